"""verify's gates: each a small pure function from measured figures and the config's limits to one typed `Gate`,
named as verify.json keys it. Every gate with an evidence count fails with "not enough evidence" below its minimum
(and at zero whatever the minimum): nothing seen is never a pass (0/0).

What they hold the GGUF to (tasks/verify.py measures it):
- the GGUF's file type, chat template and special tokens as a runtime uses them: llama.cpp adds BOS to plain text
  exactly when HF does, the ids both define agree, and every HF stop token ends generation in llama.cpp;
- tokenizer parity, llama-perplexity --kl-divergence's figures (perplexity ratio, mean and 99th-percentile KL,
  same-top-token rate), and the fine-tune kept (KL to the merged model against KL to the base, changed answers);
- golden prompts: greedy answers equal HF's (golden_match_min), teacher-forced picks where HF was decided
  (golden_margin), the expected format, chat answers that end their turn;
- served: the GGUF behind llama.cpp's OpenAI-compatible server answers as its own greedy decoding;
- eval loss after training below the base model's; GPU memory within target_gpu_memory_gib;
- with adapter_gguf: base GGUF + adapter GGUF against the merged GGUF (adapter_kl_mean_max, adapter_same_top_min).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraship.constants import (
    GGUF_FILE_TYPES,
    GGUF_KEY_ADD_BOS,
    GGUF_KEY_BOS,
    GGUF_KEY_CHAT_TEMPLATE,
    GGUF_KEY_EOS,
    GGUF_KEY_FILE_TYPE,
)
from loraship.planning import inference_memory as im


@dataclass(frozen=True)
class Gate:
    """One gate's verdict. `name` is its key in verify.json's "gates"; to_json() is the record stored there."""

    name: str
    passed: bool
    value: Any
    threshold: Any
    note: str = ""
    evidence: int | None = None  # items the gate saw (tokens, prompts, positions); None: a gate that counts none
    minimum: int | None = None  # the least evidence it passes on

    def to_json(self) -> dict:
        record = {"passed": self.passed, "value": self.value, "threshold": self.threshold}
        if self.evidence is not None:
            record["evidence"] = self.evidence
            if self.minimum is not None:
                record["minimum"] = self.minimum
        if self.note:
            record["note"] = self.note
        return record


def judge(
    name: str,
    value,
    threshold,
    passed,
    note: str = "",
    evidence: int | None = None,
    minimum: int | None = None,
    minimum_key: str = "",
) -> Gate:
    """A Gate. With an evidence count below its minimum, or of zero, it fails whatever the value: nothing seen is
    never a pass (0/0)."""
    passed = bool(passed)
    if evidence is not None and evidence < max(minimum or 0, 1):
        passed = False
        why = (
            f"{evidence} < {minimum} ({minimum_key}); add eval data or golden prompts, or lower {minimum_key}"
            if minimum is not None and evidence < minimum
            else f"{evidence} seen"
        )
        note = f"not enough evidence: {why}" + (f"; {note}" if note else "")
    return Gate(name, passed, value, threshold, note, evidence, minimum if evidence is not None else None)


def _rounded(agreement: dict, key: str, digits: int) -> float:
    return round(agreement.get(key, float("nan")), digits)


def _scored(agreement: dict, config) -> dict:
    return dict(evidence=agreement["scored_tokens"], minimum=config.min_scored_tokens, minimum_key="min_scored_tokens")


def _golden_prompts(n: int, config) -> dict:
    return dict(evidence=n, minimum=config.min_golden_prompts, minimum_key="min_golden_prompts")


# -- the GGUF's metadata and tokenizer ---------------------------------------------------------
def file_type_gate(fields: dict, quantization: str) -> Gate:
    want = GGUF_FILE_TYPES[quantization]
    return judge("file_type", fields.get(GGUF_KEY_FILE_TYPE), want, fields.get(GGUF_KEY_FILE_TYPE) == want)


def chat_template_gate(fields: dict, reference: dict) -> Gate:
    template, hf_template = fields.get(GGUF_KEY_CHAT_TEMPLATE), reference["tokenizer"]["chat_template"]
    return judge(
        "chat_template_in_gguf",
        bool(template),
        bool(hf_template),
        template == hf_template,
        "identical to the merged model's template"
        if hf_template
        else "no chat template on either side (completion data)",
    )


def special_tokens_gate(tokens: dict, fields: dict, reference: dict) -> Gate:
    """Does llama.cpp behave like HF: BOS added exactly when HF adds it, same ids where both define them, every HF
    stop token an end-of-generation token. tokens: what the measuring child saw llama.cpp do (its adds_bos, and the
    HF stop ids that are not end-of-generation there). (Qwen2 has no BOS in its tokenizer but a bos_token_id in
    config.json that the converter copies: harmless while add_bos is off.)"""
    facts = reference["tokenizer"]
    cpp_bos, not_eog = tokens["adds_bos"], tokens["stop_ids_not_eog"]
    same_bos = not (cpp_bos and facts["adds_bos"]) or fields.get(GGUF_KEY_BOS) == facts["bos_id"]
    passed = cpp_bos == facts["adds_bos"] and same_bos and not not_eog and bool(facts["stop_ids"])
    value = {
        "llama_cpp_adds_bos": cpp_bos,
        "gguf_add_bos_token": fields.get(GGUF_KEY_ADD_BOS),
        "gguf_bos": fields.get(GGUF_KEY_BOS),
        "gguf_eos": fields.get(GGUF_KEY_EOS),
        "hf_stop_ids_not_end_of_generation": not_eog,
    }
    threshold = {"hf_adds_bos": facts["adds_bos"], "hf_bos": facts["bos_id"], "hf_stop_ids": facts["stop_ids"]}
    note = "" if facts["stop_ids"] else "HF defines no stop token, so generation would never end"
    return judge("special_tokens", value, threshold, passed, note)


def tokenizer_parity_gate(parity: dict) -> Gate:
    return judge(
        "tokenizer_parity",
        f"{parity['equal']}/{parity['checked']}",
        "all",
        parity["equal"] == parity["checked"],
        "llama.cpp tokenization of eval texts and golden prompts (BOS as served) equals HF's",
        evidence=parity["checked"],
        minimum=1,
        minimum_key="eval texts",
    )


# -- agreement on the eval texts ----------------------------------------------------------------
def perplexity_ratio_gate(agreement: dict, config) -> Gate:
    return judge(
        "perplexity_ratio",
        _rounded(agreement, "perplexity_ratio", 4),
        config.perplexity_ratio_max,
        agreement["scored_tokens"] and agreement["perplexity_ratio"] <= config.perplexity_ratio_max,
        **_scored(agreement, config),
    )


def _kl_basis(agreement: dict, config, top_k: int) -> tuple[str, bool]:
    """What the KL figures were computed over, and whether that basis is trustworthy: exact over the
    full vocabulary, or HF's top-k + tail (a lower bound), which needs kl_topk_mass_min of the mass."""
    if agreement.get("kl_method") == "exact":
        return f"exact KL(HF || GGUF) over the full vocabulary, {agreement['kl_tokens']} tokens", True
    mass = agreement.get("top_k_mass_mean", 0.0)
    ok = mass >= config.kl_topk_mass_min
    note = f"KL(HF || GGUF) over HF's top-{top_k} + tail, a lower bound; top-k mass {mass:.3f}"
    if not ok:
        note += (
            f" < kl_topk_mass_min {config.kl_topk_mass_min}: raise reference_full_logprob_tokens or _mib "
            "for exact KL, or reference_top_k"
        )
    return note, ok


def _kl_evidence(agreement: dict, config) -> dict:
    return dict(
        evidence=agreement.get("kl_tokens", agreement["scored_tokens"]),
        minimum=config.min_scored_tokens,
        minimum_key="min_scored_tokens",
    )


def kl_mean_gate(agreement: dict, config, top_k: int) -> Gate:
    note, basis_ok = _kl_basis(agreement, config, top_k)
    return judge(
        "kl_divergence_mean",
        _rounded(agreement, "kl_mean", 5),
        config.kl_mean_max,
        agreement["scored_tokens"] and basis_ok and agreement["kl_mean"] <= config.kl_mean_max,
        note,
        **_kl_evidence(agreement, config),
    )


def kl_p99_gate(agreement: dict, config, top_k: int) -> Gate:
    note, basis_ok = _kl_basis(agreement, config, top_k)
    return judge(
        "kl_divergence_p99",
        _rounded(agreement, "kl_p99", 5),
        config.kl_p99_max,
        agreement["scored_tokens"] and basis_ok and agreement["kl_p99"] <= config.kl_p99_max,
        note,
        **_kl_evidence(agreement, config),
    )


def same_top_gate(agreement: dict, config) -> Gate:
    return judge(
        "same_top_token",
        _rounded(agreement, "same_top_rate", 4),
        config.same_top_min,
        agreement["scored_tokens"] and agreement["same_top_rate"] >= config.same_top_min,
        **_scored(agreement, config),
    )


def finetune_kl_gate(agreement: dict, config) -> Gate:
    """The GGUF stays much closer to the merged model than the base model is: mean KL(merged || GGUF)
    at most finetune_kl_fraction_max of mean KL(merged || base) on the same tokens. A GGUF that lost
    the fine-tune (drifted back to the base) fails."""
    ratio = agreement.get("finetune_kl_ratio")
    tokens = agreement.get("finetune_tokens", 0)
    note = (
        f"KL(merged || GGUF) {agreement.get('finetune_kl_mean', float('nan')):.5f} / KL(merged || base) "
        f"{agreement.get('base_kl_mean', float('nan')):.5f} over {tokens} tokens"
    )
    if tokens and ratio is None:
        note += "; the fine-tune did not move the model on these tokens (KL to the base is 0)"
    return judge(
        "finetune_kept_kl",
        None if ratio is None else round(ratio, 4),
        config.finetune_kl_fraction_max,
        ratio is not None and ratio <= config.finetune_kl_fraction_max,
        note,
        evidence=tokens,
        minimum=config.min_scored_tokens,
        minimum_key="min_scored_tokens",
    )


# -- golden prompts ---------------------------------------------------------------------------
def golden_match_gate(golden: dict, n: int, config) -> Gate:
    """n: golden prompts the reference answered. An answer counts when the GGUF's greedy answer equals the
    merged model's token for token, or first parts from it at a near-tie: a position where the merged
    model itself led by less than golden_margin nats, so either token is the fine-tune's answer (a real
    model after a short fine-tune has many; quantization flips some). Parting where the merged model was
    decided never counts."""
    ties = golden.get("parted_at_near_tie", 0)
    rate = (golden["matches"] + ties) / n if n else 0.0
    note = (
        f"greedy llama.cpp answer == greedy merged-HF answer: {golden['matches']}/{n} token for token, {ties} more "
        f"parted at a near-tie (merged model's lead < golden_margin {config.golden_margin} nats)"
    )
    return judge(
        "golden_match",
        round(rate, 4),
        config.golden_match_min,
        n and rate >= config.golden_match_min,
        note,
        **_golden_prompts(n, config),
    )


def golden_decisive_gate(golden: dict, config) -> Gate:
    """With HF's answer teacher-forced, llama.cpp picks HF's token where the merged model was decided;
    a quantization of 4 bits or fewer may flip a small share of them (decisive_flips_max)."""
    share = config.decisive_flips_max or 0.0
    flips = golden["decisive"] - golden["agreed"]
    passed = flips == 0 or (golden["decisive"] > 0 and flips / golden["decisive"] <= share)
    return judge(
        "golden_decisive_agreement",
        f"{golden['agreed']}/{golden['decisive']}",
        "all" if not share else f"flips <= {share:.1%}",
        passed,
        f"HF answer teacher-forced; tokens where the merged model leads by >= {config.golden_margin} nats",
        evidence=golden["decisive"],
        minimum=config.min_decisive_positions,
        minimum_key="min_decisive_positions",
    )


def golden_format_gate(golden: dict, n: int, config) -> Gate:
    return judge(
        "golden_format", f"{golden['formatted']}/{n}", "all", golden["formatted"] == n, **_golden_prompts(n, config)
    )


def finetune_answers_gate(golden: dict, config) -> Gate:
    """On golden prompts where the fine-tune changed the greedy answer (base != merged), the GGUF
    answers like the merged model, not like the base: at least golden_match_min of them."""
    changed = [a for a in golden["answers"] if a.get("changed_by_finetune")]
    # An answer that parted from the merged model's at a near-tie still keeps the fine-tune unless it
    # is the base model's answer.
    kept = sum(a["match"] or (a.get("parted_at_near_tie", False) and not a.get("equals_base", False)) for a in changed)
    rate = kept / len(changed) if changed else 0.0
    return judge(
        "finetune_kept_answers",
        f"{kept}/{len(changed)}",
        config.golden_match_min,
        bool(changed) and rate >= config.golden_match_min,
        "golden prompts whose greedy answer the fine-tune changed; the GGUF must answer as the merged model",
        evidence=len(changed),
        minimum=1,
    )


def turn_end_gate(golden: dict, reference: dict, config) -> Gate:
    """Every chat answer ends with the template's turn-end token, greedy in HF and in llama.cpp alike:
    a model that never stops when served, or stops where HF does not, fails here."""
    end = reference["tokenizer"]["turn_end_id"]
    chats = [a for a in golden["answers"] if a["kind"] == "chat"]
    unended = [a for a in chats if not (a["hf_stop"] == end and a["gguf_stop"] == end)]
    note = ""
    if unended:
        first = unended[0]
        note = (
            f"{len(unended)} answer(s) did not end with token {end}, e.g. {first['prompt'][:40]!r}: HF stopped with "
            f"{first['hf_stop']}, llama.cpp with {first['gguf_stop']} (None: cut at max_new_tokens "
            f"{config.max_new_tokens}; raise it, or train until answers end their turn)"
        )
    return judge(
        "golden_ends_turn",
        len(chats) - len(unended),
        len(chats),
        not unended,
        note,
        **_golden_prompts(len(chats), config),
    )


# -- served --------------------------------------------------------------------------------------
def parting_words(answer: dict, which: str, margin: float) -> str:
    """How the served answer (`which`: whole or streamed) left the GGUF's own greedy one, in words. The
    lead is llama.cpp's own (its greedy run outside the server) at the step where they part: a near-tie
    only under golden_margin; at or above it the token was decided. The merged model's lead there is
    named too where the GGUF's greedy answer is the merged model's, token for token."""
    if answer[f"{which}_equal_to_gguf"]:
        return "equal to it"
    step, lead = answer.get(f"{which}_gguf_parted_at"), answer[f"{which}_gguf_lead_there"]
    at = f"parted at step {step}" if step is not None else "parted"
    if lead is None:
        return f"{at}, past the GGUF's own answer and stop (no lead known there)"
    merged = answer.get(f"{which}_merged_lead_there")
    merged_words = f"; the merged model, whose answer the GGUF's is, led by {merged:.2f}" if merged is not None else ""
    if lead < margin:
        return (
            f"{at} at a near-tie: llama.cpp's own top token led by {lead:.2f} nats < golden_margin "
            f"{margin}{merged_words}"
        )
    return (
        f"{at} where it was decided: llama.cpp's own top token led by {lead:.2f} nats >= golden_margin "
        f"{margin}{merged_words}"
    )


def _served_as_gguf(answer: dict, which: str, margin: float) -> bool:
    """Equal to the GGUF's own greedy answer, or parted from it only where llama.cpp itself was at a near-tie: the
    server evaluates in other batches (its prompt cache reuses the first request's prefix), and float sums in
    another order may flip a tie, never a decided token."""
    lead = answer[f"{which}_gguf_lead_there"]
    return answer[f"{which}_equal_to_gguf"] or (lead is not None and lead < margin)


def served_gate(served: dict, config) -> Gate:
    """The GGUF behind llama.cpp's OpenAI-compatible server, asked with the shipped sampling settings:
    every golden chat prompt stops by itself (finish_reason "stop", whole and streamed), streams the text
    it returns whole, leaks no template marker, and says what the same GGUF answers greedily outside the
    server (so the server's template, tokenization, stop handling and sampling change nothing). How those
    greedy answers compare with the merged model's is golden_match's question; equal_to_reference is
    reported, not gated twice, and so is what the server's default settings answer (server_defaults)."""
    n, margin = served["requests"], config.golden_margin
    counts = {
        k: served[k]
        for k in (
            "finished_by_stop",
            "equal_to_gguf_greedy",
            "equal_to_reference",
            "streamed_equal",
            "without_markers",
        )
    }
    bad = [
        a
        for a in served["answers"]
        if not (
            a["finish_reason"] == a["streamed_finish_reason"] == "stop"
            and _served_as_gguf(a, "whole", margin)
            and _served_as_gguf(a, "streamed", margin)
            and not a["markers_leaked"]
        )
    ]
    defaults = served.get("server_defaults")
    note = (
        f"{defaults['differ_from_gguf_greedy']} of {defaults['requests']} answers differ under the server's "
        f"default settings ({defaults['settings']}), reported, not gated"
        if defaults
        else ""
    )
    if bad:
        a = bad[0]
        note = (
            f"{len(bad)} of {n} failed, e.g. {a['prompt'][:40]!r}: served {a['served'][:60]!r}, streamed "
            f"{a['streamed'][:60]!r} (finish {a['finish_reason']}, streamed {a['streamed_finish_reason']}, "
            f"markers {a['markers_leaked']}), the GGUF's greedy answer outside the server {a['gguf_greedy'][:60]!r}; "
            f"served: {parting_words(a, 'whole', margin)}; streamed: "
            f"{parting_words(a, 'streamed', margin)}" + (f"; {note}" if note else "")
        )
    return judge("served", counts, {"each": n}, not bad, note, **_golden_prompts(n, config))


# -- training and the target GPU -------------------------------------------------------------------
def eval_loss_gate(train_metrics: dict) -> Gate:
    before, after = train_metrics.get("eval_loss_before"), train_metrics.get("eval_loss_after")
    return judge(
        "eval_loss_improved",
        {"before": before, "after": after},
        "after < before",
        before is not None and after is not None and after < before,
    )


def fits_target_gpu_gate(memory: dict, gpu_memory: dict, layout, config) -> Gate:
    """memory: memory_plan's; gpu_memory: predicted and measured GiB of the run verify made."""
    used = gpu_memory["measured_gib"]
    value = used if used is not None else gpu_memory["predicted_gib"]
    return judge(
        "fits_target_gpu",
        round(value, 3),
        config.target_gpu_memory_gib,
        memory["fits"] and value <= config.target_gpu_memory_gib,
        (
            "measured through NVML (the process that loaded it)"
            if used is not None
            else "predicted from the GGUF's tensors"
        )
        + f", every layer on the GPU at n_ctx {config.target_context}"
        + (
            f", the routed experts of the first {memory['n_cpu_moe']} in CPU memory (n_cpu_moe)"
            if memory.get("n_cpu_moe")
            else ""
        )
        + (
            ""
            if memory["fits"]
            else f"; does not fit: all layers fit up to n_ctx {memory['largest_context_all_layers']}, "
            f"{memory['gpu_layers_at_target_context']} of {im.all_layers(layout)} layers (llama.cpp's -ngl, the "
            f"output layer included) at n_ctx {config.target_context}"
        ),
    )


# -- base GGUF + adapter GGUF ----------------------------------------------------------------------
def adapter_kl_mean_gate(agreement: dict, config, note: str) -> Gate:
    return judge(
        "adapter_kl_divergence_mean",
        _rounded(agreement, "kl_mean", 5),
        config.adapter_kl_mean_max,
        agreement["scored_tokens"] and agreement["kl_mean"] <= config.adapter_kl_mean_max,
        note + " (KL(merged || base + adapter))",
        **_scored(agreement, config),
    )


def adapter_same_top_gate(agreement: dict, config, note: str) -> Gate:
    return judge(
        "adapter_same_top_token",
        _rounded(agreement, "same_top_rate", 4),
        config.adapter_same_top_min,
        agreement["scored_tokens"] and agreement["same_top_rate"] >= config.adapter_same_top_min,
        note,
        **_scored(agreement, config),
    )


# -- which gates a quantization gets -------------------------------------------------------------
def agreement_gates(parity: dict, agreement: dict, config, limits, top_k: int) -> list[Gate]:
    """The gates on the eval texts: tokenizer parity, then agreement under this quantization's limits."""
    gates = [
        tokenizer_parity_gate(parity),
        perplexity_ratio_gate(agreement, limits),
        kl_mean_gate(agreement, limits, top_k),
        kl_p99_gate(agreement, limits, top_k),
        same_top_gate(agreement, limits),
    ]
    # A reference made before the base model was scored has no base_kl: no fine-tune gates then.
    if "finetune_tokens" in agreement:
        gates.append(finetune_kl_gate(agreement, config))
    return gates


def golden_gates(golden: dict, reference: dict, config, limits) -> list[Gate]:
    """The gates on the golden prompts the reference answered."""
    n = len(reference["golden"])
    gates = [
        golden_match_gate(golden, n, config),
        golden_decisive_gate(golden, limits),
        golden_format_gate(golden, n, config),
    ]
    if any(r.get("base_answer_ids") is not None for r in reference["golden"]):
        gates.append(finetune_answers_gate(golden, config))
    # Chat answers only: a completion run's prompts are plain text that ends with EOS.
    if reference["tokenizer"].get("turn_end_id") is not None and any(r["kind"] == "chat" for r in reference["golden"]):
        gates.append(turn_end_gate(golden, reference, config))
    return gates
