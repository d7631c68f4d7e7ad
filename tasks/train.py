"""Train: a LoRA or QLoRA adapter with transformers + PEFT, resumable step by step.

A plain loop rather than HF Trainer so that resume is exact: the data order is a seeded
permutation per epoch (loraship/training/packing.py), and a checkpoint holds adapter, optimizer, scheduler,
step and RNG state (CPU, CUDA, Python), so a rerun after kill -9 continues the same loss curve at
the same data position. Examples are packed padding-free where the model allows it, each attending to
itself only (loraship/training/packed_attention.py). On CUDA it records measured peak memory next to the
plan's prediction; an out-of-memory error releases the failed attempt, re-plans along the plan's own ladder
(smaller micro-batch, then the config's `fallback`), persists the new plan so a rerun starts from it, and
retries instead of failing.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraship.planning import flops, memory
from loraship.planning.strategy_record import Strategy

from loraship.training import distributed, packed_attention

from loraship.publishing import plots
from loraship.constants import (
    CHECKPOINTS_DIR,
    LOSS_HISTORY_FILE,
    LOSS_PLOT_FILE,
    MEMORY_PLOT_FILE,
    PLAN_FILE,
    STRATEGY_FILE,
)
from loraship.data import IGNORE_INDEX, load_splits
from loraship.errors import LorashipError
from loraship.runtime.manifest import atomic_write_json, atomic_write_text, sha256_json
from loraship.models import check_base_model, hf_offline_if_local, resolve_base_model
from loraship.training.packing import collate_packed, epoch_steps, packing_unsupported, steps_per_epoch
from loraship.training.packing import collate_padded as collate
from loraship.runtime.progress import Progress, artifact_key
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir
from loraship.training.device import (
    compute,
    configure_cuda_allocator,
    gpu_memory_text,
    peak_memory,
    pick_device,
    release_memory,
)
from loraship.training.gradient_checkpointing import decoder_layers
from loraship.training.lora_targets import lora_target_note, lora_targets
from loraship.training.model_loading import (
    LoadedModel,
    host_copy_stats,
    import_training_stack,
    load_model,
    load_tokenizer,
)
from loraship.training.checkpoints import (
    load_checkpoint,
    resume_words,
    save_adapter,
    save_checkpoint,
    set_checkpoints_aside,
)
from loraship.training.evaluation import evaluate, evaluate_base

STAGE = "train"
UPSTREAM = ("plan",)
# Training depends on the plan's strategy only, not its inference estimates (`loraship status` keys it the same way).
DEPENDS_ON = {"plan": (STRATEGY_FILE,)}
FIELDS = (
    "adapter",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "sequence_len",
    "truncation",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "weight_decay",
    "num_epochs",
    "max_steps",
    "seed",
    "optimize",
    "gradient_checkpointing",
    "fused_loss",
    "datasets",
    "eval_datasets",
    "val_set_size",
    "device",
    "packing",
    "fallback",
    "offload_activations",
    "chat_template",
    "thinking",
    "train_on_inputs",
)
REPLANNED_FILE = "replanned.json"  # in the checkpoints folder: kept, like the checkpoints, for a rerun
RANKS_DIR = "ranks"  # in the stage folder: what the ranks were given (job.json), their reports, rank 0's result
RANK_JOB_ARG = "--rank-job"  # python -m loraship.stages.train --rank-job FILE: one rank, as torchrun starts it
log = logging.getLogger("loraship.train")


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


def use_packing(config, model, device: str) -> tuple[bool, str]:
    """Whether this run packs examples, and why (recorded in the manifest). Packing sets the model's attention
    to loraship/training/packed_attention.py."""
    if config.packing == "off":
        return False, "packing: off"
    why_not = packing_unsupported(model, config.sequence_len)
    kernel = packed_attention.kernel_for(device)
    if why_not is None and kernel != "varlen" and device == "cuda" and config.packing == "auto":
        import torch

        # One SDPA call per example is right but slow on a GPU: padding wins there.
        why_not = (
            f"torch {torch.__version__} has no variable-length attention (torch.nn.attention.varlen, torch >= 2.10)"
        )
    if why_not is None:
        model.set_attn_implementation(packed_attention.register())
        return True, (
            f"packing: {config.packing}; examples laid end to end, each attending to itself only "
            f"({kernel} attention; a micro-batch of one length runs as a plain batch)"
        )
    if config.packing == "on":
        raise LorashipError(
            f"packing: on, but {why_not}; set packing: auto (pads where packing is unsupported) or off"
        )
    return False, f"padded batches: {why_not}"


def micro_batch(
    examples: list[dict], rows: list[list[int]], packed: bool, pad_id: int, device: str
) -> tuple[dict, int, int]:
    """Model inputs for one micro-batch, its number of real (non-pad) tokens and of target tokens."""
    batch = [examples[i] for row in rows for i in row]
    if packed and len({len(e["input_ids"]) for e in batch}) == 1:
        # Examples of one length (e.g. long rows cut at sequence_len) leave no padding to remove: as a plain batch
        # with no mask, attention runs SDPA's causal kernel (cuDNN's on Hopper), which on the H200 took 0.54x the
        # time of variable-length FlashAttention on the same tokens (bench/results/train_bench_profile.json).
        ids, labels, _mask = collate(batch, pad_id)
        inputs = {"input_ids": ids, "labels": labels}
    elif packed:
        inputs = collate_packed(batch)
    else:
        ids, labels, mask = collate(batch, pad_id)
        inputs = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    tokens = sum(len(e["input_ids"]) for e in batch)
    # Counted on the CPU: on the GPU it would wait for the copy (a sync per micro-batch).
    targets = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
    on_device = {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in inputs.items()}
    return on_device, tokens, targets


def target_tokens(example: dict) -> int:
    """Labels the model predicts (it shifts by one: the first label is never a target)."""
    return sum(1 for lab in example["labels"][1:] if lab != IGNORE_INDEX)


# Optimizer steps left out of the steady-state rate: the first allocates AdamW's state and runs every kernel's first
# launch (autotuning, cuBLAS heuristics, lazy CUDA module loads); the second still settles the allocator's segments.
WARMUP_STEPS = 2


def steady_rate(stamps: list[tuple[float, int]], warmup: int = WARMUP_STEPS) -> tuple[float | None, str]:
    """Tokens per second after the warm-up steps, from (seconds, tokens so far) stamped after each step of this run,
    and the words that say which steps it covers. None when no step is left after the warm-up."""
    if len(stamps) <= warmup:
        return None, f"no steady-state rate: {len(stamps)} step(s) in this run, the first {warmup} are warm-up"
    (t0, n0), (t1, n1) = stamps[warmup - 1] if warmup else (0.0, 0), stamps[-1]
    if t1 <= t0:
        return None, "no steady-state rate: no time elapsed after the warm-up"
    return round((n1 - n0) / (t1 - t0), 1), (
        f"steady state: steps {warmup + 1}-{len(stamps)} of this run, the first {warmup} (warm-up) left out"
    )


def flops_per_token(model_dir: Path, config, lengths: list[int]) -> float | None:
    """Model FLOPs of one trained token (loraship/planning/flops.py), None for an architecture the planner cannot read."""
    try:
        model_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        return flops.train_flops_per_token(model_config, config, flops.attention_length(lengths))
    except (ValueError, KeyError):
        return None


def utilisation(tokens_per_s: float | None, per_token: float | None, device: str) -> dict:
    """MFU against the card's dense bf16 peak, with the reason where there is none (a CPU, a card not in the table,
    too few steps, an architecture whose FLOPs are not counted)."""
    name = None
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
    if per_token is None:
        return {"mfu": None, "mfu_basis": "no FLOP count for this architecture", "flops_per_token": None}
    value, basis = flops.mfu(tokens_per_s, per_token, name)
    return {"mfu": value, "mfu_basis": basis, "flops_per_token": round(per_token)}


@dataclass(frozen=True)
class Batches:
    """How a run draws its optimizer steps: the examples, their lengths and the micro-batch layout."""

    examples: list[dict]
    lengths: list[int]
    micro: int  # micro_batch_size
    accum: int  # gradient_accumulation_steps
    per_epoch: int  # optimizer steps an epoch, the last, short one included
    packed: bool
    pad_id: int
    seed: int
    sequence_len: int

    def epoch(self, epoch: int) -> list:
        """The epoch's steps, each a list of micro-batches of rows of example indices (a seeded permutation)."""
        budget = self.micro * self.sequence_len if self.packed else None
        return epoch_steps(self.lengths, self.micro, self.accum, self.seed, epoch, budget)


@dataclass
class StepLoop:
    """What the step loop carries from one optimizer step to the next (and train_once reads after it)."""

    step: int
    history: list[dict]
    tokens_seen: int = 0
    started: float = 0.0
    stamps: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens so far) after each step


def train_once(
    config,
    ctx,
    model_dir: Path,
    strategy: Strategy | dict,
    device: str,
    tokenizer,
    train,
    evaluation,
    ranks: distributed.Ranks = distributed.ONE_PROCESS,
) -> dict:
    """One attempt at training `strategy` to the end (resuming its checkpoints), evals before and after; the
    adapter and the loss history written to the stage folder. Raises what the attempt raised (out of memory too)."""
    import torch

    strategy = Strategy.from_json(strategy)
    torch.manual_seed(config.seed)
    loaded = load_model(model_dir, config, strategy, device, ranks.engine, ranks.rank)
    model = loaded.model
    # DDP around it, or FSDP2's shards in place (its parameters replaced: the optimizer is made after), filled from
    # rank 0's weights where only rank 0 read them.
    wrapped = distributed.wrap(
        model,
        ranks.engine,
        ranks.rank,
        decoder_layers(model),
        from_rank0=distributed.rank0_loads_weights(ranks.engine, strategy.adapter),
    )
    resident_gib = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    packed, packing_why = use_packing(config, model, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # A global step is micro-batch x accumulation x ranks, laid out as one process would run it (each rank then
    # trains its share: distributed.rank_share), so the losses and the adapter are those of one process.
    micro, accum = strategy.micro_batch_size, strategy.gradient_accumulation_steps * ranks.world_size
    examples = train.examples
    lengths = [len(e["input_ids"]) for e in examples]
    batches = Batches(
        examples,
        lengths,
        micro,
        accum,
        steps_per_epoch(len(examples), micro, accum),
        packed,
        pad_id,
        config.seed,
        config.sequence_len,
    )
    total_steps = config.max_steps or max(1, math.ceil(batches.per_epoch * config.num_epochs))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(config, total_steps))

    eval_batch = max(1, micro)
    eval_key = artifact_key(config.run_name, STAGE, "eval-progress")
    eval_before = evaluate_base(
        model,
        evaluation.examples,
        eval_batch,
        pad_id,
        device,
        Progress("train: eval before (base model)", None, log, key=eval_key),
        loaded.fused_loss,
    )
    eval_peak = peak_memory(device)
    # The evaluation's activations and logits are free now; hand their cached blocks back so that
    # training's own peak, not the eval's leftovers, shapes the allocator's segments.
    release_memory(device)
    step, history = load_checkpoint(ctx.dir / CHECKPOINTS_DIR, wrapped, optimizer, scheduler)
    resumed_from = step
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    loop = StepLoop(step, history, started=time.perf_counter())
    per_token = flops_per_token(model_dir, config, lengths)
    run_steps(
        config, ctx, wrapped, ranks, batches, trainable, optimizer, scheduler, total_steps, loop, per_token, device
    )
    seconds = time.perf_counter() - loop.started
    measured = distributed.worst_rank_memory(peak_memory(device), ranks.rank)  # the card that limits the plan
    eval_after = evaluate(
        model,
        evaluation.examples,
        eval_batch,
        pad_id,
        device,
        Progress("train: eval after", None, log, key=eval_key),
        fused_loss=loaded.fused_loss,
    )
    save_adapter(ctx.dir, wrapped, tokenizer, loop.history)
    if measured:
        measured.update(
            allocated_after_load_gib=resident_gib, eval_peak_reserved_gib=eval_peak.get("peak_reserved_gib")
        )
    return {
        "steps": total_steps,
        "resumed_from_step": resumed_from,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "first_loss": loop.history[0]["loss"] if loop.history else None,
        "last_loss": loop.history[-1]["loss"] if loop.history else None,
        "packing": {"packed": packed, "why": packing_why},
        **attempt_metrics(loaded, loop, seconds, per_token, device),
        "measured_memory": measured,
    }


def attempt_metrics(loaded: LoadedModel, loop: StepLoop, seconds: float, per_token: float | None, device: str) -> dict:
    """The attempt's speed and what load_model applied, for the manifest."""
    steady, steady_basis = steady_rate(loop.stamps)
    return {
        "fused_lora_linears": loaded.fused_lora,
        # Checkpointed layers whose recompute leaves out down_proj's GEMM by loraship's mark (a frozen down_proj whose
        # layer input stays on the GPU is left out by torch's early stop, not counted here).
        "down_proj_skipped_in_recompute": loaded.recompute_skips,
        "host_copies": host_copy_stats(loaded),
        "train_tokens_this_run": loop.tokens_seen,
        # Steady state (warm-up steps left out), the rate the run sustains; the whole run's rate next to it.
        "tokens_per_s": steady,
        "tokens_per_s_basis": steady_basis,
        "tokens_per_s_overall": round(loop.tokens_seen / seconds, 1) if seconds > 0 else None,
        **utilisation(steady, per_token, device),
        "seconds": round(seconds, 2),
    }


def run_steps(
    config,
    ctx,
    wrapped: distributed.Wrapped,
    ranks: distributed.Ranks,
    batches: Batches,
    trainable: list,
    optimizer,
    scheduler,
    total_steps: int,
    loop: StepLoop,
    per_token: float | None,
    device: str,
) -> None:
    """The optimizer steps from loop.step to total_steps: each accumulates its micro-batches, steps the optimizer,
    reports progress, and every save_steps checkpoints."""
    import torch

    peak = flops.bf16_peak_tflops(torch.cuda.get_device_name(0)) if device == "cuda" and per_token else None
    progress = Progress("train", total_steps, log, key=artifact_key(config.run_name, STAGE, "progress"))
    steps: tuple[int, list] = (-1, [])
    while loop.step < total_steps:
        epoch, within = divmod(loop.step, batches.per_epoch)
        if steps[0] != epoch:
            steps = (epoch, batches.epoch(epoch))
        step_loss = accumulate_step(wrapped, ranks, batches, steps[1][within], loop, device)
        optimizer_step(trainable, optimizer, scheduler)
        loop.step += 1
        elapsed = time.perf_counter() - loop.started
        loop.stamps.append((elapsed, loop.tokens_seen))
        report_progress(progress, loop, total_steps, step_loss, elapsed, per_token, peak, device)
        if loop.step % config.logging_steps == 0 or loop.step == total_steps:
            loop.history.append(
                {"step": loop.step, "epoch": epoch, "loss": round(step_loss, 6), "lr": scheduler.get_last_lr()[0]}
            )
        if loop.step % config.save_steps == 0 and loop.step < total_steps:
            save_checkpoint(ctx.dir / CHECKPOINTS_DIR, wrapped, optimizer, scheduler, loop.step, loop.history)


def accumulate_step(
    wrapped: distributed.Wrapped, ranks: distributed.Ranks, batches: Batches, group: list, loop: StepLoop, device: str
) -> float:
    """Forward and backward of this rank's share of one optimizer step's micro-batches, gradients synced across the
    ranks on the last; the step's loss per target token, summed over the ranks (every rank reports the global one)."""
    examples = batches.examples
    # Weight each micro-batch by its share of the step's target tokens, so accumulation equals one
    # big batch; a short last step of an epoch is then a mean over fewer tokens, not a smaller one.
    step_targets = max(1, sum(target_tokens(examples[i]) for rows in group for row in rows for i in row))
    step_loss, tokens = 0.0, 0
    share = distributed.rank_share(group, ranks.index, ranks.world_size)
    for m, (rows, counts) in enumerate(share):
        with distributed.accumulating(wrapped, final=m == len(share) - 1):
            loss, n_tokens = forward_backward(
                wrapped.module,
                batches,
                rows,
                step_targets,
                device,
                weight=distributed.gradient_scale(ranks.engine) if counts else 0.0,
            )
        step_loss = step_loss + loss  # read once a step: one sync, not one each
        tokens += n_tokens if counts else 0
    step_loss, tokens = distributed.all_sum([float(step_loss), tokens], ranks.rank)
    loop.tokens_seen += int(tokens)
    return step_loss


def forward_backward(
    model, batches: Batches, rows: list[list[int]], step_targets: int, device: str, weight: float = 1.0
):
    """One micro-batch: forward, backward of its share of the step's loss times `weight` (the engine's gradient
    scale; 0 for a rank's stand-in micro-batch); that share (on the device, detached, 0 for a stand-in) and its
    real tokens."""
    inputs, n_tokens, n = micro_batch(batches.examples, rows, batches.packed, batches.pad_id, device)
    with compute(device):
        loss = model(**inputs).loss
    (loss * (n * weight / step_targets)).backward()
    return loss.detach() * (n / step_targets if weight else 0.0), n_tokens


def optimizer_step(trainable: list, optimizer, scheduler) -> None:
    import torch

    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def report_progress(
    progress: Progress,
    loop: StepLoop,
    total_steps: int,
    step_loss: float,
    elapsed: float,
    per_token: float | None,
    peak: float | None,
    device: str,
) -> None:
    rate, _ = steady_rate(loop.stamps)
    if rate is None:
        speed = f"{loop.tokens_seen / max(elapsed, 1e-9):,.0f} tokens/s (warm-up)"
    else:
        speed = f"{rate:,.0f} tokens/s" + (f", MFU {rate * per_token / 1e12 / peak:.0%}" if peak else "")
    progress.update(
        loop.step, f"step {loop.step}/{total_steps}, loss {step_loss:.4f}, {speed}{gpu_memory_text(device)}"
    )


# Messages of out-of-memory errors that do not arrive as torch.OutOfMemoryError: a cudaMalloc outside
# the caching allocator ("CUDA error: out of memory"), cuBLAS failing to allocate its workspace
# (CUBLAS_STATUS_ALLOC_FAILED, raised by torch as a RuntimeError), and Triton kernels (Liger) asking for
# more shared memory than the GPU has (triton.runtime.errors.OutOfResources: "out of resource: ...").
OOM_MESSAGES = ("out of memory", "cublas_status_alloc_failed", "out of resource")


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    if type(error).__name__ in ("OutOfResources", "OutOfMemoryError"):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in OOM_MESSAGES)


def for_device(strategy: dict, config, device: str, n_layers: int | None) -> Strategy:
    """The plan's strategy as this machine can run it (a plan from before a key upgraded here, once)."""
    out = Strategy.from_json(strategy, n_layers).replace(fused_loss=memory.fused_loss_available(config, device))
    return out.replace(offload_layers=0) if device == "cpu" else out  # no GPU to offload from


@dataclass(frozen=True)
class Attempts:
    """Where the out-of-memory retries stand: the plan tried next, its strategy as this machine runs it, why it was
    chosen; the attempts that ran out of memory, and the re-plans that trained again from step 0."""

    plan: dict
    strategy: Strategy
    reason: str | None
    failed: tuple[dict, ...] = ()
    restarts: tuple[dict, ...] = ()

    def to_json(self) -> dict:
        return {"plan": self.plan, "attempts": list(self.failed), "restarts": list(self.restarts)}


def starting_plan(ctx, config, model_config: dict, n_layers: int | None, device: str) -> Attempts:
    """The plan the first attempt trains: the plan stage's, re-planned where this machine lacks the fused loss it
    assumed, or the one an earlier run of these exact inputs re-planned to after running out of memory."""
    plan = json.loads((ctx.upstream_dir("plan") / STRATEGY_FILE).read_text(encoding="utf-8"))
    plan_file = ctx.upstream_dir("plan") / PLAN_FILE
    reason = json.loads(plan_file.read_text(encoding="utf-8")).get("reason") if plan_file.is_file() else None
    start = Attempts(plan, for_device(plan["strategy"], config, device, n_layers), reason)
    if device == "cuda" and plan["strategy"]["fused_loss"] and not start.strategy.fused_loss:
        # The plan was made where liger-kernel is importable and this machine lacks it: the HF loss
        # needs more memory than planned, so plan again here, with the same ladder and fallback.
        plan = memory.plan_training(model_config, config)
        start = Attempts(
            plan,
            for_device(plan["strategy"], config, device, n_layers),
            f"re-planned in the train environment, where liger-kernel is not importable: {plan['reason']}",
        )
    replanned = ctx.dir / CHECKPOINTS_DIR / REPLANNED_FILE
    if replanned.is_file():
        # An earlier run of these exact inputs ran out of memory and re-planned: start where it ended.
        saved = json.loads(replanned.read_text(encoding="utf-8"))
        start = Attempts(
            saved["plan"],
            for_device(saved["plan"]["strategy"], config, device, n_layers),
            start.reason,
            tuple(saved["attempts"]),
            tuple(saved.get("restarts", [])),
        )
        log.info(
            "train: starting from the strategy re-planned after %d out-of-memory error(s): %s",
            len(start.failed),
            start.strategy.to_json(),
        )
    return start


def train_until_it_fits(
    config,
    ctx,
    model_dir: Path,
    model_config: dict,
    n_layers: int | None,
    start: Attempts,
    device: str,
    tokenizer,
    train,
    evaluation,
    engine: distributed.Engine = distributed.ONE_PROCESS.engine,
) -> tuple[dict, Attempts]:
    """train_once, and after each out-of-memory error the next smaller plan (replan_after_oom) until one trains to
    the end; the result and how the attempts went. Raises naming the fix when no smaller plan is left."""
    import torch

    now = start
    while True:
        failure = None
        try:
            return train_attempt(
                config, ctx, model_dir, now.strategy, device, tokenizer, train, evaluation, engine
            ), now
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            # Ranks out of memory: the peak that rank measured (this process measured nothing).
            measured = getattr(e, "measured", None)
        # Here, outside the except clause, the exception is gone, and with it the traceback whose frames
        # held the failed attempt's model, optimizer and activations; free them before the retry loads anew.
        release_memory(device)
        now = after_out_of_memory(config, ctx, model_config, n_layers, now, failure, device, measured)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()


def after_out_of_memory(
    config,
    ctx,
    model_config: dict,
    n_layers: int | None,
    now: Attempts,
    failure: str,
    device: str,
    measured: dict | None = None,
) -> Attempts:
    """The attempts after `now` ran out of memory: the next smaller plan, persisted so that a rerun starts from it,
    the old checkpoints set aside where it changes the base's precision."""
    measured = peak_memory(device) if measured is None else measured
    nxt = memory.replan_after_oom(now.plan, model_config, config, measured)
    failed = (
        *now.failed,
        {
            "strategy": now.strategy.to_json(),
            "error": failure,
            "measured": measured,
            "under_predicted": (nxt or {}).get("oom_component"),
        },
    )
    if nxt is None:
        raise LorashipError(
            f"out of GPU memory with every plan tried ({len(failed)}); under-predicted: "
            f"{failed[-1]['under_predicted'] or 'unknown'}; last error: {failure}. Lower sequence_len or "
            f"micro_batch_size, allow more in fallback (now {list(config.fallback)}), or use a larger GPU."
        ) from RuntimeError(failure)
    log.warning(
        "train: out of memory (%s under-predicted); retrying with %s", nxt.get("oom_component"), nxt["strategy"]
    )
    strategy = for_device(nxt["strategy"], config, device, n_layers)
    restarts = now.restarts
    # A strategy on the same precision of the base resumes the checkpoints (the same LoRA parameters, trained
    # against the same weights); one on another precision starts from step 0. Moved before the re-plan is
    # saved: killed in between, the rerun starts the old strategy again, never the new one on old checkpoints.
    if now.strategy.base_precision != strategy.base_precision:
        moved = set_checkpoints_aside(ctx.dir / CHECKPOINTS_DIR, now.strategy, strategy, len(failed))
        restarts = (*restarts, moved) if moved else restarts
    out = Attempts(nxt, strategy, nxt["reason"], failed, restarts)
    atomic_write_json(ctx.dir / CHECKPOINTS_DIR / REPLANNED_FILE, out.to_json())
    return out


def train_attempt(
    config,
    ctx,
    model_dir: Path,
    strategy: Strategy,
    device: str,
    tokenizer,
    train,
    evaluation,
    engine: distributed.Engine,
) -> dict:
    """train_once in this process, or on the engine's ranks, each running train_once on its share of every step."""
    if not engine.distributed:
        return train_once(config, ctx, model_dir, strategy, device, tokenizer, train, evaluation)
    return train_on_ranks(config, ctx, model_dir, strategy, device, engine)


def train_on_ranks(config, ctx, model_dir: Path, strategy: Strategy, device: str, engine: distributed.Engine) -> dict:
    """One attempt on engine.world_size ranks: this stage again under torchrun in this container (serve_rank_job);
    rank 0's result. Raises what a rank raised: its LorashipError, RanksOutOfMemory (which the re-plan takes for its
    own out-of-memory error), or RankFailed naming a rank that died and where a rerun resumes."""
    folder = ctx.dir / RANKS_DIR
    job = distributed.RankJob(
        config=config.model_dump(mode="json"),
        stage_dir=str(ctx.dir),
        model_dir=str(model_dir),
        strategy=strategy.to_json(),
        engine=engine.name,
        world_size=engine.world_size,
        device=device,
        result_file=str(folder / "result.json"),
    )
    folder.mkdir(parents=True, exist_ok=True)
    job.write(folder / "job.json")
    log.info("train: %s on %d ranks (%s), under torchrun", engine.name, engine.world_size, device)
    distributed.launch_ranks(
        f"loraship.stages.{STAGE}",
        [RANK_JOB_ARG, str(folder / "job.json")],
        engine.world_size,
        folder,
        resume_hint=lambda: resume_words(ctx.dir / CHECKPOINTS_DIR),
    )
    return json.loads(Path(job.result_file).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class RankStage:
    """The stage folder as a rank sees it: train_once reads and writes there only (checkpoints, adapter, history)."""

    dir: Path


def serve_rank_job(job_file: Path) -> int:
    """One rank (python -m loraship.stages.train --rank-job FILE, as torchrun starts it): the job's config, data and
    strategy, checked equal on every rank before training, then train_once on this rank's share; the exit code."""
    from loraship.config import parse_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    job = distributed.RankJob.read(job_file)
    configure_cuda_allocator()

    def work(rank: distributed.Rank) -> dict:
        config = parse_config(job.config)
        hf_offline_if_local(config)
        model_dir = Path(job.model_dir)
        tokenizer = load_tokenizer(model_dir, config)
        train, evaluation = load_splits(config, tokenizer)
        distributed.check_same_inputs(
            rank,
            {
                "config": config.fingerprint(),
                "strategy": sha256_json(job.strategy),
                "train data": sha256_json([e["input_ids"] for e in train.examples]),
                "eval data": sha256_json([e["input_ids"] for e in evaluation.examples]),
            },
        )
        strategy = Strategy.from_json(job.strategy)
        import_training_stack(strategy, job.device)
        ranks = distributed.Ranks(distributed.Engine(job.engine, job.world_size), rank)
        return train_once(
            config,
            RankStage(Path(job.stage_dir)),
            model_dir,
            strategy,
            job.device,
            tokenizer,
            train,
            evaluation,
            ranks,
        )

    return distributed.serve_rank(
        work,
        job.device,
        Path(job.result_file),
        is_out_of_memory=is_out_of_memory,
        measure=lambda: peak_memory(job.device),
    )


def training_engine(ctx, config, device: str) -> tuple[distributed.Engine, dict]:
    """The engine and number of ranks for the devices visible here, from the plan stage's multi-GPU record
    (preflight.check_training_gpus, whose errors name the fix before any weight loads); the option, for the
    manifest. On a CPU the ranks are LORASHIP_CPU_RANKS (1 when unset)."""
    from loraship.planning.preflight import check_training_gpus

    record = json.loads((ctx.upstream_dir("plan") / STRATEGY_FILE).read_text(encoding="utf-8")).get("distributed")
    option = check_training_gpus(config, record, distributed.visible_devices(device))
    return distributed.engine_of(option), option


def draw_figures(config, folder: Path, result: dict, predicted: dict, device: str, trained_as: str) -> list[str]:
    """The loss curves and the memory plan as PNGs in the stage folder (outputs of its manifest)."""
    history = [json.loads(line) for line in (folder / LOSS_HISTORY_FILE).read_text(encoding="utf-8").splitlines()]
    plots.loss_curves(
        history,
        folder / LOSS_PLOT_FILE,
        eval_before=result["eval_loss_before"],
        eval_after=result["eval_loss_after"],
        steps=result["steps"],
        title=f"{config.run_name}: loss ({trained_as})",
    )
    # The budget line only where a GPU measured something: on the CPU it would dwarf the predicted bar.
    plots.memory_plan(
        predicted,
        result["measured_memory"],
        folder / MEMORY_PLOT_FILE,
        device=device,
        budget_gib=config.gpu_memory_gib if device == "cuda" else None,
        title=f"{config.run_name}: training memory, plan vs measured ({trained_as})",
    )
    return [LOSS_PLOT_FILE, MEMORY_PLOT_FILE]


def layer_count(model_config: dict) -> int | None:
    """The decoder layers the planner reads in config.json; None for an architecture it cannot read."""
    try:
        return memory.parse_model_config(model_config).L
    except (ValueError, KeyError):
        return None


@exclusive
def run(config) -> dict:
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS, depends_on=DEPENDS_ON)
    if ctx.done:
        return ctx.done
    plots.require_matplotlib()
    # Keep checkpoints only when they belong to these exact inputs (resume after a crash).
    marker = ctx.dir / CHECKPOINTS_DIR / "fingerprint"
    keep = (CHECKPOINTS_DIR,) if marker.is_file() and marker.read_text() == ctx.fingerprint else ()
    reset_dir(ctx, keep=keep)
    atomic_write_text(marker, ctx.fingerprint)

    allocator = configure_cuda_allocator()
    hf_offline_if_local(config)
    model_dir = resolve_base_model(config, weights=True)
    check_base_model(config, model_dir)
    device = pick_device(config)
    tokenizer = load_tokenizer(model_dir, config)
    train, evaluation = load_splits(config, tokenizer)
    model_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    n_layers = layer_count(model_config)
    start = starting_plan(ctx, config, model_config, n_layers, device)
    engine, option = training_engine(ctx, config, device)
    import_training_stack(start.strategy, device)
    result, final = train_until_it_fits(
        config, ctx, model_dir, model_config, n_layers, start, device, tokenizer, train, evaluation, engine
    )
    metrics = {
        **result,
        "device": device,
        # The engine and ranks it trained on (one process: single on 1), and why the plan chose them.
        "distributed": {"engine": engine.name, "ranks": engine.world_size, "why": option.get("why")},
        **trained_with(config, model_dir, model_config, final, n_layers),
        "cuda_allocator": allocator if device == "cuda" else None,
        "oom_retries": list(final.failed),
        # Re-plans that changed the base's precision and so trained again from step 0 (set_checkpoints_aside).
        "restarted_from_step_0": list(final.restarts),
        **data_metrics(config, train, evaluation),
        "predicted_reserved_gib": final.plan["memory"].get("predicted_reserved_gib"),
        "predicted_allocated_gib": final.plan["memory"].get("predicted_allocated_gib"),
        "data_fingerprint": sha256_json([e["input_ids"] for e in train.examples]),
        "figures": draw_figures(
            config, ctx.dir, result, final.plan["memory"], device, f"{final.strategy.adapter} on {device}"
        ),
    }
    atomic_write_json(ctx.dir / "train_metrics.json", metrics)
    return ctx.finish(metrics, outputs=None)


def trained_with(config, model_dir: Path, model_config: dict, final: Attempts, n_layers: int | None) -> dict:
    """What trained, for the manifest: the strategy, in words, the Linears adapted, and why this plan."""
    return {
        "strategy": final.strategy.to_json(),
        "trained_as": final.strategy.describe(n_layers),
        # The Linears adapted, as the architecture names them (Phi-3: qkv_proj, gate_up_proj), and why when a fused
        # one adapts more projections than the config named.
        "lora_modules": lora_targets(model_dir, config),
        "lora_modules_note": lora_target_note(model_config, config),
        "strategy_reason": final.reason,
    }


def data_metrics(config, train, evaluation) -> dict:
    return {
        "train_examples": len(train.examples),
        "eval_examples": len(evaluation.examples),
        "train_tokens": train.tokens,
        "truncated_examples": train.truncated + evaluation.truncated,
        "dropped_examples": train.dropped + evaluation.dropped,
        "truncation_policy": config.truncation,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == [RANK_JOB_ARG]:
        sys.exit(serve_rank_job(Path(sys.argv[2])))
    main(run)
