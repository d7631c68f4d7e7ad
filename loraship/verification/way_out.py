"""What verify's failure says to do when a quantization failed its gates: ship a rung this run made that passed, or
let `quantization: auto` choose, or name a larger rung, each with its size; and why the failing rung may be coarser
than its name says (its K-quant rows fell back to another type: loraship/llamacpp/quant_mix.py).

A rung can fail where a smaller one passes: on the real Gemma 3 270M, dequantized from llama.cpp's Q4_K_M, Q4_K_M
puts most tensors back on the Q5_0 grid they came from and rounds a small fine-tune away (bench/README.md,
bench/results/quant_grid_gemma3.json), so `quantization: auto` is named before the larger rungs.
"""

from __future__ import annotations

from pathlib import Path

from loraship.constants import AUTO_LADDER, BITS_PER_WEIGHT
from loraship.llamacpp.quant_mix import gguf_layout, gguf_tensors, summarize, tensor_types
from loraship.verification.figures import failed_gates


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def estimated_bytes(gguf: Path, quantizations: list[str]) -> dict[str, int]:
    """Each quantization's file size, from a GGUF of the same model (any quantization): its tensors' types as
    llama.cpp would pick them, plus the metadata (tokenizer, template) that file carries beside its weights."""
    layout = gguf_layout(gguf)
    overhead = max(gguf.stat().st_size - layout.data_bytes, 0)
    tensors = list(layout.tensors)
    return {
        q: summarize(tensor_types(tensors, q, layout.n_layer, layout.n_gqa), q).weight_bytes + overhead
        for q in quantizations
    }


def fallback_words(gguf: Path, quantization: str) -> str | None:
    """How many of the GGUF's tensors fell back from the rung's K-quant or i-quant type, or None where none did."""
    tensors, n_layer, n_gqa = gguf_tensors(gguf)
    mix = summarize(tensor_types(tensors, quantization, n_layer, n_gqa), quantization)
    return mix.words() if mix.fell_back else None


def failure_message(sections: dict[str, dict], gates: dict[str, dict], details: Path) -> str:
    """verify's error when a quantization failed: which rungs, each failing gate with its value and limit, then the
    way out. gates: verify.json's top-level gates (every rung's); details: verify.json's path."""
    failing = [q for q, s in sections.items() if not s["passed"]]
    return (
        f"verify failed for {', '.join(failing)}: {failed_gates(gates)}.\nWay out: {way_out(sections)}; "
        f"details in {details}"
    )


def way_out(sections: dict[str, dict]) -> str:
    """What a failed verify tells the user to do. sections: verify.json's per-quantization sections of this run
    (each names its GGUF, from whose tensors the sizes of rungs not made are estimated)."""
    failing = [q for q, s in sections.items() if not s["passed"]]
    passed = sorted((q for q, s in sections.items() if s["passed"]), key=lambda q: sections[q]["gguf_bytes"])
    if passed:
        made = ", ".join(f"{q} ({_mb(sections[q]['gguf_bytes'])})" for q in passed)
        words = f"this run made {made}, which passed every gate: ship it with quantization: {passed[0]}"
    else:
        largest = max(BITS_PER_WEIGHT[q] for q in failing)
        larger = [q for q in AUTO_LADDER if BITS_PER_WEIGHT[q] > largest]
        sizes = _sizes(next((Path(s["gguf"]) for s in sections.values() if s.get("gguf")), None), larger)
        named = ", ".join(f"{q} (about {_mb(sizes[q])})" if q in sizes else q for q in larger)
        words = (
            f"set quantization: auto (verify tries {', '.join(AUTO_LADDER)}, smallest first, and ships the first that "
            "passes every gate)" + (f", or name a larger rung: {named}" if named else "")
        )
    notes = []
    for q in failing:
        if any(name.startswith("finetune_kept") and not g["passed"] for name, g in sections[q]["gates"].items()):
            notes.append(f"{q} lost part of the fine-tune (its answers or KL went back toward the base model's)")
        fell = _fallback(Path(sections[q]["gguf"]), q) if sections[q].get("gguf") else None
        if fell:
            notes.append(fell)
    return words + (f". {'; '.join(notes)}" if notes else "")


def _sizes(gguf: Path | None, quantizations: list[str]) -> dict[str, int]:
    if gguf is None or not gguf.is_file():
        return {}
    try:
        return estimated_bytes(gguf, quantizations)
    except (OSError, ValueError, KeyError):  # a GGUF gguf-py cannot read: the rungs are named without sizes
        return {}


def _fallback(gguf: Path, quantization: str) -> str | None:
    if not gguf.is_file():
        return None
    try:
        return fallback_words(gguf, quantization)
    except (OSError, ValueError, KeyError):
        return None
