"""The `train-and-ship` flow: plan -> train -> merge -> reference -> convert -> quantize -> verify -> publish.

Each stage is one Prefect task around `loraship.stages.<stage>.run(config)` (tasks/<stage>.py). Resume is the stages'
own: a stage whose manifest shows the same inputs and intact outputs returns at once (logged as
skipped). Prefect's own result caching stays off because it keys on argument values, not on the
content of the files behind paths.

With LORASHIP_STAGE_DEPLOYMENTS=<suffix> set (deploy/prefect.yaml sets it), each stage runs as
its own deployment `loraship-stage/<stage>-<suffix>` (its own image / pod), and the parent
fails with the child's error when the child fails (run_deployment alone would not).
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed

from loraship.config import Config
from loraship.constants import STAGES
from loraship.errors import LorashipError
from loraship.runtime.failures import FAILURE, failure_of, keep_traceback
from loraship.stage_table import gpu_stages, stage_module

STAGE_DEPLOYMENTS_ENV = "LORASHIP_STAGE_DEPLOYMENTS"
# Stages that hold an accelerator (loraship/stage_table.py): train and reference on the training
# GPU (reference runs the merged HF model there, so verify needs only the GGUF), verify on the
# inference GPU. Each takes a GPU slot first (loraship/runtime/gpu_slot.py: LORASHIP_GPU_SLOTS of them,
# default 1), so two of them never share one card; a slot whose holder died is taken over.
GPU_STAGES = gpu_stages()


def gpu_slot(stage: str, config: Config):
    if stage not in GPU_STAGES:
        return contextlib.nullcontext()
    from loraship.runtime.gpu_slot import gpu_slot as slot

    return slot(config.run_name, stage, config.workdir)


def _artifact_key(run_name: str, stage: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_name}-{stage}".lower()).strip("-")


def _summary_markdown(stage: str, manifest: dict) -> str:
    rows = []
    for key, value in manifest.get("metrics", {}).items():
        if isinstance(value, (dict, list)):
            value = f"`{value}`" if len(str(value)) < 300 else "(see manifest)"
        rows.append(f"| {key} | {value} |")
    status = "skipped (up to date)" if manifest.get("_skipped") else "ran"
    outputs = "\n".join(
        f"- `{rel}` sha256 `{info['sha256'][:16]}…` ({info['size']} bytes)"
        for rel, info in list(manifest.get("outputs", {}).items())[:20]
    )
    return (
        f"### {stage}: {status}\n\nFolder: `{manifest.get('_dir')}`\n\n| figure | value |\n|---|---|\n"
        + "\n".join(rows)
        + f"\n\n**Outputs**\n{outputs}\n"
    )


# A PNG up to this size goes into its artifact as a data: URI (the train stage's are ~50 KB); a larger
# one is linked by its path, so an artifact never carries megabytes into the Prefect database.
INLINE_IMAGE_BYTES = 1 << 20


def _figures_markdown(stage: str, manifest: dict) -> str | None:
    """The stage's PNG outputs (the train stage's loss curves and memory plan), embedded."""
    folder = Path(manifest["_dir"])
    pictures = [rel for rel in manifest.get("outputs", {}) if rel.endswith(".png") and (folder / rel).is_file()]
    if not pictures:
        return None
    parts = [f"### {stage}: figures"]
    for rel in pictures:
        path = folder / rel
        data = path.read_bytes()
        source = (
            f"data:image/png;base64,{base64.b64encode(data).decode('ascii')}"
            if len(data) <= INLINE_IMAGE_BYTES
            else path.as_uri()
        )
        parts.append(f"**{rel}** (`{path}`)\n\n![{rel}]({source})")
    return "\n\n".join(parts) + "\n"


@task(name="stage", task_run_name="{stage}", cache_policy=NO_CACHE)
def stage_task(stage: str, config: Config):
    logger = get_run_logger()
    try:
        with gpu_slot(stage, config):
            manifest = stage_module(stage).run(config)
    except LorashipError as e:
        # A problem the user can fix: said plainly, without a traceback. The failed state carries the error, so
        # that `loraship run` prints it once with its exit code (loraship/runtime/failures.py).
        logger.error("%s failed: %s", stage, e, extra=FAILURE)
        return Failed(message=f"{stage}: {e}", data=e)
    except Exception as e:  # noqa: BLE001 - a crash: its traceback goes to a file and the flow run's log
        trace = keep_traceback(config, stage)
        logger.error("%s failed (traceback in %s)", stage, trace, exc_info=True, extra=FAILURE)
        return Failed(message=f"{stage}: {type(e).__name__}: {e} (traceback in {trace})", data=e)
    if manifest.get("_skipped"):
        logger.info("%s: skipped, outputs complete for the same inputs (%s)", stage, manifest["_dir"])
    else:
        logger.info("%s: done in %.1f s -> %s", stage, manifest["timings"]["seconds"], manifest["_dir"])
    create_markdown_artifact(
        key=_artifact_key(config.run_name, stage),
        markdown=_summary_markdown(stage, manifest),
        description=f"loraship {stage} for run {config.run_name}",
    )
    figures = _figures_markdown(stage, manifest)
    if figures:
        create_markdown_artifact(
            key=_artifact_key(config.run_name, f"{stage}-figures"),
            markdown=figures,
            description=f"loraship {stage} figures for run {config.run_name}",
        )
    return {
        "stage": stage,
        "skipped": bool(manifest.get("_skipped")),
        "dir": manifest["_dir"],
        "metrics": manifest.get("metrics", {}),
    }


def _run_child_deployment(stage: str, config: Config, suffix: str):
    from prefect.deployments import run_deployment

    child = run_deployment(
        name=f"loraship-stage/{stage}-{suffix}",
        parameters={"stage": stage, "config": config.model_dump(mode="json")},
        timeout=None,
    )
    if not child.state or not child.state.is_completed():
        message = child.state.message if child.state else "no final state"
        return Failed(message=f"{stage}: child flow run {child.name} ended {child.state_name}: {message}")
    return {"stage": stage, "child_flow_run": str(child.id)}


@flow(name="train-and-ship", log_prints=True)
def train_and_ship(config: Config, stages: list[str] | None = None):
    """Plan GPU memory, train a LoRA/QLoRA adapter, merge, record the HF reference outputs, convert to
    GGUF, quantize, verify, publish. `stages` runs only those, in pipeline order (`loraship run --only/--from`);
    each still refuses an upstream output that is missing or does not match its manifest."""
    unknown = sorted(set(stages or ()) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; use stages from {STAGES}")
    suffix = os.environ.get(STAGE_DEPLOYMENTS_ENV)
    results = {}
    for stage in (s for s in STAGES if stages is None or s in stages):
        if suffix:
            outcome = _run_child_deployment(stage, config, suffix)
        else:
            state = stage_task(stage, config, return_state=True)
            outcome = state if state.is_failed() else state.result()
        if hasattr(outcome, "is_failed"):  # a Failed state: stop here, later stages need this one's outputs
            return Failed(message=outcome.message, data=failure_of(outcome))
        results[stage] = outcome
    create_table_artifact(
        key=_artifact_key(config.run_name, "summary"),
        table=[
            {"stage": stage, **{k: str(v) for k, v in r.items() if k != "metrics"}} for stage, r in results.items()
        ],
        description=f"loraship train-and-ship {config.run_name}: every stage, skipped or run, and where",
    )
    return results


@flow(name="loraship-stage", log_prints=True)
def run_stage(stage: str, config: Config):
    """One stage on its own (its deployment runs in that stage's image)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
    state = stage_task(stage, config, return_state=True)
    if state.is_failed():
        # Its own message, so the parent (through run_deployment) reports the stage's real error.
        return Failed(message=state.message, data=failure_of(state))
    return state.result()
