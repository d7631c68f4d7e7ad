"""Reading a config file's YAML: keys given twice and alias bombs refused with the line to fix, and relative
dataset and golden-prompt paths resolved beside the file. loraship.config validates what this reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from loraship.errors import ConfigError

# More values than any config has, far fewer than an alias bomb ("billion laughs") expands to.
MAX_YAML_VALUES = 100_000


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice (plain YAML silently keeps the last one)."""

    source = "config"

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:
                continue  # an unhashable key: SafeLoader reports it
            if first != key_node.start_mark.line + 1:
                raise ConfigError(
                    self.source,
                    [
                        f"key {key!r} appears twice (lines {first} and "
                        f"{key_node.start_mark.line + 1}); keep one of them"
                    ],
                )
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node, sizes: dict[int, int], path: frozenset = frozenset()) -> int:
    """Values the document holds once every alias is expanded (shared nodes counted each time)."""
    if id(node) in path:
        raise ValueError("an alias refers to a value that contains it")
    if id(node) not in sizes:
        children = (
            [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else node.value
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        sizes[id(node)] = 1 + sum(_expanded_size(c, sizes, path | {id(node)}) for c in children)
    return sizes[id(node)]


def read_yaml(text: str, source: str) -> Any:
    loader = _StrictLoader(text)
    loader.source = source
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            size = _expanded_size(node, {})
        except ValueError as e:
            raise ConfigError(source, [f"{e} (a recursive YAML alias); write the value out"]) from e
        if size > MAX_YAML_VALUES:
            raise ConfigError(
                source,
                [
                    f"YAML aliases expand to {size:,} values (more than {MAX_YAML_VALUES:,}): an alias "
                    "bomb, or aliases nested too deep; write the values out instead"
                ],
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def resolve_data_paths(data: dict, folder: Path) -> None:
    """Relative dataset and golden-prompt paths start at the config file's folder (a pod runs with
    the image's working directory, not the one the config was written in). A path found only from
    the current folder keeps working as before."""

    def resolve(value):
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute() or "://" in value:
            return value  # a URL (s3://, hf://datasets/...) is no path beside the config
        beside = folder / value
        return str(beside) if beside.exists() or not Path(value).exists() else value

    for group in ("datasets", "eval_datasets"):
        for spec in data.get(group) or []:
            if isinstance(spec, dict) and "path" in spec:
                spec["path"] = resolve(spec["path"])
    if "golden_prompts" in data:
        data["golden_prompts"] = resolve(data["golden_prompts"])
