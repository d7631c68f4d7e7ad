"""Which decoder Linears a run adapts with LoRA (`lora_target_modules` read against a model's Shape).

The one place that maps the Llama-style names a config gives onto a model's own Linears (Phi-3's fused qkv_proj,
gate_up_proj); the memory estimate, the FLOP counts and the train stage all ask it.
"""

from __future__ import annotations

from loraship.config import Config
from loraship.planning.moe import expert_targets, is_expert_name, looks_like_expert_name
from loraship.planning.shape import Shape

QVO = ("q_proj", "v_proj", "o_proj")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 computes q, k, v with one Linear (qkv_proj) and gate, up with another (gate_up_proj): the names of
# ALL_LINEAR that a config may give (the default q, k, v, o) stand for the fused module that holds them
# (Shape.fused_names, read off the model).
FUSED_NAME = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def lora_modules(s: Shape, requested: list[str] | str) -> tuple[str, ...]:
    """The decoder Linears that `lora_target_modules` adapts in a model of shape `s`, in layer order.

    "all-linear" is every decoder Linear. On Phi-3 a Llama name stands for the fused Linear holding it
    (q_proj -> qkv_proj, gate_proj -> gate_up_proj; lora_target_note says when that adapts more than was
    named). A name that is no decoder Linear of the architecture is refused, not skipped: PEFT would adapt
    the rest silently (q_proj, k_proj, v_proj, o_proj on Phi-3 would train o_proj alone)."""
    names = tuple(s.linears())
    if requested == "all-linear":
        return names
    chosen, unknown = set(), []
    for n in requested:
        m = n if n in names else s.fused_names.get(n)
        if m in names:
            chosen.add(m)
        elif not is_expert_name(s.experts, n, set(names)):  # a MoE's expert tensors: expert_lora_targets
            unknown.append(n)
    experts_named = [n for n in unknown if looks_like_expert_name(n)]
    if experts_named and s.experts is None:
        raise ValueError(
            f"lora_target_modules {experts_named} name routed experts, but {s.architecture or s.model_type} is no "
            f"mixture of experts (its decoder Linears are {', '.join(names)}); fix: leave {experts_named} out"
        )
    if experts_named:
        have = ", ".join(f"experts.{t.name}" for t in s.experts.tensors)
        raise ValueError(
            f"lora_target_modules {experts_named} name expert tensors that {s.architecture or s.model_type} does not "
            f"have (its experts hold {have}); fix: name those, `experts` for all, or set lora_target_modules: "
            "all-linear"
        )
    if unknown:
        alias = " (q_proj, k_proj, v_proj name qkv_proj; gate_proj, up_proj name gate_up_proj)" if s.fused else ""
        raise ValueError(
            f"lora_target_modules {unknown} name no Linear of a {s.model_type} decoder layer, whose "
            f"Linears are {', '.join(names)}{alias}; fix: name those, or set lora_target_modules: all-linear"
        )
    return tuple(n for n in names if n in chosen)


def expert_lora_targets(s: Shape, requested: list[str] | str) -> tuple[str, ...]:
    """The routed-expert tensors (names in the layer's experts module, e.g. gate_up_proj) that `lora_target_modules`
    adapts in a mixture of experts; () for a dense model. all-linear is attention, shared experts and every routed
    expert; the router is trained only with train_router."""
    return expert_targets(s.experts, requested, set(s.linears()))


def lora_target_note(s: Shape, requested: list[str] | str) -> str | None:
    """Words for the run's record when a fused module adapts projections the config did not name, else None."""
    if not s.fused or requested == "all-linear":
        return None
    wider = []
    for m in lora_modules(s, requested):
        parts = [n for n, f in s.fused_names.items() if f == m]
        named = [n for n in parts if n in requested]
        if named and len(named) < len(parts) and m not in requested:
            wider.append(f"{', '.join(named)} -> {m} (adapts {', '.join(parts)} together)")
    if not wider:
        return None
    return f"{s.model_type} fuses its projections: " + "; ".join(wider)


def target_names(cfg: Config, s: Shape | None = None) -> tuple[str, ...]:
    """The adapted Linears of `s` (lora_modules); without a shape, of a Llama-style layer (bench scripts)."""
    if s is not None:
        return lora_modules(s, cfg.lora_target_modules)
    if cfg.lora_target_modules == "all-linear":
        return ALL_LINEAR
    return tuple(n for n in ALL_LINEAR if n in cfg.lora_target_modules)
