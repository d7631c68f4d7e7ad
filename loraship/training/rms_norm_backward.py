"""RMSNorm with Liger's forward and a backward spread over every row block when the weight is frozen.

Liger's backward launches one program per SM and walks each program's rows one after another, so it can add up the
weight's gradient per SM (liger_kernel ops/rms_norm.py rms_norm_backward). Under LoRA the norm weights are frozen and
that gradient is never wanted. Here the input's gradient alone is computed by one program per block of rows, as wide
as the forward: 17.3 ms of kernels over two Gemma-3-12B steps against Liger's 31.9, 1.0-1.6% more tokens/s
(bench/results/train_bench_gemma3_norms.json). A trainable weight still goes through Liger's own backward.

A per-head norm handed attention's heads-first view of its projection (Gemma 3's q/k norms) runs on the projection's
rows as they lie and hands back the same view, so RoPE and flex attention need no copies either: same-dtype copies
over two Gemma-3-12B steps of 4,096 tokens fell from 1,192 launches to 96
(bench/results/train_bench_gemma3_copies.json).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Elements one program holds: 16 rows of a 256-wide per-head norm, or one row of a 4096-wide layer norm.
ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _input_grad_kernel(
    dY_ptr,
    dX_ptr,
    X_ptr,
    W_ptr,
    RSTD_ptr,
    n_rows,
    n_cols,
    offset,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    # dx = rstd * (m - (1/N) * rstd^2 * sum(m * x) * x), m = dy * (w + offset): Liger's formula, in fp32 throughout.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    cols = tl.arange(0, BLOCK_SIZE)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    at = rows[:, None] * n_cols + cols[None, :]
    dy = tl.load(dY_ptr + at, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X_ptr + at, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
        m = dy * w[None, :]
    else:
        m = dy
    dot = tl.sum(m * x, axis=1)
    dx = rstd[:, None] * m - (rstd * rstd * rstd * dot / n_cols)[:, None] * x
    tl.store(dX_ptr + at, dx.to(dX_ptr.dtype.element_ty), mask=mask)


def input_grad(dY: torch.Tensor, X: torch.Tensor, W: torch.Tensor | None, RSTD: torch.Tensor, offset: float, in_place):
    """The gradient of RMSNorm's input, X and RSTD as Liger's forward saved them (rows of X's last dimension)."""
    shape = dY.shape
    n_cols = shape[-1]
    dY = dY.reshape(-1, n_cols).contiguous()
    X = X.reshape(-1, n_cols).contiguous()
    n_rows = dY.shape[0]
    dX = dY if in_place else torch.empty_like(dY)
    block_size = triton.next_power_of_2(n_cols)
    block_row = max(1, min(16, ELEMENTS_PER_PROGRAM // block_size))
    elements = block_row * block_size
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
    _input_grad_kernel[(triton.cdiv(n_rows, block_row),)](
        dY,
        dX,
        X,
        W if W is not None else X,  # not read without a weight
        RSTD,
        n_rows,
        n_cols,
        float(offset),
        HAS_WEIGHT=W is not None,
        BLOCK_SIZE=block_size,
        BLOCK_ROW=block_row,
        num_warps=num_warps,
    )
    return dX.view(shape)


def heads_first_view(X: torch.Tensor) -> bool:
    """Whether X is attention's [batch, heads, tokens, head_dim] view of a projection's contiguous [batch, tokens,
    heads, head_dim] output, as Gemma 3 hands its q/k norms. The norm then runs on the projection's rows where they lie
    and gives back the same view: Liger's own forward copied X to contiguous, RoPE copied it back to tokens-first, and
    attention's output and gradients followed the copy's layout, which cost more copies after it.
    LORASHIP_NORM_LAYOUT=copy keeps that copy (bench/train_bench.py's loraship-before rows)."""
    if os.environ.get("LORASHIP_NORM_LAYOUT") == "copy":
        return False
    return X.dim() == 4 and not X.is_contiguous() and X.transpose(1, 2).is_contiguous()


class FrozenWeightRMSNorm(torch.autograd.Function):
    """Liger's RMSNorm (same forward kernel, same saved tensors); the backward above unless the weight trains."""

    @staticmethod
    def forward(ctx, X, W, eps, offset, casting_mode, in_place, row_mode):
        from liger_kernel.ops.rms_norm import rms_norm_forward

        heads_first = heads_first_view(X)
        if heads_first:
            X = X.transpose(1, 2)  # the projection's own rows, contiguous: no copy
        Y, X_saved, RSTD, block_size, num_warps, mode = rms_norm_forward(
            X.contiguous(), W, eps, offset, casting_mode, row_mode
        )
        ctx.settings = (offset, mode, block_size, num_warps, in_place, row_mode, heads_first)
        ctx.save_for_backward(X_saved, W, RSTD)  # W may be None: saved and given back as None
        return Y.transpose(1, 2) if heads_first else Y

    @staticmethod
    def backward(ctx, dY):
        offset, mode, block_size, num_warps, in_place, row_mode, heads_first = ctx.settings
        X, W, RSTD = ctx.saved_tensors
        if heads_first:
            dY = dY.transpose(1, 2)  # rows in the order X_saved holds them (contiguous when attention kept the layout)
        if W is not None and ctx.needs_input_grad[1]:
            from liger_kernel.ops.rms_norm import rms_norm_backward

            dX, dW = rms_norm_backward(
                dY.contiguous(), X, W, RSTD, offset, mode, block_size, num_warps, in_place, row_mode, needs_dw=True
            )
        else:
            dX, dW = input_grad(dY, X, W, RSTD, offset, in_place), None
        return (dX.transpose(1, 2) if heads_first else dX), dW, None, None, None, None, None


def forward(self, hidden_states):
    """Bound on a module Liger patched (it set offset, casting_mode, in_place, row_mode on it)."""
    return FrozenWeightRMSNorm.apply(
        hidden_states,
        self.weight,
        self.variance_epsilon,
        self.offset,
        self.casting_mode,
        self.in_place,
        self.row_mode,
    )
