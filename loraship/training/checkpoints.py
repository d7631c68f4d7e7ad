"""What a run leaves on disk to resume from, and what it hands on: the checkpoint (adapter, optimizer, scheduler, step,
RNG state, loss history) saved every save_steps and loaded on a rerun, checkpoints set aside when a re-plan changes the
base's precision, and the trained adapter with its loss history at the end."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

from loraship.constants import ADAPTER_DIR, LOSS_HISTORY_FILE
from loraship.training import distributed

if TYPE_CHECKING:
    from loraship.planning.strategy_record import Strategy

log = logging.getLogger("loraship.train")


def save_checkpoint(folder: Path, model, optimizer, scheduler, step: int, history: list[dict]) -> None:
    """The state a rerun resumes from, written by rank 0: the whole adapter (PEFT's files) and the optimizer's state
    keyed by parameter name, gathered from every rank (one format for any number of ranks). model: a
    distributed.Wrapped, or a bare PEFT model in one process."""
    import torch

    from loraship.runtime.manifest import atomic_path

    wrapped = distributed.as_wrapped(model)

    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        # LoRA dropout draws from the CUDA generator on the GPU: without its state a resumed run
        # drops other units than the uninterrupted one would have.
        rng["cuda"] = torch.cuda.get_rng_state_all()
    adapter, optimizer_state = distributed.trainable_state(wrapped), distributed.optimizer_state(wrapped, optimizer)
    if wrapped.main:
        with atomic_path(folder / "last") as tmp:
            tmp.mkdir()
            wrapped.model.save_pretrained(tmp, safe_serialization=True, state_dict=adapter)
            torch.save(
                {
                    "optimizer": optimizer_state,
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "rng": rng,
                    "history": history,
                    "world_size": wrapped.engine.world_size,
                },
                tmp / "trainer_state.pt",
            )
    distributed.barrier(wrapped.rank)


def load_checkpoint(folder: Path, model, optimizer, scheduler) -> tuple[int, list[dict]]:
    """The last checkpoint into the model (a distributed.Wrapped, or a bare PEFT model), optimizer and scheduler, on
    every rank; (step, loss history), (0, []) when there is none."""
    import torch

    from loraship.runtime.manifest import aside_of

    wrapped = distributed.as_wrapped(model)
    world_size = wrapped.engine.world_size

    last = folder / "last"
    if not (last / "trainer_state.pt").is_file():
        # Killed while a newer checkpoint took the place of this one: the older is whole, aside.
        last = aside_of(last)
        if last is None or not (last / "trainer_state.pt").is_file():
            return 0, []
    distributed.load_adapter_file(wrapped, last / "adapter_model.safetensors")
    # weights_only: even our own checkpoint is loaded without running arbitrary pickled code.
    state = torch.load(last / "trainer_state.pt", weights_only=True)
    distributed.load_optimizer_state(wrapped, optimizer, state["optimizer"])
    if state.get("world_size", 1) != world_size:
        log.warning(
            "train: the checkpoint was written by %d rank(s), this run has %d: a global step holds another "
            "number of examples, so the rest of this epoch draws them in another order than it would have",
            state.get("world_size", 1),
            world_size,
        )
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    cuda_rng = state["rng"].get("cuda")
    if cuda_rng is not None and torch.cuda.is_available():
        if len(cuda_rng) != torch.cuda.device_count():
            log.warning(
                "train: checkpoint holds CUDA RNG state for %d devices, %d visible; dropout may differ "
                "from an uninterrupted run",
                len(cuda_rng),
                torch.cuda.device_count(),
            )
        else:
            torch.cuda.set_rng_state_all(cuda_rng)
    log.info("train: resumed from checkpoint at step %d", state["step"])
    return state["step"], state["history"]


def resume_words(folder: Path) -> str:
    """What a rerun of these inputs does, read from the checkpoint on disk."""
    import torch

    from loraship.runtime.manifest import aside_of

    for last in (folder / "last", aside_of(folder / "last")):
        if last is not None and (last / "trainer_state.pt").is_file():
            step = torch.load(last / "trainer_state.pt", weights_only=True)["step"]
            return f"Started again, the run resumes from the last checkpoint (step {step})"
    return "Started again, the run starts at step 0: no checkpoint was written yet (save_steps sets how often)"


def set_checkpoints_aside(folder: Path, old: Strategy, new: Strategy, attempt: int) -> dict | None:
    """Move the checkpoints of `old` out of `new`'s way when the two train against different precisions of the
    base; what was moved, for the manifest (None when there was nothing to move).

    An adapter and its AdamW moments fitted against bf16 weights are not a state of training against their NF4
    rounding (nor the reverse): resuming would carry on from gradients of a model that is no longer there. So
    the new strategy starts from step 0. The old checkpoints are kept, under the checkpoints folder (which a
    rerun of the same inputs keeps), not deleted."""
    import torch

    found = (
        [p for p in sorted(folder.iterdir()) if p.name == "last" or p.name.startswith(".old-last.")]
        if folder.is_dir()
        else []
    )
    if not found:
        return None
    state = next((p / "trainer_state.pt" for p in found if (p / "trainer_state.pt").is_file()), None)
    step = torch.load(state, weights_only=True)["step"] if state else None
    aside = folder / f"set-aside-attempt-{attempt}-{old.base_precision}"
    aside.mkdir(parents=True, exist_ok=True)
    for p in found:
        # Not under an .old-last name: load_checkpoint takes those for a checkpoint killed mid-replacement.
        os.replace(p, aside / p.name.removeprefix("."))
    why = (
        f"the re-plan changed the base's precision from {old.base_precision} to {new.base_precision}: the "
        f"checkpointed adapter and optimizer state were trained against the {old.base_precision} weights, so "
        f"training started again from step 0"
    )
    log.warning("train: %s; the checkpoints of step %s are kept in %s", why, step, aside)
    return {
        "after_attempt": attempt,
        "from_precision": old.base_precision,
        "to_precision": new.base_precision,
        "set_aside_step": step,
        "set_aside_to": str(aside.relative_to(folder.parent)),
        "why": why,
    }


def save_adapter(folder: Path, wrapped: distributed.Wrapped, tokenizer, history: list[dict]) -> None:
    """The trained adapter and the loss history, in the stage folder: written by rank 0, from the weights every
    rank gathers."""
    from loraship.runtime.manifest import atomic_path, atomic_write_text

    state = distributed.trainable_state(wrapped)
    if wrapped.main:
        with atomic_path(folder / ADAPTER_DIR) as tmp:
            wrapped.model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
            # The tokenizer the adapter was trained with, chat template included (the config's, if set):
            # merge and convert carry it into the GGUF.
            tokenizer.save_pretrained(tmp)
        atomic_write_text(folder / LOSS_HISTORY_FILE, "".join(json.dumps(h) + "\n" for h in history))
    distributed.barrier(wrapped.rank)
