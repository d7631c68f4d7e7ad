"""Where a config's run stands: each stage done, stale (and why) or not run, from the manifests."""

from __future__ import annotations

import json
from typing import Any

from loraship.errors import LorashipError
from loraship.stage_table import stage_module


def _extra_inputs(stage: str, config) -> dict | None:
    """The files outside the pipeline a stage is keyed on, computed as that stage computes them."""
    from loraship.runtime.manifest import sha256_file

    if stage == "plan":
        from loraship.models import resolve_base_model

        return stage_module("plan").input_files(config, resolve_base_model(config, weights=False))
    if stage == "reference" and config.golden_prompts:  # as tasks/reference.py keys it
        return {"golden_prompts": sha256_file(config.golden_prompts)}
    if stage == "convert" and config.adapter_gguf:  # as tasks/convert.py keys it
        return {"adapter_base_quantization": config.primary_quantization}
    return None


def run_states(config) -> dict[str, dict]:
    """Every stage's stage_status, in pipeline order (each reads its upstream's)."""
    from loraship.constants import STAGES

    states: dict[str, dict] = {}
    for stage in STAGES:
        states[stage] = stage_status(config, stage, states)
    return states


def short(value: Any, width: int = 40) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def _fingerprint(stage: str, manifest: dict, current: dict, inputs: dict, ups: dict[str, dict], keyed: dict) -> str:
    """The input fingerprint open_stage (loraship/runtime/stage.py) would compute now for the stage's recorded
    fields."""
    from loraship.runtime.manifest import input_fingerprint

    subset = {k: (inputs if k == "_inputs" else current.get(k)) for k in manifest.get("config", {})}
    upstream = {
        up: {
            "outputs": {rel: info for rel, info in m.get("outputs", {}).items() if up not in keyed or rel in keyed[up]}
        }
        for up, m in ups.items()
    }
    return input_fingerprint(stage, subset, upstream)


def stage_status(config, stage: str, states: dict[str, dict]) -> dict:
    """done / stale / not run, with the reasons, from the stage's manifest and its upstream's."""
    from loraship.runtime.manifest import check_outputs, read_manifest
    from loraship.runtime.stage import stage_dir

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
            reasons.append(
                f"{name} " + ("added" if name not in before else "removed" if name not in now else "changed")
            )
    module = stage_module(stage)
    reasons += [
        f"config key {key} is new to this stage" for key in getattr(module, "FIELDS", ()) if key not in recorded
    ]
    keyed = getattr(module, "DEPENDS_ON", {})
    if callable(getattr(module, "depends_on", None)):  # files that depend on the config (quantize's imatrix)
        try:
            keyed = {**keyed, **module.depends_on(config)}
        except LorashipError:
            pass  # its upstream has no manifest: said below
    ups = {}
    for up, record in manifest.get("inputs", {}).items():
        if states.get(up, {}).get("state") != "done":
            reasons.append(f"upstream {up} is {states.get(up, {}).get('state', 'unknown')}")
            continue
        up_manifest = ups[up] = read_manifest(stage_dir(config, up)) or {}
        files = keyed.get(up)
        was = {k: v for k, v in record.get("outputs", {}).items() if files is None or k in files}
        is_ = {k: v for k, v in up_manifest.get("outputs", {}).items() if files is None or k in files}
        if was != is_:
            reasons.append(f"upstream {up} ran again since")
    if not reasons and manifest.get("fingerprint") != _fingerprint(stage, manifest, current, now, ups, keyed):
        # open_stage keys a stage on the manifest schema and the pinned llama.cpp too. `loraship run` skips
        # Prefect when every stage is done here, so done must mean that the stage would skip itself.
        reasons.append("loraship keys it differently since it ran (manifest schema or pinned llama.cpp upgraded)")
    if not reasons:
        reasons += check_outputs(manifest, folder)
    finished = manifest.get("timings", {}).get("finished")
    return {
        "stage": stage,
        "state": "stale" if reasons else "done",
        "reasons": reasons,
        "finished": finished,
        "seconds": manifest.get("timings", {}).get("seconds"),
        "dir": str(folder),
    }
