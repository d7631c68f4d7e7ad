"""GPU memory of a GGUF under llama.cpp: predicted from the file itself, measured through NVML.

Prediction (llama.cpp's n_gpu_layers, f16 KV cache, n_ubatch 512, no flash attention, which is
llama-cpp-python's default). llama.cpp counts n_layers + 1 layers: the output layer is one of them
and the first to go to the GPU; n_gpu_layers = k puts the output layer and the last k - 1 blocks
there ("offloaded 8/9 layers" for an 8-block model at -ngl 8).
- weights: the exact bytes of every tensor the GPU holds. llama.cpp keeps the input embedding
  (token_embd) on the CPU; with tied embeddings the output projection reuses it, and that copy
  does go to the GPU.
- KV cache: K and V, f16, every offloaded block, every position: 2 x n_ctx x n_embd_kv x 2 bytes.
- compute buffer: the largest of the graph's working sets, which the allocator reuses: attention
  scores (n_ubatch x n_ctx x heads, fp32) next to the FFN and residual activations, or the logits
  of a batch (n_ubatch x vocab, fp32). Both match llama.cpp's "CUDA0 compute buffer size" within
  2% on Qwen2-7B and -14B widths at n_ctx 1024-8192, all or some layers offloaded.
- the CUDA context and cuBLAS workspace (CUDA_OVERHEAD_GIB), which no llama.cpp log shows.
- n_cpu_moe (llama.cpp's --n-cpu-moe, loraship/llamacpp/cpu_moe.py): the routed-expert tensors of blocks
  0..n_cpu_moe-1 stay in CPU memory; the GPU then holds one layer's experts more for the copy llama.cpp's scheduler
  makes to run a batch's expert product on the GPU (op offload), a margin not yet measured on a GPU.
bench/verify_gpu.py measures the total on the GPU (bench/results/verify_gpu.json, and
bench/results/verify_gpu_partial_offload.json for partial offload).
"""

from __future__ import annotations

import os
import re
import dataclasses
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
# The tensors llama.cpp's --n-cpu-moe keeps in CPU memory (LLM_FFN_EXPS_REGEX, loraship/llamacpp/cpu_moe.py).
EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")
N_UBATCH = 512
# CUDA context + cuBLAS handles/workspace of one process, as NVML sees it beyond llama.cpp's own
# buffers: 0.682-0.689 GiB in all eight loads measured on the H200 (llama-cpp-python 0.3.36,
# bench/results/verify_gpu*.json).
CUDA_OVERHEAD_GIB = 0.69


@dataclass(frozen=True)
class GGUFLayout:
    n_layers: int
    layer_bytes: list[int]  # per blk.N
    output_bytes: int  # tensors outside the blocks that live on the GPU when all layers do
    cpu_bytes: int  # the input embedding, kept in host memory by llama.cpp
    n_embd: int
    n_embd_kv: int
    n_head: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    # per blk.N: its routed-expert tensors (EXPERT_TENSOR); empty for a dense model
    expert_bytes: list[int] = dataclasses.field(default_factory=list)
    n_expert: int = 0
    n_expert_used: int = 0

    @property
    def is_moe(self) -> bool:
        return any(self.expert_bytes)

    @property
    def file_weights_gib(self) -> float:
        return (sum(self.layer_bytes) + self.output_bytes + self.cpu_bytes) / GIB


def read_layout(path: Path, reader=None) -> GGUFLayout:
    """The tensor layout of the GGUF at `path` (`reader`: its gguf reader, where one is open already)."""
    if reader is None:
        from loraship.llamacpp.gguf_info import open_gguf

        reader = open_gguf(path)

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    n_layers = int(field(f"{arch}.block_count"))
    n_embd = int(field(f"{arch}.embedding_length"))
    n_head = int(field(f"{arch}.attention.head_count"))
    n_head_kv = int(field(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(field(f"{arch}.attention.key_length", n_embd // n_head))
    layer_bytes = [0] * n_layers
    expert_bytes = [0] * n_layers
    output_bytes = cpu_bytes = 0
    names = set()
    n_vocab = 0
    for tensor in reader.tensors:
        names.add(tensor.name)
        match = re.match(r"blk\.(\d+)\.", tensor.name)
        if match:
            layer_bytes[int(match.group(1))] += int(tensor.n_bytes)
            if EXPERT_TENSOR.match(tensor.name):
                expert_bytes[int(match.group(1))] += int(tensor.n_bytes)
        elif tensor.name == "token_embd.weight":
            cpu_bytes += int(tensor.n_bytes)
            n_vocab = int(max(tensor.shape))
        else:
            output_bytes += int(tensor.n_bytes)
    if "output.weight" not in names:  # tied embeddings: the output projection is a GPU copy of token_embd
        output_bytes += cpu_bytes
    return GGUFLayout(
        n_layers=n_layers,
        layer_bytes=layer_bytes,
        output_bytes=output_bytes,
        cpu_bytes=cpu_bytes,
        n_embd=n_embd,
        n_embd_kv=n_head_kv * head_dim,
        n_head=n_head,
        n_ff=int(field(f"{arch}.feed_forward_length", 4 * n_embd)),
        n_vocab=n_vocab or int(len(field("tokenizer.ggml.tokens", []) or [])),
        n_ctx_train=int(field(f"{arch}.context_length", 4096)),
        expert_bytes=expert_bytes,
        n_expert=int(field(f"{arch}.expert_count", 0) or 0),
        n_expert_used=int(field(f"{arch}.expert_used_count", 0) or 0),
    )


def compute_buffer_bytes(n_ctx: int, n_head: int, n_embd: int, n_ff: int, n_vocab: int) -> int:
    """llama.cpp's CUDA compute buffer at n_ubatch 512: attention scores next to the FFN and residual
    activations, or a batch's logits, whichever is larger (the allocator reuses one for the other)."""
    attention = N_UBATCH * n_ctx * n_head * 4 + N_UBATCH * (n_ff + 3 * n_embd) * 4
    logits = N_UBATCH * n_vocab * 4 + N_UBATCH * n_embd * 4
    return max(attention, logits)


def all_layers(layout: GGUFLayout) -> int:
    """llama.cpp's n_gpu_layers for everything on the GPU: every block and the output layer."""
    return layout.n_layers + 1


def predict_gpu(layout: GGUFLayout, n_ctx: int, n_gpu_layers: int | None = None, n_cpu_moe: int = 0) -> dict:
    """GiB per component at llama.cpp's n_gpu_layers (all by default): the output layer, then the
    last n_gpu_layers - 1 blocks, less the experts of blocks below n_cpu_moe (kept in CPU memory)."""
    layers = all_layers(layout) if n_gpu_layers is None or n_gpu_layers < 0 else min(n_gpu_layers, all_layers(layout))
    blocks = max(0, layers - 1)
    first = layout.n_layers - blocks
    experts = layout.expert_bytes or [0] * layout.n_layers
    in_cpu = [experts[i] for i in range(first, layout.n_layers) if i < n_cpu_moe]
    weights = sum(layout.layer_bytes[first:]) - sum(in_cpu) + (layout.output_bytes if layers else 0)
    # The scheduler's copy of one layer's experts, where some stay in CPU memory (the module's docstring).
    weights += max(in_cpu, default=0)
    kv = 2 * blocks * n_ctx * layout.n_embd_kv * 2
    compute = compute_buffer_bytes(n_ctx, layout.n_head, layout.n_embd, layout.n_ff, layout.n_vocab) if layers else 0
    parts = {
        "weights_gib": weights / GIB,
        "kv_cache_gib": kv / GIB,
        "compute_buffer_gib": compute / GIB,
        "cuda_overhead_gib": CUDA_OVERHEAD_GIB,
    }
    parts = {k: round(v, 3) for k, v in parts.items()}
    parts["total_gib"] = round(sum(parts.values()), 3)
    parts.update(n_ctx=n_ctx, n_gpu_layers=layers)
    if layout.is_moe:
        parts.update(n_cpu_moe=n_cpu_moe, experts_in_cpu_memory_gib=round(sum(in_cpu) / GIB, 3))
    return parts


def layers_that_fit(layout: GGUFLayout, n_ctx: int, budget_gib: float, n_cpu_moe: int = 0) -> int:
    """Largest llama.cpp n_gpu_layers that fits the budget at n_ctx (0 when not even the output
    layer does)."""
    fit = 0
    # From 2: with the output layer alone on the GPU llama.cpp's compute buffer grows by about a
    # third (measured: 408 MiB, not 304), which this model does not predict.
    for layers in range(2, all_layers(layout) + 1):
        if predict_gpu(layout, n_ctx, layers, n_cpu_moe)["total_gib"] <= budget_gib:
            fit = layers
    return fit


def largest_context(layout: GGUFLayout, budget_gib: float, step: int = 256, n_cpu_moe: int = 0) -> int:
    """Largest context (a multiple of step) at which every layer fits; 0 when none does."""
    best, n_ctx = 0, step
    while (
        n_ctx <= max(layout.n_ctx_train, step)
        and predict_gpu(layout, n_ctx, None, n_cpu_moe)["total_gib"] <= budget_gib
    ):
        best, n_ctx = n_ctx, n_ctx + step
    return best


def gpu_total_gib() -> float | None:
    """Memory of the GPU this process sees first, through NVML; None without NVIDIA driver."""
    handle = _nvml_handle()
    if handle is None:
        return None
    import pynvml

    return pynvml.nvmlDeviceGetMemoryInfo(handle).total / GIB


def gpu_used_by_this_process_gib() -> float | None:
    """This process's own GPU memory as NVML reports it (CUDA context included); None where unknown.

    Inside a container NVML may list host pids; then the device-wide figure stands in (our process
    is the only one on a verify node).
    """
    handle = _nvml_handle()
    if handle is None:
        return None
    import pynvml

    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
            return proc.usedGpuMemory / GIB
    return pynvml.nvmlDeviceGetMemoryInfo(handle).used / GIB


def _nvml_handle():
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        index = int(visible) if visible.isdigit() else 0
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # no driver, no library, no device: nothing to measure
        return None
