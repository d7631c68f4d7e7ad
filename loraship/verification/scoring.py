"""verify's scoring: the loaded GGUF against what the reference stage stored from the merged HF model.

What it computes is what llama.cpp's own `llama-perplexity --kl-divergence` reports (perplexity ratio, mean and
99th-percentile KL divergence, same-top-token rate), plus tokenizer parity and the golden answers (free-running
greedy, and teacher-forced where the merged model was decided).

KL divergence: exact over the full vocabulary at the positions whose HF distribution the reference
stored whole (its size budget; 2,048 tokens by default), as llama-perplexity --kl-divergence computes
it. Where fewer than min_scored_tokens positions have it, the top-k bound: HF's top-k log-probs per
position with the rest lumped into one tail bucket; by the log-sum inequality KL over (top-k, tail)
is a lower bound of the full KL, tight when the top-k mass is close to 1, and it fails below
kl_topk_mass_min. The fine-tune gates compare KL(merged || GGUF) with KL(merged || base) on the same
positions, and the golden answers the fine-tune changed, so a GGUF that lost the fine-tune fails.
"""

from __future__ import annotations

import re
import time

from loraship.llamacpp.gguf_tools import builtin_template_prompt
from loraship.verification.llama_ops import greedy, logprobs_at, served_ids


# -- KL and perplexity on the eval texts ----------------------------------------------------------
def _renormalised(logprobs):
    import numpy as np

    logprobs = logprobs.astype(np.float64)
    return logprobs - np.log(np.exp(logprobs).sum(-1, keepdims=True))  # what fp16 storage rounded


def kl_stats(kls, prefix: str = "kl") -> dict:
    import numpy as np

    kls = np.maximum(np.asarray(kls, dtype=np.float64), 0.0)
    return {
        f"{prefix}_mean": float(kls.mean()),
        f"{prefix}_median": float(np.median(kls)),
        f"{prefix}_p99": float(np.percentile(kls, 99)),
        f"{prefix}_max": float(kls.max()),
    }


def topk_bound_kl(p_ids, p_lp, q):
    """KL(HF || GGUF) per position over HF's top-k (ids p_ids, log-probs p_lp) and one tail bucket for the rest, q
    the GGUF's full log-softmax: a lower bound of the full KL (log-sum inequality)."""
    import numpy as np

    q_k = np.take_along_axis(q, p_ids, axis=1)
    p_tail = np.clip(1 - np.exp(p_lp).sum(-1), 0, 1)
    q_tail = np.clip(1 - np.exp(q_k).sum(-1), 1e-12, 1)
    tail = np.where(p_tail > 1e-12, p_tail * (np.log(np.maximum(p_tail, 1e-12)) - np.log(q_tail)), 0.0)
    return (np.exp(p_lp) * (p_lp - q_k)).sum(-1) + tail


def exact_kl(p_logprobs, q):
    """KL(HF || GGUF) per position over the full vocabulary (llama-perplexity --kl-divergence's statistic)."""
    import numpy as np

    p_full = _renormalised(p_logprobs)
    return (np.exp(p_full) * (p_full - q)).sum(-1)


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
    seen = {"kls": [], "exact_kls": [], "same": [], "hf_lp": [], "cpp_lp": [], "tokens": 0, "seconds": 0.0}
    for n, record in enumerate(reference["eval"]):
        rows = np.nonzero(topk["example"] == n)[0]
        if not len(rows):
            continue
        positions = topk["position"][rows].tolist()
        started = time.perf_counter()
        q = logprobs_at(llm, record["input_ids"], positions)
        seen["seconds"] += time.perf_counter() - started
        seen["tokens"] += len(record["input_ids"])
        p_ids, p_lp = topk["topk_ids"][rows], topk["topk_logprobs"][rows].astype(np.float64)
        seen["kls"] += topk_bound_kl(p_ids, p_lp, q).tolist()
        exact = rows < n_full
        if exact.any():
            seen["exact_kls"] += exact_kl(full[rows[exact]], q[exact]).tolist()
        seen["same"] += (q.argmax(-1) == p_ids[:, 0]).tolist()
        seen["cpp_lp"] += q[np.arange(len(rows)), topk["target"][rows]].tolist()
        seen["hf_lp"] += topk["target_logprob"][rows].astype(np.float64).tolist()
    if not seen["kls"]:
        return {"scored_tokens": 0}
    return _agreement_figures(seen, topk, min_exact)


def _agreement_figures(seen: dict, topk, min_exact: int) -> dict:
    """eval_agreement's figures from what its loop collected per position."""
    import numpy as np

    kls, exact_kls, hf_lp, cpp_lp = seen["kls"], seen["exact_kls"], seen["hf_lp"], seen["cpp_lp"]
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
        "same_top_rate": float(np.mean(seen["same"])),
        "prompt_tokens": seen["tokens"],
        "prompt_tokens_per_s": round(seen["tokens"] / seen["seconds"], 1) if seen["seconds"] else None,
    }
    base_kl = topk.get("base_kl")
    if base_kl is not None and len(base_kl) and exact_kls:
        # The same positions on both sides: the first len(base_kl) scored positions, in order.
        shared = min(len(base_kl), len(exact_kls))
        gguf_mean, base_mean = float(np.mean(exact_kls[:shared])), float(np.mean(base_kl[:shared]))
        out.update(
            finetune_tokens=shared,
            base_kl_mean=base_mean,
            finetune_kl_mean=gguf_mean,
            finetune_kl_ratio=gguf_mean / base_mean if base_mean > 0 else None,
        )
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
        rows_of.append(
            {
                "example": topk["example"][rows],
                "position": topk["position"][rows],
                "target": targets,
                "topk_ids": ids,
                "topk_logprobs": np.take_along_axis(q, ids, axis=1).astype(np.float32),
                "target_logprob": q[np.arange(len(rows)), targets].astype(np.float32),
            }
        )
    return {key: np.concatenate([r[key] for r in rows_of]) for key in rows_of[0]} if rows_of else {}


# -- tokenizer ----------------------------------------------------------------------------------
def tokenizer_parity(llm, reference: dict) -> dict:
    texts = [(r["text"], r["add_bos"], r["served_ids"]) for r in reference["eval"]]
    texts += [(r["prompt_text"], r["add_bos"], r["prompt_ids"]) for r in reference["golden"]]
    mismatched = [text[:80] for text, bos, ids in texts if served_ids(llm, text, bos) != ids]
    return {"checked": len(texts), "equal": len(texts) - len(mismatched), "first_mismatches": mismatched[:3]}


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
        return {
            "checked": 0,
            "recognised": False,
            "note": "llama.cpp's built-in engine does not know this template; "
            "serve it with the GGUF's Jinja template (llama-server --jinja)",
        }
    return {"checked": len(chats), "recognised": True, "equal_to_hf": equal}


# -- golden prompts -------------------------------------------------------------------------------
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


def teacher_forced(llm, record: dict, margin: float) -> tuple[int, int]:
    """With HF's answer (and stop) teacher-forced: the positions where the merged model led by at least margin nats
    (decisive), and how many of them llama.cpp's top token agrees with (agreed)."""
    import numpy as np

    decisive = agreed = 0
    forced = record["answer_ids"] + ([record["stop_id"]] if record.get("stop_id") is not None else [])
    if forced:
        full = record["prompt_ids"] + forced
        llm.reset()
        llm.eval(full)
        picks = np.asarray(llm.scores[len(record["prompt_ids"]) - 1 : len(full) - 1]).argmax(-1).tolist()
        for pick, top1, lead in zip(picks, record["top1"], record["margins"]):
            if lead >= margin:
                decisive += 1
                agreed += pick == top1
    return decisive, agreed


def golden_answer(llm, record: dict, config, stops: set[int]) -> tuple[dict, dict]:
    """One golden prompt: the GGUF's greedy answer against the merged model's (the answer's record in verify.json),
    and what golden_agreement counts of it."""
    leads: list[float] = []
    answer, stop, seconds = greedy(llm, record["prompt_ids"], config.max_new_tokens, stops, leads)
    match = answer == record["answer_ids"]
    parted_at, lead = parting(answer, record)
    near_tie = parted_at is not None and lead is not None and lead < config.golden_margin
    decisive, agreed = teacher_forced(llm, record, config.golden_margin)
    full_text = llm.detokenize(answer).decode("utf-8", errors="replace")
    text = full_text.strip()
    ok_format = bool(re.search(record["expect_regex"], text)) if record.get("expect_regex") else True
    shown = record["messages"][-1]["content"] if record["kind"] == "chat" else record["prompt_text"]
    changed = record.get("base_answer_ids") is not None and record["base_answer_ids"] != record["answer_ids"]
    row = {
        "kind": record["kind"],
        "prompt": shown,
        "hf": record["answer_text"],
        "gguf": text,
        "match": match,
        "parted_at": parted_at,
        "merged_lead_there": lead,
        "parted_at_near_tie": near_tie,
        "changed_by_finetune": changed,
        "equals_base": answer == record.get("base_answer_ids"),
        "hf_stop": record.get("stop_id"),
        "gguf_stop": stop,
        # What the served check needs to tell a near-tie flip from a real difference.
        "gguf_own": {
            "text": full_text,
            "leads": leads,
            "prefix_bytes": [len(llm.detokenize(answer[: k + 1])) for k in range(len(answer))],
        },
        "format_ok": ok_format,
        **({"reference": record["reference"]} if "reference" in record else {}),
    }
    counts = {
        "matches": match,
        "parted_at_near_tie": near_tie,
        "formatted": ok_format,
        "decisive": decisive,
        "agreed": agreed,
        "gen_tokens": len(answer) + (stop is not None),
        "gen_seconds": seconds,
    }
    return row, counts


def golden_agreement(llm, reference: dict, config, stops: set[int]) -> dict:
    """Every golden prompt answered greedily by the GGUF (config: max_new_tokens, golden_margin), with the counts
    the golden gates judge."""
    answers = []
    totals = dict.fromkeys(("matches", "parted_at_near_tie", "formatted", "decisive", "agreed", "gen_tokens"), 0)
    gen_seconds = 0.0
    for record in reference["golden"]:
        row, counts = golden_answer(llm, record, config, stops)
        answers.append(row)
        gen_seconds += counts.pop("gen_seconds")
        for key, count in counts.items():
            totals[key] += count
    gen_tokens = totals["gen_tokens"]
    return {
        "answers": answers,
        **totals,
        "gen_tokens_per_s": round(gen_tokens / gen_seconds, 1) if gen_seconds else None,
    }
