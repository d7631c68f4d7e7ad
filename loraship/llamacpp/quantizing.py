"""Quantizing a GGUF and checking that llama.cpp loads one, each in a child process with a timeout.

The quantize stage makes every shipped quantization with these, and the convert stage quantizes the base
GGUF of adapter_gguf and load-checks what it wrote with the same calls, so both stages import them from here.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from loraship.constants import GGUF_FILE_TYPES
from loraship.errors import IntegrityError
from loraship.planning.resources import cpu_count
from loraship.runtime.manifest import library_versions
from loraship.runtime.proc import write_with_tool
from loraship.runtime.progress import LlamaCppProgress

TIMEOUT_S = 4 * 3600
# The quantize stage's logger and progress label, whichever stage asks: the progress lines read "quantize Q4_K_M: ...".
log = logging.getLogger("loraship.quantize")

_WORKER = """
import sys, llama_cpp
src, dst, ftype, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = ftype
params.nthread = threads
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
sys.exit(rc)
"""


# llama.cpp loads the GGUF as verify and llama-server will (every tensor the architecture needs, by name and
# shape, against the file's size), on the CPU and without a context: what it refuses is caught here, where the
# file was made, not after a reference run at verify. mmap'ed, so a 14B F16 takes no 28 GiB of RAM. The same
# kind of child as verify's llama.cpp runs: llama_cpp imported first, nothing of loraship.
_LOAD_CHECK = """
import sys, llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.n_gpu_layers = 0
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
if not model:
    sys.exit(3)
if len(sys.argv) > 2:  # a LoRA adapter GGUF, applied to this model as llama-server --lora would
    adapter = llama_cpp.llama_adapter_lora_init(model, sys.argv[2].encode())
    if not adapter:
        sys.exit(4)
llama_cpp.llama_model_free(model)
"""
LOAD_CHECK_TIMEOUT_S = 3600


def check_loads(path: Path, lora: Path | None = None) -> None:
    """Refuse a GGUF llama.cpp cannot load (or a LoRA adapter GGUF it cannot apply to it), naming the file and
    llama.cpp's own reason."""
    from loraship.runtime.proc import run_child

    # No GPU: a CPU load checks the file, and needs none of the inference card's memory.
    done = run_child(
        [sys.executable, "-c", _LOAD_CHECK, str(path), *([str(lora)] if lora else [])],
        LOAD_CHECK_TIMEOUT_S,
        f"llama.cpp's load check of {path.name}",
        extra_env={"CUDA_VISIBLE_DEVICES": ""},
    )
    if done.returncode == 0:
        return
    if done.returncode == 4:
        raise IntegrityError(
            f"{lora}: llama.cpp (llama-cpp-python {library_versions().get('llama-cpp-python')}) cannot apply this "
            f"LoRA adapter to {path.name}:\n  "
            + "\n  ".join(done.stderr.strip().splitlines()[-6:])
            + "\nrun the convert stage again (loraship run CONFIG --from convert); if it fails again, set "
            "adapter_gguf: false and ship the merged GGUF only"
        )
    how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    lines = done.stderr.strip().splitlines()
    reasons = [line.strip() for line in lines if "error" in line.lower() or "failed" in line.lower()] or lines[-8:]
    raise IntegrityError(
        f"{path}: llama.cpp (llama-cpp-python {library_versions().get('llama-cpp-python')}) "
        f"cannot load it ({how}):\n  "
        + "\n  ".join(reasons[-6:])
        + "\nllama-server and Ollama would refuse it too. A missing or misshapen tensor comes from the checkpoint "
        "(its weights or config.json): fix the base model and run again; otherwise convert again with the pinned "
        "converter (loraship fetch-converter, then loraship run CONFIG --from convert)"
    )


def quantize(
    src: Path, dst: Path, quantization: str, progress_key: str | None = None, imatrix: Path | None = None
) -> None:
    """progress_key: the Prefect progress artifact's key (loraship/runtime/progress.py) inside a flow run.
    imatrix: llama-quantize --imatrix with this file; None: llama-cpp-python's binding, no importance matrix."""
    progress = LlamaCppProgress(f"quantize {quantization}", log, key=progress_key)
    # Threads from the CPU quota and affinity, not the host's core count: in a pod limited to 8 CPUs
    # on a 128-core node, 128 threads would thrash.
    if imatrix is None:
        write_with_tool(
            lambda tmp: [
                sys.executable,
                "-c",
                _WORKER,
                str(src),
                str(tmp),
                str(GGUF_FILE_TYPES[quantization]),
                str(cpu_count()),
            ],
            dst,
            f"llama_model_quantize to {quantization}",
            TIMEOUT_S,
            on_line=progress,
        )
    else:
        from loraship.llamacpp.tools import tool

        write_with_tool(
            lambda tmp: [
                str(tool("llama-quantize")),
                "--imatrix",
                str(imatrix),
                str(src),
                str(tmp),
                quantization,
                str(cpu_count()),
            ],
            dst,
            f"llama-quantize --imatrix {imatrix.name} to {quantization}",
            TIMEOUT_S,
            on_line=progress,
        )
    progress.close()
