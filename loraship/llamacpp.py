"""The one pinned llama.cpp: its converter (from the llama-cpp-python sdist) and what it supports.

The converter, quantizer and runtime must be the same llama.cpp version, or the GGUF may not
load (shared/PITFALLS.md). The quantizer and runtime are the installed llama-cpp-python; the
converter is `vendor/llama.cpp/convert_hf_to_gguf.py` (+ conversion/, gguf-py/) from the sdist of
exactly that version, fetched once into LORASHIP_CACHE (or found at LORASHIP_LLAMA_CPP_DIR).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

from loraship.constants import LLAMA_CPP_PYTHON_VERSION
from loraship.errors import LorashipError

_VENDORED = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def cache_root() -> Path:
    return Path(os.environ.get("LORASHIP_CACHE", Path.home() / ".cache" / "loraship")).expanduser()


def _has_converter(folder: Path) -> bool:
    return all((folder / name).exists() for name in _VENDORED)


def converter_dir(fetch: bool = True) -> Path:
    """Folder holding convert_hf_to_gguf.py of the pinned llama.cpp; fetched from PyPI on first use."""
    explicit = os.environ.get("LORASHIP_LLAMA_CPP_DIR")
    if explicit:
        folder = Path(explicit)
        if not _has_converter(folder):
            raise LorashipError(
                f"LORASHIP_LLAMA_CPP_DIR={folder} does not hold {', '.join(_VENDORED)}; unset it to let loraship "
                f"fetch llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s converter"
            )
        return folder
    folder = cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    if _has_converter(folder):
        return folder
    if not fetch:
        raise LorashipError(f"llama.cpp converter not found in {folder}; run `loraship fetch-converter`")
    return fetch_converter(folder)


def fetch_converter(folder: Path) -> Path:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
               f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if result.returncode != 0 or not sdists:
            raise LorashipError(
                f"could not download the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist for its converter:\n"
                f"{result.stderr.strip()[-2000:]}\nSet LORASHIP_LLAMA_CPP_DIR to an unpacked vendor/llama.cpp instead."
            )
        staging = Path(tmp) / "staging"
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.name[len(prefix):].split("/")[0] in _VENDORED]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(staging, members=members, filter="data")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)  # whole folder appears at once
    return folder


@lru_cache(maxsize=4)
def supported_architectures(folder: Path | None = None) -> frozenset[str]:
    """HF architectures the pinned converter registers (conversion/__init__.py's table)."""
    folder = folder or converter_dir()
    text = (folder / "conversion" / "__init__.py").read_text(encoding="utf-8")
    names = set(re.findall(r'^\s*"([A-Za-z0-9_]+)"\s*:\s*"[a-z0-9_]+"', text, flags=re.M))
    if not names:  # older converters register with decorators in one file
        text = (folder / "convert_hf_to_gguf.py").read_text(encoding="utf-8")
        names = set(re.findall(r'"([A-Za-z0-9_]+(?:ForCausalLM|LMHeadModel|Model))"', text))
    return frozenset(names)


@lru_cache(maxsize=4)
def pre_tokenizer_table(folder: Path | None = None) -> tuple[str, dict[str, str]]:
    """(check text, {sha256 of its token ids: pre-tokenizer name}) from the converter's get_vocab_base_pre."""
    folder = folder or converter_dir()
    base = folder / "conversion" / "base.py"
    text = base.read_text(encoding="utf-8") if base.exists() else (folder / "convert_hf_to_gguf.py").read_text(encoding="utf-8")
    match = re.search(r"^\s*chktxt = (.+)$", text, flags=re.M)
    if not match:
        raise LorashipError(f"could not find the pre-tokenizer check text in the converter at {folder}")
    import ast

    chktxt = ast.literal_eval(match.group(1))
    table = dict(re.findall(r'if chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#.*\n)*\s*res = "([^"]+)"', text))
    return chktxt, table


def check_convertible(model_dir: Path) -> list[str]:
    """Problems the pinned converter would hit on this HF folder, found before any training."""
    import json

    problems = []
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    archs = config.get("architectures") or []
    supported = supported_architectures()
    if not archs:
        problems.append("config.json has no 'architectures'; the GGUF converter cannot pick a model class")
    for arch in archs:
        if arch not in supported:
            problems.append(
                f"architecture {arch} is not supported by llama.cpp's converter (llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}); "
                "pick a base model with a supported architecture or wait for a loraship release that pins a newer llama.cpp"
            )
    if (Path(model_dir) / "tokenizer.model").exists():
        return problems  # sentencepiece vocab: converted without the BPE pre-tokenizer check
    if (Path(model_dir) / "tokenizer.json").exists():
        tok = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
        if (tok.get("model") or {}).get("type") == "BPE":
            from hashlib import sha256

            from transformers import AutoTokenizer

            chktxt, table = pre_tokenizer_table()
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            chkhsh = sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest()
            if chkhsh not in table:
                problems.append(
                    f"the tokenizer's BPE pre-tokenizer is not recognised by llama.cpp's converter (chkhsh {chkhsh}); "
                    "convert_hf_to_gguf.py would stop with 'BPE pre-tokenizer was not recognized'. Use the base model's "
                    "original tokenizer (added tokens or a changed pre-tokenizer change the hash)"
                )
    else:
        problems.append("no tokenizer.model or tokenizer.json in the model folder; the GGUF would have no vocabulary")
    return problems
