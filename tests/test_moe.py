"""Mixture of experts end to end on the CPU: a tiny random Qwen3-MoE (8 experts, 2 routed per token, 2 layers; Qwen3's
real tokenizer, loraship/fixtures/families.py) trained with QLoRA on every routed expert, merged, converted, quantized
and verified; the checks that stop a run whose experts would ship untrained or in 16 bits; the planner's count of
expert weights and expert LoRA on Qwen3-30B-A3B's config (examples/models/qwen3-30b-a3b)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from loraship.config import parse_config
from loraship.errors import LorashipError
from loraship.fixtures.families import FAMILIES
from loraship.runtime.stage import stage_dir
from tests.conftest import REPO, SMALL_IMATRIX, demo_config_dict, family_model

MOE = "qwen3-moe"
QWEN3_30B_A3B = REPO / "examples" / "models" / "qwen3-30b-a3b"


@pytest.fixture(scope="module")
def moe_model() -> Path:
    return family_model(MOE)


@pytest.fixture(scope="module")
def moe_run(moe_model, tmp_path_factory):
    """The whole pipeline under QLoRA with lora_target_modules: all-linear (the served check included), the experts of
    the first layer kept in CPU memory (n_cpu_moe 1: llama.cpp's --n-cpu-moe, on the CPU too)."""
    from tests.test_families import run_family

    root = tmp_path_factory.mktemp("moe-qlora")
    return run_family(
        moe_model,
        FAMILIES[MOE],
        root,
        "moe-qlora",
        adapter="qlora",
        lora_target_modules="all-linear",
        n_cpu_moe=1,
        **SMALL_IMATRIX,
    )


def test_qlora_trains_every_routed_expert_and_ships_them(moe_run):
    config, manifests, verify = moe_run
    train = json.loads((stage_dir(config, "train") / "train_metrics.json").read_text())
    assert train["strategy"]["adapter"] == "qlora"
    experts = train["expert_lora"]
    assert experts["tensors_adapted"] == experts["tensors_in_model"] == 4  # gate_up_proj, down_proj of 2 layers
    assert experts["routers_trained"] == 0
    grads = experts["first_step_gradients"]
    # 2 layers x 2 stacked tensors x 8 experts; an expert no token reached in the first step is named, not failed.
    assert grads["experts"] == 32 and grads["experts_reached"] > 0
    assert grads["experts_reached"] + len(grads["never_routed_in_first_step"]) == 32
    merge = manifests["merge"]["metrics"] if "metrics" in manifests["merge"] else manifests["merge"]
    # The Hub layout the fixture is saved in: one tensor per expert and projection (gate, up, down), 2 layers.
    assert merge["merged_expert_tensors"] == 2 * 8 * 3
    assert merge["merge_matches_adapter"] and merge["merge_differs_from_base"]
    from loraship.llamacpp.gguf_info import read_gguf

    fields = read_gguf(Path(verify["gguf"]))["fields"]
    assert fields["general.architecture"] == "qwen3moe"
    assert fields["qwen3moe.expert_count"] == 8 and fields["qwen3moe.expert_used_count"] == 2
    assert verify["passed"], {k: g for k, g in verify["gates"].items() if not g["passed"]}
    assert "publish" in manifests


def test_the_importance_matrix_reports_which_experts_it_saw(moe_run):
    config, manifests, _verify = moe_run
    quantize = manifests["quantize"]["metrics"] if "metrics" in manifests["quantize"] else manifests["quantize"]
    coverage = quantize["imatrix"]["expert_coverage"]
    # 2 layers x 8 experts, each routed some of the calibration tokens (top-2 of 8 over hundreds of tokens)
    assert (coverage["pairs"], coverage["covered"], coverage["passed"]) == (16, 16, True)
    assert coverage["least_tokens"] > 0 and coverage["never_routed"] == []


def test_an_importance_matrix_that_missed_experts_is_one_message(moe_run, tmp_path):
    """The run's own matrix with three (layer, expert) pairs' counts zeroed, rewritten with gguf-py: 13 of 16 is
    under the 90% threshold, and the message names the experts and the fix."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    from loraship.llamacpp.imatrix_experts import check_expert_coverage, expert_coverage

    config = moe_run[0]
    real = stage_dir(config, "quantize") / "imatrix.gguf"
    f16 = stage_dir(config, "convert") / "model-F16.gguf"
    zeroed = {"blk.0.ffn_up_exps.weight.counts": [2], "blk.1.ffn_down_exps.weight.counts": [0, 5]}
    writer = GGUFWriter(tmp_path / "imatrix.gguf", arch="imatrix")
    for t in GGUFReader(real).tensors:
        data = np.array(t.data, dtype=np.float32)
        for e in zeroed.get(t.name, []):
            data.reshape(-1)[e] = 0.0
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    coverage = expert_coverage(tmp_path / "imatrix.gguf", f16)
    assert (coverage["pairs"], coverage["covered"], coverage["passed"]) == (16, 13, False)
    assert coverage["never_routed"] == ["blk.0 expert 2", "blk.1 expert 0", "blk.1 expert 5"]
    with pytest.raises(LorashipError) as e:
        check_expert_coverage(coverage, 1234, config.imatrix_max_tokens)
    assert "13 of 16 (layer, expert) pairs received calibration tokens (81%, at least 90% needed)" in str(e.value)
    assert "never routed: blk.0 expert 2, blk.1 expert 0, blk.1 expert 5" in str(e.value)
    assert "Fix: raise imatrix_max_tokens" in str(e.value) and "or set imatrix: false" in str(e.value)
    assert expert_coverage(tmp_path / "imatrix.gguf", real) is None  # a file without expert tensors: dense


def test_n_cpu_moe_reaches_verify_the_served_check_and_the_artifact(moe_run):
    """n_cpu_moe 1, set in the config: llama.cpp loaded the GGUF with blk.0's experts in CPU memory in verify's
    measuring child and its server, and the card's llama-server command and the Modelfile say so."""
    from loraship.constants import MODEL_CARD, MODELFILE
    from loraship.llamacpp.cpu_moe import block_patterns

    config, _manifests, verify = moe_run
    assert verify["n_cpu_moe"] == verify["memory"]["n_cpu_moe"] == 1
    assert verify["tensor_buft_overrides"] == block_patterns(1)
    command = verify["served"]["command"]
    assert command[command.index("--n-cpu-moe") + 1] == "1" and verify["served"]["n_cpu_moe"] == 1
    artifact = stage_dir(config, "publish") / "artifact"
    card = (artifact / MODEL_CARD).read_text()
    assert re.search(r"llama-server -m model-Q4_K_M\.gguf .* --n-cpu-moe 1 ", card)
    assert "Modelfile has no parameter" in card
    modelfile = (artifact / MODELFILE).read_text()
    assert "--n-cpu-moe 1" in modelfile and all("cpu_moe" not in x for x in modelfile.splitlines() if x[:1] != "#")


def test_llama_cpp_keeps_the_experts_n_cpu_moe_names_in_cpu_memory(moe_run):
    """The tensor overrides reach llama.cpp: its loader logs blk.0's expert tensors as overridden, blk.1's not."""
    import subprocess
    import sys

    _config, _manifests, verify = moe_run
    load = (
        "import sys\nfrom llama_cpp import Llama\nfrom loraship.llamacpp.cpu_moe import keep_experts_in_cpu_memory\n"
        "keep_experts_in_cpu_memory(1)\nLlama(model_path=sys.argv[1], n_ctx=64, n_gpu_layers=0, verbose=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", load, verify["gguf"]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    overridden = set(re.findall(r"tensor (blk\.\d+\.ffn_\w+_exps)\.weight .*buffer type overridden", done.stderr))
    assert overridden == {"blk.0.ffn_gate_exps", "blk.0.ffn_up_exps", "blk.0.ffn_down_exps"}


# -- the checks that stop a run ------------------------------------------------------------------------------------
def _config(model: Path, tmp_path: Path, **more):
    return parse_config(
        demo_config_dict(
            model,
            tmp_path,
            **{"lora_target_modules": "all-linear", "sequence_len": 64, "micro_batch_size": 2, **more},
        )
    )


def _one_step(loaded, expected: int):
    """One forward, backward and optimizer step of the loaded model with the expert-gradient check attached."""
    from loraship.training.experts import ExpertGradientCheck

    model = loaded.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    check = ExpertGradientCheck(model, optimizer, expected)
    ids = torch.randint(0, 151000, (2, 48), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return check


def test_expert_gradient_check_records_every_expert(moe_model, tmp_path):
    import loraship.stages.train as train
    from loraship.planning.strategy_record import Strategy

    config = _config(moe_model, tmp_path)
    loaded = train.load_model(moe_model, config, Strategy.from_config(config, 2), "cpu")
    assert len(loaded.experts.tensors) == 4 and loaded.experts.router == ()
    router = [p for n, p in loaded.model.named_parameters() if ".mlp.gate." in n]
    assert router and not any(p.requires_grad for p in router)  # frozen without train_router
    record = _one_step(loaded, len(loaded.experts.tensors)).as_json()
    assert record["tensors"] == 4 and record["experts"] == 32
    assert 0 < record["experts_reached"] == 32 - len(record["never_routed_in_first_step"])


def test_train_router_adapts_the_router(moe_model, tmp_path):
    import loraship.stages.train as train
    from loraship.planning.strategy_record import Strategy

    config = _config(moe_model, tmp_path, train_router=True)
    loaded = train.load_model(moe_model, config, Strategy.from_config(config, 2), "cpu")
    assert loaded.experts.router == ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight")
    assert any(".mlp.gate.lora_A." in n for n, p in loaded.model.named_parameters() if p.requires_grad)


def test_expert_gradient_check_fails_when_experts_are_excluded(moe_model, tmp_path, monkeypatch):
    """The plan adapts the experts, but the model trained has no expert LoRA (PEFT matched none): the first optimizer
    step fails the run instead of shipping untrained experts."""
    import loraship.stages.train as train
    from loraship.planning.strategy_record import Strategy
    from loraship.training import model_loading

    real = model_loading.lora_config
    monkeypatch.setattr(
        model_loading, "lora_config", lambda model_dir, config, parameters=(), **kw: real(model_dir, config, **kw)
    )
    config = _config(moe_model, tmp_path)
    loaded = train.load_model(moe_model, config, Strategy.from_config(config, 2), "cpu")
    with pytest.raises(LorashipError, match=r"adapts 4 stacked expert tensor\(s\) with LoRA, but .* LoRA on none"):
        _one_step(loaded, len(loaded.experts.tensors))


def test_expert_gradient_check_fails_when_no_expert_was_reached(moe_model, tmp_path, monkeypatch):
    import loraship.stages.train as train
    from loraship.planning.strategy_record import Strategy
    from loraship.training import experts

    config = _config(moe_model, tmp_path)
    loaded = train.load_model(moe_model, config, Strategy.from_config(config, 2), "cpu")
    monkeypatch.setattr(experts, "_reached", lambda module: [False] * module.num_experts)
    with pytest.raises(LorashipError, match=r"no expert's LoRA had a gradient \(4 expert tensors, 32 experts\)"):
        _one_step(loaded, 4)


def test_qlora_stores_every_expert_in_4_bits(moe_model, tmp_path):
    import loraship.stages.train as train
    from loraship.planning.strategy_record import Strategy
    from loraship.training.experts import holder

    config = _config(moe_model, tmp_path, adapter="qlora")
    loaded = train.load_model(moe_model, config, Strategy.from_config(config, 2), "cpu")
    base = loaded.model.get_base_model()
    for name in loaded.experts.all_experts:
        module, tensor = holder(base, name)
        packed = module.parametrizations[tensor].original
        assert packed.dtype == torch.uint8 and packed.numel() * 2 == getattr(module, tensor).numel()
    # The 4-bit experts train: one step reaches their LoRA.
    assert _one_step(loaded, 4).as_json()["experts_reached"] > 0


def test_qlora_refuses_an_expert_left_in_bf16(moe_model, tmp_path, monkeypatch):
    import loraship.stages.train as train
    from loraship.planning.strategy_record import Strategy
    from loraship.training import experts

    real = experts.quantize_experts
    monkeypatch.setattr(experts, "quantize_experts", lambda model, names: real(model, names[:-1]))
    config = _config(moe_model, tmp_path, adapter="qlora")
    with pytest.raises(
        LorashipError,
        match=r"adapter: qlora, but expert tensor model\.layers\.1\.mlp\.experts\.down_proj \(torch\.float32\) "
        r"is not stored in 4 bits",
    ):
        train.load_model(moe_model, config, Strategy.from_config(config, 2), "cpu")


# -- merge ------------------------------------------------------------------------------------------------------------
def test_expert_merge_equals_peft_fold_stacked_and_per_expert(moe_model):
    """merge's expert deltas (loraship/expert_merge.py), into stacked tensors and into a Hub checkpoint's per-expert
    ones, equal what PEFT's ParamWrapper folds into the stacked tensors of the model it trains."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from loraship.expert_merge import expert_merges
    from loraship.fixtures.families import model_config

    cfg = model_config(FAMILIES[MOE])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    targets = [f"model.layers.{i}.mlp.experts.{t}" for i in range(2) for t in ("gate_up_proj", "down_proj")]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_parameters=targets, target_modules=[]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(std=0.05)
    saved = get_peft_model_state_dict(peft_model)
    deltas = {}
    for key, value in saved.items():
        module, _, ab = key.removeprefix("base_model.model.").rpartition(".lora_")
        deltas.setdefault(module + ".weight", {})[ab[0]] = value
    deltas = {k: (v["A"], v["B"]) for k, v in deltas.items()}
    folded = peft_model.merge_and_unload().state_dict()
    config = cfg.to_dict()

    stacked = expert_merges(dict(deltas), config, set(base))
    assert sorted(stacked) == sorted(targets)
    for name in targets:
        torch.testing.assert_close(stacked[name](base[name], 2.0), folded[name].float())

    per_expert = {f"{t.rsplit('.', 1)[0]}.{e}.{p}.weight" for t in targets for e in range(8) for p in ("gate_proj",)}
    per_expert |= {n.replace("gate_proj", part) for n in per_expert for part in ("up_proj", "down_proj")}
    split = expert_merges(dict(deltas), config, per_expert)
    assert len(split) == 2 * 8 * 3
    n_ff = 256
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(8):
            gate_up, down = base[f"{prefix}.gate_up_proj"][e], base[f"{prefix}.down_proj"][e]
            gate = split[f"{prefix}.{e}.gate_proj.weight"](gate_up[:n_ff], 2.0)
            up = split[f"{prefix}.{e}.up_proj.weight"](gate_up[n_ff:], 2.0)
            torch.testing.assert_close(torch.cat([gate, up]), folded[f"{prefix}.gate_up_proj"][e].float())
            torch.testing.assert_close(
                split[f"{prefix}.{e}.down_proj.weight"](down, 2.0), folded[f"{prefix}.down_proj"][e].float()
            )


# -- plan ---------------------------------------------------------------------------------------------------------
def _family_config(name: str) -> dict:
    from loraship.fixtures.families import model_config

    return model_config(FAMILIES[name]).to_dict()


@pytest.mark.parametrize(
    "family, targets, message",
    [
        (
            "qwen3",
            ["q_proj", "experts"],
            r"lora_target_modules \['experts'\] name routed experts, but Qwen3ForCausalLM is no mixture of experts "
            r".*fix: leave \['experts'\] out",
        ),
        (
            "qwen3",
            ["experts.gate_up_proj"],
            r"\['experts.gate_up_proj'\] name routed experts, but Qwen3ForCausalLM is no mixture of experts",
        ),
        (
            MOE,
            ["q_proj", "experts.w1"],
            r"lora_target_modules \['experts.w1'\] name expert tensors that Qwen3MoeForCausalLM does not have \(its "
            r"experts hold experts.gate_up_proj, experts.down_proj\)",
        ),
    ],
)
def test_plan_refuses_expert_names_the_model_lacks(family, targets, message, tmp_path):
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy import plan_training

    config = parse_config(demo_config_dict(tmp_path, tmp_path, lora_target_modules=targets))
    with pytest.raises(ValueError, match=message):
        plan_training(shape_from_config(_family_config(family)), config)


@pytest.mark.parametrize(
    "targets, linears, experts",
    [
        ("all-linear", ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_up_proj", "down_proj")),
        (["q_proj", "v_proj"], ("q_proj", "v_proj"), ()),
        (["q_proj", "experts"], ("q_proj",), ("gate_up_proj", "down_proj")),
        (["o_proj", "experts.down_proj"], ("o_proj",), ("down_proj",)),
        # A dense MLP's names stand for the expert tensor holding them.
        (["q_proj", "gate_proj", "up_proj"], ("q_proj",), ("gate_up_proj",)),
        (["down_proj"], (), ("down_proj",)),
    ],
)
def test_lora_targets_on_a_mixture_of_experts(targets, linears, experts):
    from loraship.planning.shape import shape_from_config
    from loraship.planning.targets import lora_modules
    from loraship.planning.targets import expert_lora_targets

    s = shape_from_config(_family_config(MOE))
    assert lora_modules(s, targets) == linears
    assert expert_lora_targets(s, targets) == experts


def _qwen3_30b_a3b_plan(tmp_path, **more):
    from loraship.planning.shape import shape_from_config

    mc = json.loads((QWEN3_30B_A3B / "config.json").read_text())
    config = parse_config(
        demo_config_dict(
            QWEN3_30B_A3B,
            tmp_path,
            **{
                "adapter": "qlora",
                "lora_r": 16,
                "sequence_len": 2048,
                "micro_batch_size": 1,
                "lora_target_modules": "all-linear",
                "gpu_memory_gib": 32,
                "device": "cuda",
                **more,
            },
        )
    )
    s = shape_from_config(mc)
    return mc, config, s


def test_plan_counts_qwen3_30b_a3b_experts_in_4_bits_with_their_lora(tmp_path):
    from loraship.planning import moe
    from loraship.planning.estimate import estimate
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy_record import Strategy
    from loraship.planning.estimate import GIB, NF4_BYTES_PER_PARAM

    mc, config, s = _qwen3_30b_a3b_plan(tmp_path)
    assert s.experts.n == 128 and s.experts.top_k == 8 and s.experts.layers == 48
    experts = moe.expert_params(s)
    assert experts == 48 * 128 * (2048 * 1536 + 768 * 2048)
    # r x experts x (in + out) per stacked tensor and layer: about 0.6 B at r16.
    assert moe.expert_lora_params(s, config) == 48 * 16 * 128 * ((2048 + 1536) + (768 + 2048))
    strategy = Strategy.from_config(config, s.L)
    est = estimate(shape_from_config(mc), config, strategy)
    attention = 48 * 16 * sum(i + o for i, o in s.linears().values())
    assert est["lora_params"] == moe.expert_lora_params(s, config) + attention
    # NF4 experts: the frozen weights are the 4-bit decoder plus the bf16 rest (was 57 GiB with bf16 experts).
    frozen = est["components_gib"]["frozen_weights"]
    rest = 2 * (s.n_params - 48 * s.layer_linear_params - experts) / GIB
    assert frozen == pytest.approx((48 * s.layer_linear_params + experts) * NF4_BYTES_PER_PARAM / GIB + rest, rel=1e-3)
    assert frozen < 17
    # AdamW's fp32 state of the expert LoRA is a first-order term.
    assert est["components_gib"]["optimizer_state"] > 0.6e9 * 8 / GIB
    lora = config.model_copy(update={"adapter": "lora"})
    bf16 = estimate(shape_from_config(mc), lora, Strategy.from_config(lora, s.L))["components_gib"]["frozen_weights"]
    assert bf16 - frozen == pytest.approx(
        (48 * s.layer_linear_params + experts) * (2 - NF4_BYTES_PER_PARAM) / GIB, rel=1e-3
    )


def test_fsdp2_plans_shard_the_experts(tmp_path):
    from loraship.planning import moe, multi_gpu
    from loraship.planning.strategy_record import Strategy
    from loraship.planning.estimate import GIB, NF4_BYTES_PER_PARAM

    _mc, config, s = _qwen3_30b_a3b_plan(tmp_path, gradient_checkpointing=True)
    strategy = Strategy.from_config(config, s.L)
    options = {(o["gpus"], o["engine"]): o for o in multi_gpu.options_for(s, config, strategy, [1, 8])}
    single, sharded = options[(1, "single")]["per_gpu_gib"], options[(8, "fsdp2")]["per_gpu_gib"]
    # Each rank holds an eighth of the 4-bit experts (and of the LoRA and its AdamW state).
    assert single - sharded > 7 / 8 * moe.expert_params(s) * 0.5 / GIB
    assert sharded < single - 7 / 8 * moe.expert_lora_params(s, config) * 16 / GIB
    assert NF4_BYTES_PER_PARAM > 0.5
