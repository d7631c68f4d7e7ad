"""The optimizer step loop: AdamW and the learning-rate schedule, then each optimizer step's micro-batches forward
and backward (this rank's share, gradients synced on the last), the step, its progress line, and a checkpoint every
save_steps. What carries from step to step is a StepLoop, which the train stage reads after the loop."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraship.training import checkpoints, distributed
from loraship.training.batches import Batches, micro_batch, target_tokens
from loraship.training.device import compute, gpu_memory_text
from loraship.training.throughput import steady_rate

if TYPE_CHECKING:
    from collections.abc import Callable

    from loraship.runtime.progress import Progress


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


@dataclass
class StepLoop:
    """What the step loop carries from one optimizer step to the next (and train_once reads after it)."""

    step: int
    history: list[dict]
    tokens_seen: int = 0
    started: float = 0.0
    stamps: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens so far) after each step
    after_step: Callable[[], None] | None = None  # called after each optimizer step (loraship/training/gc_pauses.py)


@dataclass(frozen=True)
class Optimization:
    """What steps the trainable parameters: AdamW over them, its learning-rate schedule, and the run's step count."""

    trainable: list
    optimizer: Any
    scheduler: Any
    total_steps: int


def make_optimizer(config, model, total_steps: int) -> Optimization:
    """AdamW (torch's, or bitsandbytes' 8-bit one) over the model's trainable (LoRA) parameters, on the config's
    schedule over `total_steps`."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(config, total_steps))
    return Optimization(trainable, optimizer, scheduler, total_steps)


def run_steps(
    config,
    folder: Path,
    wrapped: distributed.Wrapped,
    ranks: distributed.Ranks,
    batches: Batches,
    opt: Optimization,
    loop: StepLoop,
    per_token: float | None,
    device: str,
    progress: Progress,
) -> None:
    """The optimizer steps from loop.step to opt.total_steps: each accumulates its micro-batches, steps the optimizer,
    reports progress, and every save_steps checkpoints into `folder`."""
    import torch

    from loraship.planning import flops

    peak = flops.bf16_peak_tflops(torch.cuda.get_device_name(0)) if device == "cuda" and per_token else None
    steps: tuple[int, list] = (-1, [])
    while loop.step < opt.total_steps:
        epoch, within = divmod(loop.step, batches.per_epoch)
        if steps[0] != epoch:
            steps = (epoch, batches.epoch(epoch))
        step_loss = accumulate_step(wrapped, ranks, batches, steps[1][within], loop, device)
        optimizer_step(opt.trainable, opt.optimizer, opt.scheduler)
        loop.step += 1
        if loop.after_step is not None:
            loop.after_step()
        elapsed = time.perf_counter() - loop.started
        loop.stamps.append((elapsed, loop.tokens_seen))
        report_progress(progress, loop, opt.total_steps, step_loss, elapsed, per_token, peak, device)
        if loop.step % config.logging_steps == 0 or loop.step == opt.total_steps:
            lr = opt.scheduler.get_last_lr()[0]
            loop.history.append({"step": loop.step, "epoch": epoch, "loss": round(step_loss, 6), "lr": lr})
        if loop.step % config.save_steps == 0 and loop.step < opt.total_steps:
            checkpoints.save_checkpoint(folder, wrapped, opt.optimizer, opt.scheduler, loop.step, loop.history)


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
