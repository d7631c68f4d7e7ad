"""Partial CPU offload of frozen base weights for bf16 LoRA training.

The last N decoder layers keep their frozen Linear weights in pinned CPU memory; each forward
(and each recompute under gradient checkpointing) copies the weight to the GPU just for that
matmul, and autograd frees the copy once backward no longer needs it. LoRA weights, norms,
embeddings and every other layer stay on the GPU.

Why not accelerate's device_map={"...": "cpu"}: its offload hooks leave the weights on the meta
device, PEFT then creates the layers' LoRA weights there too, and training fails (seen on the
H200: "CUDA error: an illegal memory access", bench/results/gpu_train_stage.json).
"""

from __future__ import annotations


def _streaming_forward(module, cpu_weight):
    import torch.nn.functional as F

    def forward(x):
        # A fresh GPU tensor per call: autograd keeps it alive exactly as long as backward needs it.
        weight = cpu_weight.to(x.device, non_blocking=True)
        return F.linear(x, weight, module.bias)

    return forward


def offload_frozen_layers(model, n_layers: int) -> int:
    """Move the frozen Linear weights of the last n decoder layers to pinned CPU memory.

    Call on the PEFT model while it is still on the CPU, before `model.to("cuda")`.
    Returns the number of bytes kept off the GPU.
    """
    import torch

    layers = model.get_base_model().model.layers
    kept = 0
    for layer in list(layers)[len(layers) - n_layers:]:
        for module in layer.modules():
            if type(module) is torch.nn.Linear and not module.weight.requires_grad:
                cpu_weight = module.weight.data.pin_memory() if torch.cuda.is_available() else module.weight.data
                kept += cpu_weight.numel() * cpu_weight.element_size()
                module._loraship_cpu_weight = cpu_weight  # a plain attribute: .to("cuda") leaves it alone
                module.weight = torch.nn.Parameter(torch.empty(0, dtype=cpu_weight.dtype), requires_grad=False)
                module.forward = _streaming_forward(module, cpu_weight)
    return kept
