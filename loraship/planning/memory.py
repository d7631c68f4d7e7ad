"""The planner's names in one place, for callers that hold a config.json dict (tasks/, cli, bench, tests).

New code imports from the modules themselves, which take a parsed `Shape` (shape.py): targets.py (LoRA targets),
knobs.py (the strategy record), estimate.py (memory of one strategy), step_time.py, strategy.py (the search, the
OOM re-plan), shipping.py (disk and inference). Here the functions that took a dict parse it once and call those.
"""

from __future__ import annotations

from loraship.config import Config
from loraship.planning import estimate as _estimate
from loraship.planning import shipping as _shipping
from loraship.planning import step_time as _step_time
from loraship.planning import strategy as _strategy
from loraship.planning.estimate import (  # noqa: F401
    CAL,
    GIB,
    KEPT_ANYWAY,
    LORA_BYTES_PER_PARAM,
    NF4_BYTES_PER_PARAM,
    SAFETY_MARGIN_FRACTION,
    SAFETY_MARGIN_MIN_GIB,
    fused_loss_transient,
    layer_saved_per_token,
    lora_saved_per_token,
    safety_margin_gib,
)
from loraship.planning.knobs import (  # noqa: F401
    ACTIVATIONS_IN_CPU,
    activations_setting,
    checkpoint_every_layer,
    checkpointed_layers,
    fused_loss_available,
    strategy_from_config,
    streamed_layers,
    with_checkpointing,
)
from loraship.planning.shape import Shape, UnsupportedModel, shape_from_config  # noqa: F401
from loraship.planning.step_time import PLAN_EXECUTED_TFLOPS, PLAN_HOST_TO_DEVICE_GBPS  # noqa: F401
from loraship.planning.strategy import PlanRefused  # noqa: F401
from loraship.planning.targets import (  # noqa: F401
    ALL_LINEAR,
    FUSED_NAME,
    QVO,
    lora_modules,
    lora_target_note,
    target_names,
)


def parse_model_config(mc: dict) -> Shape:
    """The Shape of the decoder-only causal LM a config.json (a dict) describes, read from transformers' own model
    class (loraship/planning/shape.py); a multimodal config's text_config is followed. Raises UnsupportedModel (a
    ValueError) naming the class and the fix for what is no decoder-only causal LM that transformers and the pinned
    llama.cpp converter both support."""
    return shape_from_config(mc)


def estimate(model_config: dict, cfg: Config, strategy: dict, program: str = "train-stage") -> dict:
    """estimate.estimate for a config.json dict."""
    return _estimate.estimate(parse_model_config(model_config), cfg, strategy, program)


def step_seconds(model_config: dict, cfg: Config, strategy: dict) -> dict:
    """step_time.step_seconds for a config.json dict."""
    return _step_time.step_seconds(parse_model_config(model_config), cfg, strategy)


def plan_training(model_config: dict, cfg: Config) -> dict:
    """strategy.plan_training for a config.json dict: raises PlanRefused when nothing fits."""
    return _strategy.plan_training(parse_model_config(model_config), cfg)


def replan_after_oom(plan: dict, model_config: dict, cfg: Config, measured: dict) -> dict | None:
    """strategy.replan_after_oom for a config.json dict."""
    return _strategy.replan_after_oom(plan, parse_model_config(model_config), cfg, measured)


def plan_disk_and_inference(model_config: dict, cfg: Config) -> dict:
    """shipping.plan_disk_and_inference for a config.json dict."""
    return _shipping.plan_disk_and_inference(parse_model_config(model_config), cfg)
