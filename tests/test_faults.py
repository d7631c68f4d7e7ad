"""Nothing lost, nothing trusted blindly: kills, corrupt files, OOM, disk, secrets, concurrency."""

from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from loraship.config import parse_config
from loraship.constants import F16_GGUF, MANIFEST_NAME, STAGES
from loraship.errors import DataError, IntegrityError, LorashipError
from loraship.stage import stage_dir
from tests.conftest import REPO, demo_config_dict

FAST = dict(max_steps=24, save_steps=2, micro_batch_size=8, warmup_steps=2)


def run_stages(config, stages):
    return {s: importlib.import_module(f"tasks.{s}").run(config) for s in stages}


def config_file(config, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def stage_process(stage: str, cfg_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"tasks.{stage}", str(cfg_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kill_during_training_resumes_the_same_loss_curve(tiny_model, tmp_path):
    killed = parse_config(demo_config_dict(tiny_model, tmp_path / "a", run_name="killed", **FAST))
    clean = parse_config(demo_config_dict(tiny_model, tmp_path / "b", run_name="clean", **FAST))
    run_stages(killed, ["plan"])
    proc = stage_process("train", config_file(killed, tmp_path / "killed.yaml"))
    state = stage_dir(killed, "train") / "checkpoints" / "last" / "trainer_state.pt"
    deadline = time.time() + 300
    while not state.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # let it run on past the checkpoint, so work after it is lost
    assert proc.poll() is None, "training finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (stage_dir(killed, "train") / MANIFEST_NAME).exists()

    resumed = run_stages(killed, ["plan", "train"])
    assert resumed["plan"].get("_skipped")  # no finished stage recomputed
    assert resumed["train"]["metrics"]["resumed_from_step"] > 0
    reference = run_stages(clean, ["plan", "train"])["train"]

    def curve(config):
        lines = (stage_dir(config, "train") / "loss_history.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    a, b = curve(killed), curve(clean)
    assert [h["step"] for h in a] == list(range(1, FAST["max_steps"] + 1))
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-3, abs=1e-4), (x, y)
    assert resumed["train"]["metrics"]["eval_loss_after"] == pytest.approx(
        reference["metrics"]["eval_loss_after"], rel=1e-3)


@pytest.fixture(scope="module")
def merged_run(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    config = parse_config(demo_config_dict(tiny_model, root, run_name="faults", **FAST))
    run_stages(config, ["plan", "train", "merge"])
    return config, root


def test_kill_during_convert_leaves_nothing_taken_as_complete(merged_run):
    config, root = merged_run
    proc = stage_process("convert", config_file(config, root / "convert.yaml"))
    time.sleep(2.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = stage_dir(config, "convert") / F16_GGUF
    if not (stage_dir(config, "convert") / MANIFEST_NAME).exists():
        # Without a manifest nothing downstream accepts the folder, complete file or not.
        with pytest.raises(IntegrityError, match="no manifest"):
            importlib.import_module("tasks.quantize").run(config)
    if out.exists():  # renamed only once the converter finished, so it must read back
        from loraship.gguf_info import read_gguf

        assert read_gguf(out)["tensor_count"] > 0
    result = run_stages(config, ["convert", "quantize"])
    assert (stage_dir(config, "quantize") / MANIFEST_NAME).exists()
    assert not list(stage_dir(config, "convert").glob(".tmp-*"))
    assert result["quantize"]["metrics"]["file_type"] == 15


def test_stale_temporary_file_is_never_taken_as_output(merged_run):
    config, _ = merged_run
    run_stages(config, ["convert"])
    folder = stage_dir(config, "quantize")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST_NAME).unlink(missing_ok=True)
    (folder / ".tmp-model-Q4_K_M.gguf.999").write_bytes(b"GGUF half written")
    result = run_stages(config, ["quantize"])["quantize"]
    assert ".tmp-model-Q4_K_M.gguf.999" not in result["outputs"]
    assert not (folder / ".tmp-model-Q4_K_M.gguf.999").exists()


def test_truncated_base_safetensors_is_named(tiny_model, tmp_path):
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    config = parse_config(demo_config_dict(broken, tmp_path, run_name="trunc"))
    with pytest.raises(LorashipError, match=r"model\.safetensors: truncated"):
        run_stages(config, ["plan"])
    assert not stage_dir(config, "train").exists()


def test_truncated_gguf_is_named(merged_run, tmp_path):
    from loraship.gguf_info import read_gguf

    config, _ = merged_run
    run_stages(config, ["convert"])
    src = stage_dir(config, "convert") / F16_GGUF
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[:4096])
    with pytest.raises(IntegrityError, match="cut.gguf"):
        read_gguf(cut)


def test_manifest_checksum_mismatch_stops_downstream(merged_run):
    config, _ = merged_run
    run_stages(config, ["convert"])
    manifest_path = stage_dir(config, "convert") / MANIFEST_NAME
    original = manifest_path.read_text()
    data = json.loads(original)
    data["outputs"][F16_GGUF]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(data))
    try:
        with pytest.raises(IntegrityError, match="sha256 does not match"):
            importlib.import_module("tasks.quantize").run(config.model_copy(update={"quantization": "Q5_K_M"}))
    finally:
        manifest_path.write_text(original)


def test_out_of_memory_replans_and_records_why(merged_run, monkeypatch):
    import torch

    import tasks.train as train

    config, _ = merged_run
    config = config.model_copy(update={"run_name": "oom", "micro_batch_size": 8, "gradient_accumulation_steps": 1})
    real = train.train_once
    calls = []

    def flaky(config_, ctx, model_dir, strategy, *args):
        calls.append(dict(strategy))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(config_, ctx, model_dir, strategy, *args)

    monkeypatch.setattr(train, "train_once", flaky)
    manifest = run_stages(config, ["plan", "train"])["train"]
    retries = manifest["metrics"]["oom_retries"]
    assert len(calls) == 2 and len(retries) == 1
    assert retries[0]["under_predicted"]  # names the component
    first, second = calls
    assert second != first
    # the user's effective batch is kept
    assert (second["micro_batch_size"] * second["gradient_accumulation_steps"]
            == first["micro_batch_size"] * first["gradient_accumulation_steps"])


def test_disk_preflight_refuses_before_writing(merged_run, monkeypatch):
    import shutil

    from loraship import preflight

    config, _ = merged_run
    config = config.model_copy(update={"run_name": "nodisk"})
    run_stages(config, ["plan", "train", "merge"])
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=1024))
    with pytest.raises(LorashipError, match=r"convert \(F16 GGUF\) needs about .* GiB free in .*only 0.00 GiB"):
        run_stages(config, ["convert"])
    assert not (stage_dir(config, "convert") / F16_GGUF).exists()


def test_chat_template_is_sandboxed():
    from loraship.chat import render_chat

    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DataError, match="chat template"):
        render_chat(evil, [{"role": "user", "content": "x"}])


def test_truncation_policy(tiny_model):
    from transformers import AutoTokenizer

    from loraship.data import tokenize_rows

    tok = AutoTokenizer.from_pretrained(tiny_model)
    row = {"text": "The capital of Ganraka is Milo. " * 10}
    kept = tokenize_rows([row] * 3, "completion", tok, 16, "truncate")
    assert kept.truncated == 3 and [len(e["input_ids"]) for e in kept.examples] == [16] * 3
    dropped = tokenize_rows([row] * 3, "completion", tok, 16, "drop")
    assert dropped.dropped == 3 and not dropped.examples
    # A chat row whose answer lies wholly past sequence_len has nothing left to learn: dropped, not truncated.
    chat = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "Answer: Milo."}]}
    cut = tokenize_rows([chat], "chat", tok, 16, "truncate")
    assert (cut.truncated, cut.dropped, cut.examples) == (0, 1, [])


def test_everything_dropped_is_a_clear_error(tiny_model, tmp_path):
    long_rows = tmp_path / "long.jsonl"
    long_rows.write_text(json.dumps({"text": "The capital of Ganraka is Milo. " * 10}) + "\n")
    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="drop", sequence_len=16, truncation="drop",
                                           datasets=[{"path": str(long_rows), "type": "completion"}]))
    run_stages(config, ["plan"])
    with pytest.raises(DataError, match="no training examples left"):
        run_stages(config, ["train"])


def test_two_runs_of_the_same_config_do_not_collide(merged_run):
    config, root = merged_run
    config = config.model_copy(update={"run_name": "twice"})
    run_stages(config, ["plan"])
    path = config_file(config, root / "twice.yaml")
    procs = [stage_process("train", path) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert sum("skipped (up to date)" in o for o in outputs) == 1, outputs
    from loraship.manifest import load_verified

    load_verified(stage_dir(config, "train"), "train")  # outputs match the manifest


def test_planted_secret_never_reaches_outputs(tiny_model, tmp_path, monkeypatch):
    secret = "hf_PLANTEDsecret0123456789abcdef"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="secret", **FAST))
    run_stages(config, STAGES)
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks


def test_merge_probe_is_skipped_with_a_reason_rather_than_running_out_of_ram():
    from tasks.merge import probe_device

    assert probe_device(1024)[0] in ("cpu", "cuda")
    device, why = probe_device(10 * 2**50)  # a 10 PiB model fits nowhere
    assert device is None and "GiB" in why
