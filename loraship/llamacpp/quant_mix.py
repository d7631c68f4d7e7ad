"""The ggml type llama.cpp's quantizer gives each tensor of a dense model at each quantization loraship ships, and
the file size that follows: its rules (llama_tensor_get_type_impl and tensor_type_fallback in src/llama-quant.cpp of
the pinned llama-cpp-python's vendor/llama.cpp) for the rungs of config.Quantization, on tensor names and shapes.

A K-quant or i-quant type packs rows in blocks of 256; a tensor whose rows (ne0, a linear layer's input features)
are not a multiple of 256 falls back to a type of blocks of 32 (Q4_K -> Q5_0, IQ3_S -> IQ4_NL, ...). Gemma 3 270M
(rows of 640) and 1B (1152) have most of their tensors fall back, so their Q4_K_M is mostly Q5_0, not Q4_K:
plan says so (tasks/plan.py) and verify's failure names the rungs out (loraship/verification/way_out.py).
tests/test_quant_mix.py checks these types against llama-quantize's own output on the real Gemma 3 270M.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

QK_K = 256  # the block of the K-quants and i-quants (ggml's QK_K)

# llama_ftype_get_default_type: the type every quantized tensor starts from.
DEFAULT_TYPE = {
    "Q8_0": "Q8_0",
    "Q6_K": "Q6_K",
    "Q5_K_M": "Q5_K",
    "Q5_K_S": "Q5_K",
    "Q4_K_M": "Q4_K",
    "Q4_K_S": "Q4_K",
    "IQ4_XS": "IQ4_XS",
    "Q3_K_L": "Q3_K",
    "Q3_K_M": "Q3_K",
    "IQ3_M": "IQ3_S",
}
# tensor_type_fallback: where rows are not a multiple of the type's block.
FALLBACK = {"IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


@dataclass(frozen=True)
class TensorType:
    """One tensor's type at a quantization: what the rung's mix asked for, and what it got after the fallback."""

    name: str
    rows: int  # ne0
    elements: int
    wanted: str | None  # None: not quantized (a norm, a 1-D tensor): it keeps its type
    got: str | None

    @property
    def fell_back(self) -> bool:
        return self.wanted != self.got


def block_size(ggml_type: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][0]


def type_bits(ggml_type: str) -> float:
    """Bits per weight of a ggml type (gguf-py's block size and bytes per block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return 8 * size / block


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _mix_type(q: str, name: str, rows: int, tied: bool, n_layer: int, n_gqa: int, imatrix: bool, wv: int) -> str:
    """llama_tensor_get_type_impl for a dense (not MoE, not Falcon) model at rung q, before the fallback. wv: how
    many attn_v tensors came before this one (layer order)."""
    t = DEFAULT_TYPE[q]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if rows % block_size(t):
            return "Q8_0"
        return t if t == "Q8_0" else "Q6_K"
    i = _layer(name)
    if "attn_v.weight" in name or "attn_qkv.weight" in name:
        if "attn_qkv.weight" in name:
            return {"Q3_K_M": "Q4_K", "Q3_K_L": "Q4_K", "IQ3_M": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(q, t)
        if q == "IQ3_M":
            return "Q4_K"
        if q == "Q3_K_M":
            return "Q5_K" if wv < 2 else "Q4_K"
        if q == "Q3_K_L":
            return "Q5_K"
        if q == "IQ4_XS" and n_gqa >= 4:
            return "Q5_K"
        if q in ("Q4_K_M", "Q5_K_M") and _more_bits(wv, n_layer):
            return "Q6_K"
        if q == "Q4_K_S" and wv < 4:
            return "Q5_K"
        return t
    if "ffn_down" in name:
        if q == "Q3_K_M":
            return "Q5_K" if i < n_layer // 16 else "Q4_K"
        if q == "IQ3_M" and i < n_layer // 8:
            return "Q4_K"
        if q == "Q3_K_L":
            return "Q5_K"
        if q in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n_layer):
            return "Q6_K"
        if q == "IQ4_XS" and i < n_layer // 8 and not imatrix:
            return "Q5_K"
        if q == "Q4_K_S" and i < n_layer // 8:
            return "Q5_K"
        return t
    if "attn_output.weight" in name:
        return {"Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}.get(q, t)
    return t


def _quantized(name: str, dims: int) -> bool:
    """tensor_allows_quantization for a text model's tensors: 2-D or more, a weight, not a norm."""
    return dims >= 2 and name.endswith("weight") and "_norm.weight" not in name


def tensor_types(
    tensors: list[tuple[str, tuple[int, ...]]], quantization: str, n_layer: int, n_gqa: int, imatrix: bool = True
) -> list[TensorType]:
    """Each tensor's type at `quantization`. tensors: (GGUF name, shape in ggml order, ne0 first), as gguf-py's
    ReaderTensor has them; n_gqa: attention heads per KV head."""
    import math

    tied = not any(name == "output.weight" for name, _ in tensors)
    order = sorted(tensors, key=lambda t: (_layer(t[0]), t[0]))  # llama.cpp's weight_name_comparer
    out, wv = [], 0
    for name, shape in order:
        rows, elements = int(shape[0]), math.prod(int(d) for d in shape)
        if not _quantized(name, len(shape)):
            out.append(TensorType(name, rows, elements, None, None))
            continue
        wanted = _mix_type(quantization, name, rows, tied, n_layer, n_gqa, imatrix, wv)
        if "attn_v.weight" in name:
            wv += 1
        got = wanted
        if rows % block_size(wanted):
            got = FALLBACK.get(wanted, "F16")
            if rows % block_size(got):
                got = "F16"
        out.append(TensorType(name, rows, elements, wanted, got))
    return out


@dataclass(frozen=True)
class MixSummary:
    """What a quantization does to a model's tensors: how many are quantized, how many fell back (to which
    types, for which row sizes), and the weights' estimated bytes."""

    quantization: str
    quantized: int
    fell_back: int
    fallback_types: tuple[str, ...]
    rows: tuple[int, ...]  # the row sizes that fell back
    weight_bytes: int

    def words(self) -> str:
        return (
            f"{self.quantization}: {self.fell_back} of {self.quantized} quantized tensors fall back to "
            f"{'/'.join(self.fallback_types)} (rows of {'/'.join(map(str, self.rows))} are not a multiple of {QK_K})"
        )


def summarize(types: list[TensorType], quantization: str, unquantized_bits: float = 32.0) -> MixSummary:
    """unquantized_bits: what the tensors left alone weigh (F32 norms in a converted GGUF)."""
    quantized = [t for t in types if t.got is not None]
    back = [t for t in quantized if t.fell_back]
    bits = sum(t.elements * (type_bits(t.got) if t.got else unquantized_bits) for t in types)
    return MixSummary(
        quantization,
        len(quantized),
        len(back),
        tuple(sorted({t.got for t in back})),
        tuple(sorted({t.rows for t in back})),
        int(bits / 8),
    )


@dataclass(frozen=True)
class GGUFLayout:
    """What quant_mix needs of a GGUF: its tensors (name, ggml shape, ne0 first), layer count, attention heads per
    KV head, and the bytes its tensor data take (the rest of the file is metadata: tokenizer, template)."""

    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    n_layer: int
    n_gqa: int
    data_bytes: int


def gguf_layout(path) -> GGUFLayout:
    """Read once per file version: gguf-py parses the whole vocabulary with the tensor list (seconds for 262k)."""
    import os

    st = os.stat(path)
    return _layout(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _layout(path: str, _mtime_ns: int, _size: int) -> GGUFLayout:
    from loraship.llamacpp.gguf_info import open_gguf

    reader = open_gguf(path)  # the project's fast reader: gguf's own took minutes on a 262k vocabulary
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def scalar(key: str) -> int:
        field = reader.fields[f"{arch}.{key}"]
        return int(field.parts[field.data[0]][0])

    heads = scalar("attention.head_count")
    kv = scalar("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in reader.fields else heads
    return GGUFLayout(
        tuple((t.name, tuple(int(d) for d in t.shape)) for t in reader.tensors),
        scalar("block_count"),
        max(heads // max(kv, 1), 1),
        sum(int(t.n_bytes) for t in reader.tensors),
    )


def gguf_tensors(path) -> tuple[list[tuple[str, tuple[int, ...]]], int, int]:
    """A GGUF's tensors (name, ggml shape), its layer count and heads per KV head, read with gguf-py."""
    layout = gguf_layout(path)
    return list(layout.tensors), layout.n_layer, layout.n_gqa


# The HF decoder Linear names (planning/shape.py Shape.linears) as llama.cpp's converter names their GGUF tensors.
GGUF_LINEAR_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "qkv_proj": "attn_qkv",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "gate_up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def planned_tensors(
    linears: dict[str, tuple[int, int]], n_layer: int, hidden: int, vocab: int, tied: bool
) -> list[tuple[str, tuple[int, ...]]]:
    """The GGUF tensors (name, ggml shape) a converted model will have, from its decoder Linears (name -> (in, out)):
    what plan knows before any weights exist. Norms are left out (never quantized)."""
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (hidden, vocab))]
    if not tied:
        out.append(("output.weight", (hidden, vocab)))
    for i in range(n_layer):
        for name, (n_in, n_out) in linears.items():
            gguf = GGUF_LINEAR_NAMES.get(name)
            if gguf:
                out.append((f"blk.{i}.{gguf}.weight", (n_in, n_out)))
    return out
