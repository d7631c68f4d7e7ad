"""Model FLOPs per trained token and model FLOPs utilisation (MFU) against the card's bf16 peak.

Arithmetic on the planner's Shape (loraship/planning/shape.py) and the LoRA targets (targets.py), nothing else of
the planner, so the step-time model (step_time.py) builds on it. MFU counts the FLOPs the model needs, not what the
run executes (PaLM's definition, Chowdhery et al. 2022, appendix B): a checkpointed layer's recompute is not
counted, so MFU compares strategies by useful work. For LoRA on a frozen base, the backward pass computes input
gradients of every frozen matmul but no weight gradients, so a frozen matmul costs 4 FLOPs per parameter per token
(forward 2, input gradient 2), not the 6 of full fine-tuning; a LoRA matrix costs 6. Causal attention (scores and
the weighted sum) costs 2 x q x n FLOPs per token per layer forward at sequence length n (on average n / 2 keys of
width q, two products), and twice that backward.
"""

from __future__ import annotations

from loraship.planning.shape import Shape, shape_from_config
from loraship.planning.targets import target_names

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, from the vendors' datasheets. Matched against
# torch.cuda.get_device_name() in this order: more specific names first.
BF16_PEAK_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H200", 989.4),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),  # with fp32 accumulation, as torch's bf16 matmuls accumulate
)


def bf16_peak_tflops(device_name: str | None) -> float | None:
    """The card's dense bf16 peak, or None when the name is not in the table (or there is no GPU)."""
    for key, tflops in BF16_PEAK_TFLOPS:
        if device_name and key in device_name:
            return tflops
    return None


def attention_length(lengths: list[int]) -> float:
    """The sequence length an average trained token sits in (each example attends to itself only):
    sum(n^2) / sum(n)."""
    total = sum(lengths)
    return sum(n * n for n in lengths) / total if total else 0.0


def _shape(model: Shape | dict) -> Shape:
    """The Shape itself; a config.json dict is parsed here, the edge for callers that hold one (tasks/train.py)."""
    return model if isinstance(model, Shape) else shape_from_config(model)


def _layer_terms(model: Shape | dict, cfg, seq_len: float) -> tuple:
    """(shape, LoRA parameters of one decoder layer, keys attended summed over the layers). Gemma 2's sliding layers
    attend to at most sliding_window keys (an approximation for mixed lengths: the average length capped, not each
    example's)."""
    s = _shape(model)
    linears = s.linears()
    lora = sum(cfg.lora_r * sum(linears[name]) for name in target_names(cfg, s))
    window = min(seq_len, s.sliding_window) if s.sliding_window else seq_len
    return s, lora, (s.L - s.sliding_layers) * seq_len + s.sliding_layers * window


def train_flops_per_token(model: Shape | dict, cfg, seq_len: float) -> float:
    """Model FLOPs of one trained token of LoRA/QLoRA training (forward + backward, no recompute) at attention
    length `seq_len` (attention_length of the examples)."""
    s, lora, keys = _layer_terms(model, cfg, seq_len)
    frozen = s.L * s.layer_linear_params + s.V * s.h  # decoder matmuls + lm_head (the embedding is a lookup)
    return 4 * frozen + 6 * s.L * lora + 6 * s.q * keys


def forward_flops_per_layer_token(model: Shape | dict, cfg, seq_len: float) -> float:
    """FLOPs of one decoder layer's forward per token (frozen and LoRA matmuls, attention averaged over the layers)."""
    s, lora, keys = _layer_terms(model, cfg, seq_len)
    return 2 * s.layer_linear_params + 2 * lora + 2 * s.q * keys / s.L


def recompute_flops_per_layer_token(model: Shape | dict, cfg, seq_len: float) -> float:
    """FLOPs one checkpointed decoder layer adds per token: its forward again, less down_proj's GEMM (and its LoRA
    B product) where the layer ends in `residual + down_proj(h)`: nothing reads that output in a recompute, which
    skips it (loraship/training/recompute.py)."""
    s = _shape(model)
    skipped = 0.0
    if s.recompute_skips_down:
        f_in, h_out = s.linears()["down_proj"]
        lora_b = cfg.lora_r * h_out if "down_proj" in target_names(cfg, s) else 0
        skipped = 2 * (f_in * h_out + lora_b)
    return forward_flops_per_layer_token(s, cfg, seq_len) - skipped


def mfu(tokens_per_s: float | None, flops_per_token: float, device_name: str | None) -> tuple[float | None, str]:
    """(MFU as a fraction of the bf16 peak, or None, and the words that say how it was taken or why not)."""
    peak = bf16_peak_tflops(device_name)
    if peak is None:
        return (
            None,
            f"no bf16 peak known for {device_name or 'this device'} (loraship/planning/flops.py BF16_PEAK_TFLOPS)",
        )
    if not tokens_per_s:
        return None, "no steady-state tokens/s (too few steps after the warm-up)"
    achieved = tokens_per_s * flops_per_token / 1e12
    return (
        round(achieved / peak, 4),
        f"{achieved:,.0f} of {peak:,.0f} TFLOP/s ({device_name} dense bf16), "
        f"{flops_per_token / 1e9:.2f} GFLOP per token (model FLOPs: no recompute)",
    )
