"""The traced activation count of a mixture of experts' layer (loraship/planning/trace.py, trace_experts.py): expert
LoRA through PEFT's target_parameters and NF4 experts through bitsandbytes' parametrization, against real CPU runs of
the same layer built as the train stage builds it (loraship/training/experts.py), under two routings; and the plan of
Qwen3-30B-A3B QLoRA it decides."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loraship.config import Config
from loraship.planning import estimate, moe, trace
from loraship.planning.shape import shape_from_config
from loraship.planning.trace_experts import NONE, ExpertWrapping

ROOT = Path(__file__).resolve().parents[1]
# A small Qwen3-MoE: 8 experts, 2 per token, every layer routed.
MOE = dict(
    model_type="qwen3_moe",
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    norm_topk_prob=True,
)
STACKS = ("gate_up_proj", "down_proj")
BATCH, SEQ = 2, 128


def _real_model(wrapping: ExpertWrapping, router: str):
    """The tiny model in bf16 on the CPU as load_model wraps a MoE (LoRA on the planned expert stacks through
    target_parameters, then every stack in NF4 under QLoRA), with its router's weights set for `router`: "spread"
    (random) or "same" (zero: every token on the same two experts)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from loraship.training import experts

    config = AutoConfig.for_model(**MOE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    assert model.config._experts_implementation == "grouped_mm"  # what the trace runs
    for layer in model.model.layers:
        w = layer.mlp.gate.weight
        w.data = torch.randn_like(w) if router == "spread" else torch.zeros_like(w)
    cfg = SimpleNamespace(lora_target_modules=list(wrapping.tensors) or ["q_proj"], train_router=wrapping.router)
    plan = experts.plan_experts(model, MOE, cfg)
    experts.fix_peft_param_wrapper()
    if plan.parameters:
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=[], target_parameters=plan.parameters)
        model = get_peft_model(model, lora)
        base = model.get_base_model()
    else:
        base = model.requires_grad_(False)
    if wrapping.nf4:
        experts.quantize_experts(base, plan.all_experts)
        experts.check_experts_4bit(base, plan.all_experts)
    return model


def _saved_by_layer_1(model, b: int, s: int) -> tuple[float, set]:
    """Bytes the second decoder layer saves for backward (frozen weights and LoRA parameters left out), and the
    experts its router chose."""
    from torch.multiprocessing.reductions import StorageWeakRef

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    frozen = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    current = {"layer": None}
    hooks = [
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.update(layer=i))
        for i, layer in enumerate(base.model.layers)
    ]
    chosen: set = set()
    hooks.append(
        base.model.layers[1].mlp.gate.register_forward_hook(
            lambda _m, _a, out: chosen.update(out[2].flatten().tolist())
        )
    )
    first: dict = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in frozen:
            first.setdefault(ref, (current["layer"], t.untyped_storage().nbytes()))
        return t

    ids = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(0))
    embeds = base.get_input_embeddings()(ids).detach().requires_grad_()
    # Under bf16 autocast, as the train stage runs (the router's LoRA product is cast down there).
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        base.model(inputs_embeds=embeds)
    for hook in hooks:
        hook.remove()
    return sum(n for layer, n in first.values() if layer == 1), chosen


def _real(wrapping: ExpertWrapping, router: str) -> tuple[float, float, set]:
    """(what grows with the tokens at BATCH x SEQ, what does not, the experts routed to) for the real layer, counted
    as the trace counts them: the fixed part is the difference to the same layer with its experts frozen in bf16."""
    model = _real_model(wrapping, router)
    full, chosen = _saved_by_layer_1(model, BATCH, SEQ)
    base = 2 * _saved_by_layer_1(model, 1, 1)[0] - _saved_by_layer_1(model, 1, 2)[0]
    plain = _real_model(NONE, router)
    plain_base = 2 * _saved_by_layer_1(plain, 1, 1)[0] - _saved_by_layer_1(plain, 1, 2)[0]
    return full - base, base - plain_base, chosen


@pytest.mark.parametrize(
    "wrapping",
    [
        ExpertWrapping(STACKS),
        ExpertWrapping(STACKS, nf4=True),
        ExpertWrapping(("down_proj",), nf4=True),
        ExpertWrapping(STACKS, router=True, nf4=True),
    ],
    ids=["lora", "qlora", "qlora-down-only", "qlora-router"],
)
def test_the_trace_counts_what_a_real_moe_layer_keeps_whatever_the_routing(wrapping):
    """The second layer of the real class on the CPU, wrapped as the train stage wraps it, keeps what the trace says,
    to the byte, both what grows with the tokens and the expert stacks it keeps once; with the tokens spread over the
    experts and with all of them on the same two (the grouped GEMMs' tensors do not follow the split)."""
    t = trace.trace_layers(MOE, (), 8, 0.0, BATCH, SEQ, liger=False, experts=wrapping)
    ((_kind, _n, traced, _b),) = t.kinds
    spread = _real(wrapping, "spread")
    same = _real(wrapping, "same")
    assert len(spread[2]) > 2 and len(same[2]) == 2  # the two routings differ
    assert (traced, t.fixed_saved) == spread[:2] == same[:2]
    # Each adapted projection's grouped GEMM keeps its folded bf16 stack (W + s B A); under QLoRA an unadapted one
    # keeps its dequantized stack the same way.
    stacks = {"gate_up_proj": 8 * 256 * 256 * 2, "down_proj": 8 * 256 * 128 * 2}
    kept = sum(stacks.values()) if wrapping.nf4 else sum(stacks[n] for n in wrapping.tensors)
    assert kept <= t.fixed_saved < 1.1 * kept + wrapping.router * 8 * 256 * 4
    assert t.backward > 0 and t.fixed_backward > 0
    # The hand model (the fallback) counts the same stacks, and per token what the grouped_mm path keeps with LoRA on
    # both stacks (more where gate_up_proj is frozen: its GEMM then keeps no input).
    s = shape_from_config(MOE, check_converter=False)
    cfg = _cfg(
        lora_r=8,
        lora_dropout=0.0,
        sequence_len=SEQ,
        lora_target_modules=list(wrapping.tensors),
        train_router=wrapping.router,
    )
    assert t.fixed_saved == moe.kept_stack_bytes(s, cfg, wrapping.nf4)
    hand = BATCH * SEQ * estimate.layer_saved_per_token(s, cfg, (), "train-stage", False)
    assert hand == pytest.approx(traced, rel=0.02) if wrapping.tensors == STACKS else hand > traced


def test_what_grows_with_the_micro_batch_and_what_is_kept_once_per_layer():
    """The plan traces one sequence and multiplies by the micro-batch: a MoE layer's per-token tensors grow with it
    exactly, its expert stacks (kept, their gradients, PEFT's dequantized copies) stay once per layer."""
    wrapping = ExpertWrapping(STACKS, nf4=True)
    one = trace.trace_layers(MOE, ("q_proj",), 8, 0.0, 1, SEQ, liger=False, experts=wrapping)
    three = trace.trace_layers(MOE, ("q_proj",), 8, 0.0, 3, SEQ, liger=False, experts=wrapping)
    assert three.saved == 3 * one.saved
    fixed = (one.fixed_saved, one.fixed_backward, one.fixed_forward)
    assert (three.fixed_saved, three.fixed_backward, three.fixed_forward) == fixed
    assert one.fixed_saved > one.saved  # at 128 tokens the stacks outweigh the tokens' tensors


def test_a_real_moe_layer_holds_in_forward_and_backward_what_the_fake_one_holds():
    """The windows the plan's transients come from, counted the same way on real tensors: under QLoRA with expert
    LoRA the forward holds each stack dequantized (PEFT's _activate_lora keeps the parameter it read while the layer
    runs), its fold and the dequantized copy being folded; fake and real tensors live and die alike."""
    wrapping = ExpertWrapping(STACKS, nf4=True)
    (fake,) = trace._count(MOE, (), 8, 0.0, BATCH, SEQ, False, wrapping, True)[1].values()
    model = _real_model(wrapping, "spread")
    real = trace._trace(model, list(model.get_base_model().model.layers), BATCH, SEQ)[1]
    assert fake[1:] == real[1:]
    stacks = 8 * 256 * 256 * 2 + 8 * 256 * 128 * 2
    assert fake[2] > 2 * stacks  # the folds kept for backward and the dequantized copies PEFT holds


@pytest.mark.parametrize(
    "mc,liger,wrapping,message",
    [
        # Frozen experts under the fused loss run Liger's fused-MoE kernel (Triton, no fake implementation).
        (MOE, True, ExpertWrapping(nf4=True), "Liger's fused-MoE kernel"),
        # A dense layer among the routed ones: the two traced layers would not say which kind they counted.
        ({**MOE, "mlp_only_layers": [0]}, False, ExpertWrapping(STACKS), "3 of its 4 layers are routed"),
    ],
    ids=["liger-fused-moe", "mlp-only-layers"],
)
def test_experts_the_trace_cannot_run_are_named(mc, liger, wrapping, message):
    """What the trace cannot count raises NotTraceable naming it; the plan then falls back to the hand model."""
    with pytest.raises(trace.NotTraceable, match=message):
        trace.trace_layers(mc, ("q_proj",), 8, 0.0, 1, 64, liger=liger, experts=wrapping)


def _cfg(**kw) -> Config:
    return Config(base_model="org/model", datasets=[{"path": "d.jsonl", "type": "completion"}], **kw)


def test_the_plan_of_qwen3_30b_a3b_qlora_is_traced():
    """Qwen3-30B-A3B QLoRA r16 all-linear, 1 x 2048: its activations are traced (no hand model, no margin), each
    un-checkpointed layer keeps its two folded expert stacks (1.125 GiB in bf16), and a layer's forward holds more."""
    mc = json.loads((ROOT / "examples/models/qwen3-30b-a3b/config.json").read_text(encoding="utf-8"))
    s = shape_from_config(mc, check_converter=False)
    cfg = _cfg(lora_r=16, sequence_len=2048, lora_target_modules="all-linear", gpu_memory_gib=32, adapter="qlora")
    strategy = {
        "adapter": "qlora",
        "offload_layers": 0,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "fused_loss": True,
        "gradient_checkpointing": True,
        "offload_activations": False,
        "checkpointed_layers": 46,
    }
    est = estimate.estimate(s, cfg, strategy)
    assert est["activations_counted"] == "traced from Qwen3MoeDecoderLayer (FakeTensorMode)"
    c = est["components_gib"]
    assert "hand_model_margin" not in c
    assert 1.125 < c["saved_activations_other_layers"] / 2 < 1.125 + 0.5
    # The last layer's forward, above what it keeps: PEFT's dequantized copies of both stacks among it.
    assert c["one_layer_recompute_and_backward"] > 1.125
