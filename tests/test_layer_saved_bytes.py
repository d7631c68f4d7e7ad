"""What one un-checkpointed decoder layer keeps for backward on the train stage's model path, counted, against the
planner's per-layer term (loraship/planning/estimate.py layer_saved_per_token).

The model is the train stage's: a bf16 Qwen2 (transformers' class, 7B's head ratio 7:1), PEFT LoRA, the fused LoRA
nodes (loraship/training/fused_lora.py, SwiGLUDownLora included), Liger's RMSNorm / SwiGLU / RoPE applied as
tasks/train.py applies them, one forward under bf16 autocast. Liger's kernels are Triton and do not run on the CPU,
so the bodies of its three forwards are replaced by torch code that returns what the kernels return (the same
tensors: RMSNorm's view of its input and fp32 rstd, SwiGLU's views of gate and up, RoPE rotating q and k in
place); Liger's own autograd functions, and so their save_for_backward calls, run unchanged. Every saved tensor is
recorded by storage, so a tensor two nodes keep (the normed input q and v both read; the attention output SDPA and
o_proj both keep) counts once, in the layer that saved it first.
"""

from __future__ import annotations

import pytest
import torch

liger_rms = pytest.importorskip("liger_kernel.ops.rms_norm")

from loraship.config import Config  # noqa: E402
from loraship.planning.estimate import layer_saved_per_token  # noqa: E402
from loraship.planning.shape import shape_from_config  # noqa: E402
from loraship.planning.targets import target_names  # noqa: E402

SHAPE = dict(
    hidden_size=448,
    intermediate_size=2368,
    num_hidden_layers=3,
    num_attention_heads=7,
    num_key_value_heads=1,
    vocab_size=256,
)


def _cpu_bodies_for_liger(monkeypatch):
    import liger_kernel.ops.rope as liger_rope
    import liger_kernel.ops.swiglu as liger_swiglu
    import liger_kernel.transformers.rope as liger_rope_module

    def rms_norm_forward(X, W, eps, offset, casting_mode, row_mode):
        shape = X.shape
        X = X.view(-1, shape[-1])
        rstd = torch.rsqrt(X.float().pow(2).mean(-1) + eps)
        Y = (X.float() * rstd[:, None] * (W.float() + offset)).to(X.dtype)
        return Y.view(*shape), X, rstd, 0, 0, casting_mode

    def swiglu_forward(a, b, gate_multiplier=1.0):
        shape = a.shape
        a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        return a, b, (torch.nn.functional.silu(a.float()) * b.float()).to(a.dtype).view(*shape)

    def rope_forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # q_proj's own storage, as the kernel
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        for x in (q, k):
            x1, x2 = x.chunk(2, -1)
            x.copy_(x * c + torch.cat((-x2, x1), -1) * s)
        return q.transpose(1, 2), k.transpose(1, 2), cos, sin

    # Liger patches transformers' Qwen2 module itself (its RoPE, RMSNorm and MLP classes): undone after the test, or
    # every later Qwen2 in the session would run Triton kernels on the CPU.
    from transformers.models.qwen2 import modeling_qwen2

    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))
    monkeypatch.setattr(liger_rms, "rms_norm_forward", rms_norm_forward)
    monkeypatch.setattr(liger_swiglu, "swiglu_forward", swiglu_forward)
    monkeypatch.setattr(liger_rope, "rope_forward", rope_forward)
    # The Triton registration of "rope" (liger_kernel ops/backends/_triton/rope.py) is LigerRopeFunction itself.
    monkeypatch.setattr(
        liger_rope_module,
        "dispatch",
        lambda _op, q, k, cos, sin, pid=None, dim=1, rotary_dim=None: liger_rope.LigerRopeFunction.apply(
            q, k, cos, sin, pid, dim, rotary_dim
        ),
    )


def _train_stage_model(targets, r: int):
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from loraship.training.fused_lora import fuse_lora_linears
    from loraship.training.gradient_checkpointing import checkpoint_first_layers, enable_checkpointing

    config = Qwen2Config(**SHAPE, max_position_embeddings=1024, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    enable_checkpointing(model)  # as tasks/train.py load_model, with no layer checkpointed
    model.enable_input_require_grads()
    checkpoint_first_layers(model, 0)
    model = get_peft_model(
        model,
        LoraConfig(
            r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets, bias="none", task_type="CAUSAL_LM"
        ),
    )
    _apply_liger_kernel_to_instance(model=model.get_base_model(), fused_linear_cross_entropy=True, cross_entropy=False)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    report = fuse_lora_linears(model)
    assert not report["unfused"] and report["swiglu_down"] == (3 if targets == "all-linear" else 0)
    return model.train()


def _bytes_saved_by_middle_layer(model, tokens: int) -> int:
    frozen = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    layers = model.base_model.model.model.layers
    current = {"layer": None}
    hooks = [
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.update(layer=i)) for i, layer in enumerate(layers)
    ]
    first_saver: dict[int, tuple[int, int]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in frozen:
            first_saver.setdefault(storage.data_ptr(), (current["layer"], storage.nbytes()))
        return t

    ids = torch.randint(0, SHAPE["vocab_size"], (2, tokens // 2), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.base_model.model.model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return sum(nbytes for layer, nbytes in first_saver.values() if layer == 1)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "o_proj"], "all-linear"])
def test_one_layer_keeps_what_the_planner_counts(monkeypatch, targets):
    _cpu_bodies_for_liger(monkeypatch)
    model = _train_stage_model(targets, r=16)
    # Two lengths: the difference per token leaves out what does not grow with the tokens (bf16 casts of A and B).
    counted = (_bytes_saved_by_middle_layer(model, 256) - _bytes_saved_by_middle_layer(model, 128)) / 128
    cfg = Config(
        base_model="org/model",
        datasets=[{"path": "d.jsonl", "type": "completion"}],
        lora_r=16,
        lora_target_modules=targets,
        lora_dropout=0.0,
        fused_loss="on",
    )
    s = shape_from_config({"model_type": "qwen2", **SHAPE})
    planned = layer_saved_per_token(s, cfg, target_names(cfg, s), "train-stage", liger=True)
    # The planner leaves out two per-row fp32 statistics: RMSNorm's rstd (4 B, two norms) and SDPA's logsumexp
    # (4 B per head), 36 B here. Flash and cuDNN attention on CUDA keep the same five tensors (q, k, v, output,
    # logsumexp) as the CPU kernel. The bound, 64 B, is half the smallest tensor of the layer (k or v: 128 B per
    # token), so a tensor counted twice or missed fails.
    assert 0 <= counted - planned <= 64, (counted, planned)


# Small layers of the families whose structure the planner reads off the class (loraship/planning/shape.py): q and k
# normed before RoPE (Qwen3 per head, OLMo 2 over all heads, Gemma 3 per head with four layer norms and GELU),
# Granite's multipliers. Hidden 512, 8 heads of 64 over 2 KV heads, intermediate 1536.
FAMILY_LAYERS = {
    "qwen3": dict(head_dim=64),
    "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=64),
    "olmo2": dict(),
    "granite": dict(
        residual_multiplier=0.22, embedding_multiplier=12.0, attention_multiplier=0.015625, logits_scaling=8.0
    ),
    "llama": dict(),
}


def _bytes_saved_by_plain_layer(model, tokens: int) -> int:
    """Bytes the second decoder layer of a bf16 transformers model (SDPA, frozen weights) saves for backward."""
    frozen = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    layers = model.model.layers
    current = {"layer": None}
    hooks = [
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.update(layer=i)) for i, layer in enumerate(layers)
    ]
    first_saver: dict[int, tuple[int, int]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in frozen:
            first_saver.setdefault(storage.data_ptr(), (current["layer"], storage.nbytes()))
        return t

    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(inputs_embeds=embeds)
    for hook in hooks:
        hook.remove()
    return sum(nbytes for layer, nbytes in first_saver.values() if layer == 1)


@pytest.mark.parametrize("mt", sorted(FAMILY_LAYERS))
def test_one_plain_layer_of_each_family_keeps_what_the_planner_counts(mt):
    """transformers' own layer code (no Liger, no LoRA), bf16 with SDPA, counted with saved-tensor hooks: the
    planner's per-layer term within 2% (what it leaves out: per-row norm statistics and SDPA's logsumexp). QK-norm
    keeps q and k in fp32 once more (4 (q + kv) bytes per token); Gemma 3's sliding layers (a window of 64 here,
    shorter than both lengths) run SDPA with a mask, which keeps k and v repeated to every head and the S x S mask."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from loraship.planning.shape import shape_from_config

    mc = dict(
        model_type=mt,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **FAMILY_LAYERS[mt],
    )
    config = AutoConfig.for_model(**mc)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.requires_grad_(False)
    # Two lengths: the difference leaves out what does not grow with the tokens (fp32 casts of the norm weights).
    counted = _bytes_saved_by_plain_layer(model, 256) - _bytes_saved_by_plain_layer(model, 128)
    s = shape_from_config(mc, check_converter=False)

    def planned_bytes(tokens):
        cfg = Config(
            base_model="org/model",
            datasets=[{"path": "d.jsonl", "type": "completion"}],
            lora_dropout=0.0,
            sequence_len=tokens,
        )
        return tokens * layer_saved_per_token(s, cfg, (), "train-stage", liger=False)

    planned = planned_bytes(256) - planned_bytes(128)
    assert s.qk_norm == (mt in ("qwen3", "gemma3_text", "olmo2"))
    assert planned == pytest.approx(counted, rel=0.02), (counted, planned)
