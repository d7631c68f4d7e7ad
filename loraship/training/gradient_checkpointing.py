"""Gradient checkpointing of the first k decoder layers: which modules are the decoder layers, how checkpointing is
switched on in this transformers, and (where the strategy says so) the checkpointed layers' inputs kept in CPU
memory (loraship/training/activation_offload.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraship.planning.strategy_record import Strategy

log = logging.getLogger("loraship.train")


def decoder_layers(model) -> list:
    """The decoder layers in order: transformers' GradientCheckpointingLayer instances (one per layer of
    Llama, Qwen2, Mistral, Gemma 2 and Phi-3), whose own `gradient_checkpointing` flag decides whether it
    recomputes."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_first_layers(model, k: int | None) -> None:
    """After enable_checkpointing() (which flags every layer): keep the flag on the first k only.

    Why the first: their activations would live longest (from the start of the forward to the end of the
    backward), and backward reaches them last, after the later, un-checkpointed layers freed theirs, so a
    recompute never adds to those. loraship/planning/estimate.py's estimate assumes exactly this order. k None
    (a plan from before `checkpointed_layers`) means every layer, as before.
    """
    layers = decoder_layers(model)
    if not layers:
        if k is not None and k < (getattr(model.config, "num_hidden_layers", None) or 0):
            log.warning(
                "train: this architecture has no per-layer checkpointing flags; every layer is checkpointed, "
                "not the first %d",
                k,
            )
        return
    if k is None or k >= len(layers):
        return
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < k


def enable_checkpointing(model) -> None:
    """Non-reentrant checkpointing flagged on every decoder layer, by the name this transformers gives it
    (5.24 renamed gradient_checkpointing_enable to activation_checkpointing_enable and deprecated the old one)."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def apply_checkpointing(model, strategy: Strategy, layers: list, k: int):
    """Checkpoint the first k decoder layers, their inputs in CPU memory where the strategy says so: the
    activation offload's hooks then, else None."""
    if not strategy.gradient_checkpointing:
        return None
    # Not prepare_model_for_kbit_training: it upcasts embeddings/norms/lm_head to fp32,
    # which costs more memory than it saves. We take only what it does for
    # checkpointing: inputs that require grad so the frozen embedding output carries a graph.
    enable_checkpointing(model)
    model.enable_input_require_grads()
    checkpoint_first_layers(model, strategy.checkpointed_layers)
    if not strategy.offload_activations:
        return None
    from loraship.training.activation_offload import offload_checkpointed_activations

    offloaded = offload_checkpointed_activations(layers, k)
    log.info("train: the inputs of %d checkpointed layers kept in pinned CPU memory", k)
    return offloaded
