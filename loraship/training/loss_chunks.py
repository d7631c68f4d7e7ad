"""Chunks of Liger's fused linear cross-entropy sized by rows, not by the hidden states' bytes.

Liger bounds a chunk's logits to chunk_mem_const x T x h entries, 1 by default: on a 262k vocabulary that is 64 rows,
and each chunk rereads the whole lm_head in a skinny GEMM. Liger's causal-LM forwards pass no chunk_mem_const, so
the loss function they call gets one here, from the rule the planner counts (loss_chunk_mem_const).
LORASHIP_LOSS_CHUNKS=liger keeps Liger's own chunks (bench/train_bench.py's loraship-chunks-liger rows compare them).
"""

from __future__ import annotations

import functools
import inspect
import os

from loraship.errors import LorashipError
from loraship.fused_loss import loss_chunk_mem_const


def widen_loss_chunks() -> None:
    """Make the fused loss Liger's model forwards call (liger_kernel transformers/model/loss_utils.py looks up
    `liger_fused_linear_cross_entropy` on its functional module at each call) pick chunk_mem_const from the rows.
    Idempotent; a chunk_mem_const the caller passes is kept."""
    setting = os.environ.get("LORASHIP_LOSS_CHUNKS", "rows")
    if setting not in ("rows", "liger"):
        raise LorashipError(f"LORASHIP_LOSS_CHUNKS={setting!r} is not one of rows, liger; fix: unset it or pick one")
    if setting == "liger":
        return
    import liger_kernel.transformers.functional as liger_functional
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    current = liger_functional.liger_fused_linear_cross_entropy
    if getattr(current, "_loraship_rows", False):
        return
    # Older liger-kernel takes no chunk_mem_const (or drops it before the kernel): the plan would count chunks that
    # train never runs.
    if "chunk_mem_const" not in inspect.signature(current).parameters or not getattr(
        LigerFusedLinearCrossEntropyFunction, "supports_inner_impl_dispatch", False
    ):
        raise LorashipError(
            "the installed liger-kernel takes no chunk_mem_const for its fused loss; "
            "install liger-kernel>=0.8.5 (pyproject.toml) or set fused_loss: off and plan again"
        )

    @functools.wraps(current)
    def by_rows(input, weight, target, *args, chunk_mem_const=None, **kwargs):
        if chunk_mem_const is None:
            chunk_mem_const = loss_chunk_mem_const(input.shape[0], weight.shape[0], weight.shape[1])
        return current(input, weight, target, *args, chunk_mem_const=chunk_mem_const, **kwargs)

    by_rows._loraship_rows = True
    liger_functional.liger_fused_linear_cross_entropy = by_rows
