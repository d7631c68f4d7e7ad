"""The train stage's steady-state tokens/s (warm-up left out) and MFU from a known FLOP count, on the CPU."""

from __future__ import annotations

import importlib

import pytest

from loraship.config import parse_config
from loraship.planning import flops
from loraship.planning.shape import shape_from_config
from tests.conftest import demo_config_dict

# A shape small enough to count by hand: h 8, 2 heads of 4 (q 8), 1 KV head (kv 4), f 16, V 32, 2 layers.
TOY = {
    "model_type": "qwen2",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 32,
    "tie_word_embeddings": False,
}


def test_steady_rate_leaves_the_warm_up_steps_out():
    train = importlib.import_module("loraship.stages.train")
    # (seconds since start, tokens so far) after each step: a 5 s first step, then 100 tokens a second.
    stamps = [(5.0, 100), (6.0, 200), (7.0, 300), (8.0, 400)]
    rate, basis = train.steady_rate(stamps, warmup=2)
    assert rate == 100.0  # (400 - 200) / (8 - 6): steps 3 and 4 only
    assert "steps 3-4" in basis and "warm-up" in basis
    assert 400 / 8 < rate  # the whole run's rate, warm-up included, is lower
    assert train.steady_rate(stamps[:2], warmup=2)[0] is None  # nothing left after the warm-up
    assert "warm-up" in train.steady_rate(stamps[:2], warmup=2)[1]


def test_flops_per_token_counts_each_term(tmp_path):
    cfg = parse_config(demo_config_dict(tmp_path, tmp_path, lora_r=2, lora_target_modules=["q_proj", "v_proj"]))
    # Frozen matmuls per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate, up 8x16 + down 16x8 = 64+32+32+64+384 = 576;
    # two layers plus lm_head 32 x 8: 1,408 parameters at 4 FLOPs each (forward 2, input gradient 2).
    frozen = 4 * (2 * 576 + 256)
    lora = 6 * 2 * 2 * ((8 + 8) + (8 + 4))  # r x (in + out) per module, q and v, two layers, 6 FLOPs each
    attention = 2 * 6 * 8 * 10  # 6 x q x n per layer at attention length 10
    assert flops.train_flops_per_token(TOY, cfg, 10) == frozen + lora + attention
    assert flops.attention_length([10, 10]) == 10 and flops.attention_length([2, 6]) == (4 + 36) / 8
    # A layer's forward: frozen 2, LoRA 2 per parameter, attention 2 x q x n. A checkpointed Qwen2 layer's recompute
    # is that less down_proj's 16 x 8 GEMM, whose output nothing reads (loraship/training/recompute.py).
    forward = 2 * 576 + 2 * 2 * ((8 + 8) + (8 + 4)) + 2 * 8 * 10
    assert flops.forward_flops_per_layer_token(TOY, cfg, 10) == forward
    assert flops.recompute_flops_per_layer_token(TOY, cfg, 10) == forward - 2 * 16 * 8
    # down_proj adapted too: its LoRA B product (r x 8) is skipped with it; A's (16 x r) is not (B's gradient
    # needs it).
    all_linear = parse_config(demo_config_dict(tmp_path, tmp_path, lora_r=2, lora_target_modules="all-linear"))
    assert (
        flops.forward_flops_per_layer_token(TOY, all_linear, 10)
        - flops.recompute_flops_per_layer_token(TOY, all_linear, 10)
    ) == 2 * (16 * 8 + 2 * 8)
    # Gemma 2 style: every other layer attends to a sliding window of 4 keys at most. Its MLP output goes through a
    # norm that keeps it, so its recompute is the whole forward again.
    # head_dim given: Gemma2Config's default is 256, whatever hidden / heads is.
    sliding = {
        **TOY,
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "sliding_window": 4,
        "head_dim": 4,
    }
    s = shape_from_config(sliding)
    assert s.sliding_layers == 1
    assert flops.recompute_flops_per_layer_token(sliding, cfg, 10) == pytest.approx(
        2 * s.layer_linear_params + 2 * 2 * ((8 + 8) + (8 + 4)) + 2 * s.q * (10 + 4) / 2
    )


# One small config of each family whose decoder layer the planner reads (model_type, extra keys).
FAMILY_CONFIGS = {
    "llama": {},
    "qwen2": {},
    "mistral": {},
    "phi3": {},
    "qwen3": {"head_dim": 4},
    "olmo2": {},
    "granite": {"residual_multiplier": 0.22},
    "gemma2": {"head_dim": 4},
    "gemma3_text": {"head_dim": 4},
}


@pytest.mark.parametrize("mt", sorted(FAMILY_CONFIGS))
def test_the_planner_skips_down_proj_in_the_recompute_where_the_train_stage_does(mt):
    """Shape.recompute_skips_down, read off each layer class's forward (it returns `residual + mlp(x)` and the MLP
    returns down_proj's output, a dropout or a float multiplier at most between), holds for exactly the layer classes
    loraship/training/recompute.py marks: Granite's among them, not Gemma's nor OLMo 2's (a norm after the MLP)."""
    from loraship.training.recompute import LAYERS_ENDING_IN_DOWN_PROJ

    s = shape_from_config({**TOY, "model_type": mt, **FAMILY_CONFIGS[mt]})
    assert s.recompute_skips_down == (s.layer_class in LAYERS_ENDING_IN_DOWN_PROJ), s.layer_class


def test_mfu_against_the_card_peak_or_none_with_a_reason():
    value, basis = flops.mfu(10_000, 30e9, "NVIDIA H200")
    assert value == round(10_000 * 30e9 / 989.4e12, 4) and "989" in basis
    assert (
        flops.bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
        and flops.bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    )
    value, basis = flops.mfu(10_000, 30e9, None)
    assert value is None and "no bf16 peak" in basis
    assert flops.mfu(None, 30e9, "NVIDIA H200")[0] is None


def test_train_manifest_reports_steady_tokens_per_s_and_mfu_on_the_cpu(tiny_model, tmp_path):
    config = parse_config(
        demo_config_dict(
            tiny_model, tmp_path, run_name="mfu", max_steps=4, warmup_steps=0, save_steps=1000, device="cpu"
        )
    )
    for stage in ("plan", "train"):
        manifest = importlib.import_module(f"loraship.stages.{stage}").run(config)
    metrics = manifest["metrics"]
    assert metrics["tokens_per_s"] > 0 and "steps 3-4" in metrics["tokens_per_s_basis"]
    assert metrics["tokens_per_s_overall"] > 0
    assert metrics["flops_per_token"] > 0
    assert metrics["mfu"] is None and "no bf16 peak" in metrics["mfu_basis"]  # a CPU: no peak to divide by
    # The step loop ran with setup frozen out of the collector's scans (loraship/training/gc_pauses.py), timed.
    assert metrics["python_gc"]["setup_frozen"] is True and metrics["python_gc"]["seconds"] >= 0


@pytest.mark.parametrize("name", ["qwen2-7b", "qwen2-14b", "llama-3-8b", "mistral-7b", "qwen3-8b", "gemma-3-12b"])
def test_every_shipped_shape_has_a_flop_count(name, tmp_path):
    import json
    from pathlib import Path

    mc = json.loads((Path(__file__).resolve().parents[1] / "examples" / "models" / name / "config.json").read_text())
    cfg = parse_config(demo_config_dict(tmp_path, tmp_path))
    per_token = flops.train_flops_per_token(mc, cfg, 4096)
    assert 20e9 < per_token < 80e9  # about 4 x 7-14 B parameters plus attention
