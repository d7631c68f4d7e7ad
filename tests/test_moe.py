"""Mixture of experts on the CPU: a tiny random Qwen3-MoE (8 experts, 2 routed per token, 2 layers; Qwen3's real
tokenizer, loraship/fixtures/families.py) with LoRA on every routed expert, 4-bit experts under QLoRA, and the checks
that stop a run whose experts would ship untrained or in 16 bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraship.config import parse_config
from loraship.errors import LorashipError
from loraship.fixtures.families import FAMILIES
from tests.conftest import REPO, demo_config_dict

MOE = "qwen3-moe"


@pytest.fixture(scope="module")
def moe_model() -> Path:
    from loraship.fixtures.families import ensure_family
    from tests.conftest import cache_lock

    with cache_lock(REPO / ".loraship" / "models" / f"family-{MOE}") as folder:
        return ensure_family(MOE, folder)


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
    from loraship.planning import memory

    config = _config(moe_model, tmp_path)
    loaded = train.load_model(moe_model, config, memory.strategy_from_config(config, 2), "cpu")
    assert len(loaded.experts.tensors) == 4 and loaded.experts.router == ()
    router = [p for n, p in loaded.model.named_parameters() if ".mlp.gate." in n]
    assert router and not any(p.requires_grad for p in router)  # frozen without train_router
    record = _one_step(loaded, len(loaded.experts.tensors)).as_json()
    assert record["tensors"] == 4 and record["experts"] == 32
    assert 0 < record["experts_reached"] == 32 - len(record["never_routed_in_first_step"])


def test_train_router_adapts_the_router(moe_model, tmp_path):
    import loraship.stages.train as train
    from loraship.planning import memory

    config = _config(moe_model, tmp_path, train_router=True)
    loaded = train.load_model(moe_model, config, memory.strategy_from_config(config, 2), "cpu")
    assert loaded.experts.router == ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight")
    assert any(".mlp.gate.lora_A." in n for n, p in loaded.model.named_parameters() if p.requires_grad)


def test_expert_gradient_check_fails_when_experts_are_excluded(moe_model, tmp_path, monkeypatch):
    """The plan adapts the experts, but the model trained has no expert LoRA (PEFT matched none): the first optimizer
    step fails the run instead of shipping untrained experts."""
    import loraship.stages.train as train
    from loraship.planning import memory
    from loraship.training import model_loading

    real = model_loading.lora_config
    monkeypatch.setattr(model_loading, "lora_config", lambda model_dir, config, parameters=(): real(model_dir, config))
    config = _config(moe_model, tmp_path)
    loaded = train.load_model(moe_model, config, memory.strategy_from_config(config, 2), "cpu")
    with pytest.raises(LorashipError, match=r"adapts 4 stacked expert tensor\(s\) with LoRA, but .* LoRA on none"):
        _one_step(loaded, len(loaded.experts.tensors))


def test_expert_gradient_check_fails_when_no_expert_was_reached(moe_model, tmp_path, monkeypatch):
    import loraship.stages.train as train
    from loraship.planning import memory
    from loraship.training import experts

    config = _config(moe_model, tmp_path)
    loaded = train.load_model(moe_model, config, memory.strategy_from_config(config, 2), "cpu")
    monkeypatch.setattr(experts, "_reached", lambda module: [False] * module.num_experts)
    with pytest.raises(LorashipError, match=r"no expert's LoRA had a gradient \(4 expert tensors, 32 experts\)"):
        _one_step(loaded, 4)


def test_qlora_stores_every_expert_in_4_bits(moe_model, tmp_path):
    import loraship.stages.train as train
    from loraship.planning import memory
    from loraship.training.experts import holder

    config = _config(moe_model, tmp_path, adapter="qlora")
    loaded = train.load_model(moe_model, config, memory.strategy_from_config(config, 2), "cpu")
    base = loaded.model.get_base_model()
    for name in loaded.experts.all_experts:
        module, tensor = holder(base, name)
        packed = module.parametrizations[tensor].original
        assert packed.dtype == torch.uint8 and packed.numel() * 2 == getattr(module, tensor).numel()
    # The 4-bit experts train: one step reaches their LoRA.
    assert _one_step(loaded, 4).as_json()["experts_reached"] > 0


def test_qlora_refuses_an_expert_left_in_bf16(moe_model, tmp_path, monkeypatch):
    import loraship.stages.train as train
    from loraship.planning import memory
    from loraship.training import experts

    real = experts.quantize_experts
    monkeypatch.setattr(experts, "quantize_experts", lambda model, names: real(model, names[:-1]))
    config = _config(moe_model, tmp_path, adapter="qlora")
    with pytest.raises(
        LorashipError,
        match=r"adapter: qlora, but expert tensor model\.layers\.1\.mlp\.experts\.down_proj \(torch\.float32\) "
        r"is not stored in 4 bits",
    ):
        train.load_model(moe_model, config, memory.strategy_from_config(config, 2), "cpu")


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
    from loraship.planning import memory

    config = parse_config(demo_config_dict(tmp_path, tmp_path, lora_target_modules=targets))
    with pytest.raises(ValueError, match=message):
        memory.plan_training(_family_config(family), config)


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
    from loraship.planning import memory
    from loraship.planning.targets import expert_lora_targets

    s = memory.parse_model_config(_family_config(MOE))
    assert memory.lora_modules(s, targets) == linears
    assert expert_lora_targets(s, targets) == experts
