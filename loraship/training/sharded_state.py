"""Training state across ranks: the trainable (LoRA) weights and the optimizer's state gathered whole to rank 0 by
torch.distributed.checkpoint.state_dict, and loaded back by every rank (each keeps its shard). One format whatever
the engine and the number of ranks, so a checkpoint resumes on another number of devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraship.errors import LorashipError

# loraship.training.distributed's Wrapped (the model as the engine wrapped it, and its engine), named here without
# importing it: distributed re-exports this module's functions, and the two must not import each other.
Wrapped = Any


def state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def trainable_state(wrapped: Wrapped) -> dict:
    """The trainable (LoRA) weights, whole, on rank 0's CPU, keyed like the PEFT model's state_dict; {} on the
    other ranks. Every rank must call it (FSDP2 gathers the shards). One format whatever the engine and the number
    of ranks, so a checkpoint resumes on another number of devices."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(
        wrapped.model, options=state_options(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(wrapped: Wrapped, state: dict) -> None:
    """trainable_state's dict back into the model, on every rank (each keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    missing = _trainable(wrapped.model) - set(state)
    if missing:
        raise LorashipError(
            f"the checkpoint lacks {len(missing)} trainable weight(s), e.g. {sorted(missing)[0]}; "
            "fix: delete the train stage's checkpoints folder to start from step 0"
        )
    set_model_state_dict(wrapped.model, state, options=state_options(full_state_dict=True, strict=False))


def optimizer_state(wrapped: Wrapped, optimizer) -> dict:
    """The optimizer's state, whole and keyed by parameter name, on rank 0 ({} elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(
        wrapped.model, optimizer, options=state_options(full_state_dict=True, cpu_offload=True)
    )


def load_optimizer_state(wrapped: Wrapped, optimizer, state: dict) -> None:
    """optimizer_state's dict back, on every rank. A state keyed by parameter number (optimizer.state_dict(), as
    one process saved it before) loads as it was saved, in one process only."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    numbered = all(isinstance(i, int) for g in state.get("param_groups", []) for i in g["params"])
    if numbered and state.get("param_groups"):
        if wrapped.engine.distributed:
            raise LorashipError(
                "the checkpoint's optimizer state is from an older loraship that numbered the "
                "parameters, which several ranks cannot load; fix: resume it on one device, or delete "
                "the train stage's checkpoints folder to start from step 0"
            )
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(wrapped.model, optimizer, state, options=state_options(full_state_dict=True))


def adapter_names(wrapped: Wrapped) -> dict[str, str]:
    """Each trainable weight's name in an adapter file PEFT saved (adapter_model.safetensors: no adapter name) ->
    its name in the model (trainable_state's keys), by PEFT's own renaming, so that a saved adapter loads through
    load_trainable_state whatever the engine."""
    import torch
    from peft import get_peft_model_state_dict

    names = sorted(_trainable(wrapped.model))
    # Each name's saved form, by PEFT's own renaming: a tensor per name, told apart by its value.
    saved = get_peft_model_state_dict(
        wrapped.model, state_dict={n: torch.tensor([float(i)]) for i, n in enumerate(names)}
    )
    return {k: names[int(v.item())] for k, v in saved.items()}


def load_adapter_file(wrapped: Wrapped, path: Path) -> None:
    """An adapter_model.safetensors (a checkpoint's) into the model on every rank."""
    from safetensors.torch import load_file

    names = adapter_names(wrapped)
    saved = load_file(path)
    unknown = sorted(set(saved) - set(names))
    if unknown:
        raise LorashipError(
            f"{path}: {len(unknown)} weight(s) this model has no trainable place for, e.g. "
            f"{unknown[0]}; fix: delete the train stage's checkpoints folder to start from step 0"
        )
    load_trainable_state(wrapped, {names[k]: v for k, v in saved.items()})


def save_adapter_dir(wrapped: Wrapped, folder: Path, main: bool, **kwargs) -> None:
    """PEFT's save_pretrained of the whole trainable state into folder, by rank 0 alone; every rank must call it
    (FSDP2 gathers the shards first)."""
    state = trainable_state(wrapped)
    if main:
        wrapped.model.save_pretrained(folder, safe_serialization=True, state_dict=state, **kwargs)
