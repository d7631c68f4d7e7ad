"""The strategy record: the knobs a training plan turns, as the config sets them and as a plan is read back.

A strategy is a dict (adapter, offload_layers, micro_batch_size, gradient_accumulation_steps, fused_loss,
gradient_checkpointing, checkpointed_layers, offload_activations, offload_spread); these helpers build it from the
config, keep its checkpointing keys consistent and say which layers it checkpoints and streams.
"""

from __future__ import annotations

import importlib.util

from loraship.config import Config
from loraship.errors import ConfigError

# How plans, manifests and model cards name offload_activations (bench/train_bench.py reads it back from them).
ACTIVATIONS_IN_CPU = "checkpointed activations in CPU memory"


# Model types liger-kernel maps but whose fused loss it refuses: Granite scales its logits (logits_scaling), which
# LigerFusedLinearCrossEntropy has no term for (liger_kernel transformers/monkey_patch.py raises NotImplementedError).
# Plan leaves the fused loss off for them; train refuses a plan that has it on (tasks/train.py).
LIGER_NO_FUSED_LOSS = frozenset({"granite"})


def base_model_type(cfg: Config) -> str | None:
    """config.json's model_type of the base model where its config.json is on this machine (a local folder, or the
    hub copy plan fetched); None where it is not, or cannot be read (plan reports that with its own message)."""
    import json
    from pathlib import Path

    if cfg.base_model_is_local():
        path = Path(cfg.base_model).expanduser() / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(cfg.base_model, "config.json", revision=cfg.base_model_revision)
        if not isinstance(found, str):
            return None
        path = Path(found)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    return model_type if isinstance(model_type, str) else None


def fused_loss_available(cfg: Config, device: str = "cuda", model_type: str | None = None) -> bool:
    """Whether training uses Liger's fused linear cross-entropy; plan and train both ask this.

    'auto' means: liger-kernel is importable, the device is CUDA (its kernels are Triton) and liger-kernel has a fused
    loss for the model type (`model_type`, else the base model's config.json; not for LIGER_NO_FUSED_LOSS). The plan
    describes GPU training, so it asks for "cuda" unless `device: cpu`. find_spec looks the package up without
    importing it (and torch with it), so `loraship plan` stays light. 'on' for such a model type is refused.
    """
    if cfg.fused_loss == "off" or device != "cuda":
        return False
    model_type = model_type or base_model_type(cfg)
    if model_type in LIGER_NO_FUSED_LOSS:
        if cfg.fused_loss == "on":
            raise ConfigError(
                "config",
                [
                    f"fused_loss: on, but liger-kernel has no fused loss for model_type "
                    f"{model_type!r} (it scales its logits, which the fused loss has no term for); "
                    "fix: set fused_loss: auto or off"
                ],
            )
        return False
    if cfg.fused_loss == "on":
        return True
    return importlib.util.find_spec("liger_kernel") is not None


def checkpoint_every_layer(cfg: Config) -> bool:
    """Whether every decoder layer is checkpointed: `gradient_checkpointing` where set; else yes under
    `optimize: memory` or `offload_activations: on` (which asks for every checkpointed input in CPU memory, the
    least memory). Otherwise (optimize: speed) the plan checkpoints only as many of the first layers as fit."""
    if cfg.gradient_checkpointing is not None:
        return cfg.gradient_checkpointing
    return cfg.optimize == "memory" or cfg.offload_activations == "on"


def activations_setting(cfg: Config) -> str:
    """offload_activations as the plan applies it: 'auto' under optimize: memory is 'on' (the least GPU memory)."""
    if cfg.offload_activations == "auto" and cfg.optimize == "memory" and checkpoint_every_layer(cfg):
        return "on"
    return cfg.offload_activations


def strategy_from_config(cfg: Config, n_layers: int | None = None) -> dict:
    """The configuration as written. `checkpointed_layers` needs the layer count: without it the key is
    left out and checkpointed_layers() reads `gradient_checkpointing` as all layers or none."""
    out = {
        "adapter": cfg.adapter,
        "offload_layers": 0,
        "micro_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "fused_loss": fused_loss_available(cfg, "cpu" if cfg.device == "cpu" else "cuda"),
        "gradient_checkpointing": checkpoint_every_layer(cfg),
        "offload_activations": activations_setting(cfg) == "on" and checkpoint_every_layer(cfg),
    }
    if n_layers is not None:
        out["checkpointed_layers"] = n_layers if checkpoint_every_layer(cfg) else 0
    return out


def checkpointed_layers(strategy: dict, n_layers: int) -> int:
    """How many decoder layers (the first ones) recompute their activations in backward.

    `gradient_checkpointing` stays in the strategy as "any layer checkpointed"; a strategy without
    `checkpointed_layers` (plans written before it existed) means all layers or none.
    """
    k = strategy.get("checkpointed_layers")
    if k is None:
        return n_layers if strategy["gradient_checkpointing"] else 0
    return max(0, min(int(k), n_layers))


def with_checkpointing(strategy: dict, k: int) -> dict:
    """`strategy` with the first k decoder layers checkpointed (both keys kept consistent)."""
    return {**strategy, "gradient_checkpointing": k > 0, "checkpointed_layers": k}


def streamed_layers(strategy: dict, n_layers: int) -> list[int]:
    """Which decoder layers stream their frozen weights from CPU memory (loraship/training/offload.py), ascending.

    The first n; or, where the plan spreads them (`offload_spread`), n spaced evenly over the first k checkpointed
    layers, so each prefetch has the forward of the layers between two streamed ones to hide behind, not one layer's.
    Either way every streamed layer is checkpointed (autograd would otherwise keep its copy until backward).
    """
    n = min(strategy.get("offload_layers", 0), n_layers)
    k = checkpointed_layers(strategy, n_layers)
    if n <= 0:
        return []
    if not strategy.get("offload_spread") or k <= n:
        return list(range(n))
    return [j * k // n for j in range(n)]  # distinct, first 0, last below k - 1: the layer after it is recomputed
