"""Verify: prove the shipped GGUF under the llama.cpp users will run it with, loading nothing else.

Runs on the small inference GPU (CPU in tests) with the GGUF alone: every layer on the GPU at
`target_context`, compared against what the reference stage stored from the merged HF model.
What it reports is what llama.cpp's own `llama-perplexity --kl-divergence` reports (perplexity
ratio, mean and 99th-percentile KL divergence, same-top-token rate), plus:
- the GGUF's file type, chat template and special tokens as a runtime uses them: llama.cpp adds
  BOS to plain text exactly when HF does, the ids both define agree, and every HF stop token ends
  generation in llama.cpp;
- tokenizer parity: llama.cpp tokenizes every eval text and golden prompt as HF did (BOS as served);
- golden prompts: free-running greedy answers equal HF's (golden_match_min), and with HF's answer
  teacher-forced llama.cpp picks HF's token wherever HF leads by golden_margin nats;
- chat answers end with the template's turn-end token, greedy in HF and in llama.cpp alike;
- served: the GGUF behind llama.cpp's OpenAI-compatible server, asked by the `openai` client with the
  sampling settings the artifact ships (loraship/sampling.py, recorded as verify.json's "sampling"), stops
  by itself on every golden chat prompt with the GGUF's own greedy answer, streamed and whole, no template
  marker in the content; what the server's defaults answer is reported beside it (loraship/llamacpp/served.py);
- eval loss after training below the base model's;
- GPU memory: predicted from the GGUF's tensors, and on a GPU measured through NVML, within
  target_gpu_memory_gib; where it does not fit, the largest context and the layers that do.
- with adapter_gguf: base GGUF + adapter GGUF (convert's) against the merged GGUF, both under
  llama.cpp: mean KL divergence and same-top-token rate on the eval texts (adapter_kl_mean_max,
  adapter_same_top_min), a gate that exists only when the adapter GGUF does.
Every gate carries its evidence count and fails with "not enough evidence" below the config's
minimum, never passing as 0/0.

With several quantizations each GGUF is verified the same way, in its own llama.cpp process;
verify.json keeps the primary's (the first's) report and gates at its top level, where a
one-quantization verify.json has them, the others' gates beside them as '<quantization>/<gate>',
and a section per quantization under "quantizations".

KL divergence: exact over the full vocabulary at the positions whose HF distribution the reference
stored whole (its size budget; 2,048 tokens by default), as llama-perplexity --kl-divergence computes
it. Where fewer than min_scored_tokens positions have it, the top-k bound: HF's top-k log-probs per
position with the rest lumped into one tail bucket; by the log-sum inequality KL over (top-k, tail)
is a lower bound of the full KL, tight when the top-k mass is close to 1, and it fails below
kl_topk_mass_min. The fine-tune gates compare KL(merged || GGUF) with KL(merged || base) on the same
positions, and the golden answers the fine-tune changed, so a GGUF that lost the fine-tune fails.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from loraship.planning import inference_memory as im
from loraship.constants import (
    ADAPTER_GGUF, REFERENCE_FILE, REFERENCE_TOPK_FILE, VERIFY_FILE, base_gguf_name, quantized_gguf_name,
)
from loraship.errors import IntegrityError, LorashipError
from loraship.llamacpp.gguf_info import read_gguf_apart
from loraship.llamacpp.gguf_tools import builtin_template_prompt
from loraship.runtime.manifest import atomic_write_json
from loraship.planning.resources import cpu_count
from loraship.llamacpp.served import served_check
from loraship.runtime.lineage import converted_from
from loraship.sampling import GREEDY
from loraship.verification.figures import draw_ladder, failed_gates, ladder_row, passed_metrics
from loraship.verification.gates import (
    adapter_kl_mean_gate, adapter_same_top_gate, chat_template_gate, eval_loss_gate, file_type_gate, finetune_answers_gate,
    finetune_kl_gate, fits_target_gpu_gate, golden_decisive_gate, golden_format_gate, golden_match_gate, kl_mean_gate,
    kl_p99_gate, perplexity_ratio_gate, same_top_gate, served_gate, special_tokens_gate, tokenizer_parity_gate,
    turn_end_gate,
)
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir

STAGE = "verify"
UPSTREAM = ("train", "reference", "quantize")
FIELDS = (
    "golden_match_min", "golden_margin", "decisive_flips_max", "perplexity_ratio_max", "kl_mean_max", "kl_p99_max", "same_top_min",
    "min_golden_prompts", "min_decisive_positions", "min_scored_tokens", "target_gpu_memory_gib", "target_context",
    "device", "quantization", "max_new_tokens", "seed", "adapter_gguf", "kl_topk_mass_min", "finetune_kl_fraction_max",
)
ADAPTER_FIELDS = ("adapter_kl_mean_max", "adapter_same_top_min")  # key the stage only with adapter_gguf on
MERGED_TOPK_FILE = ".merged-topk.npz"  # the merged GGUF's top-k for the adapter run; removed once scored
MEASURE_TIMEOUT_S = 3 * 3600
log = logging.getLogger("loraship.verify")


# -- llama.cpp -------------------------------------------------------------------------------
def pick_device(config) -> str:
    import llama_cpp

    gpu = bool(llama_cpp.llama_supports_gpu_offload()) and im.gpu_total_gib() is not None
    if config.device == "cuda" and not gpu:
        raise LorashipError("device: cuda was asked for, but this llama-cpp-python has no GPU offload or no GPU is "
                            "visible; install the CUDA build of llama-cpp-python or use device: auto")
    return "cuda" if gpu and config.device != "cpu" else "cpu"


def check_gpu_size(config, device: str) -> None:
    """The measured memory gate means something only on a GPU at least as large as the target."""
    total = im.gpu_total_gib() if device == "cuda" else None
    if total is not None and total < config.target_gpu_memory_gib:
        raise LorashipError(
            f"this GPU has {total:.1f} GiB, less than target_gpu_memory_gib {config.target_gpu_memory_gib:g} the plan "
            "was made for; run verify on a GPU at least that large, or lower target_gpu_memory_gib and run again"
        )


def vocab_of(llm):
    return llm._model.vocab


def adds_bos(llm) -> bool:
    sample = b"Hello world"
    return len(llm.tokenize(sample, add_bos=True, special=False)) > len(llm.tokenize(sample, add_bos=False, special=False))


def served_ids(llm, text: str, add_bos: bool) -> list[int]:
    """Token ids llama.cpp feeds the model for text: a rendered chat prompt carries its own BOS text
    (llama-cpp-python's chat handlers tokenize it with add_bos off); plain text gets BOS as the GGUF says."""
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)


def greedy(llm, prompt: list[int], max_new: int, stops: set[int],
           leads: list[float] | None = None) -> tuple[list[int], int | None, float]:
    """Argmax decoding straight from llama.cpp's logits (no sampler settings to disagree on):
    (answer, stop token or None, seconds spent generating). `leads`, when given, gets the nats by which
    each step's top token led its runner-up (answer tokens, then the stop)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    answer: list[int] = []
    started = time.perf_counter()
    for _ in range(max_new):
        row = llm.scores[llm.n_tokens - 1]
        token = int(np.argmax(row))
        if leads is not None:
            second, first = np.partition(row, -2)[-2:]
            leads.append(round(float(first - second), 5))
        if token in stops:
            return answer, token, time.perf_counter() - started
        answer.append(token)
        llm.eval([token])
    return answer, None, time.perf_counter() - started


def logprobs_at(llm, ids: list[int], positions: list[int]):
    """llama.cpp's log-softmax at the given positions after evaluating ids (float64, [n, vocab])."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)[positions]
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


# -- comparisons -----------------------------------------------------------------------------
def _renormalised(logprobs):
    import numpy as np

    logprobs = logprobs.astype(np.float64)
    return logprobs - np.log(np.exp(logprobs).sum(-1, keepdims=True))  # what fp16 storage rounded


def kl_stats(kls, prefix: str = "kl") -> dict:
    import numpy as np

    kls = np.maximum(np.asarray(kls, dtype=np.float64), 0.0)
    return {f"{prefix}_mean": float(kls.mean()), f"{prefix}_median": float(np.median(kls)),
            f"{prefix}_p99": float(np.percentile(kls, 99)), f"{prefix}_max": float(kls.max())}


def eval_agreement(llm, reference: dict, topk, min_exact: int = 1) -> dict:
    """Perplexity of both runtimes, KL(HF || GGUF) per position and the same-top-token rate.

    KL is exact (full vocabulary, llama-perplexity --kl-divergence's statistic) at the positions whose
    HF distribution the reference stored whole, when there are at least min_exact of them; otherwise
    the top-k lower bound over every position, with the top-k mass it covers. Where the reference
    also scored the base model, KL(merged || GGUF) over KL(merged || base) on the same positions says
    how much of the fine-tune the GGUF kept."""
    import numpy as np

    full = topk.get("full_logprobs")
    n_full = 0 if full is None else len(full)
    base_kl = topk.get("base_kl")
    kls, exact_kls, same, hf_lp, cpp_lp = [], [], [], [], []
    eval_tokens, eval_seconds = 0, 0.0
    for n, record in enumerate(reference["eval"]):
        rows = np.nonzero(topk["example"] == n)[0]
        if not len(rows):
            continue
        positions = topk["position"][rows].tolist()
        started = time.perf_counter()
        q = logprobs_at(llm, record["input_ids"], positions)
        eval_seconds += time.perf_counter() - started
        eval_tokens += len(record["input_ids"])
        p_ids, p_lp = topk["topk_ids"][rows], topk["topk_logprobs"][rows].astype(np.float64)
        q_k = np.take_along_axis(q, p_ids, axis=1)
        p_tail = np.clip(1 - np.exp(p_lp).sum(-1), 0, 1)
        q_tail = np.clip(1 - np.exp(q_k).sum(-1), 1e-12, 1)
        tail = np.where(p_tail > 1e-12, p_tail * (np.log(np.maximum(p_tail, 1e-12)) - np.log(q_tail)), 0.0)
        kls += ((np.exp(p_lp) * (p_lp - q_k)).sum(-1) + tail).tolist()
        exact = rows < n_full
        if exact.any():
            p_full = _renormalised(full[rows[exact]])
            exact_kls += (np.exp(p_full) * (p_full - q[exact])).sum(-1).tolist()
        same += (q.argmax(-1) == p_ids[:, 0]).tolist()
        targets = topk["target"][rows]
        cpp_lp += q[np.arange(len(rows)), targets].tolist()
        hf_lp += topk["target_logprob"][rows].astype(np.float64).tolist()
    if not kls:
        return {"scored_tokens": 0}
    use_exact = len(exact_kls) >= max(min_exact, 1)
    out = {
        "scored_tokens": len(kls),
        "hf_perplexity": float(np.exp(-np.mean(hf_lp))),
        "gguf_perplexity": float(np.exp(-np.mean(cpp_lp))),
        "perplexity_ratio": float(np.exp(np.mean(hf_lp) - np.mean(cpp_lp))),
        "kl_method": "exact" if use_exact else "top-k",
        "kl_tokens": len(exact_kls) if use_exact else len(kls),
        **kl_stats(exact_kls if use_exact else kls),
        "kl_topk_bound_mean": float(np.maximum(np.array(kls), 0.0).mean()),
        "top_k_mass_mean": float(np.exp(topk["topk_logprobs"].astype(np.float64)).sum(-1).mean()),
        "same_top_rate": float(np.mean(same)),
        "prompt_tokens": eval_tokens,
        "prompt_tokens_per_s": round(eval_tokens / eval_seconds, 1) if eval_seconds else None,
    }
    if base_kl is not None and len(base_kl) and exact_kls:
        # The same positions on both sides: the first len(base_kl) scored positions, in order.
        shared = min(len(base_kl), len(exact_kls))
        gguf_mean, base_mean = float(np.mean(exact_kls[:shared])), float(np.mean(base_kl[:shared]))
        out.update(finetune_tokens=shared, base_kl_mean=base_mean, finetune_kl_mean=gguf_mean,
                   finetune_kl_ratio=gguf_mean / base_mean if base_mean > 0 else None)
    return out


def gguf_topk(llm, reference: dict, topk, k: int) -> dict:
    """The loaded GGUF's own top-k log-probs (sorted) and target log-prob at the reference's scored
    positions, laid out as the reference's eval_topk.npz, so eval_agreement can score another
    llama.cpp run against this one."""
    import numpy as np

    rows_of = []
    for n, record in enumerate(reference["eval"]):
        rows = np.nonzero(topk["example"] == n)[0]
        if not len(rows):
            continue
        q = logprobs_at(llm, record["input_ids"], topk["position"][rows].tolist())
        ids = np.argpartition(-q, k - 1, axis=1)[:, :k]
        ids = np.take_along_axis(ids, np.argsort(-np.take_along_axis(q, ids, axis=1), axis=1), axis=1)
        targets = topk["target"][rows]
        rows_of.append({"example": topk["example"][rows], "position": topk["position"][rows], "target": targets,
                        "topk_ids": ids, "topk_logprobs": np.take_along_axis(q, ids, axis=1).astype(np.float32),
                        "target_logprob": q[np.arange(len(rows)), targets].astype(np.float32)})
    return {key: np.concatenate([r[key] for r in rows_of]) for key in rows_of[0]} if rows_of else {}


def parting(answer: list[int], record: dict) -> tuple[int | None, float | None]:
    """Where a free-running answer first leaves the merged model's greedy answer (None if it never
    does), and by how many nats the merged model's top token led its runner-up there (the reference's
    teacher-forced margins; None past them). Up to that position both ran on the same tokens, so the
    lead says whether the merged model was decided there or at a coin toss."""
    ref = record["answer_ids"]
    if answer == ref:
        return None, None
    at = next((i for i, (a, b) in enumerate(zip(answer, ref)) if a != b), min(len(answer), len(ref)))
    margins = record.get("margins") or []
    return at, (margins[at] if at < len(margins) else None)


def golden_agreement(llm, reference: dict, config, stops: set[int]) -> dict:
    import numpy as np

    answers, matches, ties, formatted, decisive, agreed, gen_tokens, gen_seconds = [], 0, 0, 0, 0, 0, 0, 0.0
    for record in reference["golden"]:
        leads: list[float] = []
        answer, stop, seconds = greedy(llm, record["prompt_ids"], config.max_new_tokens, stops, leads)
        gen_tokens += len(answer) + (stop is not None)
        gen_seconds += seconds
        match = answer == record["answer_ids"]
        matches += match
        parted_at, lead = parting(answer, record)
        near_tie = parted_at is not None and lead is not None and lead < config.golden_margin
        ties += near_tie
        forced = record["answer_ids"] + ([record["stop_id"]] if record.get("stop_id") is not None else [])
        if forced:
            full = record["prompt_ids"] + forced
            llm.reset()
            llm.eval(full)
            picks = np.asarray(llm.scores[len(record["prompt_ids"]) - 1 : len(full) - 1]).argmax(-1).tolist()
            for pick, top1, margin in zip(picks, record["top1"], record["margins"]):
                if margin >= config.golden_margin:
                    decisive += 1
                    agreed += pick == top1
        full_text = llm.detokenize(answer).decode("utf-8", errors="replace")
        text = full_text.strip()
        ok_format = bool(re.search(record["expect_regex"], text)) if record.get("expect_regex") else True
        formatted += ok_format
        shown = record["messages"][-1]["content"] if record["kind"] == "chat" else record["prompt_text"]
        changed = record.get("base_answer_ids") is not None and record["base_answer_ids"] != record["answer_ids"]
        answers.append({"kind": record["kind"], "prompt": shown, "hf": record["answer_text"], "gguf": text, "match": match,
                        "parted_at": parted_at, "merged_lead_there": lead, "parted_at_near_tie": near_tie,
                        "changed_by_finetune": changed, "equals_base": answer == record.get("base_answer_ids"),
                        "hf_stop": record.get("stop_id"), "gguf_stop": stop,
                        # What the served check needs to tell a near-tie flip from a real difference.
                        "gguf_own": {"text": full_text, "leads": leads,
                                     "prefix_bytes": [len(llm.detokenize(answer[: k + 1])) for k in range(len(answer))]},
                        "format_ok": ok_format, **({"reference": record["reference"]} if "reference" in record else {})})
    return {"answers": answers, "matches": matches, "parted_at_near_tie": ties, "formatted": formatted,
            "decisive": decisive, "agreed": agreed, "gen_tokens": gen_tokens, "gen_tokens_per_s": round(gen_tokens / gen_seconds, 1) if gen_seconds else None}


def tokenizer_parity(llm, reference: dict) -> dict:
    texts = [(r["text"], r["add_bos"], r["served_ids"]) for r in reference["eval"]]
    texts += [(r["prompt_text"], r["add_bos"], r["prompt_ids"]) for r in reference["golden"]]
    mismatched = [text[:80] for text, bos, ids in texts if served_ids(llm, text, bos) != ids]
    return {"checked": len(texts), "equal": len(texts) - len(mismatched), "first_mismatches": mismatched[:3]}


def llama_cpp_tokens(llm, reference: dict) -> dict:
    """What special_tokens_gate judges of the loaded GGUF: whether llama.cpp adds BOS to plain text, and the HF stop
    ids that are not end-of-generation tokens in llama.cpp."""
    import llama_cpp

    vocab = vocab_of(llm)
    return {"adds_bos": adds_bos(llm),
            "stop_ids_not_eog": [t for t in reference["tokenizer"]["stop_ids"] if not llama_cpp.llama_vocab_is_eog(vocab, t)]}


# -- memory ----------------------------------------------------------------------------------
def memory_plan(layout, config) -> dict:
    """Prediction at target_context, and where it does not fit, the context and layers that do."""
    at_target = im.predict_gpu(layout, config.target_context)
    plan = {"predicted": at_target, "fits": at_target["total_gib"] <= config.target_gpu_memory_gib}
    if not plan["fits"]:
        layers = im.layers_that_fit(layout, config.target_context, config.target_gpu_memory_gib)
        if layers == 0 and im.largest_context(layout, config.target_gpu_memory_gib) == 0:
            one = im.predict_gpu(layout, config.target_context, 1)
            raise LorashipError(
                f"the GGUF does not fit target_gpu_memory_gib {config.target_gpu_memory_gib:g} even with one layer (the output layer) on the "
                f"GPU (about {one['total_gib']:.2f} GiB at n_ctx {config.target_context}); choose a smaller "
                "quantization, a smaller base model, or a larger target GPU"
            )
        plan["largest_context_all_layers"] = im.largest_context(layout, config.target_gpu_memory_gib)
        plan["gpu_layers_at_target_context"] = layers
    return plan


def measure(job: dict, llm, load_seconds: float) -> dict:
    """Everything that needs the GGUF loaded in llama.cpp, in the process that loaded it (_MEASURE)."""
    import json
    from types import SimpleNamespace

    cuda = job["device"] == "cuda"
    out = {"load_seconds": round(load_seconds, 2)}
    import numpy as np

    reference = json.loads(Path(job["reference"]).read_text(encoding="utf-8"))
    with np.load(job["topk"]) as handle:
        topk = {k: handle[k] for k in handle.files}
    log.info("loaded in %.1f s; special tokens, tokenizer parity", out["load_seconds"])
    out["llama_cpp_tokens"] = llama_cpp_tokens(llm, reference)
    out["tokenizer_parity"] = tokenizer_parity(llm, reference)
    log.info("scoring %d eval texts against the reference", len(reference["eval"]))
    out["eval_agreement"] = eval_agreement(llm, reference, topk, job.get("min_scored_tokens", 1))
    stops = set(reference["tokenizer"]["stop_ids"]) | {t for t in range(llm.n_vocab()) if _is_eog(llm, t)}
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

    load_seconds = round(load_seconds, 2)
    import numpy as np

    reference = json.loads(Path(job["reference"]).read_text(encoding="utf-8"))
    with np.load(job["merged_topk"]) as handle:
        merged = {k: handle[k] for k in handle.files}
    log.info("scoring base GGUF + adapter on %d eval texts against the merged GGUF", len(reference["eval"]))
    agreement = eval_agreement(llm, reference, merged) if merged else {"scored_tokens": 0}
    return {"load_seconds": load_seconds, "eval_agreement": agreement}


# The child loads the GGUF with nothing but the standard library and llama_cpp imported, then imports
# this module: on the H200 a CUDA load after `import numpy` segfaults (in llama.cpp's print_info),
# and this module imports numpy; llama_cpp loads its CUDA libraries before it imports numpy, and that
# order works (bench/results/verify_gpu_bisect.json, then the 7B and 14B rows of verify_gpu.json).
_MEASURE = """
import json, sys, time
job = json.loads(open(sys.argv[2], encoding="utf-8").read())
from llama_cpp import Llama
started = time.perf_counter()
llm = Llama(**job["llama"])
load_seconds = time.perf_counter() - started
import importlib, logging
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
module = importlib.import_module(sys.argv[1])
result = getattr(module, sys.argv[4])(job, llm, load_seconds)
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
    llama = {"model_path": job["gguf"], "n_ctx": job["n_ctx"], "n_gpu_layers": job["n_gpu_layers"], "logits_all": True,
             "seed": job["seed"], "n_threads": cpu_count(), "verbose": os.environ.get("LORASHIP_LLAMA_VERBOSE") == "1"}
    if job.get("lora"):
        llama.update(lora_path=job["lora"], lora_scale=1.0)
    job_file.write_text(json.dumps({**job, "llama": llama}), encoding="utf-8")
    result_file.unlink(missing_ok=True)
    # loraship.stages.verify, also under python -m
    module = module or (__spec__.name if __spec__ is not None else __name__)
    keep = {k: os.environ[k] for k in ("LORASHIP_LLAMA_VERBOSE", "PYTHONUNBUFFERED") if k in os.environ}
    done = run_child([sys.executable, "-c", _MEASURE, module, str(job_file), str(result_file), entry],
                     MEASURE_TIMEOUT_S, f"verify's llama.cpp run on {Path(job['gguf']).name}", extra_env=keep)
    if keep.get("LORASHIP_LLAMA_VERBOSE") == "1" or done.returncode != 0:
        sys.stderr.write(done.stderr)
    if done.returncode != 0 or not result_file.is_file():
        raise LorashipError(
            f"llama.cpp failed while loading or running {job['gguf']} {child_death(done.returncode, done.stderr)}\n"
            "A GGUF that llama-cpp-python cannot load is a llama.cpp version mismatch or a broken file: run the "
            "convert and quantize stages again with this image's llama-cpp-python; out of memory: lower target_context"
            + native_crash_hint(done.returncode))
    result = json.loads(result_file.read_text(encoding="utf-8"))
    job_file.unlink(missing_ok=True)
    result_file.unlink(missing_ok=True)
    return result


def verify_quantization(ctx, config, quantization: str, reference: dict, device: str, with_adapter: bool) -> dict:
    """One quantized GGUF against the reference: its gates and what was measured (a section of verify.json)."""
    gguf_path = ctx.upstream_dir("quantize") / quantized_gguf_name(quantization)
    # Read in a child: llama.cpp loads this file next (loraship/llamacpp/gguf_info.py says why).
    info = read_gguf_apart(gguf_path)
    fields = info["fields"]
    if info["layout"] is None:
        raise IntegrityError(f"{gguf_path}: its metadata gives no tensor layout ({info['layout_error']}); "
                             "run the convert and quantize stages again")
    layout = im.GGUFLayout(**info["layout"])
    gates: dict[str, dict] = {}
    report: dict = {"quantization": quantization, "gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size}

    gates["file_type"] = file_type_gate(fields, quantization).to_json()
    gates["chat_template_in_gguf"] = chat_template_gate(fields, reference).to_json()

    memory = memory_plan(layout, config)
    report["memory"] = memory
    needed = max([len(r["input_ids"]) for r in reference["eval"]]
                 + [len(r["prompt_ids"]) + config.max_new_tokens + 1 for r in reference["golden"]])
    # On the GPU the context the model must serve; on the CPU (tests) just what the texts need.
    n_ctx = max(config.target_context, needed) if device == "cuda" else max(256, needed)
    n_gpu_layers = (-1 if memory["fits"] else memory["gpu_layers_at_target_context"]) if device == "cuda" else 0
    log.info("loading %s on %s in a fresh process: n_ctx %d, %s GPU layers", gguf_path.name, device, n_ctx,
             "all" if n_gpu_layers == -1 else n_gpu_layers)
    measured = measure_apart(ctx, {
        "gguf": str(gguf_path), "n_ctx": n_ctx, "n_gpu_layers": n_gpu_layers, "device": device, "seed": config.seed,
        "reference": str(ctx.upstream_dir("reference") / REFERENCE_FILE),
        "topk": str(ctx.upstream_dir("reference") / REFERENCE_TOPK_FILE),
        "max_new_tokens": config.max_new_tokens, "golden_margin": config.golden_margin,
        "min_scored_tokens": config.min_scored_tokens,
        "merged_topk_out": str(ctx.dir / MERGED_TOPK_FILE) if with_adapter else None,
    })
    report.update(device=device, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, load_seconds=measured["load_seconds"])

    gates["special_tokens"] = special_tokens_gate(measured["llama_cpp_tokens"], fields, reference).to_json()
    parity = measured["tokenizer_parity"]
    report["tokenizer_parity"] = parity
    gates["tokenizer_parity"] = tokenizer_parity_gate(parity).to_json()

    agreement = measured["eval_agreement"]
    report["eval_agreement"] = agreement
    # This quantization's limits: the config's where it sets them, else its calibrated defaults.
    report["gate_limits"] = config.gate_limits(quantization)
    limits = config.model_copy(update=report["gate_limits"])
    gates["perplexity_ratio"] = perplexity_ratio_gate(agreement, limits).to_json()
    gates["kl_divergence_mean"] = kl_mean_gate(agreement, limits, reference["top_k"]).to_json()
    gates["kl_divergence_p99"] = kl_p99_gate(agreement, limits, reference["top_k"]).to_json()
    gates["same_top_token"] = same_top_gate(agreement, limits).to_json()
    # A reference made before the base model was scored has no base_kl: no fine-tune gates then.
    if "finetune_tokens" in agreement:
        gates["finetune_kept_kl"] = finetune_kl_gate(agreement, config).to_json()

    golden = measured["golden"]
    n = len(reference["golden"])
    gates["golden_match"] = golden_match_gate(golden, n, config).to_json()
    gates["golden_decisive_agreement"] = golden_decisive_gate(golden, limits).to_json()
    gates["golden_format"] = golden_format_gate(golden, n, config).to_json()
    if any(r.get("base_answer_ids") is not None for r in reference["golden"]):
        gates["finetune_kept_answers"] = finetune_answers_gate(golden, config).to_json()
    # Chat answers only: a completion run's prompts are plain text that ends with EOS.
    if reference["tokenizer"].get("turn_end_id") is not None and any(r["kind"] == "chat" for r in reference["golden"]):
        gates["golden_ends_turn"] = turn_end_gate(golden, reference, config).to_json()
    report["golden_answers"] = golden["answers"]
    with_reference = [a for a in golden["answers"] if "reference" in a]
    if with_reference:
        report["golden_accuracy_vs_reference"] = sum(a["gguf"] == a["reference"] for a in with_reference) / len(with_reference)
    report["builtin_template_engine"] = measured["builtin_template_engine"]
    # Each chat prompt with the same GGUF's own greedy answer (measure's, in llama.cpp outside the server).
    chats = [{**r, "gguf_answer_text": a["gguf"], "gguf_match": a["match"], "gguf_own": a["gguf_own"]}
             for r, a in zip(reference["golden"], golden["answers"]) if r["kind"] == "chat"]
    # What the served check sends and the artifact ships (the Modelfile, the card's commands): greedy,
    # as verify's own argmax decoding above.
    report["sampling"] = GREEDY.record()
    if chats:
        log.info("serving %s through llama.cpp's OpenAI-compatible server: %d golden chats, whole and streamed",
                 gguf_path.name, len(chats))
        report["served"] = served_check(gguf_path, chats, config.max_new_tokens, n_ctx, n_gpu_layers, cpu_count(),
                                        reference["tokenizer"].get("markers", []),
                                        ctx.dir / f"server-{quantization}.log", GREEDY,
                                        reference["tokenizer"].get("template_kwargs"))
        gates["served"] = served_gate(report["served"], config).to_json()

    gates["eval_loss_improved"] = eval_loss_gate(ctx.upstream["train"]["metrics"]).to_json()

    predicted = memory["predicted"]["total_gib"] if memory["fits"] else im.predict_gpu(
        layout, n_ctx, memory["gpu_layers_at_target_context"])["total_gib"]
    report["gpu_memory"] = {"predicted_gib": predicted, "measured_gib": measured["gpu_used_gib"],
                            "target_gpu_gib": config.target_gpu_memory_gib}
    gates["fits_target_gpu"] = fits_target_gpu_gate(memory, report["gpu_memory"], layout, config).to_json()
    if with_adapter:
        report["adapter_gguf"] = adapter_gates(ctx, config, quantization, gates, {
            "n_ctx": n_ctx, "n_gpu_layers": n_gpu_layers, "device": device, "seed": config.seed,
            "reference": str(ctx.upstream_dir("reference") / REFERENCE_FILE)})
    report["prompt_tokens_per_s"] = agreement.get("prompt_tokens_per_s")
    report["gen_tokens_per_s"] = golden["gen_tokens_per_s"]
    report["golden_match"] = golden["matches"] / n if n else 0.0  # token for token; the gate also counts near-ties
    report["golden_parted_at_near_tie"] = golden["parted_at_near_tie"]
    return {"passed": all(g["passed"] for g in gates.values()), "gates": gates, **report}


def all_gates(sections: dict[str, dict]) -> dict[str, dict]:
    """Every quantization's gates in one mapping: the primary's (first) under their own names, where
    readers of a one-quantization verify.json find them, the others' as '<quantization>/<gate>'."""
    primary, *others = sections
    return {**sections[primary]["gates"],
            **{f"{q}/{name}": g for q in others for name, g in sections[q]["gates"].items()}}


@exclusive
def run(config) -> dict:
    primary = config.primary_quantization
    # adapter_gguf: convert's adapter and base GGUFs are inputs too (only those, not its F16 model).
    adapter = {"convert": (ADAPTER_GGUF, base_gguf_name(primary))} if config.adapter_gguf else {}
    ctx = open_stage(config, STAGE, UPSTREAM + tuple(adapter), FIELDS + (ADAPTER_FIELDS if adapter else ()),
                     consumes=adapter)
    if ctx.done:
        return ctx.done
    reset_dir(ctx)
    import json

    reference = json.loads((ctx.upstream_dir("reference") / REFERENCE_FILE).read_text(encoding="utf-8"))
    check_lineage(config, reference)
    device = pick_device(config)
    check_gpu_size(config, device)
    if config.auto_quantization:
        return run_ladder(ctx, config, reference, device)
    # The adapter's base is quantized like the primary, so the pair is compared with the primary GGUF.
    sections = {q: verify_quantization(ctx, config, q, reference, device, with_adapter=bool(adapter) and q == primary)
                for q in config.quantizations}
    gates = all_gates(sections)
    passed = all(g["passed"] for g in gates.values())
    head = sections[primary]
    draw_ladder(ctx, config, [ladder_row(q, sections[q]) for q in config.quantizations], shipped=primary,
                shipped_label="primary")
    verdict = {**head, "passed": passed, "gates": gates, "quantizations": sections,
               "verify_seconds": round(time.time() - ctx.started, 2)}
    atomic_write_json(ctx.dir / VERIFY_FILE, verdict)
    if not passed:
        failing = [q for q, section in sections.items() if not section["passed"]]
        raise LorashipError(f"verify failed for {', '.join(failing)}: {failed_gates(gates)}; details in "
                            f"{ctx.dir / VERIFY_FILE}")
    return ctx.finish({**passed_metrics(head, gates, sections),
                       **({"adapter_gguf": {k: head["adapter_gguf"].get(k) for k in ("kl_mean", "same_top_rate",
                                                                                    "scored_tokens")}}
                          if adapter else {})})


def run_ladder(ctx, config, reference: dict, device: str) -> dict:
    """quantization: auto. Verify the ladder smallest first and stop at the first rung that passes every
    gate under its own limits, the target-GPU fit included: that one is shipped, alone. Larger rungs
    are not verified (a smaller one already keeps the fine-tune)."""
    sections: dict[str, dict] = {}
    chosen = None
    for q in config.quantizations:
        sections[q] = verify_quantization(ctx, config, q, reference, device, with_adapter=False)
        log.info("quantization auto: %s %s", q, "passed" if sections[q]["passed"] else "failed: " + ", ".join(
            k for k, g in sections[q]["gates"].items() if not g["passed"]))
        if sections[q]["passed"]:
            chosen = q
            break
    ladder = [ladder_row(q, sections.get(q)) for q in config.quantizations]
    draw_ladder(ctx, config, ladder, shipped=chosen)
    head = sections[chosen] if chosen else sections[config.quantizations[-1]]
    verdict = {**head, "passed": chosen is not None, "quantization_auto": True, "shipped_quantization": chosen,
               "ladder": ladder, "quantizations": sections, "verify_seconds": round(time.time() - ctx.started, 2)}
    atomic_write_json(ctx.dir / VERIFY_FILE, verdict)
    if chosen is None:
        fitting = [r for r in ladder if r["fits"]]
        if not fitting:
            raise LorashipError(
                f"quantization auto: no rung of {', '.join(config.quantizations)} fits target_gpu_memory_gib "
                f"{config.target_gpu_memory_gib:g} at target_context {config.target_context}; raise either, or ship a "
                f"smaller base model; details in {ctx.dir / VERIFY_FILE}")
        largest = fitting[-1]
        raise LorashipError(
            f"quantization auto: no rung passed every gate; the largest that fits the target, {largest['quant']}, "
            f"failed {failed_gates(sections[largest['quant']]['gates'])}. Train until the eval loss settles, loosen that gate's limit in the config if the "
            f"figure is acceptable, or raise target_gpu_memory_gib for a larger rung; details in {ctx.dir / VERIFY_FILE}")
    return ctx.finish({**passed_metrics(head, head["gates"], {chosen: head}),
                       "shipped_quantization": chosen, "ladder": ladder})


def adapter_gates(ctx, config, quantization: str, gates: dict, job: dict) -> dict:
    """Run base GGUF + adapter GGUF against the merged GGUF's top-k; add its gates; its report."""
    convert_dir = ctx.upstream_dir("convert")
    base, lora = convert_dir / base_gguf_name(quantization), convert_dir / ADAPTER_GGUF
    merged_topk = ctx.dir / MERGED_TOPK_FILE
    log.info("loading %s with the adapter %s in a fresh process", base.name, lora.name)
    try:
        measured = measure_apart(ctx, {**job, "gguf": str(base), "lora": str(lora), "merged_topk": str(merged_topk)},
                                 entry="measure_adapter")
    finally:
        merged_topk.unlink(missing_ok=True)
    agreement = measured["eval_agreement"]
    note = f"{base.name} + {lora.name} against the merged GGUF, both in llama.cpp, on the eval texts"
    gates["adapter_kl_divergence_mean"] = adapter_kl_mean_gate(agreement, config, note).to_json()
    gates["adapter_same_top_token"] = adapter_same_top_gate(agreement, config, note).to_json()
    names = {"hf_perplexity": "merged_gguf_perplexity", "gguf_perplexity": "base_plus_adapter_perplexity"}
    return {"base_gguf": str(base), "adapter_gguf": str(lora), "load_seconds": measured["load_seconds"],
            **{names.get(k, k): v for k, v in agreement.items()}}


def _is_eog(llm, token: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(vocab_of(llm), token))


def builtin_engine_report(llm, reference: dict) -> dict:
    """Reported, not gated: whether llama.cpp's built-in template engine (llama-server without --jinja)
    formats golden chats into HF's prompt tokens. Many real templates (Qwen2.5's default system
    prompt, custom markers) come out differently there; the GGUF's Jinja template is what to serve."""
    chats = [r for r in reference["golden"] if r["kind"] == "chat"]
    if not chats:
        return {"checked": 0, "note": "no chat prompts"}
    equal, recognised = 0, True
    for record in chats:
        prompt = builtin_template_prompt(llm, record["messages"])
        if prompt is None:
            recognised = False
            break
        equal += served_ids(llm, prompt, False) == record["prompt_ids"]
    if not recognised:
        return {"checked": 0, "recognised": False, "note": "llama.cpp's built-in engine does not know this template; "
                "serve it with the GGUF's Jinja template (llama-server --jinja)"}
    return {"checked": len(chats), "recognised": True, "equal_to_hf": equal}


def check_lineage(config, reference: dict) -> None:
    """The reference must come from the merged model this GGUF was converted from; a convert manifest
    that does not say which merged model that was is refused (loraship/runtime/lineage.py converted_from)."""
    if converted_from(config) != reference.get("merged_digest"):
        raise IntegrityError(
            "the reference stage's results were computed for another merged model than the one this GGUF was converted "
            "from; run the reference stage again for this run (loraship run CONFIG re-runs it)"
        )


if __name__ == "__main__":
    main(run)
