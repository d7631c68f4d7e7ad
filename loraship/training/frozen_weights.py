"""The frozen weight under a Linear, as a matmul operand: found on the module (a plain, 4-bit or streamed weight),
the dtype the matmul runs in, and the 4-bit weight dequantized. The fused LoRA nodes (fused_lora.py) and the
recompute's gradient-only down_proj (recompute.py) both read weights this way; neither imports the other for it."""

from __future__ import annotations

import torch


def dequantized(weight, quant_state, dtype):
    """The frozen weight as a matmul operand in `dtype` (a 4-bit weight dequantized first)."""
    if quant_state is not None:
        import bitsandbytes.functional as bnbf

        weight = bnbf.dequantize_4bit(weight, quant_state)
    return weight if weight.dtype == dtype else weight.to(dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls on `x` run in: autocast's (bf16 on the GPU) where it is on, as PEFT's would; else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def base_weight(base):
    """A function device -> (weight, quant_state) of the frozen layer under a LoRA Linear; None where it is not one
    we fuse."""
    stream = getattr(base, "_loraship_weight_on", None)
    if stream is not None:  # streamed from CPU memory (loraship/training/offload.py): this pass's GPU copy
        return stream
    if type(base) is torch.nn.Linear:
        return lambda device: (base.weight, None)
    weight = getattr(base, "weight", None)
    if weight is not None and type(weight).__name__ == "Params4bit":
        return lambda device: (base.weight, base.weight.quant_state)
    return None
