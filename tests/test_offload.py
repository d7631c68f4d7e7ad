"""CPU offload of frozen weights changes where weights live, never what the model computes."""

from __future__ import annotations

import torch


def _model(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    model.train()
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.item(), grads


def test_offloaded_layers_train_identically(tiny_model):
    from loraship.offload import offload_frozen_layers

    ids = torch.tensor([[1, 3, 40, 41, 42, 43, 4, 50, 51, 2]])
    reference = _model(tiny_model)
    # LoRA B starts at zero; give it a value so gradients reach every LoRA matrix.
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    state = {n: p.detach().clone() for n, p in reference.named_parameters()}
    loss_ref, grads_ref = _loss_and_grads(reference, ids)

    offloaded = _model(tiny_model)
    with torch.no_grad():
        for n, p in offloaded.named_parameters():
            p.copy_(state[n])
    kept = offload_frozen_layers(offloaded, 1)
    assert kept > 0
    last = offloaded.get_base_model().model.layers[-1]
    frozen = [m for m in last.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad]
    assert frozen and all(m.weight.numel() == 0 and hasattr(m, "_loraship_cpu_weight") for m in frozen)
    loss, grads = _loss_and_grads(offloaded, ids)
    assert loss == torch.tensor(loss_ref).item() or abs(loss - loss_ref) < 1e-6
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-7)
