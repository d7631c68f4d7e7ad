"""Merge: fold the adapter into the bf16 base, shard by shard, and prove it on a probe batch.

Merging streams one safetensors shard at a time (W' = W + scale * B @ A in fp32, stored bf16),
so RAM stays at one shard however large the model: OOM during merge is a common failure of
other tools. QLoRA adapters are merged into the bf16 base, never the NF4
copy; the probe measures what that does to the logits the adapter was trained against. A base stored 4-bit
(a -bnb-4bit folder) has no bf16 copy: its NF4 weights are dequantized and merged (loraship/prequantized.py).

Probe invariant: merged logits equal base+adapter logits (up to bf16 rounding of the merged
weights) and differ from the base logits.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from loraship.chat import resolve_template
from loraship.constants import ADAPTER_DIR, GENERATION_CONFIG_FILE, MERGED_DIR, PROBE_FILE
from loraship.data import load_splits
from loraship.errors import IntegrityError, LorashipError
from loraship.expert_merge import expert_merges
from loraship.runtime.manifest import atomic_path, atomic_write_json
from loraship.models import (
    config_json,
    EMBED_TOKENS,
    LM_HEAD,
    check_base_model,
    embedding_only_as_lm_head,
    hf_offline_if_local,
    resolve_base_model,
    ties_embeddings,
    weight_files,
)
from loraship.planning.estimate import NF4_BYTES_PER_PARAM
from loraship.planning.preflight import check_free_disk
from loraship.prequantized import bnb_quantization, dequantized, weight_names
from loraship.runtime.progress import Progress, artifact_key
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir
from loraship.sampling import GREEDY

STAGE = "merge"
UPSTREAM = ("train",)  # the base model's identity reaches merge through train's strategy.json
FIELDS = ("base_model", "base_model_revision", "adapter", "chat_template")
TOKENIZER_FILES = ("tokenizer.model", "chat_template.jinja")
log = logging.getLogger("loraship.merge")


def adapter_config(adapter_dir: Path) -> dict:
    """adapter_config.json of a PEFT LoRA adapter, refused with the file's name unless it holds what merging
    needs: an object with a positive rank `r` and a number `lora_alpha`."""
    from loraship.models import json_file_problems

    path = adapter_dir / "adapter_config.json"
    fix = "run the train stage again (loraship run CONFIG --from train), or restore the adapter folder it wrote"
    if not path.is_file():
        raise IntegrityError(f"{path}: not found; the adapter folder has no adapter_config.json; {fix}")

    def check(cfg: dict) -> list[str]:
        problems = []
        r, alpha = cfg.get("r"), cfg.get("lora_alpha")
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            problems.append(f"'r' is {json.dumps(r)}, not a positive whole number (the LoRA rank)")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            problems.append(f"'lora_alpha' is {json.dumps(alpha)}, not a number")
        return problems

    cfg, problems = json_file_problems(path, check, fix)
    if problems:
        raise IntegrityError(f"{adapter_dir}: " + "\n  ".join(problems))
    return cfg


def lora_deltas(adapter_dir: Path) -> tuple[dict, float]:
    """{base weight name: (A, B)} and the scale from a PEFT LoRA adapter folder."""
    from safetensors.torch import load_file

    cfg = adapter_config(adapter_dir)
    if cfg.get("use_dora"):
        raise LorashipError("DoRA adapters cannot be merged shard by shard; train with use_dora off")
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (r**0.5 if cfg.get("use_rslora") else r)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    pairs: dict[str, dict] = {}
    for key, value in tensors.items():
        m = re.match(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$", key)
        if not m:
            raise LorashipError(f"adapter tensor {key!r} is not a plain LoRA A/B weight; loraship merges LoRA only")
        pairs.setdefault(m.group(1) + ".weight", {})[m.group(2)] = value
    return {name: (ab["A"], ab["B"]) for name, ab in pairs.items()}, scale


def merge_shards(
    base_dir: Path, adapter_dir: Path, out_dir: Path, dtype_name: str = "bfloat16", progress_key: str | None = None
) -> dict:
    """progress_key: the Prefect progress artifact's key inside a flow run (loraship/runtime/progress.py)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    dtype = getattr(torch, dtype_name)
    deltas, scale = lora_deltas(adapter_dir)
    cfg = config_json(base_dir)
    # A tied embedding stored only as lm_head.weight is written under the embedding's own name, the one
    # transformers' save_pretrained uses for tied weights: llama.cpp's converter maps tensors by name and
    # would otherwise write a GGUF without token_embd.weight, which llama.cpp cannot load.
    renamed = {LM_HEAD: EMBED_TOKENS} if ties_embeddings(cfg) and embedding_only_as_lm_head(base_dir) else {}
    prequantized = bnb_quantization(cfg) == "4bit"  # a -bnb-4bit base: merged into its dequantized NF4 weights
    shards = weight_files(base_dir)
    # A mixture of experts' expert LoRA, one pair per stacked tensor for all its experts (loraship/expert_merge.py).
    stacked = expert_merges(deltas, cfg, base_weight_names(shards))
    remaining = set(deltas) | set(stacked)
    sizes = [shard.stat().st_size for shard in shards]
    progress = Progress(STAGE, sum(sizes), log, key=progress_key)  # by bytes: shards differ in size
    for i, shard in enumerate(shards):
        merged = {}
        try:
            with safe_open(shard, framework="pt") as f:
                tensors = dequantized(f, dtype) if prequantized else ((n, f.get_tensor(n)) for n in f.keys())
                for name, w in tensors:
                    if name in deltas:
                        a, b = deltas[name]
                        w = w.float() + scale * (b.float() @ a.float())
                        remaining.discard(name)
                    elif name in stacked:
                        w = stacked[name](w, scale)
                        remaining.discard(name)
                    merged[renamed.get(name, name)] = w.to(dtype) if w.is_floating_point() else w
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise IntegrityError(f"{shard}: cannot read base weights ({e}); the file is truncated or corrupt") from e
        save_file(merged, out_dir / shard.name, metadata={"format": "pt"})
        progress.update(sum(sizes[: i + 1]), f"shard {i + 1}/{len(shards)} ({shard.name})")
    if remaining:
        raise LorashipError(
            f"adapter weights with no matching base weight: {sorted(remaining)[:5]}; wrong base model?"
        )
    index = base_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text(encoding="utf-8"))
        kept = weight_names(set(data.get("weight_map", {})))
        data["weight_map"] = {renamed.get(k, k): v for k, v in data.get("weight_map", {}).items() if k in kept}
        (out_dir / index.name).write_text(json.dumps(data, indent=2), encoding="utf-8")
    cfg["torch_dtype"] = dtype_name
    cfg.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    if (base_dir / "generation_config.json").exists():
        shutil.copy(base_dir / "generation_config.json", out_dir)
    return {
        "merged_modules": len(deltas),
        "merged_expert_tensors": len(stacked),  # as the base stores them: stacked, or one per expert and part
        "scale": scale,
        "shards": len(shards),
        "renamed_tensors": renamed,
        # What the adapter was folded into: the bf16 base, or a -bnb-4bit base's weights dequantized from NF4.
        "base_weights": "nf4 dequantized to bf16 (pre-quantized base)" if prequantized else "as stored",
    }


def base_weight_names(shards: list[Path]) -> set[str]:
    """Every tensor name of the base's safetensors shards, from their headers."""
    from safetensors import safe_open

    names: set[str] = set()
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                names.update(weight_names(set(f.keys())))
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise IntegrityError(f"{shard}: cannot read base weights ({e}); the file is truncated or corrupt") from e
    return names


def copy_tokenizer(base_dir: Path, out_dir: Path, trust_remote_code: bool) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir, trust_remote_code=trust_remote_code)
    tokenizer.save_pretrained(out_dir)
    # save_pretrained rewrites tokenizer_config.json and may drop keys it rebuilds on load
    # (transformers 5 drops `legacy`); the base's own file is the truth the converter reads.
    for name in ("tokenizer_config.json", "special_tokens_map.json", *TOKENIZER_FILES):
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, out_dir / name)
    ensure_added_tokens_decoder(out_dir / "tokenizer_config.json", tokenizer)


def write_chat_template(out_dir: Path, configured: str | None) -> None:
    """The config's chat template into the merged tokenizer, where the GGUF converter reads it.

    convert_hf_to_gguf.py takes tokenizer_config.json's `chat_template` before chat_template.jinja;
    both are written so transformers and the converter see the same text.
    """
    if not configured:
        return
    template = resolve_template(configured)
    config_file = out_dir / "tokenizer_config.json"
    data = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    data["chat_template"] = template
    config_file.write_text(json.dumps(data, indent=2), encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")


def stop_at_turn_end(out_dir: Path) -> dict | None:
    """Make generation_config's eos list the tokens llama.cpp stops on: add the template's turn-end token
    (ChatML on a base whose EOS is <|endoftext|>: llama.cpp stops at <|im_end|> by name, HF only at what
    generation_config lists), and drop stop tokens llama.cpp does not end generation on and a GGUF cannot
    make it (Phi-3's <|assistant|>): the merged model then stops where the served GGUF does, and the
    reference answers verify compares against are the ones users get. None without a template; else the
    turn end, with the stop tokens dropped."""
    from transformers import AutoTokenizer

    from loraship.chat import ends_generation_in_llama_cpp, template_of, turn_end

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if template_of(tokenizer) is None:
        return None
    end = turn_end(tokenizer)
    gen_file = out_dir / "generation_config.json"
    gen = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.exists() else {}
    if not gen:
        model_config = config_json(out_dir)
        gen = {
            k: model_config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if model_config.get(k) is not None
        }
    eos = gen.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    if end["id"] not in eos:
        eos.append(end["id"])
    stops = [{"id": i, "text": tokenizer.convert_ids_to_tokens(i)} for i in eos]
    dropped = [t for t in stops if not ends_generation_in_llama_cpp(t, tokenizer.eos_token_id)]
    eos = [t["id"] for t in stops if t not in dropped]
    gen["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    gen_file.write_text(json.dumps(gen, indent=2), encoding="utf-8")
    return {**end, "stop_tokens_dropped": dropped}


def greedy_generation_config(out_dir: Path) -> dict:
    """generation_config.json decodes greedily with nothing else applied (do_sample false, repetition_penalty
    1.0), as verify checks and the artifact ships (loraship/sampling.py): the base's own suggestions
    (Qwen2.5-Instruct's temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05) would otherwise reach
    the reference's model.generate and, through convert_hf_to_gguf.py, the GGUF's general.sampling.* keys
    that llama-server takes as its defaults. Returns the settings dropped or changed, with the base's values."""
    gen_file = out_dir / GENERATION_CONFIG_FILE
    gen = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.exists() else {}
    if not gen:
        model_config = config_json(out_dir)
        gen = {
            k: model_config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if model_config.get(k) is not None
        }
    shipped, changed = GREEDY.generation_config(gen)
    gen_file.write_text(json.dumps(shipped, indent=2), encoding="utf-8")
    return changed


def ensure_added_tokens_decoder(config_file: Path, tokenizer) -> None:
    """Record added tokens where convert_hf_to_gguf.py looks for them.

    For sentencepiece vocabularies the converter types tokens from tokenizer_config.json's
    added_tokens_decoder; transformers 5 no longer writes it, and without it chat markers such
    as <|user|> land in the GGUF as NORMAL tokens that llama.cpp splits into bytes, so the
    shipped model sees different prompts than it was trained on.
    """
    data = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    if data.get("added_tokens_decoder"):
        return
    data["added_tokens_decoder"] = {
        str(token_id): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "rstrip": tok.rstrip,
            "normalized": tok.normalized,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for token_id, tok in sorted(tokenizer.added_tokens_decoder.items())
    }
    config_file.write_text(json.dumps(data, indent=2), encoding="utf-8")


def probe_device(base_bytes: int) -> tuple[str | None, str]:
    """Where the fp32 probe fits: one fp32 model at a time (the base+adapter, then the merged
    model), about 2.5x the bytes of 16-bit weights. CPU RAM first, then a GPU; else skip and say why
    rather than be killed for memory half-way through a merge of a large model."""
    import torch

    from loraship.planning.resources import available_memory

    needed = 2.5 * base_bytes
    available = available_memory()  # a pod's memory limit, not the node's free RAM
    if needed < 0.8 * available:
        return "cpu", ""
    if torch.cuda.is_available() and needed < 0.9 * torch.cuda.mem_get_info()[0]:
        return "cuda", ""
    return None, (
        f"an fp32 probe needs about {needed / 2**30:.1f} GiB; {available / 2**30:.1f} GiB RAM free and "
        "no GPU with that much free memory"
    )


def probe(
    config,
    base_dir: Path,
    adapter_dir: Path,
    merged_dir: Path,
    examples: list[dict],
    trained_adapter: str,
    device: str = "cpu",
) -> dict:
    """Logits on a probe batch: base, base+adapter (unmerged), merged; plus the NF4 view for QLoRA."""
    import torch
    from transformers import AutoModelForCausalLM

    from loraship.runtime.imports import import_peft
    from loraship.training.packing import collate_padded

    PeftModel = import_peft().PeftModel

    ids, _labels, mask = collate_padded(examples, pad_id=0)
    load = dict(
        dtype=torch.float32,
        trust_remote_code=config.trust_remote_code,
        **({"device_map": {"": 0}} if device == "cuda" else {}),
    )

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()

    base = AutoModelForCausalLM.from_pretrained(base_dir, **load).eval()
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with peft_model.disable_adapter():
        base_logits = logits(peft_model)
    adapted = logits(peft_model)
    del peft_model, base
    merged_logits = logits(AutoModelForCausalLM.from_pretrained(merged_dir, **load).eval())

    valid = mask.bool()

    def kl(p_logits, q_logits) -> float:
        p = torch.log_softmax(p_logits[valid], -1)
        q = torch.log_softmax(q_logits[valid], -1)
        return float((p.exp() * (p - q)).sum(-1).mean())

    adapter_effect = float((adapted - base_logits)[valid].abs().max())
    merge_error = float((merged_logits - adapted)[valid].abs().max())
    result = {
        "probe_tokens": int(valid.sum()),
        "max_abs_diff_merged_vs_adapter": merge_error,
        "max_abs_diff_adapter_vs_base": adapter_effect,
        "kl_adapter_to_merged": kl(adapted, merged_logits),
        "argmax_agreement_merged_vs_adapter": float(
            (merged_logits.argmax(-1) == adapted.argmax(-1))[valid].float().mean()
        ),
        # bf16 storage of W + sBA rounds each weight; the merge is correct when that error is
        # a small fraction of what the adapter changed.
        "merge_matches_adapter": merge_error <= 0.1 * adapter_effect,
        "merge_differs_from_base": adapter_effect > 1e-4,
    }
    if trained_adapter == "qlora":
        result["kl_nf4_training_view_to_merged_bf16"] = nf4_view_kl(
            config, base_dir, adapter_dir, ids, mask, merged_logits, kl
        )
    return result


def nf4_view_kl(config, base_dir, adapter_dir, ids, mask, merged_logits, kl) -> float | None:
    """KL between what the adapter was trained against (NF4 base) and the shipped bf16 merge."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from loraship.runtime.imports import import_peft
    from loraship.training import experts

    PeftModel = import_peft().PeftModel

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant, dtype=torch.float32)
    # A MoE's stacked experts, which bitsandbytes' loader leaves in 16 bits, in NF4 as the train stage had them.
    shape = experts.shape_of(base_dir)
    stacked = tuple(experts.stacked_expert_names(base, shape.experts.module)) if shape and shape.experts else ()
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    if stacked:
        experts.fix_peft_param_wrapper()
        experts.quantize_experts(model.get_base_model(), stacked)
    with torch.no_grad():
        nf4_logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits.float().cpu()
    return kl(nf4_logits, merged_logits)


@exclusive
def run(config) -> dict:
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS)
    if ctx.done:
        return ctx.done
    reset_dir(ctx)
    from transformers import AutoTokenizer

    hf_offline_if_local(config)
    base_dir = resolve_base_model(config, weights=True)
    check_base_model(config, base_dir)
    adapter_dir = ctx.upstream_dir("train") / ADAPTER_DIR
    base_bytes = sum(p.stat().st_size for p in weight_files(base_dir))
    base_config = config_json(base_dir)
    # A -bnb-4bit base is written back in bf16: about 2 / 0.53 times its size (estimate.NF4_BYTES_PER_PARAM).
    merged_bytes = base_bytes * (2 / NF4_BYTES_PER_PARAM if bnb_quantization(base_config) == "4bit" else 1)
    check_free_disk(ctx.dir, merged_bytes * 1.05, "merge (bf16 copy of the base)")
    with atomic_path(ctx.dir / MERGED_DIR) as tmp:
        tmp.mkdir()
        info = merge_shards(base_dir, adapter_dir, tmp, progress_key=artifact_key(config.run_name, STAGE, "progress"))
        copy_tokenizer(base_dir, tmp, config.trust_remote_code)
        write_chat_template(tmp, config.chat_template)
        turn_end = stop_at_turn_end(tmp)
        generation_changed = greedy_generation_config(tmp)
    tokenizer = AutoTokenizer.from_pretrained(ctx.dir / MERGED_DIR)
    _train, evaluation = load_splits(config, tokenizer)
    examples = (evaluation.examples or _train.examples)[:4]
    # The plan may have switched lora -> qlora to fit the card; the probe follows what was trained.
    trained_adapter = ctx.upstream["train"]["metrics"]["strategy"]["adapter"]
    device, why = probe_device(base_bytes)
    if device is None:
        checks = {"logits_probe": f"skipped: {why}"}
        log.warning("merge: logits probe skipped: %s", why)
    else:
        checks = probe(config, base_dir, adapter_dir, ctx.dir / MERGED_DIR, examples, trained_adapter, device)
    atomic_write_json(ctx.dir / PROBE_FILE, checks)
    if device is not None and not (checks["merge_matches_adapter"] and checks["merge_differs_from_base"]):
        raise LorashipError(
            f"merge check failed: merged vs base+adapter max |diff| {checks['max_abs_diff_merged_vs_adapter']:.3g}, "
            f"adapter effect {checks['max_abs_diff_adapter_vs_base']:.3g} (see {ctx.dir / PROBE_FILE})"
        )
    return ctx.finish({**info, **checks, "turn_end": turn_end, "generation_config_changed": generation_changed})


if __name__ == "__main__":
    main(run)
