"""Out of GPU memory: recognising the error whatever its type, and the re-plan loop around the train stage's
attempts. After each out-of-memory error the failed attempt is released, the plan's own ladder gives the next
smaller plan (loraship/planning/strategy.py replan_after_oom), persisted in the checkpoints folder so a rerun starts
from it, and the next attempt trains it; the checkpoints are set aside where the new plan trains another precision of
the base."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from loraship.constants import CHECKPOINTS_DIR, PLAN_FILE, STRATEGY_FILE
from loraship.errors import LorashipError
from loraship.training.checkpoints import set_checkpoints_aside
from loraship.training.device import peak_memory, release_memory

if TYPE_CHECKING:
    from loraship.planning.plan_record import Plan
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


def ask_planner(config, model_config: dict, plan: Plan | None = None, measured: dict | None = None) -> Plan | None:
    """The one place the train stage asks the planner again: a plan made here (plan=None: plan_training, where this
    machine lacks the fused loss the plan stage assumed), or the next smaller one after `plan` ran out of memory
    with `measured` (replan_after_oom; None when none is left). Either way a Plan record, its decisions made."""
    from loraship.planning.plan_record import Plan
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy import plan_training, replan_after_oom

    shape = shape_from_config(model_config)
    if plan is None:
        planned = plan_training(shape, config)
    else:
        planned = replan_after_oom(plan.to_json(), shape, config, measured)
    return None if planned is None else Plan.build(planned, shape, config, **_kept(plan))


def _kept(plan: Plan | None) -> dict:
    """What a re-plan keeps of the plan it replaces: where the model is and the inputs it was made for."""
    return {k: plan.other[k] for k in ("model_dir", "inputs") if plan is not None and k in plan.other}


def read_plan(d: dict, config, model_config: dict) -> Plan:
    """A plan file's object as a record; one from before the decisions were recorded is upgraded here, once."""
    from loraship.planning.plan_record import DECISIONS, Plan
    from loraship.planning.shape import shape_from_config

    return Plan.from_json(d) if DECISIONS in d else Plan.from_json(d, shape_from_config(model_config), config)


def for_device(plan: Plan, config, device: str) -> Plan:
    """The plan as this machine can run it: the fused loss where liger-kernel is importable on CUDA (for the model
    type the plan read), no streamed weights without a GPU."""
    from loraship.planning.knobs import fused_loss_available

    return plan.on_device(device, fused_loss_available(config, device, model_type=plan.model.model_type))


@dataclass(frozen=True)
class Attempts:
    """Where the out-of-memory retries stand: the plan tried next, as this machine runs it; the attempts that ran out
    of memory, and the re-plans that trained again from step 0."""

    plan: Plan
    failed: tuple[dict, ...] = ()
    restarts: tuple[dict, ...] = ()

    @property
    def strategy(self) -> Strategy:
        return self.plan.strategy

    @property
    def reason(self) -> str:
        return self.plan.reason

    def to_json(self) -> dict:
        return {"plan": self.plan.to_json(), "attempts": list(self.failed), "restarts": list(self.restarts)}


def starting_plan(ctx, config, model_config: dict, device: str) -> tuple[Attempts, Plan]:
    """The plan the first attempt trains: the plan stage's (read once, here), re-planned where this machine lacks the
    fused loss it assumed, or the one an earlier run of these exact inputs re-planned to after running out of
    memory; and the plan stage's own record (its multi-GPU choice is the train stage's)."""
    from loraship.planning.plan_record import DECISIONS

    folder = ctx.upstream_dir("plan")
    d = json.loads((folder / STRATEGY_FILE).read_text(encoding="utf-8"))
    if DECISIONS not in d and (folder / PLAN_FILE).is_file():
        # An older plan stage wrote the reason, the model and the ladder to plan.json only: upgraded from both.
        d = {**json.loads((folder / PLAN_FILE).read_text(encoding="utf-8")), **d}
    staged = read_plan(d, config, model_config)
    start = Attempts(for_device(staged, config, device))
    if device == "cuda" and staged.fused_loss and not start.plan.fused_loss:
        # The plan was made where liger-kernel is importable and this machine lacks it: the HF loss
        # needs more memory than planned, so plan again here, with the same ladder and fallback.
        again = ask_planner(config, model_config)
        again = dataclasses.replace(
            again,
            reason=f"re-planned in the train environment, where liger-kernel is not importable: {again.reason}",
            other={**again.other, **_kept(staged)},
        )
        start = Attempts(for_device(again, config, device))
    replanned = ctx.dir / CHECKPOINTS_DIR / REPLANNED_FILE
    if replanned.is_file():
        # An earlier run of these exact inputs ran out of memory and re-planned: start where it ended.
        saved = json.loads(replanned.read_text(encoding="utf-8"))
        start = Attempts(
            for_device(read_plan(saved["plan"], config, model_config), config, device),
            tuple(saved["attempts"]),
            tuple(saved.get("restarts", [])),
        )
        log.info(
            "train: starting from the strategy re-planned after %d out-of-memory error(s): %s",
            len(start.failed),
            start.strategy.to_json(),
        )
    return start, staged


def train_until_it_fits(
    config,
    ctx,
    model_config: dict,
    start: Attempts,
    device: str,
    attempt: Callable[[Plan], dict],
) -> tuple[dict, Attempts]:
    """attempt(plan) (the train stage's train_attempt: one attempt at training it to the end), and after each
    out-of-memory error the next smaller plan (replan_after_oom) until one trains to the end; the result and how the
    attempts went. Raises naming the fix when no smaller plan is left."""
    import torch

    now = start
    while True:
        failure = None
        try:
            return attempt(now.plan), now
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            # Ranks out of memory: the peak that rank measured (this process measured nothing).
            measured = getattr(e, "measured", None)
        # Here, outside the except clause, the exception is gone, and with it the traceback whose frames
        # held the failed attempt's model, optimizer and activations; free them before the retry loads anew.
        release_memory(device)
        now = after_out_of_memory(config, ctx, model_config, now, failure, device, measured)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()


def after_out_of_memory(
    config,
    ctx,
    model_config: dict,
    now: Attempts,
    failure: str,
    device: str,
    measured: dict | None = None,
) -> Attempts:
    """The attempts after `now` ran out of memory: the next smaller plan, persisted so that a rerun starts from it,
    the old checkpoints set aside where it changes the base's precision."""
    from loraship.runtime.manifest import atomic_write_json

    measured = peak_memory(device) if measured is None else measured
    nxt = ask_planner(config, model_config, now.plan, measured)
    failed = (
        *now.failed,
        {
            "strategy": now.strategy.to_json(),
            "error": failure,
            "measured": measured,
            "under_predicted": nxt.oom_component if nxt else None,
        },
    )
    if nxt is None:
        raise LorashipError(
            f"out of GPU memory with every plan tried ({len(failed)}); under-predicted: "
            f"{failed[-1]['under_predicted'] or 'unknown'}; last error: {failure}. Lower sequence_len or "
            f"micro_batch_size, allow more in fallback (now {list(config.fallback)}), or use a larger GPU."
        ) from RuntimeError(failure)
    log.warning(
        "train: out of memory (%s under-predicted); retrying with %s", nxt.oom_component, nxt.strategy.to_json()
    )
    nxt = for_device(nxt, config, device)
    strategy = nxt.strategy
    restarts = now.restarts
    # A strategy on the same precision of the base resumes the checkpoints (the same LoRA parameters, trained
    # against the same weights); one on another precision starts from step 0. Moved before the re-plan is
    # saved: killed in between, the rerun starts the old strategy again, never the new one on old checkpoints.
    if now.strategy.base_precision != strategy.base_precision:
        moved = set_checkpoints_aside(ctx.dir / CHECKPOINTS_DIR, now.strategy, strategy, len(failed))
        restarts = (*restarts, moved) if moved else restarts
    out = Attempts(nxt, failed, restarts)
    atomic_write_json(ctx.dir / CHECKPOINTS_DIR / REPLANNED_FILE, out.to_json())
    return out
