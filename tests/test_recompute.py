"""A checkpointed layer's recompute leaves out down_proj's GEMM (loraship/training/recompute.py) and changes nothing
else: the same loss and gradients as the full recompute, for frozen and LoRA down_projs, with the layer inputs on the
device (torch's non-reentrant checkpoint) or in CPU memory (activation_offload.py), with streamed weights, on Llama,
Qwen2, Phi-3, Qwen3 and Granite; one down_proj GEMM fewer per checkpointed layer and step, counted op by op."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import loss_and_grads

IDS = torch.tensor([[5, 9, 17, 33, 65, 100, 3, 7, 11, 13, 2, 1], [4, 8, 16, 32, 64, 99, 6, 10, 12, 14, 15, 1]])
QVO = ["q_proj", "v_proj", "o_proj"]
# Granite's multipliers away from 1 (granite-3.0-2b-instruct's), so its `residual + mlp(x) * residual_multiplier` is
# what the skip runs through; head_dim 16 where the config's default would be larger than hidden / heads.
FAMILY_KEYS = {
    "granite": dict(
        embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0
    ),
    "qwen3": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4),
    "olmo2": {},
}


def _model(family: str, targets, layers: int = 4, checkpointed: int = 3):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        family,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        **FAMILY_KEYS.get(family, {}),
    )
    base = AutoModelForCausalLM.from_config(config)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    for i, layer in enumerate(model.get_base_model().model.layers):
        layer.gradient_checkpointing = i < checkpointed  # tasks/train.py checkpoint_first_layers
    model.train()
    return model


def _as_train_stage_sets_up(model, checkpointed: int, in_cpu: bool, streamed: int, swiglu_down: bool):
    """tasks/train.py's order: activation offload, streamed weights, fused LoRA, then the recompute mark."""
    from loraship.training.activation_offload import offload_checkpointed_activations
    from loraship.training.fused_lora import fuse_lora_linears
    from loraship.training.offload import offload_frozen_layers

    layers = list(model.get_base_model().model.layers)
    if in_cpu:
        offload_checkpointed_activations(layers, checkpointed)
    if streamed:
        offload_frozen_layers(model, streamed)
    fuse_lora_linears(model, only_liger=not swiglu_down)
    return layers


class DownGemms(TorchDispatchMode):
    """Counts matmuls that read a down_proj weight and produce the hidden size: down_proj's forward GEMMs (its
    backward, g W, produces the intermediate size)."""

    def __init__(self, weights, hidden: int):
        super().__init__()
        self.ptrs = {w.untyped_storage().data_ptr() for w in weights}
        self.hidden, self.count = hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.matmul):
            reads = any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.ptrs for a in args)
            if reads and out.shape[-1] == self.hidden:
                self.count += 1
        return out


def _down_weights(layers):
    out = []
    for layer in layers:
        down = layer.mlp.down_proj
        base = getattr(down, "base_layer", down)
        out.append(getattr(base, "_loraship_cpu_weight", base.weight))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "qwen3", "granite"])
@pytest.mark.parametrize("targets, swiglu_down", [(QVO, False), ("all-linear", False), ("all-linear", True)])
@pytest.mark.parametrize("in_cpu, streamed", [(False, 0), (True, 0), (True, 2), (False, 2)])
def test_recompute_without_down_proj_gemm_trains_identically(family, targets, swiglu_down, in_cpu, streamed):
    from loraship.training.recompute import skip_down_proj_in_recompute

    if family == "phi3":
        if swiglu_down:
            pytest.skip("Phi-3's MLP (one gate_up_proj) has no SwiGLU/down node")
        targets = ["qkv_proj", "o_proj"] if targets == QVO else targets  # its fused projections

    checkpointed = 3
    reference, model = _model(family, targets), _model(family, targets)  # same seed: same weights
    ref_layers = _as_train_stage_sets_up(reference, checkpointed, in_cpu, streamed, swiglu_down)
    layers = _as_train_stage_sets_up(model, checkpointed, in_cpu, streamed, swiglu_down)
    marked = skip_down_proj_in_recompute(layers, checkpointed, offloaded=in_cpu)
    # A frozen down_proj whose input stays on the device is left to torch's early stop: nothing to mark.
    frozen_down = targets in (QVO, ["qkv_proj", "o_proj"])
    assert marked == (0 if frozen_down and not in_cpu else checkpointed)

    counts = []
    for net, net_layers in ((reference, ref_layers), (model, layers)):
        gemms = DownGemms(_down_weights(net_layers), hidden=64)
        with gemms:
            result = [loss_and_grads(net, IDS) for _ in range(2)]  # a second step: nothing carried over
        counts.append(gemms.count)
        if net is reference:
            loss_ref, grads_ref = result[0]
    for loss, grads in result:
        assert abs(loss - loss_ref) < 1e-6 and grads.keys() == grads_ref.keys() and any("lora_A" in n for n in grads)
        for name in grads:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-7)
    # Per step: one forward GEMM per layer, plus one per checkpointed layer's recompute unless skipped (by the mark
    # or, for a frozen down_proj on the non-reentrant path, by torch's early stop in both models).
    per_step = 4 + (checkpointed if in_cpu or not frozen_down else 0)
    assert counts[0] == 2 * per_step
    assert counts[1] == 2 * 4


def test_qlora_down_proj_recompute_skip_keeps_gradients(tiny_qwen):
    """The 4-bit frozen down_proj (QLoRA, q/v/o) in CPU-memory checkpointing: GradientOnlyLinear dequantizes in
    backward as bitsandbytes' matmul does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from loraship.training.recompute import skip_down_proj_in_recompute

    def build():
        torch.manual_seed(0)
        q = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        base = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32, quantization_config=q)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=QVO, lora_dropout=0.0))
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
        model.train()
        return model

    reference, model = build(), build()
    with torch.no_grad():
        for (n, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
            if p.requires_grad:
                q.copy_(p.normal_(0, 0.02) if "lora_B" in n else p)
    k = reference.config.num_hidden_layers
    ref_layers = _as_train_stage_sets_up(reference, k, True, 0, False)
    layers = _as_train_stage_sets_up(model, k, True, 0, False)
    assert skip_down_proj_in_recompute(layers, k, offloaded=True) == k
    ids = torch.tensor([[1, 3, 40, 41, 42, 43, 4, 50, 51, 2]])
    loss_ref, grads_ref = loss_and_grads(reference, ids)
    loss, grads = loss_and_grads(model, ids)
    assert abs(loss - loss_ref) < 1e-5 and grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6)
    del ref_layers


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "olmo2"])
def test_layers_that_read_down_proj_output_are_left_alone(family):
    """Gemma 2, Gemma 3 and OLMo 2 normalise the MLP's output before the residual add (the norm keeps it for
    backward): their down_proj must run in the recompute, so it is not marked."""
    from loraship.training.recompute import skip_down_proj_in_recompute

    model = _model(family, "all-linear", layers=2, checkpointed=2)
    layers = _as_train_stage_sets_up(model, 2, True, 0, True)
    assert skip_down_proj_in_recompute(layers, 2, offloaded=True) == 0
    assert not any(getattr(m, "_loraship_output_unused_in_recompute", False) for m in model.modules())


def test_outside_a_recompute_down_proj_computes():
    """The mark acts only inside recomputing(): an evaluation forward with autograd off is the real thing."""
    from loraship.training.recompute import skip_down_proj_in_recompute

    reference, model = _model("qwen2", QVO), _model("qwen2", QVO)
    _as_train_stage_sets_up(reference, 3, True, 0, False)
    layers = _as_train_stage_sets_up(model, 3, True, 0, False)
    skip_down_proj_in_recompute(layers, 3, offloaded=True)
    reference.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, reference(input_ids=IDS).logits)
