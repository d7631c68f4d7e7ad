"""LoRA Linears as one autograd node each: y = x W^T + b + s * (drop(x) A^T) B^T.

PEFT's LoRA Linear runs the frozen matmul, then lora_B(lora_A(dropout(x))) * scaling as separate ops, and
adds: two extra passes over every output in forward (the scale, the add) and their mirrors in backward,
plus, under QLoRA, a defensive clone of the base output (peft/tuners/lora/bnb.py). Here the LoRA term is
added by the GEMM itself (addmm's epilogue: out += s * xa @ B^T) and in backward the input gradient gets
its LoRA part the same way (dx = g W + s * (g B) A); gradients go to A and B only, W is frozen. This is
the arithmetic of Unsloth's matmul_lora / LoRA_QKV / LoRA_MLP, written over torch ops, so it runs on the
CPU too (tests/test_fused_lora.py checks it against PEFT's own forward and backward there).

Dropout keeps a 1-byte mask per input feature instead of PEFT's dropped-out copy of the input (2 bytes in
bf16) plus its mask: the dropped input is rebuilt from the kept input in backward.

What the fused node keeps for backward: the input (shared with whatever else reads it), the rank-r
product x A^T, bf16 casts of A and B (r x features, small), the dropout mask; the frozen weight is kept by
reference (QLoRA: the packed 4-bit weight, dequantized again in backward, as bitsandbytes' MatMul4Bit does).
loraship/planning/memory.py lora_saved_per_token counts exactly these.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("loraship.train")


def _dequantized(weight, quant_state):
    if quant_state is None:
        return weight
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(weight, quant_state)


class FusedLoraLinear(torch.autograd.Function):
    """out = x W^T (+ bias) + scaling * (dropout(x) A^T) B^T; gradients for x, A and B (W and bias frozen)."""

    @staticmethod
    def forward(ctx, x, weight, quant_state, bias, lora_a, lora_b, scaling, dropout_p, compute_dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != compute_dtype:
            x2 = x2.to(compute_dtype)
        w = _dequantized(weight, quant_state)
        if w.dtype != compute_dtype:
            w = w.to(compute_dtype)
        a, b = lora_a.to(compute_dtype), lora_b.to(compute_dtype)
        if bias is not None:
            out = torch.addmm(bias.to(compute_dtype), x2, w.t())
        else:
            out = torch.mm(x2, w.t())
        mask = None
        if dropout_p > 0:
            # Drawn straight into a bool tensor: no float tensor of random numbers the size of the input.
            mask = torch.empty_like(x2, dtype=torch.bool).bernoulli_(1.0 - dropout_p)
            xa = torch.mm((x2 * mask).mul_(1.0 / (1.0 - dropout_p)), a.t())
        else:
            xa = torch.mm(x2, a.t())
        out.addmm_(xa, b.t(), alpha=scaling)  # the LoRA term added inside the GEMM, no extra pass
        ctx.save_for_backward(x2, xa, a, b, weight, mask)
        ctx.quant_state, ctx.scaling, ctx.dropout_p = quant_state, scaling, dropout_p
        ctx.x_shape, ctx.x_dtype = shape, x.dtype
        ctx.master_dtypes = (lora_a.dtype, lora_b.dtype)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, xa, a, b, weight, mask = ctx.saved_tensors
        s = ctx.scaling
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if g.dtype != xa.dtype:
            g = g.to(xa.dtype)
        grad_x = grad_a = grad_b = None
        d_xa = torch.mm(g, b).mul_(s)  # [tokens, r]
        if ctx.needs_input_grad[5]:
            grad_b = torch.mm(g.t(), xa).mul_(s).to(ctx.master_dtypes[1])
        if ctx.needs_input_grad[4]:
            dropped = x2 if mask is None else (x2 * mask).mul_(1.0 / (1.0 - ctx.dropout_p))
            grad_a = torch.mm(d_xa.t(), dropped).to(ctx.master_dtypes[0])
        if ctx.needs_input_grad[0]:
            w = _dequantized(weight, ctx.quant_state)
            if w.dtype != g.dtype:
                w = w.to(g.dtype)
            grad_x = torch.mm(g, w)
            if mask is None:
                grad_x.addmm_(d_xa, a)  # dx's LoRA part added inside the GEMM too
            else:
                grad_x.add_(torch.mm(d_xa, a).mul_(mask).mul_(1.0 / (1.0 - ctx.dropout_p)))
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        return grad_x, None, None, None, grad_a, grad_b, None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Under autocast the matmuls run in its dtype (bf16 on the GPU), as PEFT's would; otherwise in x's.
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _base_weight(base):
    """(weight, quant_state) of the frozen layer under a LoRA Linear; None where it is not one we fuse."""
    stream = getattr(base, "_loraship_weight_on", None)
    if stream is not None:  # streamed from CPU memory (loraship/training/offload.py): this pass's GPU copy
        return stream
    if type(base) is torch.nn.Linear:
        return lambda device: (base.weight, None)
    weight = getattr(base, "weight", None)
    if weight is not None and type(weight).__name__ == "Params4bit":
        return lambda device: (base.weight, base.weight.quant_state)
    return None


def fusable(module) -> str | None:
    """Why a PEFT LoRA Linear cannot take the fused path, or None when it can."""
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    if getattr(module, "lora_variant", None):
        return "a LoRA variant (DoRA, ...)"
    if len(module.active_adapters) != 1:
        return "more than one active adapter"
    if _base_weight(module.base_layer) is None:
        return f"a {type(module.base_layer).__name__} base layer"
    return None


def _fused_forward(module):
    peft_forward = module.forward

    def forward(x, *args, **kwargs):
        # Anything PEFT does beyond plain LoRA (merged or disabled adapters, mixed batches) goes its own way.
        if args or kwargs or module.merged or module.disable_adapters:
            return peft_forward(x, *args, **kwargs)
        name = module.active_adapters[0]
        dropout = module.lora_dropout[name]
        p = dropout.p if module.training and isinstance(dropout, torch.nn.Dropout) else 0.0
        # Looked up per call: weights streamed from CPU memory may be set up after this (offload_frozen_layers).
        weight, quant_state = _base_weight(module.base_layer)(x.device)
        return FusedLoraLinear.apply(x, weight, quant_state, module.base_layer.bias, module.lora_A[name].weight,
                                     module.lora_B[name].weight, module.scaling[name], p, _compute_dtype(x))

    return forward


def fused_lora_wanted() -> bool:
    """LORASHIP_FUSED_LORA=0 leaves every LoRA Linear to PEFT: for comparing the two (bench/train_bench.py's
    loraship-unfused rows) and for ruling this path out when a run misbehaves."""
    import os

    return os.environ.get("LORASHIP_FUSED_LORA", "1") != "0"


def fuse_lora_linears(model) -> dict:
    """Route every PEFT LoRA Linear that can take it through FusedLoraLinear; {fused: n, unfused: {why: n}}."""
    from peft.tuners.lora.layer import LoraLayer

    fused, unfused = 0, {}
    for module in model.modules():
        if not isinstance(module, LoraLayer) or not hasattr(module, "base_layer"):
            continue
        if not isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) or not module.lora_A:
            continue
        why = fusable(module)
        if why is not None:
            unfused[why] = unfused.get(why, 0) + 1
            continue
        module.forward = _fused_forward(module)  # an instance attribute: nn.Module.__call__ runs it
        fused += 1
    if unfused:
        log.info("train: %d LoRA Linears fused; left to PEFT: %s", fused, unfused)
    return {"fused": fused, "unfused": unfused}
