"""CPU offload of frozen weights changes where weights live, never what the model computes;
the prefetch copies the layer that runs next (forward: up, checkpoint recompute: down)."""

from __future__ import annotations

import weakref

import pytest
import torch

from tests.conftest import loss_and_grads


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


@pytest.mark.parametrize("n_layers", [1, 2])  # the tiny model has 2 layers: 2 offloads the last layer too
def test_offloaded_layers_train_identically(tiny_model, n_layers):
    from loraship.training.offload import offload_frozen_layers

    ids = torch.tensor([[1, 3, 40, 41, 42, 43, 4, 50, 51, 2]])
    reference = _model(tiny_model)
    # LoRA B starts at zero; give it a value so gradients reach every LoRA matrix.
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    state = {n: p.detach().clone() for n, p in reference.named_parameters()}
    loss_ref, grads_ref = loss_and_grads(reference, ids)

    offloaded = _model(tiny_model)
    with torch.no_grad():
        for n, p in offloaded.named_parameters():
            p.copy_(state[n])
    kept = offload_frozen_layers(offloaded, n_layers)
    assert kept > 0
    first = offloaded.get_base_model().model.layers[0]  # the first n layers stream (the checkpointed ones)
    frozen = [m for m in first.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad]
    assert frozen and all(m.weight.numel() == 0 and hasattr(m, "_loraship_cpu_weight") for m in frozen)
    for _ in range(2):  # a second step: the prefetch state from the first must not leak into it
        loss, grads = loss_and_grads(offloaded, ids)
        assert loss == torch.tensor(loss_ref).item() or abs(loss - loss_ref) < 1e-6
        assert grads.keys() == grads_ref.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# The prefetch schedule, observed through a Transfer that copies by clone() and keeps a log
# ---------------------------------------------------------------------------------------------
class RecordingTransfer:
    """Stands in for the CUDA copies: clones (so each copy is a distinct tensor whose lifetime can be
    watched), logs which decoder layer each prefetch is for, counts on-the-spot copies."""

    def __init__(self):
        self.layer_of = {}  # id(cpu weight) -> decoder layer index, filled in by the test
        self.prefetched, self.fallbacks, self.dropped, self.copies, self.peak = [], 0, 0, [], 0

    def _watch(self, cpu_weight, copy):
        self.copies.append((self.layer_of.get(id(cpu_weight)), weakref.ref(copy)))
        self.peak = max(self.peak, len(self.alive()))

    def alive(self):
        """Decoder layers with a copy still referenced by anyone (prefetcher or autograd)."""
        return {layer for layer, ref in self.copies if ref() is not None}

    def now(self, cpu_weight, device):
        self.fallbacks += 1
        copy = cpu_weight.clone()
        self._watch(cpu_weight, copy)
        return copy

    def start(self, cpu_weights, device):
        self.prefetched.append(self.layer_of[id(cpu_weights[0])])
        copies = [w.clone() for w in cpu_weights]
        for w, c in zip(cpu_weights, copies):
            self._watch(w, c)
        return copies, None

    def ready(self, copy, done):
        return copy

    def drop(self, copies, done):
        self.dropped += 1


def _generated_model(checkpointing=True):
    """A 4-layer Llama built from a config: enough layers to see the schedule walk up and down."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    base = LlamaForCausalLM(config)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.train()
    return model


def _offload_recording(model, layers):
    from loraship.training.offload import offload_frozen_layers

    transfer = RecordingTransfer()
    offload_frozen_layers(model, layers, transfer=transfer)
    layers = model.get_base_model().model.layers
    transfer.layer_of = {
        id(m._loraship_cpu_weight): i
        for i, layer in enumerate(layers)
        for m in layer.modules()
        if hasattr(m, "_loraship_cpu_weight")
    }
    return transfer


IDS = torch.tensor([[5, 9, 17, 33, 65, 100, 3, 7, 11, 13, 2, 1]])


def _checkpoint_first(model, k):
    """What tasks/train.py checkpoint_first_layers does: only the first k decoder layers recompute."""
    for i, layer in enumerate(model.get_base_model().model.layers):
        layer.gradient_checkpointing = i < k


def _step_schedule(model, transfer, reference_grads, loss_ref):
    """One training step: (layers prefetched in forward, in backward); checks the gradients on the way."""
    transfer.prefetched.clear()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=IDS, labels=IDS).loss
    forward = list(transfer.prefetched)
    transfer.prefetched.clear()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert abs(loss.item() - loss_ref) < 1e-6 and grads.keys() == reference_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-5, atol=1e-7)
    return forward, list(transfer.prefetched)


@pytest.mark.parametrize(
    "streamed, checkpointed, forward, backward",
    [
        # All 4 streamed: the last layer, once forward is done with it, is copied again for its recompute, the first
        # thing backward does; recomputing i copies i - 1.
        (4, 4, [0, 1, 2, 3, 3], [2, 1, 0]),
        # 3 streamed, every layer checkpointed: layer 3 (resident) recomputes first; its recompute copies layer 2.
        (3, 4, [0, 1, 2], [2, 1, 0]),
        # 2 streamed, 3 checkpointed: layer 3 keeps its activations (no recompute); layer 2's recompute copies layer 1.
        (2, 3, [0, 1], [1, 0]),
        # Spread (Strategy.streamed): layer 0 starting copies layer 2, which has layer 1's forward to hide behind;
        # layer 3's recompute copies layer 2, layer 2's copies layer 0 (with layer 1's recompute and backward between).
        ([0, 2], 4, [0, 2], [2, 0]),
        # Spread up to the last layer: copied again for its recompute as forward ends; its recompute copies layer 1.
        ([1, 3], 4, [1, 3, 3], [1]),
    ],
)
@pytest.mark.parametrize("activations_in_cpu", [False, True])
def test_prefetch_walks_up_in_forward_and_down_in_the_recompute(
    streamed, checkpointed, forward, backward, activations_in_cpu
):
    from loraship.training.activation_offload import offload_checkpointed_activations

    reference = _generated_model()
    _checkpoint_first(reference, checkpointed)
    loss_ref, grads_ref = loss_and_grads(reference, IDS)
    model = _generated_model()  # same seed: same weights
    _checkpoint_first(model, checkpointed)
    if activations_in_cpu:  # tasks/train.py's order: the checkpointing function first, then the weights
        offload_checkpointed_activations(list(model.get_base_model().model.layers), checkpointed)
    transfer = _offload_recording(model, streamed)
    for _ in range(2):  # a second step: the prefetch state from the first must not leak into it
        assert _step_schedule(model, transfer, grads_ref, loss_ref) == (forward, backward)
        assert transfer.fallbacks == 0  # every weight was prefetched: no copy on the spot
        assert transfer.peak <= 2  # current + next: never more than two layers' copies alive, whoever holds them
    prefetcher = model.get_base_model().model._loraship_prefetcher
    n = streamed if isinstance(streamed, int) else len(streamed)
    assert (prefetcher.passes, prefetcher.late) == (2 * 2 * n, 0)  # 2 steps: forward + recompute of each


@pytest.mark.parametrize("streamed", [2, [0, 1]])
def test_streaming_every_checkpointed_layer_costs_one_copy_on_the_spot(streamed):
    """k == n: the layer after the streamed ones is not recomputed, so nothing announces the last streamed layer's
    recompute; it is copied when it starts, and waited for (the result is the same)."""
    reference = _generated_model()
    _checkpoint_first(reference, 2)
    loss_ref, grads_ref = loss_and_grads(reference, IDS)
    model = _generated_model()
    _checkpoint_first(model, 2)
    transfer = _offload_recording(model, streamed)
    assert _step_schedule(model, transfer, grads_ref, loss_ref) == ([0, 1], [1, 0])
    assert (
        model.get_base_model().model._loraship_prefetcher.late == 1 and transfer.fallbacks == 0 and transfer.peak <= 2
    )


def test_unconsumed_prefetch_is_dropped_at_the_next_step():
    model = _generated_model()
    transfer = _offload_recording(model, 4)
    model(input_ids=IDS, labels=IDS)  # a training forward with no backward: layer 3's recompute copy waits
    assert transfer.alive() == {3}
    with torch.no_grad():  # e.g. an eval step; no recompute follows, so nothing is left behind
        model(input_ids=IDS)
    assert transfer.alive() == set() and transfer.dropped == 1
    assert transfer.prefetched == [0, 1, 2, 3, 3, 0, 1, 2, 3]
    assert transfer.peak <= 2


def test_without_checkpointing_nothing_is_copied_for_a_recompute():
    model = _generated_model(checkpointing=False)
    transfer = _offload_recording(model, 2)
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert transfer.prefetched == [0, 1] and transfer.fallbacks == 0


def test_a_wrong_guess_costs_a_copy_never_a_wrong_weight():
    from loraship.training.offload import Prefetcher

    class Module:  # what the prefetcher needs of a Linear: its CPU weight, hashable by identity
        def __init__(self, value):
            self._loraship_cpu_weight = torch.full((2, 2), value)

    # Three layers of two modules each, visited in an order no model produces.
    layers = [[Module(float(10 * i + k)) for k in range(2)] for i in range(3)]
    transfer = RecordingTransfer()
    transfer.layer_of = {id(m._loraship_cpu_weight): i for i, ms in enumerate(layers) for m in ms}
    prefetcher = Prefetcher(layers, recompute_follows=lambda: True, transfer=transfer)
    cpu = torch.device("cpu")
    prefetcher.step(cpu)
    for i, k in [(0, 0), (2, 1), (2, 0), (0, 1), (1, 0), (1, 0), (2, 0), (2, 1), (2, 0)]:
        module = layers[i][k]
        assert torch.equal(prefetcher.weight(i, module, cpu), module._loraship_cpu_weight)
        assert len(prefetcher.held) <= 2
    assert prefetcher.late > 0  # the jumps were not prefetched; they were copied when they came


def test_streamed_layers_outside_the_model_are_refused():
    from loraship.training.offload import offload_frozen_layers

    with pytest.raises(ValueError, match=r"streamed layers \[2, 4\] outside the model's 4 decoder layers"):
        offload_frozen_layers(_generated_model(), [2, 4])
