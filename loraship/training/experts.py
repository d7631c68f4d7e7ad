"""LoRA on a mixture of experts' routed experts: which stacked expert tensors get it, their 4-bit storage under QLoRA,
and the check after the first optimizer step that every expert's LoRA was reached by a gradient.

Since transformers v5 a layer's experts are one [experts, out, in] nn.Parameter per projection
(mlp.experts.gate_up_proj, mlp.experts.down_proj), no nn.Linear: PEFT's target_modules and bitsandbytes' 4-bit loader
(nn.Linear only) both pass them by. Here PEFT's target_parameters adapts them (its ParamWrapper: per expert A [r, in]
and B [out, r], folded into the stacked weight by one baddbmm per forward, no loop over experts), and bitsandbytes'
parametrization (bitsandbytes.nn.parametrize) stores each stacked tensor in NF4, dequantized when the experts module
runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from loraship.models import config_json
from loraship.errors import LorashipError

log = logging.getLogger("loraship.train")


@dataclass(frozen=True)
class ExpertPlan:
    """The expert tensors a run adapts, as full parameter names of the loaded model, and the router's."""

    tensors: tuple[str, ...]  # e.g. model.layers.0.mlp.experts.gate_up_proj
    router: tuple[str, ...]  # e.g. model.layers.0.mlp.gate.weight, with train_router
    all_experts: tuple[str, ...] = field(default=())  # every stacked expert tensor of the model

    @property
    def parameters(self) -> list[str]:
        return [*self.tensors, *self.router]


def shape_of(model_dir: Path):

    try:
        return shape_of_config(config_json(model_dir))
    except (OSError, ValueError):
        return None


def shape_of_config(model_config: dict | None):
    """The planner's Shape of a parsed config.json; None where there is none or the planner cannot read it."""
    from loraship.planning.shape import shape_from_config

    try:
        return shape_from_config(model_config) if model_config is not None else None
    except (ValueError, KeyError):
        return None


def stacked_expert_names(model, experts_module: str) -> list[str]:
    """Every stacked expert tensor of the loaded model: `<layer>.<experts_module>.<tensor>`."""
    import torch

    out = []
    for name, module in model.named_modules():
        if not name.endswith("." + experts_module):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.ndim == 3:
                out.append(f"{name}.{pname}")
        params = getattr(module, "parametrizations", None)  # already 4-bit (a prequantized base)
        if isinstance(params, torch.nn.ModuleDict):
            out += [f"{name}.{pname}" for pname in params.keys()]
    return out


def plan_experts(model, model_config: dict | None, config) -> ExpertPlan | None:
    """The expert tensors (and router) that lora_target_modules and train_router adapt in the loaded `model`; None for
    a dense model."""
    from loraship.planning.targets import expert_lora_targets

    s = shape_of_config(model_config)
    if s is None or s.experts is None:
        return None
    wanted = set(expert_lora_targets(s, config.lora_target_modules))
    every = stacked_expert_names(model, s.experts.module)
    tensors = tuple(n for n in every if n.rpartition(".")[2] in wanted)
    router = ()
    if config.train_router and s.experts.router:
        router = tuple(f"{name}.weight" for name, _ in model.named_modules() if name.endswith("." + s.experts.router))
    return ExpertPlan(tensors, router, tuple(every))


# -- 4-bit experts under QLoRA -------------------------------------------------------------------------------
def quantize_experts(model, names: tuple[str, ...]) -> int:
    """Each stacked expert tensor in NF4 with double quant (what BitsAndBytesConfig gives the Linears), through
    bitsandbytes' parametrization: dequantized when accessed, inside the experts module's forward. Returns the
    tensors quantized (a prequantized base's are already)."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    done = 0
    for name in names:
        module, pname = holder(model, name)
        if _is_4bit(module, pname):
            continue
        replace_parameter_4bit(module, pname, compress_statistics=True, quant_type="nf4")
        drop_quant_state_hook(module)
        done += 1
    return done


def drop_quant_state_hook(module) -> None:
    """bitsandbytes' state-dict hook adds the quantization state's entries (absmax, quant_map, ...) under the
    tensor's name, which torch's state-dict API (distributed.trainable_state) takes for attributes and fails on. The
    train stage saves the adapter only, never the 4-bit base: the hook goes."""
    hooks = getattr(module, "_state_dict_hooks", {})
    for key, hook in list(hooks.items()):
        func = getattr(hook, "func", hook)
        if getattr(func, "__name__", "") == "_parametrized_state_dict_post_hook":
            del hooks[key]


def holder(model, name: str):
    """(the module that holds the tensor `name`, the tensor's own name): under PEFT's wrappers, the experts module
    itself."""
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name)
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module, pname


def _is_4bit(module, pname: str) -> bool:
    from torch.nn.utils import parametrize

    if not parametrize.is_parametrized(module, pname):
        return False
    import torch

    stored = module.parametrizations[pname].original
    return stored.dtype == torch.uint8 and any(
        type(p).__name__ == "Bnb4bitParametrization" for p in module.parametrizations[pname]
    )


def check_experts_4bit(model, names: tuple[str, ...]) -> None:
    """QLoRA: refuse to train when any expert tensor is not stored in 4 bits, naming it."""
    left = []
    for name in names:
        module, pname = holder(model, name)
        if not _is_4bit(module, pname):
            left.append(f"{name} ({getattr(module, pname).dtype})")
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        raise LorashipError(
            f"adapter: qlora, but expert tensor {left[0]}{more} is not stored in 4 bits: the plan counted every "
            "expert weight in NF4 and a 16-bit expert stack would not fit; fix: report this with the model's "
            "config.json (bitsandbytes' parametrization did not take), or train with adapter: lora"
        )


def fix_peft_param_wrapper() -> None:
    """Two faults of PEFT 0.21's ParamWrapper where another parametrization sits under its own (bitsandbytes' 4-bit
    one), both fixed here. (1) After the forward it removes only a `_LoraParameterProxy`, not the `_LoraFactorsProxy`
    it registers for one adapter: the LoRA fold would stay on the weight and pile up. (2) A wrapper nested in another
    (one per tensor of the same experts module) reads its tensor inside the outer one's `parametrize.cached()`, before
    registering its LoRA: the cached value, without the LoRA, is what the experts then run, and that tensor's LoRA
    gets no gradient (the train stage's expert-gradient check found every gate_up_proj expert unreached)."""
    import contextlib

    from peft.tuners.lora import layer as lora_layer
    from torch.nn.utils import parametrize

    wrapper = lora_layer.ParamWrapper
    if getattr(wrapper, "_loraship_fixed", False):
        return
    original = wrapper._remove_parametrizations
    activate = wrapper._activate_lora

    @contextlib.contextmanager
    def activate_uncached(self, active_adapters):
        with activate(self, active_adapters):
            parametrize._cache.pop((id(self.get_base_layer()), self.parameter_name), None)
            yield

    proxies = tuple(
        c
        for c in (getattr(lora_layer, "_LoraParameterProxy", None), getattr(lora_layer, "_LoraFactorsProxy", None))
        if c
    )

    def remove(self):
        base = self.get_base_layer()
        stack = base.parametrizations[self.parameter_name] if self.parameter_name in base.parametrizations else []
        if len(stack) > 1:
            for i in reversed(range(len(stack))):
                if isinstance(stack[i], proxies):
                    del stack[i]
                    return
        original(self)

    wrapper._remove_parametrizations = remove
    wrapper._activate_lora = activate_uncached
    wrapper._loraship_fixed = True


# -- the gradient check --------------------------------------------------------------------------------------
def expert_lora_layers(model) -> list[tuple[str, object]]:
    """(the adapted parameter's name, PEFT's ParamWrapper) of every stacked expert tensor with LoRA."""
    from peft.tuners.lora.layer import ParamWrapper

    out = []
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper) and getattr(module, "num_experts", 1) > 1:
            clean = name.replace(".base_layer", "")
            for prefix in ("base_model.model.",):
                clean = clean[len(prefix) :] if clean.startswith(prefix) else clean
            out.append((f"{clean}.{module.parameter_name}", module))
    return sorted(out, key=lambda item: item[0])


def _reached(module) -> list[bool]:
    """Per expert: its slice of A or B (PEFT's layout: A [experts * r, in], B [out, r * experts]) has a non-zero
    gradient."""
    import torch

    e = module.num_experts
    adapter = module.active_adapters[0]
    a, b = module.lora_A[adapter].weight.grad, module.lora_B[adapter].weight.grad
    hit = torch.zeros(e, dtype=torch.bool)
    if a is not None:
        hit |= (a.detach().reshape(e, -1).abs().sum(dim=1) > 0).cpu()
    if b is not None:
        hit |= (b.detach().reshape(b.shape[0], -1, e).abs().sum(dim=(0, 1)) > 0).cpu()
    return hit.tolist()


class ExpertGradientCheck:
    """After the first optimizer step of the run (its post hook: the gradients are still there, zero_grad comes
    after), which experts' LoRA received a non-zero gradient. Experts the step never routed a token to are named in
    the record, not failed; a check that finds no expert with LoRA where the plan adapts experts, or none reached,
    fails the run."""

    def __init__(self, model, optimizer, expected: int):
        self.expected = expected  # the stacked expert tensors the plan adapts
        self.layers = expert_lora_layers(model)
        self.record: dict | None = None
        self.error: LorashipError | None = None
        self._handle = optimizer.register_step_post_hook(self._after_step) if expected else None

    def _after_step(self, optimizer, args, kwargs) -> None:
        # The first step only (torch iterates its hooks as it calls them: this one stays, idle, after it).
        if self.record is not None:
            return
        self.record = self.measure()
        if self.error is not None:
            raise self.error

    def measure(self) -> dict:
        if not self.layers:
            self.error = LorashipError(
                f"the plan adapts {self.expected} stacked expert tensor(s) with LoRA, but the model being trained has "
                "LoRA on none: the experts would ship untrained; fix: report this with the model's config.json "
                "(PEFT's target_parameters matched no expert tensor)"
            )
            return {"tensors": 0, "expected": self.expected, "experts_reached": 0}
        never = []
        reached = total = 0
        for name, module in self.layers:
            hits = _reached(module)
            total += len(hits)
            reached += sum(hits)
            never += [f"{name}[{i}]" for i, hit in enumerate(hits) if not hit]
        if reached == 0:
            self.error = LorashipError(
                f"after the first optimizer step no expert's LoRA had a gradient ({len(self.layers)} expert tensors, "
                f"{total} experts): the experts would ship untrained; fix: report this with the model's config.json"
            )
        return {
            "tensors": len(self.layers),
            "expected": self.expected,
            "experts": total,
            "experts_reached": reached,
            # Experts no token was routed to in that step: their LoRA learns once tokens reach them.
            "never_routed_in_first_step": never,
        }

    def as_json(self) -> dict | None:
        return self.record
