"""Quantize: F16 GGUF -> Q4_K_M (or any of config.Quantization; several in one run) with llama-cpp-python's
llama_model_quantize.

The binding is the same llama.cpp that verify loads. It runs in a child process with a
timeout, so a hang or crash in native code cannot wedge the flow. Adding a quantization to the
list re-runs this stage, but a GGUF the last run made from the same F16 GGUF with the same
llama-cpp-python, still intact, is kept rather than made again.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from loraship.constants import F16_GGUF, GGUF_FILE_TYPES, GGUF_KEY_FILE_TYPE, quantized_gguf_name
from loraship.errors import IntegrityError
from loraship.llamacpp.gguf_info import read_gguf, read_gguf_of_type
from loraship.runtime.manifest import check_outputs, library_versions, read_manifest
from loraship.runtime.proc import write_with_tool
from loraship.runtime.progress import LlamaCppProgress, artifact_key
from loraship.planning.resources import cpu_count
from loraship.planning.preflight import check_free_disk
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir

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
    done = run_child([sys.executable, "-c", _LOAD_CHECK, str(path), *([str(lora)] if lora else [])],
                     LOAD_CHECK_TIMEOUT_S, f"llama.cpp's load check of {path.name}",
                     extra_env={"CUDA_VISIBLE_DEVICES": ""})
    if done.returncode == 0:
        return
    if done.returncode == 4:
        raise IntegrityError(
            f"{lora}: llama.cpp (llama-cpp-python {library_versions().get('llama-cpp-python')}) cannot apply this "
            f"LoRA adapter to {path.name}:\n  " + "\n  ".join(done.stderr.strip().splitlines()[-6:])
            + "\nrun the convert stage again (loraship run CONFIG --from convert); if it fails again, set "
            "adapter_gguf: false and ship the merged GGUF only"
        )
    how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    lines = done.stderr.strip().splitlines()
    reasons = [line.strip() for line in lines if "error" in line.lower() or "failed" in line.lower()] or lines[-8:]
    raise IntegrityError(
        f"{path}: llama.cpp (llama-cpp-python {library_versions().get('llama-cpp-python')}) cannot load it ({how}):\n  "
        + "\n  ".join(reasons[-6:])
        + "\nllama-server and Ollama would refuse it too. A missing or misshapen tensor comes from the checkpoint "
        "(its weights or config.json): fix the base model and run again; otherwise convert again with the pinned "
        "converter (loraship fetch-converter, then loraship run CONFIG --from convert)"
    )


def quantize(src: Path, dst: Path, quantization: str, progress_key: str | None = None) -> None:
    """progress_key: the Prefect progress artifact's key (loraship/runtime/progress.py) inside a flow run."""
    progress = LlamaCppProgress(f"{STAGE} {quantization}", log, key=progress_key)
    # Threads from the CPU quota and affinity, not the host's core count: in a pod limited to 8 CPUs
    # on a 128-core node, 128 threads would thrash.
    write_with_tool(
        lambda tmp: [sys.executable, "-c", _WORKER, str(src), str(tmp), str(GGUF_FILE_TYPES[quantization]),
                     str(cpu_count())],
        dst, f"llama_model_quantize to {quantization}", TIMEOUT_S, on_line=progress,
    )
    progress.close()


def reusable(ctx, quantizations: list[str]) -> list[str]:
    """Outputs of the last run of this stage that are exactly what this run would make: the same
    F16 GGUF (by sha256), the same llama-cpp-python, and the file still matching its manifest."""
    try:
        last = read_manifest(ctx.dir)
    except IntegrityError:
        return []
    if last is None:
        return []
    f16 = ctx.upstream["convert"]["outputs"].get(F16_GGUF, {}).get("sha256")
    same_input = (last.get("inputs", {}).get("convert", {}).get("outputs", {}).get(F16_GGUF, {}).get("sha256") == f16
                  and last.get("versions", {}).get("llama-cpp-python") == library_versions().get("llama-cpp-python"))
    if not same_input:
        return []
    names = [q for q in quantizations if quantized_gguf_name(q) in last.get("outputs", {})]
    return [q for q in names if not check_outputs(last, ctx.dir, only=(quantized_gguf_name(q),))]


def describe(out: Path, quantization: str, f16_bytes: int) -> dict:
    info = read_gguf_of_type(out, quantization)
    size = out.stat().st_size
    return {"quantization": quantization, "file_type": info["fields"][GGUF_KEY_FILE_TYPE],
            "tensor_count": info["tensor_count"], "bytes": size, "compression_vs_f16": round(f16_bytes / size, 3)}


@exclusive
def run(config) -> dict:
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS)
    if ctx.done:
        return ctx.done
    quantizations = config.quantizations
    kept = reusable(ctx, quantizations)
    reset_dir(ctx, keep=tuple(quantized_gguf_name(q) for q in kept))
    src = ctx.upstream_dir("convert") / F16_GGUF
    read_gguf(src)  # refuses a truncated input with the file's name before any work
    todo = [q for q in quantizations if q not in kept]
    if kept:
        log.info("quantize: keeping %s, made from the same F16 GGUF by the last run", ", ".join(kept))
    if todo:
        check_free_disk(ctx.dir, src.stat().st_size * 0.6 * len(todo), f"quantize ({', '.join(todo)})")
    for quantization in todo:
        quantize(src, ctx.dir / quantized_gguf_name(quantization), quantization,
                 progress_key=artifact_key(config.run_name, STAGE, "progress"))
        check_loads(ctx.dir / quantized_gguf_name(quantization))
    each = {q: {**describe(ctx.dir / quantized_gguf_name(q), q, src.stat().st_size), "reused": q in kept}
            for q in quantizations}
    # The primary's figures stay at the top level, where one-quantization runs always had them.
    return ctx.finish({**each[quantizations[0]], "quantizations": each})


if __name__ == "__main__":
    main(run)
