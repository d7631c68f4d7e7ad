"""llama.cpp's tensor types per quantization (loraship/llamacpp/quant_mix.py) on the real Gemma 3 270M, whose rows
of 640 fall back from the K-quants; the way out a failed verify names (loraship/verification/way_out.py); plan's
warnings for such shapes and for a base model already on a ggml grid (loraship/planning/base_grid.py).

The packaged google/gemma-3-270m GGUF is llama.cpp's own Q4_K_M of the real model, so it is the reference for the
predicted types and sizes (bench/README.md: why Q4_K_M loses a Gemma 3 270M fine-tune)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def packaged():
    from loraship.fixtures.families import gemma3_gguf

    return gemma3_gguf()


def test_predicted_types_are_llama_quantizes_on_the_real_gemma3(packaged):
    """Every tensor's type in llama.cpp's own Q4_K_M of Gemma 3 270M is the predicted one, and so is the file size:
    90 of its 127 quantized tensors fell back from Q4_K / Q6_K (rows of 640), to Q5_0 and Q8_0."""
    from loraship.llamacpp.gguf_info import open_gguf

    from loraship.llamacpp.quant_mix import gguf_tensors, summarize, tensor_types
    from loraship.verification.way_out import estimated_bytes

    tensors, n_layer, n_gqa = gguf_tensors(packaged)
    assert (n_layer, n_gqa) == (18, 4)
    predicted = tensor_types(tensors, "Q4_K_M", n_layer, n_gqa)
    actual = {t.name: t.tensor_type.name for t in open_gguf(packaged).tensors}
    assert {t.name: t.got for t in predicted if t.got} == {n: ty for n, ty in actual.items() if ty != "F32"}
    mix = summarize(predicted, "Q4_K_M")
    assert (mix.quantized, mix.fell_back, mix.fallback_types, mix.rows) == (127, 90, ("Q5_0", "Q8_0"), (640,))
    assert sum(t.got == "Q5_0" for t in predicted) == 81
    assert estimated_bytes(packaged, ["Q4_K_M"]) == {"Q4_K_M": packaged.stat().st_size}


@pytest.mark.parametrize(
    "rung, fallback, falls_back",
    [
        ("IQ3_M", ("IQ4_NL", "Q5_0"), 90),  # q/k/gate/up IQ3_S -> IQ4_NL, attn_v Q4_K -> Q5_0
        ("IQ4_XS", ("IQ4_NL", "Q5_1"), 90),  # attn_v Q5_K (4 heads per KV head) -> Q5_1
        ("Q3_K_M", ("Q4_0", "Q5_1", "Q5_0"), 90),
        ("Q5_K_M", ("Q5_1", "Q8_0"), 90),
        ("Q6_K", ("Q8_0",), 90),
        ("Q8_0", (), 0),  # blocks of 32: nothing falls back
    ],
)
def test_every_rung_falls_back_on_rows_of_640_but_q8_0(packaged, rung, fallback, falls_back):
    from loraship.llamacpp.quant_mix import gguf_tensors, summarize, tensor_types

    tensors, n_layer, n_gqa = gguf_tensors(packaged)
    mix = summarize(tensor_types(tensors, rung, n_layer, n_gqa), rung)
    assert mix.fell_back == falls_back
    assert set(mix.fallback_types) == set(fallback)


def _section(q: str, passed: bool, gguf: Path, size: int, lost_finetune: bool = False) -> dict:
    gates = {"kl_divergence_mean": {"passed": passed, "value": 0.01 if passed else 0.238, "threshold": 0.1}}
    if lost_finetune:
        gates["finetune_kept_answers"] = {"passed": False, "value": "6/10", "threshold": 0.8}
    return {"passed": passed, "gguf": str(gguf), "gguf_bytes": size, "gates": gates}


@pytest.mark.parametrize(
    "verified, expected",
    [
        # A rung of this run passed: it is named, with its size, as the one to ship.
        (
            {"Q4_K_M": False, "Q8_0": True},
            [
                "this run made Q8_0 (300 MB), which passed every gate: ship it with quantization: Q8_0",
                "Q4_K_M lost part of the fine-tune",
                "Q4_K_M: 90 of 127 quantized tensors fall back to Q5_0/Q8_0",
            ],
        ),
        # None passed: auto, and the larger rungs with their estimated sizes.
        (
            {"Q4_K_M": False},
            [
                "set quantization: auto (verify tries IQ3_M, Q3_K_M, IQ4_XS, Q4_K_M, Q5_K_M, Q6_K, Q8_0",
                "or name a larger rung: Q5_K_M (about 260 MB), Q6_K (about 283 MB), Q8_0 (about 292 MB)",
            ],
        ),
        ({"Q8_0": False}, ["set quantization: auto"]),  # nothing larger to name
    ],
)
def test_way_out_names_the_rungs(packaged, verified, expected):
    from loraship.verification.way_out import way_out

    sizes = {"Q4_K_M": 253_000_000, "Q8_0": 300_000_000}
    sections = {
        q: _section(q, ok, packaged if q == "Q4_K_M" else Path("/nonexistent.gguf"), sizes[q], lost_finetune=not ok)
        for q, ok in verified.items()
    }
    text = way_out(sections)
    for part in expected:
        assert part in text, (part, text)
    if list(verified) == ["Q8_0"]:
        assert "larger rung" not in text


# -- plan's warnings -----------------------------------------------------------------------------
# google/gemma-3-270m's config.json, the fields plan reads.
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
}


def _plan_shape():
    from loraship.planning.shape import shape_from_config

    return shape_from_config(GEMMA3_270M)


def _config(tmp_path, quantization):
    from loraship.config import parse_config
    from tests.conftest import demo_config_dict

    return parse_config(demo_config_dict(tmp_path, tmp_path, quantization=quantization))


def test_plan_predicts_the_packaged_files_types_from_config_json(packaged):
    """plan has no GGUF: the tensors it derives from config.json get the types llama.cpp gave the real file."""
    from loraship.llamacpp.gguf_info import open_gguf

    from loraship.llamacpp.quant_mix import planned_tensors, tensor_types

    s = _plan_shape()
    planned = {
        t.name: t.got for t in tensor_types(planned_tensors(s.linears(), s.L, s.h, s.V, s.tied), "Q4_K_M", 18, 4)
    }
    actual = {t.name: t.tensor_type.name for t in open_gguf(packaged).tensors if t.name in planned}
    assert planned == actual and len(planned) == 127


def _on_grid_checkpoint(folder: Path, packaged: Path) -> Path:
    """A checkpoint holding the packaged GGUF's layer-0 linears as transformers dequantizes them (bf16), beside
    weights never quantized in another layer: what a model read with gguf_file= and saved looks like."""
    import numpy as np
    import torch
    from loraship.llamacpp.gguf_info import open_gguf
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    names = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_output": "o_proj", "ffn_up": "up_proj"}
    weights = {}
    for t in open_gguf(packaged).tensors:
        role = t.name.split(".")[-2]
        if t.name.startswith("blk.0.") and role in names:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            weights[f"model.layers.0.{'mlp' if role.startswith('ffn') else 'self_attn'}.{names[role]}.weight"] = (
                torch.from_numpy(w).to(torch.bfloat16)
            )
    gen = torch.Generator().manual_seed(0)
    weights["model.layers.1.self_attn.q_proj.weight"] = (torch.randn(1024, 640, generator=gen) * 0.02).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def test_plan_tells_a_base_dequantized_from_a_gguf(tmp_path, packaged):
    """Layer 0 of a checkpoint dequantized from llama.cpp's Q4_K_M is on its Q5_0 and Q4_K grids; weights never
    quantized are on none."""
    import torch
    from safetensors.torch import save_file

    from loraship.planning.base_grid import first_layer_on_grid

    found = {g.gguf_name: g.ggml_type for g in first_layer_on_grid(_on_grid_checkpoint(tmp_path / "m", packaged))}
    assert found == {
        "blk.0.attn_q.weight": "Q5_0",
        "blk.0.attn_k.weight": "Q5_0",
        "blk.0.ffn_up.weight": "Q5_0",
        "blk.0.attn_output.weight": "Q4_K",
    }
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    gen = torch.Generator().manual_seed(1)
    save_file(
        {
            "model.layers.0.self_attn.q_proj.weight": (torch.randn(1024, 640, generator=gen) * 0.02).bfloat16(),
            "model.layers.0.self_attn.o_proj.weight": (torch.randn(640, 1024, generator=gen) * 0.02).bfloat16(),
        },
        str(fresh / "model.safetensors"),
    )
    assert first_layer_on_grid(fresh) == []
    assert first_layer_on_grid(tmp_path / "no-weights") == []


@pytest.mark.parametrize(
    "quantization, on_grid, expected",
    [
        # Rows of 640 only: the file is mostly Q5_0, larger than a Q4_K_M's name says.
        (
            ["Q4_K_M"],
            False,
            ["Q4_K_M: 90 of 127 quantized tensors fall back to Q5_0/Q8_0 (rows of 640", "quantization: auto"],
        ),
        # A base dequantized from llama.cpp's Q4_K_M: Q4_K_M puts it back on its grids; the rungs that don't are named.
        (
            ["Q4_K_M"],
            True,
            [
                "Q4_K_M: the base model's weights were quantized before",
                "Q5_0 grid",
                "rounds the fine-tune's changes",
                "set quantization: auto, or a rung that gives them another type (IQ4_XS, Q5_K_M, Q6_K, Q8_0)",
            ],
        ),
        (["Q8_0"], True, []),  # Q8_0 falls back nowhere and puts nothing back on a grid
        (["auto"], True, []),  # auto verifies each rung: nothing to warn of
    ],
)
def test_plan_warns_of_fallback_and_grid(tmp_path, packaged, quantization, on_grid, expected):
    from loraship.planning.base_grid import first_layer_on_grid
    from loraship.planning.shipping import quantization_warnings

    grid = first_layer_on_grid(_on_grid_checkpoint(tmp_path / "m", packaged)) if on_grid else []
    warnings = quantization_warnings(_plan_shape(), _config(tmp_path, quantization), grid)
    text = "\n".join(warnings)
    assert bool(warnings) == bool(expected), text
    for part in expected:
        assert part in text, (part, text)
