"""Liger's Triton forwards and backwards as fake implementations, for loraship/planning/trace.py: the tensors the
kernels return and allocate (shapes, dtypes, which are views of or written over their inputs), no values, so Liger's
own autograd functions save and free what they do on the GPU.

Liger's kernels are launched from Python, not registered as torch.library operators, so FakeTensorMode cannot run
them; these bodies stand in while a trace runs (`bodies()`), and are put back after. They allocate only what the
kernel does (a kernel's temporaries live in registers), so they compute nothing.
"""

from __future__ import annotations

import contextlib


def rms_norm_forward(X, W, eps, offset, casting_mode, row_mode):
    """Liger's RMSNorm forward: (Y, X as rows, fp32 rstd per row, block size, warps, casting mode)."""
    import torch

    shape = X.shape
    X = X.view(-1, shape[-1])
    rstd = torch.empty(X.shape[0], dtype=torch.float32, device=X.device)
    return torch.empty_like(X).view(*shape), X, rstd, 0, 0, casting_mode


def swiglu_forward(a, b, gate_multiplier=1.0):
    """Liger's SwiGLU forward: (gate and up as rows, silu(gate) * up)."""
    import torch

    shape = a.shape
    a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
    return a, b, torch.empty_like(a).view(*shape)


def geglu_forward(a, b):
    """Liger's GEGLU forward (tanh GELU): (gate and up as rows, gelu(gate) * up)."""
    import torch

    shape = a.shape
    a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
    return a, b, torch.empty_like(a).view(*shape)


def rope_forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """Liger's RoPE forward: q and k rotated in place in a contiguous (batch, seq, heads, dim) copy, as the kernel."""
    q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    return q.transpose(1, 2), k.transpose(1, 2), cos, sin


def rms_norm_backward(dY, X, W, RSTD, offset, casting_mode, BLOCK_SIZE, num_warps, in_place, row_mode, needs_dw=None):
    """Liger's RMSNorm backward: dX written over dY in place or into a new tensor, dW in the weight's dtype."""
    import torch

    shape = dY.shape
    dY = dY.view(-1, shape[-1])
    dX = dY if in_place is True else torch.zeros_like(dY)
    compute_dw = W is not None and (needs_dw is None or needs_dw)
    return dX.view(*shape), (torch.zeros_like(W) if compute_dw else None)


def input_grad(dY, X, W, RSTD, offset, in_place):
    """loraship/training/rms_norm_backward.py input_grad: dX over dY in place or into a new tensor."""
    import torch

    shape = dY.shape
    dY = dY.reshape(-1, shape[-1]).contiguous()
    return (dY if in_place else torch.empty_like(dY)).view(shape)


def gated_backward(a, b, dc, *_multiplier):
    """Liger's SwiGLU and GEGLU backward: both gradients written over the saved gate and up, in place."""
    shape = dc.shape
    return a.view(*shape), b.view(*shape)


def rope_backward(dq, dk, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """Liger's RoPE backward: the gradients rotated back in contiguous (batch, seq, heads, dim) copies."""
    dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
    return dq.transpose(1, 2), dk.transpose(1, 2)


@contextlib.contextmanager
def bodies():
    """Liger's forwards replaced by the bodies above while inside; the originals back after."""
    import liger_kernel.ops.geglu as geglu
    import liger_kernel.ops.rms_norm as rms
    import liger_kernel.ops.rope as rope
    import liger_kernel.ops.swiglu as swiglu
    import liger_kernel.transformers.rope as rope_module

    from loraship.training import rms_norm_backward as frozen_weight_norm

    def dispatch(_op, q, k, cos, sin, pid=None, dim=1, rotary_dim=None):
        # The Triton registration of "rope" (liger_kernel ops/backends/_triton/rope.py) is LigerRopeFunction itself.
        return rope.LigerRopeFunction.apply(q, k, cos, sin, pid, dim, rotary_dim)

    swaps = [
        (rms, "rms_norm_forward", rms_norm_forward),
        (rms, "rms_norm_backward", rms_norm_backward),
        (frozen_weight_norm, "input_grad", input_grad),
        (swiglu, "swiglu_forward", swiglu_forward),
        (swiglu, "swiglu_backward", gated_backward),
        (geglu, "geglu_forward", geglu_forward),
        (geglu, "geglu_backward", gated_backward),
        (rope, "rope_forward", rope_forward),
        (rope, "rope_backward", rope_backward),
        (rope_module, "dispatch", dispatch),
    ]
    from loraship.training import fused_lora

    swaps.append((fused_lora, "_GPU_BRANCH_ON_CPU", True))
    before = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, body in swaps:
            setattr(module, name, body)
        yield
    finally:
        for module, name, original in before:
            setattr(module, name, original)
