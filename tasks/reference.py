"""Reference: what the merged HF model says, computed once on the training node.

verify runs on the small inference GPU with the GGUF alone; a 7B in bf16 (about 15 GB) could
never sit next to it on an 8 GB card. So this stage, right after merge, runs the merged model
over the eval texts and the golden prompts and stores what verify compares against:
- every eval text with HF's token ids, and at every scored position the target's log-prob and the
  top-k log-probs; at the first positions a size budget allows (reference_full_logprob_tokens /
  _mib), the whole distribution in fp16, so verify's KL divergence is exact there;
- the base model's KL divergence from the merged model at those positions and its greedy golden
  answers: how far the fine-tune moved the model, which a GGUF must not undo (tasks/verify.py);
- every golden prompt rendered with the merged tokenizer's template, its HF token ids, the greedy
  answer, and per answer token HF's top-1 and its lead over the runner-up (the margin);
- the tokenizer facts a runtime must reproduce: whether HF adds BOS, its stop tokens, the template;
- the digest of the merged weights it was computed from, so a reference of another model is refused.
"""

from __future__ import annotations

import logging

from loraship.chat import (
    render,
    set_template_kwargs,
    special_tokens,
    stop_ids,
    template_kwargs,
    template_kwargs_of,
    template_of,
    turn_end_id,
)
from loraship.constants import MERGED_DIR, REFERENCE_FILE, REFERENCE_TOPK_FILE
from loraship.data import eval_records, golden_rows
from loraship.errors import LorashipError
from loraship.runtime.lineage import merged_digest
from loraship.runtime.manifest import atomic_path, atomic_write_json, sha256_file
from loraship.models import hf_offline_if_local, resolve_base_model
from loraship.runtime.progress import Progress, artifact_key
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir

STAGE = "reference"
UPSTREAM = ("merge",)
FIELDS = (
    "golden_prompts",
    "max_new_tokens",
    "verify_max_examples",
    "reference_top_k",
    "datasets",
    "eval_datasets",
    "val_set_size",
    "sequence_len",
    "truncation",
    "seed",
    "device",
    "chat_template",
    "thinking",
    "train_on_inputs",
    "reference_full_logprob_tokens",
    "reference_full_logprob_mib",
    "base_model",
    "base_model_revision",
)
log = logging.getLogger("loraship.reference")


def adds_bos(tokenizer) -> bool:
    """Whether HF puts BOS in front of plain text (Llama does, Qwen does not)."""
    sample = "Hello world"
    with_special = tokenizer(sample)["input_ids"]
    plain = tokenizer(sample, add_special_tokens=False)["input_ids"]
    return (
        tokenizer.bos_token_id is not None
        and len(with_special) > len(plain)
        and with_special[0] == tokenizer.bos_token_id
    )


def template_markers(tokenizer) -> list[str]:
    """Special-token texts that must never reach a served answer's content: the template's markers
    (those its text names), BOS, EOS and the turn end."""
    template = template_of(tokenizer) or ""
    special = set(special_tokens(tokenizer).values())
    end = turn_end_id(tokenizer)
    named = {
        tokenizer.bos_token,
        tokenizer.eos_token,
        tokenizer.convert_ids_to_tokens(end) if end is not None else None,
    }
    return sorted(t for t in special if t and (t in template or t in named))


def golden_records(config, tokenizer) -> list[dict]:
    """Golden prompts as a runtime receives them: rendered with the merged template (or plain text)."""
    records = []
    for row in golden_rows(config):
        if "messages" in row:
            text = render(tokenizer, row["messages"], add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            record = {
                "kind": "chat",
                "messages": row["messages"],
                "prompt_text": text,
                "prompt_ids": ids,
                "add_bos": False,
            }
        else:
            ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"]
            record = {"kind": "text", "prompt_text": row["text"], "prompt_ids": ids, "add_bos": True}
        for key in ("expect_regex", "reference"):
            if row.get(key) is not None:
                record[key] = row[key]
        records.append(record)
    return records


def full_rows_budget(n_positions: int, vocab: int, tokens: int, mib: int) -> int:
    """How many scored positions keep their full-vocabulary log-probs (fp16): the config's token
    count, capped by its size budget and by what the eval split has."""
    return max(0, min(n_positions, tokens, (mib * 2**20) // (2 * vocab)))


def score_eval(
    model, records: list[dict], top_k: int, progress: Progress | None = None, full_tokens: int = 0, full_mib: int = 0
) -> tuple[dict, dict]:
    """HF log-probs at every scored position: top-k everywhere, the full distribution (fp16) at the
    first positions the budget allows (verify's KL divergence is exact there); npz arrays and summary."""
    import numpy as np
    import torch

    n_positions = sum(len(r["positions"]) for r in records)
    vocab = model.get_output_embeddings().weight.shape[0]
    budget = full_rows_budget(n_positions, vocab, full_tokens, full_mib)
    full = np.zeros((budget, vocab), dtype=np.float16)
    filled = 0
    example, position, target, target_lp, top_ids, top_lps = [], [], [], [], [], []
    for n, record in enumerate(records):
        if progress is not None:
            progress.update(n, f"eval text {n + 1}/{len(records)}")
        ids, positions = record["input_ids"], record["positions"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, positions].float()
        logprobs = torch.log_softmax(logits, -1)
        targets = torch.tensor([ids[i + 1] for i in positions], device=logprobs.device)
        values, indices = logprobs.topk(top_k, dim=-1)
        take = min(budget - filled, len(positions))
        if take > 0:
            full[filled : filled + take] = logprobs[:take].cpu().numpy().astype(np.float16)
            filled += take
        example += [n] * len(positions)
        position += positions
        target += targets.tolist()
        target_lp.append(logprobs.gather(1, targets[:, None])[:, 0].cpu())
        top_ids.append(indices.cpu())
        top_lps.append(values.cpu())
    if progress is not None:
        progress.update(len(records), f"{len(records)} eval texts scored")
    arrays = {
        "example": np.array(example, dtype=np.int32),
        "position": np.array(position, dtype=np.int32),
        "target": np.array(target, dtype=np.int32),
        "target_logprob": torch.cat(target_lp).numpy().astype(np.float32),
        "topk_ids": torch.cat(top_ids).numpy().astype(np.int32),
        "topk_logprobs": torch.cat(top_lps).numpy().astype(np.float32),
        # Row i of full_logprobs is scored position i, for i < full_tokens (positions in order).
        "full_logprobs": full,
    }
    mass = np.exp(arrays["topk_logprobs"].astype(np.float64)).sum(-1)
    summary = {
        "scored_tokens": int(len(target)),
        "full_logprob_tokens": int(budget),
        "full_logprob_bytes": int(full.nbytes),
        "hf_perplexity": float(np.exp(-arrays["target_logprob"].astype(np.float64).mean())),
        "top_k": top_k,
        "top_k_mass_mean": float(mass.mean()),
        "top_k_mass_min": float(mass.min()),
    }
    return arrays, summary


def score_base(base, records: list[dict], full):
    """KL(merged || base) at the positions whose merged distribution is stored in full: how far the
    fine-tune moved the model, the yardstick for how much of it a GGUF may lose (verify)."""
    import numpy as np
    import torch

    kls, row = [], 0
    for record in records:
        if row >= len(full):
            break
        take = min(len(full) - row, len(record["positions"]))
        with torch.no_grad():
            logits = base(input_ids=torch.tensor([record["input_ids"]], device=base.device)).logits[0]
        q = torch.log_softmax(logits[record["positions"][:take]].double(), -1).cpu().numpy()
        p = full[row : row + take].astype(np.float64)
        p = p - np.log(np.exp(p).sum(-1, keepdims=True))  # renormalise what fp16 rounded
        kls.append((np.exp(p) * (p - q)).sum(-1))
        row += take
    return np.maximum(np.concatenate(kls), 0.0).astype(np.float32) if kls else np.zeros(0, dtype=np.float32)


def base_answers(base, records: list[dict], max_new: int, stops: list[int]) -> None:
    """The base model's greedy answer per golden prompt (record['base_answer_ids']): where it differs from
    the merged model's, the fine-tune changed the answer, and the GGUF must keep that change."""
    import torch

    for record in records:
        with torch.no_grad():
            # Argmax whatever the base's generation_config suggests (Qwen2.5-Instruct's repetition_penalty 1.05
            # would otherwise shape the answer the fine-tune is judged against).
            out = base.generate(
                torch.tensor([record["prompt_ids"]], device=base.device),
                max_new_tokens=max_new,
                do_sample=False,
                repetition_penalty=1.0,
                num_beams=1,
                eos_token_id=stops or None,
                pad_token_id=(stops or [0])[0],
            )
        new = out[0, len(record["prompt_ids"]) :].tolist()
        cut = next((i for i, t in enumerate(new) if t in stops), None)
        record["base_answer_ids"] = new[:cut] if cut is not None else new


def greedy_answers(
    model, records: list[dict], max_new: int, stops: list[int], progress: Progress | None = None
) -> None:
    """HF greedy answer per golden prompt, then HF's top-1 and margin at each answer token (teacher-forced)."""
    import torch

    for n, record in enumerate(records):
        if progress is not None:
            progress.update(n, f"golden prompt {n + 1}/{len(records)}")
        prompt = record["prompt_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt], device=model.device),
                max_new_tokens=max_new,
                do_sample=False,
                repetition_penalty=1.0,
                num_beams=1,
                eos_token_id=stops or None,
                pad_token_id=(stops or [0])[0],
            )
        new = out[0, len(prompt) :].tolist()
        cut = next((i for i, t in enumerate(new) if t in stops), None)
        answer = new[:cut] if cut is not None else new
        forced = answer + ([new[cut]] if cut is not None else [])
        record["answer_ids"] = answer
        record["stop_id"] = new[cut] if cut is not None else None
        if not forced:
            record["top1"], record["margins"] = [], []
            continue
        full = prompt + forced
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([full], device=model.device)).logits[
                0, len(prompt) - 1 : len(full) - 1
            ]
        top2 = torch.log_softmax(logits.float(), -1).topk(2, dim=-1)
        record["top1"] = top2.indices[:, 0].tolist()
        record["margins"] = [round(float(m), 5) for m in (top2.values[:, 0] - top2.values[:, 1])]
    if progress is not None:
        progress.update(len(records), f"{len(records)} golden prompts answered")


@exclusive
def run(config) -> dict:
    golden_file = {"golden_prompts": sha256_file(config.golden_prompts)} if config.golden_prompts else None
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS, extra_inputs=golden_file)
    if ctx.done:
        return ctx.done
    reset_dir(ctx)
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_offline_if_local(config)
    merged = ctx.upstream_dir("merge") / MERGED_DIR
    tokenizer = AutoTokenizer.from_pretrained(merged)
    set_template_kwargs(tokenizer, template_kwargs(template_of(tokenizer), config.thinking))
    device = "cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu"
    # bf16 on the GPU is what the merged model is; fp32 on the CPU, where bf16 matmuls are slow.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=dtype).to(device).eval()

    evaluation = eval_records(config, tokenizer)
    if not evaluation:
        raise LorashipError("reference: the eval split has no scored tokens; add eval_datasets or raise val_set_size")
    # One progress artifact for the stage: the eval texts, then the golden prompts.
    key = artifact_key(config.run_name, STAGE, "progress")
    arrays, summary = score_eval(
        model,
        evaluation,
        config.reference_top_k,
        Progress(f"{STAGE}: eval", len(evaluation), log, key=key),
        config.reference_full_logprob_tokens,
        config.reference_full_logprob_mib,
    )
    golden = golden_records(config, tokenizer)
    stops = stop_ids(tokenizer, merged)
    greedy_answers(
        model, golden, config.max_new_tokens, stops, Progress(f"{STAGE}: golden", len(golden), log, key=key)
    )
    for record in golden:
        record["answer_text"] = tokenizer.decode(record["answer_ids"], skip_special_tokens=True).strip()
    # The base model, after the merged one is freed (both at once would not fit a 14B on the card).
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    log.info("%s: the base model on the same positions and golden prompts", STAGE)
    base = (
        AutoModelForCausalLM.from_pretrained(resolve_base_model(config, weights=True), dtype=dtype).to(device).eval()
    )
    arrays["base_kl"] = score_base(base, evaluation, arrays["full_logprobs"])
    base_answers(base, golden, config.max_new_tokens, stops)
    del base
    summary["base_kl_mean"] = float(arrays["base_kl"].mean()) if len(arrays["base_kl"]) else None
    summary["golden_changed_by_finetune"] = sum(r["base_answer_ids"] != r["answer_ids"] for r in golden)

    reference = {
        "merged_digest": merged_digest(ctx.upstream["merge"]),
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "tokenizer": {
            "adds_bos": adds_bos(tokenizer),
            "bos_id": tokenizer.bos_token_id,
            "stop_ids": stops,
            # What a chat answer must end with, in HF and llama.cpp alike (None: no template).
            "turn_end_id": turn_end_id(tokenizer),
            "markers": template_markers(tokenizer),
            "chat_template": template_of(tokenizer),
            # The variables every rendering passed the template (config `thinking`); the served check passes them too.
            "template_kwargs": template_kwargs_of(tokenizer),
        },
        "eval": [
            {k: r[k] for k in ("kind", "text", "add_bos", "served_ids", "input_ids", "positions")} for r in evaluation
        ],
        "golden": golden,
        **summary,
    }
    with atomic_path(ctx.dir / REFERENCE_TOPK_FILE) as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, **arrays)  # fp16 log-probs barely compress; zlib on 1 GiB is minutes
    atomic_write_json(ctx.dir / REFERENCE_FILE, reference)
    return ctx.finish({**summary, "eval_examples": len(evaluation), "golden_prompts": len(golden), "device": device})


if __name__ == "__main__":
    main(run)
