"""A mixture-of-experts layer as the planner reads it off transformers' own class: the routed experts' fused 3-D
weights (transformers v5 stores a layer's experts as one [experts, out, in] parameter per projection, no nn.Linear),
the router, and how many experts each token reaches.

shape.py asks `read_experts` for the first decoder layer that has experts; targets.py maps `lora_target_modules` onto
the expert tensors; estimate.py and multi_gpu.py count their weights, LoRA and activations.
"""

from __future__ import annotations

from dataclasses import dataclass

# Names a config's lora_target_modules may give for the routed experts: every expert tensor, or one of them. The
# Llama names of a dense MLP stand for the expert tensor that holds them where the layer has no such Linear.
EXPERTS = "experts"
LLAMA_MLP_NAMES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


@dataclass(frozen=True)
class ExpertTensor:
    """One fused expert parameter of a MoE layer: `n` experts' [out, in] matrices, stacked."""

    name: str  # the parameter's name in the experts module, e.g. gate_up_proj
    n: int
    in_features: int
    out_features: int

    @property
    def params(self) -> int:
        return self.n * self.in_features * self.out_features


@dataclass(frozen=True)
class Experts:
    """The routed experts of one MoE decoder layer, as shape.py reads them."""

    module: str  # the experts module's path in the decoder layer, e.g. mlp.experts
    tensors: tuple[ExpertTensor, ...]
    router: str | None  # the router's path in the layer (mlp.gate), trained only with train_router
    router_params: int
    top_k: int
    layers: int  # decoder layers with experts (the rest have a dense MLP: mlp_only_layers, decoder_sparse_step)
    transposed: bool = False  # stored [experts, in, out] (transformers' is_transposed), else [experts, out, in]

    @property
    def n(self) -> int:
        return self.tensors[0].n

    @property
    def layer_params(self) -> int:
        return sum(t.params for t in self.tensors)


def _experts_in(layer):
    """(path, module, its 3-D parameters) of the first module in the decoder layer holding stacked expert weights."""
    for path, module in layer.named_modules():
        stacked = [(n, p) for n, p in module.named_parameters(recurse=False) if p.ndim == 3]
        if stacked:
            return path, module, stacked
    return None


def read_experts(layers, config) -> Experts | None:
    """The routed experts of the decoder `layers` (transformers' modules, on the meta device), or None for a dense
    model. In features and out features from the layout transformers declares (`is_transposed`: [experts, in, out])."""
    found = None
    moe_layers = 0
    for layer in layers:
        hit = _experts_in(layer)
        if hit is not None:
            moe_layers += 1
            found = found or hit
    if found is None:
        return None
    path, module, stacked = found
    transposed = bool(getattr(module, "is_transposed", False))
    tensors = tuple(
        ExpertTensor(
            name,
            int(p.shape[0]),
            int(p.shape[1] if transposed else p.shape[2]),
            int(p.shape[2] if transposed else p.shape[1]),
        )
        for name, p in stacked
    )
    parent = path.rpartition(".")[0]
    router, router_params = None, 0
    layer = next(lay for lay in layers if _experts_in(lay) is not None)
    block = layer.get_submodule(parent) if parent else layer
    for name, child in block.named_children():
        weight = getattr(child, "weight", None)
        if child is not module and weight is not None and weight.ndim == 2 and weight.shape[0] == tensors[0].n:
            router, router_params = (f"{parent}.{name}" if parent else name), int(weight.numel())
            break
    top_k = int(getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None) or 1)
    return Experts(path, tensors, router, router_params, top_k, moe_layers, transposed)


def expert_targets(experts: Experts | None, requested: list[str] | str, linears: set[str]) -> tuple[str, ...]:
    """The expert tensors (names in the experts module) that `lora_target_modules` adapts: every one under
    all-linear or `experts`; `experts.<name>` or `<name>` one of them; a dense MLP's Llama name (gate_proj, up_proj,
    down_proj) the tensor holding it where the layer has no such Linear."""
    if experts is None:
        return ()
    names = [t.name for t in experts.tensors]
    if requested == "all-linear":
        return tuple(names)
    chosen = set()
    for n in requested:
        if n == EXPERTS:
            chosen.update(names)
        elif n.startswith(EXPERTS + ".") and n[len(EXPERTS) + 1 :] in names:
            chosen.add(n[len(EXPERTS) + 1 :])
        elif n in names and n not in linears:
            chosen.add(n)
        elif n not in linears and LLAMA_MLP_NAMES.get(n) in names:
            chosen.add(LLAMA_MLP_NAMES[n])
    return tuple(n for n in names if n in chosen)


def is_expert_name(experts: Experts | None, name: str, linears: set[str]) -> bool:
    """`name` in lora_target_modules stands for expert tensors of this model."""
    return bool(expert_targets(experts, [name], linears))


def looks_like_expert_name(name: str) -> bool:
    """`name` names routed experts (`experts`, `experts.<tensor>`): refused with its own words on a dense model."""
    return name == EXPERTS or name.startswith(EXPERTS + ".")


# -- what the planner counts (estimate.py, multi_gpu.py) -----------------------------------------------------------
def expert_params(s) -> int:
    """Every routed expert weight of a Shape `s` (0 for a dense model)."""
    return s.experts.layers * s.experts.layer_params if s.experts else 0


def expert_lora_params(s, cfg) -> int:
    """LoRA parameters on the routed experts: per adapted tensor r x experts x (in + out), in every MoE layer; and the
    routers' (r x (hidden + experts)) with train_router."""
    if s.experts is None:
        return 0
    names = set(expert_targets(s.experts, cfg.lora_target_modules, set(s.linears())))
    per_layer = sum(cfg.lora_r * t.n * (t.in_features + t.out_features) for t in s.experts.tensors if t.name in names)
    if getattr(cfg, "train_router", False) and s.experts.router:
        per_layer += cfg.lora_r * (s.h + s.experts.n)
    return s.experts.layers * per_layer


def kept_stack_bytes(s, cfg, qlora: bool) -> float:
    """Bytes of one MoE layer's expert stacks its grouped GEMMs keep for backward (bf16): an adapted stack's fold
    W + s B A (PEFT's ParamWrapper, one baddbmm per forward) with the bf16 casts of its factors the fold keeps, and
    under QLoRA an unadapted stack's dequantized copy too (its GEMM keeps it for the input's gradient). Counted on
    the traced layer (tests/test_trace_moe.py)."""
    if s.experts is None:
        return 0.0
    names = set(expert_targets(s.experts, cfg.lora_target_modules, set(s.linears())))
    kept = sum(t.params for t in s.experts.tensors if qlora or t.name in names)
    casts = sum(cfg.lora_r * t.n * (t.in_features + t.out_features) for t in s.experts.tensors if t.name in names)
    if getattr(cfg, "train_router", False) and s.experts.router:
        # The router's weight folded with its LoRA, and its factors' casts, as the stacks'.
        kept += s.experts.router_params
        casts += cfg.lora_r * (s.h + s.experts.n)
    return 2.0 * (kept + casts)


def stack_gradient_bytes(s, cfg) -> float:
    """Bytes one MoE layer's backward holds above its start for its adapted stacks: the largest one's bf16 gradient
    (the trace sees less: the fold it replaces is freed as it is made)."""
    if s.experts is None:
        return 0.0
    names = set(expert_targets(s.experts, cfg.lora_target_modules, set(s.linears())))
    return 2.0 * max((t.params for t in s.experts.tensors if t.name in names), default=0)


def moe_saved_per_token(s) -> float:
    """Bytes per token one MoE layer's routed experts keep for backward, in place of a dense MLP's, in transformers'
    grouped_mm experts forward with LoRA on the stacks: the router's fp32 probabilities (4 x experts), the top-k
    indices (int64), weights (fp32) and their sum (12 x k + 4), the sort's int64 permutations (24 x k), and per routed
    copy of the token (k of them) its gathered bf16 input (2h), the gate/up output, the activation and its product
    with up, which down_proj's GEMM keeps (4 x 2 x f_expert), the routing weight (2) and the expert's bf16 output kept
    for the routing weight's gradient (2h). Counted on the traced layer (tests/test_trace_moe.py)."""
    e = s.experts
    by_name = {t.name: t for t in e.tensors}
    down = by_name.get("down_proj")
    f_expert = down.in_features if down else min(t.in_features for t in e.tensors)
    return 4 * e.n + 4 + 36 * e.top_k + e.top_k * (4 * s.h + 8 * f_expert + 2)
