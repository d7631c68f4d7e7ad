"""Base models stored pre-quantized by bitsandbytes (the `-bnb-4bit` folders users download): what they are, and
their weights back in bf16 for merge.

Such a folder's config.json carries `quantization_config` (quant_method bitsandbytes, load_in_4bit) and each
quantized Linear's weight is packed uint8 with its quantization state beside it under the weight's name
(`<name>.absmax`, `.quant_map`, `.nested_absmax`, `.nested_quant_map`, `.quant_state.bitsandbytes__nf4`), as
bitsandbytes' Params4bit serializes it. transformers loads it 4-bit as it is, so train runs QLoRA on exactly these
weights; there is no bf16 original to merge into, so merge dequantizes them: the adapter lands on the weights it was
trained against, and the merged model carries their 4-bit rounding.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

QUANT_STATE_MARK = ".quant_state.bitsandbytes__"
# The tensors bitsandbytes writes beside a packed 4-bit weight (QuantState.as_dict(packed=True)).
COMPANIONS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def bnb_quantization(model_config: dict | None) -> str | None:
    """'4bit' or '8bit' when config.json says the weights are stored quantized by bitsandbytes, else None."""
    q = (model_config or {}).get("quantization_config") or {}
    if q.get("quant_method") != "bitsandbytes":
        return None
    if q.get("load_in_4bit") or q.get("_load_in_4bit"):
        return "4bit"
    if q.get("load_in_8bit") or q.get("_load_in_8bit"):
        return "8bit"
    return None


# One expert's own packed Linear (mlp.experts.7.gate_proj.weight.quant_state...): the per-expert layout of checkpoints
# quantized before transformers v5 stored a layer's experts as fused 3-D tensors.
PER_EXPERT_PACKED = re.compile(r"\.experts\.\d+\.[^.]+\.weight\.quant_state\.")


def problems(model_config: dict | None, adapter: str, folder: Path | None = None) -> list[str]:
    """A pre-quantized base trains as QLoRA only: its weights exist in 4 bits; 8-bit ones are not trained here; and a
    mixture of experts quantized one expert Linear at a time cannot be loaded into transformers' fused experts."""
    kind = bnb_quantization(model_config)
    if kind == "4bit" and folder is not None:
        per_expert = sorted(n for n in tensor_names(folder) if PER_EXPERT_PACKED.search(n))
        if per_expert:
            return [
                f"stores its experts as separate 4-bit Linears ({per_expert[0].split('.quant_state')[0]}, ...), "
                "the layout of -bnb-4bit folders made before transformers v5, which loads a layer's experts into "
                "fused 3-D tensors and cannot take them packed one by one; fix: point base_model at the bf16 "
                "original (under adapter: qlora loraship stores every expert in 4-bit itself)"
            ]
    if kind == "8bit":
        return [
            "stored 8-bit by bitsandbytes (quantization_config load_in_8bit), which loraship cannot train or merge; "
            "fix: point base_model at the bf16 original, or at its 4-bit (-bnb-4bit) version"
        ]
    if kind == "4bit" and adapter != "qlora":
        return [
            "stored 4-bit by bitsandbytes (quantization_config load_in_4bit): its weights exist only in NF4, so "
            f"adapter: {adapter} cannot load them in bf16; fix: set adapter: qlora, or point base_model at the bf16 "
            "original"
        ]
    return []


def packed_weights(names: set[str]) -> dict[str, str]:
    """{weight name: its quant-state key} for every packed 4-bit weight among a shard's tensor names."""
    out = {}
    for name in names:
        if QUANT_STATE_MARK in name:
            out[name.split(QUANT_STATE_MARK)[0]] = name
    return out


def is_companion(name: str, packed: dict[str, str]) -> bool:
    base, _, last = name.rpartition(".")
    return (last in COMPANIONS and base in packed) or QUANT_STATE_MARK in name


def dequantized(f, dtype) -> Iterator[tuple[str, object]]:
    """Each tensor of an open safetensors shard (safe_open), the packed 4-bit weights dequantized to `dtype` under
    their own names and their quantization states left out; other tensors as stored."""
    from bitsandbytes.functional import QuantState, dequantize_4bit

    names = set(f.keys())
    packed = packed_weights(names)
    for name in sorted(names):
        if is_companion(name, packed):
            continue
        w = f.get_tensor(name)
        if name in packed:
            state = {packed[name]: f.get_tensor(packed[name])}
            state.update({f"{name}.{c}": f.get_tensor(f"{name}.{c}") for c in COMPANIONS if f"{name}.{c}" in names})
            w = dequantize_4bit(w, QuantState.from_dict(state, device=w.device)).to(dtype)
        yield name, w


def weight_names(names: set[str]) -> set[str]:
    """A shard's tensor names as the model has them: the quantization states' own entries left out."""
    packed = packed_weights(names)
    return {n for n in names if not is_companion(n, packed)}


def tensor_names(folder: Path) -> set[str]:
    """Every tensor name of a checkpoint folder: from its shard index, else from the safetensors headers."""
    from loraship.safetensors_check import read_header

    names: set[str] = set()
    for index in folder.glob("*.safetensors.index.json"):
        try:
            names.update(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}))
        except (OSError, ValueError, AttributeError):
            continue  # shard_index_problems names a broken index
    if not names:
        for shard in folder.glob("*.safetensors"):
            try:
                names.update(k for k in read_header(shard)[1] if k != "__metadata__")
            except (OSError, ValueError):
                continue  # safetensors_problem names a broken shard
    return names
