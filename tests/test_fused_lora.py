"""The fused LoRA Linear (loraship/training/fused_lora.py) computes what PEFT's LoRA Linear computes: same
loss, same gradients for every LoRA matrix and for the input, for plain Linears, Qwen2's biased q/k/v, QLoRA's
4-bit base, streamed (offloaded) weights and dropout; and leaves PEFT's path where it cannot follow it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import loss_and_grads


def _peft_model(model_dir, targets="all-linear", dropout=0.0, quantized=False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    kwargs = {"dtype": torch.float32}
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    base = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=dropout))
    with torch.no_grad():  # LoRA B starts at zero; a value makes every LoRA gradient and the LoRA term non-zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):  # as tasks/train.py load_model does on the CPU
            module.support_avx512bf16_for_cpu = False
    model.train()
    return model


IDS = torch.tensor([[1, 3, 40, 41, 42, 43, 4, 50, 51, 2], [1, 7, 8, 9, 10, 11, 12, 13, 14, 2]])


def _assert_same(reference, fused, ids=IDS):
    loss_ref, grads_ref = loss_and_grads(reference, ids)
    loss, grads = loss_and_grads(fused, ids)
    assert abs(loss - loss_ref) < 1e-5 * max(1.0, abs(loss_ref))
    assert grads.keys() == grads_ref.keys() and any("lora_A" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_qwen"])  # Llama (no biases), Qwen2 (biased q/k/v)
def test_fused_lora_matches_peft(model_name, request):
    from loraship.training.fused_lora import fuse_lora_linears

    model_dir = request.getfixturevalue(model_name)
    reference, fused = _peft_model(model_dir), _peft_model(model_dir)
    fused.load_state_dict(reference.state_dict())
    report = fuse_lora_linears(fused)
    assert report["fused"] == 7 * fused.config.num_hidden_layers and not report["unfused"]
    _assert_same(reference, fused)


def test_fused_lora_matches_peft_on_a_4bit_base(tiny_qwen):
    from loraship.training.fused_lora import fuse_lora_linears

    reference, fused = _peft_model(tiny_qwen, quantized=True), _peft_model(tiny_qwen, quantized=True)
    with torch.no_grad():
        for (n, p), (_, q) in zip(reference.named_parameters(), fused.named_parameters()):
            if p.requires_grad:
                q.copy_(p)
    assert fuse_lora_linears(fused)["fused"] == 7 * fused.config.num_hidden_layers
    _assert_same(reference, fused)


@pytest.mark.parametrize("swiglu_down", [False, True])
def test_fused_lora_streams_offloaded_weights(tiny_model, swiglu_down):
    """Offloaded layers' LoRA Linears take the fused path on the streamed copy of their weight; so does the MLP node,
    which asks for down_proj's copy before gate's and up's."""
    from loraship.training.fused_lora import fuse_lora_linears
    from loraship.training.offload import offload_frozen_layers

    reference, fused = _peft_model(tiny_model), _peft_model(tiny_model)
    fused.load_state_dict(reference.state_dict())
    offload_frozen_layers(fused, 1)
    report = fuse_lora_linears(fused, only_liger=not swiglu_down)
    assert report["fused"] == 7 * fused.config.num_hidden_layers
    assert report["swiglu_down"] == (fused.config.num_hidden_layers if swiglu_down else 0)
    for _ in range(2):
        _assert_same(reference, fused)


def test_fused_lora_dropout_is_peft_dropout():
    """With dropout: the same mask gives PEFT's output and gradients, and the mask is drawn afresh each call."""
    from peft import LoraConfig, get_peft_model

    from loraship.training.fused_lora import fuse_lora_linears

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 24))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0"], lora_dropout=0.25))
    with torch.no_grad():
        model.base_model.model[0].lora_B["default"].weight.normal_(0, 0.1)
    fuse_lora_linears(model)
    layer = model.base_model.model[0]
    x = torch.randn(5, 16, requires_grad=True)
    torch.manual_seed(1)
    out = model(x)
    out.pow(2).sum().backward()
    # The reference, by hand with the mask the fused node drew (same seed, same draw).
    torch.manual_seed(1)
    mask = torch.empty(5, 16, dtype=torch.bool).bernoulli_(0.75)
    a = layer.lora_A["default"].weight.detach().clone().requires_grad_()
    b = layer.lora_B["default"].weight.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    ref = layer.base_layer(x_ref) + (x_ref * mask / 0.75) @ a.t() @ b.t() * layer.scaling["default"]
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.lora_A["default"].weight.grad, a.grad)
    torch.testing.assert_close(layer.lora_B["default"].weight.grad, b.grad)
    assert not torch.equal(model(x), model(x))  # a new mask each call
    model.eval()
    torch.testing.assert_close(model(x), layer.base_layer(x) + x @ a.t() @ b.t() * layer.scaling["default"])


def test_what_fused_lora_leaves_to_peft(tiny_model):
    """DoRA is PEFT's to run; disabled adapters run the base alone, as PEFT's forward does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraship.training.fused_lora import fuse_lora_linears

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    dora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    report = fuse_lora_linears(dora)
    assert report["fused"] == 0 and sum(report["unfused"].values()) == base.config.num_hidden_layers

    model = _peft_model(tiny_model, targets=["q_proj", "v_proj"])
    fuse_lora_linears(model)
    with torch.no_grad():
        with model.disable_adapter():
            off = model(input_ids=IDS).logits
        on = model(input_ids=IDS).logits
        base_only = model.get_base_model()
    assert not torch.allclose(on, off)
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(base_only(input_ids=IDS).logits, off)


def test_swiglu_down_node_matches_peft(tiny_qwen):
    """The MLP node (gate and up kept, h = silu(gate) * up rebuilt in backward) gives PEFT's loss and gradients."""
    from loraship.training.fused_lora import fuse_lora_linears

    reference, fused = _peft_model(tiny_qwen), _peft_model(tiny_qwen)
    fused.load_state_dict(reference.state_dict())
    report = fuse_lora_linears(fused, only_liger=False)
    assert report["swiglu_down"] == fused.config.num_hidden_layers
    _assert_same(reference, fused)
    # Adapters disabled: the MLP's own forward runs, gradients still reach the input.
    with fused.disable_adapter():
        loss = fused(input_ids=IDS, labels=IDS).loss
    with reference.disable_adapter():
        loss_ref = reference(input_ids=IDS, labels=IDS).loss
    assert abs(loss.item() - loss_ref.item()) < 1e-5


def test_swiglu_down_node_with_dropout():
    """With dropout on down's LoRA: the mask the node drew over h gives the hand-written result and gradients."""
    from loraship.training.fused_lora import SwiGLUDownLora

    torch.manual_seed(0)
    tokens, f, h_out, r, p, s = 6, 20, 12, 4, 0.25, 2.0
    gate, up = torch.randn(tokens, f, requires_grad=True), torch.randn(tokens, f, requires_grad=True)
    weight, a, b = (
        torch.randn(h_out, f),
        torch.randn(r, f, requires_grad=True),
        torch.randn(h_out, r, requires_grad=True),
    )
    torch.manual_seed(1)
    out = SwiGLUDownLora.apply(gate, up, weight, None, None, a, b, s, p, torch.float32)
    out.pow(2).sum().backward()
    torch.manual_seed(1)
    mask = torch.empty(tokens, f, dtype=torch.bool).bernoulli_(1 - p)
    g2, u2, a2, b2 = (t.detach().clone().requires_grad_() for t in (gate, up, a, b))
    hidden = torch.nn.functional.silu(g2) * u2
    ref = hidden @ weight.t() + (hidden * mask / (1 - p)) @ a2.t() @ b2.t() * s
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    for mine, theirs in ((gate, g2), (up, u2), (a, a2), (b, b2)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-4)  # sums of products near 10


def test_swiglu_down_keeps_gate_and_up_not_h(tiny_qwen):
    """What the MLP keeps for backward: gate and up, and no other tensor of their size (h is rebuilt)."""
    from loraship.training.fused_lora import fuse_lora_linears

    def intermediate_sized_saves(model):
        tokens, f, seen = 20, model.config.intermediate_size, []

        def pack(t):
            if t.numel() == tokens * f:
                seen.append(t)
            return t

        mlp = model.base_model.model.model.layers[0].mlp
        x = torch.randn(2, tokens // 2, model.config.hidden_size, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mlp(x).sum().backward()
        return len({t.data_ptr() for t in seen})

    reference, fused = _peft_model(tiny_qwen), _peft_model(tiny_qwen)
    fuse_lora_linears(reference)  # LoRA Linears fused, the MLP as it is (no Liger on the CPU): h kept for down
    fuse_lora_linears(fused, only_liger=False)
    assert intermediate_sized_saves(fused) == 2 < intermediate_sized_saves(reference)


def test_swiglu_down_backward_lets_h_go_before_its_gradient_is_made(tiny_qwen, monkeypatch):
    """In the MLP node's backward, h (rebuilt for A's gradient) is freed before down's input gradient, the other
    tensor of gate's size, is allocated: one such transient at a time beyond gate and up."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    from loraship.training import fused_lora

    model = _peft_model(tiny_qwen)
    fused_lora.fuse_lora_linears(model, only_liger=False)
    rebuilt = []
    swiglu = fused_lora._swiglu
    monkeypatch.setattr(fused_lora, "_swiglu", lambda g, u: rebuilt.append(weakref.ref(h := swiglu(g, u))) or h)
    tokens, f = 20, model.config.intermediate_size

    class GateSizedMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.h_alive = []  # per matmul producing a gate-sized tensor after h was rebuilt: was h still alive?

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (
                func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
                and out.shape == (tokens, f)
                and rebuilt
            ):
                self.h_alive.append(any(ref() is not None for ref in rebuilt))
            return out

    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(2, tokens // 2, model.config.hidden_size, requires_grad=True)
    loss = mlp(x).sum()
    rebuilt.clear()  # the forward's h; backward rebuilds its own
    with GateSizedMatmuls() as mode:
        loss.backward()
    assert rebuilt and mode.h_alive == [False]  # one gate-sized matmul (down's input gradient), h already gone


def _lora_casts_counted(model):
    """A dispatch mode counting fp32 -> bf16 copies of tensors shaped like a LoRA A or B of `model`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = {tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n}

    class Count(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
                if args[0].dtype == torch.float32 and tuple(args[0].shape) in shapes:
                    Count.casts += 1
            return func(*args, **kwargs)

    return Count


def _train_steps(model, kept: bool, steps: int = 3, **adamw) -> tuple[list[float], int]:
    """`steps` AdamW steps of two micro-batches each under CPU bf16 autocast (checkpointed: each layer recomputes);
    the losses and how many A/B casts were made."""
    import contextlib

    from loraship.training.fused_lora import casts_kept_until_step

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, **adamw)
    counted, losses = _lora_casts_counted(model), []
    with casts_kept_until_step(optimizer) if kept else contextlib.nullcontext(), counted():
        for _ in range(steps):
            for ids in (IDS[:1], IDS[1:]):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses, counted.casts


# The step hook drops the casts: fused AdamW leaves the masters' versions as they were (torch 2.13, CPU).
@pytest.mark.parametrize("adamw", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_lora_casts_are_made_once_per_optimizer_step_and_follow_its_updates(tiny_model, adamw):
    from loraship.training.fused_lora import fuse_lora_linears

    each, kept = _peft_model(tiny_model), _peft_model(tiny_model)
    kept.load_state_dict(each.state_dict())
    modules = fuse_lora_linears(each)["fused"]
    assert fuse_lora_linears(kept)["fused"] == modules > 0
    losses_each, casts_each = _train_steps(each, kept=False, **adamw)
    losses_kept, casts_kept = _train_steps(kept, kept=True, **adamw)
    # Identical losses at every micro-batch after the first step: no cast outlived the update it was made before.
    assert losses_kept == losses_each and len(set(losses_kept)) == len(losses_kept)
    steps, micro_batches = 3, 2
    assert casts_kept == steps * 2 * modules  # A and B of every module, once per optimizer step
    assert casts_each == steps * micro_batches * 2 * 2 * modules  # ... at each forward and each recompute


def test_a_lora_master_changed_in_place_is_cast_again(tiny_model):
    from loraship.training.fused_lora import casts_kept_until_step, fuse_lora_linears

    model = _peft_model(tiny_model)
    fuse_lora_linears(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with casts_kept_until_step(optimizer), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = model(input_ids=IDS).logits
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(3.0)  # what loading a checkpoint into the masters does: in place, no optimizer step
        during = model(input_ids=IDS).logits
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = model(input_ids=IDS).logits
    assert not torch.equal(before, during)
    assert torch.equal(during, after)
