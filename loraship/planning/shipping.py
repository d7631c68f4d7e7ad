"""Disk for merge, convert and quantize, and the GPU memory the shipped GGUF needs under llama.cpp, planned from the
model's Shape before any training (verify measures the real GGUF: inference_memory.py).
"""

from __future__ import annotations

from loraship.config import Config
from loraship.constants import BITS_PER_WEIGHT
from loraship.planning import expert_offload, inference_memory as im
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
    # A mixture of experts: n_cpu_moe, sized or checked (planning/expert_offload.py); the totals are what the GPU
    # holds with it. A value set that does not fit, or set on a dense model, stops the plan here.
    expert_offload.check_n_cpu_moe(s, cfg, runtime)
    gpu = {q: expert_offload.plan_quantization(s, cfg, q, runtime) for q in cfg.quantizations}
    primary = gpu[cfg.primary_quantization]
    total = primary["total_gib"] * GIB
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
            "fits_target": primary["fits"],
            "target_gpu_memory_gib": cfg.target_gpu_memory_gib,
            "target_context": cfg.target_context,
            "quantization": cfg.primary_quantization,
            **({"experts": moe_figures(primary, cfg)} if primary["n_cpu_moe"] is not None else {}),
            "by_quantization": {
                q: {
                    "gguf_gib": g(b),
                    "gpu_weights_gib": round(gpu[q]["gpu_weights_gib"], 2),
                    "total_gib": round(gpu[q]["total_gib"], 2),
                    "fits_target": gpu[q]["fits"],
                    **({"n_cpu_moe": gpu[q]["n_cpu_moe"]} if gpu[q]["n_cpu_moe"] is not None else {}),
                }
                for q, b in each.items()
            },
        },
    }


def moe_figures(primary: dict, cfg: Config) -> dict:
    """plan.json's "experts" of the primary quantization: n_cpu_moe, how it was chosen, the GPU without it, and the
    speed model both ways."""
    r = lambda v: round(v, 2)  # noqa: E731
    return {
        "n_cpu_moe": primary["n_cpu_moe"],
        "n_cpu_moe_setting": cfg.n_cpu_moe,
        "experts_in_cpu_memory_gib": r(primary["experts_in_cpu_memory_gib"]),
        "all_on_gpu_total_gib": r(primary["all_on_gpu_total_gib"]),
        "every_expert_in_cpu_memory_total_gib": r(primary["every_expert_in_cpu_memory_gib"]),
        "tokens_per_s": primary["tokens_per_s"],
    }


def quantization_warnings(s: Shape, cfg: Config, on_grid: list) -> list[str]:
    """What plan warns of for each named quantization: K-quant rows that fall back (rows not a multiple of 256:
    Gemma 3 270M's 640, 1B's 1152), and a base model already on the grid a rung would quantize it to
    (planning/base_grid.py: the fine-tune's changes would be rounded away). None under quantization: auto, whose
    verify tries each rung and ships the smallest that keeps the fine-tune."""
    from loraship.llamacpp.quant_mix import planned_tensors, summarize, tensor_types

    if cfg.auto_quantization:
        return []
    tensors = planned_tensors(s.linears(), s.L, s.h, s.V, s.tied)
    gqa = max(s.heads // max(s.kv_heads, 1), 1)
    out = []
    for q in cfg.quantizations:
        types = tensor_types(tensors, q, s.L, gqa)
        mix = summarize(types, q)
        got = {t.name: t.got for t in types}
        same = [g for g in on_grid if got.get(g.gguf_name) == g.ggml_type]
        if same:
            out.append(
                f"{q}: the base model's weights were quantized before ({'; '.join(g.words() for g in same)}), "
                f"and {q} quantizes them to that type again, which rounds the fine-tune's changes back to the base's "
                f"(bench/results/quant_ladder_gemma3.json); set quantization: auto, or a rung that gives them "
                f"another type ({', '.join(other_rungs(tensors, s, same))}), or train from the original weights"
            )
        elif mix.fell_back:
            out.append(
                f"{mix.words()}: the file is larger than {q}'s name says; quantization: auto verifies the smaller "
                "rungs too and ships the smallest that passes"
            )
    return out


def other_rungs(tensors, s: Shape, same: list) -> list[str]:
    """The quantizations (AUTO_LADDER) that give none of the on-grid tensors their grid's type."""
    from loraship.constants import AUTO_LADDER
    from loraship.llamacpp.quant_mix import tensor_types

    gqa = max(s.heads // max(s.kv_heads, 1), 1)
    names = {g.gguf_name: g.ggml_type for g in same}
    return [q for q in AUTO_LADDER if not any(names.get(t.name) == t.got for t in tensor_types(tensors, q, s.L, gqa))]
