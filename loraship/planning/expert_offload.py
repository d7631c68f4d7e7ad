"""A mixture of experts on an inference GPU smaller than its GGUF: llama.cpp's n_cpu_moe (--n-cpu-moe N keeps the
routed-expert tensors of blocks 0..N-1 in CPU memory, every other tensor of every layer on the GPU).

The config's `n_cpu_moe` is `auto` (0 where the GGUF fits target_gpu_memory_gib whole, else the smallest N that fits
with every layer on the GPU: a token reads only its top-k experts, so experts in CPU memory cost far less speed than
whole layers there) or a number the user sets, which must fit. Sized here from the model's shape at plan time (every
expert layer's experts at the quantization's bits per weight) and by verify from the GGUF's own tensors
(loraship/planning/inference_memory.py predict_gpu, loraship/verification/device.py).

Generation speed either way from a bandwidth model, not a measurement: a generated token reads every weight on the
GPU that is not an expert, and the top-k of n experts of each layer, from the memory that holds them.
"""

from __future__ import annotations

import math

from loraship.constants import AUTO_LADDER, BITS_PER_WEIGHT
from loraship.errors import ConfigError
from loraship.planning.inference_memory import GIB

# Assumed memory bandwidths of the machine the target GPU sits in: a consumer card of 8-16 GiB and dual-channel
# desktop DDR5. Assumptions for the speed model only; nothing here measured them.
GPU_GB_PER_S = 300.0
CPU_GB_PER_S = 60.0
SPEED_NOTE = (
    f"a bandwidth model, not a measurement: each generated token reads the GPU's non-expert weights and the "
    f"top-k experts of every layer, at an assumed {GPU_GB_PER_S:g} GB/s on the GPU and {CPU_GB_PER_S:g} GB/s from "
    "CPU memory; KV cache reads, compute and PCIe transfers are left out"
)


def tokens_per_s(non_expert_bytes: float, expert_bytes: list[float], active: float, n_cpu_moe: int) -> float:
    """Generated tokens/s of the bandwidth model: `active` (top_k / n experts) of each block's experts read, those of
    blocks below n_cpu_moe from CPU memory."""
    gpu = non_expert_bytes + active * sum(expert_bytes[n_cpu_moe:])
    cpu = active * sum(expert_bytes[:n_cpu_moe])
    seconds = gpu / (GPU_GB_PER_S * 1e9) + cpu / (CPU_GB_PER_S * 1e9)
    return round(1 / seconds, 1) if seconds > 0 else 0.0


def expert_bytes_per_block(s, quantization: str) -> list[float]:
    """Each block's routed-expert bytes at the quantization's bits per weight, from the shape. A model whose dense
    MLP layers are fewer than its blocks (first_k_dense_replace, mlp_only_layers) is taken to have them first."""
    if s.experts is None:
        return []
    each = BITS_PER_WEIGHT[quantization] / 8 * s.experts.layer_params
    dense = s.L - s.experts.layers
    return [0.0 if i < dense else each for i in range(s.L)]


def gpu_bytes(total_bytes: float, experts: list[float], n_cpu_moe: int) -> float:
    """What the GPU holds with every layer there and the experts of blocks below n_cpu_moe in CPU memory: the rest,
    and the scheduler's copy of one such layer's experts (loraship/planning/inference_memory.py)."""
    in_cpu = experts[:n_cpu_moe]
    return total_bytes - sum(in_cpu) + max(in_cpu, default=0)


def smallest_fit(total_bytes: float, experts: list[float], budget_bytes: float) -> int | None:
    """The smallest n_cpu_moe at which every layer fits the budget; None when not even every expert in CPU memory
    makes it fit."""
    return next((k for k in range(len(experts) + 1) if gpu_bytes(total_bytes, experts, k) <= budget_bytes), None)


def plan_quantization(s, cfg, quantization: str, runtime_bytes: float) -> dict:
    """One quantization's GPU figures under the config's n_cpu_moe (sized where auto): n_cpu_moe, the GPU's total and
    weights with it, what fits, and the speed model both ways. Dense models: n_cpu_moe None, everything on the GPU."""
    quant = BITS_PER_WEIGHT[quantization] / 8 * s.n_params
    experts = expert_bytes_per_block(s, quantization)
    budget = cfg.target_gpu_memory_gib * GIB
    whole = quant + runtime_bytes
    if not experts:
        return {"n_cpu_moe": None, "gpu_weights_gib": quant / GIB, "total_gib": whole / GIB, "fits": whole <= budget}
    fit = smallest_fit(whole, experts, budget)
    k = (fit if fit is not None else len(experts)) if cfg.n_cpu_moe == "auto" else cfg.n_cpu_moe
    with_k = gpu_bytes(whole, experts, k)
    active = s.experts.top_k / s.experts.n
    non_expert = quant - sum(experts)
    return {
        "n_cpu_moe": k,
        "fits_with": fit,
        "gpu_weights_gib": (with_k - runtime_bytes) / GIB,
        "total_gib": with_k / GIB,
        "fits": with_k <= budget,
        "all_on_gpu_total_gib": whole / GIB,
        "every_expert_in_cpu_memory_gib": gpu_bytes(whole, experts, len(experts)) / GIB,
        "experts_in_cpu_memory_gib": sum(experts[:k]) / GIB,
        "tokens_per_s": {
            "all_on_gpu": tokens_per_s(non_expert, experts, active, 0),
            "with_n_cpu_moe": tokens_per_s(non_expert, experts, active, k),
            "note": SPEED_NOTE,
        },
    }


def n_cpu_moe_problem(s, cfg, runtime_bytes: float) -> str | None:
    """What is wrong with a `n_cpu_moe` the config sets, in one message naming what fits; None where nothing is (or
    it is auto). runtime_bytes: the KV cache, compute buffer and CUDA context at target_context."""
    k = cfg.n_cpu_moe
    if k == "auto":
        return None
    if s.experts is None:
        return (
            f"n_cpu_moe {k}: the base model is no mixture of experts (no routed experts to keep in CPU memory); "
            "remove n_cpu_moe or set it to auto"
        )
    if k > s.L:
        return f"n_cpu_moe {k}: the model has {s.L} layers; at most {s.L} (every expert in CPU memory), or auto"
    target = cfg.target_gpu_memory_gib
    # quantization auto: the smallest rung must fit (verify would fail every other rung too); a list: each.
    quants = [min(cfg.quantizations, key=BITS_PER_WEIGHT.get)] if cfg.auto_quantization else cfg.quantizations
    for q in quants:
        plan = plan_quantization(s, cfg, q, runtime_bytes)
        if plan["fits"]:
            continue
        need = f"needs about {plan['total_gib']:.2f} GiB on the GPU at target_context {cfg.target_context}"
        if plan["fits_with"] is not None:
            return (
                f"n_cpu_moe {k}: the {q} GGUF {need} with the experts of its first {k} layers in CPU memory, more "
                f"than target_gpu_memory_gib {target:g}; the smallest n_cpu_moe that fits is {plan['fits_with']} "
                "(or set n_cpu_moe: auto)"
            )
        least = plan["every_expert_in_cpu_memory_gib"]
        smaller = [
            r
            for r in AUTO_LADDER
            if BITS_PER_WEIGHT[r] < BITS_PER_WEIGHT[q]
            and plan_quantization(s, cfg.model_copy(update={"n_cpu_moe": "auto"}), r, runtime_bytes)["fits"]
        ]
        quant_fix = f", or a smaller quantization ({smaller[-1]} fits with n_cpu_moe auto)" if smaller else ""
        where = (
            f"needs about {least:.2f} GiB on the GPU at target_context {cfg.target_context} with every expert in CPU "
            "memory"
            if k == s.L
            else f"{need} with the experts of its first {k} layers in CPU memory, and even with every expert there "
            f"(n_cpu_moe {s.L}) about {least:.2f} GiB"
        )
        return (
            f"n_cpu_moe {k}: the {q} GGUF {where}, more than target_gpu_memory_gib {target:g}; raise "
            f"target_gpu_memory_gib to {math.ceil(least * 2) / 2:g}{quant_fix}, or lower target_context"
        )
    return None


def check_n_cpu_moe(s, cfg, runtime_bytes: float) -> None:
    problem = n_cpu_moe_problem(s, cfg, runtime_bytes)
    if problem:
        raise ConfigError("config", [problem])
