"""`--set KEY=VALUE` overrides of a config, for the CLI: dotted keys reach nested mappings and list entries, each
key checked against the config's schema before anything is read, the result validated as the file is."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, get_args, get_origin

from loraship.errors import LorashipError


def _model_of(annotation) -> type | None:
    """The pydantic model a field holds (itself, or the element of a list of them); None otherwise."""
    from pydantic import BaseModel

    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _set_path(data: dict, parts: list[str], value: Any, item: str) -> None:
    """data[parts[0]][parts[1]]... = value, refusing a key or index the config does not have."""
    from loraship.config import Config

    node: Any = data
    model: type | None = Config
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                have = f"indices 0..{len(node) - 1}" if node else "no entries"
                raise LorashipError(
                    f"--set {item}: {where} is a list with {have}; use an existing index, or set the "
                    f"whole list, e.g. --set '{where}=[...]'"
                )
            key: Any = int(part)
        elif isinstance(node, dict):
            if model is not None and part not in model.model_fields:
                close = difflib.get_close_matches(part, list(model.model_fields), n=1, cutoff=0.6)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise LorashipError(
                    f"--set {item}: {where} has no key {part!r}{hint}; the keys are described in loraship/config.py"
                )
            if model is None and part not in node and depth < len(parts) - 1:
                raise LorashipError(
                    f"--set {item}: {where} has no key {part!r}; set it whole, e.g. --set '{where}.{part}=VALUE'"
                )
            key = part
        else:
            raise LorashipError(
                f"--set {item}: {where} is {node!r}, not a mapping or a list; set it whole, e.g. --set {where}=VALUE"
            )
        if depth == len(parts) - 1:
            node[key] = value
            return
        if isinstance(node, dict) and model is not None:
            field = model.model_fields[part]
            model = _model_of(field.annotation) if get_origin(field.annotation) is not dict else None
        node = node[key]


def _parse_sets(items: list[str]) -> list[tuple[list[str], Any, str]]:
    import yaml

    parsed = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LorashipError(
                f"--set {item!r}: expected KEY=VALUE, e.g. --set max_steps=10 or --set datasets.0.path=train.jsonl"
            )
        try:
            parsed.append((key.strip().split("."), yaml.safe_load(value), item))
        except yaml.YAMLError as e:
            raise LorashipError(
                f"--set {item}: the value is not valid YAML ({e}); quote it, e.g. --set 'key=\"...\"'"
            ) from e
    return parsed


def load_with_overrides(config_path: Path, overrides: list[str]):
    """The config with --set overrides; dotted keys reach nested mappings and list entries."""
    from loraship.config import load_config, parse_config

    parsed = _parse_sets(overrides)
    for parts, _value, item in parsed:  # a misspelt key is named before anything else is read
        _set_path({}, parts[:1], None, item)
    top = {parts[0]: value for parts, value, _item in parsed if len(parts) == 1}
    config = load_config(config_path, top)
    nested = [p for p in parsed if len(p[0]) > 1]
    if not nested:
        return config
    data = config.model_dump(mode="json")  # defaults filled in, dataset paths already resolved
    for parts, value, item in nested:
        _set_path(data, parts, value, item)
    return parse_config(data, source=f"{config_path} with --set")


SET_HELP = (
    "Override a config key, dotted for nested ones: --set max_steps=10, --set datasets.0.path=x.jsonl (repeatable)"
)
