"""Finding the base model: a local folder, or a hub id resolved with huggingface_hub at run time."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from loraship.config import Config
from loraship import prequantized
from loraship.errors import ConfigError, LorashipError
from loraship.safetensors_check import read_header, safetensors_problem

# What `plan` needs; training needs the weights too.
METADATA_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
    "*.model",
]
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
            f"base_model {config.base_model!r}: could not fetch it from the Hugging Face hub ({type(e).__name__}: "
            f"{e}); check the id and HF_TOKEN, or point base_model at a local folder"
        ) from e


# Keys of config.json that the planner, transformers and llama.cpp's converter read as numbers; a list or
# a string there fails deep inside them (TypeError, AttributeError) instead of with a message.
CONFIG_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
REPLACE = "replace it with the file from the original checkpoint (its Hugging Face repository)"


def _kind(value) -> str:
    """JSON's name for a parsed value's type: 'a list', 'a string', 'the number 3'."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"the number {value}"
    return {list: "a list", str: "a string", dict: "an object"}[type(value)]


def _token_ids_problem(data: dict, key: str) -> str | None:
    """A token id key holds an id, a list of ids (eos of chat models), or null. Negative ids are let through:
    some published configs say pad_token_id -1 for "none", and transformers reads it so."""
    value = data.get(key)
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return f"'{key}' is {json.dumps(value)[:60]}, not a token id or a list of token ids"
    return None


def _config_json_problems(data: dict) -> list[str]:
    problems = []
    archs = data.get("architectures")
    if archs is not None and not (isinstance(archs, list) and archs and all(isinstance(a, str) and a for a in archs)):
        problems.append(
            f"'architectures' is {json.dumps(archs)[:60]}, not a list of model class names "
            'such as ["LlamaForCausalLM"]'
        )
    if not isinstance(data.get("model_type"), str) or not data["model_type"]:
        problems.append(
            "'model_type' is missing or not a name (such as \"llama\"); transformers and the planner "
            "pick the architecture by it"
        )
    text = data.get("text_config")
    if text is not None and not isinstance(text, dict):
        problems.append(f"'text_config' is {_kind(text)}, not an object")
    for where, block in (("", data), ("text_config.", text if isinstance(text, dict) else {})):
        for key in CONFIG_SIZES:
            value = block.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                problems.append(f"'{where}{key}' is {json.dumps(value)[:60]}, not a positive whole number")
    tie = data.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        problems.append(f"'tie_word_embeddings' is {json.dumps(tie)[:60]}, not true or false")
    if data.get("auto_map") is not None and not isinstance(data["auto_map"], dict):
        problems.append(f"'auto_map' is {_kind(data['auto_map'])}, not an object")
    problems += filter(None, (_token_ids_problem(data, k) for k in TOKEN_ID_KEYS))
    return problems


def _tokenizer_config_problems(data: dict) -> list[str]:
    problems = []
    template = data.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template
    )
    if template is not None and not isinstance(template, str) and not named:
        problems.append(
            f"'chat_template' is {_kind(template)}, not a Jinja template string (or a list of "
            "{name, template} objects)"
        )
    for key in SPECIAL_TOKEN_KEYS:
        value = data.get(key)
        if (
            value is not None
            and not isinstance(value, str)
            and not (isinstance(value, dict) and isinstance(value.get("content"), str))
        ):
            problems.append(f"'{key}' is {_kind(value)}, not a token string (or an object with its 'content')")
    added = data.get("added_tokens_decoder")
    if added is not None and not (
        isinstance(added, dict)
        and all(isinstance(v, dict) and isinstance(v.get("content"), str) for v in added.values())
    ):
        problems.append("'added_tokens_decoder' is not an object mapping token ids to {\"content\": ...} objects")
    return problems


def _generation_config_problems(data: dict) -> list[str]:
    return list(filter(None, (_token_ids_problem(data, k) for k in TOKEN_ID_KEYS)))


def _tokenizer_json_problems(data: dict) -> list[str]:
    model = data.get("model")
    return [] if model is None or isinstance(model, dict) else [f"'model' is {_kind(model)}, not an object"]


# The model folder's JSON files and what each must hold: (name, required, check of its object).
MODEL_JSON_FILES = (
    ("config.json", True, _config_json_problems),
    ("tokenizer_config.json", False, _tokenizer_config_problems),
    ("generation_config.json", False, _generation_config_problems),
    ("special_tokens_map.json", False, lambda data: []),
    ("tokenizer.json", False, _tokenizer_json_problems),
)


def json_file_problems(path: Path, check=lambda data: [], fix: str = REPLACE) -> tuple[dict | None, list[str]]:
    """The JSON object in `path` and what is wrong with it (not JSON, not an object, keys of the wrong type),
    each problem naming the file and the fix."""
    try:
        data = cached_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, [f"{path.name} is not valid JSON ({e}); {fix}"]
    if not isinstance(data, dict):
        return None, [f"{path.name} holds {_kind(data)}, not a JSON object of settings; {fix}"]
    return data, [f"{path.name}: {p}; {fix}" for p in check(data)]


def config_json(folder: Path) -> dict:
    """A model folder's config.json (cached_json)."""
    return cached_json(Path(folder) / "config.json")


def cached_json(path: Path):
    """A JSON file parsed once per process while it is unchanged (path, mtime, size): a stage asks a model's
    config.json of several checks. Each caller gets its own copy. Raises what reading and json.loads raise."""
    import copy

    st = path.stat()
    return copy.deepcopy(_parsed_json(str(Path(path).resolve()), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=16)
def _parsed_json(path: str, _mtime_ns: int, _size: int):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_model_config(folder: Path) -> dict:
    """The folder's config.json as a dict, or a ConfigError naming what is wrong with it and the fix: what the
    planner reads it with (plan stage, `loraship plan`, `loraship init`) must not meet a list or a string."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"base model {str(folder)!r}",
            ["no config.json; this does not look like a Hugging Face model folder; point base_model at one"],
        )
    data, problems = json_file_problems(path, _config_json_problems)
    if problems:
        raise ConfigError(f"base model {str(folder)!r}", problems)
    return data


def model_json_problems(folder: Path) -> list[str]:
    """Every problem of the model folder's JSON files (config, tokenizer and generation settings), at once."""
    problems = []
    for name, required, check in MODEL_JSON_FILES:
        if not (folder / name).is_file():
            if required:
                problems.append(f"no {name}; this does not look like a Hugging Face model folder")
            continue
        problems += json_file_problems(folder / name, check)[1]
    return problems


def base_model_problems(config: Config, folder: Path, weights: bool = True) -> list[str]:
    """Everything wrong with a base model folder, listed at once."""
    where = f"base_model {str(folder)!r}"
    if not folder.is_dir():
        from loraship.planning.model_kind import gguf_problem

        named = (
            gguf_problem(folder)
            or ("a file, not a folder" if folder.exists() else "folder does not exist")
            + "; point base_model at a folder holding config.json, a tokenizer and *.safetensors"
        )
        return [f"{where}: {named}"]
    from loraship.planning.model_kind import gguf_folder_problem

    gguf = gguf_folder_problem(folder)
    if gguf:
        return [f"{where}: {gguf}"]
    problems = [f"{where}: {p}" for p in model_json_problems(folder)]
    model_config = json_file_problems(folder / "config.json")[0] if (folder / "config.json").is_file() else None
    if model_config and model_config.get("auto_map") and not config.trust_remote_code:
        problems.append(
            f"{where}: config.json asks for custom model code (auto_map); loraship does not run it unless "
            "you set trust_remote_code: true"
        )
    problems += [f"{where}: {p}" for p in prequantized.problems(model_config, config.adapter, folder)]
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"{where}: no tokenizer (tokenizer.json or tokenizer.model); copy the tokenizer files into the folder"
        )
    problems += [f"{where}: {p}" for p in sentencepiece_problems(folder)]
    if weights:
        safetensors = list(folder.glob("*.safetensors"))
        pickles = [p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES] if folder.is_dir() else []
        if not safetensors and pickles and not config.allow_pickle:
            problems.append(
                f"{where}: only pickle checkpoints ({', '.join(sorted(p.name for p in pickles))}); pickle can run "
                "code on load. Convert to safetensors, or set allow_pickle: true if you trust the source"
            )
        elif not safetensors and not pickles:
            problems.append(f"{where}: no weights (*.safetensors)")
        problems += [f"{where}: {p}" for p in shard_index_problems(folder)]
        problems += [p for p in map(safetensors_problem, safetensors) if p]
        if model_config is not None and not problems:
            problems += embedding_problems(config, folder, model_config)
    return problems


SHARD_INDEX_FIX = "fix: download the index again with its shards (or the whole checkpoint)"


def shard_index_problems(folder: Path) -> list[str]:
    """A sharded checkpoint's model.safetensors.index.json must be JSON whose weight_map names shards that are all
    in the folder: transformers reads it at train and stops with a JSONDecodeError or FileNotFoundError traceback."""
    problems = []
    for index in sorted(folder.glob("*.safetensors.index.json")):
        data, found = json_file_problems(index, fix=SHARD_INDEX_FIX)
        problems += found
        if data is None:
            continue
        weight_map = data.get("weight_map")
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items())
        ):
            problems.append(
                f"{index.name}: 'weight_map' is {json.dumps(weight_map)[:60]}, not an object mapping "
                f"tensor names to shard files; {SHARD_INDEX_FIX}"
            )
            continue
        root = folder.resolve()
        shards = sorted(set(weight_map.values()))
        outside = [s for s in shards if not (root / s).resolve().is_relative_to(root)]
        if outside:  # a name such as ../../x would make transformers read a file outside the model folder
            problems.append(f"{index.name} names {outside[0]!r}, outside {folder}; {SHARD_INDEX_FIX}")
            continue
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            present = len(shards) - len(missing)
            problems.append(
                f"{index.name} names {named}, {'which is' if len(missing) == 1 else 'which are'} not in "
                f"{folder} ({present} of the {len(shards)} shards it names {'is' if present == 1 else 'are'} "
                "there); fix: download the missing shard or the whole checkpoint again"
            )
    return problems


def sentencepiece_problems(folder: Path) -> list[str]:
    """A tokenizer.model that sentencepiece cannot load: llama.cpp's converter loads it (after train, merge and
    reference) even where transformers reads tokenizer.json, so a truncated download is found here instead.
    Loading parses the protobuf (milliseconds); a model cut short anywhere does not parse (tests/test_plan_checks.py
    cuts one at many places)."""
    path = folder / "tokenizer.model"
    if not path.is_file():
        return []
    try:
        import sentencepiece
    except ImportError as e:
        return [
            f"tokenizer.model cannot be read without sentencepiece ({e}); fix: pip install sentencepiece "
            "protobuf (both in loraship[train])"
        ]
    try:
        sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError or OSError, with C++ text
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        return [
            f"tokenizer.model ({path.stat().st_size} bytes) does not load in sentencepiece ({reason}); it is "
            f"truncated or not a sentencepiece model; fix: {REPLACE}"
        ]
    return []


# The names transformers gives the input embedding and the output layer in every architecture the planner
# knows (memory.SUPPORTED: Llama, Qwen2, Mistral, Gemma 2, Phi-3); llama.cpp's converter maps them to token_embd
# and output.
EMBED_TOKENS, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def embedding_only_as_lm_head(folder: Path) -> bool:
    """Whether the checkpoint stores its embedding only under lm_head.weight (no model.embed_tokens.weight).

    transformers loads such a tied checkpoint (tying fills the embedding from the output layer), but llama.cpp's
    converter maps tensors by name: it writes no token_embd.weight, and llama.cpp cannot load that GGUF. Read from
    the safetensors headers alone."""
    names: set[str] = set()
    for shard in weight_files(folder):
        try:
            names |= set(read_header(shard)[1]) - {"__metadata__"}
        except (OSError, ValueError):
            return False  # safetensors_problem names a header that cannot be read
    return LM_HEAD in names and EMBED_TOKENS not in names


def ties_embeddings(model_config: dict) -> bool:
    """Whether the output layer is the input embedding in the model transformers builds from config.json
    (loraship/planning/shape.py: tie_word_embeddings, else the class's default, e.g. tied for Gemma 2 and 3; a
    multimodal config's language model). Where the planner cannot build it, config.json's tie_word_embeddings."""
    from loraship.planning.shape import shape_from_config

    try:
        return shape_from_config(model_config, check_converter=False).tied
    except ValueError:  # the plan refuses such a config.json with its own words
        return model_config.get("tie_word_embeddings", model_config.get("model_type") == "gemma2") is True


def embedding_problems(config: Config, folder: Path, model_config: dict) -> list[str]:
    """A checkpoint whose embedding is stored only as lm_head.weight: the merge stage writes it under its own name
    when the two are tied; what it cannot mend is refused here, before any training."""
    if not embedding_only_as_lm_head(folder):
        return []
    where = f"base_model {str(folder)!r}"
    if not ties_embeddings(model_config):
        return [
            f"{where}: the weights have {LM_HEAD} but no {EMBED_TOKENS}, and config.json does not tie the two "
            "(tie_word_embeddings is not true), so the model would start from a random embedding; use the "
            "checkpoint's complete weights"
        ]
    if config.adapter_gguf:
        return [
            f"{where}: the tied embedding is stored only as {LM_HEAD} (no {EMBED_TOKENS}); adapter_gguf converts "
            "this base as it is, and llama.cpp's converter would write a GGUF without token_embd.weight that "
            "llama.cpp cannot load. Set adapter_gguf: false (the merged model is written with the embedding "
            "under its own name), or re-save the base with transformers' save_pretrained, which stores it as "
            f"{EMBED_TOKENS}"
        ]
    return []


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
