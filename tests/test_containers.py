"""Inside a container: cgroup limits instead of the host's, child processes killed as a group and
without credentials, temporary names unique per container."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from loraship.planning import resources
from loraship.errors import LorashipError
from loraship.runtime.manifest import atomic_path
from loraship.runtime.proc import run_child, write_with_tool

GiB = 2**30


def cgroup_tree(tmp_path: Path, files: dict[str, str], own: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    proc_self = tmp_path / "proc-self"
    proc_self.mkdir()
    (proc_self / "cgroup").write_text(own + "\n")
    return root, proc_self


def test_cgroup_v2_memory_and_cpu_limits(tmp_path, monkeypatch):
    # A 64 GiB pod (4 GiB in use) with 2.5 CPUs on a 1 TiB node: the pod's numbers count.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # make test sets it; its own cap is tested below
    root, proc_self = cgroup_tree(
        tmp_path,
        {
            "kubepods/pod1/memory.max": str(64 * GiB),
            "kubepods/pod1/memory.current": str(4 * GiB),
            "kubepods/pod1/cpu.max": "250000 100000",
            "kubepods/memory.max": "max",
            "kubepods/cpu.max": "max 100000",
        },
        "0::/kubepods/pod1",
    )
    monkeypatch.setattr(resources, "host_available_memory", lambda: 1024 * GiB)
    assert resources.available_memory(root, proc_self) == 60 * GiB
    assert resources.cpu_limit(root, proc_self) == 2.5
    assert resources.cpu_count(root, proc_self) == min(3, len(os.sched_getaffinity(0)))
    # OMP_NUM_THREADS, where set, is the thread budget: it caps the count, never raises it; junk is ignored.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert resources.cpu_count(root, proc_self) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    assert resources.cpu_count(root, proc_self) == min(3, len(os.sched_getaffinity(0)))
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    assert resources.cpu_count(root, proc_self) == min(3, len(os.sched_getaffinity(0)))


def test_cgroup_v1_fallback_and_no_limit(tmp_path, monkeypatch):
    root, proc_self = cgroup_tree(
        tmp_path,
        {
            "memory/docker/abc/memory.limit_in_bytes": str(16 * GiB),
            "memory/docker/abc/memory.usage_in_bytes": str(GiB),
            "cpu/docker/abc/cpu.cfs_quota_us": "100000",
            "cpu/docker/abc/cpu.cfs_period_us": "100000",
        },
        "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc",
    )
    monkeypatch.setattr(resources, "host_available_memory", lambda: 1024 * GiB)
    assert resources.available_memory(root, proc_self) == 15 * GiB
    assert resources.cpu_count(root, proc_self) == 1
    # v1 spells "no limit" as a page-counter maximum
    unlimited, proc2 = cgroup_tree(
        tmp_path / "u", {"memory/memory.limit_in_bytes": str(9223372036854771712)}, "4:memory:/"
    )
    assert resources.memory_limit(unlimited, proc2) is None


def test_merge_probe_respects_the_pod_limit(tmp_path, monkeypatch):
    """A 14B bf16 base (28 GiB: ~70 GiB fp32 probe) inside a 64 GiB pod on a 1 TiB node is skipped,
    not started and OOM-killed; with the pod's limit lifted it runs on the CPU."""
    from loraship.stages.merge import probe_device

    root, proc_self = cgroup_tree(tmp_path, {"memory.max": str(64 * GiB), "memory.current": "0"}, "0::/")
    monkeypatch.setattr(resources, "CGROUP_ROOT", root)
    monkeypatch.setattr(resources, "PROC_SELF", proc_self)
    monkeypatch.setattr(resources, "host_available_memory", lambda: 1024 * GiB)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, why = probe_device(28 * GiB)
    assert device is None and "64.0 GiB" in why
    (root / "memory.max").write_text("max\n")
    assert probe_device(28 * GiB)[0] == "cpu"


def test_child_and_its_children_are_killed_as_a_group_on_timeout(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(LorashipError, match="did not finish within 1 s"):
        run_child(["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], 1, "test tool")
    grandchild = int(pid_file.read_text())
    deadline = time.time() + 10
    while _running(grandchild) and time.time() < deadline:
        time.sleep(0.05)
    assert not _running(grandchild)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_child_gets_no_credentials(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_PLANTED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "PLANTED")
    result = run_child([sys.executable, "-c", "import os; print(sorted(os.environ))"], 60, "env probe")
    assert "HF_TOKEN" not in result.stdout and "AWS_SECRET_ACCESS_KEY" not in result.stdout
    assert "PATH" in result.stdout


def test_failed_tool_leaves_no_output_and_no_temporary(tmp_path):
    out = tmp_path / "model.gguf"
    with pytest.raises(LorashipError, match="exit 3"):
        write_with_tool(lambda tmp: ["sh", "-c", f"echo half > {tmp}; exit 3"], out, "test tool", 60)
    assert list(tmp_path.iterdir()) == []


def test_temporary_names_differ_between_containers_with_the_same_pid(tmp_path):
    # Two containers on one volume both run as pid 1: the temporary name must still differ.
    names = []
    for _ in range(2):
        with atomic_path(tmp_path / "out.bin") as tmp:
            names.append(tmp.name)
            tmp.write_bytes(b"x")
    assert names[0] != names[1]
    assert all(os.uname().nodename in n and f".{os.getpid()}." in n for n in names)


def test_output_data_and_folder_are_synced_before_and_after_the_rename(tmp_path, monkeypatch):
    """After a power loss an output visible under its final name must not be empty: its bytes
    reach the disk before the rename, and the rename itself (the folder entry) right after."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = tmp_path / "merged"
    with atomic_path(final) as tmp:
        tmp.mkdir()
        (tmp / "a.safetensors").write_bytes(b"a")
        (tmp / "b.safetensors").write_bytes(b"b")
    rename = events.index(("replace", str(final)))
    synced_before = {Path(p).name for kind, p in events[:rename] if kind == "fsync"}
    assert {"a.safetensors", "b.safetensors"} <= synced_before
    assert ("fsync", str(tmp_path)) in events[rename:]
