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
    """Prediction at target_context, and where it does not fit, the context and layers that do."""
    at_target = im.predict_gpu(layout, config.target_context)
    plan = {"predicted": at_target, "fits": at_target["total_gib"] <= config.target_gpu_memory_gib}
    if not plan["fits"]:
        layers = im.layers_that_fit(layout, config.target_context, config.target_gpu_memory_gib)
        if layers == 0 and im.largest_context(layout, config.target_gpu_memory_gib) == 0:
            one = im.predict_gpu(layout, config.target_context, 1)
            raise LorashipError(
                f"the GGUF does not fit target_gpu_memory_gib {config.target_gpu_memory_gib:g} even with one layer "
                f"(the output layer) on the GPU (about {one['total_gib']:.2f} GiB at n_ctx {config.target_context}); "
                "choose a smaller quantization, a smaller base model, or a larger target GPU"
            )
        plan["largest_context_all_layers"] = im.largest_context(layout, config.target_gpu_memory_gib)
        plan["gpu_layers_at_target_context"] = layers
    return plan
