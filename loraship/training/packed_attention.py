"""Padding-free attention for packed micro-batches: each example attends to itself only, at the cost of its length.

A packed micro-batch is one row of whole examples laid end to end (loraship/training/packing.py). The train stage
passes their boundaries as cumulative lengths in transformers' own keyword arguments (cu_seq_lens_q / cu_seq_lens_k /
max_length_q / max_length_k, which its models hand down to the attention function unchanged). On CUDA, torch's
variable-length FlashAttention (torch.nn.attention.varlen.varlen_attn, torch >= 2.10) computes every example's
causal attention in one kernel: no mask is built and no score is computed across examples, so a row of many short
examples costs what they cost alone. Elsewhere (the CPU, or a torch without varlen) each example runs through SDPA
on its own: the same result, one kernel per example. Without those keyword arguments (padded evaluation batches)
this is transformers' SDPA attention with its usual mask.

transformers' own answer for packed rows under SDPA is a block-causal mask built from the position ids
(masking_utils.find_packed_sequence_indices): a T x T mask per row that keeps SDPA off its flash kernel and still
computes every masked score. On the H200 packed rows that way trained at 0.59x the padded speed; through this
module, 2.43x (bench/README.md, the `packing` case of the train bench).

A micro-batch whose examples all have one length has nothing to unpad: the train stage sends it as a plain batch
with no mask (loraship/training/batches.py `micro_batch`), which this function hands to SDPA's causal kernel. On the
H200 that kernel (cuDNN's) took 0.54x the time of variable-length FlashAttention on the same full-length rows
(bench/results/train_bench_profile.json).

Registered under ATTENTION with transformers' AttentionInterface and AttentionMaskInterface (its documented way to
add an attention implementation); the train stage sets it on the model only when it packs.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

ATTENTION = "loraship_packed"


def register() -> str:
    """Make ATTENTION known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(ATTENTION, packed_attention_mask)
    return ATTENTION


@lru_cache(maxsize=1)
def varlen_kernel():
    """torch's variable-length FlashAttention and the names of its parameters, or None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def kernel_for(device_type: str) -> str:
    """Which kernel packed attention runs on this device: 'varlen' (one kernel) or 'sdpa-per-example'."""
    return "varlen" if device_type == "cuda" and varlen_kernel() is not None else "sdpa-per-example"


def packed_attention_mask(*args, attention_mask=None, **kwargs):
    """No mask for packed rows (the boundaries travel as cu_seq_lens); SDPA's mask for padded batches."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def packed_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None, **kwargs
):
    """transformers' attention-function contract: query (B, Hq, T, D), key/value (B, Hkv, T, D) -> (B, T, Hq, D)."""
    import torch

    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    max_length = int(kwargs.get("max_length_q") or 0)
    if dropout:
        raise ValueError(
            "packed attention has no attention dropout; set the model's attention_dropout to 0 or packing: off"
        )
    if sliding_window is not None and max_length > sliding_window:
        raise ValueError(
            f"an example of {max_length} tokens is longer than the sliding window ({sliding_window}); "
            "packed attention is full causal attention: set packing: off for this model"
        )
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    scale = scaling if scaling is not None else d**-0.5
    # (B, H, T, D) -> (B*T, H, D): the rows laid end to end, as the cumulative lengths count them.
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    kernel = varlen_kernel()
    if q.is_cuda and kernel is not None and q.dtype in (torch.bfloat16, torch.float16):
        out = _varlen(kernel, q, k, v, cu_seq_lens, max_length, scale, hq // hkv)
    else:
        out = _per_example(q, k, v, cu_seq_lens, scale, hq != hkv)
    return out.view(b, t, hq, d), None


def _varlen(kernel, q, k, v, cu_seq_lens, max_length: int, scale: float, groups: int):
    varlen_attn, params = kernel
    options = {}
    # torch 2.10 takes is_causal; later versions a (left, right) window, (-1, 0) being causal.
    if "window_size" in params:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if "scale" in params:
        options["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        q = q * (scale * q.shape[-1] ** 0.5)  # the kernel's default scale is 1/sqrt(D)
    if groups > 1:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:  # query head i reads key/value head i // groups, as FlashAttention's GQA does
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, **options)


def _per_example(q, k, v, cu_seq_lens, scale: float, gqa: bool):
    import torch
    import torch.nn.functional as F

    bounds = cu_seq_lens.tolist()
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        one = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # (1, H, n, D)
        out = F.scaled_dot_product_attention(*one, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
