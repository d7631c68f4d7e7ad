"""What base_model names, asked before its files are read as a checkpoint, so that a wrong kind of model is refused
with one message naming it and the fix, not with the messages of the checks that would stumble on it later (a
missing folder, a chat template, an unknown token): a GGUF file, an encoder, an encoder-decoder."""

from __future__ import annotations

from pathlib import Path

GGUF_MAGIC = b"GGUF"
# Where converters record the checkpoint a GGUF was made from (gguf-py's Keys.General), most specific first.
GGUF_SOURCE_KEYS = (
    "general.source.huggingface.repository",
    "general.base_model.0.repo_url",
    "general.source.repo_url",
    "general.source.url",
    "general.base_model.0.name",
)


def _gguf_facts(path: Path) -> tuple[str, str | None]:
    """('gemma3, Q4_K_M', 'https://huggingface.co/google/gemma-3-270m') from the header, as far as it can be read."""
    from loraship.errors import LorashipError
    from loraship.llamacpp.gguf_info import read_gguf

    try:
        fields = read_gguf(path)["fields"]
    except LorashipError:
        return "its header does not read", None
    from gguf import Keys, LlamaFileType

    arch = fields.get(Keys.General.ARCHITECTURE)
    file_type = fields.get(Keys.General.FILE_TYPE)
    try:
        kind = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        kind = f"file type {file_type}"
    facts = ", ".join(str(x) for x in (arch, kind) if x)
    source = next((str(fields[k]) for k in GGUF_SOURCE_KEYS if fields.get(k)), None)
    return facts or "no architecture in its header", source


def gguf_problem(path: Path) -> str | None:
    """base_model naming a GGUF file: loraship trains a Hugging Face checkpoint (safetensors) and writes the GGUF
    itself. A GGUF's weights are quantized (or F16 with the vocabulary rewritten for llama.cpp); training from one
    would fine-tune a dequantized copy and lose what the original tokenizer files carry, so it is refused."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return None
    if magic != GGUF_MAGIC:
        return None
    facts, source = _gguf_facts(path)
    from_ = f" (its header names {source})" if source else ""
    return (
        f"a GGUF file ({facts}), not a Hugging Face model folder; loraship trains from the original checkpoint "
        "(config.json, tokenizer, *.safetensors) and makes the GGUF itself; fix: point base_model at the Hub id or "
        f"the downloaded folder of the model this GGUF was converted from{from_}"
    )


def gguf_folder_problem(folder: Path) -> str | None:
    """A folder of GGUF files and no config.json (a downloaded '...-GGUF' repository): named as gguf_problem names
    the file."""
    if (folder / "config.json").exists():
        return None
    found = sorted(folder.glob("*.gguf"))
    problem = gguf_problem(found[0]) if found else None
    return f"holds {found[0].name}, {problem}" if problem else None


def architecture_problems(model_dir: Path) -> list[str]:
    """An encoder (BERT's masked LM, a classifier) or an encoder-decoder (T5): one message, the planner's."""
    from loraship.models import config_json
    from loraship.planning.shape import causal_lm_problem

    try:
        model_config = config_json(model_dir)
    except (OSError, ValueError):
        return []  # base_model_problems names a config.json it cannot read
    archs = model_config.get("architectures") if isinstance(model_config, dict) else None
    if (
        isinstance(archs, list)
        and archs
        and all(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs)
        and model_config.get("is_encoder_decoder") is not True
    ):
        return []  # a causal LM by its own name: no need to import transformers to ask
    problem = causal_lm_problem(model_config)
    return [f"base model {str(model_dir)!r}: {problem}"] if problem else []
