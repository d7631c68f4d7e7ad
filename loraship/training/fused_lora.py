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

Under Liger's SwiGLU MLP (the train stage's on CUDA), down_proj's node also takes the activation: it keeps gate
and up, which the SwiGLU keeps anyway, and rebuilds h = silu(gate) * up in backward (SwiGLUDownLora), where the
separate nodes kept h as well.

What the fused node keeps for backward: the input (shared with whatever else reads it), the rank-r
product x A^T, bf16 casts of A and B (r x features, small), the dropout mask; the frozen weight is kept by
reference (QLoRA: the packed 4-bit weight, dequantized again in backward, as bitsandbytes' MatMul4Bit does).
loraship/planning/estimate.py lora_saved_per_token counts exactly these.

Inside the train stage's step loop (casts_kept_until_step) the bf16 casts of the fp32 A and B are made once per
optimizer step and reused by every micro-batch's forward and every recompute, not made again each time: they were
1,644 of the 1,834 casting copies in two profiled Gemma-3-12B steps (bench/results/train_bench_gemma3_copies.json).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from loraship.training.frozen_weights import base_weight, compute_dtype, dequantized
from loraship.training.recompute import output_unused

log = logging.getLogger("loraship.train")


# id(master) -> (master, its version and storage when cast, the cast); None outside casts_kept_until_step.
_kept_casts: dict[int, tuple] | None = None


def _compute_copy(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A LoRA master weight as a matmul operand in `dtype`: the cast kept since the last optimizer step where it
    still matches the master (same tensor, version and storage), else a new one."""
    if master.dtype == dtype:
        return master
    kept = _kept_casts
    if kept is None:
        return master.to(dtype)
    stamp = (master._version, master.data_ptr())
    entry = kept.get(id(master))
    if entry is not None and entry[0] is master and entry[1] == stamp and entry[2].dtype == dtype:
        return entry[2]
    cast = master.detach().to(dtype)
    kept[id(master)] = (master, stamp, cast)
    return cast


def lora_casts_kept_wanted() -> bool:
    """LORASHIP_LORA_CASTS=each casts A and B at every forward and recompute, as before the casts were kept: for
    comparing the two (bench/train_bench.py's loraship-recast rows)."""
    return os.environ.get("LORASHIP_LORA_CASTS", "kept") != "each"


@contextlib.contextmanager
def casts_kept_until_step(optimizer, enabled: bool = True):
    """While the block runs, A's and B's compute-dtype casts are made once and dropped after each optimizer step
    (its post hook); a master changed in place otherwise (a checkpoint loaded into it) is cast again, by its version.
    Not under FSDP2 (enabled=False): its gathered parameters reuse storage from one gather to the next."""
    global _kept_casts
    if not enabled or not lora_casts_kept_wanted():
        yield
        return
    kept: dict[int, tuple] = {}
    handle = optimizer.register_step_post_hook(lambda *_: kept.clear())
    _kept_casts = kept
    try:
        yield
    finally:
        _kept_casts = None
        handle.remove()
        kept.clear()


def _lora_forward(
    x2, weight, quant_state, bias, lora_a, lora_b, scaling, dropout_p, compute_dtype, output_unused=False
):
    """x2 [tokens, in] in compute dtype -> (out, xa, a, b, mask): out = x2 W^T (+ bias) + s (drop(x2) A^T) B^T.
    output_unused (a recompute that never reads out: loraship/training/recompute.py): out is zeros, no GEMM; what
    backward keeps (xa, the mask: same random draws) is computed as ever."""
    a, b = _compute_copy(lora_a, compute_dtype), _compute_copy(lora_b, compute_dtype)
    if output_unused:
        out = x2.new_zeros(x2.shape[0], b.shape[0])
    else:
        w = dequantized(weight, quant_state, compute_dtype)
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
    if not output_unused:
        out.addmm_(xa, b.t(), alpha=scaling)  # the LoRA term added inside the GEMM, no extra pass
    return out, xa, a, b, mask


def _lora_backward(ctx, g, x2, xa, a, b, weight, mask, needs_x: bool, needs_a: bool, needs_b: bool):
    """Gradients (x2's in compute dtype, A's and B's in their masters' dtypes) from g = d out [tokens, out]."""
    s = ctx.scaling
    if g.dtype != xa.dtype:
        g = g.to(xa.dtype)
    grad_x = grad_a = grad_b = None
    d_xa = torch.mm(g, b).mul_(s)  # [tokens, r]
    if needs_b:
        grad_b = torch.mm(g.t(), xa).mul_(s).to(ctx.master_dtypes[1])
    if needs_a:
        dropped = x2 if mask is None else (x2 * mask).mul_(1.0 / (1.0 - ctx.dropout_p))
        grad_a = torch.mm(d_xa.t(), dropped).to(ctx.master_dtypes[0])
        del dropped  # an input-sized copy under dropout: gone before the input gradient below is made
    if needs_x:
        w = dequantized(weight, ctx.quant_state, g.dtype)
        grad_x = torch.mm(g, w)
        if mask is None:
            grad_x.addmm_(d_xa, a)  # dx's LoRA part added inside the GEMM too
        else:
            grad_x.add_(torch.mm(d_xa, a).mul_(mask).mul_(1.0 / (1.0 - ctx.dropout_p)))
    return grad_x, grad_a, grad_b


def _keep_lora_state(ctx, quant_state, scaling, dropout_p, lora_a, lora_b):
    ctx.quant_state, ctx.scaling, ctx.dropout_p = quant_state, scaling, dropout_p
    ctx.master_dtypes = (lora_a.dtype, lora_b.dtype)


class FusedLoraLinear(torch.autograd.Function):
    """out = x W^T (+ bias) + scaling * (dropout(x) A^T) B^T; gradients for x, A and B (W and bias frozen)."""

    @staticmethod
    def forward(
        ctx, x, weight, quant_state, bias, lora_a, lora_b, scaling, dropout_p, compute_dtype, output_unused=False
    ):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != compute_dtype:
            x2 = x2.to(compute_dtype)
        out, xa, a, b, mask = _lora_forward(
            x2, weight, quant_state, bias, lora_a, lora_b, scaling, dropout_p, compute_dtype, output_unused
        )
        ctx.save_for_backward(x2, xa, a, b, weight, mask)
        _keep_lora_state(ctx, quant_state, scaling, dropout_p, lora_a, lora_b)
        ctx.x_shape, ctx.x_dtype = shape, x.dtype
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, xa, a, b, weight, mask = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x, grad_a, grad_b = _lora_backward(
            ctx,
            g,
            x2,
            xa,
            a,
            b,
            weight,
            mask,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[4],
            ctx.needs_input_grad[5],
        )
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        return grad_x, None, None, None, grad_a, grad_b, None, None, None, None


# Set while loraship/planning/trace.py counts a layer on fake CPU tensors: the GPU branches below run (Liger's kernels,
# whose bodies the trace swaps for torch code), so the count is the GPU step's.
_GPU_BRANCH_ON_CPU = False


def _gpu_branch(t: torch.Tensor) -> bool:
    return t.is_cuda or _GPU_BRANCH_ON_CPU


def _swiglu(gate, up):
    """silu(gate) * up: Liger's Triton kernel on the GPU (the one its SwiGLU MLP runs), torch's ops elsewhere."""
    if _gpu_branch(gate):
        from liger_kernel.ops.swiglu import swiglu_forward

        return swiglu_forward(gate, up)[2]
    return torch.nn.functional.silu(gate) * up


def _swiglu_backward(gate, up, grad_h):
    """(d gate, d up) of h = silu(gate) * up. On the GPU Liger's kernel writes them over gate and up."""
    if _gpu_branch(gate):
        from liger_kernel.ops.swiglu import swiglu_backward

        return swiglu_backward(gate, up, grad_h)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    return grad_h * up * sig * (1 + gate * (1 - sig)), grad_h * silu


class SwiGLUDownLora(torch.autograd.Function):
    """out = down(silu(gate) * up) with down a LoRA Linear, as one node that keeps gate and up only.

    Liger's SwiGLU keeps gate and up, and down's LoRA needs its input h = silu(gate) * up for A's gradient:
    separately, h is kept too (2 bytes per intermediate feature per token, a quarter of a Qwen2-7B all-linear
    layer's saved activations). Here h is rebuilt from gate and up in backward (one elementwise kernel), as
    Unsloth's LoRA_MLP does (its fast_lora.py recomputes the activation in backward)."""

    @staticmethod
    def forward(
        ctx,
        gate,
        up,
        weight,
        quant_state,
        bias,
        lora_a,
        lora_b,
        scaling,
        dropout_p,
        compute_dtype,
        output_unused=False,
    ):
        shape = gate.shape
        g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
        if g2.dtype != compute_dtype:
            g2, u2 = g2.to(compute_dtype), u2.to(compute_dtype)
        h = _swiglu(g2, u2)
        out, xa, a, b, mask = _lora_forward(
            h, weight, quant_state, bias, lora_a, lora_b, scaling, dropout_p, compute_dtype, output_unused
        )
        del h
        ctx.save_for_backward(g2, u2, xa, a, b, weight, mask)
        _keep_lora_state(ctx, quant_state, scaling, dropout_p, lora_a, lora_b)
        ctx.in_shape, ctx.in_dtypes = shape, (gate.dtype, up.dtype)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        g2, u2, xa, a, b, weight, mask = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if g.dtype != xa.dtype:
            g = g.to(xa.dtype)  # once, for both calls below
        # h (for A's gradient) and h's gradient are each the size of gate: h goes before its gradient is made, so the
        # layer's backward holds one such tensor beyond gate and up, not two (B's product g B is computed twice:
        # r wide).
        grad_a = grad_b = None
        if ctx.needs_input_grad[5] or ctx.needs_input_grad[6]:
            h = _swiglu(g2, u2)
            _, grad_a, grad_b = _lora_backward(
                ctx, g, h, xa, a, b, weight, mask, False, ctx.needs_input_grad[5], ctx.needs_input_grad[6]
            )
            del h
        grad_h, _, _ = _lora_backward(ctx, g, None, xa, a, b, weight, mask, True, False, False)
        grad_gate, grad_up = _swiglu_backward(g2, u2, grad_h)
        return (
            grad_gate.view(ctx.in_shape).to(ctx.in_dtypes[0]),
            grad_up.view(ctx.in_shape).to(ctx.in_dtypes[1]),
            None,
            None,
            None,
            grad_a,
            grad_b,
            None,
            None,
            None,
            None,
        )


def fusable(module) -> str | None:
    """Why a PEFT LoRA Linear cannot take the fused path, or None when it can."""
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    if getattr(module, "lora_variant", None):
        return "a LoRA variant (DoRA, ...)"
    if len(module.active_adapters) != 1:
        return "more than one active adapter"
    if base_weight(module.base_layer) is None:
        return f"a {type(module.base_layer).__name__} base layer"
    return None


def _lora_args(module, x) -> tuple | None:
    """What the fused nodes take after the input: (weight, quant_state, bias, A, B, scaling, dropout p, compute
    dtype); None where PEFT must run it (merged or disabled adapters)."""
    if module.merged or module.disable_adapters:
        return None
    name = module.active_adapters[0]
    dropout = module.lora_dropout[name]
    p = dropout.p if module.training and isinstance(dropout, torch.nn.Dropout) else 0.0
    # Looked up per call: weights streamed from CPU memory may be set up after this (offload_frozen_layers).
    weight, quant_state = base_weight(module.base_layer)(x.device)
    return (
        weight,
        quant_state,
        module.base_layer.bias,
        module.lora_A[name].weight,
        module.lora_B[name].weight,
        module.scaling[name],
        p,
        compute_dtype(x),
    )


def _fused_forward(module):
    peft_forward = module.forward

    def forward(x, *args, **kwargs):
        # Anything PEFT does beyond plain LoRA (merged or disabled adapters, mixed batches) goes its own way.
        lora = None if args or kwargs else _lora_args(module, x)
        if lora is None:
            return peft_forward(x, *args, **kwargs)
        return FusedLoraLinear.apply(x, *lora, output_unused(module))

    return forward


def _swiglu_down_forward(mlp):
    """forward of a Liger SwiGLU MLP whose down_proj is a fused LoRA Linear: down's node keeps gate and up, not h."""

    own_forward = mlp.forward

    def forward(x):
        lora = _lora_args(mlp.down_proj, x)  # x: the same device and autocast state as down's input
        if lora is None:
            return own_forward(x)
        return SwiGLUDownLora.apply(mlp.gate_proj(x), mlp.up_proj(x), *lora, output_unused(mlp.down_proj))

    return forward


def _liger_swiglu_forward():
    """Liger's SwiGLU MLP forward (down(silu(gate(x)) * up(x)), the train stage's on CUDA); None without Liger."""
    try:
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    except ImportError:
        return None
    return LigerSwiGLUMLP.forward


def fuse_swiglu_down(model, only_liger: bool = True) -> int:
    """Run every SwiGLU MLP whose down_proj took the fused LoRA path through SwiGLUDownLora; how many.

    Only MLPs running Liger's SwiGLU forward unless only_liger=False (the tests, on the CPU, where the train stage
    applies no Liger kernel): an MLP forward of another shape (Gemma's GELU, Phi-3's fused gate_up_proj) is not
    silu(gate) * up and keeps its own."""
    n, liger_forward = 0, _liger_swiglu_forward() if only_liger else None
    for mlp in model.modules():
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            continue
        if not getattr(mlp.down_proj, "_loraship_fused", False):
            continue
        if only_liger and (liger_forward is None or getattr(mlp.forward, "__func__", None) is not liger_forward):
            continue
        if not only_liger and getattr(getattr(mlp, "config", None), "hidden_act", "silu") not in ("silu", "swish"):
            continue
        mlp.forward = _swiglu_down_forward(mlp)
        n += 1
    return n


def fused_lora_wanted() -> bool:
    """LORASHIP_FUSED_LORA=0 leaves every LoRA Linear to PEFT: for comparing the two (bench/train_bench.py's
    loraship-unfused rows) and for ruling this path out when a run misbehaves."""
    import os

    return os.environ.get("LORASHIP_FUSED_LORA", "1") != "0"


def fuse_lora_linears(model, only_liger: bool = True) -> dict:
    """Route every PEFT LoRA Linear that can take it through FusedLoraLinear, and each SwiGLU MLP whose down_proj
    took it through SwiGLUDownLora (fuse_swiglu_down); {fused: n, unfused: {why: n}, swiglu_down: n}."""
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
        module._loraship_fused = True
        fused += 1
    mlps = fuse_swiglu_down(model, only_liger)
    if unfused:
        log.info("train: %d LoRA Linears fused; left to PEFT: %s", fused, unfused)
    return {"fused": fused, "unfused": unfused, "swiglu_down": mlps}
