"""The knobs a training plan turns, as the config sets them: the fused loss where liger-kernel has one, which layers
optimize/gradient_checkpointing checkpoint, where checkpointed activations live. The strategy record built from them
is strategy_record.Strategy (Strategy.from_config).
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
    from pathlib import Path

    if cfg.base_model_is_local():
        path = Path(cfg.base_model).expanduser() / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(cfg.base_model, "config.json", revision=cfg.base_model_revision)
        if not isinstance(found, str):
            return None
        path = Path(found)
    from loraship.models import cached_json

    try:
        data = cached_json(path)
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
