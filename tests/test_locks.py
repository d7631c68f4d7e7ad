"""Locks on the run folder: per-stage names, a run claim per config, timeouts naming the holder,
stale holders (dead processes, silent hosts) taken over."""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraship.runtime import locks
from loraship.runtime.stage import stage_name
from tests.conftest import REPO

HOLD = """
import sys, time
from pathlib import Path
from loraship.runtime import locks
kind, path = sys.argv[1], Path(sys.argv[2])
ctx = (locks.exclusive_lock(path, "test lock", stage="train") if kind == "stage"
       else locks.run_claim(path, "r", sys.argv[3], "train"))
with ctx:
    print("held", flush=True)
    time.sleep(600)
"""


def hold(kind: str, path: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, kind, str(path), *args], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_stage_lock_is_named_after_the_stage_even_as_main():
    # `python -m loraship.stages.quantize` runs the module as __main__; the lock must still be quantize's.
    module = runpy.run_module("loraship.stages.quantize", run_name="__main_like__")
    assert module["run"].__wrapped__.__module__ == "__main_like__"
    assert stage_name(module["run"].__wrapped__) == "quantize"


def test_lock_held_by_a_dead_process_is_taken_over(tmp_path, caplog):
    path = tmp_path / ".locks" / "train.lock"
    proc = hold("stage", path)
    holder = json.loads(path.read_text())
    kill9(proc)
    assert path.exists()  # kill -9 leaves the file behind
    with caplog.at_level(logging.WARNING, logger="loraship"):
        with locks.exclusive_lock(path, "stage train", timeout=10) as me:
            assert json.loads(path.read_text())["token"] == me["token"]
    assert f"pid {holder['pid']} on host" in caplog.text and "no longer running" in caplog.text
    assert not path.exists()


def test_lock_timeout_names_the_live_holder(tmp_path):
    path = tmp_path / ".locks" / "train.lock"
    proc = hold("stage", path)
    try:
        with pytest.raises(locks.LockTimeout) as e:
            with locks.exclusive_lock(path, "stage train", timeout=0.5):
                pass
    finally:
        kill9(proc)
    message = str(e.value)
    assert f"pid {proc.pid} on host {locks.host()!r}" in message
    assert str(path) in message and locks.TIMEOUT_ENV in message


def test_holder_on_another_host_is_alive_while_it_heartbeats(tmp_path):
    # On a shared volume the pid of another pod means nothing: its file's mtime is its heartbeat.
    path = tmp_path / "train.lock"
    path.write_text(json.dumps({"token": "x", "pid": 1, "host": "some-other-pod", "since": time.time()}))
    with pytest.raises(locks.LockTimeout, match="pid 1 on host 'some-other-pod'"):
        with locks.exclusive_lock(path, "stage train", timeout=0.3):
            pass
    old = time.time() - locks.STALE_S - 1
    os.utime(path, (old, old))
    with locks.exclusive_lock(path, "stage train", timeout=5):
        pass


def test_run_claim_is_shared_by_a_config_and_exclusive_against_another(tmp_path):
    locks_dir = tmp_path / ".locks"
    proc = hold("claim", locks_dir, "config-A")
    try:
        with locks.run_claim(locks_dir, "r", "config-A", "merge", timeout=5):
            pass  # the same config shares the run folder
        with pytest.raises(locks.LockTimeout, match=f"in use by another config.*pid {proc.pid}"):
            with locks.run_claim(locks_dir, "r", "config-B", "merge", timeout=0.5):
                pass
    finally:
        kill9(proc)
    with locks.run_claim(locks_dir, "r", "config-B", "merge", timeout=5):
        pass  # its holder died: the claim is dropped


def test_run_claim_outlives_a_stage_until_the_run_is_released(tmp_path):
    locks_dir = tmp_path / ".locks"
    claim = locks_dir / "run" / "elsewhere.json"
    claim.parent.mkdir(parents=True)
    # A stage of config A finished on another pod; the next stage of A has not started yet.
    claim.write_text(
        json.dumps(
            {
                "token": "elsewhere",
                "pid": 1,
                "host": "pod-a",
                "config": "config-A",
                "running": False,
                "since": time.time(),
            }
        )
    )
    with pytest.raises(locks.LockTimeout, match="in use by another config"):
        with locks.run_claim(locks_dir, "r", "config-B", "plan", timeout=0.3):
            pass
    locks.release_run(locks_dir, "config-A")  # A published (or failed): the folder is free
    with locks.run_claim(locks_dir, "r", "config-B", "plan", timeout=5):
        pass


def test_idle_claim_of_a_vanished_host_expires(tmp_path, monkeypatch):
    locks_dir = tmp_path / ".locks"
    claim = locks_dir / "run" / "gone.json"
    claim.parent.mkdir(parents=True)
    claim.write_text(json.dumps({"token": "gone", "pid": 1, "host": "pod-a", "config": "config-A", "running": False}))
    old = time.time() - 120
    os.utime(claim, (old, old))
    monkeypatch.setenv(locks.IDLE_ENV, "60")
    with locks.run_claim(locks_dir, "r", "config-B", "plan", timeout=5):
        assert not claim.exists()
