"""Merging a mixture of experts' expert LoRA into the stacked expert tensors of the bf16 base (tasks/merge.py).

PEFT's ParamWrapper (target_parameters, loraship/training/experts.py) keeps one LoRA per stacked tensor, for every
expert at once: A is [experts * r, in] (expert-major rows), B is [out, r * experts] (expert-minor columns), and expert
e's delta is scale * B_e @ A_e with A_e = A.reshape(experts, r, in)[e] and B_e = B.reshape(out, r, experts)[..., e]
(peft/tuners/lora/layer.py ParamWrapper.get_delta_weight). Wrappers of the same experts module nest, so the saved keys
name the module, not the tensor (`...mlp.experts.lora_A.weight`, `...mlp.experts.base_layer.lora_A.weight`): each is
matched to its tensor by the in and out features the planner reads off transformers' class (loraship/planning/moe.py).
"""

from __future__ import annotations

from loraship.errors import LorashipError


# A Hub checkpoint keeps each expert's projections apart (experts.{e}.gate_proj.weight, ...), which transformers
# stacks on load: gate_up_proj = [gate; up] along the out features, down_proj as is (transformers'
# conversion_mapping.py: MergeModulelist, then Concatenate(dim=1)). The parts of each stacked tensor there, in order.
PER_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_merges(deltas: dict, base_config: dict, base_names: set[str]) -> dict:
    """Moves the expert LoRA pairs out of `deltas` ({adapter module path + '.weight': (A, B)}, as merge reads them):
    {base tensor name: merge(w, scale) -> the merged fp32 tensor}, for a base that stores the experts stacked or
    (a Hub checkpoint) one tensor per expert and projection. Pairs whose name is a base weight stay (Linears, a
    router's LoRA)."""
    from loraship.planning.shape import shape_from_config

    pending = {k: v for k, v in deltas.items() if k not in base_names}
    if not pending:
        return {}
    try:
        experts = shape_from_config(base_config).experts
    except ValueError:
        experts = None
    if experts is None:
        return {}
    merges: dict = {}
    taken: set[str] = set()
    for key, (a, b) in pending.items():
        module = key[: -len(".weight")].replace(".base_layer", "")
        if not module.endswith("." + experts.module):
            continue
        n = experts.n
        if a.shape[0] % n or b.shape[1] != a.shape[0]:
            raise LorashipError(
                f"adapter tensors of {module} are A {tuple(a.shape)}, B {tuple(b.shape)}: no LoRA of {n} experts; "
                "fix: train again (loraship run CONFIG --from train)"
            )
        fits = [
            t
            for t in experts.tensors
            if t.in_features == a.shape[1] and t.out_features == b.shape[0] and f"{module}.{t.name}" not in taken
        ]
        if len(fits) != 1:
            have = ", ".join(f"{t.name} in {t.in_features} out {t.out_features}" for t in experts.tensors)
            raise LorashipError(
                f"adapter LoRA {key} (in {a.shape[1]}, out {b.shape[0]}) matches {len(fits)} expert tensors of "
                f"{module} ({have}), not one; fix: report this with the model's config.json"
            )
        tensor = fits[0]
        taken.add(f"{module}.{tensor.name}")
        merges.update(_merges_of(module, tensor.name, a, b, n, experts.transposed, base_names, key))
        del deltas[key]
    return merges


def _merges_of(module: str, tensor: str, a, b, n: int, transposed: bool, base_names: set[str], key: str) -> dict:
    stacked = f"{module}.{tensor}"
    if stacked in base_names:
        return {stacked: lambda w, scale: merged_stack(w, a, b, transposed, scale)}
    parts = PER_EXPERT_PARTS.get(tensor, ())
    names = [[f"{module}.{e}.{part}.weight" for part in parts] for e in range(n)]
    missing = [name for row in names for name in row if name not in base_names]
    if not parts or missing:
        raise LorashipError(
            f"adapter LoRA {key} is for {stacked}, which the base holds neither stacked nor as one tensor per expert "
            f"({missing[0] if missing else tensor + ' has no known per-expert parts'}); wrong base model?"
        )
    out = {}
    for e, row in enumerate(names):
        for i, name in enumerate(row):
            out[name] = _expert_part(a, b, n, e, i, len(row))
    return out


def _expert_part(a, b, n: int, e: int, i: int, parts: int):
    """merge(w, scale) for part i of `parts` (rows along the out features) of expert e's matrix."""

    def merge(w, scale):
        a_e = a.float().reshape(n, -1, a.shape[-1])[e]  # r, in
        b_e = b.float().reshape(b.shape[0], -1, n)[..., e]  # out, r
        rows = b_e.shape[0] // parts
        delta = b_e[i * rows : (i + 1) * rows] @ a_e
        if delta.shape != w.shape:
            raise LorashipError(
                f"expert {e}'s LoRA delta part of shape {tuple(delta.shape)} does not fit the base tensor "
                f"{tuple(w.shape)}; wrong base model?"
            )
        return w.float() + scale * delta

    return merge


def merged_stack(w, a, b, transposed: bool, scale: float):
    """The stacked expert tensor `w` ([experts, out, in], or [experts, in, out] where transposed) plus every expert's
    LoRA delta, in fp32."""
    import torch

    n = w.shape[0]
    a3 = a.float().reshape(n, -1, a.shape[-1])  # experts, r, in
    b3 = b.float().reshape(b.shape[0], -1, n)  # out, r, experts
    delta = torch.einsum("ore,eri->eio" if transposed else "ore,eri->eoi", b3, a3)
    if delta.shape != w.shape:
        raise LorashipError(
            f"an expert LoRA delta of shape {tuple(delta.shape)} does not fit the base tensor {tuple(w.shape)}; "
            "wrong base model?"
        )
    return w.float() + scale * delta
