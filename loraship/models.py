"""Finding the base model: a local folder, or a hub id resolved with huggingface_hub at run time."""

from __future__ import annotations

import json
import os
from pathlib import Path

from loraship.config import Config
from loraship.errors import ConfigError, LorashipError
from loraship.safetensors_check import safetensors_problem

# What `plan` needs; training needs the weights too.
METADATA_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "chat_template*", "*.model"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def resolve_base_model(config: Config, weights: bool = True) -> Path:
    """Local folder of the base model, downloading metadata (and weights) from the hub when needed."""
    if config.base_model_is_local():
        return Path(config.base_model).expanduser()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = METADATA_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    if config.allow_pickle and weights:
        patterns += ["*.bin", "*.bin.index.json"]
    try:
        # The token comes from HF_TOKEN in the environment (or a Prefect Secret exported to it),
        # never from the config, so it cannot reach a manifest.
        return Path(snapshot_download(config.base_model, revision=config.base_model_revision, allow_patterns=patterns))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise LorashipError(
            f"base_model {config.base_model!r}: could not fetch it from the Hugging Face hub ({type(e).__name__}: {e}); "
            "check the id and HF_TOKEN, or point base_model at a local folder"
        ) from e


def base_model_problems(config: Config, folder: Path, weights: bool = True) -> list[str]:
    """Everything wrong with a base model folder, listed at once."""
    where = f"base_model {str(folder)!r}"
    if not folder.is_dir():
        return [f"{where}: folder does not exist; point base_model at a folder holding config.json, a tokenizer and *.safetensors"]
    problems = []
    config_file = folder / "config.json"
    if not config_file.is_file():
        problems.append(f"{where}: no config.json; this does not look like a Hugging Face model folder")
    else:
        try:
            model_config = json.loads(config_file.read_text(encoding="utf-8"))
            if model_config.get("auto_map") and not config.trust_remote_code:
                problems.append(
                    f"{where}: config.json asks for custom model code (auto_map); loraship does not run it unless "
                    "you set trust_remote_code: true"
                )
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append(f"{where}: config.json is not valid JSON ({e})")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"{where}: no tokenizer (tokenizer.json or tokenizer.model); copy the tokenizer files into the folder")
    if weights:
        safetensors = list(folder.glob("*.safetensors"))
        pickles = [p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES] if folder.is_dir() else []
        if not safetensors and pickles and not config.allow_pickle:
            problems.append(
                f"{where}: only pickle checkpoints ({', '.join(sorted(p.name for p in pickles))}); pickle can run code on load. "
                "Convert to safetensors, or set allow_pickle: true if you trust the source"
            )
        elif not safetensors and not pickles:
            problems.append(f"{where}: no weights (*.safetensors)")
        problems += [p for p in map(safetensors_problem, safetensors) if p]
    return problems


def check_base_model(config: Config, folder: Path, weights: bool = True) -> None:
    problems = base_model_problems(config, folder, weights)
    if problems:
        raise ConfigError("base model", problems)


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def torch_load_kwargs(config: Config) -> dict:
    """from_pretrained options that keep loading safe: safetensors only, no remote code."""
    return {"trust_remote_code": config.trust_remote_code, "use_safetensors": not config.allow_pickle or None}


def hf_offline_if_local(config: Config) -> None:
    if config.base_model_is_local():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
