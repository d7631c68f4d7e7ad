"""The device a run trains on: which one, how its CUDA allocator is configured, where forward passes run (autocast),
and the memory figures the train stage reports and re-plans from."""

from __future__ import annotations

import gc
import os

from loraship.errors import LorashipError


def pick_device(config) -> str:
    import torch

    if config.device == "cuda" and not torch.cuda.is_available():
        raise LorashipError("device: cuda was asked for but no CUDA device is visible; use device: auto or cpu")
    return "cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu"


def configure_cuda_allocator() -> str:
    """expandable_segments:True unless the user configured the allocator; call before CUDA starts.

    The caching allocator reads its configuration once, when CUDA initialises; expandable segments let
    a segment grow instead of leaving freed blocks of odd sizes behind, so reserved stays close to
    allocated (measured gap 1-6 GiB with the default allocator: bench/memory_matrix.md).
    """
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the second is torch >= 2.9's name
        if os.environ.get(name):
            return f"{name}={os.environ[name]} (set by the user)"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set after CUDA started in this process: not applied"
    return "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def compute(device: str):
    """Where every forward pass runs. On CUDA: torch.autocast in bf16, the mixed precision HF Trainer's bf16 uses:
    the frozen weights are bf16 already and the LoRA weights stay fp32 masters (AdamW updates them in fp32), but
    their matmuls run in bf16 on tensor cores, and no fp32 copy of a layer's input is made or kept for backward."""
    import contextlib

    import torch

    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def release_memory(device: str) -> None:
    """Return what unreachable tensors hold: gc for reference cycles (PEFT and checkpointing hooks make
    some), then the CUDA caching allocator's free blocks, so the next allocation starts clean."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def gpu_memory_text(device: str) -> str:
    """The CUDA caching allocator's figures for a progress line ('' on the CPU)."""
    if device != "cuda":
        return ""
    import torch

    gib = 2**30
    return (
        f", GPU {torch.cuda.memory_allocated() / gib:.1f} GiB allocated, {torch.cuda.memory_reserved() / gib:.1f} "
        f"reserved (peak {torch.cuda.max_memory_reserved() / gib:.1f})"
    )


def peak_memory(device: str) -> dict:
    if device != "cuda":
        return {}
    import torch

    return {
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
