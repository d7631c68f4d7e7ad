"""n_cpu_moe: a mixture of experts on an inference GPU smaller than its GGUF (llama.cpp's --n-cpu-moe). The planner's
sizing on Qwen3-30B-A3B's shape (examples/models/qwen3-30b-a3b), the one message a value that cannot fit gets at plan,
verify's sizing from a GGUF's tensors, and the setting on llama-server's and llama-cpp-python's side. The tiny MoE
pipeline that runs with it is tests/test_moe.py's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.constants import BITS_PER_WEIGHT
from loraship.errors import ConfigError, LorashipError
from loraship.planning import expert_offload
from loraship.planning import inference_memory as im
from loraship.planning.shape import shape_from_config
from loraship.planning.shipping import plan_disk_and_inference
from tests.conftest import REPO, demo_config_dict

QWEN3_30B_A3B = REPO / "examples" / "models" / "qwen3-30b-a3b"
QWEN2_7B = REPO / "examples" / "models" / "qwen2-7b"
GIB = 2**30


def _plan(model: Path, **more) -> dict:
    config = parse_config(demo_config_dict(model, Path("/nonexistent"), **more))
    shape = shape_from_config(json.loads((model / "config.json").read_text()))
    return plan_disk_and_inference(shape, config)["inference"]


@pytest.mark.parametrize("target", [8, 12])
def test_plan_sizes_n_cpu_moe_for_qwen3_30b_a3b(target):
    """The smallest n_cpu_moe that fits, counted here from the config's own shape: 48 layers of 128 experts, each
    gate, up (2048 -> 768) and down (768 -> 2048), at Q4_K_M's bits per weight."""
    inf = _plan(QWEN3_30B_A3B, target_gpu_memory_gib=target)
    experts = inf["experts"]
    layer = 128 * 3 * 2048 * 768 * BITS_PER_WEIGHT["Q4_K_M"] / 8
    whole = experts["all_on_gpu_total_gib"] * GIB
    assert whole / GIB > target  # the GGUF alone does not fit: that is why experts go to CPU memory
    # k layers' experts in CPU memory, one of them copied back for batched prompts.
    need = [whole - k * layer + (layer if k else 0) for k in range(49)]
    expected = next(k for k in range(49) if need[k] <= target * GIB + 0.01 * GIB)
    assert experts["n_cpu_moe"] == expected and 0 < expected < 48
    assert need[expected - 1] > target * GIB
    assert inf["fits_target"] and inf["total_gib"] <= target
    assert experts["experts_in_cpu_memory_gib"] == pytest.approx(expected * layer / GIB, abs=0.01)
    # Every layer stays on the GPU: the GGUF less the experts in CPU memory (plus one layer's copy) is the weights.
    q = inf["by_quantization"]["Q4_K_M"]
    assert q["gpu_weights_gib"] == pytest.approx(inf["gguf_gib"] - (expected - 1) * layer / GIB, abs=0.02)
    speed = experts["tokens_per_s"]
    assert 0 < speed["with_n_cpu_moe"] < speed["all_on_gpu"] and "not a measurement" in speed["note"]


def test_a_larger_target_keeps_fewer_experts_in_cpu_memory_and_is_faster():
    small, large = _plan(QWEN3_30B_A3B, target_gpu_memory_gib=8), _plan(QWEN3_30B_A3B, target_gpu_memory_gib=12)
    assert large["experts"]["n_cpu_moe"] < small["experts"]["n_cpu_moe"]
    assert large["experts"]["tokens_per_s"]["with_n_cpu_moe"] > small["experts"]["tokens_per_s"]["with_n_cpu_moe"]
    roomy = _plan(QWEN3_30B_A3B, target_gpu_memory_gib=24)["experts"]
    assert roomy["n_cpu_moe"] == 0 and roomy["tokens_per_s"]["with_n_cpu_moe"] == roomy["tokens_per_s"]["all_on_gpu"]


def test_a_set_n_cpu_moe_that_fits_is_kept_and_a_dense_plan_has_none():
    inf = _plan(QWEN3_30B_A3B, target_gpu_memory_gib=8, n_cpu_moe=40)
    assert inf["experts"]["n_cpu_moe"] == 40 and inf["experts"]["n_cpu_moe_setting"] == 40 and inf["fits_target"]
    dense = _plan(QWEN2_7B)
    assert "experts" not in dense and "n_cpu_moe" not in dense["by_quantization"]["Q4_K_M"]


def test_plan_prints_n_cpu_moe_and_the_speed_both_ways(tmp_path):
    from rich.console import Console

    from loraship.plan_report import render_plan
    from loraship.planning.multi_gpu import plan_on_gpus

    config = parse_config(demo_config_dict(QWEN3_30B_A3B, tmp_path, target_gpu_memory_gib=8, adapter="qlora"))
    shape = shape_from_config(json.loads((QWEN3_30B_A3B / "config.json").read_text()))
    footprint = plan_disk_and_inference(shape, config)
    console = Console(width=400, record=True)
    console.print(render_plan(plan_on_gpus(shape, config), footprint))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    k = footprint["inference"]["experts"]["n_cpu_moe"]
    assert f"n_cpu_moe {k} (auto; every expert on the GPU would need 18.27)" in text
    speed = footprint["inference"]["experts"]["tokens_per_s"]
    assert f"all on the GPU {speed['all_on_gpu']:g}, with n_cpu_moe {k} {speed['with_n_cpu_moe']:g}" in text
    assert "not a measurement" in text and "fits the 8 GiB target │ yes" in text


# -- bad input: one message at plan, naming what fits --------------------------------------------------------------
@pytest.mark.parametrize(
    "model, more, message",
    [
        (
            QWEN3_30B_A3B,
            {"n_cpu_moe": 2, "target_gpu_memory_gib": 8},
            r"^n_cpu_moe 2: the Q4_K_M GGUF needs about 17\.\d\d GiB on the GPU at target_context 512 with the "
            r"experts of its first 2 layers in CPU memory, more than target_gpu_memory_gib 8; the smallest n_cpu_moe "
            r"that fits is 32 \(or set n_cpu_moe: auto\)$",
        ),
        (
            QWEN3_30B_A3B,
            {"n_cpu_moe": 48, "target_gpu_memory_gib": 2},
            r"^n_cpu_moe 48: the Q4_K_M GGUF needs about 2\.24 GiB on the GPU at target_context 512 with every "
            r"expert in CPU memory, more than target_gpu_memory_gib 2; raise target_gpu_memory_gib to 2\.5, or "
            r"lower target_context$",
        ),
        (
            QWEN3_30B_A3B,
            {"n_cpu_moe": 10, "target_gpu_memory_gib": 2.1},
            r"^n_cpu_moe 10: the Q4_K_M GGUF needs about \d+\.\d\d GiB .* with the experts of its first 10 layers in "
            r"CPU memory, and even with every expert there \(n_cpu_moe 48\) about 2\.24 GiB, more than "
            r"target_gpu_memory_gib 2\.1; raise target_gpu_memory_gib to 2\.5, or a smaller quantization \(Q3_K_M "
            r"fits with n_cpu_moe auto\), or lower target_context$",
        ),
        (
            QWEN3_30B_A3B,
            {"n_cpu_moe": 49},
            r"^n_cpu_moe 49: the model has 48 layers; at most 48 \(every expert in CPU memory\), or auto$",
        ),
        (
            QWEN2_7B,
            {"n_cpu_moe": 4},
            r"^n_cpu_moe 4: the base model is no mixture of experts \(no routed experts to keep in CPU memory\); "
            r"remove n_cpu_moe or set it to auto$",
        ),
        (
            QWEN2_7B,
            {"n_cpu_moe": 0},
            r"^n_cpu_moe 0: the base model is no mixture of experts",
        ),
    ],
)
def test_plan_refuses_an_n_cpu_moe_that_cannot_fit(model, more, message):
    from loraship.planning.preflight import target_gpu_problems

    with pytest.raises(ConfigError) as raised:
        _plan(model, **more)
    assert len(raised.value.problems) == 1 and re.search(message, raised.value.problems[0])
    # The plan stage's input checks (loraship plan without --memory-only) say the same, once.
    config = parse_config(demo_config_dict(model, Path("/nonexistent"), **more))
    (problem,) = target_gpu_problems(config, model)
    assert problem == raised.value.problems[0]


@pytest.mark.parametrize("value", [-1, "all", True, 2.5])
def test_config_refuses_an_n_cpu_moe_that_is_not_a_count(value):
    with pytest.raises(ConfigError, match=r"n_cpu_moe.*must be 'auto' or a whole number of layers >= 0"):
        parse_config(demo_config_dict(QWEN3_30B_A3B, Path("/nonexistent"), n_cpu_moe=value))


def test_a_moe_that_fits_with_its_experts_in_cpu_memory_passes_the_weights_check():
    """The input checks refuse a GGUF whose weights alone exceed the target; a mixture of experts' weights on the
    GPU are those n_cpu_moe leaves there."""
    from loraship.planning.preflight import target_gpu_problems

    config = parse_config(demo_config_dict(QWEN3_30B_A3B, Path("/nonexistent"), target_gpu_memory_gib=8))
    assert target_gpu_problems(config, QWEN3_30B_A3B) == []


# -- verify: sized from the GGUF's own tensors ---------------------------------------------------------------------
MIB = 2**20


def _moe_layout(n_layers=8, experts_mib=400, rest_mib=40):
    return im.GGUFLayout(
        n_layers=n_layers,
        layer_bytes=[(experts_mib + rest_mib) * MIB] * n_layers,
        output_bytes=300 * MIB,
        cpu_bytes=300 * MIB,
        n_embd=2048,
        n_embd_kv=512,
        n_head=32,
        n_ff=6144,
        n_vocab=151936,
        n_ctx_train=40960,
        expert_bytes=[experts_mib * MIB] * n_layers,
        n_expert=128,
        n_expert_used=8,
    )


def _verify_config(**more):
    return parse_config(demo_config_dict(QWEN3_30B_A3B, Path("/nonexistent"), **more))


def test_verify_sizes_n_cpu_moe_from_the_gguf():
    from loraship.verification.device import memory_plan

    layout = _moe_layout()
    config = _verify_config(target_gpu_memory_gib=3, target_context=512)
    plan = memory_plan(layout, config)
    k = plan["n_cpu_moe"]
    assert plan["fits"] and 0 < k < layout.n_layers
    assert im.predict_gpu(layout, 512, None, k - 1)["total_gib"] > 3 >= plan["predicted"]["total_gib"]
    # All layers on the GPU, the first k blocks' experts in CPU memory, one block's copy back on the GPU.
    assert plan["predicted"]["n_gpu_layers"] == layout.n_layers + 1
    saved = im.predict_gpu(layout, 512)["weights_gib"] - plan["predicted"]["weights_gib"]
    assert saved == pytest.approx((k - 1) * 400 / 1024, abs=0.002)
    assert plan["tokens_per_s"]["with_n_cpu_moe"] < plan["tokens_per_s"]["all_on_gpu"]
    # The config's own value is used as it is; a dense GGUF refuses one.
    assert (
        memory_plan(layout, _verify_config(target_gpu_memory_gib=3, target_context=512, n_cpu_moe=7))["n_cpu_moe"] == 7
    )
    dense = im.GGUFLayout(**{**layout.__dict__, "expert_bytes": [], "n_expert": 0, "n_expert_used": 0})
    assert "n_cpu_moe" not in memory_plan(dense, _verify_config(target_gpu_memory_gib=8, target_context=512))
    with pytest.raises(LorashipError, match=r"n_cpu_moe 2: this GGUF has no routed-expert tensors"):
        memory_plan(dense, _verify_config(target_gpu_memory_gib=8, n_cpu_moe=2))


def test_verify_passes_n_cpu_moe_on_the_cpu_too():
    import loraship.stages.verify as verify
    from loraship.verification.device import memory_plan

    config = _verify_config(target_gpu_memory_gib=3, target_context=512, n_cpu_moe=3)
    reference = {"eval": [{"input_ids": [1] * 20}], "golden": [{"prompt_ids": [1] * 5}]}
    load = verify.load_settings(config, reference, memory_plan(_moe_layout(), config), "cpu")
    assert load["n_gpu_layers"] == 0 and load["n_cpu_moe"] == 3


# -- llama.cpp's side ------------------------------------------------------------------------------------------------
def test_block_patterns_are_llama_cpp_n_cpu_moe():
    from loraship.llamacpp.cpu_moe import block_patterns

    patterns = block_patterns(2)
    assert patterns == [rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps" for i in (0, 1)]
    hit = lambda name: any(re.search(p, name) for p in patterns)  # noqa: E731
    assert hit("blk.0.ffn_gate_exps.weight") and hit("blk.1.ffn_down_exps.weight") and hit("blk.1.ffn_up_exps.weight")
    assert not hit("blk.10.ffn_up_exps.weight") and not hit("blk.2.ffn_up_exps.weight")
    assert not hit("blk.0.ffn_gate_inp.weight") and not hit("blk.0.ffn_up_shexp.weight")
    # verify's count of expert bytes reads the same tensors.
    assert im.EXPERT_TENSOR.match("blk.0.ffn_gate_exps.weight") and not im.EXPERT_TENSOR.match("blk.0.ffn_up_shexp")


def test_served_command_carries_n_cpu_moe(tmp_path, monkeypatch):
    import sys

    from loraship.llamacpp import cpu_moe, served

    cmd = served.server_command(tmp_path / "m.gguf", 8000, 512, -1, 2, None, 5)
    assert cmd[1:3] == ["-m", "loraship.llamacpp.cpu_moe"] and cmd[cmd.index("--n-cpu-moe") + 1] == "5"
    plain = served.server_command(tmp_path / "m.gguf", 8000, 512, -1, 2)
    assert plain[1:3] == ["-m", "llama_cpp.server"] and "--n-cpu-moe" not in plain
    # The launcher takes the flag off before llama-cpp-python's server parses the rest, and sets the experts first.
    seen = {}
    monkeypatch.setattr(cpu_moe, "keep_experts_in_cpu_memory", lambda n: seen.setdefault("n", n))
    import llama_cpp.server.__main__ as server_main

    monkeypatch.setattr(server_main, "main", lambda: seen.setdefault("argv", list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    cpu_moe.serve(cmd[3:])
    assert seen["n"] == 5 and "--n-cpu-moe" not in seen["argv"] and "--n_gpu_layers" in seen["argv"]


def test_card_and_modelfile_carry_n_cpu_moe(tmp_path):
    from loraship.llamacpp.ollama import modelfile
    from loraship.publishing.model_card import experts_note, serve_commands

    config = _verify_config()
    speed = {"all_on_gpu": 150.0, "with_n_cpu_moe": 60.0, "note": expert_offload.SPEED_NOTE}
    verify = {"n_cpu_moe": 32, "memory": {"fits": True, "n_cpu_moe": 32, "tokens_per_s": speed}}
    commands = serve_commands(config, verify)
    assert " --n-cpu-moe 32 " in commands["llama_server"] and " -ngl 999 " in commands["llama_server"]
    note = experts_note(32, verify)
    assert "`--n-cpu-moe 32`" in note and "60 tokens/s" in note and "Modelfile has no parameter" in note
    text = modelfile("model-Q4_K_M.gguf", {}, [], 512, n_cpu_moe=32)
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert comments and "--n-cpu-moe 32" in " ".join(comments)
    assert not any("cpu_moe" in line for line in text.splitlines() if not line.startswith("#"))
    assert "--n-cpu-moe" not in serve_commands(config, {"memory": {"fits": True}})["llama_server"]
    assert not modelfile("model-Q4_K_M.gguf", {}, [], 512).startswith("#")
