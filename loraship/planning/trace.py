"""What a decoder layer keeps for backward and holds during its backward, counted from the code that runs.

The planner's activation terms come from here, not from per-family formulas. `trace_layers` builds the first few
decoder layers of the model's own transformers class under torch's FakeTensorMode (tensors with shapes and dtypes,
no storage: a 14B layer at 8k tokens costs nothing), puts the train stage's own wrappers on it as
loraship/training/model_loading.py does (PEFT LoRA on the planned targets, the fused LoRA nodes, Liger's RMSNorm,
SwiGLU/GEGLU and RoPE where the plan uses the fused loss), runs one forward under bf16 autocast and one backward, and
counts:
- saved: what autograd keeps per layer (torch.autograd.graph.saved_tensors_hooks, each storage once, in the layer
  that saved it first), the frozen weights and LoRA parameters left out;
- backward: how far above its start one layer's backward goes (every storage an operator makes, alive until freed);
- forward: the same for its forward (what a recompute holds before its backward).
Both at the plan's micro-batch x sequence_len, less the same counts at one token, which leaves out what does not grow
with the tokens (bf16 casts of LoRA weights, fp32 casts of norm weights; the estimate counts those apart).

Liger's kernels are Triton, launched from Python: they are not torch.library operators, so they have no fake
implementation. Their forward bodies are swapped, for the trace only, for torch code returning the tensors the kernel
returns (LIGER_FAKE_BODIES); Liger's own autograd functions, and what they save, run unchanged. A mixture of experts'
layer runs with its expert LoRA and NF4 experts as the train stage wraps them (trace_experts.py); what its expert
stacks keep whatever the tokens is counted per layer (LayerTrace.fixed_saved, fixed_backward). A layer that still
cannot be traced (a custom op without a fake implementation, experts whose tensors follow the routing) raises
NotTraceable with the reason; estimate.py then uses its hand model and the plan says so.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from functools import lru_cache

from loraship.planning.trace_experts import NONE, ExpertWrapping, NotTraceable


@dataclass(frozen=True)
class LayerTrace:
    """One un-checkpointed decoder layer, averaged over the model's layers by kind (full / sliding attention, MoE /
    dense MLP), at `tokens` = micro-batch x sequence_len."""

    layer_class: str
    tokens: int
    saved: float  # bytes autograd keeps for the layer's backward
    backward: float  # bytes its backward holds at its peak above what was live when it started
    kinds: tuple[tuple[str, int, float, float], ...]  # (kind, layers of that kind in the model, saved, backward)
    # Bytes per layer that do not grow with the tokens, counted once per layer whatever the micro-batch: a MoE's
    # expert stacks kept for backward and their gradients in it (trace_experts.py); 0 for a dense layer.
    fixed_saved: float = 0.0
    fixed_backward: float = 0.0
    # How far above its start one layer's forward (a recompute's) goes, what it saves included, per sequence and per
    # layer: a MoE's NF4 stacks are dequantized there, next to their LoRA-folded copies (trace_experts.py).
    forward: float = 0.0
    fixed_forward: float = 0.0


def trace_layers(
    mc: dict | str,
    targets: tuple[str, ...],
    lora_r: int,
    lora_dropout: float,
    micro_batch: int,
    sequence_len: int,
    liger: bool,
    experts: ExpertWrapping = NONE,
) -> LayerTrace:
    """The traced layer for config.json `mc` (a dict, or its sorted-key JSON text) under the train stage's wrappers
    (see the module docstring; `experts`: a MoE's expert LoRA and NF4 experts, loraship/planning/trace_experts.py).
    Raises NotTraceable where the layer cannot run on fake tensors."""
    text = mc if isinstance(mc, str) else json.dumps(mc, sort_keys=True)
    return _cached(text, tuple(targets), lora_r, lora_dropout, micro_batch, sequence_len, liger, experts)


@lru_cache(maxsize=256)
def _cached(text, targets, lora_r, lora_dropout, micro_batch, sequence_len, liger, experts) -> LayerTrace:
    mc = json.loads(text)

    def count(b, t, wrapping):
        return _count(mc, targets, lora_r, lora_dropout, b, t, liger, wrapping, experts.adapted)

    try:
        full = count(micro_batch, sequence_len, experts)
        base = _fixed(count(1, 1, experts)[1], count(1, 2, experts)[1])
        # What a dense layer's wrappers keep whatever the tokens is counted apart (estimate.py); a MoE layer's
        # expert stacks and their gradients are its own, kept per layer: the difference to the same layer with its
        # experts frozen in bf16 (trace_experts.py).
        plain = _fixed(count(1, 1, NONE)[1], count(1, 2, NONE)[1]) if experts.touched else base
    except NotTraceable:
        raise
    except Exception as e:  # whatever stopped the fake run: named, and the hand model takes over
        raise NotTraceable(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from e
    layer_class, counts, n_of_kind = full
    kinds, fixed, forward = [], [], []
    for kind, (saved, backward, fwd) in counts.items():
        saved1, backward1, forward1 = base.get(kind, (0.0, 0.0, 0.0))
        saved0, backward0, forward0 = plain.get(kind, (0.0, 0.0, 0.0))
        kinds.append((kind, n_of_kind[kind], max(0.0, saved - saved1), max(0.0, backward - backward1)))
        fixed.append((max(0.0, saved1 - saved0), max(0.0, backward1 - backward0)))
        forward.append((max(0.0, fwd - forward1), max(0.0, forward1 - forward0)))
    L = sum(n for _, n, _, _ in kinds)
    worst = max(range(len(kinds)), key=lambda i: kinds[i][3] + fixed[i][1])
    worst_forward = max(range(len(kinds)), key=lambda i: sum(forward[i]))
    return LayerTrace(
        layer_class=layer_class,
        tokens=micro_batch * sequence_len,
        saved=sum(n * s for _, n, s, _ in kinds) / L,
        # The transient of the worst layer kind: the peak happens in one layer's backward, not on average.
        backward=kinds[worst][3],
        kinds=tuple(kinds),
        fixed_saved=sum(k[1] * f[0] for k, f in zip(kinds, fixed, strict=True)) / L,
        fixed_backward=fixed[worst][1],
        forward=forward[worst_forward][0],
        fixed_forward=forward[worst_forward][1],
    )


def _fixed(one: dict, two: dict) -> dict:
    """What does not grow with the tokens, per kind: twice the one-token count less the two-token count, which cancels
    the per-token part exactly (bf16 casts of the LoRA weights, fp32 casts of norm weights, a MoE's expert stacks)."""
    return {k: tuple(2 * a - b for a, b in zip(one[k], two[k], strict=True)) for k in one}


def _layer_kinds(config, L: int) -> list[str]:
    """Each decoder layer's kind: its attention type (config.layer_types) and, in a MoE, whether its MLP is routed."""
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * L)[:L]
    types += ["full_attention"] * (L - len(types))
    return types


def _reduced_config(config, kinds: list[str]):
    """The config with two layers of each kind the model has (one where it has one): the first layer of a kind may
    save what the model computes once for all layers (RoPE's cos and sin), the second is the one counted. Gemma 3's
    5 sliding : 1 full pattern thus traces 4 layers, not 12. Returns (config, the built layers' kinds)."""
    import copy

    order: list[str] = []
    for kind in kinds:
        if kind not in order:
            order.append(kind)
    built = [k for kind in order for k in [kind] * min(2, kinds.count(kind))]
    reduced = copy.deepcopy(config)
    reduced.num_hidden_layers = len(built)
    if getattr(config, "layer_types", None):
        reduced.layer_types = built
    return reduced, built


def _count(mc, targets, lora_r, lora_dropout, micro_batch, sequence_len, liger, experts, experts_adapted):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from loraship.planning import trace_experts
    from loraship.planning.shape import language_model_config

    config, lm_class, _wrapper, _where = language_model_config(mc)
    L = config.num_hidden_layers
    trace_experts.check_every_layer_routed(mc, L)
    kinds = _layer_kinds(config, L)
    reduced, built = _reduced_config(config, kinds)
    n = len(built)
    # The attention implementation the train stage asks for (model_loading.attention_choice): eager where the model
    # soft-caps its attention logits, SDPA otherwise. (Flex attention for sliding windows on CUDA is not traced.)
    reduced._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    reduced.use_cache = False
    from loraship.training.fused_lora import fuse_lora_linears, fused_lora_wanted

    with _restored_modeling_module(lm_class), _liger_fake_bodies(liger), _masks_as_in_a_real_run():
        model, stacked = _train_stage_model(lm_class, reduced, mc, targets, lora_r, lora_dropout, experts)
        trace_experts.check_implementation(model, liger and not experts_adapted)
        if experts.nf4:
            trace_experts.warm_bitsandbytes()
        with FakeTensorMode(allow_non_fake_inputs=True):
            _to_fake(model)
            trace_experts.after_peft(model, stacked, experts, lora_dropout)
            if liger:
                # As the real run: Liger's SwiGLU off where the experts carry LoRA, in the run with them frozen too
                # (its fused-MoE forward would change the per-token part the two runs share).
                _apply_liger(model, experts_adapted=experts_adapted)
            if targets and fused_lora_wanted():
                with _quiet("loraship.train"):  # its note on what stays PEFT's (the expert stacks) is the run's to log
                    fuse_lora_linears(model)
            layers = _decoder_layers(model, n)
            counts = _trace(model, layers, micro_batch, sequence_len)
    by_kind: dict[str, tuple[float, float, float]] = {}
    for kind, count in zip(built, counts, strict=True):
        by_kind[kind] = count  # the last built layer of the kind (see _reduced_config)
    n_of_kind = {k: kinds.count(k) for k in by_kind}
    return type(layers[0]).__name__, by_kind, n_of_kind


@contextlib.contextmanager
def _liger_fake_bodies(liger: bool):
    """Liger's Triton forwards swapped for torch code returning the tensors the kernels return (see the docstring)."""
    if not liger:
        yield
        return
    from loraship.planning import liger_fake

    with liger_fake.bodies():
        yield


@contextlib.contextmanager
def _masks_as_in_a_real_run():
    """transformers takes a fake tensor for a graph being traced and then always builds the causal mask, where a real
    run without padding leaves it to SDPA's is_causal (and keeps k and v unrepeated): told it is not tracing, it builds
    the masks a real step builds (a sliding window shorter than the sequence still gets one)."""
    from transformers import masking_utils

    before = masking_utils.is_tracing, masking_utils.find_packed_sequence_indices
    masking_utils.is_tracing = lambda tensor=None: False
    # Rows of one sequence each (packing's rows go through loraship/training/packed_attention.py, not this mask).
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.is_tracing, masking_utils.find_packed_sequence_indices = before


@contextlib.contextmanager
def _quiet(logger: str):
    import logging

    log = logging.getLogger(logger)
    before = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(before)


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def _restored_modeling_module(lm_class):
    """Liger patches the model's transformers module itself (its RoPE function, norm and MLP classes): put back after
    the trace, or every later model of that family in this process would run the patched code."""
    import sys

    module = sys.modules[lm_class.__module__]
    saved = dict(vars(module))
    try:
        yield
    finally:
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def _train_stage_model(lm_class, config, mc, targets, lora_r, lora_dropout, experts):
    """The model as loraship/training/model_loading.py load_model builds it for a plan with no layer checkpointed, on
    the meta device (PEFT moves and casts its adapters with Module.to, which fake parameters refuse: _to_fake
    follows); and every stacked expert tensor's name (trace_experts.after_peft quantizes them under QLoRA)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from loraship.training.gradient_checkpointing import checkpoint_first_layers, enable_checkpointing

    with _default_dtype(torch.bfloat16), torch.device("meta"):
        model = lm_class(config)
    enable_checkpointing(model)
    model.enable_input_require_grads()
    checkpoint_first_layers(model, 0)
    model.config.use_cache = False
    from loraship.planning import trace_experts

    stacked = trace_experts.all_stacked(model, mc)
    parameters = trace_experts.target_parameters(model, mc, experts)
    if targets or parameters:
        extra = {"target_parameters": parameters} if parameters else {}
        if parameters:
            trace_experts.fix_peft()
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora_r,
                lora_alpha=2 * lora_r,
                # PEFT's ParamWrapper takes no dropout: the Linears get theirs back (trace_experts.after_peft).
                lora_dropout=0.0 if parameters else lora_dropout,
                target_modules=list(targets),
                bias="none",
                task_type="CAUSAL_LM",
                **extra,
            ),
        )
    else:
        model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    return model.train(), stacked


def _to_fake(model) -> None:
    """Every meta parameter and buffer replaced, in place, by a fake CPU tensor of its shape and dtype (tied ones
    stay tied); called inside the FakeTensorMode."""
    import torch

    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None:
                    continue
                if id(t) not in made:
                    fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    is_parameter = store is module._parameters
                    made[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if is_parameter else fake
                store[name] = made[id(t)]


def _apply_liger(model, experts_adapted: bool) -> None:
    """Liger's kernels as loraship/training/model_loading.py apply_fused_loss applies them."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    from loraship.training import norm_kernels
    from loraship.training.model_loading import liger_kwargs

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _apply_liger_kernel_to_instance(model=base, **liger_kwargs(experts_adapted))
    norm_kernels.adjust_norms(model)


def _decoder_layers(model, n: int):
    from loraship.planning.shape import _decoder_layers as layer_list

    found = layer_list(model, n)
    if found is None:
        raise NotTraceable(f"no list of {n} decoder layers in {type(model).__name__}")
    return list(found)


def _decoder_stack(model):
    """The decoder stack without the head: model.model of a causal LM, under PEFT's wrappers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def _trace(model, layers, micro_batch, sequence_len) -> list[tuple[float, float, float]]:
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    frozen = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    current = {"layer": None}
    first_saver: dict = {}
    live: dict = {}
    windows: list[list[float]] = [[0.0, 0.0] for _ in layers]  # per layer: live at its backward's start, peak since
    forward_windows: list[list[float]] = [[0.0, 0.0] for _ in layers]  # the same for its forward
    open_window = {"layer": None, "forward": None}

    def live_bytes() -> float:
        dead = [ref for ref in live if ref.expired()]
        for ref in dead:
            del live[ref]
        return float(sum(live.values()))

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref not in frozen:
                        live.setdefault(ref, t.untyped_storage().nbytes())
            i, f = open_window["layer"], open_window["forward"]
            if i is not None:  # the live total is summed only inside a layer's backward or forward
                windows[i][1] = max(windows[i][1], live_bytes())
            if f is not None:
                forward_windows[f][1] = max(forward_windows[f][1], live_bytes())
            return out

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in frozen and current["layer"] is not None:
            first_saver.setdefault(ref, (current["layer"], t.untyped_storage().nbytes()))
        return t

    def backward_start(i):
        def hook(_module, _grad_output):
            start = live_bytes()
            windows[i] = [start, start]
            open_window["layer"] = i

        return hook

    def backward_end(_module, _grad_input, _grad_output):
        open_window["layer"] = None

    def forward_start(i):
        def hook(_module, _args):
            current.update(layer=i)
            start = live_bytes()
            forward_windows[i] = [start, start]
            open_window["forward"] = i

        return hook

    def forward_end(_module, _args, _output):
        current.update(layer=None)
        open_window["forward"] = None

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(forward_start(i)))
        hooks.append(layer.register_forward_hook(forward_end))
        hooks.append(layer.register_full_backward_pre_hook(backward_start(i)))
        hooks.append(layer.register_full_backward_hook(backward_end))
    try:
        ids = torch.zeros(micro_batch, sequence_len, dtype=torch.long)
        with Live(), torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                hidden = _decoder_stack(model)(input_ids=ids).last_hidden_state
            hidden.backward(torch.ones_like(hidden))
    finally:
        for hook in hooks:
            hook.remove()
    saved = [0.0 for _ in layers]
    for layer, nbytes in first_saver.values():
        saved[layer] += nbytes
    return [
        (saved[i], windows[i][1] - windows[i][0], forward_windows[i][1] - forward_windows[i][0])
        for i in range(len(layers))
    ]
