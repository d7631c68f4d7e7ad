"""What every stage does around its own work: locate folders, verify inputs, skip when done.

Deliberately a few helper functions, not a base class: each tasks/<stage>.py reads top to bottom.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraship.runtime import locks
from loraship.runtime import manifest as mf
from loraship.config import Config, load_config
from loraship.constants import MANIFEST_NAME, STAGES
from loraship.errors import LorashipError
from loraship.runtime.prefect_env import secret_env

log = logging.getLogger("loraship")


def run_dir(config: Config) -> Path:
    return Path(config.workdir).expanduser() / config.run_name


def stage_dir(config: Config, stage: str) -> Path:
    return run_dir(config) / stage


class WouldRun(Exception):
    """open_stage under skip_only(): the stage is not up to date, so it would do its work."""


_SKIP_ONLY = contextvars.ContextVar("loraship_skip_only", default=False)


@contextlib.contextmanager
def skip_only():
    """Stages called in this block only skip: one that is up to date returns as it does in the flow
    (publish still puts back what differs at its destination), one that is not raises WouldRun
    before it touches anything. `loraship run` finishes a run with nothing to do this way, without Prefect."""
    token = _SKIP_ONLY.set(True)
    try:
        yield
    finally:
        _SKIP_ONLY.reset(token)


@dataclass
class StageContext:
    stage: str
    config: Config
    dir: Path
    upstream: dict[str, dict]
    config_subset: dict
    fingerprint: str
    done: dict | None
    started: float = field(default_factory=time.time)

    def upstream_dir(self, stage: str) -> Path:
        return Path(self.upstream[stage]["_dir"])

    def finish(self, metrics: dict, outputs: dict | None = None) -> dict:
        return mf.write_manifest(
            self.dir,
            stage=self.stage,
            run_name=self.config.run_name,
            fingerprint=self.fingerprint,
            config=self.config_subset,
            upstream=self.upstream,
            metrics=metrics,
            started=self.started,
            outputs=outputs,
        )


def open_stage(
    config: Config,
    stage: str,
    upstream: tuple[str, ...],
    fields: tuple[str, ...],
    extra_inputs: dict | None = None,
    depends_on: dict[str, tuple[str, ...]] | None = None,
    consumes: dict[str, tuple[str, ...]] | None = None,
) -> StageContext:
    """Verify upstream manifests (checksums included) and decide whether this stage must run.

    extra_inputs: identities of files outside the pipeline (datasets, base model) that key the stage too.
    depends_on: for an upstream stage, the only output files this stage's result depends on
    (train depends on the plan's strategy, not on its inference estimates).
    consumes: for an upstream stage, the only output files (or folders) this stage reads, and so
    the only ones it verifies (default: those in depends_on, else all). Publish reads the merge
    and convert manifests but not their 15 GB of weights each.
    """
    reads = {**(depends_on or {}), **(consumes or {})}
    ups = {name: mf.load_verified(stage_dir(config, name), name, reads.get(name)) for name in upstream}
    subset = config.subset(fields)
    if extra_inputs:
        subset["_inputs"] = extra_inputs
    keyed = {
        name: {**m, "outputs": {rel: info for rel, info in m["outputs"].items() if rel in depends_on[name]}}
        if depends_on and name in depends_on
        else m
        for name, m in ups.items()
    }
    fingerprint = mf.input_fingerprint(stage, subset, keyed)
    folder = stage_dir(config, stage)
    done = mf.up_to_date(folder, fingerprint)
    if done is None and _SKIP_ONLY.get():
        raise WouldRun(f"stage {stage} of run {config.run_name!r} is not up to date")
    if done is not None:
        done = {**done, "_skipped": True}
        log.info("stage %s: up to date (same inputs, outputs intact), skipped", stage)
    return StageContext(stage, config, folder, ups, subset, fingerprint, done)


@contextlib.contextmanager
def stage_lock(config: Config, stage: str):
    """The run folder shared with stages of the same config (another config with the same
    run_name waits until this run is published or fails), and one writer per stage folder: a
    second run of the same config waits, then finds the first run's manifest and skips."""
    locks_dir = run_dir(config) / ".locks"
    fingerprint = config.fingerprint()
    with locks.run_claim(locks_dir, config.run_name, fingerprint, stage):
        with locks.exclusive_lock(
            locks_dir / f"{stage}.lock", f"stage {stage} of run {config.run_name!r}", stage=stage, config=fingerprint
        ):
            yield


def stage_name(run) -> str:
    """The stage a tasks/<stage>.py run() belongs to. Not run.__module__: under
    `python -m loraship.stages.<stage>` (every image's entrypoint) that is '__main__' for every stage."""
    name = run.__globals__.get("STAGE")
    if name not in STAGES:
        raise TypeError(f"{run.__module__}.{run.__qualname__}: its module must set STAGE to one of {STAGES}")
    return name


def exclusive(run):
    """Decorator for a stage's run(config): holds the run claim and the stage lock for the whole
    stage, with the config's secrets in the environment for that stage only, and gives the run
    folder up when the run is over (published, or a stage failed)."""
    stage = stage_name(run)

    @functools.wraps(run)
    def wrapper(config: Config, *args, **kwargs):
        finished = False
        try:
            with stage_lock(config, stage), secret_env(config.env_from_secrets):
                result = run(config, *args, **kwargs)
            finished = True
            return result
        finally:
            if not finished or stage == STAGES[-1]:
                locks.release_run(run_dir(config) / ".locks", config.fingerprint())

    return wrapper


def reset_dir(ctx: StageContext, keep: tuple[str, ...] = ()) -> None:
    """Start the stage folder afresh, manifest first so a crash leaves it visibly incomplete."""
    ctx.dir.mkdir(parents=True, exist_ok=True)
    (ctx.dir / MANIFEST_NAME).unlink(missing_ok=True)
    for child in ctx.dir.iterdir():
        if child.name in keep:
            continue
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def main(run) -> None:
    """`python -m loraship.stages.<stage> CONFIG.yaml`: the stage image's entrypoint."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {run.__module__} CONFIG.yaml")
    try:
        result = run(load_config(sys.argv[1]))
    except LorashipError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    print(f"{result['stage']}: {'skipped (up to date)' if result.get('_skipped') else 'done'} -> {result['_dir']}")
