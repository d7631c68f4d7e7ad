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
from loraship.runtime.stage import stage_dir
from tests.conftest import REPO, demo_config_dict

# FAST trains a few steps for tests that stop before verify (kills during training, OOM, disk);
# a run that goes through verify trains as the demo does (configs/demo.yaml), whose quality gates
# pass with a margin on any CPU: 24 small steps left the tiny model on a knife edge (golden_match
# 0.667 against 0.75 on one 2-core machine, passing on another).
FAST = dict(max_steps=24, save_steps=2, micro_batch_size=8, warmup_steps=2)
THROUGH_VERIFY = dict(save_steps=20)


def run_stages(config, stages):
    return {s: importlib.import_module(f"loraship.stages.{s}").run(config) for s in stages}


def config_file(config, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def stage_process(stage: str, cfg_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"loraship.stages.{stage}", str(cfg_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


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
        reference["metrics"]["eval_loss_after"], rel=1e-3
    )


def test_kill_between_the_renames_of_a_folder_swap_keeps_the_old_one_whole(tmp_path, monkeypatch):
    """A checkpoint folder replaces the last one in two renames (no rename replaces a folder): a kill
    between them leaves the older checkpoint whole, aside, and resume takes it (the kill test above
    hit this window under load: resumed from step 0)."""
    import os

    from loraship.runtime import manifest

    last = tmp_path / "checkpoints" / "last"
    with manifest.atomic_path(last) as tmp:
        tmp.mkdir()
        (tmp / "trainer_state.pt").write_text("step 4")
    real_replace = os.replace

    def killed_before_the_new_one_lands(src, dst):
        if Path(src).name.startswith(".tmp-last"):
            raise KeyboardInterrupt("kill -9")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_the_new_one_lands)
    with pytest.raises(KeyboardInterrupt):
        with manifest.atomic_path(last) as tmp:
            tmp.mkdir()
            (tmp / "trainer_state.pt").write_text("step 8")
    monkeypatch.setattr(os, "replace", real_replace)
    assert not last.exists()
    assert (manifest.aside_of(last) / "trainer_state.pt").read_text() == "step 4"
    with manifest.atomic_path(last) as tmp:  # the next checkpoint lands and clears what was aside
        tmp.mkdir()
        (tmp / "trainer_state.pt").write_text("step 12")
    assert (last / "trainer_state.pt").read_text() == "step 12" and manifest.aside_of(last) is None


@pytest.fixture(scope="module")
def merged_run(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    config = parse_config(demo_config_dict(tiny_model, root, run_name="faults", **THROUGH_VERIFY))
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
            importlib.import_module("loraship.stages.quantize").run(config)
    if out.exists():  # renamed only once the converter finished, so it must read back
        from loraship.llamacpp.gguf_info import read_gguf

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
    from loraship.llamacpp.gguf_info import read_gguf

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
            importlib.import_module("loraship.stages.quantize").run(
                config.model_copy(update={"quantization": ["Q5_K_M"]})
            )
    finally:
        manifest_path.write_text(original)


def test_out_of_memory_replans_and_records_why(merged_run, monkeypatch):
    import torch

    import loraship.stages.train as train

    config, _ = merged_run
    config = config.model_copy(update={"run_name": "oom", **FAST, "gradient_accumulation_steps": 1})
    real = train.train_once
    calls = []

    def flaky(config_, ctx, model_dir, plan, *args, **kwargs):
        calls.append(plan.strategy.to_json())
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(config_, ctx, model_dir, plan, *args, **kwargs)

    monkeypatch.setattr(train, "train_once", flaky)
    manifest = run_stages(config, ["plan", "train"])["train"]
    retries = manifest["metrics"]["oom_retries"]
    assert len(calls) == 2 and len(retries) == 1
    assert retries[0]["under_predicted"]  # names the component
    first, second = calls
    assert second != first
    # the user's effective batch is kept
    assert (
        second["micro_batch_size"] * second["gradient_accumulation_steps"]
        == first["micro_batch_size"] * first["gradient_accumulation_steps"]
    )


def test_disk_preflight_refuses_before_writing(merged_run, monkeypatch):
    import shutil

    from loraship.planning import preflight

    config, _ = merged_run
    config = config.model_copy(update={"run_name": "nodisk", **FAST})
    run_stages(config, ["plan", "train", "merge"])
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=1024))
    with pytest.raises(LorashipError, match=r"convert \(F16 GGUF\) needs about .* GiB free in .*only 0.00 GiB"):
        run_stages(config, ["convert"])
    assert not (stage_dir(config, "convert") / F16_GGUF).exists()


def test_chat_template_is_sandboxed(tiny_model):
    from transformers import AutoTokenizer

    from loraship.chat import render

    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DataError, match="chat template"):
        render(AutoTokenizer.from_pretrained(tiny_model), [{"role": "user", "content": "x"}], template=evil)


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
    # imatrix: false: its 73 tokens are too few for an importance matrix, which the plan would refuse first.
    config = parse_config(
        demo_config_dict(
            tiny_model,
            tmp_path,
            run_name="drop",
            sequence_len=16,
            truncation="drop",
            datasets=[{"path": str(long_rows), "type": "completion"}],
            imatrix=False,
        )
    )
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
    from loraship.runtime.manifest import load_verified

    load_verified(stage_dir(config, "train"), "train")  # outputs match the manifest


def test_planted_secret_never_reaches_outputs(tiny_model, tmp_path, monkeypatch):
    secret = "hf_PLANTEDsecret0123456789abcdef"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="secret", **THROUGH_VERIFY))
    run_stages(config, STAGES)
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks


def test_merge_probe_is_skipped_with_a_reason_rather_than_running_out_of_ram():
    from loraship.stages.merge import probe_device

    assert probe_device(1024)[0] in ("cpu", "cuda")
    device, why = probe_device(10 * 2**50)  # a 10 PiB model fits nowhere
    assert device is None and "GiB" in why


RUN_ALL = """
import importlib, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from loraship.config import load_config
from loraship.constants import STAGES
config = load_config(sys.argv[1])
for stage in STAGES:
    importlib.import_module(f"loraship.stages.{stage}").run(config)
print("published", config.output, flush=True)
"""


def other_config(config):
    """Another config with the same run_name: a looser perplexity gate (so it redoes verify, the
    folder the first config's publish reads) and another destination."""
    return config.model_copy(
        update={
            "perplexity_ratio_max": config.gate_limits("Q4_K_M")["perplexity_ratio_max"] + 0.5,
            "output": config.output + "-b",
        }
    )


def test_two_configs_with_the_same_run_name_at_once(merged_run):
    """Two configs under one run_name, started together: the second waits until the first's run
    is published (it must not reset a folder the first has yet to read), then runs its own."""
    from loraship.runtime.manifest import load_verified

    config, root = merged_run
    first, second = config, other_config(config)
    procs = []
    for c, name in ((first, "first.yaml"), (second, "second.yaml")):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RUN_ALL, str(config_file(c, root / name))],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        if c is first:  # the second starts once the first holds the run folder
            claims = stage_dir(config, "plan").parent / ".locks" / "run"
            deadline = time.time() + 120
            while (
                not [p for p in claims.glob("*.json") if f'"pid": {procs[0].pid},' in p.read_text()]
                and procs[0].poll() is None
                and time.time() < deadline
            ):
                time.sleep(0.05)
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "waiting, its folder is in use by another config" in outputs[1], outputs[1]
    assert "stage verify: up to date" not in outputs[1]  # redone for the second config
    for c in (first, second):
        artifact = Path(c.output) / c.run_name
        published = json.loads((artifact / MANIFEST_NAME).read_text())
        # each artifact carries its own config's verification, not the other's
        verify_manifest = json.loads((artifact / "manifests" / "verify.json").read_text())
        assert verify_manifest["config"]["perplexity_ratio_max"] == c.perplexity_ratio_max
        for rel, info in published["files"].items():
            assert sha256_of(artifact / rel) == info["sha256"], rel
    for stage in STAGES:
        load_verified(stage_dir(second, stage), stage)


def sha256_of(path: Path) -> str:
    from loraship.runtime.manifest import sha256_file

    return sha256_file(path)


def test_resume_of_a_finished_run_reads_no_output_again(merged_run, monkeypatch):
    """Digests are cached by (device, inode, size, mtime): resuming a finished run re-hashes no
    stage output (about 100 GB of sha256 per 7B run before); a file whose mtime moved is read
    again, once; LORASHIP_FULL_VERIFY=1 reads everything each stage verifies.
    (bench/resume_hashing.py times it on 15 GiB.)"""
    import os

    from loraship.runtime import manifest as mf

    config, _ = merged_run
    config = other_config(config)
    run_stages(config, STAGES)
    calls = []
    real = mf.sha256_file
    # Stage outputs only: plan fingerprints the (small) dataset files on every run, by design.
    datasets = {Path(s.path).resolve() for s in [*config.datasets, *config.eval_datasets]}

    def counted(path, *args, **kwargs):
        if Path(path).resolve() not in datasets:
            calls.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(mf, "sha256_file", counted)
    assert all(m.get("_skipped") for m in run_stages(config, STAGES).values())
    assert calls == []

    gguf = stage_dir(config, "quantize") / "model-Q4_K_M.gguf"
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert all(m.get("_skipped") for m in run_stages(config, STAGES).values())
    assert calls == [gguf]  # the published copy via its hard link shares the inode: not read twice

    calls.clear()
    monkeypatch.setenv(mf.FULL_VERIFY_ENV, "1")
    run_stages(config, STAGES)
    merged = [p for p in calls if p.parent.name == "merged" and p.suffix == ".safetensors"]
    assert merged and len(calls) > len(set(calls))  # every consumer verifies again


def test_publish_puts_back_what_the_destination_lost(merged_run):
    """The destination's own manifest is not trusted: a deleted or altered file is sent again,
    though publish itself is up to date."""
    from loraship.runtime.manifest import sha256_file

    config, _ = merged_run
    config = other_config(config)
    run_stages(config, STAGES)
    artifact = Path(config.output) / config.run_name
    (artifact / "model-Q4_K_M.gguf").unlink()
    card = (artifact / "README.md").read_text()
    (artifact / "README.md").write_text(card.replace("loraship", "LORASHIP"))  # same size, other bytes
    published = run_stages(config, ["publish"])["publish"]
    assert published.get("_skipped")
    for rel, info in published["metrics"]["artifact_files"].items():
        assert sha256_file(artifact / rel) == info["sha256"], rel


@pytest.mark.parametrize("stage", ["plan", "merge", "reference", "quantize", "verify", "publish"])
def test_kill_9_in_a_stage_then_the_rerun_completes(merged_run, stage):
    """kill -9 right after the stage has cleared its folder: nothing it half wrote is accepted
    (no manifest, so downstream refuses it), its locks are taken over, and the rerun completes.
    (train and convert: the tests above.)"""
    from loraship.runtime.manifest import load_verified

    config, root = merged_run
    run_stages(config, STAGES)
    folder = stage_dir(config, stage)
    (folder / MANIFEST_NAME).unlink()  # make the stage run again
    sentinel = folder / "sentinel"
    sentinel.write_text("removed when the stage starts over")
    proc = stage_process(stage, config_file(config, root / f"kill-{stage}.yaml"))
    deadline = time.time() + 300
    while sentinel.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0]
    killed = proc.returncode == -signal.SIGKILL
    assert killed or proc.returncode == 0, out
    print(f"kill -9 in {stage}: {'killed mid-stage' if killed else 'finished before the kill landed'}")
    if not (folder / MANIFEST_NAME).exists():
        readers = [s for s in STAGES if stage in importlib.import_module(f"loraship.stages.{s}").UPSTREAM]
        if readers:
            with pytest.raises(IntegrityError, match="has no manifest"):
                importlib.import_module(f"loraship.stages.{readers[0]}").run(config)
    rerun = run_stages(config, STAGES)
    for s in STAGES:
        load_verified(stage_dir(config, s), s)
    assert not list(folder.rglob(".tmp-*"))
    assert not rerun[stage].get("_skipped") or not killed
    assert not (folder.parent / ".locks" / f"{stage}.lock").exists()
