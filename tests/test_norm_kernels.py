"""loraship/training/norm_kernels.py: the RMSNorm kernel settings keep the model's numbers."""

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
    with pytest.raises(ValueError, match="all, layer, off, compile"):
        norm_kernels.setting()
