"""Heavy imports, made once and without the work nothing here uses."""

from __future__ import annotations

import importlib.util
import sys


def import_peft():
    """peft, which imports bitsandbytes where installed. bitsandbytes' default backend (its CPU path) wraps four
    kernels in torch.compile when imported, and torch.compile imports inductor: about a second of every process
    that imports peft (train, merge), for kernels that only NF4 on the CPU calls. Imported here with torch.compile
    left out, those kernels run eager; on CUDA its own library runs NF4. Train and merge time on the CPU:
    bench/results/ci_time.json."""
    if "bitsandbytes" not in sys.modules and importlib.util.find_spec("bitsandbytes") is not None:
        import torch

        compile_ = torch.compile

        def eager(model=None, **_kwargs):
            return model if model is not None else (lambda fn: fn)

        torch.compile = eager
        try:
            import bitsandbytes  # noqa: F401
        finally:
            torch.compile = compile_
    import peft

    return peft
