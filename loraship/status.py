"""Where a config's run stands: each stage done, stale (and why) or not run, from the manifests."""

from __future__ import annotations

import json
from typing import Any

from loraship.errors import LorashipError
from loraship.stage_table import stage_module


def _extra_inputs(stage: str, config) -> dict | None:
    """The files outside the pipeline a stage is keyed on, computed as that stage computes them."""
    from loraship.manifest import sha256_file

    if stage == "plan":
        from loraship.models import resolve_base_model

        return stage_module("plan").input_files(config, resolve_base_model(config, weights=False))
    if stage == "reference" and config.golden_prompts:  # as tasks/reference.py keys it
        return {"golden_prompts": sha256_file(config.golden_prompts)}
    return None


def short(value: Any, width: int = 40) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def stage_status(config, stage: str, states: dict[str, dict]) -> dict:
    """done / stale / not run, with the reasons, from the stage's manifest and its upstream's."""
    from loraship.manifest import check_outputs, read_manifest
    from loraship.stage import stage_dir

    folder = stage_dir(config, stage)
    try:
        manifest = read_manifest(folder)
    except LorashipError as e:
        return {"stage": stage, "state": "stale", "reasons": [str(e)]}
    if manifest is None:
        return {"stage": stage, "state": "not run", "reasons": []}
    reasons = []
    recorded = manifest.get("config", {})
    current = config.model_dump(mode="json")
    for key, old in recorded.items():
        if key == "_inputs":
            continue
        if key not in current:
            reasons.append(f"config key {key} no longer exists")
        elif current[key] != old:
            reasons.append(f"{key} changed: {short(old)} -> {short(current[key])}")
    try:
        now = _extra_inputs(stage, config) or {}
    except (LorashipError, OSError) as e:
        reasons.append(f"its input files cannot be read: {e}")
        now = recorded.get("_inputs") or {}
    before = recorded.get("_inputs") or {}
    for name in sorted(set(before) | set(now)):
        if before.get(name) != now.get(name):
            reasons.append(f"{name} " + ("added" if name not in before else "removed" if name not in now else "changed"))
    keyed = getattr(stage_module(stage), "DEPENDS_ON", {})
    for up, record in manifest.get("inputs", {}).items():
        if states.get(up, {}).get("state") != "done":
            reasons.append(f"upstream {up} is {states.get(up, {}).get('state', 'unknown')}")
            continue
        up_manifest = read_manifest(stage_dir(config, up)) or {}
        files = keyed.get(up)
        was = {k: v for k, v in record.get("outputs", {}).items() if files is None or k in files}
        is_ = {k: v for k, v in up_manifest.get("outputs", {}).items() if files is None or k in files}
        if was != is_:
            reasons.append(f"upstream {up} ran again since")
    if not reasons:
        reasons += check_outputs(manifest, folder)
    finished = manifest.get("timings", {}).get("finished")
    return {"stage": stage, "state": "stale" if reasons else "done", "reasons": reasons, "finished": finished,
            "seconds": manifest.get("timings", {}).get("seconds"), "dir": str(folder)}
