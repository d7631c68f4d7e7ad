"""Verify: prove the shipped GGUF under the same llama.cpp users will run it with.

Gates (all must pass; verify.json records each with its value and threshold):
- the GGUF's file type is the requested quantization;
- chat template, BOS and EOS are inside the GGUF and equal the merged model's (a lost template
  makes models ramble in Ollama/llama.cpp: shared/PITFALLS.md);
- llama.cpp tokenizes every golden prompt, rendered with the GGUF's own template, exactly as HF does;
- greedy answers to golden prompts from llama.cpp equal the merged HF model's, and match the
  expected format where one is given;
- perplexity on the eval split under llama.cpp is within perplexity_ratio_max of the merged HF model's;
- eval loss after training is below the base model's;
- weights + KV cache at target_context + compute buffers fit target_gpu_memory_gib.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

from loraship import memory
from loraship.chat import render_chat
from loraship.constants import (
    GGUF_FILE_TYPES, GGUF_KEY_BOS, GGUF_KEY_CHAT_TEMPLATE, GGUF_KEY_EOS, GGUF_KEY_FILE_TYPE, MERGED_DIR, VERIFY_FILE,
    quantized_gguf_name,
)
from loraship.data import IGNORE_INDEX, load_splits, read_rows
from loraship.errors import LorashipError
from loraship.gguf_info import read_gguf
from loraship.manifest import atomic_write_json, sha256_file
from loraship.stage import exclusive, main, open_stage, reset_dir

STAGE = "verify"
UPSTREAM = ("train", "merge", "quantize")
FIELDS = (
    "golden_prompts", "max_new_tokens", "golden_match_min", "golden_margin", "perplexity_ratio_max", "verify_max_examples",
    "target_gpu_memory_gib", "target_context", "device", "datasets", "eval_datasets", "val_set_size",
    "sequence_len", "truncation", "seed", "quantization",
)
log = logging.getLogger("loraship.verify")


def gate(value, threshold, passed: bool, note: str = "") -> dict:
    return {"passed": bool(passed), "value": value, "threshold": threshold, **({"note": note} if note else {})}


def golden_rows(config) -> list[dict]:
    if config.golden_prompts:
        rows = read_rows(config.golden_prompts, "golden")
        return [r if "messages" in r else {**r, "messages": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    # Without a golden file, the first user turns of chat eval rows stand in (answers compared HF vs GGUF).
    specs = config.eval_datasets or config.datasets
    chats = [r for s in specs if s.type == "chat" for r in read_rows(s.path, s.type)]
    return [{"messages": [m for m in r["messages"] if m["role"] != "assistant"][:1]} for r in chats[:8]]


def hf_greedy(model, ids: list[int], max_new: int, eos: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=model.device), max_new_tokens=max_new, do_sample=False,
            eos_token_id=eos, pad_token_id=eos,
        )
    new = out[0, len(ids):].tolist()
    return new[: new.index(eos)] if eos in new else new


def llama_greedy(llm, ids: list[int], max_new: int, eos: int) -> list[int]:
    """Argmax decoding straight from llama.cpp's logits: no sampler settings to disagree on."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(max_new):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if tok == eos:
            break
        out.append(tok)
        llm.eval([tok])
    return out


def teacher_forced_agreement(model, llm, prompt: list[int], answer: list[int], margin: float) -> tuple[int, int]:
    """(decisive positions, of which llama.cpp agrees) with HF's answer fed to both runtimes.

    A position is decisive when the merged model's top token leads its runner-up by >= margin
    nats; there quantization must not change the choice. Near-ties are reported, not gated.
    """
    import numpy as np
    import torch

    if not answer:
        return 0, 0
    full = prompt + answer
    span = slice(len(prompt) - 1, len(full) - 1)
    with torch.no_grad():
        hf = torch.log_softmax(model(input_ids=torch.tensor([full], device=model.device)).logits[0, span].float(), -1)
    llm.reset()
    llm.eval(full)
    cpp_top = np.array(llm.scores[: len(full)])[span].argmax(-1)
    top2 = hf.topk(2, dim=-1).values.cpu()
    decisive = (top2[:, 0] - top2[:, 1]) >= margin
    agree = torch.from_numpy(cpp_top) == hf.argmax(-1).cpu()
    return int(decisive.sum()), int((decisive & agree).sum())


def token_nll(logits, targets):
    """Negative log-likelihood per target from a [n, vocab] logits array (numpy)."""
    import numpy as np

    logits = logits.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return lse - logits[np.arange(len(targets)), targets]


def perplexities(model, llm, examples: list[dict]) -> dict:
    """Eval-split perplexity on target tokens under HF and llama.cpp, and their mean KL."""
    import numpy as np
    import torch

    hf_nll, cpp_nll, kls = [], [], []
    for e in examples:
        ids, labels = e["input_ids"], e["labels"]
        positions = [i for i in range(len(ids) - 1) if labels[i + 1] != IGNORE_INDEX]
        if not positions:
            continue
        targets = np.array([ids[i + 1] for i in positions])
        with torch.no_grad():
            hf_logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().cpu().numpy()
        llm.reset()
        llm.eval(ids)
        cpp_logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        hf_nll += token_nll(hf_logits[positions], targets).tolist()
        cpp_nll += token_nll(cpp_logits[positions], targets).tolist()
        p = torch.log_softmax(torch.from_numpy(hf_logits[positions]).double(), -1)
        q = torch.log_softmax(torch.from_numpy(cpp_logits[positions]).double(), -1)
        kls += (p.exp() * (p - q)).sum(-1).tolist()
    if not hf_nll:
        raise LorashipError("verify: the eval split has no target tokens; add eval data (eval_datasets or val_set_size)")
    return {
        "tokens": len(hf_nll),
        "hf_perplexity": float(np.exp(np.mean(hf_nll))),
        "gguf_perplexity": float(np.exp(np.mean(cpp_nll))),
        "mean_kl_hf_to_gguf": float(np.mean(kls)),
    }


@exclusive
def run(config) -> dict:
    golden_file = {"golden_prompts": sha256_file(config.golden_prompts)} if config.golden_prompts else None
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS, extra_inputs=golden_file)
    if ctx.done:
        return ctx.done
    reset_dir(ctx)
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = ctx.upstream_dir("quantize") / quantized_gguf_name(config.quantization)
    merged = ctx.upstream_dir("merge") / MERGED_DIR
    info = read_gguf(gguf_path)
    fields = info["fields"]
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model_config = json.loads((merged / "config.json").read_text(encoding="utf-8"))
    gates: dict[str, dict] = {}
    report: dict = {"gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size}

    want = GGUF_FILE_TYPES[config.quantization]
    gates["file_type"] = gate(fields.get(GGUF_KEY_FILE_TYPE), want, fields.get(GGUF_KEY_FILE_TYPE) == want)
    template = fields.get(GGUF_KEY_CHAT_TEMPLATE)
    gates["chat_template_in_gguf"] = gate(
        bool(template), True, bool(template) and template == tokenizer.chat_template,
        "present and identical to the merged model's template",
    )
    bos, eos = fields.get(GGUF_KEY_BOS), fields.get(GGUF_KEY_EOS)
    gates["bos_eos_in_gguf"] = gate(
        {"bos": bos, "eos": eos}, {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id},
        bos == tokenizer.bos_token_id and eos == tokenizer.eos_token_id and eos is not None,
    )

    footprint = memory.plan_disk_and_inference(model_config, config)["inference"]
    needed_gib = report["gguf_bytes"] / 2**30 + footprint["kv_cache_gib"] + footprint["compute_buffer_gib"]
    gates["fits_target_gpu"] = gate(
        round(needed_gib, 3), config.target_gpu_memory_gib, needed_gib <= config.target_gpu_memory_gib,
        f"GGUF file + f16 KV cache at n_ctx {config.target_context} + compute buffers (predicted)",
    )

    train_metrics = ctx.upstream["train"]["metrics"]
    before, after = train_metrics.get("eval_loss_before"), train_metrics.get("eval_loss_after")
    gates["eval_loss_improved"] = gate(
        {"before": before, "after": after}, "after < before", before is not None and after is not None and after < before
    )

    device = "cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=dtype).to(device).eval()
    _train, evaluation = load_splits(config, tokenizer)
    examples = evaluation.examples[: config.verify_max_examples]
    golden = golden_rows(config)
    longest = max([len(e["input_ids"]) for e in examples] + [config.sequence_len])
    n_ctx = min(model_config.get("max_position_embeddings", 4096), max(512, longest + config.max_new_tokens + 8))
    llm = Llama(
        model_path=str(gguf_path), n_ctx=n_ctx, n_gpu_layers=-1 if device == "cuda" else 0, logits_all=True,
        verbose=False, seed=config.seed, n_threads=os.cpu_count() or 1,
    )

    ppl = perplexities(model, llm, examples)
    ratio = ppl["gguf_perplexity"] / ppl["hf_perplexity"]
    report["perplexity"] = ppl
    gates["perplexity_ratio"] = gate(round(ratio, 4), config.perplexity_ratio_max, ratio <= config.perplexity_ratio_max)

    answers, parity, matches, formatted, gen_tokens, gen_seconds = [], 0, 0, 0, 0, 0.0
    decisive = agreed = 0
    bos_text, eos_text = tokenizer.bos_token or "", tokenizer.eos_token or ""
    for row in golden:
        prompt = render_chat(template or tokenizer.chat_template, row["messages"], bos_token=bos_text,
                             eos_token=eos_text, add_generation_prompt=True)
        hf_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        cpp_ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        parity += hf_ids == cpp_ids
        hf_out = hf_greedy(model, hf_ids, config.max_new_tokens, tokenizer.eos_token_id)
        t0 = time.perf_counter()
        cpp_out = llama_greedy(llm, hf_ids, config.max_new_tokens, tokenizer.eos_token_id)
        gen_seconds += time.perf_counter() - t0
        gen_tokens += len(cpp_out)
        hf_text = tokenizer.decode(hf_out, skip_special_tokens=True).strip()
        cpp_text = llm.detokenize(cpp_out).decode("utf-8", errors="replace").strip()
        matches += hf_out == cpp_out
        n_decisive, n_agree = teacher_forced_agreement(
            model, llm, hf_ids, hf_out + [tokenizer.eos_token_id], config.golden_margin
        )
        decisive += n_decisive
        agreed += n_agree
        ok_format = bool(re.search(row["expect_regex"], cpp_text)) if row.get("expect_regex") else True
        formatted += ok_format
        answers.append({"prompt": row["messages"][-1]["content"], "hf": hf_text, "gguf": cpp_text,
                        "match": hf_out == cpp_out, "format_ok": ok_format,
                        **({"reference": row["reference"]} if row.get("reference") else {})})
    n = max(len(golden), 1)
    gates["tokenizer_parity"] = gate(f"{parity}/{len(golden)}", "all", parity == len(golden),
                                     "llama.cpp tokenization of the GGUF-rendered prompt equals HF's")
    gates["golden_match"] = gate(round(matches / n, 4), config.golden_match_min, matches / n >= config.golden_match_min,
                                 "greedy llama.cpp answer == greedy merged-HF answer, token for token")
    gates["golden_decisive_agreement"] = gate(
        f"{agreed}/{decisive}", "all", agreed == decisive,
        f"HF answer teacher-forced; tokens where the merged model leads by >= {config.golden_margin} nats",
    )
    gates["golden_format"] = gate(f"{formatted}/{len(golden)}", "all", formatted == len(golden))
    with_reference = [a for a in answers if "reference" in a]
    report["golden_answers"] = answers
    if with_reference:
        report["golden_accuracy_vs_reference"] = sum(a["gguf"] == a["reference"] for a in with_reference) / len(with_reference)
    report["gguf_tokens_per_s"] = round(gen_tokens / gen_seconds, 1) if gen_seconds else None
    report["device"] = device
    report["n_ctx"] = n_ctx
    passed = all(g["passed"] for g in gates.values())
    verdict = {"passed": passed, "gates": gates, **report}
    atomic_write_json(ctx.dir / VERIFY_FILE, verdict)
    if not passed:
        failed = ", ".join(f"{k} (value {g['value']}, threshold {g['threshold']})" for k, g in gates.items() if not g["passed"])
        raise LorashipError(f"verify failed: {failed}; details in {ctx.dir / VERIFY_FILE}")
    return ctx.finish({"passed": True, "gates": {k: g["passed"] for k, g in gates.items()},
                       "perplexity_ratio": ratio, "golden_match": matches / n,
                       "gguf_tokens_per_s": report["gguf_tokens_per_s"]})


if __name__ == "__main__":
    main(run)
