"""optimizer: adamw_8bit (bitsandbytes' AdamW8bit): planned at its own bytes, trained with 8-bit moments, resumed
exactly, and refused where it cannot go (FSDP2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraship.config import parse_config
from tests.conftest import demo_config_dict
from tests.test_train import Killed, curve, run_stages

ROOT = Path(__file__).resolve().parents[1]
QWEN3_MOE = ROOT / "examples" / "models" / "qwen3-30b-a3b"


def _moe_config(tmp_path, **over):
    from loraship.config import Config

    data = dict(
        base_model=str(QWEN3_MOE),
        datasets=[{"path": "x.jsonl", "type": "chat"}],
        workdir=str(tmp_path / "w"),
        output=str(tmp_path / "o"),
        adapter="qlora",
        lora_r=16,
        lora_target_modules="all-linear",
        sequence_len=2048,
        micro_batch_size=1,
    )
    return Config.model_validate({**data, **over})


def _moe_every_layer_checkpointed():
    """Qwen3-30B-A3B's shape and QLoRA at micro-batch 1 with every layer checkpointed."""
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy_record import Strategy

    s = shape_from_config(json.loads((QWEN3_MOE / "config.json").read_text()))
    st = Strategy(
        adapter="qlora",
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        fused_loss=True,
        gradient_checkpointing=True,
        checkpointed_layers=s.L,
    )
    return s, st


def test_the_plan_counts_8bit_moments_at_about_a_quarter_of_adamw():
    from loraship.planning.estimate import estimate

    s, st = _moe_every_layer_checkpointed()
    est = {o: estimate(s, _moe_config(ROOT, optimizer=o), st) for o in ("adamw", "adamw_8bit")}
    params = est["adamw"]["lora_params"]
    assert params > 5e8  # Qwen3-30B-A3B's expert LoRA at r16 is about 0.6B parameters
    full, eight = (est[o]["components_gib"]["optimizer_state"] for o in ("adamw", "adamw_8bit"))
    # components_gib are rounded to hundredths of a GiB
    assert full == pytest.approx(8 * params / 2**30, abs=0.006)
    assert eight == pytest.approx(params * (2 + 8 / 256) / 2**30, abs=0.006)
    saved = est["adamw"]["predicted_total_gib"] - est["adamw_8bit"]["predicted_total_gib"]
    assert saved == pytest.approx(full - eight, abs=0.02)


def test_fsdp2_is_not_offered_with_the_8bit_optimizer():
    from loraship.planning.multi_gpu import options_for

    s, st = _moe_every_layer_checkpointed()
    fsdp = [o for o in options_for(s, _moe_config(ROOT, optimizer="adamw_8bit"), st, [1, 2]) if o["engine"] == "fsdp2"]
    assert fsdp and not fsdp[0]["fits"] and "optimizer: adamw" in fsdp[0]["why"]


def test_8bit_adamw_trains_with_8bit_moments_and_resumes_the_same_curve(tiny_model, tmp_path, monkeypatch):
    from loraship.training import checkpoints

    # lora_r 16 on hidden 256: every LoRA factor holds 4096 values, bitsandbytes' floor for 8-bit moments.
    common = dict(
        max_steps=6, save_steps=3, micro_batch_size=8, gradient_accumulation_steps=1, warmup_steps=1, lora_r=16
    )
    common["optimizer"] = "adamw_8bit"
    clean = parse_config(demo_config_dict(tiny_model, tmp_path / "a", run_name="clean", **common))
    killed = parse_config(demo_config_dict(tiny_model, tmp_path / "b", run_name="killed", **common))
    plain = parse_config(
        demo_config_dict(tiny_model, tmp_path / "c", run_name="plain", **{**common, "optimizer": "adamw"})
    )
    run_stages(clean, ["plan", "train"])
    run_stages(plain, ["plan", "train"])

    real_save = checkpoints.save_checkpoint
    moments, held, sizes = [], [], []

    def save_then_die(folder, model, optimizer, scheduler, step, history):
        moments.extend((p.numel(), st["state1"].dtype) for p, st in optimizer.state.items())
        held.append(
            sum(
                v.nbytes for st in optimizer.state.values() for k, v in st.items() if k.startswith(("state", "absmax"))
            )
        )
        sizes.extend(p.numel() for p in optimizer.state)
        real_save(folder, model, optimizer, scheduler, step, history)
        if step == 3:
            raise Killed

    monkeypatch.setattr(checkpoints, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        run_stages(killed, ["plan", "train"])
    # LoRA factors of 4096+ values keep 8-bit moments; smaller ones (k/v's B: 128 x 16) fp32, as bitsandbytes does.
    assert {dtype for n, dtype in moments if n >= 4096} == {torch.uint8}
    assert {dtype for n, dtype in moments if n < 4096} <= {torch.float32}
    # The plan's count of the moments (estimate.optimizer_bytes) is what bitsandbytes allocated, to the byte.
    from loraship.planning.estimate import optimizer_bytes

    assert optimizer_bytes(killed, sizes, 0) == held[0]
    monkeypatch.setattr(checkpoints, "save_checkpoint", real_save)
    resumed = run_stages(killed, ["plan", "train"])["train"]["metrics"]
    assert resumed["resumed_from_step"] == 3
    a, b, c = curve(killed), curve(clean), curve(plain)
    assert [h["step"] for h in a] == list(range(1, 7))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-7), (x, y)
    # The same run under fp32 moments: the first step's loss is the same model's, later ones drift by rounding.
    assert b[0]["loss"] == pytest.approx(c[0]["loss"], rel=1e-6)
    assert b[-1]["loss"] == pytest.approx(c[-1]["loss"], rel=0.05)
