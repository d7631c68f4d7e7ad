"""A mixture of experts' layer in loraship/planning/trace.py, wrapped as the train stage wraps it: PEFT's
target_parameters LoRA on the stacked expert tensors (and the router with train_router), every stacked expert tensor
in NF4 through bitsandbytes' parametrization under QLoRA (loraship/training/experts.py, model_loading.py
experts_after_peft), and transformers' experts implementation the loaded model dispatches to.

What runs on fake tensors: bitsandbytes registers fake implementations of its quantize and dequantize operators
(bitsandbytes/_ops.py), so the NF4 storage and its dequantization inside the parametrization trace as they run.
transformers' grouped_mm experts forward (the default experts implementation, the one the train stage runs: it never
sets experts_implementation) sorts the token copies by expert and runs one grouped GEMM per projection with offsets:
every tensor it makes is [tokens x top_k, ...] or [experts, ...], whatever the routing, so the fake run's unknown top-k
indices give the bytes any split gives: no worst case to pick (tests/test_trace_moe.py counts the real layer with the
tokens spread over the experts and with all of them on the same top_k, to the byte alike). Eager (a Python loop over
the experts hit) would depend on the routing: refused.

What does not grow with the tokens: the stacked weight each projection's grouped GEMM saves for backward (W + s B A,
folded by PEFT's baddbmm, or under QLoRA the dequantized stack where the projection has no LoRA), the stack's gradient
its backward makes, and in the forward the dequantized copy of each adapted NF4 stack that PEFT's _activate_lora
holds while the layer runs. These are per layer and per step, not per sequence: `fixed` in the trace, counted once
per layer, not once per sequence of the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

# transformers' experts implementations whose tensors do not depend on the routing (see the docstring).
ROUTING_FREE = ("grouped_mm", "batched_mm")


class NotTraceable(Exception):
    """The layer could not run under FakeTensorMode; the message says what stopped it (trace.py re-exports it)."""


@dataclass(frozen=True)
class ExpertWrapping:
    """How the train stage wraps a MoE layer's experts: the stacked tensors with LoRA (names in the experts module),
    LoRA on the router, every stacked tensor in NF4 (QLoRA)."""

    tensors: tuple[str, ...] = ()
    router: bool = False
    nf4: bool = False

    @property
    def touched(self) -> bool:
        """The experts keep or make anything for backward beyond a dense MLP's per-token tensors."""
        return bool(self.tensors or self.router or self.nf4)

    @property
    def adapted(self) -> bool:
        """Expert LoRA: the train stage then leaves Liger's SwiGLU (its fused-MoE forward) off
        (model_loading.liger_kwargs)."""
        return bool(self.tensors)


NONE = ExpertWrapping()


def target_parameters(model, mc: dict, wrapping: ExpertWrapping) -> list[str]:
    """PEFT's target_parameters for the built (not yet PEFT-wrapped) model, as experts.plan_experts names them: every
    stacked expert tensor of `wrapping.tensors` and, with `router`, every router's weight."""
    if not (wrapping.tensors or wrapping.router):
        return []
    from loraship.training.experts import shape_of_config, stacked_expert_names

    s = shape_of_config(mc)
    if s is None or s.experts is None:
        return []
    names = [n for n in stacked_expert_names(model, s.experts.module) if n.rpartition(".")[2] in wrapping.tensors]
    if wrapping.router and s.experts.router:
        names += [f"{name}.weight" for name, _ in model.named_modules() if name.endswith("." + s.experts.router)]
    return names


def all_stacked(model, mc: dict) -> list[str]:
    """Every stacked expert tensor of the built model (quantized under QLoRA, adapted or not)."""
    from loraship.training.experts import shape_of_config, stacked_expert_names

    s = shape_of_config(mc)
    return stacked_expert_names(model, s.experts.module) if s is not None and s.experts is not None else []


def after_peft(model, stacked: list[str], wrapping: ExpertWrapping, lora_dropout: float) -> None:
    """On the PEFT model, its tensors fake: experts_after_peft's steps (NF4 under QLoRA, checked; the Linears'
    dropout where target_parameters made PEFT build them without)."""
    from loraship.training import experts
    from loraship.training.model_loading import linear_lora_dropout

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if wrapping.nf4 and stacked:
        experts.quantize_experts(base, tuple(stacked))  # bitsandbytes' fake quantize: shapes and dtypes as on the GPU
        experts.check_experts_4bit(base, tuple(stacked))
    if wrapping.tensors or wrapping.router:
        linear_lora_dropout(model, lora_dropout)


def check_every_layer_routed(mc: dict, L: int) -> None:
    """Refuse (NotTraceable) a MoE with dense layers among its routed ones (mlp_only_layers, decoder_sparse_step): the
    trace's two layers of a kind would not say which of them it counted."""
    from loraship.training.experts import shape_of_config

    s = shape_of_config(mc)
    if s is not None and s.experts is not None and s.experts.layers != L:
        raise NotTraceable(f"{s.experts.layers} of its {L} layers are routed (the rest dense): not traced yet")


def check_implementation(model, liger_swiglu: bool) -> None:
    """Refuse (NotTraceable) experts the fake run cannot count: an implementation whose tensors follow the routing, or
    Liger's fused-MoE forward (Triton; the train stage binds it where the experts carry no LoRA)."""
    for module in model.modules():
        if not (hasattr(module, "num_experts") and hasattr(module, "_apply_gate")):
            continue
        if liger_swiglu:
            raise NotTraceable(
                f"{type(module).__name__} would run Liger's fused-MoE kernel (frozen experts under the fused loss), "
                "which has no fake implementation"
            )
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if impl not in ROUTING_FREE:
            raise NotTraceable(
                f"{type(module).__name__} runs experts_implementation={impl!r}, whose tensors follow the routing"
            )


def warm_bitsandbytes() -> None:
    """bitsandbytes builds its 8-bit dynamic map (the NF4 statistics' code) from Python floats the first time it
    quantizes: built here, on real tensors, before the fake run, which cannot read a value back."""
    from bitsandbytes import functional

    if "dynamic" not in functional.name2qmap:
        functional.name2qmap["dynamic"] = functional.create_dynamic_map()


def fix_peft() -> None:
    """PEFT's ParamWrapper as the train stage runs it (experts.fix_peft_param_wrapper patches the class, once)."""
    from loraship.training.experts import fix_peft_param_wrapper

    fix_peft_param_wrapper()
