"""Checks that run before any GPU is touched; every problem is reported at once."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from loraship.config import Config
from loraship.data import read_rows
from loraship.errors import ConfigError, LorashipError


def output_problems(config: Config) -> list[str]:
    """Can we write where the artifact goes (local folder or fsspec URL)?"""
    import fsspec

    target = f"{config.output.rstrip('/')}/{config.run_name}"
    try:
        fs, path = fsspec.core.url_to_fs(target)
        fs.makedirs(path, exist_ok=True)
        probe = f"{path}/.loraship-write-test-{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except ImportError as e:  # a known scheme whose fsspec implementation is not installed (s3 -> s3fs)
        return [f"output {config.output!r}: no filesystem for this URL is installed ({e}); install the package it names "
                "into this environment (image), or choose a local folder"]
    except ValueError as e:  # fsspec: "Protocol not known"
        return [f"output {config.output!r}: cannot write there ({type(e).__name__}: {e}); use a local folder or a URL "
                "fsspec knows (s3://, gs://, az://, hf://, file://, memory://)"]
    except OSError as e:
        return [f"output {config.output!r}: cannot write there ({type(e).__name__}: {e}); choose a writable folder or URL"]
    return []


def dataset_problems(config: Config) -> list[str]:
    problems = []
    for group in ("datasets", "eval_datasets"):
        for i, spec in enumerate(getattr(config, group)):
            try:
                read_rows(spec.path, spec.type)
            except LorashipError as e:
                problems.append(f"{group}[{i}]: {e}")
    if config.golden_prompts:
        try:
            read_rows(config.golden_prompts, "golden")
        except LorashipError as e:
            problems.append(f"golden_prompts: {e}")
    return problems


# Below this, not even the plan, a checkpoint of a tiny adapter and the logs fit; plan.json then
# lists what each later stage needs, and each stage checks its own share before it writes.
WORKDIR_MIN_FREE = 256 * 2**20


def workdir_problems(config: Config) -> list[str]:
    folder = Path(config.workdir).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return [f"workdir {config.workdir!r}: cannot create it ({e}); choose a writable local folder"]
    free = shutil.disk_usage(folder).free
    if free < WORKDIR_MIN_FREE:
        return [f"workdir {config.workdir!r}: its disk is full ({free / 2**20:.0f} MiB free, at least "
                f"{WORKDIR_MIN_FREE / 2**20:.0f} MiB needed to start); free space there or point workdir at a larger disk"]
    probe = folder / f".loraship-write-test-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"\0" * 65536)
    except OSError as e:  # a full disk (ENOSPC) or a read-only mount
        return [f"workdir {config.workdir!r}: cannot write there ({e}); free space there or choose a writable local folder"]
    finally:
        probe.unlink(missing_ok=True)
    return []


def check_inputs(config: Config) -> Path:
    """Every problem with the run's inputs, raised at once; returns the base model's folder.

    Runs before any training: base model folder (config, tokenizer, safetensors, remote code),
    GGUF convertibility with the pinned llama.cpp, every dataset line, workdir and output.
    """
    from loraship.llamacpp import check_convertible
    from loraship.models import base_model_problems, resolve_base_model

    model_dir = resolve_base_model(config, weights=False)
    problems = base_model_problems(config, model_dir, weights=config.base_model_is_local())
    if not problems:
        problems += [f"base model {config.base_model!r}: {p}" for p in check_convertible(model_dir)]
    problems += dataset_problems(config) + workdir_problems(config) + output_problems(config)
    if problems:
        raise ConfigError(f"run {config.run_name!r}", problems)
    return model_dir


def check_free_disk(folder: Path, needed_bytes: float, what: str) -> None:
    """Refuse to start a stage that would run out of disk half-way."""
    folder = Path(folder)
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise LorashipError(
            f"{what} needs about {needed_bytes / 2**30:.2f} GiB free in {probe}, but only {free / 2**30:.2f} GiB is free; "
            "free space there or point workdir at a larger disk"
        )
