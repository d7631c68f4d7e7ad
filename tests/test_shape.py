"""The planner's Shape, read from transformers' own model class (loraship/planning/shape.py): the same fields as the
hand-written parser it replaced for the five families that parser knew, the newer families planned, and every kind of
config.json that is no decoder-only causal LM refused at plan naming the class and the fix."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loraship.config import Config
from loraship.planning.shape import Shape, shape_from_config
from loraship.planning.shipping import plan_disk_and_inference
from loraship.planning.strategy import plan_training
from loraship.planning.shape import UnsupportedModel
from tests.test_memory import (
    GEMMA2_2B,
    GEMMA2_9B,
    LLAMA3_8B,
    MISTRAL_7B,
    PHI3_MEDIUM,
    PHI3_MINI,
    QWEN2_05B,
    QWEN2_7B,
    QWEN2_14B,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "models"
OLD_SUPPORTED = ("llama", "qwen2", "mistral", "gemma2", "phi3")


def old_parse(mc: dict) -> dict:
    """The hand-written parser the planner had before it read the model class (shape_from_config as it was),
    kept as the oracle: its fields, for the families it knew."""
    if "text_config" in mc and "hidden_size" not in mc:
        mc = {**mc["text_config"], "model_type": mc["text_config"].get("model_type", mc.get("model_type"))}
    mt = mc.get("model_type", "")
    heads = int(mc["num_attention_heads"])
    L = int(mc["num_hidden_layers"])
    gemma2 = mt == "gemma2"
    window = mc.get("sliding_window") if gemma2 else None
    if gemma2:
        types = mc.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
        sliding = sum(t == "sliding_attention" for t in types) if window else 0
    else:
        sliding = 0
    return dict(
        model_type=mt,
        h=int(mc["hidden_size"]),
        L=L,
        heads=heads,
        kv_heads=int(mc.get("num_key_value_heads") or heads),
        head_dim=int(mc.get("head_dim") or mc["hidden_size"] // heads),
        f=int(mc["intermediate_size"]),
        V=int(mc["vocab_size"]),
        tied=bool(mc.get("tie_word_embeddings", gemma2)),
        qkv_bias=bool(mc.get("attention_bias", mt == "qwen2")),
        fused=mt == "phi3",
        norms=4 if gemma2 else 2,
        attn_softcap=gemma2 and mc.get("attn_logit_softcapping", 50.0) is not None,
        final_softcap=gemma2 and mc.get("final_logit_softcapping", 30.0) is not None,
        sliding_window=int(window) if window else None,
        sliding_layers=sliding,
    )


def _examples() -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(EXAMPLES.glob("*/config.json"))}


def _fixture_families() -> dict[str, dict]:
    pytest.importorskip("transformers")
    from loraship.fixtures.families import FAMILIES, model_config

    out = {}
    for name, family in FAMILIES.items():
        try:
            out[f"family-{name}"] = model_config(family).to_dict()
        except KeyError:  # a family model_config does not build (another helper's addition): not the oracle's
            continue
    return out


KNOWN = {
    "qwen2-0.5b": QWEN2_05B,
    "qwen2-7b": QWEN2_7B,
    "qwen2-14b": QWEN2_14B,
    "llama-3-8b": LLAMA3_8B,
    "mistral-7b": MISTRAL_7B,
    "gemma-2-2b": GEMMA2_2B,
    "gemma-2-9b": GEMMA2_9B,
    "phi-3-mini": PHI3_MINI,
    "phi-3-medium": PHI3_MEDIUM,
    "gemma-2-no-window": {**GEMMA2_2B, "sliding_window": None},
    "gemma-2-no-caps": {**GEMMA2_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "gemma-2-all-full": {**GEMMA2_2B, "layer_types": ["full_attention"] * 26},
    "mistral-head-dim-64": {**MISTRAL_7B, "head_dim": 64},
}


def test_the_model_class_gives_the_hand_parsers_fields_for_the_families_it_knew():
    configs = {**KNOWN, **_examples(), **_fixture_families()}
    compared = 0
    for name, mc in configs.items():
        if (mc.get("text_config") or mc).get("model_type") not in OLD_SUPPORTED:
            continue
        s = shape_from_config(mc)
        old = old_parse(mc)
        assert {k: getattr(s, k) for k in old} == old, name
        # linears() and n_params as the old Shape computed them from those fields
        hand = Shape(**old)
        assert s.linears() == hand.linears(), name
        assert list(s.linears()) == list(hand.linears()), name
        assert s.n_params == hand.n_params, name
        assert not s.qk_norm and s.other_params == 0, name
        compared += 1
    assert compared >= 14  # the table above and the four shipped examples at least


def test_structure_replaces_the_model_type_lists():
    """SwiGLU with a separate down_proj, fused projections and a layer ending in `residual + down_proj` are read off
    the classes: the same answer the old model_type tuples gave, and one the train stage's recompute agrees with
    (loraship/training/recompute.py marks layer classes)."""
    from loraship.training.recompute import LAYERS_ENDING_IN_DOWN_PROJ

    for mc, swiglu_down, fused, skips in (
        (QWEN2_7B, True, False, True),
        (LLAMA3_8B, True, False, True),
        (MISTRAL_7B, True, False, True),
        (GEMMA2_2B, False, False, False),
        (PHI3_MINI, False, True, True),
    ):
        s = shape_from_config(mc)
        assert (s.swiglu_down, s.fused, s.recompute_skips_down) == (swiglu_down, fused, skips), mc["model_type"]
        assert s.recompute_skips_down == (s.layer_class in LAYERS_ENDING_IN_DOWN_PROJ), s.layer_class
    # Where the hand parser read a key the class ignores, the class wins: Qwen2Attention's q, k, v always have biases.
    assert shape_from_config({**QWEN2_7B, "attention_bias": False}).qkv_bias


def test_qwen3_8b_is_planned_from_its_published_config():
    mc = json.loads((EXAMPLES / "qwen3-8b" / "config.json").read_text())
    s = shape_from_config(mc)
    assert (s.architecture, s.layer_class) == ("Qwen3ForCausalLM", "Qwen3DecoderLayer")
    assert (s.h, s.L, s.heads, s.kv_heads, s.head_dim, s.f, s.V) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert s.qk_norm and s.norms == 2 and not s.tied and not s.qkv_bias and s.sliding_layers == 0
    assert s.swiglu_down and s.recompute_skips_down and s.max_positions == 40960
    assert s.n_params / 1e9 == pytest.approx(8.19, abs=0.01)  # Qwen3-8B: 8.2B
    _plans_sanely(mc, s)


def test_gemma3_12b_plans_its_language_model_out_of_the_multimodal_config():
    mc = json.loads((EXAMPLES / "gemma-3-12b" / "config.json").read_text())
    s = shape_from_config(mc)
    assert s.wrapper == "Gemma3ForConditionalGeneration" and s.architecture == "Gemma3ForCausalLM"
    assert (s.h, s.L, s.heads, s.kv_heads, s.head_dim, s.f, s.V) == (3840, 48, 16, 8, 256, 15360, 262208)
    assert s.tied and s.qk_norm and s.norms == 4 and s.mlp == "geglu"
    assert not s.attn_softcap and not s.final_softcap  # SDPA, not Gemma 2's eager attention
    assert (s.sliding_window, s.sliding_layers) == (1024, 40)  # 5 sliding : 1 global
    assert s.rope_scaling == "linear" and not s.recompute_skips_down and not s.swiglu_down
    assert s.n_params / 1e9 == pytest.approx(11.77, abs=0.01)  # the text model, its 262k embedding once (tied)
    assert 0.3e9 < s.other_params < 0.5e9  # the SigLIP vision tower and projector: loaded, frozen, not trained
    assert any(
        "vision tower (model.vision_tower, model.multi_modal_projector: loaded frozen, no LoRA) is not trained" in n
        for n in s.notes
    )
    assert s.untrained_modules == ("model.vision_tower", "model.multi_modal_projector")
    plan = _plans_sanely(mc, s)
    assert plan["model"]["wrapper"] == "Gemma3ForConditionalGeneration"
    assert "is not trained" in plan["model"]["notes"][0]
    assert plan["model"]["untrained_modules"] == ["model.vision_tower", "model.multi_modal_projector"]


def _plans_sanely(mc: dict, s) -> dict:
    cfg = Config(
        base_model="org/model",
        datasets=[{"path": "d.jsonl", "type": "completion"}],
        gpu_memory_gib=80,
        sequence_len=2048,
        lora_target_modules="all-linear",
        fused_loss="on",
    )
    plan = plan_training(shape_from_config(mc), cfg)
    comps = plan["memory"]["components_gib"]
    # bf16 LoRA on 80 GiB: the frozen weights are the model's bf16 parameters (a vision tower's included)
    assert plan["strategy"]["adapter"] == "lora" and plan["fits"]
    assert comps["frozen_weights"] == pytest.approx(2 * (s.n_params + s.other_params) / 2**30, rel=1e-3)
    assert 0 < comps["lora_weights"] < 1 and 0 < comps["logits_and_cross_entropy"] < 2
    assert plan["model"]["class"] == s.architecture
    disk = plan_disk_and_inference(shape_from_config(mc), cfg)
    assert disk["inference"]["gguf_gib"] < disk["disk_gib"]["merge"]
    return plan


def test_gemma3_layers_are_sliding_except_every_sixth():
    s = shape_from_config(
        {
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "vocab_size": 262144,
            "sliding_window": 512,
        }
    )
    assert (s.sliding_window, s.sliding_layers, s.tied) == (512, 15, True)  # Gemma 3 270M's shape


def _llama(**kw) -> dict:
    return {**LLAMA3_8B, "architectures": ["LlamaForCausalLM"], **kw}


@pytest.mark.parametrize(
    "mc,words",
    [
        (
            _llama(model_type="nosuchmodel"),
            [r"model_type 'nosuchmodel' is not known to the installed transformers \d", "fix: upgrade transformers"],
        ),
        (
            {
                "architectures": ["BertForMaskedLM"],
                "model_type": "bert",
                "hidden_size": 768,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "intermediate_size": 3072,
                "vocab_size": 30522,
            },
            ["BertForMaskedLM is an encoder", "fix: use a decoder-only base model"],
        ),
        (
            {
                "model_type": "bert",
                "hidden_size": 768,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "intermediate_size": 3072,
                "vocab_size": 30522,
            },
            ["bert.* is an encoder", "fix: use a decoder-only"],
        ),
        (
            {
                "architectures": ["T5ForConditionalGeneration"],
                "model_type": "t5",
                "d_model": 512,
                "d_ff": 2048,
                "num_layers": 6,
                "num_heads": 8,
                "vocab_size": 32128,
                "is_encoder_decoder": True,
            },
            ["T5ForConditionalGeneration is an encoder-decoder model", "fix: use a decoder-only base model"],
        ),
        (
            _llama(architectures=["FancyLlamaForCausalLM"]),
            [
                r"architecture FancyLlamaForCausalLM is not in the llama.cpp converter's registry "
                r".*llama-cpp-python==",
                "fix: pick a base model whose architecture the converter registers",
            ],
        ),
        ({"model_type": "llama", "hidden_size": 4096}, ["lacks num_hidden_layers, num_attention_heads", "fix: pass"]),
    ],
)
def test_what_is_no_supported_decoder_only_lm_is_refused_naming_the_class_and_the_fix(mc, words):
    from loraship.llamacpp.llamacpp import converter_dir

    converter_dir()  # the pinned converter's registry, fetched like `make venv` does
    with pytest.raises(UnsupportedModel) as e:
        shape_from_config(mc)
    for w in words:
        assert __import__("re").search(w, str(e.value)), (w, str(e.value))
    cfg = Config(base_model="org/model", datasets=[{"path": "d.jsonl", "type": "completion"}])
    with pytest.raises(ValueError):  # what `loraship plan` and the plan stage catch and name as a config.json error
        plan_training(shape_from_config(mc), cfg)


def test_the_converter_registry_lists_the_new_families():
    from loraship.llamacpp.llamacpp import supported_architectures

    registered = supported_architectures()
    for arch in (
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Olmo2ForCausalLM",
        "GraniteForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
    ):
        assert arch in registered, arch
    assert "SiglipVisionModel" not in registered  # a vision tower converts to an mmproj file only, not a text GGUF


def test_shape_from_config_is_cached_and_timed(capsys):
    mc = json.loads((EXAMPLES / "qwen3-8b" / "config.json").read_text())
    mc = {**mc, "rms_norm_eps": 1.01e-6}  # a config not built before in this process
    start = time.perf_counter()
    first = shape_from_config(mc)
    built = time.perf_counter() - start
    start = time.perf_counter()
    assert shape_from_config(dict(mc)) is first
    cached = time.perf_counter() - start
    with capsys.disabled():
        print(f"\nshape_from_config(Qwen3-8B): {built:.3f} s built on the meta device, {cached * 1e6:.0f} us cached")
