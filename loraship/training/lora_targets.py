"""Which Linears the LoRA adapter trains: lora_target_modules as the architecture names them, the modules the plan
leaves untrained, and PEFT's LoraConfig built from both. The train stage takes both from its plan record
(loraship/planning/plan_record.py); lora_targets and lora_excluded ask the planner, for a model loaded without one."""

from __future__ import annotations

import re
from pathlib import Path

from loraship.models import config_json
from loraship.errors import LorashipError


def lora_targets(model_dir: Path, config) -> list[str] | str:
    """lora_target_modules as this architecture names its Linears (targets.lora_modules: Phi-3's fused qkv_proj
    and gate_up_proj); as written for an architecture the planner cannot read."""
    from loraship.planning.shape import shape_from_config
    from loraship.planning.targets import lora_modules

    try:
        shape = shape_from_config(config_json(model_dir))
    except (OSError, ValueError, KeyError):
        return config.lora_target_modules
    try:
        return list(lora_modules(shape, config.lora_target_modules))
    except ValueError as e:  # the plan's preflight refuses it first; a train run on its own says it too
        raise LorashipError(str(e)) from e


def lora_excluded(model_dir: Path) -> str | None:
    """A regex (PEFT's exclude_modules) for the modules the plan leaves untrained: a multimodal model's vision tower
    and projector (Gemma 3), whose Linears share the language model's names (q_proj, ...)."""
    from loraship.planning.shape import shape_from_config

    try:
        shape = shape_from_config(config_json(model_dir))
    except (OSError, ValueError, KeyError):
        return None
    if not shape.untrained_modules:
        return None
    return "(?:" + "|".join(re.escape(m) for m in shape.untrained_modules) + r")(?:\..*)?"


def lora_config(model_dir: Path, config, parameters: tuple[str, ...] | list[str] = (), plan=None):
    """PEFT's LoraConfig: the Linears the plan resolved (lora_targets without a plan), and `parameters` (a MoE's
    stacked expert tensors, full names: PEFT matches an already parametrized, 4-bit tensor by its full name only)
    through target_parameters, whose ParamWrapper takes no dropout (the train stage puts the config's back on the
    Linears)."""
    from loraship.runtime.imports import import_peft

    if plan is not None:
        targets, excluded = list(plan.lora_modules), plan.lora_excluded
    else:
        targets, excluded = lora_targets(model_dir, config), lora_excluded(model_dir)

    extra = {"target_parameters": list(parameters)} if parameters else {}
    return import_peft().LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=0.0 if parameters else config.lora_dropout,
        target_modules=targets,
        exclude_modules=excluded,
        bias="none",
        task_type="CAUSAL_LM",
        **extra,
    )
