"""tokenizer.ggml.add_space_prefix: the one flag with which llama.cpp's sentencepiece (SPM) tokenizer
places sentencepiece's dummy-prefix "▁", chosen so that llama.cpp tokenizes the texts a model is served
exactly as the HF tokenizer it was trained with did.

llama.cpp (its SPM tokenizer, in the llama.cpp that llama-cpp-python vendors) cuts a text at its special
tokens and, when the flag is true, puts a space before EVERY raw-text piece: the first one and each one
after a special token, even a piece that already starts with a space. With the flag false it puts none.

HF puts "▁" before a piece by the tokenizer's Metaspace pre-tokenizer, only where the piece does not
start with a space already, and by its prepend_scheme: before every piece ("always", legacy=True), only
before the text's first character ("first", legacy=False), or never. A legacy tokenizer.json's Prepend
normalizer puts it before every piece unconditionally, as llama.cpp's true does.

So llama.cpp equals HF on a text exactly when HF prefixes every raw piece of it (flag true) or none
(flag false). Mistral 7B v0.3's template (legacy=False, "first") renders "[INST] " + content: HF
prefixes no piece and writes [INST] ▁Do, as Mistral's reference tokenizer mistral-common does; the
converter's default (true) makes it [INST] ▁ ▁Do. Plain text (completion data) is one piece
at the text's start, which HF prefixes: true. A run serving both has no flag that fits, and plan says so.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

# Probe conversations: what a template puts around message contents decides where raw pieces start.
_CHAT_PROBE = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Why"},
    {"role": "assistant", "content": "Because"},
]
_TEXT_PROBE = "Hello world"  # completion data: the row's text itself, BOS added as a token


def prepend_scheme(tokenizer) -> str | None:
    """How HF places the dummy prefix: "always", "first" or "never" (Metaspace), "prepend" (a legacy
    Prepend normalizer), or None for a tokenizer without one (byte-level BPE: Llama 3, Qwen, ...),
    which the flag does not concern."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    # Only the normalizer's and pre-tokenizer's JSON, as backend.to_str() holds them: parsing the whole tokenizer for
    # two small entries took 0.1-1.9 s a call at 49k-262k tokens (bench/results/ci_time.json, session_36).
    spec = {
        key: json.loads(part.__getstate__()) if part is not None else None
        for key, part in (("normalizer", backend.normalizer), ("pre_tokenizer", backend.pre_tokenizer))
    }

    def parts(node: dict | None, key: str) -> list[dict]:
        node = node or {}
        return node.get(key, []) if node.get("type") == "Sequence" else [node]

    for node in parts(spec.get("normalizer"), "normalizers"):
        if node.get("type") == "Prepend" and node.get("prepend") == "▁":
            return "prepend"
    for node in parts(spec.get("pre_tokenizer"), "pretokenizers"):
        if node.get("type") == "Metaspace":
            if "prepend_scheme" in node:
                return node["prepend_scheme"]
            return "always" if node.get("add_prefix_space", True) else "never"  # tokenizers < 0.14
    return None


def raw_pieces(tokenizer, text: str) -> list[tuple[int, str]]:
    """(offset, text) of each raw-text piece between the added tokens both HF and llama.cpp (special
    tokens parsed) cut the text at."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    added = set(tokenizer.get_added_vocab().values())
    cuts = [(s, e) for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]) if i in added]
    pieces, at = [], 0
    for start, end in [*cuts, (len(text), len(text))]:
        if start > at:
            pieces.append((at, text[at:start]))
        at = max(at, end)
    return pieces


def hf_prefixes(scheme: str, offset: int, piece: str) -> bool:
    """Does HF put "▁" before this raw piece?"""
    if scheme == "prepend":
        return True
    if piece[:1] in (" ", "▁"):
        return False
    return scheme == "always" or (scheme == "first" and offset == 0)


def served_kinds(config) -> set[str]:
    """What llama.cpp will be given: "chat" (texts rendered by the template) and/or "text" (plain text)."""
    kinds = {"text" if spec.type == "completion" else "chat" for spec in (*config.datasets, *config.eval_datasets)}
    if config.golden_prompts:
        kinds.add("chat")  # loraship.data.golden_rows makes every golden prompt a conversation
    return kinds


def probe_texts(tokenizer, kinds: set[str]) -> dict[str, str]:
    from loraship.chat import render
    from loraship.errors import DataError

    texts = {}
    if "text" in kinds:
        texts["plain text"] = _TEXT_PROBE
    if "chat" in kinds:
        for what, messages, prompt in (
            ("a rendered conversation", _CHAT_PROBE, False),
            ("a rendered prompt", _CHAT_PROBE[:1], True),
        ):
            try:
                texts[what] = render(tokenizer, messages, add_generation_prompt=prompt)
            except DataError:
                # a template this probe does not suit; plan renders the run's own rows, verify's parity gate the rest
                pass
    return texts


def choose(tokenizer, kinds: set[str]) -> tuple[bool | None, str | None]:
    """(the add_space_prefix to write, or None where the tokenizer has no dummy prefix; a problem where
    no value makes llama.cpp tokenize every kind of served text as HF does)."""
    scheme = prepend_scheme(tokenizer)
    if scheme is None:
        return None, None
    wants: dict[str, set[bool]] = {}
    for what, text in probe_texts(tokenizer, kinds).items():
        wants[what] = {
            bool(value)
            for value in (True, False)
            if all(hf_prefixes(scheme, offset, piece) == value for offset, piece in raw_pieces(tokenizer, text))
        }
    fits = set.intersection({True, False}, *wants.values())
    if fits:
        return (True if True in fits else False), None  # true where both fit: llama.cpp's own default
    shown = "; ".join(
        f"{what} needs {' or '.join(str(value).lower() for value in sorted(values)) or 'neither'}"
        for what, values in wants.items()
    )
    why = (
        "llama.cpp places sentencepiece's space prefix by one GGUF flag, tokenizer.ggml.add_space_prefix (a space "
        f"before every raw-text piece, or before none), and this HF tokenizer (prepend_scheme {scheme!r}) needs "
        f"another value per text ({shown}), so llama.cpp would feed the model token sequences it never trained on"
    )
    if all(wants.values()):
        return None, (
            f"{why}. This run serves both kinds: train chat data (alpaca, chat, sharegpt; golden prompts "
            "are conversations too) and completion data in separate runs, or give the completion rows as "
            "conversations"
        )
    return None, (
        f"{why}. The chat template renders raw text at the start of the conversation and after special "
        "tokens; begin it with {{ bos_token }} (or another special token), as the model's own template does"
    )


def converter_writes(model_dir: Path) -> bool:
    """The add_space_prefix the pinned converter gives a sentencepiece GGUF of model_dir: the
    tokenizer_config's add_prefix_space where set (its Llama/Mistral model class copies it), else llama.cpp's
    default, true."""
    try:
        value = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8")).get(
            "add_prefix_space"
        )
    except (OSError, ValueError):
        value = None
    return True if value is None else bool(value)


@contextmanager
def converter_input(model_dir: Path, add_space_prefix: bool | None):
    """model_dir as the converter is to read it: itself, or, where the converter would write another
    add_space_prefix, a temporary folder of links to its files whose tokenizer_config.json sets
    add_prefix_space (the converter's own input for the flag; model_dir, a stage's output, stays as it is)."""
    model_dir = Path(model_dir)
    if add_space_prefix is None or converter_writes(model_dir) == add_space_prefix:
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix="loraship-convert-") as tmp:
        view = Path(tmp) / model_dir.name  # the converter names a model without --metadata after its folder
        view.mkdir()
        for entry in model_dir.iterdir():
            if entry.name != "tokenizer_config.json":
                (view / entry.name).symlink_to(entry.resolve())
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        config["add_prefix_space"] = add_space_prefix
        (view / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        yield view


def gguf_value(fields: dict) -> bool | None:
    """The add_space_prefix llama.cpp uses for a GGUF (its key, else the SPM default, true); None for
    a vocabulary that is not sentencepiece's."""
    from gguf import Keys

    if fields.get(Keys.Tokenizer.MODEL) != "llama":
        return None
    value = fields.get(Keys.Tokenizer.ADD_PREFIX)
    return True if value is None else bool(value)
