"""verify's llama.cpp measuring child: the stage writes a job file, a fresh Python process loads the GGUF in
llama-cpp-python, runs one entry of this module (measure, measure_adapter, or a bench script's own) with it, and
writes the result as JSON; measure_apart is the stage's side. A native crash there is reported, not fatal to the
stage, and each GGUF gets a process of its own."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from loraship.errors import LorashipError
from loraship.planning import inference_memory as im
from loraship.planning.resources import llama_threads
from loraship.verification.llama_ops import adds_bos, is_eog, vocab_of
from loraship.verification.scoring import (
    builtin_engine_report,
    eval_agreement,
    golden_agreement,
    gguf_topk,
    tokenizer_parity,
)

MEASURE_TIMEOUT_S = 3 * 3600
log = logging.getLogger("loraship.verify")

# n_cpu_moe: llama-cpp-python takes no such argument (its Llama() ignores unknown ones), so the child sets llama.cpp's
# tensor overrides itself before the load (loraship/llamacpp/cpu_moe.py, standard library only) and reports them.
# The child loads the GGUF with nothing but the standard library and llama_cpp imported, then imports
# the entry's module: on the H200 a CUDA load after `import numpy` segfaults (in llama.cpp's print_info),
# and this module imports numpy; llama_cpp loads its CUDA libraries before it imports numpy, and that
# order works (bench/results/verify_gpu_bisect.json, then the 7B and 14B rows of verify_gpu.json).
_MEASURE = """
import json, sys, time
job = json.loads(open(sys.argv[2], encoding="utf-8").read())
from llama_cpp import Llama
overrides = []
if job.get("n_cpu_moe"):
    from loraship.llamacpp.cpu_moe import keep_experts_in_cpu_memory
    overrides = keep_experts_in_cpu_memory(job["n_cpu_moe"])
started = time.perf_counter()
llm = Llama(**job["llama"])
load_seconds = time.perf_counter() - started
import importlib, logging
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
module = importlib.import_module(sys.argv[1])
result = getattr(module, sys.argv[4])(job, llm, load_seconds)
if overrides:
    result["tensor_buft_overrides"] = overrides
open(sys.argv[3], "w", encoding="utf-8").write(json.dumps(result, default=float))
"""


def measure_apart(ctx, job: dict, entry: str = "measure", module: str | None = None) -> dict:
    """measure(job) (or another function of this module, or of `module`) in a fresh child process: a
    native crash there is reported, not fatal to the stage. bench/quant_ladder_gpu.py loads each rung
    here, as verify does, and times it with its own entry."""
    import json
    import sys

    from loraship.llamacpp.llama_child import child_death, native_crash_hint
    from loraship.runtime.proc import run_child

    job_file, result_file = ctx.dir / ".measure-job.json", ctx.dir / ".measure-result.json"
    # llama.cpp's arguments, decided here: the child loads before it imports anything of loraship.
    llama = {
        "model_path": job["gguf"],
        "n_ctx": job["n_ctx"],
        "n_gpu_layers": job["n_gpu_layers"],
        "logits_all": True,
        "seed": job["seed"],
        **llama_threads(),
        "verbose": os.environ.get("LORASHIP_LLAMA_VERBOSE") == "1",
    }
    if job.get("lora"):
        llama.update(lora_path=job["lora"], lora_scale=1.0)
    job_file.write_text(json.dumps({**job, "llama": llama}), encoding="utf-8")
    result_file.unlink(missing_ok=True)
    module = module or __name__
    keep = {k: os.environ[k] for k in ("LORASHIP_LLAMA_VERBOSE", "PYTHONUNBUFFERED") if k in os.environ}
    done = run_child(
        [sys.executable, "-c", _MEASURE, module, str(job_file), str(result_file), entry],
        MEASURE_TIMEOUT_S,
        f"verify's llama.cpp run on {Path(job['gguf']).name}",
        extra_env=keep,
    )
    if keep.get("LORASHIP_LLAMA_VERBOSE") == "1" or done.returncode != 0:
        sys.stderr.write(done.stderr)
    if done.returncode != 0 or not result_file.is_file():
        raise LorashipError(
            f"llama.cpp failed while loading or running {job['gguf']} {child_death(done.returncode, done.stderr)}\n"
            "A GGUF that llama-cpp-python cannot load is a llama.cpp version mismatch or a broken file: run the "
            "convert and quantize stages again with this image's llama-cpp-python; out of memory: lower target_context"
            + native_crash_hint(done.returncode)
        )
    result = json.loads(result_file.read_text(encoding="utf-8"))
    job_file.unlink(missing_ok=True)
    result_file.unlink(missing_ok=True)
    return result


# -- the child's entries ---------------------------------------------------------------------------
def llama_cpp_tokens(llm, reference: dict) -> dict:
    """What special_tokens_gate judges of the loaded GGUF: whether llama.cpp adds BOS to plain text, and the HF stop
    ids that are not end-of-generation tokens in llama.cpp."""
    import llama_cpp

    vocab = vocab_of(llm)
    not_eog = [t for t in reference["tokenizer"]["stop_ids"] if not llama_cpp.llama_vocab_is_eog(vocab, t)]
    return {"adds_bos": adds_bos(llm), "stop_ids_not_eog": not_eog}


def measure(job: dict, llm, load_seconds: float) -> dict:
    """Everything that needs the GGUF loaded in llama.cpp, in the process that loaded it (_MEASURE)."""
    import json
    from types import SimpleNamespace

    import numpy as np

    cuda = job["device"] == "cuda"
    out = {"load_seconds": round(load_seconds, 2)}
    reference = json.loads(Path(job["reference"]).read_text(encoding="utf-8"))
    with np.load(job["topk"]) as handle:
        topk = {k: handle[k] for k in handle.files}
    log.info("loaded in %.1f s; special tokens, tokenizer parity", out["load_seconds"])
    out["llama_cpp_tokens"] = llama_cpp_tokens(llm, reference)
    out["tokenizer_parity"] = tokenizer_parity(llm, reference)
    log.info("scoring %d eval texts against the reference", len(reference["eval"]))
    out["eval_agreement"] = eval_agreement(llm, reference, topk, job.get("min_scored_tokens", 1))
    stops = set(reference["tokenizer"]["stop_ids"]) | {t for t in range(llm.n_vocab()) if is_eog(llm, t)}
    log.info("answering %d golden prompts", len(reference["golden"]))
    settings = SimpleNamespace(max_new_tokens=job["max_new_tokens"], golden_margin=job["golden_margin"])
    out["golden"] = golden_agreement(llm, reference, settings, stops)
    out["builtin_template_engine"] = builtin_engine_report(llm, reference)
    out["gpu_used_gib"] = im.gpu_used_by_this_process_gib() if cuda else None
    if job.get("merged_topk_out"):
        log.info("top-%d of the merged GGUF for the adapter comparison", reference["top_k"])
        np.savez(job["merged_topk_out"], **gguf_topk(llm, reference, topk, reference["top_k"]))
    return out


def measure_adapter(job: dict, llm, load_seconds: float) -> dict:
    """Base GGUF + adapter GGUF loaded as llama.cpp serves them (llama-server --lora; scale 1, so
    llama.cpp's own alpha / rank), scored on the eval texts against the merged GGUF's top-k that
    measure() wrote; loaded by _MEASURE like measure()'s model."""
    import json

    import numpy as np

    load_seconds = round(load_seconds, 2)
    reference = json.loads(Path(job["reference"]).read_text(encoding="utf-8"))
    with np.load(job["merged_topk"]) as handle:
        merged = {k: handle[k] for k in handle.files}
    log.info("scoring base GGUF + adapter on %d eval texts against the merged GGUF", len(reference["eval"]))
    agreement = eval_agreement(llm, reference, merged) if merged else {"scored_tokens": 0}
    return {"load_seconds": load_seconds, "eval_agreement": agreement}
