"""loraship/training/norm_kernels.py: the RMSNorm kernel settings keep the model's numbers."""

import os
import subprocess
import sys
import textwrap

import pytest

from loraship.training import norm_kernels


def tiny_gemma3():
    import torch
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        max_position_embeddings=64,
    )
    return Gemma3ForCausalLM(config).eval()


def loss_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "norm" in n}
    model.zero_grad()
    return out.loss.item(), grads


def test_layer_setting_puts_the_per_head_norms_back_on_their_own_forward(monkeypatch):
    model = tiny_gemma3()
    for name, module in model.named_modules():  # what Liger's patch does: a forward bound on the instance
        if name.endswith("norm"):
            module.__dict__["forward"] = lambda x: x
    monkeypatch.setenv("LORASHIP_LIGER_NORMS", "layer")
    assert norm_kernels.adjust_norms(model) == 4  # q_norm and k_norm of two layers
    patched = sorted(n.rsplit(".", 1)[-1] for n, m in model.named_modules() if "forward" in m.__dict__)
    assert "q_norm" not in patched and "k_norm" not in patched and "input_layernorm" in patched


@pytest.mark.slow  # inductor's CPU compile: about a minute
def test_compiled_norms_give_the_same_loss_and_gradients(monkeypatch):
    import torch

    ids = torch.randint(0, 64, (2, 12))
    model = tiny_gemma3()
    eager_loss, eager_grads = loss_and_grads(model, ids)
    monkeypatch.setenv("LORASHIP_LIGER_NORMS", "compile")
    assert norm_kernels.liger_norm_kwargs() == {"rms_norm": False}
    assert norm_kernels.adjust_norms(model) == 2 * 6 + 1  # six norms a layer and the final one
    loss, grads = loss_and_grads(model, ids)
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    assert grads.keys() == eager_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6)


def test_an_unknown_setting_names_the_choices(monkeypatch):
    monkeypatch.setenv("LORASHIP_LIGER_NORMS", "fast")
    with pytest.raises(ValueError, match="all, liger, layer, off, compile"):
        norm_kernels.setting()


# Triton's interpreter runs loraship/training/rms_norm_backward.py's kernel on the CPU (set before triton is imported,
# hence a child). Liger's forward kernel does not run there, so the child gives its function a torch forward that
# returns what Liger's saves: the gradient under test is the kernel's alone.
SPREAD_CHILD = textwrap.dedent(
    """
    import torch
    import liger_kernel.ops.rms_norm as liger_ops
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module
    from tests.test_norm_kernels import tiny_gemma3
    from loraship.training import norm_kernels

    def torch_forward(X, W, eps, offset, casting_mode, row_mode):
        x = X.reshape(-1, X.shape[-1]).float()
        rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
        y = (x * rstd[:, None] * (W.float() + offset)).to(X.dtype)
        return y.view(X.shape), X.reshape(-1, X.shape[-1]), rstd, 64, 4, casting_mode

    liger_ops.rms_norm_forward = torch_forward
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 12))
    results = []
    for spread in (False, True):
        model = tiny_gemma3()
        for name, param in model.named_parameters():
            param.requires_grad_("norm" not in name)  # frozen norms, as under LoRA
        if spread:
            for name, module in model.named_modules():
                if name.endswith("norm"):
                    _patch_rms_norm_module(module, offset=1.0, casting_mode="gemma", in_place=False)
            assert norm_kernels.adjust_norms(model) == 2 * 6 + 1
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager_loss, eager), (loss, spread) = results
    assert abs(loss - eager_loss) < 1e-5 * abs(eager_loss), (loss, eager_loss)
    assert spread.keys() == eager.keys() and len(spread) > 10
    for name, grad in spread.items():
        torch.testing.assert_close(grad, eager[name], rtol=1e-4, atol=1e-6)
    print("ok", len(spread))
    """
)


def test_the_spread_backward_gives_the_same_gradients_as_transformers():
    pytest.importorskip("liger_kernel")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SPREAD_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


def test_the_spread_backward_matches_the_formula_on_wide_rows_and_bf16():
    child = textwrap.dedent(
        """
        import torch
        from loraship.training.rms_norm_backward import input_grad
        torch.manual_seed(0)
        # (shape, offset, dtype, weight, in place): a 300-wide row pads to 512 columns; 16 rows a program on 24 wide
        for shape, offset, dtype, has_w, in_place in [((70, 300), 0.0, torch.bfloat16, True, False),
                                                      ((2, 5, 4, 16), 1.0, torch.float32, True, True),
                                                      ((9, 24), 0.0, torch.float32, False, False)]:
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            w = torch.randn(shape[-1], dtype=dtype) * 0.1 if has_w else None
            g = torch.randn(shape, dtype=dtype)
            rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
            (x.float() * rstd * ((w.float() + offset) if has_w else 1.0)).to(dtype).backward(g)
            ours = input_grad(g.clone(), x.detach(), w, rstd.detach().reshape(-1), offset, in_place)
            assert ours.shape == x.shape and ours.dtype == dtype
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(ours.float(), x.grad.float(), rtol=tol, atol=tol)
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


def _stand_in_liger_forward(X, W, eps, offset, casting_mode, row_mode):
    """What Liger's rms_norm_forward returns (its Triton kernel does not run on the CPU), computed by torch."""
    import torch

    x = X.view(-1, X.shape[-1]).float()  # view: Liger's own needs contiguous rows as well
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    y = (x * rstd[:, None] * (W.float() + offset)).to(X.dtype)
    return y.view(X.shape), X.view(-1, X.shape[-1]), rstd, 64, 4, casting_mode


def test_a_heads_first_norm_keeps_the_projection_layout_without_copying(monkeypatch):
    """Gemma 3 hands its q/k norms attention's [batch, heads, tokens, head_dim] view of the projection's output. The
    norm runs on the projection's rows as they lie and gives back the same view, so RoPE and attention need no
    copy either: no bf16 copy in the norm's forward, the output tokens-first in memory, the values unchanged."""
    import liger_kernel.ops.rms_norm as liger_ops
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from loraship.training.rms_norm_backward import FrozenWeightRMSNorm, heads_first_view

    monkeypatch.setattr(liger_ops, "rms_norm_forward", _stand_in_liger_forward)
    copies = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}

    class SameDtypeCopies(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in copies and out.dtype == args[0].dtype:
                SameDtypeCopies.seen += 1
            return out

    torch.manual_seed(0)
    projection = torch.randn(2, 5, 3, 16, dtype=torch.bfloat16)  # [batch, tokens, heads, head_dim], contiguous
    weight = torch.randn(16, dtype=torch.bfloat16) * 0.1
    view = projection.transpose(1, 2)
    assert heads_first_view(view) and not heads_first_view(projection) and not heads_first_view(view.contiguous())
    with SameDtypeCopies():
        out = FrozenWeightRMSNorm.apply(view, weight, 1e-6, 1.0, "gemma", False, None)
    assert SameDtypeCopies.seen == 0
    assert out.shape == view.shape and out.transpose(1, 2).is_contiguous()
    expected = _stand_in_liger_forward(view.contiguous(), weight, 1e-6, 1.0, "gemma", None)[0]
    assert torch.equal(out, expected)
