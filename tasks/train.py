"""Train: a LoRA or QLoRA adapter with transformers + PEFT, resumable step by step.

A plain loop rather than HF Trainer so that resume is exact: the data order is a seeded
permutation per epoch, and a checkpoint holds adapter, optimizer, scheduler, step and RNG
state, so a rerun after kill -9 continues the same loss curve at the same data position.
On CUDA it records measured peak memory next to the plan's prediction; an out-of-memory
error re-plans (smaller micro-batch, then QLoRA or offload) and retries instead of failing.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

from loraship import memory
from loraship.constants import ADAPTER_DIR, CHECKPOINTS_DIR, LOSS_HISTORY_FILE, STRATEGY_FILE
from loraship.data import IGNORE_INDEX, load_splits
from loraship.errors import LorashipError
from loraship.manifest import atomic_path, atomic_write_json, atomic_write_text, sha256_json
from loraship.models import check_base_model, hf_offline_if_local, resolve_base_model, torch_load_kwargs
from loraship.stage import exclusive, main, open_stage, reset_dir

STAGE = "train"
UPSTREAM = ("plan",)
FIELDS = (
    "adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "sequence_len", "truncation",
    "micro_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler", "warmup_steps",
    "weight_decay", "num_epochs", "max_steps", "seed", "gradient_checkpointing", "fused_loss", "datasets",
    "eval_datasets", "val_set_size", "device",
)
log = logging.getLogger("loraship.train")


def pick_device(config) -> str:
    import torch

    if config.device == "cuda" and not torch.cuda.is_available():
        raise LorashipError("device: cuda was asked for but no CUDA device is visible; use device: auto or cpu")
    return "cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu"


def load_model(model_dir: Path, config, strategy: dict, device: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    # bf16 on GPUs; fp32 on CPU, where bf16 matmuls are slow and lossy for tiny models.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kwargs = {"dtype": dtype, **torch_load_kwargs(config)}
    if strategy["adapter"] == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    offload = strategy.get("offload_layers", 0) if device == "cuda" else 0
    if offload and strategy["adapter"] == "qlora":
        raise LorashipError("the plan combines QLoRA with CPU offload, which loraship does not support; re-plan")
    if device == "cuda" and not offload:
        kwargs["device_map"] = {"": 0}
    # With offload the model is assembled on the CPU and moved to the GPU after the frozen
    # weights of the offloaded layers were set aside (loraship/offload.py).
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if strategy["gradient_checkpointing"]:
        # Not prepare_model_for_kbit_training: it upcasts embeddings/norms/lm_head to fp32,
        # which costs more memory than it saves (shared/MEMORY.md). We take only what it does for
        # checkpointing: inputs that require grad so the frozen embedding output carries a graph.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = False
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if offload:
        from loraship.offload import offload_frozen_layers

        log.info("train: %.2f GiB of frozen weights kept in CPU memory", offload_frozen_layers(model, offload) / 2**30)
        model.to("cuda")
    if device == "cuda" and strategy["fused_loss"]:
        # Patched once the model sits on the GPU: applied to a CPU-resident model (the offload
        # path) it left the HF loss in place (bench/results/gpu_train_stage.json).
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model.get_base_model(), fused_linear_cross_entropy=True, cross_entropy=False)
    # from_pretrained returns eval mode, where HF silently skips gradient checkpointing
    # (seen on the H200: 67.6 GiB instead of 23.5). Train mode, always.
    model.train()
    return model


def collate(examples: list[dict], pad_id: int):
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        labels[row, :n] = torch.tensor(e["labels"])
        mask[row, :n] = 1
    return ids, labels, mask


def evaluate(model, examples: list[dict], batch_size: int, pad_id: int, device: str) -> float | None:
    """Mean loss per target token over the eval split."""
    import torch

    if not examples:
        return None
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            ids, labels, mask = (t.to(device) for t in collate(examples[i : i + batch_size], pad_id))
            n = int((labels[:, 1:] != IGNORE_INDEX).sum())
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            total += float(loss) * n
            count += n
    model.train(was_training)
    return total / max(count, 1)


def schedule(config, total_steps: int):
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        if config.lr_scheduler == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if config.lr_scheduler == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return factor


def data_order(n: int, micro: int, seed: int, epoch: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    return [order[i : i + micro] for i in range(0, n, micro)]


def save_checkpoint(folder: Path, model, optimizer, scheduler, step: int, history: list[dict]) -> None:
    import torch

    with atomic_path(folder / "last") as tmp:
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True)
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "history": history,
            },
            tmp / "trainer_state.pt",
        )


def load_checkpoint(folder: Path, model, optimizer, scheduler) -> tuple[int, list[dict]]:
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    last = folder / "last"
    if not (last / "trainer_state.pt").is_file():
        return 0, []
    set_peft_model_state_dict(model, load_file(last / "adapter_model.safetensors"))
    # weights_only: even our own checkpoint is loaded without running arbitrary pickled code.
    state = torch.load(last / "trainer_state.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    log.info("train: resumed from checkpoint at step %d", state["step"])
    return state["step"], state["history"]


def train_once(config, ctx, model_dir: Path, strategy: dict, device: str, tokenizer, train, evaluation) -> dict:
    import torch

    torch.manual_seed(config.seed)
    model = load_model(model_dir, config, strategy, device)
    resident_gib = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    micro, accum = strategy["micro_batch_size"], strategy["gradient_accumulation_steps"]
    batches_per_epoch = math.ceil(len(train.examples) / micro)
    steps_per_epoch = max(1, batches_per_epoch // accum)
    total_steps = config.max_steps or max(1, math.ceil(steps_per_epoch * config.num_epochs))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(config, total_steps))

    eval_batch = max(1, micro)
    eval_before = evaluate_base(model, evaluation.examples, eval_batch, pad_id, device)
    checkpoints = ctx.dir / CHECKPOINTS_DIR
    step, history = load_checkpoint(checkpoints, model, optimizer, scheduler)
    resumed_from = step
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens_seen, started = 0, time.perf_counter()
    while step < total_steps:
        epoch, within = divmod(step, steps_per_epoch)
        batches = data_order(len(train.examples), micro, config.seed, epoch)
        group = batches[within * accum : (within + 1) * accum]
        target_tokens = sum(sum(1 for lab in train.examples[i]["labels"][1:] if lab != IGNORE_INDEX) for b in group for i in b)
        step_loss = 0.0
        for batch in group:
            ids, labels, mask = (t.to(device) for t in collate([train.examples[i] for i in batch], pad_id))
            n = int((labels[:, 1:] != IGNORE_INDEX).sum())
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            # Weight each micro-batch by its target tokens, so accumulation equals one big batch.
            (loss * n / max(target_tokens, 1)).backward()
            step_loss += float(loss.detach()) * n / max(target_tokens, 1)
            tokens_seen += int(mask.sum())
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % config.logging_steps == 0 or step == total_steps:
            history.append({"step": step, "epoch": epoch, "loss": round(step_loss, 6), "lr": scheduler.get_last_lr()[0]})
        if step % config.save_steps == 0 and step < total_steps:
            save_checkpoint(checkpoints, model, optimizer, scheduler, step, history)
    seconds = time.perf_counter() - started
    measured = {}
    if device == "cuda":
        measured = {
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
    eval_after = evaluate(model, evaluation.examples, eval_batch, pad_id, device)
    with atomic_path(ctx.dir / ADAPTER_DIR) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
    atomic_write_text(ctx.dir / LOSS_HISTORY_FILE, "".join(json.dumps(h) + "\n" for h in history))
    return {
        "steps": total_steps,
        "resumed_from_step": resumed_from,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "train_tokens_this_run": tokens_seen,
        "tokens_per_s": round(tokens_seen / seconds, 1) if seconds > 0 else None,
        "seconds": round(seconds, 2),
        "measured_memory": {**measured, "allocated_after_load_gib": resident_gib} if measured else {},
    }


def evaluate_base(model, examples, batch_size, pad_id, device):
    """Eval loss of the base model alone: the adapter switched off."""
    with model.disable_adapter():
        return evaluate(model, examples, batch_size, pad_id, device)


@exclusive
def run(config) -> dict:
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS, depends_on={"plan": (STRATEGY_FILE,)})
    if ctx.done:
        return ctx.done
    # Keep checkpoints only when they belong to these exact inputs (resume after a crash).
    marker = ctx.dir / CHECKPOINTS_DIR / "fingerprint"
    keep = (CHECKPOINTS_DIR,) if marker.is_file() and marker.read_text() == ctx.fingerprint else ()
    reset_dir(ctx, keep=keep)
    atomic_write_text(marker, ctx.fingerprint)

    import torch
    from transformers import AutoTokenizer

    hf_offline_if_local(config)
    plan = json.loads((ctx.upstream_dir("plan") / STRATEGY_FILE).read_text(encoding="utf-8"))
    model_dir = resolve_base_model(config, weights=True)
    check_base_model(config, model_dir)
    device = pick_device(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
    train, evaluation = load_splits(config, tokenizer)
    model_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))

    strategy = dict(plan["strategy"])
    if device == "cpu":
        strategy.update(fused_loss=False, offload_layers=0)  # Liger is Triton/CUDA-only; no GPU to offload from
    attempts = []
    current_plan = plan
    while True:
        try:
            result = train_once(config, ctx, model_dir, strategy, device, tokenizer, train, evaluation)
            break
        except torch.OutOfMemoryError as e:
            measured = {}
            if device == "cuda":
                measured = {
                    "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                    "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                }
                torch.cuda.empty_cache()
            nxt = memory.replan_after_oom(current_plan, model_config, config, measured)
            attempts.append({"strategy": strategy, "error": str(e).splitlines()[0], "measured": measured,
                             "under_predicted": (nxt or {}).get("oom_component")})
            if nxt is None:
                raise LorashipError(
                    f"out of GPU memory with every plan tried ({len(attempts)}); under-predicted: "
                    f"{attempts[-1]['under_predicted'] or 'unknown'}. Lower sequence_len or use a larger GPU."
                ) from e
            log.warning("train: out of memory (%s under-predicted); retrying with %s", nxt.get("oom_component"), nxt["strategy"])
            current_plan, strategy = nxt, dict(nxt["strategy"])
            # Checkpoints from another strategy are still valid adapter states; keep them.
    predicted = current_plan["memory"]
    metrics = {
        **result,
        "device": device,
        "strategy": strategy,
        "oom_retries": attempts,
        "train_examples": len(train.examples),
        "eval_examples": len(evaluation.examples),
        "train_tokens": train.tokens,
        "truncated_examples": train.truncated + evaluation.truncated,
        "dropped_examples": train.dropped + evaluation.dropped,
        "truncation_policy": config.truncation,
        "predicted_reserved_gib": predicted.get("predicted_reserved_gib"),
        "predicted_allocated_gib": predicted.get("predicted_allocated_gib"),
        "data_fingerprint": sha256_json([e["input_ids"] for e in train.examples]),
    }
    atomic_write_json(ctx.dir / "train_metrics.json", metrics)
    return ctx.finish(metrics, outputs=None)


if __name__ == "__main__":
    main(run)
