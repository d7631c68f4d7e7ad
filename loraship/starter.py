"""Starter configs: `loraship init` from a base model and a dataset (row type read from the rows),
or from an Axolotl YAML (the keys that map, each ignored key named)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, get_args

from loraship.errors import ConfigError, LorashipError
from loraship.plan_report import artifact_words


def model_config_of(config) -> dict:
    from loraship.models import read_model_config, resolve_base_model

    # config.json is all the planner reads: a 14B model need not be downloaded to plan it. Read as the
    # plan stage reads it: a list, a string or missing keys are one clear error, not a traceback.
    return read_model_config(resolve_base_model(config, weights=False))


def dataset_types() -> tuple[str, ...]:
    from loraship.config import DatasetSpec

    return get_args(DatasetSpec.model_fields["type"].annotation)


def detect_dataset_type(path: Path, sample: int = 200) -> str:
    """chat (messages), sharegpt (conversations/from/value), alpaca or completion, from the rows themselves."""
    from loraship.dataset_files import compressed_name_problem, open_text

    if not path.is_file():
        raise LorashipError(f"dataset {path}: file not found; pass a JSONL file with one example per line")
    kinds: dict[str, int] = {}
    try:
        with open_text(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise LorashipError(
                        f"dataset {path} line {number}: malformed JSON ({e.msg}); one JSON object per line (JSONL)"
                    ) from e
                keys = set(row) if isinstance(row, dict) else set()
                kind = (
                    "chat"
                    if "messages" in keys
                    else "sharegpt"
                    if "conversations" in keys
                    else "alpaca"
                    if {"instruction", "output"} <= keys
                    else "completion"
                    if "text" in keys
                    else None
                )
                if kind is None:
                    raise LorashipError(
                        f"dataset {path} line {number}: cannot tell the row type from its keys {sorted(keys)}; rows "
                        "need 'messages' (chat), 'conversations' (ShareGPT), 'instruction'+'output' (alpaca) or "
                        "'text' (completion)"
                    )
                kinds.setdefault(kind, number)
                if len(kinds) > 1:
                    (a, la), (b, lb) = list(kinds.items())[:2]
                    raise LorashipError(
                        f"dataset {path}: line {la} is a {a} row but line {lb} a {b} row; keep one row "
                        "type per file (split it into two datasets)"
                    )
                if number >= sample:
                    break
    except UnicodeDecodeError as e:
        with open(path, "rb") as f:
            compressed = compressed_name_problem(f.read(8), path)
        plain = f"dataset {path}: not UTF-8 ({e.reason}); re-encode the file as UTF-8"
        raise LorashipError(compressed or plain) from e
    if not kinds:
        raise LorashipError(f"dataset {path}: empty; add at least one example")
    return next(iter(kinds))


def _dataset_entry(
    path: Path | str,
    kind: str,
    config_dir: Path,
    notes: list[str],
    force: bool,
    fields: dict[str, str] | None = None,
    split: str | None = None,
) -> dict:
    """A datasets[] entry for the config in config_dir, its rows read now (every bad one named) rather than at plan
    time."""
    from loraship.config import DatasetSpec
    from loraship.data import hub_dataset_id, read_dataset

    local = hub_dataset_id(str(path)) is None
    entry = {"path": os.path.relpath(Path(path).resolve(), config_dir.resolve()) if local else str(path), "type": kind}
    entry.update({"fields": fields} if fields else {})
    entry.update({"split": split} if split and not local else {})
    read_dataset(DatasetSpec(**{**entry, "path": str(path)}))
    notes.append(f"{path}: {kind} rows" + (f" (fields {fields})" if fields else ""))
    return entry


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        # A tokenizer_config.json of the wrong shape is the plan stage's to name (loraship/models.py).
        return isinstance(data, dict) and bool(data.get("chat_template"))
    return False


# A base model's native chat formats, known by their turn markers among its special tokens, in the order tried:
# (named template in loraship/chat.py NAMED_TEMPLATES, the markers, the words for init's note).
NATIVE_FORMATS = (
    ("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "Llama 3's header tokens and <|eot_id|>"),
    ("chatml", ("<|im_start|>", "<|im_end|>"), "ChatML's <|im_start|> and <|im_end|> (Qwen)"),
    ("gemma", ("<start_of_turn>", "<end_of_turn>"), "Gemma's turn markers <start_of_turn> and <end_of_turn>"),
    ("phi3", ("<|user|>", "<|assistant|>", "<|end|>"), "Phi-3's <|user|>, <|assistant|> and <|end|>"),
)


def template_for_base(folder: Path, row_type: str, trust_remote_code: bool = False) -> tuple[str, str]:
    """The base model's native chat format, read from its own special tokens (NATIVE_FORMATS: Llama 3's headers and
    <|eot_id|>, ChatML's <|im_start|>/<|im_end|>, Gemma's <start_of_turn>/<end_of_turn>, Phi-3's <|user|>/<|end|>;
    Mistral's [INST] turns ended by its EOS), so every assistant turn ends in one special token of this vocabulary;
    else alpaca, each answer ended by the base's EOS; never a plain-text marker no runtime stops on. (name, why)."""
    from transformers import AutoTokenizer

    from loraship.chat import special_tokens

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    special = set(special_tokens(tokenizer).values())
    for name, markers, words in NATIVE_FORMATS:
        if set(markers) <= special:
            ids = ", ".join(f"{m} ({tokenizer.convert_tokens_to_ids(m)})" for m in markers)
            return name, f"{words} are special tokens of its vocabulary: {ids}"
    if tokenizer.eos_token is None:
        raise LorashipError(
            f"base model {folder}: its tokenizer has no EOS and no turn-end special token, so no chat "
            "template can end a turn where a runtime stops; set chat_template: to a template ending "
            "assistant turns with one of its special tokens, or train on completion rows"
        )
    if {"[INST]", "[/INST]"} <= special or "mistral" in json.loads((folder / "config.json").read_text()).get(
        "model_type", ""
    ):
        return "mistral", f"Mistral's [INST] turns, each answer ended by the EOS {tokenizer.eos_token!r}"
    if row_type == "alpaca":
        return (
            "alpaca",
            f"instruction rows and no turn markers among its special tokens; each response ends with "
            f"the EOS {tokenizer.eos_token!r}",
        )
    return "alpaca", f"no turn markers among its special tokens; each answer ends with the EOS {tokenizer.eos_token!r}"


def starter_config(
    base_model: str, dataset: Path, out_file: Path, gpu_gib: float | None, force: bool
) -> tuple[dict, list[str]]:
    """Config keys for a base model and a dataset, and what was inferred (for the header)."""
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy import plan_training
    from loraship.config import Config, parse_config
    from loraship.planning.inference_memory import gpu_total_gib
    from loraship.models import resolve_base_model

    notes: list[str] = []
    kind = detect_dataset_type(dataset)
    entry = _dataset_entry(dataset, kind, out_file.parent, notes, force)
    defaults = {k: Config.model_fields[k].default for k in ("adapter", "lora_r", "lora_alpha", "lora_dropout")}
    data: dict[str, Any] = {
        "base_model": base_model,
        "datasets": [entry],
        **defaults,
        "lora_target_modules": "all-linear",
    }
    # Resolved against the config's folder, as load_config will.
    config = parse_config(
        {**data, "datasets": [{**entry, "path": str(out_file.parent / entry["path"])}]}, source="starter config"
    )
    folder = resolve_base_model(config, weights=False)
    model_config = model_config_of(config)
    if entry["type"] != "completion":
        if _has_chat_template(folder):
            notes.append(f"{base_model}: has a chat template; training and the GGUF use it")
        else:
            data["chat_template"], why = template_for_base(folder, entry["type"], config.trust_remote_code)
            notes.append(f"{base_model}: no chat template, so chat_template: {data['chat_template']} ({why})")
    max_positions = model_config.get("max_position_embeddings")
    data["sequence_len"] = min(Config.model_fields["sequence_len"].default, max_positions or 10**9)
    found = gpu_total_gib()
    data["gpu_memory_gib"] = gpu_gib or (round(found, 1) if found else Config.model_fields["gpu_memory_gib"].default)
    notes.append(
        f"training GPU: {data['gpu_memory_gib']:g} GiB ("
        + (
            "--gpu-gib"
            if gpu_gib
            else "this machine's GPU"
            if found
            else "no GPU here; the default, change gpu_memory_gib to your card's"
        )
        + ")"
    )
    try:
        planned = plan_training(
            shape_from_config(model_config), parse_config({**data, "datasets": config.model_dump()["datasets"]})
        )
        if planned["strategy"]["adapter"] != data["adapter"]:
            data["adapter"] = planned["strategy"]["adapter"]
        notes.append(f"memory plan: {planned['reason']}")
    except LorashipError as e:
        notes.append(f"memory plan: {e}")
    except (ValueError, KeyError) as e:
        notes.append(f"memory plan: config.json not understood by the planner ({e})")
    return data, notes


def write_config(out_file: Path, data: dict, notes: list[str], warnings: list[str], force: bool) -> None:
    import yaml

    from loraship.config import load_config
    from loraship.runtime.manifest import atomic_write_text

    header = [
        f"# Written by `loraship init`. Run with:  loraship run {out_file}",
        "# Keys not set here take the defaults described in loraship/config.py.",
        *(f"#   {n}" for n in notes),
        *(f"#   ignored: {w}" for w in warnings),
    ]
    text = (
        "\n".join(line.replace("\n", " ") for line in header)
        + "\n"
        + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120)
    )
    if out_file.exists() and not force:
        raise LorashipError(f"{out_file} exists; choose another file with -o, or pass --force to overwrite it")
    atomic_write_text(out_file, text)
    load_config(out_file)  # the file it wrote loads, or the user hears why now


# Axolotl keys with the same meaning and name in loraship's config.
AXOLOTL_SAME = (
    "base_model",
    "trust_remote_code",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "sequence_len",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "weight_decay",
    "num_epochs",
    "max_steps",
    "seed",
    "gradient_checkpointing",
    "save_steps",
    "logging_steps",
    "val_set_size",
)
# Axolotl chat_template names with a loraship equivalent (loraship/chat.py NAMED_TEMPLATES).
AXOLOTL_TEMPLATES = {"chatml": "chatml", "llama3": "llama3", "alpaca": "alpaca"}
# Optimizers that are loraship's own (torch AdamW).
ADAMW = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"}
# bitsandbytes' 8-bit AdamW under Axolotl's (transformers' optim) names; loraship's optimizer: adamw_8bit.
ADAMW_8BIT = {"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"}
AXOLOTL_DATASET_KEYS = {
    "path",
    "type",
    "ds_type",
    "split",
    "field_messages",
    "message_property_mappings",
    "message_field_role",
    "message_field_content",
    "field",
    "field_instruction",
    "field_input",
    "field_output",
    "roles_to_train",
    "train_on_eos",
}


def _axolotl_dataset(
    spec,
    where: str,
    source: Path,
    out_dir: Path,
    problems: list[str],
    ignored: list[str],
    notes: list[str],
    force: bool,
) -> dict | None:
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        problems.append(f"{where}: needs a 'path' (a local JSONL file)")
        return None
    ignored += [f"{where}.{k}" for k in spec if k not in AXOLOTL_DATASET_KEYS]
    kind, axolotl_type = None, spec.get("type")
    roles = spec.get("message_property_mappings") or {}
    role_key = roles.get("role", spec.get("message_field_role", "role"))
    content_key = roles.get("content", spec.get("message_field_content", "content"))
    messages_key = spec.get("field_messages", "messages")
    fields: dict[str, str] = {}
    if axolotl_type == "alpaca":
        kind = "alpaca"
        fields = {
            name: spec[f"field_{name}"] for name in ("instruction", "input", "output") if spec.get(f"field_{name}")
        }
    elif axolotl_type == "completion":
        kind, fields = "completion", ({"text": spec["field"]} if spec.get("field", "text") != "text" else {})
    elif axolotl_type == "sharegpt" or (
        axolotl_type == "chat_template" and (role_key, content_key) == ("from", "value")
    ):
        kind = "sharegpt"
        fields = {"conversations": messages_key} if messages_key not in ("conversations", "messages") else {}
    elif axolotl_type == "chat_template":
        kind = "chat"
        fields = {
            name: key
            for name, key in (("messages", messages_key), ("role", role_key), ("content", content_key))
            if key != name
        }
    if kind is None:
        problems.append(
            f"{where}: type {axolotl_type!r} has no loraship equivalent; use alpaca, completion, "
            "chat_template or sharegpt, converting the file if needed"
        )
        return None
    from loraship.data import hub_dataset_id

    path: Path | str = Path(spec["path"]).expanduser()
    if not path.is_absolute():
        path = (source.parent / path) if (source.parent / path).exists() else path
    if not Path(path).is_file():
        if hub_dataset_id(spec["path"]) is None:
            problems.append(
                f"{where}.path {spec['path']!r}: not a local file nor a Hub dataset id; point path at a "
                ".jsonl/.json/.parquet/.csv file or an '<org>/<name>' Hub dataset"
            )
            return None
        path = spec["path"]
    try:
        return _dataset_entry(path, kind, out_dir, notes, force, fields, spec.get("split"))
    except LorashipError as e:
        problems.append(f"{where}: {e}")
        return None


def import_axolotl(source: Path, out_file: Path, force: bool) -> tuple[dict, list[str], list[str]]:
    """loraship config keys from an Axolotl YAML: (keys, notes, ignored Axolotl keys). Raises
    ConfigError listing every value that cannot be converted."""
    from loraship.config import Config
    from loraship.config_yaml import read_yaml

    if not source.is_file():
        raise LorashipError(f"{source}: file not found; pass the Axolotl YAML config")
    try:
        ax = read_yaml(source.read_text(encoding="utf-8"), str(source))
    except UnicodeDecodeError as e:
        raise LorashipError(f"{source}: not UTF-8 text; save it as UTF-8") from e
    except Exception as e:  # yaml.YAMLError
        if isinstance(e, LorashipError):
            raise
        raise LorashipError(f"{source}: not valid YAML ({e})") from e
    if not isinstance(ax, dict):
        raise LorashipError(f"{source}: expected a mapping of Axolotl keys, got {type(ax).__name__}")
    data: dict[str, Any] = {}
    problems: list[str] = []
    ignored: list[str] = []
    notes: list[str] = [f"imported from the Axolotl config {source}"]
    for key, value in ax.items():
        if key in AXOLOTL_SAME:
            data[key] = value
        elif key == "adapter":
            if value not in ("lora", "qlora"):
                problems.append(
                    f"adapter {value!r}: loraship trains LoRA or QLoRA adapters only; set adapter: lora or qlora"
                )
            else:
                data.setdefault("adapter", value)
        elif key == "load_in_4bit":
            if value:
                data["adapter"] = "qlora"
        elif key == "lora_target_linear":
            if value:
                data["lora_target_modules"] = "all-linear"
        elif key == "revision_of_model":
            data["base_model_revision"] = value
        elif key == "sample_packing":
            data["packing"] = "on" if value else "off"
        elif key == "chat_template":
            if value == "jinja":
                if not ax.get("chat_template_jinja"):
                    problems.append("chat_template: jinja needs chat_template_jinja (the template text)")
                data["chat_template"] = ax.get("chat_template_jinja")
            elif value in AXOLOTL_TEMPLATES:
                data["chat_template"] = AXOLOTL_TEMPLATES[value]
            elif value != "tokenizer_default":
                problems.append(
                    f"chat_template {value!r}: no loraship equivalent; use tokenizer_default (the base model's), "
                    f"{', '.join(AXOLOTL_TEMPLATES)}, or jinja with chat_template_jinja"
                )
        elif key in ("datasets", "test_datasets"):
            target = "datasets" if key == "datasets" else "eval_datasets"
            if not isinstance(value, list) or not value:
                problems.append(f"{key}: expected a non-empty list of {{path, type}}")
                continue
            entries = [
                _axolotl_dataset(spec, f"{key}[{i}]", source, out_file.parent, problems, ignored, notes, force)
                for i, spec in enumerate(value)
            ]
            data[target] = [e for e in entries if e]
        elif key == "optimizer" and value in ADAMW:
            pass  # loraship's default optimizer is torch AdamW
        elif key == "optimizer" and value in ADAMW_8BIT:
            data["optimizer"] = "adamw_8bit"
        elif key == "chat_template_jinja" or (key == "base_model_config" and value == ax.get("base_model")):
            pass  # read with chat_template / the same as base_model
        elif key in Config.model_fields and key not in ("datasets", "eval_datasets"):
            data[key] = value  # a key loraship shares with Axolotl by name
        else:
            ignored.append(key)
    if "base_model" not in data:
        problems.append("base_model: missing; Axolotl configs name the base model in base_model")
    if "datasets" not in ax:
        problems.append("datasets: missing; list the training data as datasets: [{path, type}]")
    if problems:
        raise ConfigError(f"{source} (Axolotl)", problems)
    if "lora_target_modules" not in data:
        data["lora_target_modules"] = "all-linear"
        notes.append("lora_target_modules: all-linear (the Axolotl file names none)")
    return data, notes, ignored


def init_config(
    base_model: str | None,
    dataset: Path | None,
    output: Path,
    from_axolotl: Path | None,
    gpu_gib: float | None,
    force: bool,
) -> tuple[list[str], list[str]]:
    """`loraship init`: a starter config from BASE_MODEL and DATASET or from an Axolotl file, checked as a config
    before it is written to `output`; returns the notes to print and the Axolotl keys ignored."""
    if output.exists() and not force:
        raise LorashipError(f"{output} exists; choose another file with -o, or pass --force to overwrite it")
    if from_axolotl is not None:
        if base_model or dataset:
            raise LorashipError(
                "--from-axolotl takes the base model and data from the Axolotl file; pass either "
                "BASE_MODEL DATASET or --from-axolotl FILE"
            )
        data, notes, ignored = import_axolotl(from_axolotl, output, force)
        if gpu_gib:
            data["gpu_memory_gib"] = gpu_gib
    elif base_model and dataset:
        data, notes = starter_config(base_model, dataset, output, gpu_gib, force)
        ignored = []
    else:
        raise LorashipError(
            "init needs BASE_MODEL and DATASET (e.g. loraship init Qwen/Qwen2.5-0.5B-Instruct "
            "train.jsonl), or --from-axolotl FILE"
        )
    from loraship.config import parse_config

    # Checked before writing; run_name as load_config will default it, from the file's name.
    config = parse_config(
        {"run_name": output.stem, **data}, source=f"{from_axolotl} (Axolotl)" if from_axolotl else "starter config"
    )
    notes.append(f"artifact: {artifact_words(config)}")
    output.parent.mkdir(parents=True, exist_ok=True)
    write_config(output, data, notes, ignored, force)
    return notes, ignored
