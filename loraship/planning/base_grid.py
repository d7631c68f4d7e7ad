"""Does the base model's checkpoint hold weights that were already quantized by llama.cpp (a model dequantized from a
GGUF: a *-GGUF repository read with transformers' gguf_file=)? Then quantizing the fine-tune at a rung that gives a
tensor the same ggml type puts it back on the same grid, and a LoRA's small weight changes round back to the base's:
the GGUF loses the fine-tune while its weights stay within a fraction of a percent of the merged model's.

On the real Gemma 3 270M dequantized from its Q4_K_M GGUF, Q4_K_M kept a fraction of the fine-tune's change on its
Q5_0 tensors while IQ3_M (IQ4_NL there) kept it (bench/results/quant_ladder_gemma3.json). plan reads one decoder
layer's weights (a few MB) to tell, where the checkpoint is on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Types gguf-py can quantize (gguf.quants), with what a round trip costs weights never quantized (relative L2;
# gguf-py's Q5_1 on Gemma 3's layer-0 weights: 0.037, Q5_0 about 0.03, 4 bits about twice that). A tensor already on
# the grid comes back within bf16's rounding. Q8_0 is left out: its steps are 16 times finer than Q5_0's, and the real
# Gemma 3 270M, whose attn_v were stored as Q8_0, keeps its fine-tune at Q8_0 (bench/results/quant_ladder_gemma3.json).
ROUND_TRIP_TYPES = ("Q5_0", "Q5_1", "Q4_0", "Q4_1")
ON_GRID_FRACTION = 0.2  # on the grid: a round trip error under a fifth of the fresh one
FRESH_ERROR = {"Q5_0": 0.025, "Q5_1": 0.03, "Q4_0": 0.05, "Q4_1": 0.06}
# HF Linear name suffixes of a decoder layer, as the GGUF converter names them (loraship/llamacpp/quant_mix.py).
LAYER_TENSORS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
MAX_ELEMENTS = 2**18  # per tensor, its first rows: a grid shows in any of its blocks, and plan stays fast


@dataclass(frozen=True)
class OnGrid:
    """A base-model tensor that sits on a llama.cpp type's grid."""

    hf_name: str
    gguf_name: str  # blk.N.<role>.weight
    ggml_type: str
    round_trip_error: float | None  # None: told by its values (Q4_K: at most 16 distinct in each block of 32)

    def words(self) -> str:
        if self.round_trip_error is None:
            return f"{self.hf_name} is on llama.cpp's {self.ggml_type} grid (at most 16 distinct values per 32)"
        return (
            f"{self.hf_name} is on llama.cpp's {self.ggml_type} grid (a {self.ggml_type} round trip changes it by "
            f"{self.round_trip_error:.2%}, against about {FRESH_ERROR[self.ggml_type]:.1%} for weights never "
            "quantized)"
        )


def _rel_error(w, ggml_type: str) -> float:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType[ggml_type]
    back = dequantize(quantize(w, t), t).astype(np.float64)
    return float(np.linalg.norm(back - w) / max(np.linalg.norm(w), 1e-30))


def grid_of(w) -> tuple[str, float | None] | None:
    """The type whose grid the 2-D float32 array w (rows a multiple of 32 long) sits on, with its round trip error."""
    import numpy as np

    for ggml_type in ROUND_TRIP_TYPES:
        err = _rel_error(w, ggml_type)
        if err < ON_GRID_FRACTION * FRESH_ERROR[ggml_type]:
            return ggml_type, err
    # Q4_K (gguf-py cannot quantize it): 16 levels per block of 32; weights never quantized have ~32 distinct.
    if w.shape[-1] % 256 == 0:
        blocks = np.sort(w.reshape(-1, 32), axis=1)
        distinct = 1 + (np.diff(blocks, axis=1) != 0).sum(1)
        if (distinct <= 16).mean() > 0.95:
            return "Q4_K", None
    return None


def first_layer_on_grid(model_dir: Path) -> list[OnGrid]:
    """The first decoder layer's Linear weights that sit on a llama.cpp grid, read from the checkpoint's safetensors
    (nothing where there are none: plan may run before the weights are downloaded)."""
    import numpy as np

    files = sorted(Path(model_dir).glob("*.safetensors"))
    try:
        import torch  # noqa: F401  (safetensors' bf16 tensors need it; a plan-only install may lack it)
        from safetensors import safe_open
    except ImportError:
        return []

    found = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                parts = key.split(".")
                if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in LAYER_TENSORS:
                    continue
                if ".layers.0." not in f".{key}" or "vision" in key:
                    continue
                sliced = f.get_slice(key)
                rows, cols = sliced.get_shape()[:2]
                if cols % 32:
                    continue
                w = sliced[: max(1, min(rows, MAX_ELEMENTS // cols))].float().numpy().astype(np.float32)
                hit = grid_of(w)
                if hit:
                    found.append(OnGrid(key, f"blk.0.{LAYER_TENSORS[parts[-2]]}.weight", hit[0], hit[1]))
    return found
