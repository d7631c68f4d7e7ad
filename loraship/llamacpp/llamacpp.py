"""The one pinned llama.cpp: its converter (from the llama-cpp-python sdist) and what it supports.

The converter, quantizer and runtime must be the same llama.cpp version, or the GGUF may not
load (a newer converter can write tensor layouts or pre-tokenizer names an older runtime does not
know). The quantizer and runtime are the installed llama-cpp-python; the converter is
`vendor/llama.cpp/convert_hf_to_gguf.py` (+ conversion/, gguf-py/) from the sdist of exactly that
version, fetched once into LORASHIP_CACHE with its sha256 checked against PyPI's (or found at
LORASHIP_LLAMA_CPP_DIR).
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

from loraship.models import config_json
from loraship.constants import LLAMA_CPP_PYTHON_VERSION
from loraship.errors import IntegrityError, LorashipError
from loraship.cache import cache_root

_VENDORED = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
# Needed only with adapter_gguf, so not required of a folder fetched before it was unpacked too.
LORA_CONVERTER = "convert_lora_to_gguf.py"


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


def lora_converter() -> Path:
    """convert_lora_to_gguf.py of the pinned llama.cpp, beside convert_hf_to_gguf.py (it imports its model classes)."""
    folder = converter_dir()
    script = folder / LORA_CONVERTER
    if script.is_file():
        return script
    if os.environ.get("LORASHIP_LLAMA_CPP_DIR"):
        raise LorashipError(
            f"LORASHIP_LLAMA_CPP_DIR={folder} has no {LORA_CONVERTER}, which adapter_gguf needs; copy it there from "
            f"the same llama.cpp (vendor/llama.cpp/ of the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist), or "
            "set adapter_gguf: false"
        )
    fetch_converter(folder)  # a cache unpacked before the LoRA converter was part of it
    return script


# sha256 of each llama-cpp-python sdist as PyPI publishes it (https://pypi.org/simple/llama-cpp-python/,
# the "hashes" of llama_cpp_python-<version>.tar.gz); a new LLAMA_CPP_PYTHON_VERSION needs its line here.
SDIST_SHA256 = {
    "0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
}


def fetch_converter(folder: Path) -> Path:
    """Download the pinned sdist in pip's hash-checking mode and unpack its converter into folder.

    pip checks the sha256 before it runs anything from the archive (preparing an sdist's metadata
    runs its build backend), so a tampered or substituted file never executes and never reaches
    the cache; the folder already there is left as it was.
    """
    return fetch_vendored(folder, lambda top: top in (*_VENDORED, LORA_CONVERTER))


def fetch_source(folder: Path) -> Path:
    """The whole vendor/llama.cpp of the pinned sdist (to build llama.cpp's tools), fetched and checked as
    fetch_converter's part is."""
    return fetch_vendored(folder, lambda top: True)


def fetch_vendored(folder: Path, wanted) -> Path:
    """Unpack the entries of the pinned sdist's vendor/llama.cpp/ whose first path part `wanted` accepts
    into folder, which appears whole or not at all."""
    version = LLAMA_CPP_PYTHON_VERSION
    expected = SDIST_SHA256.get(version)
    if expected is None:
        raise LorashipError(
            f"no pinned sha256 for the llama-cpp-python=={version} sdist; add PyPI's sha256 of "
            f"llama_cpp_python-{version}.tar.gz to SDIST_SHA256 in {__name__}"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"llama-cpp-python=={version} --hash=sha256:{expected}\n", encoding="utf-8")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--require-hashes",
            "--quiet",
            "-r",
            str(requirements),
            "-d",
            tmp,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if "DO NOT MATCH THE HASHES" in result.stderr:  # pip's hash-checking mode refused the file it fetched
            got = re.search(r"Got\s+([0-9a-f]{64})", result.stderr)
            source = re.search(r"from (\S+llama_cpp_python-\S+\.tar\.gz)", result.stderr)
            raise IntegrityError(
                f"{source.group(1) if source else f'llama_cpp_python-{version}.tar.gz'}: sha256 "
                f"{got.group(1) if got else '(see pip below)'} is not {expected}, the one PyPI publishes for "
                f"llama_cpp_python-{version}.tar.gz; the download was altered or replaced, so nothing was unpacked. "
                "Check the index or proxy pip uses (pip config list, PIP_INDEX_URL, PIP_FIND_LINKS) and run "
                "`loraship fetch-converter` again, or set LORASHIP_LLAMA_CPP_DIR to a vendor/llama.cpp you trust\n"
                f"{result.stderr.strip()[-2000:]}"
            )
        if result.returncode != 0 or not sdists:
            raise LorashipError(
                f"could not download the llama-cpp-python=={version} sdist for its llama.cpp:\n"
                f"{result.stderr.strip()[-2000:]}\nSet LORASHIP_LLAMA_CPP_DIR to an unpacked vendor/llama.cpp instead."
            )
        staging = Path(tmp) / "staging"
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix) and m.name[len(prefix) :] and wanted(m.name[len(prefix) :].split("/")[0])
            ]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(staging, members=members, filter="data")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)  # whole folder appears at once
    return folder


def _registered_text_models(sources: list[Path]) -> set[str]:
    """HF architecture names of `@ModelBase.register("...")` on the converter's text-model classes (not its mmproj
    ones, which convert a vision tower into a separate file), read with ast: nothing of the converter is imported."""
    import ast

    bases: dict[str, list[str]] = {}
    registered: dict[str, list[str]] = {}
    for source in sources:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            for dec in node.decorator_list:
                if (
                    isinstance(dec, ast.Call)
                    and isinstance(dec.func, ast.Attribute)
                    and dec.func.attr == "register"
                    and isinstance(dec.func.value, ast.Name)
                    and dec.func.value.id == "ModelBase"
                ):
                    registered.setdefault(node.name, []).extend(
                        a.value for a in dec.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    )

    def mmproj(name: str, seen: frozenset = frozenset()) -> bool:
        if name == "MmprojModel":
            return True
        return any(mmproj(b, seen | {name}) for b in bases.get(name, []) if b not in seen)

    return {arch for cls, archs in registered.items() if not mmproj(cls) for arch in archs}


@lru_cache(maxsize=4)
def supported_architectures(folder: Path | None = None) -> frozenset[str]:
    """HF architectures the pinned converter turns into a text GGUF: those its model classes register with
    `@ModelBase.register` (conversion/*.py, or convert_hf_to_gguf.py itself in older converters), and, where the
    converter looks classes up through conversion/__init__.py's TEXT_MODEL_MAP, in that table too."""
    import ast

    folder = folder or converter_dir()
    package = folder / "conversion"
    sources = sorted(package.glob("*.py")) if package.is_dir() else []
    names = _registered_text_models(sources or [folder / "convert_hf_to_gguf.py"])
    init = package / "__init__.py"
    if init.is_file():
        for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
            target = getattr(node, "target", None) or (node.targets[0] if isinstance(node, ast.Assign) else None)
            if isinstance(target, ast.Name) and target.id == "TEXT_MODEL_MAP" and isinstance(node.value, ast.Dict):
                table = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                names = names & table if names else table
    return frozenset(names)


@lru_cache(maxsize=4)
def pre_tokenizer_table(folder: Path | None = None) -> tuple[str, dict[str, str]]:
    """(check text, {sha256 of its token ids: pre-tokenizer name}) from the converter's get_vocab_base_pre."""
    folder = folder or converter_dir()
    base = folder / "conversion" / "base.py"
    text = (
        base.read_text(encoding="utf-8")
        if base.exists()
        else (folder / "convert_hf_to_gguf.py").read_text(encoding="utf-8")
    )
    match = re.search(r"^\s*chktxt = (.+)$", text, flags=re.M)
    if not match:
        raise LorashipError(f"could not find the pre-tokenizer check text in the converter at {folder}")
    import ast

    chktxt = ast.literal_eval(match.group(1))
    table = dict(re.findall(r'if chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#.*\n)*\s*res = "([^"]+)"', text))
    return chktxt, table


# llama.cpp scales Gemma 2's queries by its own rule, not by config.json's query_pre_attn_scalar:
# 1/sqrt(hidden / heads) for the 27B, which it knows by its 46 layers, 1/sqrt(head_dim) for every other
# (models/gemma2.cpp in the pinned sdist).
GEMMA2_27B_LAYERS = 46


def gemma2_scale_problems(config: dict) -> list[str]:
    """A Gemma 2 whose query_pre_attn_scalar is not the one llama.cpp assumes would ship a GGUF whose attention
    differs from the fine-tuned model's in every layer: refused before training, not found by verify afterwards."""
    if config.get("model_type") != "gemma2" or config.get("query_pre_attn_scalar") is None:
        return []
    hidden, heads, layers = (
        config.get("hidden_size"),
        config.get("num_attention_heads"),
        config.get("num_hidden_layers"),
    )
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    if not (hidden and heads and head_dim):
        return []
    assumed = hidden // heads if layers == GEMMA2_27B_LAYERS else head_dim
    if float(config["query_pre_attn_scalar"]) == float(assumed):
        return []
    return [
        f"Gemma 2 config.json has query_pre_attn_scalar {config['query_pre_attn_scalar']}, but llama.cpp "
        f"(llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}) scales the queries of a {layers}-layer Gemma 2 by "
        f"1/sqrt({assumed}) whatever the config says, so the GGUF would attend differently from the fine-tuned "
        f"model; use a Gemma 2 checkpoint whose query_pre_attn_scalar is {assumed} (as Gemma-2-2B, 9B and 27B have)"
    ]


def check_convertible(model_dir: Path) -> list[str]:
    """Problems the pinned converter would hit on this HF folder, found before any training."""

    problems = []
    config = config_json(Path(model_dir))
    archs = config.get("architectures") or []
    supported = supported_architectures()
    if not archs:
        problems.append("config.json has no 'architectures'; the GGUF converter cannot pick a model class")
    for arch in archs:
        if arch not in supported:
            problems.append(
                f"architecture {arch} is not supported by llama.cpp's converter "
                f"(llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}); pick a base model with a supported architecture or "
                "wait for a loraship release that pins a newer llama.cpp"
            )
    problems += gemma2_scale_problems(config)
    # Whether the converter can write the vocabulary (a BPE pre-tokenizer it knows, ...) is its own vocabulary
    # step's to say, run at the end of the input checks (loraship/llamacpp/vocab_export.py).
    if not any((Path(model_dir) / name).exists() for name in ("tokenizer.model", "tokenizer.json")):
        problems.append("no tokenizer.model or tokenizer.json in the model folder; the GGUF would have no vocabulary")
    return problems
