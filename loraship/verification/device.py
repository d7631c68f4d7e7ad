"""Where verify loads the GGUF: the device (the small inference GPU, the CPU in tests), whether that GPU is as
large as the target, and what of the GGUF fits target_gpu_memory_gib at target_context."""

from __future__ import annotations

from loraship.errors import LorashipError
from loraship.planning import inference_memory as im


def pick_device(config) -> str:
    import llama_cpp

    gpu = bool(llama_cpp.llama_supports_gpu_offload()) and im.gpu_total_gib() is not None
    if config.device == "cuda" and not gpu:
        raise LorashipError(
            "device: cuda was asked for, but this llama-cpp-python has no GPU offload or no GPU is "
            "visible; install the CUDA build of llama-cpp-python or use device: auto"
        )
    return "cuda" if gpu and config.device != "cpu" else "cpu"


def check_gpu_size(config, device: str) -> None:
    """The measured memory gate means something only on a GPU at least as large as the target."""
    total = im.gpu_total_gib() if device == "cuda" else None
    if total is not None and total < config.target_gpu_memory_gib:
        raise LorashipError(
            f"this GPU has {total:.1f} GiB, less than target_gpu_memory_gib {config.target_gpu_memory_gib:g} the plan "
            "was made for; run verify on a GPU at least that large, or lower target_gpu_memory_gib and run again"
        )


def memory_plan(layout, config) -> dict:
    """Prediction at target_context, and where it does not fit, the context and layers that do. A mixture of experts
    runs with n_cpu_moe (the config's, or under auto the smallest that fits with every layer on the GPU): its experts
    of the first n_cpu_moe blocks in CPU memory (loraship/planning/expert_offload.py)."""
    n_cpu_moe = experts_in_cpu_memory(layout, config)
    at_target = im.predict_gpu(layout, config.target_context, None, n_cpu_moe)
    plan = {"predicted": at_target, "fits": at_target["total_gib"] <= config.target_gpu_memory_gib}
    if layout.is_moe:
        plan.update(n_cpu_moe=n_cpu_moe, **expert_figures(layout, config, n_cpu_moe))
    if not plan["fits"]:
        layers = im.layers_that_fit(layout, config.target_context, config.target_gpu_memory_gib, n_cpu_moe)
        if layers == 0 and im.largest_context(layout, config.target_gpu_memory_gib, n_cpu_moe=n_cpu_moe) == 0:
            one = im.predict_gpu(layout, config.target_context, 1)
            raise LorashipError(
                f"the GGUF does not fit target_gpu_memory_gib {config.target_gpu_memory_gib:g} even with one layer "
                f"(the output layer) on the GPU (about {one['total_gib']:.2f} GiB at n_ctx {config.target_context}); "
                "choose a smaller quantization, a smaller base model, or a larger target GPU"
            )
        plan["largest_context_all_layers"] = im.largest_context(
            layout, config.target_gpu_memory_gib, n_cpu_moe=n_cpu_moe
        )
        plan["gpu_layers_at_target_context"] = layers
    return plan


def experts_in_cpu_memory(layout, config) -> int:
    """llama.cpp's n_cpu_moe for this GGUF: the config's number; under auto 0 where every expert fits on the GPU,
    else the smallest that fits with every layer there, else every block's; 0 for a dense GGUF."""
    setting = getattr(config, "n_cpu_moe", "auto")  # a hand-made config (bench, tests) may lack it
    if not layout.is_moe:
        if setting != "auto":
            raise LorashipError(
                f"n_cpu_moe {setting}: this GGUF has no routed-expert tensors (a dense model) to keep in CPU memory; "
                "remove n_cpu_moe or set it to auto"
            )
        return 0
    if setting != "auto":
        return setting
    fits = (
        k
        for k in range(layout.n_layers + 1)
        if im.predict_gpu(layout, config.target_context, None, k)["total_gib"] <= config.target_gpu_memory_gib
    )
    return next(fits, layout.n_layers)


def expert_figures(layout, config, n_cpu_moe: int) -> dict:
    """The GPU every expert on it would take, the experts kept in CPU memory, and the speed model both ways."""
    from loraship.planning.expert_offload import SPEED_NOTE, tokens_per_s

    experts = [float(b) for b in layout.expert_bytes]
    non_expert = sum(layout.layer_bytes) + layout.output_bytes - sum(experts)
    active = layout.n_expert_used / layout.n_expert if layout.n_expert else 1.0
    return {
        "all_on_gpu_total_gib": im.predict_gpu(layout, config.target_context)["total_gib"],
        "experts_in_cpu_memory_gib": round(sum(experts[:n_cpu_moe]) / im.GIB, 3),
        "tokens_per_s": {
            "all_on_gpu": tokens_per_s(non_expert, experts, active, 0),
            "with_n_cpu_moe": tokens_per_s(non_expert, experts, active, n_cpu_moe),
            "note": SPEED_NOTE,
        },
    }
