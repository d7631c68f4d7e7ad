"""Child processes for long native work (convert, quantize)."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    # If the stage process is killed (kill -9, OOM killer, pod eviction), its converter child
    # must not live on and write into a folder a rerun is already using.
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_child(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run cmd with a timeout (a Prefect timeout cannot interrupt blocking native code)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=_die_with_parent)
