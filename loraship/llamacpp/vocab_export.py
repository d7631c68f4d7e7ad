"""The pinned converter's vocabulary step, run at plan: `convert_hf_to_gguf.py --vocab-only` into a temporary file.

A tokenizer the converter cannot write (a BPE pre-tokenizer whose hash it does not know, a vocabulary it cannot
find or read) used to stop the convert stage after train and merge, with the converter's stack as the message. The
vocabulary step loads config.json and the tokenizer, not the weights, so it runs at plan in seconds, and its last
line, the error itself, is quoted in one refusal.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tempfile
from pathlib import Path

from loraship.constants import LLAMA_CPP_PYTHON_VERSION
from loraship.errors import LorashipError

TIMEOUT_S = 600
_CHKHSH = re.compile(r"chkhsh:\s*([0-9a-f]{64})")


def export_vocab(model_dir: Path, out_file: Path):
    """Run the vocabulary step on model_dir into out_file; the finished child (returncode, stdout, stderr)."""
    from loraship.llamacpp.llamacpp import converter_dir
    from loraship.runtime.proc import run_child

    script = converter_dir() / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(model_dir), "--vocab-only", "--outfile", str(out_file)]
    return run_child(cmd, TIMEOUT_S, f"convert_hf_to_gguf.py --vocab-only on {model_dir}")


# What the vocabulary step reads is the folder less its weights; a success is remembered under that content's hash,
# so `loraship run`'s check and the plan stage's, and every rerun, convert it once.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf")


def _passed_marker(model_dir: Path) -> Path:
    from loraship.cache import cache_root

    digest = hashlib.sha256(LLAMA_CPP_PYTHON_VERSION.encode())
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.endswith(".index.json"):
            digest.update(f"\0{path.name}\0".encode())
            digest.update(path.read_bytes())
    return cache_root() / "vocab-export" / f"{digest.hexdigest()}.ok"


def vocab_export_problems(base_model: str, model_dir: Path) -> list[str]:
    """One message quoting the converter's last line where it cannot write this tokenizer; [] where it can."""
    marker = _passed_marker(Path(model_dir))
    if marker.is_file():
        return []
    with tempfile.TemporaryDirectory(prefix="loraship-vocab-") as tmp:
        out = Path(tmp) / "vocab.gguf"
        try:
            done = export_vocab(model_dir, out)
        except LorashipError as e:  # the converter did not finish in time
            return [f"base model {base_model!r}: {e}"]
        if done.returncode == 0 and out.is_file():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            return []
    lines = [line.strip() for line in f"{done.stdout}\n{done.stderr}".splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit {done.returncode}, no output"
    hashes = _CHKHSH.findall(done.stdout + done.stderr)
    if last.startswith(("ModuleNotFoundError", "ImportError")):
        return [
            f"base model {base_model!r}: llama.cpp's converter cannot run in this environment ({last}); fix: install "
            "the convert extra (pip install 'loraship[convert]'), which has what the converter imports"
        ]
    if "pre-tokenizer" in last or hashes:
        fix = (
            f"the tokenizer's BPE pre-tokenizer (chkhsh {hashes[-1] if hashes else '?'}) is not one this converter "
            "knows; use the base model's original tokenizer files (an edited pre_tokenizer, normalizer, merges or "
            "added tokens change the hash), or a base model whose tokenizer llama.cpp supports"
        )
    else:
        fix = (
            "use the tokenizer files that came with the checkpoint (tokenizer.json, or tokenizer.model for a "
            "sentencepiece vocabulary), or a base model whose tokenizer llama.cpp supports"
        )
    return [
        f"base model {base_model!r}: llama.cpp's converter (llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}) cannot "
        f"write its tokenizer into a GGUF, so the convert stage would fail after train and merge: {last}; fix: {fix}"
    ]
