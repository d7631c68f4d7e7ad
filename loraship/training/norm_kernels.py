"""Which kernel runs each RMSNorm in training: Liger's Triton kernel, transformers' own, or transformers' own compiled.

LORASHIP_LIGER_NORMS picks it (bench/train_bench.py's loraship-norms-* rows compare them):
- all (default): Liger's RMSNorm forward everywhere liger-kernel patches one, the backward of a frozen weight spread
  over every row block (loraship/training/rms_norm_backward.py);
- liger: Liger's RMSNorm, its own backward too;
- layer: Liger's on the layer norms, transformers' own on attention's per-head q/k norms (QK-norm: Qwen3, Gemma 3,
  OLMo 2);
- off: transformers' own everywhere;
- compile: transformers' own everywhere, each norm class's forward compiled once by torch.compile.
"""

from __future__ import annotations

import os

SETTINGS = ("all", "liger", "layer", "off", "compile")
PER_HEAD_NORMS = ("q_norm", "k_norm")


def setting() -> str:
    value = os.environ.get("LORASHIP_LIGER_NORMS", "all")
    if value not in SETTINGS:
        raise ValueError(
            f"LORASHIP_LIGER_NORMS={value!r} is not one of {', '.join(SETTINGS)}; fix: unset it or pick one"
        )
    return value


def liger_norm_kwargs() -> dict:
    """The arguments for Liger's patch: its norms off where transformers' own run everywhere; with compiled layers
    only the fused loss (torch.compile cannot trace Liger's RMSNorm kernel:
    bench/results/train_bench_gemma3_kernels.json), inductor fusing the norms, RoPE and the gated MLP itself."""
    if os.environ.get("LORASHIP_COMPILE_LAYERS") == "1":
        return {"rms_norm": False, "rope": False, "geglu": False, "swiglu": False}
    return {"rms_norm": False} if setting() in ("off", "compile") else {}


def _unpatch(module) -> None:
    # Liger binds its forward on the instance (monkey_patch.py _bind_method_to_module); the class's is underneath.
    for attribute in ("forward", "extra_repr", "_get_name"):
        module.__dict__.pop(attribute, None)


def adjust_norms(model) -> int:
    """After Liger's patch: put the norms the setting wants back on transformers' forward. Returns how many changed."""
    chosen = setting()
    changed = 0
    if chosen == "all":
        changed = spread_backward(model)
    elif chosen == "layer":
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in PER_HEAD_NORMS and "forward" in module.__dict__:
                _unpatch(module)
                changed += 1
    elif chosen == "compile":
        import torch

        compiled = {}
        for _name, module in model.named_modules():
            cls = type(module)
            if cls.__name__.endswith("RMSNorm") and "forward" not in module.__dict__:
                # One compiled function per class, the module passed in: every instance shares its graphs
                # (parameters are graph inputs), instead of one compile per layer.
                if cls not in compiled:
                    compiled[cls] = torch.compile(cls.forward, dynamic=True)
                module.forward = compiled[cls].__get__(module, cls)
                changed += 1
    return changed


def spread_backward(model) -> int:
    """Every norm Liger patched runs loraship/training/rms_norm_backward.py's function: Liger's forward kernel, the
    input's gradient one program per row block. Returns how many."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    from loraship.training import rms_norm_backward

    changed = 0
    for module in model.modules():
        bound = module.__dict__.get("forward")
        if getattr(bound, "__func__", None) is LigerRMSNorm.forward:
            module.forward = rms_norm_backward.forward.__get__(module, type(module))
            changed += 1
    return changed


def compile_decoder_layers(layers: list) -> int:
    """LORASHIP_COMPILE_LAYERS=1: every decoder layer's forward compiled by torch.compile (one graph per layer class,
    dynamic sequence length), checkpointed layers recomputing the compiled forward (torch.utils.checkpoint, not
    reentrant). What Unsloth does for Gemma 3; bench/train_bench.py's loraship-compile-layers rows measure it.
    `layers`: the train stage's decoder_layers(model), the same list its checkpointing flags are set on."""
    if os.environ.get("LORASHIP_COMPILE_LAYERS") != "1":
        return 0
    import torch
    from torch.utils.checkpoint import checkpoint

    compiled = {}
    for layer in layers:
        cls = type(layer)
        inner = getattr(cls.forward, "__wrapped__", cls.forward)  # under transformers' checkpointing wrapper
        fn = compiled.setdefault(cls, torch.compile(inner, dynamic=True))
        recompute = bool(getattr(layer, "gradient_checkpointing", False))
        layer.gradient_checkpointing = False  # checkpointed here instead, around the compiled forward

        def forward(*args, _layer=layer, _fn=fn, _recompute=recompute, **kwargs):
            if _recompute and _layer.training and torch.is_grad_enabled():
                kwargs["use_cache"] = False
                return checkpoint(_fn, _layer, *args, use_reentrant=False, **kwargs)
            return _fn(_layer, *args, **kwargs)

        layer.forward = forward
    return len(layers)
