"""Child processes for long native work (convert, quantize)."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from pathlib import Path

from loraship.errors import LorashipError
from loraship.manifest import atomic_path

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    # If the stage process is killed (kill -9, OOM killer, pod eviction), its converter child
    # must not live on and write into a folder a rerun is already using.
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def write_with_tool(cmd_for, out_file: Path, what: str, timeout: float) -> None:
    """Run cmd_for(tmp_path) in a child process that writes tmp_path; rename it to out_file on success.

    A timeout here, not in Prefect: a task timeout cannot interrupt blocking native code.
    """
    with atomic_path(out_file) as tmp:
        try:
            result = subprocess.run(cmd_for(tmp), capture_output=True, text=True, timeout=timeout,
                                    preexec_fn=_die_with_parent)
        except subprocess.TimeoutExpired as e:
            raise LorashipError(f"{what} did not finish within {timeout} s") from e
        if result.returncode != 0 or not tmp.is_file():
            tail = "\n".join(result.stderr.strip().splitlines()[-15:])
            raise LorashipError(f"{what} failed (exit {result.returncode}):\n{tail}")
