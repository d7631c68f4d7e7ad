"""Memory and CPUs this process may use: the container's cgroup limits, not the host's.

Inside a Kubernetes pod with a 64 Gi limit on a 1 TiB node, /proc/meminfo and os.cpu_count()
describe the node; a merge probe sized by them is killed by the OOM killer half-way. The kernel
enforces the cgroup's memory.max (v2) or memory.limit_in_bytes (v1) and cpu.max or
cpu.cfs_quota_us/cpu.cfs_period_us, on this process's cgroup and every cgroup above it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF = Path("/proc/self")
# cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages), not "max".
_V1_UNLIMITED = 1 << 60


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroups(proc_self: Path) -> dict[str, str]:
    """controller (or '' for the v2 unified hierarchy) -> this process's cgroup path."""
    text = _read(proc_self / "cgroup") or ""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _chain(base: Path, path: str) -> list[Path]:
    """The cgroup folder of `path` and every ancestor that is visible under `base`. Inside a
    container with its own cgroup namespace the process sits at '/', and base itself holds the limits."""
    folders, rel = [], Path(path.lstrip("/"))
    while True:
        folder = base / rel
        if folder.is_dir():
            folders.append(folder)
        if rel == Path(".") or str(rel) == "":
            break
        rel = rel.parent
    return folders


def _number(text: str | None) -> int | None:
    if text is None or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _V1_UNLIMITED else value


def memory_limit(root: Path | None = None, proc_self: Path | None = None) -> tuple[int, int] | None:
    """(limit, usage) in bytes of the tightest memory cgroup above this process, or None when unlimited."""
    root, groups = root or CGROUP_ROOT, _own_cgroups(proc_self or PROC_SELF)
    candidates = []
    if "" in groups:  # v2 (or the unified part of a hybrid setup)
        for folder in _chain(root, groups[""]):
            limit = _number(_read(folder / "memory.max"))
            if limit is not None:
                candidates.append((limit, _number(_read(folder / "memory.current")) or 0))
    if "memory" in groups:  # v1
        for base in (root / "memory", root):
            for folder in _chain(base, groups["memory"]):
                limit = _number(_read(folder / "memory.limit_in_bytes"))
                if limit is not None:
                    candidates.append((limit, _number(_read(folder / "memory.usage_in_bytes")) or 0))
    if not candidates:
        return None
    return min(candidates, key=lambda c: c[0] - c[1])


def host_available_memory() -> int:
    """MemAvailable (free + reclaimable page cache), as the kernel estimates it."""
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory(root: Path | None = None, proc_self: Path | None = None) -> int:
    """Bytes this process can still allocate: the host's available memory, capped by the room
    left under its cgroup's limit."""
    available = host_available_memory()
    limit = memory_limit(root, proc_self)
    if limit is not None:
        available = min(available, max(0, limit[0] - limit[1]))
    return available


def cpu_limit(root: Path | None = None, proc_self: Path | None = None) -> float | None:
    """CPUs allowed by the tightest CPU quota above this process (cpu.max or cfs quota/period)."""
    root, groups = root or CGROUP_ROOT, _own_cgroups(proc_self or PROC_SELF)
    quotas = []
    if "" in groups:
        for folder in _chain(root, groups[""]):
            parts = (_read(folder / "cpu.max") or "").split()
            if len(parts) == 2 and parts[0] != "max":
                quotas.append(int(parts[0]) / int(parts[1]))
    for key in ("cpu", "cpuacct"):
        if key in groups:
            for base in (root / "cpu", root / "cpu,cpuacct", root):
                for folder in _chain(base, groups[key]):
                    quota = _read(folder / "cpu.cfs_quota_us")
                    period = _read(folder / "cpu.cfs_period_us")
                    if quota and period and int(quota) > 0:
                        quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def cpu_count(root: Path | None = None, proc_self: Path | None = None) -> int:
    """Threads worth starting (llama.cpp's tools, its server, verify's measuring child): CPUs this process may run on
    (affinity), capped by the CPU quota and by OMP_NUM_THREADS where it is set, the thread budget this process was
    given. llama.cpp's threads spin at every barrier: two test workers each starting 2 on 2 cores ran verify's
    llama.cpp 10x slower than one thread each (prompt 21 tokens/s, a 135M Q4_K_M; bench/results/ci_time.json).
    Callers pass it for the batch (prompt) threads too (llama_threads)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cpu_limit(root, proc_self)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    budget = os.environ.get("OMP_NUM_THREADS", "").strip()
    if budget.isdigit() and int(budget) > 0:
        cpus = min(cpus, int(budget))
    return max(1, cpus)


def llama_threads() -> dict:
    """llama_cpp.Llama's thread arguments: cpu_count() for generation and for prompt batches alike. Left unset,
    llama-cpp-python gives batches every core of the host (a 135M model scored prompts 12x slower beside another busy
    process: bench/results/ci_time.json)."""
    threads = cpu_count()
    return {"n_threads": threads, "n_threads_batch": threads}
