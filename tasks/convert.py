"""Convert: merged HF folder -> F16 GGUF with the pinned llama.cpp's convert_hf_to_gguf.py.

The converter runs in a subprocess with a timeout: a blocking native call cannot be
interrupted by a Prefect task timeout, and a crash there must not take
the flow with it. Output is written under a temporary name and renamed when complete.

The GGUF is named after the run, not after the folder it was converted from ("merged"): the
converter's `--metadata` override file sets general.name, basename, finetune, the base model
and, where the base model's card states one, the license. This stage also records, from the
merged tokenizer, what publish needs for Ollama (loraship/llamacpp/ollama.py): the chat-template family,
its default system prompt and the model's stop tokens.

A sentencepiece vocabulary gets the tokenizer.ggml.add_space_prefix with which llama.cpp tokenizes the
texts this run serves (chat or plain) as HF did in training (loraship/llamacpp/space_prefix.py): Mistral
7B v0.3's chat needs false where the converter writes llama.cpp's default, true. Phi-3's converter takes no
value from tokenizer_config, so its GGUF is copied once with the flag set (set_add_space_prefix).

With adapter_gguf it also writes the train stage's PEFT adapter alone as a GGUF LoRA (llama.cpp's
convert_lora_to_gguf.py) and the base model converted and quantized like the merged one, which
llama.cpp applies it to at run time (its LoRA matmul adds scale * B(A x) to the quantized base
weight's product, so the base need not be F16).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from loraship.constants import (
    ADAPTER_DIR,
    ADAPTER_GGUF,
    F16_GGUF,
    GGUF_KEY_CHAT_TEMPLATE,
    GGUF_KEY_FILE_TYPE,
    GGUF_METADATA_FILE,
    MERGED_DIR,
    OLLAMA_FILE,
    base_gguf_name,
)
from loraship.chat import set_template_kwargs, stop_ids, template_kwargs, template_of
from loraship.errors import IntegrityError, LorashipError
from loraship.llamacpp import space_prefix
from loraship.llamacpp.gguf_info import read_gguf, read_gguf_of_type
from loraship.llamacpp.llamacpp import converter_dir, lora_converter
from loraship.llamacpp.quantizing import check_loads, quantize
from loraship.runtime.manifest import atomic_write_json
from loraship.runtime.proc import write_with_tool
from loraship.runtime.progress import LlamaCppProgress, artifact_key
from loraship.planning.preflight import check_free_disk
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir

STAGE = "convert"
UPSTREAM = ("merge",)
FIELDS: tuple[str, ...] = ("run_name", "base_model", "base_model_revision", "adapter_gguf")
TIMEOUT_S = 4 * 3600
log = logging.getLogger("loraship.convert")


def convert(
    merged_dir: Path,
    out_file: Path,
    outtype: str = "f16",
    metadata: Path | None = None,
    progress_key: str | None = None,
    add_space_prefix: bool | None = None,
) -> None:
    """progress_key: the Prefect progress artifact's key (loraship/runtime/progress.py) inside a flow run.
    add_space_prefix: the value a sentencepiece GGUF must carry (space_prefix.choose), checked once written."""
    script = converter_dir() / "convert_hf_to_gguf.py"
    extra = ["--metadata", str(metadata)] if metadata else []
    progress = LlamaCppProgress(STAGE, log, key=progress_key)
    with space_prefix.converter_input(merged_dir, add_space_prefix) as source:
        write_with_tool(
            lambda tmp: [
                sys.executable,
                str(script),
                str(source),
                "--outfile",
                str(tmp),
                "--outtype",
                outtype,
                *extra,
            ],
            out_file,
            f"convert_hf_to_gguf.py on {merged_dir}",
            TIMEOUT_S,
            on_line=progress,
        )
    progress.close()
    if add_space_prefix is None:
        return
    written = space_prefix.gguf_value(read_gguf(out_file)["fields"])
    if written is not None and written != add_space_prefix:
        # The converter of this architecture does not take tokenizer_config's add_prefix_space (Phi-3's writes
        # its own sentencepiece vocabulary): the GGUF is copied once with the key set.
        set_add_space_prefix(out_file, add_space_prefix)
        written = space_prefix.gguf_value(read_gguf(out_file)["fields"])
    if written is not None and written != add_space_prefix:
        raise IntegrityError(
            f"{out_file}: tokenizer.ggml.add_space_prefix is {written}, but llama.cpp needs "
            f"{add_space_prefix} to tokenize this run's texts as HF did, and setting it in a copy "
            "of the GGUF did not take; do not ship it"
        )


# In a child process, with the converter's own gguf-py (its gguf_new_metadata.py puts it first on sys.path):
# copy the GGUF, every key and tensor as they are, with tokenizer.ggml.add_space_prefix set.
_SET_ADD_PREFIX = """
import importlib.util, sys
script, src, dst, value = sys.argv[1:]
spec = importlib.util.spec_from_file_location("gguf_new_metadata", script)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
gguf = tool.gguf
reader = gguf.GGUFReader(src, "r")
arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
tool.copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.ADD_PREFIX: tool.MetadataDetails(
    gguf.GGUFValueType.BOOL, value == "true")}, [])
"""


def set_add_space_prefix(gguf_path: Path, value: bool) -> None:
    """Rewrite gguf_path (atomically) with tokenizer.ggml.add_space_prefix = value."""
    script = converter_dir() / "gguf-py" / "gguf" / "scripts" / "gguf_new_metadata.py"
    write_with_tool(
        lambda tmp: [
            sys.executable,
            "-c",
            _SET_ADD_PREFIX,
            str(script),
            str(gguf_path),
            str(tmp),
            "true" if value else "false",
        ],
        gguf_path,
        f"setting tokenizer.ggml.add_space_prefix in {gguf_path.name}",
        TIMEOUT_S,
    )


def convert_adapter(adapter_dir: Path, base_dir: Path, out_file: Path, progress_key: str | None = None) -> None:
    """The PEFT adapter alone as a GGUF LoRA; base_dir gives the converter the architecture (config.json)."""
    script = lora_converter()
    progress = LlamaCppProgress(f"{STAGE} adapter", log, key=progress_key)
    write_with_tool(
        lambda tmp: [
            sys.executable,
            str(script),
            str(adapter_dir),
            "--base",
            str(base_dir),
            "--outfile",
            str(tmp),
            "--outtype",
            "f16",
        ],
        out_file,
        f"convert_lora_to_gguf.py on {adapter_dir}",
        TIMEOUT_S,
        on_line=progress,
    )
    progress.close()


def adapter_ggufs(config, ctx, progress_key: str | None, add_space_prefix: bool | None) -> dict:
    """adapter_gguf: the adapter GGUF and its base GGUF, read back; their facts for the manifest."""
    from gguf import Keys

    from loraship.models import check_base_model, resolve_base_model, weight_files

    base_dir = resolve_base_model(config, weights=True)
    check_base_model(config, base_dir)
    base_bytes = sum(p.stat().st_size for p in weight_files(base_dir))
    check_free_disk(ctx.dir, base_bytes * 1.65, "convert (base model GGUF for adapter_gguf)")  # F16 + quantized
    base_f16, base_out = ctx.dir / "base-F16.gguf", ctx.dir / base_gguf_name(config.primary_quantization)
    try:
        convert(base_dir, base_f16, progress_key=progress_key, add_space_prefix=add_space_prefix)
        quantize(base_f16, base_out, config.primary_quantization, progress_key=progress_key)
    finally:
        base_f16.unlink(missing_ok=True)  # a step on the way; the base ships quantized like the merged model
    base_info = read_gguf_of_type(base_out, config.primary_quantization)
    convert_adapter(ctx.upstream_dir("train") / ADAPTER_DIR, base_dir, ctx.dir / ADAPTER_GGUF, progress_key)
    fields = read_gguf(ctx.dir / ADAPTER_GGUF)
    if fields["fields"].get(Keys.General.TYPE) != "adapter" or fields["fields"].get(Keys.Adapter.TYPE) != "lora":
        raise LorashipError(
            f"{ctx.dir / ADAPTER_GGUF}: not a LoRA adapter GGUF (general.type "
            f"{fields['fields'].get(Keys.General.TYPE)!r}); run the convert stage again"
        )
    check_loads(base_out, lora=ctx.dir / ADAPTER_GGUF)  # the pair llama-server --lora would load
    return {
        "adapter_tensor_count": fields["tensor_count"],
        "adapter_bytes": (ctx.dir / ADAPTER_GGUF).stat().st_size,
        "lora_alpha": fields["fields"].get(Keys.Adapter.LORA_ALPHA),
        "base_tensor_count": base_info["tensor_count"],
        "base_bytes": base_out.stat().st_size,
    }


def base_label(base_model: str) -> str:
    """The base model's own name: the hub id's repository part, or the local folder's name."""
    return Path(base_model.rstrip("/")).name or base_model


def base_license(config) -> str | None:
    """The license in the base model's card (README.md front matter), or None when it states none
    or the card cannot be read (no README in a local folder, the hub unreachable or offline)."""
    from huggingface_hub import ModelCard

    if config.base_model_is_local():
        card_file = Path(config.base_model).expanduser() / "README.md"
        source = str(card_file) if card_file.is_file() else None
    else:
        source = config.base_model
    if source is None:
        return None
    try:
        card = ModelCard.load(source)  # a local README.md, or the hub repository's card
    except Exception as e:  # noqa: BLE001 - hub errors, offline mode, a card without front matter
        log.info("convert: no license from the base model's card (%s: %s)", type(e).__name__, e)
        return None
    value = card.data.to_dict().get("license")
    return ",".join(value) if isinstance(value, list) else value


def llama_cpp_name(name: str, tokenizer) -> str:
    """general.name as llama.cpp must read it. llama.cpp strips the whitespace after special tokens, as Phi-3's
    HF tokenizer does (rstrip), only where general.name holds "phi-3" or "phi3" (llama.cpp's src/llama-vocab.cpp):
    a Phi-3 from a folder of another name served every prompt with newlines the model never saw
    (tests/test_families.py's export checks), and such a name over a tokenizer that keeps them strips them."""
    rstrips = any(t.special and t.rstrip for t in getattr(tokenizer, "added_tokens_decoder", {}).values())
    says_phi3 = re.search(r"phi-?3", name, re.IGNORECASE) is not None
    if rstrips and not says_phi3:
        return f"{name}-phi-3"
    if says_phi3 and not rstrips:
        return re.sub(r"(phi-?)3", r"\g<1>_3", name, flags=re.IGNORECASE)
    return name


def gguf_metadata(config, tokenizer) -> dict:
    """The converter's metadata override (gguf-py's Metadata.load reads these keys)."""
    from gguf import Keys

    label = base_label(config.base_model)
    base = {"name": label}
    if not config.base_model_is_local():
        organization, _, _ = config.base_model.partition("/")
        base.update(organization=organization, repo_url=f"https://huggingface.co/{config.base_model}")
        if config.base_model_revision:
            base["version"] = config.base_model_revision
    metadata = {
        Keys.General.NAME: llama_cpp_name(f"{label}-{config.run_name}", tokenizer),
        Keys.General.BASENAME: label,
        Keys.General.FINETUNE: config.run_name,
        "general.base_models": [base],  # gguf-py's override key for general.base_model.{count,N.*}
    }
    license_id = base_license(config)
    if license_id:
        metadata[Keys.General.LICENSE] = license_id
    return metadata


def ollama_facts(tokenizer, merged_dir: Path) -> dict:
    """Chat-template family, default system prompt and stop tokens of the merged tokenizer."""
    from loraship.llamacpp import ollama

    stops = stop_ids(tokenizer, merged_dir)
    return {**ollama.recognise(tokenizer), "stop_ids": stops, "stop_tokens": tokenizer.convert_ids_to_tokens(stops)}


@exclusive
def run(config) -> dict:
    # adapter_gguf reads the train stage's adapter (only it, not the checkpoints) and quantizes the base.
    adapter = {"train": (ADAPTER_DIR,)} if config.adapter_gguf else {}
    # The base ships in the primary quantization only: adding another to the list does not convert again.
    ctx = open_stage(
        config,
        STAGE,
        UPSTREAM + tuple(adapter),
        FIELDS,
        extra_inputs={"adapter_base_quantization": config.primary_quantization} if adapter else None,
        consumes=adapter,
    )
    if ctx.done:
        return ctx.done
    reset_dir(ctx)
    merged = ctx.upstream_dir("merge") / MERGED_DIR
    merged_bytes = sum(p.stat().st_size for p in merged.glob("*.safetensors"))
    check_free_disk(ctx.dir, merged_bytes * 1.05, "convert (F16 GGUF)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    metadata = gguf_metadata(config, tokenizer)
    atomic_write_json(ctx.dir / GGUF_METADATA_FILE, metadata)
    # Rendered as trained (Qwen3's enable_thinking from `thinking:`), so the Modelfile's template renders that form.
    set_template_kwargs(tokenizer, template_kwargs(template_of(tokenizer), config.thinking))
    facts = ollama_facts(tokenizer, merged)
    atomic_write_json(ctx.dir / OLLAMA_FILE, facts)
    add_space_prefix, problem = space_prefix.choose(tokenizer, space_prefix.served_kinds(config))
    if problem:  # plan refuses such a run first (loraship/planning/preflight.py)
        raise LorashipError(f"run {config.run_name!r}: {problem}")
    out = ctx.dir / F16_GGUF
    progress_key = artifact_key(config.run_name, STAGE, "progress")
    convert(
        merged,
        out,
        metadata=ctx.dir / GGUF_METADATA_FILE,
        progress_key=progress_key,
        add_space_prefix=add_space_prefix,
    )
    info = read_gguf_of_type(out, "F16")
    check_loads(out)
    extra = {"adapter_gguf": adapter_ggufs(config, ctx, progress_key, add_space_prefix)} if config.adapter_gguf else {}
    from gguf import Keys

    return ctx.finish(
        {
            "tensor_count": info["tensor_count"],
            "file_type": info["fields"][GGUF_KEY_FILE_TYPE],
            "has_chat_template": bool(info["fields"].get(GGUF_KEY_CHAT_TEMPLATE)),
            "name": info["fields"].get(Keys.General.NAME),
            "ollama_template_family": facts.get("family"),
            "add_space_prefix": space_prefix.gguf_value(info["fields"]),
            "bytes": out.stat().st_size,
            **extra,
        }
    )


if __name__ == "__main__":
    main(run)
