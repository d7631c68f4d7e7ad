"""Child processes for long native work (convert, quantize)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from loraship.errors import LorashipError
from loraship.manifest import atomic_path

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# What a converter or quantizer needs from the stage's environment. Everything else (HF_TOKEN,
# cloud keys, secrets exported from Prefect blocks) stays out of the child: it reads local files
# only, and a crash dump or a verbose log of it must not hold a credential.
CHILD_ENV_KEEP = (
    "PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONHASHSEED",
    "VIRTUAL_ENV", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
    "HF_HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "LORASHIP_CACHE",
)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """An explicit environment for a child: the variables above, never credentials."""
    env = {k: os.environ[k] for k in CHILD_ENV_KEEP if k in os.environ}
    env.update(extra or {})
    return env


def _child_setup() -> None:
    # If the stage process is killed (kill -9, OOM killer, pod eviction), its converter child
    # must not live on and write into a folder a rerun is already using.
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen) -> None:
    """The child leads its own session (start_new_session), so its process group holds it and
    anything it started: kill them all, not only the child."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)


def run_child(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run cmd in its own session with an explicit environment; on timeout, an error or an
    interrupt of the stage, kill its whole process group."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True, preexec_fn=_child_setup)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        _kill_group(proc)
        raise LorashipError(f"{what} did not finish within {timeout} s; it was stopped. "
                            "Look for a hung or very slow disk, or raise the stage's TIMEOUT_S") from e
    except BaseException:
        _kill_group(proc)
        raise
    # A grandchild may outlive a child that exited; it must not write on after the stage moved on.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def write_with_tool(cmd_for, out_file: Path, what: str, timeout: float) -> None:
    """Run cmd_for(tmp_path) in a child process that writes tmp_path; rename it to out_file on success.

    A timeout here, not in Prefect: a task timeout cannot interrupt blocking native code.
    """
    with atomic_path(out_file) as tmp:
        result = run_child(cmd_for(tmp), timeout, what)
        if result.returncode != 0 or not tmp.is_file():
            tail = "\n".join(result.stderr.strip().splitlines()[-15:])
            raise LorashipError(f"{what} failed (exit {result.returncode}):\n{tail}")
