"""llama.cpp's tensor types per quantization (loraship/llamacpp/quant_mix.py) on the real Gemma 3 270M, whose rows
of 640 fall back from the K-quants, and the way out a failed verify names (loraship/verification/way_out.py).

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
    from gguf import GGUFReader

    from loraship.llamacpp.quant_mix import gguf_tensors, summarize, tensor_types
    from loraship.verification.way_out import estimated_bytes

    tensors, n_layer, n_gqa = gguf_tensors(packaged)
    assert (n_layer, n_gqa) == (18, 4)
    predicted = tensor_types(tensors, "Q4_K_M", n_layer, n_gqa)
    actual = {t.name: t.tensor_type.name for t in GGUFReader(packaged).tensors}
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
