"""Locks on a run folder that hold where the workdir lives: a local disk, or the ReadWriteMany
volume the Kubernetes pool mounts into every stage's pod.

Two kinds, both made of plain files under `<workdir>/<run_name>/.locks/`:

- The run claim (`run/<holder>.json`): shared by every stage of one config, exclusive against a
  different config with the same run_name. A stage of config B waits while a stage of config A
  runs, and while A's run is between stages (A's claim stays until A's publish finishes or a
  stage of A fails), so B cannot reset a folder that A has yet to read. Between stages, a claim
  made on this host lasts as long as the process that made it (`loraship run` runs every stage
  in one process); one made on another host (a pod per stage) lasts LORASHIP_RUN_IDLE_S.
- The stage lock (`<stage>.lock`): one writer per stage folder. A second run of the same config
  waits here, then finds the first run's manifest and skips.

The GPU slots (loraship/runtime/gpu_slot.py) are lock files of the same kind, shared by every run of a workdir.

Files created with O_EXCL (or hard-linked into place), not flock: flock blocks forever without a
timeout, and on NFS it is emulated by byte-range locks or not at all, depending on the client.
Creating a file exclusively is atomic on local filesystems and on NFSv3 and later. Why not the
`filelock` package: its FileLock is flock/fcntl (the NFS problem above); its SoftFileLock (O_EXCL)
takes over a dead holder on the same host only (filelock 4.3's owner_is_stale: "a foreign
hostname ... cannot establish" it), so a killed pod's lock on the shared volume would stand until
deleted by hand; and neither has the run claim's shape (shared within a config, exclusive
between configs). The heartbeat below is what covers other hosts.

A holder is alive while it can be shown to be: on this host, while its pid runs with the same
start time (pids are reused, and pid 1 runs in every container, so the host name is part of the
identity); on another host, while it touches its file (every HEARTBEAT_S). A stale holder (its
process is gone) is taken over, and the take-over is logged with the dead holder's pid and host.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

from loraship.errors import LorashipError

log = logging.getLogger("loraship")

HEARTBEAT_S = 10.0
# A running holder on another host that has not touched its file for this long is gone
# (12 missed heartbeats: survives a stalled NFS client or a long GC pause).
STALE_S = 120.0
POLL_S = 0.5
TIMEOUT_ENV = "LORASHIP_LOCK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 24 * 3600.0  # a second run of the same config may wait for a whole training
IDLE_ENV = "LORASHIP_RUN_IDLE_S"
# How long a run on other hosts keeps its claim between two stages (a pod scheduled, an image
# pulled) before another config may take the run folder over.
DEFAULT_IDLE_S = 900.0
_BREAKER_STALE_S = 30.0


class LockTimeout(LorashipError):
    """Waited longer than LORASHIP_LOCK_TIMEOUT_S for a lock that another process holds."""


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def idle_s() -> float:
    return float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S))


def host() -> str:
    return socket.gethostname()


def _start_time(pid: int) -> str | None:
    """The kernel's start time of a process (field 22 of /proc/<pid>/stat): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def identity(**extra) -> dict:
    pid = os.getpid()
    return {
        "token": f"{host()}-{pid}-{secrets.token_hex(6)}",
        "pid": pid,
        "host": host(),
        "pid_start": _start_time(pid),
        "since": time.time(),
        **extra,
    }


def is_own_process(holder: dict) -> bool:
    return (
        holder.get("host") == host()
        and holder.get("pid") == os.getpid()
        and holder.get("pid_start") == _start_time(os.getpid())
    )


def _pid_runs(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    start = _start_time(pid)
    return start is None or holder.get("pid_start") in (None, start)


def is_alive(holder: dict, mtime: float, quiet_for_s: float) -> bool:
    """On this host: its process runs. Elsewhere: it touched its file within quiet_for_s."""
    if holder.get("host") == host():
        return _pid_runs(holder)
    return time.time() - mtime < quiet_for_s


def describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    what = ", ".join(f"{k} {holder[k]}" for k in ("stage", "config") if holder.get(k))
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')!r}" + (f" ({what})" if what else "") + f", since {since}"
    )


def _read(path: Path) -> tuple[dict, float] | None:
    try:
        st = path.stat()
        holder = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        # Hard-linked into place whole, so an unreadable lock is damaged, not half-written:
        # treat it as a holder on no host that never heartbeats (stale after STALE_S).
        with contextlib.suppress(OSError):
            return {"pid": None, "host": "?", "since": 0.0}, path.stat().st_mtime
        return None
    return (holder if isinstance(holder, dict) else {}), st.st_mtime


def _create(path: Path, holder: dict) -> bool:
    """Create path holding `holder`, whole, only if it does not exist yet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}.{holder['token']}")
    tmp.write_text(json.dumps(holder), encoding="utf-8")
    try:
        os.link(tmp, path)  # atomic, and the file appears with its content
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
            raise
        # Filesystems without hard links (some SMB/FUSE volumes): O_EXCL, then write.
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(holder))
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _remove_if_held_by(path: Path, token: str | None) -> bool:
    """Remove a lock file only if it still belongs to `token` (a check-then-remove guarded by a
    breaker file, so two processes taking over the same stale lock cannot remove a fresh one)."""
    breaker = path.with_name(path.name + ".break")
    me = identity()
    if not _create(breaker, me):
        found = _read(breaker)
        if found is None or time.time() - found[1] > _BREAKER_STALE_S:
            with contextlib.suppress(FileNotFoundError):
                breaker.unlink()  # a breaker is held for milliseconds; one this old was left by a kill
        return False
    try:
        found = _read(path)
        if found is None or found[0].get("token") != token:
            return False
        path.unlink(missing_ok=True)
        return True
    finally:
        breaker.unlink(missing_ok=True)


class _Heartbeat:
    """One daemon thread per process touching every lock file this process holds."""

    def __init__(self):
        self.paths: set[Path] = set()
        self.guard = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, path: Path) -> None:
        with self.guard:
            self.paths.add(path)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="loraship-lock-heartbeat", daemon=True)
                self.thread.start()

    def discard(self, path: Path) -> None:
        with self.guard:
            self.paths.discard(path)

    def _run(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            with self.guard:
                paths = list(self.paths)
            for p in paths:
                with contextlib.suppress(OSError):
                    os.utime(p)


_heartbeat = _Heartbeat()


def _timeout_error(what: str, holder: dict, path: Path, waited: float) -> LockTimeout:
    return LockTimeout(
        f"{what}: still held by {describe(holder)} after waiting {waited:.0f} s ({path}). "
        f"Wait for that run to finish; if it is gone for good, delete {path}; "
        f"to wait longer set {TIMEOUT_ENV} (now {timeout_s():.0f})."
    )


def try_take(path: Path, me: dict, what: str) -> tuple[bool, dict | None]:
    """One attempt at the lock file `path` for the holder `me`: (True, None) when it is ours now; (False, holder)
    while a live holder has it; (False, None) when it changed hands meanwhile (released, or a dead holder's file
    removed, which is logged): try again at once."""
    if _create(path, me):
        return True, None
    found = _read(path)
    if found is None:
        return False, None  # released between our attempt and the read
    holder, mtime = found
    if is_alive(holder, mtime, STALE_S):
        return False, holder
    if _remove_if_held_by(path, holder.get("token")):
        log.warning("%s: took over the lock of %s, which is no longer running (%s)", what, describe(holder), path)
    return False, None


@contextlib.contextmanager
def holding(path: Path, me: dict) -> Iterator[dict]:
    """A lock file try_take gave `me`: heartbeat while the block runs, removed after it (if still ours)."""
    _heartbeat.add(path)
    try:
        yield me
    finally:
        _heartbeat.discard(path)
        found = _read(path)
        if found is not None and found[0].get("token") == me["token"]:
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive_lock(path: Path, what: str, timeout: float | None = None, **info) -> Iterator[dict]:
    """Hold `path` as an exclusive lock for the block; wait up to `timeout` seconds for it."""
    path = Path(path)
    timeout = timeout_s() if timeout is None else timeout
    me = identity(**info)
    started, announced = time.monotonic(), False
    while True:
        taken, holder = try_take(path, me, what)
        if taken:
            break
        if holder is None:
            continue
        waited = time.monotonic() - started
        if waited >= timeout:
            raise _timeout_error(what, holder, path, waited)
        if not announced:
            log.info("%s: waiting for %s to release %s", what, describe(holder), path)
            announced = True
        time.sleep(POLL_S)
    with holding(path, me):
        yield me


# -- the run claim ------------------------------------------------------------------------


def _claims(folder: Path) -> list[tuple[Path, dict, float]]:
    out = []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if p.name.startswith(".tmp-"):
            continue  # a claim being rewritten (or left by a kill during the rewrite): not a holder
        found = _read(p)
        if found is not None:
            out.append((p, *found))
    return out


def _ancestors() -> set[int]:
    """Pids of this process's parent, grandparent, ... on this host."""
    pids, pid = set(), os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _claim_blocks(holder: dict, mtime: float, config: str) -> bool | None:
    """True: a live claim of another config. False: no obstacle. None: a dead claim to remove."""
    if holder.get("host") == host() and holder.get("pid") in _ancestors():
        # The process that started this one (a driver that ran earlier stages in-process) waits
        # for it to finish; waiting for that process in turn would never end.
        return False
    if holder.get("config") == config or is_own_process(holder):
        # Our own config shares the claim; this very process has moved on from its earlier
        # config (its stages run one after the other), so that claim no longer protects anything.
        return False if holder.get("config") == config or holder.get("running") else None
    quiet = STALE_S if holder.get("running") else idle_s()
    return True if is_alive(holder, mtime, quiet) else None


@contextlib.contextmanager
def run_claim(locks_dir: Path, run_name: str, config: str, stage: str, timeout: float | None = None) -> Iterator[dict]:
    """Share the run folder with stages of the same config; wait while another config has it.

    The claim outlives the stage (marked not running) so the run keeps the folder between stages;
    release_run() drops it when the run is over (published, or failed).
    """
    locks_dir = Path(locks_dir)
    folder = locks_dir / "run"
    folder.mkdir(parents=True, exist_ok=True)
    timeout = timeout_s() if timeout is None else timeout
    me = identity(stage=stage, config=config, running=True)
    mine = folder / f"{me['token']}.json"
    started, announced = time.monotonic(), False
    while True:
        with exclusive_lock(locks_dir / "run.mutex", f"run {run_name!r} claim table", timeout=timeout):
            blocking = None
            for path, holder, mtime in _claims(folder):
                verdict = _claim_blocks(holder, mtime, config)
                if verdict is None:
                    path.unlink(missing_ok=True)
                    if not is_own_process(holder):
                        log.warning(
                            "run %r: dropped the claim of %s, which is no longer running", run_name, describe(holder)
                        )
                elif verdict and blocking is None:
                    blocking = (path, holder)
            if blocking is None:
                _create(mine, me)
                break
        waited = time.monotonic() - started
        if waited >= timeout:
            raise _timeout_error(
                f"run {run_name!r} (config {config[:12]}) is in use by another config",
                blocking[1],
                blocking[0],
                waited,
            )
        if not announced:
            log.info("run %r: waiting, its folder is in use by another config: %s", run_name, describe(blocking[1]))
            announced = True
        time.sleep(POLL_S)
    _heartbeat.add(mine)
    try:
        yield me
    finally:
        _heartbeat.discard(mine)
        # Keep the claim between stages, marked as not running (its heartbeat stops now).
        with contextlib.suppress(OSError):
            tmp = mine.with_name(f".tmp-{mine.name}")
            tmp.write_text(json.dumps({**me, "running": False, "ended": time.time()}), encoding="utf-8")
            os.replace(tmp, mine)


def release_run(locks_dir: Path, config: str) -> None:
    """The run of `config` is over: drop its claims, except those of stages still running."""
    folder = Path(locks_dir) / "run"
    for leftover in folder.glob(".tmp-*") if folder.is_dir() else []:
        with contextlib.suppress(OSError):
            if time.time() - leftover.stat().st_mtime > STALE_S:
                leftover.unlink()
    for path, holder, mtime in _claims(folder):
        if holder.get("config") != config:
            continue
        if holder.get("running") and not is_own_process(holder) and is_alive(holder, mtime, STALE_S):
            continue
        path.unlink(missing_ok=True)
