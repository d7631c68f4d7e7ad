"""Out of GPU memory: recognising the error whatever its type, and the re-plan loop around the train stage's
attempts. After each out-of-memory error the failed attempt is released, the plan's own ladder gives the next
smaller plan (loraship/planning/strategy.py replan_after_oom), persisted in the checkpoints folder so a rerun starts
from it, and the next attempt trains it; the checkpoints are set aside where the new plan trains another precision of
the base."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from loraship.constants import CHECKPOINTS_DIR, PLAN_FILE, STRATEGY_FILE
from loraship.errors import LorashipError
from loraship.training.checkpoints import set_checkpoints_aside
from loraship.training.device import peak_memory, release_memory

if TYPE_CHECKING:
    from loraship.planning.strategy_record import Strategy

REPLANNED_FILE = "replanned.json"  # in the checkpoints folder: kept, like the checkpoints, for a rerun
log = logging.getLogger("loraship.train")


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
    from loraship.planning.knobs import fused_loss_available
    from loraship.planning.strategy_record import Strategy

    out = Strategy.from_json(strategy, n_layers).replace(fused_loss=fused_loss_available(config, device))
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


def layer_count(model_config: dict) -> int | None:
    """The decoder layers the planner reads in config.json; None for an architecture it cannot read."""
    from loraship.planning.shape import shape_from_config

    try:
        return shape_from_config(model_config).L
    except (ValueError, KeyError):
        return None


def starting_plan(ctx, config, model_config: dict, n_layers: int | None, device: str) -> Attempts:
    """The plan the first attempt trains: the plan stage's, re-planned where this machine lacks the fused loss it
    assumed, or the one an earlier run of these exact inputs re-planned to after running out of memory."""
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy import plan_training

    plan = json.loads((ctx.upstream_dir("plan") / STRATEGY_FILE).read_text(encoding="utf-8"))
    plan_file = ctx.upstream_dir("plan") / PLAN_FILE
    reason = json.loads(plan_file.read_text(encoding="utf-8")).get("reason") if plan_file.is_file() else None
    start = Attempts(plan, for_device(plan["strategy"], config, device, n_layers), reason)
    if device == "cuda" and plan["strategy"]["fused_loss"] and not start.strategy.fused_loss:
        # The plan was made where liger-kernel is importable and this machine lacks it: the HF loss
        # needs more memory than planned, so plan again here, with the same ladder and fallback.
        plan = plan_training(shape_from_config(model_config), config)
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
    model_config: dict,
    n_layers: int | None,
    start: Attempts,
    device: str,
    attempt: Callable[[Strategy], dict],
) -> tuple[dict, Attempts]:
    """attempt(strategy) (the train stage's train_attempt: one attempt at training it to the end), and after each
    out-of-memory error the next smaller plan (replan_after_oom) until one trains to the end; the result and how the
    attempts went. Raises naming the fix when no smaller plan is left."""
    import torch

    now = start
    while True:
        failure = None
        try:
            return attempt(now.strategy), now
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
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy import replan_after_oom
    from loraship.runtime.manifest import atomic_write_json

    measured = peak_memory(device) if measured is None else measured
    nxt = replan_after_oom(now.plan, shape_from_config(model_config), config, measured)
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
