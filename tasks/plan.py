"""Plan: validate every input, predict GPU memory, disk and the shipped model's footprint.

Reads only the base model's config.json + tokenizer and the training config, so it runs on a
laptop for a 14B model that is not downloaded. Convertibility to GGUF is checked here, before
any GPU hour is spent (unknown architecture, unrecognised BPE pre-tokenizer).
"""

from __future__ import annotations

import logging

from loraship.planning.multi_gpu import plan_on_gpus
from loraship.planning.plan_record import Plan
from loraship.planning.shape import Shape, shape_from_config
from loraship.planning.shipping import plan_disk_and_inference
from loraship.constants import PLAN_FILE, STRATEGY_FILE
from loraship.data import dataset_identity
from loraship.errors import ConfigError
from loraship.runtime.manifest import atomic_write_json
from loraship.models import read_model_config
from loraship.planning.preflight import check_inputs
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir

log = logging.getLogger("loraship.plan")
STAGE = "plan"
UPSTREAM: tuple[str, ...] = ()
FIELDS = (
    "base_model",
    "base_model_revision",
    "trust_remote_code",
    "allow_pickle",
    "adapter",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "sequence_len",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "optimize",
    "gradient_checkpointing",
    "fused_loss",
    "gpu_memory_gib",
    "target_gpu_memory_gib",
    "target_context",
    "n_cpu_moe",
    "quantization",
    "datasets",
    "eval_datasets",
    "device",
    "fallback",
    "offload_activations",
    "train_on_inputs",
    "gpus",
)


def input_files(config, model_dir) -> dict:
    """Identity of the data and base model the plan was made for; it keys every later stage.

    Datasets are hashed in full. Model weights are identified by name, size and mtime: hashing
    28 GB of weights on every resume costs minutes and a changed checkpoint changes those too.
    """
    files = {f"dataset:{s.path}": dataset_identity(s) for s in [*config.datasets, *config.eval_datasets]}
    for p in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
        if p.is_file():
            st = p.stat()
            files[f"base_model:{p.name}"] = f"{st.st_size}:{st.st_mtime_ns}"
    return files


def quantization_warnings(config, shape: Shape, model_dir) -> list[str]:
    """Named quantizations whose K-quant rows fall back, or that would put a base model dequantized from a GGUF back
    on its grid (loraship/planning/shipping.py)."""
    from loraship.planning.base_grid import first_layer_on_grid
    from loraship.planning.shipping import quantization_warnings as warnings

    if config.auto_quantization:
        return []
    return warnings(shape, config, first_layer_on_grid(model_dir))


@exclusive
def run(config) -> dict:
    model_dir = check_inputs(config)
    inputs = input_files(config, model_dir)
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS, extra_inputs=inputs)
    if ctx.done:
        return ctx.done
    reset_dir(ctx)

    model_config = read_model_config(model_dir)  # parsed once: the planners and the record read this Shape
    try:
        shape = shape_from_config(model_config)
        training = plan_on_gpus(shape, config)
        footprint = plan_disk_and_inference(shape, config)
    except (ValueError, KeyError) as e:  # a config.json the planner cannot read
        raise ConfigError(f"base model {config.base_model!r}", [f"config.json: {e}"]) from e
    counted = training["memory"].get("activations_counted", "")
    hand_margin = training["memory"]["components_gib"].get("hand_model_margin")
    if hand_margin:
        log.warning("plan: activations counted by the %s; %.2f GiB of margin added for it", counted, hand_margin)
    else:
        log.info("plan: activations %s", counted)
    quantization = quantization_warnings(config, shape, model_dir)
    for warning in quantization:
        log.warning("plan: %s", warning)
    plan = Plan.build(
        training,
        shape,
        config,
        base_model=config.base_model,
        model_dir=str(model_dir),
        architecture=(model_config.get("architectures") or ["?"])[0],
        **footprint,
        gguf_convertible=True,
        quantization_warnings=quantization,
        # In plan.json so that every later stage's fingerprint changes with the data or the base.
        inputs=inputs,
    )
    # Sorted keys: the record is read back by name, and its bytes (hashed into later stages' fingerprints) then
    # depend on what it says only. strategy.json: the plan less its shipping estimates, all that training reads.
    atomic_write_json(ctx.dir / PLAN_FILE, plan.to_json(), sort_keys=True)
    atomic_write_json(ctx.dir / STRATEGY_FILE, plan.training_json(), sort_keys=True)
    return ctx.finish(
        {
            "strategy": plan.strategy.to_json(),
            "fits": plan.fits,
            "predicted_total_gib": plan.memory.predicted_total_gib,
        }
    )


if __name__ == "__main__":
    main(run)
