"""The plan as one typed, frozen record (loraship/planning/plan_record.py): built from what the planner returns, its
decisions made once, written and read back unchanged; a plan from before the decisions upgraded or refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loraship.planning.plan_record import SHIPPING_KEYS, MemoryEstimate, Plan, PlanError
from loraship.planning.shape import shape_from_config
from loraship.planning.strategy import plan_training
from loraship.planning.strategy_record import Strategy
from tests.test_memory import LORA_14B, PHI3_MINI, QWEN2_05B, QWEN2_14B_EXAMPLE, cfg


def _plan(mc: dict, **kw) -> tuple[Plan, dict]:
    c = cfg(**kw)
    s = shape_from_config(mc)
    planned = plan_training(s, c)
    return Plan.build(planned, s, c, model_dir="/models/m", inputs={"dataset:d.jsonl": "abc"}), planned


def test_a_plan_is_written_and_read_back_unchanged_and_frozen():
    plan, planned = _plan(QWEN2_05B, sequence_len=2048, micro_batch_size=2, gradient_accumulation_steps=4)
    text = json.dumps(plan.to_json(), sort_keys=True)
    again = Plan.from_json(json.loads(text))
    assert again == plan and json.dumps(again.to_json(), sort_keys=True) == text
    # What the planner wrote is all still there, key for key, beside the decisions.
    assert {k: v for k, v in plan.to_json().items() if k in planned} == {**planned, "model": plan.model.to_json()}
    assert (
        plan.to_json()["model_dir"] == "/models/m"
        and plan.memory.predicted_total_gib == planned["memory"]["predicted_total_gib"]
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.reason = "edited"
    with pytest.raises(TypeError):
        plan.memory.components_gib["frozen_weights"] = 0.0  # the named terms are read-only too


def test_the_decisions_are_the_ones_train_would_have_asked_the_planner_for():
    plan, _ = _plan(PHI3_MINI, lora_target_modules=["q_proj", "v_proj", "o_proj"])
    # Phi-3's fused Linears, resolved for this model; the note says a fused one adapts more than was named.
    assert plan.lora_modules == ("qkv_proj", "o_proj") and "qkv_proj" in plan.lora_modules_note
    assert plan.checkpointed_layers == tuple(range(plan.strategy.checkpointed(32)))
    assert plan.model.decoder_layers == 32 and plan.model.model_type == "phi3" and plan.lora_excluded is None
    # A 14B streamed over a 32 GiB card: the layers streamed are the strategy's, each one checkpointed.
    big, _ = _plan(QWEN2_14B_EXAMPLE, **LORA_14B, fused_loss="on")
    assert big.streamed_layers == tuple(big.strategy.streamed(48)) and big.streamed_layers
    assert set(big.streamed_layers) <= set(big.checkpointed_layers) and big.liger_kernels is big.fused_loss is True
    # On the CPU nothing streams and no Liger kernel runs.
    cpu = big.on_device("cpu", fused_loss=False)
    assert (cpu.streamed_layers, cpu.liger_kernels, cpu.strategy.offload_layers) == ((), False, 0)
    assert cpu.memory == big.memory and cpu.checkpointed_layers == big.checkpointed_layers


def test_strategy_json_leaves_out_what_training_does_not_depend_on():
    plan, _ = _plan(QWEN2_05B)
    shipped = Plan.from_json({**plan.to_json(), "disk_gib": {"total": 3.0}, "quantization_warnings": []})
    training = shipped.training_json()
    assert not set(training) & set(SHIPPING_KEYS) and training == plan.training_json()
    assert Plan.from_json(training) == plan


def test_a_plan_from_before_the_decisions_upgrades_once_or_is_refused_naming_the_re_plan():
    plan, planned = _plan(QWEN2_05B)
    old = {**planned, "model_dir": "/models/m", "inputs": {"dataset:d.jsonl": "abc"}}  # as plan stages wrote it
    with pytest.raises(PlanError, match=r"older loraship .* fix: re-plan \(loraship run CONFIG --from plan --force\)"):
        Plan.from_json(old)
    assert Plan.from_json(old, shape_from_config(QWEN2_05B), cfg()) == plan


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("memory"), r"lacks \['memory'\]"),
        (lambda d: d.pop("reason"), r"lacks \['reason'\]"),
        (lambda d: d["memory"].pop("predicted_reserved_gib"), r"memory estimate lacks \['predicted_reserved_gib'\]"),
    ],
)
def test_a_damaged_plan_is_refused_naming_what_it_lacks_and_the_re_plan(change, message):
    plan, _ = _plan(QWEN2_05B)
    d = json.loads(json.dumps(plan.to_json()))
    change(d)
    with pytest.raises(PlanError, match=message + r".*re-plan"):
        Plan.from_json(d)


def test_a_plan_re_made_for_another_strategy_makes_its_layer_decisions_again():
    plan, _ = _plan(QWEN2_14B_EXAMPLE, **LORA_14B, fused_loss="on")
    none = plan.with_strategy(plan.strategy.replace(offload_layers=0).with_checkpointing(0), "smaller")
    assert (none.streamed_layers, none.checkpointed_layers, none.reason) == ((), (), "smaller")
    assert isinstance(none.strategy, Strategy) and none.lora_modules == plan.lora_modules
    assert MemoryEstimate.from_json(plan.memory.to_json()) == plan.memory


def test_train_reads_the_plan_once_and_asks_the_planner_nothing_it_decided(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import loraship.stages.train as train
    from loraship.planning import shape, strategy, targets
    from loraship.runtime.manifest import atomic_write_json
    from loraship.training.out_of_memory import starting_plan

    plan, _ = _plan(PHI3_MINI, lora_target_modules=["q_proj", "v_proj", "o_proj"])
    (tmp_path / "plan").mkdir()
    atomic_write_json(tmp_path / "plan" / "strategy.json", plan.training_json(), sort_keys=True)
    ctx = SimpleNamespace(upstream_dir=lambda stage: tmp_path / stage, dir=tmp_path / "train")

    def asked(*args, **kwargs):
        raise AssertionError("the train stage asked the planner for what its plan decided")

    for module, name in ((shape, "shape_from_config"), (targets, "lora_modules"), (strategy, "plan_training")):
        monkeypatch.setattr(module, name, asked)
    c = cfg(lora_target_modules=["q_proj", "v_proj", "o_proj"])
    start, staged = starting_plan(ctx, c, PHI3_MINI, "cpu")
    assert staged == plan and start.plan == plan.on_device("cpu", fused_loss=False)
    record = train.trained_with(start)
    assert record["lora_modules"] == ["qkv_proj", "o_proj"] and record["lora_modules_note"] == plan.lora_modules_note
    assert record["strategy_reason"] == plan.reason and "of 32 layers" in record["trained_as"]
    # A plan stage from before the decisions wrote the reason and the model to plan.json only, and strategy.json as
    # below: upgraded once, with the planner, to the same record.
    monkeypatch.undo()
    written = plan.to_json()
    old = {k: written[k] for k in ("strategy", "memory", "model_dir", "inputs")}
    atomic_write_json(tmp_path / "plan" / "strategy.json", {**old, "distributed": None})
    atomic_write_json(tmp_path / "plan" / "plan.json", {k: v for k, v in written.items() if k != "decisions"})
    assert starting_plan(ctx, c, PHI3_MINI, "cpu")[1] == plan


def test_the_plan_stage_parses_config_json_once(tiny_model, tmp_path, monkeypatch):
    """Every check of the plan stage that reads the base's config.json shares one read (models.cached_json): loraship's
    code reads files with Path.read_text, which this counts (transformers' own reads open the file, uncounted)."""
    import importlib

    from loraship import models
    from loraship.config import parse_config
    from tests.conftest import demo_config_dict

    config_json = (tiny_model / "config.json").resolve()
    reads = []
    real = Path.read_text

    def counting(self, *a, **k):
        if Path(self).resolve() == config_json:
            reads.append(self)
        return real(self, *a, **k)

    models._parsed_json.cache_clear()
    monkeypatch.setattr(Path, "read_text", counting)
    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="once"))
    importlib.import_module("loraship.stages.plan").run(config)
    assert len(reads) == 1, reads
