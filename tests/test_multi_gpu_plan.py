"""The multi-GPU plan (loraship/planning/multi_gpu.py) on real config.json shapes: which engine on how many GPUs, the
numbers' sanity (FSDP2 per GPU falls with N, DDP per GPU is about one GPU's), the `gpus` key and the refusals."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.errors import ConfigError, LorashipError
from loraship.planning.multi_gpu import GPU_COUNTS, choose_engine, plan_on_gpus
from loraship.planning.shape import shape_from_config
from loraship.planning.strategy import PlanRefused

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
BASE = {"base_model": "x", "datasets": [{"path": "a.jsonl", "type": "alpaca"}]}


@lru_cache(maxsize=None)
def shape(name: str):
    return shape_from_config(json.loads((MODELS / name / "config.json").read_text(encoding="utf-8")))


def plan(name: str, **overrides) -> dict:
    return plan_on_gpus(shape(name), parse_config({**BASE, **overrides}))


def option(record: dict, gpus: int, engine: str) -> dict:
    return next(o for o in record["options"] if (o["gpus"], o["engine"]) == (gpus, engine))


def test_gpus_key_is_strict():
    assert parse_config(BASE).gpus == "auto"
    assert parse_config({**BASE, "gpus": 4}).gpus == 4
    for bad in (0, -2, True, 2.0, "2", "all"):
        with pytest.raises(ConfigError, match="gpus: must be 'auto' or a whole number"):
            parse_config({**BASE, "gpus": bad})


def test_record_shape_follows_the_contract():
    record = plan("qwen2-7b")["distributed"]
    assert set(record) == {"requested", "options", "min_gpus", "chosen"}
    assert record["requested"] == "auto" and record["chosen"] is None
    assert {o["gpus"] for o in record["options"]} == set(GPU_COUNTS)
    for o in record["options"]:
        assert set(o) == {"gpus", "engine", "fits", "per_gpu_gib", "tokens_per_s", "why"}
        assert o["engine"] == ("single" if o["gpus"] == 1 else o["engine"]) and o["engine"] in (
            "single",
            "ddp",
            "fsdp2",
        )
        assert "not measured on several GPUs" in o["why"]


def test_7b_fits_one_card_so_ddp_and_sane_numbers():
    p = plan("qwen2-7b", gpus=4)
    record = p["distributed"]
    single = option(record, 1, "single")
    assert single["fits"] and record["min_gpus"] == 1
    assert record["chosen"]["engine"] == "ddp" and record["chosen"]["gpus"] == 4
    assert record["requested"] == 4
    fsdp = [option(record, n, "fsdp2")["per_gpu_gib"] for n in (2, 4, 8)]
    assert fsdp[0] > fsdp[1] > fsdp[2], fsdp  # sharding takes more off each GPU as N grows
    for n in (2, 4, 8):
        ddp = option(record, n, "ddp")
        # DDP replicates the one-GPU plan: its per-GPU figure is that plus buckets and NCCL, well under 1 GiB more.
        assert single["per_gpu_gib"] < ddp["per_gpu_gib"] < single["per_gpu_gib"] + 1.0
        # tokens/s scale with N, at an all-reduce efficiency below 1 but not far.
        assert 0.9 * n * single["tokens_per_s"] < ddp["tokens_per_s"] <= n * single["tokens_per_s"]
    assert single["per_gpu_gib"] == p["memory"]["predicted_total_gib"]


def test_32b_bf16_lora_needs_fsdp2_on_the_fewest_gpus_that_fit():
    p = plan("qwen2.5-32b", fallback=[])
    record = p["distributed"]
    assert not option(record, 1, "single")["fits"]
    assert all(not option(record, n, "ddp")["fits"] for n in (2, 4, 8))
    fits = [n for n in (2, 4, 8) if option(record, n, "fsdp2")["fits"]]
    assert fits and record["min_gpus"] == fits[0] > 1
    assert p["strategy"]["adapter"] == "lora" and not p["strategy"]["offload_layers"]
    assert f"FSDP2 over {record['min_gpus']} GPUs" in p["reason"]
    # gpus: auto: train picks FSDP2 where enough are visible, refuses where too few are.
    assert choose_engine(record, 8)["engine"] == "fsdp2"
    with pytest.raises(LorashipError, match=f"fits on {record['min_gpus']}.*set gpus: {record['min_gpus']}"):
        choose_engine(record, 1)


def test_32b_bf16_lora_on_one_gpu_says_how_many_would_fit():
    need = plan("qwen2.5-32b", fallback=[])["distributed"]["min_gpus"]
    with pytest.raises(PlanRefused, match=rf"gpus: 1 is too few GPUs.*fits on {need} \(fsdp2.*fix: set gpus: {need}"):
        plan("qwen2.5-32b", fallback=[], gpus=1)


def test_70b_llama_qlora_fsdp2_and_bf16_needs_more():
    qlora = plan("llama-3-70b", adapter="qlora")["distributed"]
    lora = plan("llama-3-70b", fallback=[])["distributed"]
    assert not option(qlora, 1, "single")["fits"] and qlora["min_gpus"] >= 2
    assert lora["min_gpus"] > qlora["min_gpus"]  # NF4 shards a quarter of bf16's bytes
    assert option(qlora, 8, "fsdp2")["per_gpu_gib"] < option(lora, 8, "fsdp2")["per_gpu_gib"]


def test_explicit_gpus_shard_before_fallback_offload():
    # One 32 GiB card takes the 32B bf16 LoRA only by streaming layers from CPU memory (fallback: offload).
    assert plan("qwen2.5-32b")["strategy"]["offload_layers"] > 0
    p = plan("qwen2.5-32b", gpus=4)
    assert p["strategy"]["offload_layers"] == 0 and p["strategy"]["adapter"] == "lora"
    assert p["distributed"]["chosen"] == option(p["distributed"], 4, "fsdp2")


def test_choose_engine_errors_name_the_fix():
    record = plan("qwen2-7b", gpus=4)["distributed"]
    assert choose_engine(record, 4)["gpus"] == 4
    assert choose_engine(record, 8)["gpus"] == 4  # gpus: 4 means 4, even where more are visible
    with pytest.raises(LorashipError, match=r"gpus: 4 but 2 device\(s\) are visible here; fix: set gpus: 2"):
        choose_engine(record, 2)
    with pytest.raises(LorashipError, match="usable training devices; fix"):
        choose_engine(record, 0)
    assert choose_engine(None, 4)["engine"] == "single" and choose_engine(None, 4)["gpus"] == 1
    auto = plan("qwen2-7b")["distributed"]
    assert choose_engine(auto, 1)["engine"] == "single"
    assert choose_engine(auto, 3)["gpus"] == 2  # the listed counts only: 2 of 3 visible


def test_where_ddp_extras_do_not_fit_fsdp2_takes_the_gpus():
    # The 7B at sequence 4096 just fits one card; DDP's buckets and NCCL do not on top: FSDP2 on the 2 asked for.
    record = plan("qwen2-7b", sequence_len=4096, gpus=2)["distributed"]
    assert option(record, 1, "single")["fits"] and not option(record, 2, "ddp")["fits"]
    assert record["chosen"] == option(record, 2, "fsdp2")


def test_train_preflight_checks_the_visible_devices(monkeypatch):
    from loraship.planning.preflight import check_training_gpus

    cfg = parse_config({**BASE, "device": "cpu", "gpus": 2})
    record = plan("qwen2-7b", gpus=2)["distributed"]
    monkeypatch.setenv("LORASHIP_CPU_RANKS", "1")
    with pytest.raises(LorashipError, match=r"gpus: 2 but 1 device\(s\) are visible"):
        check_training_gpus(cfg, record)
    monkeypatch.setenv("LORASHIP_CPU_RANKS", "2")
    assert check_training_gpus(cfg, record)["gpus"] == 2
    monkeypatch.setenv("LORASHIP_CPU_RANKS", "two")
    with pytest.raises(LorashipError, match="LORASHIP_CPU_RANKS='two'"):
        check_training_gpus(cfg, record)


def test_fsdp2_ranks_do_not_count_the_kept_lora_casts():
    # The train stage keeps bf16 LoRA casts through a step except under FSDP2 (loraship/training/fused_lora.py):
    # FSDP2's rank is predicted as if the single-GPU estimate had never counted them.
    from loraship.planning.estimate import estimate
    from loraship.planning.multi_gpu import fsdp2_per_gpu_gib
    from loraship.planning.strategy_record import Strategy

    s, cfg = shape("qwen2.5-32b"), parse_config(BASE)
    strategy = Strategy.from_config(cfg, s.L)
    est = estimate(s, cfg, strategy)
    casts = est["components_gib"]["lora_compute_copies"]
    assert casts > 0
    without = {
        **est,
        "components_gib": {k: v for k, v in est["components_gib"].items() if k != "lora_compute_copies"},
        "predicted_total_gib": est["predicted_total_gib"] - casts,
    }
    for n in (2, 4, 8):
        assert fsdp2_per_gpu_gib(s, strategy, est, n) == pytest.approx(fsdp2_per_gpu_gib(s, strategy, without, n))
