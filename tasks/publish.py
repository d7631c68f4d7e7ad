"""Publish: the artifact folder at `output/<run_name>/` (local or any fsspec URL).

Holds the quantized GGUF (one per quantization listed; the first, the primary, is the one the
Modelfile and the card's llama-server command use), an Ollama Modelfile beside it, the adapter, every stage's manifest,
plan.json, verify.json and a model card (huggingface_hub's ModelCard: YAML front matter, how to
run it with llama-server and Ollama, the strategy that really trained, memory and verify figures;
loraship/publishing/model_card.py). Files are
uploaded first and manifest.json last, so a destination with a manifest is complete; local destinations get
each file under a temporary name, then renamed. Every file is read back from the destination (size and sha256);
a rerun sends only what is missing or differs there, and removes what an earlier publish there wrote that this
artifact no longer ships: nothing loraship did not write is removed or overwritten (loraship/publishing/store.py,
destination.py). An `hf://<namespace>/<repo>` output is a Hugging Face Hub repository, published in one atomic
commit (loraship/publishing/hub.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from loraship.publishing import hub
from loraship.publishing.destination import destination_of, foreign_problems, overlap_problems
from loraship.publishing.model_card import (
    PICTURES,
    ladder_picture,
    model_card,
    quantization_figures,
    shipped_pictures,
    shipped_sampling,
)
from loraship.publishing.store import sync

from loraship.llamacpp import ollama
from loraship.constants import (
    ADAPTER_DIR,
    ADAPTER_GGUF,
    GENERATION_CONFIG_FILE,
    GGUF_METADATA_FILE,
    LADDER_PLOT_FILE,
    MANIFEST_NAME,
    MERGED_DIR,
    MODEL_CARD,
    MODELFILE,
    OLLAMA_FILE,
    PLAN_FILE,
    STAGES,
    VERIFY_FILE,
    base_gguf_name,
    quantized_gguf_name,
)
from loraship.errors import OutputError
from loraship.runtime.manifest import (
    DigestCache,
    atomic_write_json,
    describe_files,
    sha256_json,
)
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir, stage_dir
from loraship.sampling import Sampling

STAGE = "publish"
UPSTREAM = ("plan", "train", "merge", "convert", "quantize", "verify")
FIELDS = ("output", "run_name", "quantization", "adapter_gguf")


def stage_artifact(config, ctx) -> Path:
    """Assemble the artifact locally inside the stage folder (each file written whole)."""
    root = ctx.dir / "artifact"
    root.mkdir(parents=True)
    gguf = quantized_gguf_name(config.primary_quantization)
    for name in map(quantized_gguf_name, config.quantizations):
        _link_or_copy(ctx.upstream_dir("quantize") / name, root / name)
    shutil.copytree(ctx.upstream_dir("train") / ADAPTER_DIR, root / ADAPTER_DIR)
    (root / "manifests").mkdir()
    for name in STAGES[:-1]:
        shutil.copy(stage_dir(config, name) / MANIFEST_NAME, root / "manifests" / f"{name}.json")
    shutil.copy(ctx.upstream_dir("plan") / PLAN_FILE, root / PLAN_FILE)
    shutil.copy(ctx.upstream_dir("verify") / VERIFY_FILE, root / VERIFY_FILE)
    for picture in shipped_pictures(ctx.upstream["train"]):
        shutil.copy(ctx.upstream_dir("train") / picture, root / picture)
    if ladder_picture(ctx.upstream["verify"]):
        shutil.copy(ctx.upstream_dir("verify") / LADDER_PLOT_FILE, root / LADDER_PLOT_FILE)
    if config.adapter_gguf:
        for name in (ADAPTER_GGUF, base_gguf_name(config.primary_quantization)):
            _link_or_copy(ctx.upstream_dir("convert") / name, root / name)
    verify = json.loads((root / VERIFY_FILE).read_text(encoding="utf-8"))
    plan = json.loads((root / PLAN_FILE).read_text(encoding="utf-8"))
    convert_dir = ctx.upstream_dir("convert")
    facts = json.loads((convert_dir / OLLAMA_FILE).read_text(encoding="utf-8"))
    metadata = json.loads((convert_dir / GGUF_METADATA_FILE).read_text(encoding="utf-8"))
    sampling = shipped_sampling(verify)
    (root / MODELFILE).write_text(
        ollama.modelfile(
            gguf, facts, facts.get("stop_tokens") or [], config.target_context, sampling, verify.get("n_cpu_moe") or 0
        ),
        encoding="utf-8",
    )
    write_generation_config(
        ctx.upstream_dir("merge") / MERGED_DIR / GENERATION_CONFIG_FILE, root / GENERATION_CONFIG_FILE, sampling
    )
    (root / MODEL_CARD).write_text(model_card(config, ctx.upstream, verify, plan, facts, metadata), encoding="utf-8")
    return root


def write_generation_config(merged: Path, out: Path, sampling: Sampling) -> dict:
    """The merged model's generation_config.json (its stop tokens) with the shipped decoding: for
    transformers users of the adapter, and so a merge made before merge wrote greedy settings ships them."""
    gen = json.loads(merged.read_text(encoding="utf-8")) if merged.is_file() else {}
    shipped, _changed = sampling.generation_config(gen)
    out.write_text(json.dumps(shipped, indent=2) + "\n", encoding="utf-8")
    return shipped


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link saves copying gigabytes inside the workdir; other filesystems get a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def send(root: Path, files: dict, destination: str, cache: DigestCache, config) -> dict:
    """Publish to a Hub repository or any fsspec destination."""
    if hub.is_hub_repo(destination):
        return hub.sync(root, files, destination, config.run_name, force=config.replace_output)
    return sync(root, files, destination, cache, force=config.replace_output)


def check_destination(config, ctx) -> None:
    """The plan's checks of the artifact folder again, before anything is staged: apart from the workdir and every
    input (the base model's folder as the plan resolved it), and holding nothing loraship did not write. The folder
    may have changed since the plan, and `--only publish` runs without it."""
    plan = json.loads((ctx.upstream_dir("plan") / PLAN_FILE).read_text(encoding="utf-8"))
    problems = overlap_problems(config, Path(plan["model_dir"]) if plan.get("model_dir") else None)
    problems = problems or foreign_problems(config)
    if problems:
        raise OutputError("; ".join(problems))


# Publish reads these upstream files; the merged weights and the F16 GGUF (tens of GB on a
# 7B model) only through their manifests, so it does not hash them again.
CONSUMES = {
    "plan": (PLAN_FILE,),
    "train": (ADAPTER_DIR, *PICTURES),
    "merge": (f"{MERGED_DIR}/{GENERATION_CONFIG_FILE}",),
    "convert": (GGUF_METADATA_FILE, OLLAMA_FILE),
    "verify": (VERIFY_FILE, LADDER_PLOT_FILE),
}


def shipping_config(config):
    """The config as publish ships it: for quantization auto, the one rung verify chose (its manifest)."""
    if not config.auto_quantization:
        return config
    from loraship.runtime.manifest import read_manifest

    chosen = ((read_manifest(stage_dir(config, "verify")) or {}).get("metrics") or {}).get("shipped_quantization")
    if not chosen:
        raise OutputError("quantization auto: verify has not chosen a quantization yet; run the verify stage first")
    return config.model_copy(update={"quantization": [chosen]})


@exclusive
def run(config) -> dict:
    stage_config, config = config, shipping_config(config)
    gguf = quantized_gguf_name(config.primary_quantization)
    consumes = {**CONSUMES, "quantize": tuple(map(quantized_gguf_name, config.quantizations))}
    if config.adapter_gguf:  # the adapter alone and the base it applies to, beside the merged GGUF
        consumes["convert"] += (ADAPTER_GGUF, base_gguf_name(config.primary_quantization))
    ctx = open_stage(stage_config, STAGE, UPSTREAM, FIELDS, consumes=consumes)
    check_destination(config, ctx)
    destination = destination_of(config)
    cache = DigestCache.of_run(ctx.dir)
    if ctx.done and "artifact_files" in ctx.done["metrics"]:
        # The stage folder still holds the artifact it published; the destination may not (an
        # interrupted upload, a deleted or altered object): put back whatever differs.
        root = ctx.dir / "artifact"
        send(root, ctx.done["metrics"]["artifact_files"], destination, cache, config)
        return ctx.done
    reset_dir(ctx)
    root = stage_artifact(config, ctx)
    files = describe_files(root, cache=cache)
    verify = json.loads((root / VERIFY_FILE).read_text(encoding="utf-8"))
    published = {
        "run_name": config.run_name,
        "base_model": config.base_model,
        "quantization": config.primary_quantization,
        "gguf": gguf,
        "verified": verify["passed"],
        # The decoding verify served the GGUF with, which the Modelfile, the card and generation_config.json carry.
        "sampling": shipped_sampling(verify).record(),
        # Every GGUF shipped, the primary first: its file's checksum beside the figures verify measured for it.
        "quantizations": {
            q: {
                "gguf": quantized_gguf_name(q),
                "sha256": files[quantized_gguf_name(q)]["sha256"],
                "size": files[quantized_gguf_name(q)]["size"],
                "verify": figures,
            }
            for q, figures in quantization_figures(config, verify).items()
        },
        "files": files,
    }
    atomic_write_json(root / MANIFEST_NAME, published)
    sent = send(root, files, destination, cache, config)
    return ctx.finish(
        {
            "destination": destination,
            "files": len(files),
            "files_sha256": sha256_json(files),
            "artifact_files": files,
            "uploaded": len(sent["uploaded"]),
            "removed": sent["removed"],
            # Where --force put what loraship did not write: a sibling folder, or on the Hub the commit before.
            **{k: sent[k] for k in ("moved_aside", "replaced_from_commit") if k in sent},
            **({"hub_commit": sent["commit"]} if "commit" in sent else {}),
        }
    )


if __name__ == "__main__":
    main(run)
