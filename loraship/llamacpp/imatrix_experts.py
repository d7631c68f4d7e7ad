"""How much of a mixture of experts an importance matrix saw: which (layer, expert) pairs the calibration text routed
tokens through, read from the matrix's own per-expert counts.

llama-imatrix counts the tokens each expert of each `blk.N.ffn_*_exps` tensor received (`<tensor>.counts`, one entry
per expert). llama-quantize divides each expert's sums by its count and, for an expert with none, quantizes that
expert with uniform weights: as if there were no matrix (tools/quantize/quantize.cpp of the pinned llama.cpp). So
an expert the run's data never routed still ships, only without the matrix's help; the gate below fails a matrix
that saw too few of them to be called the run's matrix.
"""

from __future__ import annotations

import re
from pathlib import Path

from loraship.errors import LorashipError

# The share of (layer, expert) pairs that must have received calibration tokens. Below it the matrix leaves more
# than one expert in ten to uniform weights; the training text is what the fix adds (imatrix_max_tokens), or the
# matrix is dropped (imatrix: false). Every tiny and real MoE run measured so far saw 100%.
IMATRIX_EXPERT_COVERAGE_MIN = 0.9
EXPERT_COUNTS = re.compile(r"^blk\.(\d+)\.(ffn_\w+_exps)\.weight\.counts$")
EXPERT_WEIGHT = re.compile(r"^blk\.(\d+)\.ffn_\w+_exps\.weight$")


def expert_layers(f16: Path) -> tuple[int, list[int]]:
    """(experts per layer, the layers holding expert tensors) of a GGUF; (0, []) for a dense model."""
    from gguf import GGUFReader

    reader = GGUFReader(f16)
    layers = sorted({int(m.group(1)) for t in reader.tensors if (m := EXPERT_WEIGHT.match(t.name))})
    if not layers:
        return 0, []
    arch = reader.get_field("general.architecture")
    name = bytes(arch.parts[arch.data[0]]).decode() if arch else ""
    field = reader.get_field(f"{name}.expert_count")
    experts = int(field.parts[field.data[0]][0]) if field is not None else 0
    return experts, layers


def expert_coverage(imatrix: Path, f16: Path) -> dict | None:
    """The pairs that received tokens, of every (layer, expert) pair the model has; None for a dense model. A pair
    counts as covered only where every expert tensor of its layer (gate, up, down) has tokens for it."""
    import numpy as np
    from gguf import GGUFReader

    experts, layers = expert_layers(f16)
    if not layers:
        return None
    least: dict[tuple[int, int], float] = {(layer, e): 0.0 for layer in layers for e in range(experts)}
    seen: dict[int, list] = {}
    for t in GGUFReader(imatrix).tensors:
        m = EXPERT_COUNTS.match(t.name)
        if m:
            seen.setdefault(int(m.group(1)), []).append(np.asarray(t.data, dtype=np.float64).ravel())
    for layer, arrays in seen.items():
        counts = np.min(np.stack([a[:experts] for a in arrays if a.size >= experts]), axis=0)
        for e, c in enumerate(counts):
            if (layer, e) in least:
                least[(layer, e)] = float(c)
    never = [f"blk.{layer} expert {e}" for (layer, e), c in sorted(least.items()) if c <= 0]
    total = len(least)
    covered = total - len(never)
    routed = [c for c in least.values() if c > 0]
    return {
        "pairs": total,  # the evidence: (layer, expert) pairs the model has
        "covered": covered,
        "fraction": covered / total if total else 0.0,
        "threshold": IMATRIX_EXPERT_COVERAGE_MIN,
        "least_tokens": min(routed) if routed else 0.0,
        "never_routed": never[:16],
        "never_routed_count": len(never),
        "passed": total > 0 and covered / total >= IMATRIX_EXPERT_COVERAGE_MIN,
    }


def check_expert_coverage(coverage: dict | None, tokens: int, max_tokens: int) -> None:
    """One message naming the experts the matrix never saw and the fix; a matrix with no pairs never passes."""
    if coverage is None or coverage["passed"]:
        return
    raise LorashipError(
        f"importance matrix: {coverage['covered']} of {coverage['pairs']} (layer, expert) pairs received calibration "
        f"tokens ({coverage['fraction']:.0%}, at least {IMATRIX_EXPERT_COVERAGE_MIN:.0%} needed); never routed: "
        f"{', '.join(coverage['never_routed'][:6])}{' ...' if coverage['never_routed_count'] > 6 else ''}. llama.cpp "
        f"would quantize those experts as if there were no matrix. Fix: raise imatrix_max_tokens (now {max_tokens}; "
        f"this matrix saw {tokens} tokens) or add training text that reaches them, or set imatrix: false"
    )
