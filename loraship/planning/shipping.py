"""Disk for merge, convert and quantize, and the GPU memory the shipped GGUF needs under llama.cpp, planned from the
model's Shape before any training (verify measures the real GGUF: inference_memory.py).
"""

from __future__ import annotations

from loraship.config import Config
from loraship.constants import BITS_PER_WEIGHT
from loraship.planning import inference_memory as im
from loraship.planning.inference_memory import GIB
from loraship.planning.shape import Shape


def plan_disk_and_inference(s: Shape, cfg: Config) -> dict:
    """Disk for merge/convert/quantize and GPU memory of the shipped GGUF under llama.cpp."""
    P = s.n_params
    merged = 2 * (P + s.other_params)  # bf16 safetensors, a multimodal wrapper's vision tower included
    f16 = 2 * P  # F16 GGUF
    # Every quantization takes disk; the primary (the one Ollama and chat open) is what the GPU figures are for.
    each = {q: BITS_PER_WEIGHT[q] / 8 * P for q in cfg.quantizations}
    quant, quant_disk = each[cfg.primary_quantization], sum(each.values())
    # llama.cpp KV cache in f16: K and V, every layer, every position.
    kv = 2 * s.L * cfg.target_context * s.kv * 2
    # The compute buffer and CUDA context as verify predicts them from the GGUF
    # (loraship/planning/inference_memory.py), here from the model config; the weights are the whole GGUF (the input
    # embedding, which llama.cpp keeps on the CPU, included: a margin at plan time).
    compute = im.compute_buffer_bytes(cfg.target_context, s.heads, s.h, s.f, s.V)
    ctx = im.CUDA_OVERHEAD_GIB * GIB
    runtime = kv + compute + ctx
    total = quant + runtime
    g = lambda b: round(b / GIB, 2)  # noqa: E731
    return {
        "disk_gib": {
            "merge": g(merged),
            "convert": g(f16),
            "quantize": g(quant_disk),
            "total": g(merged + f16 + quant_disk),
        },
        "inference": {
            "gguf_gib": g(quant),
            "kv_cache_gib": g(kv),
            "compute_buffer_gib": g(compute),
            "cuda_context_gib": g(ctx),
            "total_gib": g(total),
            "fits_target": total / GIB <= cfg.target_gpu_memory_gib,
            "target_gpu_memory_gib": cfg.target_gpu_memory_gib,
            "target_context": cfg.target_context,
            "quantization": cfg.primary_quantization,
            "by_quantization": {
                q: {
                    "gguf_gib": g(b),
                    "total_gib": g(b + runtime),
                    "fits_target": (b + runtime) / GIB <= cfg.target_gpu_memory_gib,
                }
                for q, b in each.items()
            },
        },
    }
