"""Which merged model a later stage's inputs came from: one digest of the merged model's files, as the
reference stage stores it and as convert's manifest lets verify recompute it (the lineage check)."""

from __future__ import annotations

from loraship.constants import MERGED_DIR
from loraship.errors import IntegrityError
from loraship.runtime.manifest import read_manifest, sha256_json


def merged_digest(merge_manifest: dict) -> str:
    """One digest of the merged model's files, as recorded by merge's manifest."""
    return sha256_json(
        {
            rel: info["sha256"]
            for rel, info in sorted(merge_manifest["outputs"].items())
            if rel.startswith(MERGED_DIR + "/")
        }
    )


def converted_from(config) -> str:
    """The digest of the merged model this run's convert manifest says its GGUF was converted from (the merge
    outputs it recorded, digested as merged_digest does), for a later stage's lineage check.

    A manifest that records no merge outputs cannot vouch for its GGUF's lineage: refused, not passed over."""
    from loraship.runtime.stage import stage_dir

    folder = stage_dir(config, "convert")
    manifest = read_manifest(folder)
    merge_outputs = ((manifest or {}).get("inputs", {}).get("merge") or {}).get("outputs") or {}
    merged = {rel: info for rel, info in merge_outputs.items() if rel.startswith(MERGED_DIR + "/")}
    if not merged or not all(isinstance(info, dict) and info.get("sha256") for info in merged.values()):
        what = "has no manifest" if manifest is None else "records no merged model files (inputs.merge.outputs)"
        raise IntegrityError(
            f"{folder}: the convert stage {what}, so nothing says which merged model its GGUF was converted from; "
            "run the convert stage again (loraship run CONFIG --from convert)"
        )
    return merged_digest({"outputs": merged})
