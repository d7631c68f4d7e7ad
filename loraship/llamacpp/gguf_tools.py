"""A GGUF on its own: find it, describe it (metadata, tensors, template, special tokens), and the
llama.cpp-only checks `loraship verify GGUF` runs without a reference."""

from __future__ import annotations

import ctypes
from pathlib import Path

from gguf import Keys

from loraship.errors import LorashipError


def gguf_file(path: Path) -> Path:
    """The GGUF to read: the file itself, or inside an artifact folder the primary GGUF its
    manifest.json names (an artifact may ship several quantizations and an adapter), else its one .gguf."""
    if path.is_dir():
        primary = _primary_gguf(path)
        found = [primary] if primary is not None else sorted(path.glob("*.gguf"))
        if len(found) != 1:
            what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(p.name for p in found)})"
            raise LorashipError(
                f"{path}: folder with {what}; pass the .gguf file itself, e.g. artifacts/<run>/model-Q4_K_M.gguf"
            )
        path = found[0]
    if not path.is_file():
        raise LorashipError(
            f"{path}: file not found; pass the path of a .gguf file, e.g. artifacts/<run>/model-Q4_K_M.gguf"
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LorashipError(
            f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF'); pass the "
            ".gguf file a run shipped, e.g. artifacts/<run>/model-Q4_K_M.gguf"
        )
    return path


def _primary_gguf(folder: Path) -> Path | None:
    import json

    from loraship.constants import MANIFEST_NAME

    try:
        name = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8")).get("gguf")
    except (OSError, ValueError, AttributeError):
        return None
    return folder / name if isinstance(name, str) and (folder / name).is_file() else None


def _file_type_name(value) -> str:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return f"unknown ({value})"


def _token_text(fields: dict, token_id) -> str | None:
    tokens = fields.get(Keys.Tokenizer.LIST) or []
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def describe_gguf(path: Path) -> dict:
    """Metadata, tensor types and sizes, chat template and special tokens of a GGUF file."""
    from loraship.llamacpp.gguf_info import open_gguf, read_gguf

    reader = open_gguf(path)  # names a truncated or corrupt file
    fields = read_gguf(path, reader)["fields"]
    types: dict[str, dict] = {}
    for tensor in reader.tensors:
        row = types.setdefault(tensor.tensor_type.name, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += int(tensor.n_elements)
        row["bytes"] += int(tensor.n_bytes)
    metadata = {
        k: (f"[{len(v)} items]" if isinstance(v, list) and len(v) > 16 else v)
        for k, v in fields.items()
        if k != Keys.Tokenizer.CHAT_TEMPLATE
    }
    special = {}
    for key, value in fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            special[key.removeprefix("tokenizer.ggml.").removesuffix("_token_id")] = {
                "id": value,
                "text": _token_text(fields, value),
            }
    return {
        "file": str(path),
        "bytes": path.stat().st_size,
        "architecture": fields.get("general.architecture"),
        "name": fields.get("general.name"),
        "file_type": _file_type_name(fields.get(Keys.General.FILE_TYPE)),
        "tensor_count": len(reader.tensors),
        "parameters": sum(t["parameters"] for t in types.values()),
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"])),
        "special_tokens": special,
        "add_bos_token": fields.get(Keys.Tokenizer.ADD_BOS),
        "add_eos_token": fields.get(Keys.Tokenizer.ADD_EOS),
        "chat_template": fields.get(Keys.Tokenizer.CHAT_TEMPLATE),
        "metadata": metadata,
    }


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def special_text(llm, token: int | None) -> str:
    return (
        llm.detokenize([token], special=True).decode("utf-8", errors="replace")
        if token is not None and token >= 0
        else ""
    )


def chat_formatter(llm, template: str):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    # What llama-cpp-python serves a GGUF's template with (Llama picks it from the metadata).
    return Jinja2ChatFormatter(
        template=template,
        eos_token=special_text(llm, llm.token_eos()),
        bos_token=special_text(llm, llm.token_bos()),
        stop_token_ids=[llm.token_eos()],
    )


def builtin_template_prompt(llm, messages: list[dict]) -> str | None:
    """The prompt llama.cpp's own (non-Jinja) template engine makes from the GGUF's template, as
    llama-server without --jinja and Ollama-style importers do; None when it does not know the template."""
    import llama_cpp

    template = llama_cpp.llama_model_chat_template(llm._model.model, None)
    if not template:
        return None
    keep = [(m["role"].encode("utf-8"), m["content"].encode("utf-8")) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(
        *[llama_cpp.llama_chat_message(role=r, content=c) for r, c in keep]
    )
    size = 4096 + sum(len(c) for _r, c in keep) * 2
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template, chat, len(keep), True, buf, size)
    if n < 0:
        return None
    if n > size:
        buf = ctypes.create_string_buffer(n)
        n = llama_cpp.llama_chat_apply_template(template, chat, len(keep), True, buf, n)
    return buf.raw[:n].decode("utf-8", errors="replace")


def llama_checks(llm, job: dict) -> None:
    """In llama_child's child, with the GGUF loaded: the checks that need llama.cpp, sent to the parent."""
    import llama_cpp

    from loraship.llamacpp.llama_child import send

    fields = job["fields"]
    checks = []

    def check(name: str, passed: bool | None, detail: str) -> None:
        checks.append({"check": name, "passed": passed, "detail": detail})

    check(
        "loads in llama.cpp",
        True,
        f"llama-cpp-python {llama_cpp.__version__}: {llm.n_vocab()} tokens, {llm._model.n_params():,} parameters",
    )
    vocab = llm._model.vocab
    eos, bos = llm.token_eos(), llm.token_bos()
    adds_bos = fields.get(Keys.Tokenizer.ADD_BOS)
    eos_ok = eos >= 0 and bool(llama_cpp.llama_vocab_is_eog(vocab, eos))
    check(
        "special tokens",
        eos_ok,
        f"BOS {bos} {special_text(llm, bos)!r} (added to plain text: {adds_bos}), EOS {eos} {special_text(llm, eos)!r}"
        + ("" if eos_ok else "; EOS is not an end-of-generation token, so generation would not stop"),
    )
    stops = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    check(
        "stop tokens",
        bool(stops),
        ", ".join(f"{t} {special_text(llm, t)!r}" for t in stops[:8])
        + (f" (+{len(stops) - 8} more)" if len(stops) > 8 else "")
        if stops
        else "no end-of-generation token; generation would only stop at max_tokens",
    )

    template = fields.get(Keys.Tokenizer.CHAT_TEMPLATE)
    if not template:
        check(
            "chat template", None, "none in the GGUF (a completion model); chat needs `chat_template:` in the config"
        )
    else:
        question, sentinel = "What is the capital of France?", "Paris-7c1e"
        try:
            formatter = chat_formatter(llm, template)
            prompt = formatter(messages=[{"role": "user", "content": question}]).prompt
            turn = formatter(
                messages=[{"role": "user", "content": question}, {"role": "assistant", "content": sentinel}]
            ).prompt
        except Exception as e:  # jinja2 errors, raise_exception() in the template, missing variables
            check("chat template renders", False, f"llama-cpp-python cannot render it: {type(e).__name__}: {e}")
        else:
            rendered = question in prompt
            check(
                "chat template renders",
                rendered,
                f"user turn + generation prompt: {prompt[-80:]!r}"
                if rendered
                else f"the rendered prompt lacks the user's message: {prompt!r}",
            )
            after = turn.split(sentinel, 1)[1] if sentinel in turn else ""
            ends = llm.tokenize(after.encode("utf-8"), add_bos=False, special=True)[:1]
            ends_ok = bool(ends) and bool(llama_cpp.llama_vocab_is_eog(vocab, ends[0]))
            check(
                "assistant turn ends with a stop token",
                ends_ok,
                f"{special_text(llm, ends[0])!r} (id {ends[0]}) ends generation"
                if ends_ok
                else f"the template ends an assistant turn with {after[:20]!r}, which llama.cpp does not treat as "
                "end of generation: answers would run on; use a template whose turns end with EOS or a stop token",
            )
            # llama-server without --jinja (and importers like Ollama's) use llama.cpp's own engine,
            # which matches the template against the formats it knows and may pick a different one.
            builtin = builtin_template_prompt(llm, [{"role": "user", "content": question}])
            check(
                "llama.cpp built-in template engine",
                None,
                "renders the same prompt (llama-server works without --jinja)"
                if builtin == prompt
                else f"renders {builtin!r}, not the template's prompt: run llama-server with --jinja"
                if builtin
                else "does not know the template: run llama-server with --jinja",
            )
    send({"checks": checks})


def verify_checks(path: Path, context: int, gpu_gib: float | None) -> list[dict]:
    """The checks a GGUF passes with llama.cpp alone (no reference): each {check, passed, detail}.
    llama.cpp runs in a child process that loads the file first (loraship/llamacpp/llama_child.py says why)."""
    from loraship.planning import inference_memory as im
    from loraship.llamacpp.gguf_info import read_gguf_apart
    from loraship.llamacpp.llama_child import run_loaded

    checks = []

    def check(name: str, passed: bool | None, detail: str) -> None:
        checks.append({"check": name, "passed": passed, "detail": detail})

    info = read_gguf_apart(path)  # not in this process: llama.cpp loads the file next
    fields, layout = info["fields"], im.GGUFLayout(**info["layout"]) if info["layout"] else None
    file_type = fields.get(Keys.General.FILE_TYPE)
    check(
        "file type",
        file_type is not None,
        f"{_file_type_name(file_type)} (general.file_type {file_type})"
        if file_type is not None
        else "general.file_type is missing; convert the model again with the pinned llama.cpp",
    )
    try:
        wanted = {k: fields.get(k) for k in (Keys.Tokenizer.ADD_BOS, Keys.Tokenizer.CHAT_TEMPLATE)}
        checks += run_loaded(
            path,
            512,
            "loraship.llamacpp.gguf_tools:llama_checks",
            {"fields": wanted},
            f"llama.cpp checks of {path.name}",
        )["checks"]
    except LorashipError as e:
        check("loads in llama.cpp", False, str(e))
        return checks
    if layout is None:
        check("GPU memory", False, f"cannot predict from the GGUF's metadata ({info['layout_error']})")
        return checks
    try:
        predicted = im.predict_gpu(layout, context)
    except (KeyError, TypeError, ValueError) as e:
        check("GPU memory", False, f"cannot predict from the GGUF's metadata ({type(e).__name__}: {e})")
        return checks
    parts = ", ".join(
        f"{k.removesuffix('_gib')} {v:.2f}" for k, v in predicted.items() if k.endswith("_gib") and k != "total_gib"
    )
    detail = f"{predicted['total_gib']:.2f} GiB at context {context}, all layers on the GPU ({parts})"
    if gpu_gib is None:
        check("GPU memory", None, detail)
    else:
        fits = predicted["total_gib"] <= gpu_gib
        if not fits:
            detail += (
                f"; does not fit {gpu_gib:g} GiB: {im.layers_that_fit(layout, context, gpu_gib)} of "
                f"{im.all_layers(layout)} layers (llama.cpp's -ngl) do at this context, all layers up to context "
                f"{im.largest_context(layout, gpu_gib)}"
            )
        check(f"fits {gpu_gib:g} GiB", fits, detail)
    return checks
