"""Child processes for long native work (convert, quantize, llama.cpp for the CLI)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from loraship.errors import LorashipError
from loraship.runtime.manifest import atomic_path

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# What a converter or quantizer needs from the stage's environment. Everything else (HF_TOKEN,
# cloud keys, secrets exported from Prefect blocks) stays out of the child: it reads local files
# only, and a crash dump or a verbose log of it must not hold a credential.
CHILD_ENV_KEEP = (
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "HF_HOME",
    "XDG_CACHE_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "LORASHIP_CACHE",
)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """An explicit environment for a child: the variables above, never credentials."""
    env = {k: os.environ[k] for k in CHILD_ENV_KEEP if k in os.environ}
    env.update(extra or {})
    return env


def child_setup() -> None:
    # If the stage process is killed (kill -9, OOM killer, pod eviction), its converter child
    # must not live on and write into a folder a rerun is already using.
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def kill_group(proc: subprocess.Popen) -> None:
    """The child leads its own session (start_new_session), so its process group holds it and
    anything it started: kill them all, not only the child."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)


def run_child(
    cmd: list[str],
    timeout: float,
    what: str,
    extra_env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> subprocess.CompletedProcess:
    """Run cmd in its own session with an explicit environment; on timeout, an error or an
    interrupt of the stage, kill its whole process group.

    on_line: called in this thread with every line the child prints (stdout and stderr, split at
    \\n and \\r, which tqdm's bars use), as it prints it: the stage's live progress.
    """
    if on_line is not None:
        # A Python child writes its stdout through as it goes, not in 8 KiB blocks at the end.
        extra_env = {"PYTHONUNBUFFERED": "1", **(extra_env or {})}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=on_line is None,
        env=child_env(extra_env),
        start_new_session=True,
        preexec_fn=child_setup,
    )
    try:
        if on_line is None:
            stdout, stderr = proc.communicate(timeout=timeout)
        else:
            stdout, stderr = _stream(proc, time.monotonic() + timeout, on_line)
    except subprocess.TimeoutExpired as e:
        kill_group(proc)
        raise LorashipError(
            f"{what} did not finish within {timeout} s; it was stopped. "
            "Look for a hung or very slow disk, or raise the stage's TIMEOUT_S"
        ) from e
    except BaseException:
        kill_group(proc)
        raise
    # A grandchild may outlive a child that exited; it must not write on after the stage moved on.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def start_child(cmd: list[str], stderr) -> subprocess.Popen:
    """A long-lived child talked to through its stdin and stdout (text), isolated as run_child's are:
    its own session, an explicit environment, killed with the process that started it."""
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=child_env(),
        start_new_session=True,
        preexec_fn=child_setup,
    )


def stop_child(proc: subprocess.Popen) -> None:
    """End a start_child child: it stops when its input ends; whatever is left of its group is killed."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    kill_group(proc)
    with contextlib.suppress(OSError):
        proc.stdout.close()


_LINE_END = re.compile(rb"\r\n|\r|\n")


def _read_pipe(pipe, name: str, lines: queue.Queue) -> None:
    """Drain one pipe as fast as the child writes it (a full pipe would block the child), handing
    complete lines to the queue; None when the pipe closed."""
    pending = b""
    for chunk in iter(lambda: pipe.read1(65536), b""):
        pending += chunk
        *complete, pending = _LINE_END.split(pending)
        for line in complete:
            lines.put((name, line))
    if pending:
        lines.put((name, pending))
    lines.put((name, None))


def _stream(proc: subprocess.Popen, deadline: float, on_line: Callable[[str], None]) -> tuple[str, str]:
    """Both pipes read by threads; on_line called here, in the stage's thread, where its Prefect run
    context lives. Raises TimeoutExpired after the deadline."""
    lines: queue.Queue = queue.Queue()
    readers = [
        threading.Thread(target=_read_pipe, args=(pipe, name, lines), daemon=True)
        for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
    ]
    for reader in readers:
        reader.start()
    text: dict[str, list[str]] = {"stdout": [], "stderr": []}
    open_pipes = len(readers)
    while open_pipes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise subprocess.TimeoutExpired(proc.args, 0)
        try:
            name, raw = lines.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            if proc.poll() is not None:
                # Exited, but a grandchild still holds the pipes open: end it so they close.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            continue
        if raw is None:
            open_pipes -= 1
            continue
        line = raw.decode("utf-8", errors="replace")
        if line.strip():
            text[name].append(line)
            on_line(line)
    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    return "\n".join(text["stdout"]), "\n".join(text["stderr"])


def write_with_tool(
    cmd_for, out_file: Path, what: str, timeout: float, on_line: Callable[[str], None] | None = None
) -> None:
    """Run cmd_for(tmp_path) in a child process that writes tmp_path; rename it to out_file on success.

    A timeout here, not in Prefect: a task timeout cannot interrupt blocking native code.
    on_line: see run_child.
    """
    with atomic_path(out_file) as tmp:
        result = run_child(cmd_for(tmp), timeout, what, on_line=on_line)
        if result.returncode != 0 or not tmp.is_file():
            tail = "\n".join(result.stderr.strip().splitlines()[-15:])
            raise LorashipError(f"{what} failed (exit {result.returncode}):\n{tail}")
