"""A checkpointed decoder layer's recompute leaves out its last GEMM, whose output nothing reads.

Backward of a checkpointed layer runs the layer's forward again to rebuild what autograd saved, then backward through
it; the output of that second forward is never read. Llama, Qwen2, Qwen3, Mistral and Phi-3 layers end with
`residual + down_proj(h)`: the add saves nothing, and down_proj's backward needs only its weight (a LoRA down_proj also
its rank-r product h A^T and h itself, for A's gradient). So down_proj's GEMM is wasted work in every recompute: on
Qwen2-7B, 3584 x 18944 of a layer's ~233M frozen parameters, 29% of its matmuls.

torch's non-reentrant checkpoint (the train stage's for layers whose inputs stay on the GPU) already stops its
recompute once the last tensor forward saved is saved again ("early stop"): a frozen down_proj's matmul saves its
weight before it runs, so it is skipped there. Two recomputes still run it:
- a LoRA down_proj's fused node (loraship/training/fused_lora.py), which saves its tensors after computing;
- layers whose input waits in CPU memory (loraship/training/activation_offload.py), whose recompute rebuilds the whole
  graph, as reentrant checkpointing does (and as Unsloth's offloaded checkpointing does: it runs the GEMM).
Both run under `recomputing()`, and a down_proj marked by `skip_down_proj_in_recompute` then returns zeros of its
output's shape without the GEMM, its backward unchanged (tests/test_recompute.py: same loss and gradients, no down_proj
GEMM in the recompute).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import partial

import torch

from loraship.training.frozen_weights import base_weight, compute_dtype, dequantized

_state = threading.local()  # backward runs on autograd's own threads: each keeps its own depth

# Decoder layers whose forward ends in `residual + mlp(x)` with the MLP ending in down_proj, so that nothing but that
# add reads down_proj's output (Phi-3 puts a dropout between them, which keeps its mask, not its input; Granite a
# multiply by the float residual_multiplier, which keeps neither). Llama 3.1 and Phi-4 run the Llama and Phi-3 layers.
# Not Gemma 2 / Gemma 3 / OLMo 2: a norm after the MLP (post_feedforward_layernorm) keeps its input.
LAYERS_ENDING_IN_DOWN_PROJ = frozenset(
    {
        "LlamaDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "MistralDecoderLayer",
        "Phi3DecoderLayer",
        "GraniteDecoderLayer",
    }
)


def active() -> bool:
    """Whether this thread is inside a checkpointed layer's recompute."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def recomputing():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:  # torch's early stop leaves the recompute by an exception
        _state.depth -= 1


def output_unused(module) -> bool:
    """Whether `module` (a down_proj marked by skip_down_proj_in_recompute) may leave its output uncomputed now."""
    return active() and getattr(module, "_loraship_output_unused_in_recompute", False)


def _contexts():
    return torch.utils.checkpoint.noop_context_fn()[0], recomputing()


# transformers' checkpointing function for the layers whose inputs stay on the GPU, with the recompute marked.
non_reentrant_checkpoint = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, context_fn=_contexts)


class GradientOnlyLinear(torch.autograd.Function):
    """A frozen Linear in a recompute: zeros of its output's shape (never read), the input gradient g W in backward.
    The weight is kept by reference, as F.linear keeps it (QLoRA: the packed 4-bit weight, dequantized in backward)."""

    @staticmethod
    def forward(ctx, x, weight, quant_state, out_features: int, compute_dtype):
        ctx.save_for_backward(weight)
        ctx.quant_state, ctx.x_dtype = quant_state, x.dtype
        return x.new_zeros(*x.shape[:-1], out_features, dtype=compute_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        w = dequantized(weight, ctx.quant_state, grad_out.dtype)
        return torch.matmul(grad_out, w).to(ctx.x_dtype), None, None, None, None


def _frozen_down_forward(module):
    """down_proj's forward: its own outside a recompute; in one, GradientOnlyLinear on the same weight (a streamed
    weight through the prefetcher, so its layer pass is counted as before)."""
    own_forward = module.forward
    weight_on = base_weight(module)

    def forward(x):
        if not output_unused(module):
            return own_forward(x)
        weight, quant_state = weight_on(x.device)
        return GradientOnlyLinear.apply(x, weight, quant_state, module.out_features, compute_dtype(x))

    return forward


def skip_down_proj_in_recompute(layers: list, k: int, offloaded: bool) -> int:
    """Mark the down_proj of the first k (checkpointed) decoder layers so their recompute skips its GEMM; how many.

    Call last, on the model as it will run (fused LoRA Linears and streamed weights in place). `offloaded`: those
    layers' inputs wait in CPU memory (their recompute rebuilds everything); otherwise they get torch's non-reentrant
    checkpoint under `recomputing()`, where only a fused LoRA down_proj needs the mark (early stop skips a frozen one).
    A down_proj PEFT runs itself (DoRA, several adapters, LORASHIP_FUSED_LORA=0) is left alone.
    """
    n = 0
    for layer in layers[:k]:
        mlp = getattr(layer, "mlp", None)
        down = getattr(mlp, "down_proj", None)
        if type(layer).__name__ not in LAYERS_ENDING_IN_DOWN_PROJ or down is None:
            continue
        if not offloaded:
            layer._gradient_checkpointing_func = non_reentrant_checkpoint
        if getattr(down, "_loraship_fused", False):
            down._loraship_output_unused_in_recompute = True  # the fused nodes read it (fused_lora.py)
        elif hasattr(down, "base_layer") or base_weight(down) is None or not offloaded:
            continue
        else:
            down.forward = _frozen_down_forward(down)
            down._loraship_output_unused_in_recompute = True
        n += 1
    return n
