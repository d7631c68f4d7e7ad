"""Quantize: F16 GGUF -> Q4_K_M (or Q5_K_M, Q8_0) with llama-cpp-python's llama_model_quantize.

The binding is the same llama.cpp that verify loads. It runs in a child process with a
timeout, so a hang or crash in native code cannot wedge the flow.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from loraship.constants import F16_GGUF, GGUF_FILE_TYPES, GGUF_KEY_FILE_TYPE, quantized_gguf_name
from loraship.gguf_info import read_gguf, read_gguf_of_type
from loraship.proc import write_with_tool
from loraship.progress import LlamaCppProgress, artifact_key
from loraship.resources import cpu_count
from loraship.preflight import check_free_disk
from loraship.stage import exclusive, main, open_stage, reset_dir

STAGE = "quantize"
UPSTREAM = ("convert",)
FIELDS = ("quantization",)
TIMEOUT_S = 4 * 3600
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


def quantize(src: Path, dst: Path, quantization: str, progress_key: str | None = None) -> None:
    """progress_key: the Prefect progress artifact's key (loraship/progress.py) inside a flow run."""
    progress = LlamaCppProgress(f"{STAGE} {quantization}", log, key=progress_key)
    # Threads from the CPU quota and affinity, not the host's core count: in a pod limited to 8 CPUs
    # on a 128-core node, 128 threads would thrash.
    write_with_tool(
        lambda tmp: [sys.executable, "-c", _WORKER, str(src), str(tmp), str(GGUF_FILE_TYPES[quantization]),
                     str(cpu_count())],
        dst, f"llama_model_quantize to {quantization}", TIMEOUT_S, on_line=progress,
    )
    progress.close()


@exclusive
def run(config) -> dict:
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS)
    if ctx.done:
        return ctx.done
    reset_dir(ctx)
    src = ctx.upstream_dir("convert") / F16_GGUF
    read_gguf(src)  # refuses a truncated input with the file's name before any work
    check_free_disk(ctx.dir, src.stat().st_size * 0.6, f"quantize ({config.quantization})")
    out = ctx.dir / quantized_gguf_name(config.quantization)
    quantize(src, out, config.quantization, progress_key=artifact_key(config.run_name, STAGE, "progress"))
    info = read_gguf_of_type(out, config.quantization)
    size = out.stat().st_size
    return ctx.finish(
        {
            "quantization": config.quantization,
            "file_type": info["fields"][GGUF_KEY_FILE_TYPE],
            "tensor_count": info["tensor_count"],
            "bytes": size,
            "compression_vs_f16": round(src.stat().st_size / size, 3),
        }
    )


if __name__ == "__main__":
    main(run)
