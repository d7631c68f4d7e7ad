"""Publish: the artifact folder at `output/<run_name>/` (local or any fsspec URL).

Holds the quantized GGUF, the adapter, every stage's manifest, plan.json, verify.json and a
model card. Files are uploaded first and manifest.json last, so a destination with a manifest
is complete; local destinations get each file under a temporary name, then renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from loraship.constants import (
    ADAPTER_DIR, MANIFEST_NAME, MODEL_CARD, PLAN_FILE, STAGES, VERIFY_FILE, quantized_gguf_name,
)
from loraship.errors import OutputError
from loraship.manifest import atomic_path, describe_files, sha256_json
from loraship.stage import exclusive, main, open_stage, reset_dir, stage_dir

STAGE = "publish"
UPSTREAM = ("plan", "train", "merge", "convert", "quantize", "verify")
FIELDS = ("output", "run_name", "quantization")


def model_card(config, manifests: dict[str, dict], verify: dict) -> str:
    train = manifests["train"]["metrics"]
    quant = manifests["quantize"]["metrics"]
    gates = "\n".join(f"| {name} | {'pass' if g['passed'] else 'FAIL'} | {g['value']} | {g['threshold']} |"
                      for name, g in verify["gates"].items())
    versions = manifests["verify"]["versions"]
    return f"""# {config.run_name}

Fine-tuned from `{config.base_model}` with a {config.adapter.upper()} adapter (r={config.lora_r},
alpha={config.lora_alpha}, targets {config.lora_target_modules}) and shipped as
`{quantized_gguf_name(config.quantization)}` ({quant['bytes'] / 2**20:.1f} MiB) by loraship.

Verified with llama.cpp from llama-cpp-python {versions.get('llama-cpp-python', '?')}: load it with the
same or a newer llama.cpp.

## Training
- steps: {train['steps']}, train examples: {train['train_examples']}, eval examples: {train['eval_examples']}
- eval loss: {train['eval_loss_before']:.4f} (base) -> {train['eval_loss_after']:.4f} (fine-tuned)
- truncation policy: {train['truncation_policy']} ({train['truncated_examples']} examples truncated)

## Verification gates
| gate | result | value | threshold |
|---|---|---|---|
{gates}

Perplexity on the eval split: merged HF {verify['perplexity']['hf_perplexity']:.4f},
GGUF {verify['perplexity']['gguf_perplexity']:.4f}.

## Files
- `{quantized_gguf_name(config.quantization)}`: the model for llama.cpp / Ollama / LM Studio
- `adapter/`: the PEFT LoRA adapter (safetensors)
- `manifests/<stage>.json`: inputs, outputs (sha256), library versions and figures of each stage
- `plan.json`, `verify.json`, `manifest.json` (this folder's checksums)
"""


def stage_artifact(config, ctx) -> Path:
    """Assemble the artifact locally inside the stage folder (each file written whole)."""
    root = ctx.dir / "artifact"
    root.mkdir(parents=True)
    gguf = quantized_gguf_name(config.quantization)
    _link_or_copy(ctx.upstream_dir("quantize") / gguf, root / gguf)
    shutil.copytree(ctx.upstream_dir("train") / ADAPTER_DIR, root / ADAPTER_DIR)
    (root / "manifests").mkdir()
    for name in STAGES[:-1]:
        shutil.copy(stage_dir(config, name) / MANIFEST_NAME, root / "manifests" / f"{name}.json")
    shutil.copy(ctx.upstream_dir("plan") / PLAN_FILE, root / PLAN_FILE)
    shutil.copy(ctx.upstream_dir("verify") / VERIFY_FILE, root / VERIFY_FILE)
    verify = json.loads((root / VERIFY_FILE).read_text(encoding="utf-8"))
    (root / MODEL_CARD).write_text(model_card(config, ctx.upstream, verify), encoding="utf-8")
    return root


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link saves copying gigabytes inside the workdir; other filesystems get a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def upload(root: Path, files: dict, destination: str) -> None:
    """Copy the artifact to its destination, manifest.json last."""
    import fsspec

    from fsspec.implementations.local import LocalFileSystem

    fs, base = fsspec.core.url_to_fs(destination)
    local = isinstance(fs, LocalFileSystem)
    try:
        fs.makedirs(base, exist_ok=True)
        if fs.exists(f"{base}/{MANIFEST_NAME}"):
            fs.rm_file(f"{base}/{MANIFEST_NAME}")  # the old artifact stops being complete first
        for rel in [*files, MANIFEST_NAME]:
            src, dst = root / rel, f"{base}/{rel}"
            fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
            if local:
                with atomic_path(Path(dst)) as tmp:
                    fs.put_file(str(src), str(tmp))
            else:
                fs.put_file(str(src), dst)
    except OSError as e:
        raise OutputError(f"publish: cannot write to {destination} ({e}); check output and its permissions") from e


def destination_of(config) -> str:
    return f"{config.output.rstrip('/')}/{config.run_name}"


def destination_complete(config, manifest: dict) -> bool:
    import fsspec

    fs, base = fsspec.core.url_to_fs(destination_of(config))
    try:
        published = json.loads(fs.cat_file(f"{base}/{MANIFEST_NAME}"))
    except (OSError, ValueError):
        return False
    return sha256_json(published.get("files")) == manifest["metrics"].get("files_sha256")


@exclusive
def run(config) -> dict:
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS)
    if ctx.done and destination_complete(config, ctx.done):
        return ctx.done
    reset_dir(ctx)
    root = stage_artifact(config, ctx)
    files = describe_files(root)
    published = {
        "run_name": config.run_name,
        "base_model": config.base_model,
        "quantization": config.quantization,
        "gguf": quantized_gguf_name(config.quantization),
        "verified": json.loads((root / VERIFY_FILE).read_text(encoding="utf-8"))["passed"],
        "files": files,
    }
    (root / MANIFEST_NAME).write_text(json.dumps(published, indent=2) + "\n", encoding="utf-8")
    destination = destination_of(config)
    upload(root, files, destination)
    return ctx.finish({"destination": destination, "files": len(files), "files_sha256": sha256_json(files)})


if __name__ == "__main__":
    main(run)
