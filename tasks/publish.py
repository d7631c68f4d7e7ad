"""Publish: the artifact folder at `output/<run_name>/` (local or any fsspec URL).

Holds the quantized GGUF, the adapter, every stage's manifest, plan.json, verify.json and a
model card. Files are uploaded first and manifest.json last, so a destination with a manifest
is complete; local destinations get each file under a temporary name, then renamed. Every file
is read back from the destination (size and sha256); a rerun sends only what is missing or
differs there, and removes what this artifact no longer ships.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from loraship.constants import (
    ADAPTER_DIR, MANIFEST_NAME, MODEL_CARD, PLAN_FILE, STAGES, VERIFY_FILE, quantized_gguf_name,
)
from loraship.errors import OutputError
from loraship.manifest import DigestCache, atomic_path, atomic_write_json, describe_files, sha256_file, sha256_json
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

On the eval split ({verify['eval_agreement']['scored_tokens']} scored tokens): perplexity merged HF
{verify['eval_agreement']['hf_perplexity']:.4f}, GGUF {verify['eval_agreement']['gguf_perplexity']:.4f}; mean KL divergence
{verify['eval_agreement']['kl_mean']:.4f} nats/token (99th percentile {verify['eval_agreement']['kl_p99']:.4f}); same top
token {verify['eval_agreement']['same_top_rate']:.1%}. GPU memory at n_ctx {config.target_context}: predicted
{verify['gpu_memory']['predicted_gib']:.2f} GiB, measured {verify['gpu_memory']['measured_gib'] if verify['gpu_memory']['measured_gib'] is not None else 'n/a (verified on CPU)'}
(target {config.target_gpu_memory_gib:g} GiB).

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


def _remote_sha256(fs, path: str) -> str:
    """sha256 of a file as the store returns it (read back, not trusted from our side)."""
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _remote_matches(fs, path: str, info: dict, cache: DigestCache | None) -> bool:
    """Whether the destination holds exactly this file: size first (cheap), then its bytes. A
    local destination's digest comes from the run's digest cache while the file is unchanged."""
    try:
        size = fs.size(path)
    except FileNotFoundError:
        return False
    if size != info["size"]:
        return False
    if cache is not None:
        return cache.sha256(Path(path)) == info["sha256"]
    return _remote_sha256(fs, path) == info["sha256"]


def sync(root: Path, files: dict, destination: str, cache: DigestCache | None = None) -> dict:
    """Make `destination` hold exactly the artifact in `root`, manifest.json last.

    The remote manifest is not trusted: every file is compared by size and sha256 read back from
    the store, and one that is missing or differs is uploaded again (then read back) even when the
    remote manifest lists it. Files this artifact no longer ships (another quantization's GGUF, a
    file of an interrupted upload) are removed. Returns what was uploaded and removed.
    """
    import fsspec

    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, base = fsspec.core.url_to_fs(destination)
        manifest = root / MANIFEST_NAME
        wanted = {**files, MANIFEST_NAME: {"size": manifest.stat().st_size,
                                           "sha256": cache.sha256(manifest) if cache else sha256_file(manifest)}}
        local = isinstance(fs, LocalFileSystem)
        dest_cache = cache if local else None  # a remote store is always read back
        fs.makedirs(base, exist_ok=True)
        stale = [rel for rel, info in wanted.items() if not _remote_matches(fs, f"{base}/{rel}", info, dest_cache)]
        present = {p[len(base) + 1:] for p in fs.find(base) if p.startswith(base + "/")}
        extra = sorted(rel for rel in present if rel not in wanted)
        if not stale and not extra:
            return {"uploaded": [], "removed": []}
        # The old artifact stops being complete before anything in it changes.
        if fs.exists(f"{base}/{MANIFEST_NAME}"):
            fs.rm_file(f"{base}/{MANIFEST_NAME}")
            stale = [*[r for r in stale if r != MANIFEST_NAME], MANIFEST_NAME]
        for rel in extra:
            fs.rm_file(f"{base}/{rel}")
        for rel in sorted(stale, key=lambda r: r == MANIFEST_NAME):  # manifest last
            _put(fs, root / rel, f"{base}/{rel}", local)
            # Read back what the store now holds (not the local cache: these bytes are new).
            dst = f"{base}/{rel}"
            size, digest = fs.size(dst), _remote_sha256(fs, dst)
            if (size, digest) != (wanted[rel]["size"], wanted[rel]["sha256"]):
                raise OutputError(
                    f"publish: {dst} reads back as {size} bytes, sha256 {digest[:16]}..., not the "
                    f"{wanted[rel]['size']} bytes, sha256 {wanted[rel]['sha256'][:16]}... uploaded; the store "
                    "altered or lost it. Check the destination and run again (only differing files are re-sent)"
                )
            if dest_cache is not None:
                dest_cache.remember(Path(dst), digest, os.stat(dst))
    except OutputError:
        raise
    except Exception as e:  # noqa: BLE001 - stores raise their own types (botocore, gcsfs, adlfs ...)
        raise OutputError(
            f"publish: cannot write to {destination} ({type(e).__name__}: {e}); check output, its credentials "
            "and permissions, then run again: files already there and intact are not sent again"
        ) from e
    finally:
        if cache is not None:
            cache.save()
    return {"uploaded": stale, "removed": extra}


def _put(fs, src: Path, dst: str, local: bool) -> None:
    fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
    if local:  # a local file appears whole, under its name, only once written and synced
        with atomic_path(Path(dst)) as tmp:
            fs.put_file(str(src), str(tmp))
    else:  # object stores make an object visible only once its upload completes
        fs.put_file(str(src), dst)


def destination_of(config) -> str:
    return f"{config.output.rstrip('/')}/{config.run_name}"


# Publish reads these upstream files; the merged weights and the F16 GGUF (tens of GB on a
# 7B model) only through their manifests, so it does not hash them again.
CONSUMES = {
    "plan": (PLAN_FILE,), "train": (ADAPTER_DIR,), "merge": (), "convert": (), "verify": (VERIFY_FILE,),
}


@exclusive
def run(config) -> dict:
    gguf = quantized_gguf_name(config.quantization)
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS, consumes={**CONSUMES, "quantize": (gguf,)})
    destination = destination_of(config)
    cache = DigestCache.of_run(ctx.dir)
    if ctx.done and "artifact_files" in ctx.done["metrics"]:
        # The stage folder still holds the artifact it published; the destination may not (an
        # interrupted upload, a deleted or altered object): put back whatever differs.
        root = ctx.dir / "artifact"
        sync(root, ctx.done["metrics"]["artifact_files"], destination, cache)
        return ctx.done
    reset_dir(ctx)
    root = stage_artifact(config, ctx)
    files = describe_files(root, cache=cache)
    published = {
        "run_name": config.run_name,
        "base_model": config.base_model,
        "quantization": config.quantization,
        "gguf": gguf,
        "verified": json.loads((root / VERIFY_FILE).read_text(encoding="utf-8"))["passed"],
        "files": files,
    }
    atomic_write_json(root / MANIFEST_NAME, published)
    sent = sync(root, files, destination, cache)
    return ctx.finish({"destination": destination, "files": len(files), "files_sha256": sha256_json(files),
                       "artifact_files": files, "uploaded": len(sent["uploaded"]), "removed": sent["removed"]})


if __name__ == "__main__":
    main(run)
