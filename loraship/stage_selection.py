"""Which stages `loraship run --only/--from` runs, refusing a selection whose upstream output is not there yet."""

from __future__ import annotations

from pathlib import Path

from loraship.constants import STAGES
from loraship.errors import LorashipError
from loraship.stage_table import stage_module


def _ancestors(stage: str) -> set[str]:
    found: set[str] = set()
    for up in stage_module(stage).UPSTREAM:
        found |= {up} | _ancestors(up)
    return found


def select_stages(config, config_path: Path, only: str | None, start: str | None) -> list[str]:
    """Stages to run for --only/--from; refuses one whose upstream output is not there yet."""
    from loraship.runtime.manifest import read_manifest
    from loraship.runtime.stage import stage_dir

    if only and start:
        raise LorashipError(
            "--only and --from together: use --only STAGE for one stage, or --from STAGE for it and "
            "every stage after it"
        )
    for flag, value in (("--only", only), ("--from", start)):
        if value is not None and value not in STAGES:
            raise LorashipError(f"{flag} {value!r}: not a stage; use one of {', '.join(STAGES)}")
    stages = [only] if only else list(STAGES[STAGES.index(start) :]) if start else list(STAGES)
    first = stages[0]
    missing = sorted(
        (
            s
            for s in set().union(*(_ancestors(s) for s in stages)) - set(stages)
            if read_manifest(stage_dir(config, s)) is None
        ),
        key=STAGES.index,
    )
    direct = [s for s in stage_module(first).UPSTREAM if s in missing] or missing
    if missing:
        flag = f"--only {only}" if only else f"--from {start}"
        raise LorashipError(
            f"{flag}: stage {first} reads the output of {direct[0]}, which has not run for run {config.run_name!r} "
            f"(no manifest in {stage_dir(config, direct[0])}); run {missing[0]} first: "
            f"loraship run {config_path} --from {missing[0]}"
        )
    return stages
