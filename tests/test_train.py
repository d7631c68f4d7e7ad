"""The train stage's own invariants on the CPU: packing, epochs, resume with dropout, out-of-memory handling."""

from __future__ import annotations

import importlib
import json
import weakref

import pytest
import torch

from loraship.config import parse_config
from loraship.training.packing import collate_packed, collate_padded, epoch_steps, steps_per_epoch
from loraship.runtime.stage import stage_dir
from tests.conftest import demo_config_dict

# 96 demo examples less the 12 eval rows kept apart: micro 5 x accumulation 3 leaves a short last step.
SHORT = dict(
    max_steps=None, num_epochs=1, micro_batch_size=5, gradient_accumulation_steps=3, save_steps=1000, warmup_steps=0
)


def run_stages(config, stages):
    return {s: importlib.import_module(f"loraship.stages.{s}").run(config) for s in stages}


def curve(config) -> list[dict]:
    return [json.loads(line) for line in (stage_dir(config, "train") / "loss_history.jsonl").read_text().splitlines()]


# --- which examples train in which step ---------------------------------------------------------
@pytest.mark.parametrize(
    "n,micro,accum,budget",
    [(97, 5, 3, None), (10, 4, 2, None), (3, 8, 4, None), (97, 2, 3, 64), (40, 4, 1, 120), (41, 1, 8, 45)],
)
def test_every_example_trains_exactly_once_per_epoch(n, micro, accum, budget):
    lengths = [1 + (i * 7) % 29 for i in range(n)]
    steps = epoch_steps(lengths, micro, accum, seed=3, epoch=0, budget=budget)
    seen = [i for step in steps for rows in step for row in rows for i in row]
    assert sorted(seen) == list(range(n))
    assert len(steps) == steps_per_epoch(n, micro, accum) == -(-n // (micro * accum))  # the short last step too
    for step in steps:
        assert 1 <= len(step) <= accum and all(1 <= len(rows) <= micro for rows in step)
        if budget:  # a packed micro-batch is one row within the token budget (>= micro x the longest example)
            assert all(len(rows) == 1 and sum(lengths[i] for i in rows[0]) <= budget for rows in step)


def test_a_step_holds_the_same_examples_packed_or_not_whatever_the_micro_batch():
    """The loss curve packed equals the padded one, and an out-of-memory re-plan (same micro x accumulation)
    resumes on the same examples."""
    lengths = [1 + (i * 11) % 37 for i in range(101)]
    layouts = [
        epoch_steps(lengths, micro, 8 // micro, 7, 2, budget) for micro in (4, 1) for budget in (None, micro * 48)
    ]
    flat = [[sorted(i for rows in step for row in rows for i in row) for step in steps] for steps in layouts]
    assert all(f == flat[0] for f in flat)
    forward_passes = [sum(len(step) for step in steps) for steps in layouts]
    assert forward_passes[1] < forward_passes[0] and forward_passes[3] < forward_passes[2]


def test_one_epoch_trains_every_token(tiny_model, tmp_path):
    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="epoch", packing="off", **SHORT))
    metrics = run_stages(config, ["plan", "train"])["train"]["metrics"]
    assert metrics["train_examples"] % (5 * 3) != 0
    assert metrics["steps"] == -(-metrics["train_examples"] // 15)
    assert metrics["train_tokens_this_run"] == metrics["train_tokens"]
    assert metrics["packing"] == {"packed": False, "why": "packing: off"}
    # The demo config sets no mode: optimize: speed, and the tiny model fits with no layer checkpointed.
    assert (
        metrics["strategy"]["checkpointed_layers"] == 0
        and "gradient checkpointing 0 of 2 layers" in metrics["trained_as"]
    )


# --- packing ------------------------------------------------------------------------------------
def _tiny(tiny_model, packed=False):
    from transformers import AutoModelForCausalLM

    from loraship.training import packed_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    if packed:
        model.set_attn_implementation(packed_attention.register())
    return model


def _examples():
    # Different lengths, labels masked on a prompt part as chat examples are.
    out = []
    for n, prompt in ((9, 3), (5, 2), (13, 6), (1, 0), (7, 7)):
        ids = [1] + [(17 * n + 5 * j) % 200 + 10 for j in range(n - 1)]
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def test_packed_logits_equal_each_example_alone(tiny_model):
    model = _tiny(tiny_model, packed=True)
    examples = _examples()
    inputs = collate_packed(examples)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 9, 14, 27, 28, 35] and inputs["max_length_q"] == 13
    labels, positions = inputs.pop("labels")[0], inputs["position_ids"][0]
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits[0]
        at = 0
        for e in examples:
            n = len(e["input_ids"])
            alone = model(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[at : at + n], alone, rtol=1e-4, atol=1e-4)
            assert positions[at : at + n].tolist() == list(range(n))
            # no example's first token is predicted from the one before it; its own targets are kept
            assert labels[at].item() == -100 and labels[at + 1 : at + n].tolist() == e["labels"][1:]
            at += n
    assert at == packed.shape[0]  # no padding at all


@pytest.mark.parametrize("model_dir", ["tiny_model", "tiny_qwen"])
def test_packed_loss_equals_padded_loss(model_dir, request):
    folder = request.getfixturevalue(model_dir)
    model = _tiny(folder, packed=True)  # padded batches (eval) through the same attention: SDPA with its mask
    examples = _examples()
    ids, labels, mask = collate_padded(examples, pad_id=0)
    inputs = collate_packed(examples)
    assert int((labels[:, 1:] != -100).sum()) == int((inputs["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        packed = model(**inputs, use_cache=False).loss
    assert packed.item() == pytest.approx(padded.item(), rel=1e-5)


def test_a_packed_micro_batch_of_one_length_runs_as_a_plain_batch_with_the_same_loss(tiny_model):
    from loraship.training.batches import micro_batch

    model = _tiny(tiny_model, packed=True)
    nine, thirteen = _examples()[0], _examples()[2]
    same = [nine, nine, {k: v[:9] for k, v in thirteen.items()}]  # three examples of 9 tokens
    plain, tokens, targets = micro_batch(same, [[0, 1], [2]], packed=True, pad_id=0, device="cpu")
    assert set(plain) == {"input_ids", "labels"} and plain["input_ids"].shape == (3, 9) and tokens == 27
    packed = collate_packed(same)
    assert targets == int((packed["labels"][:, 1:] != -100).sum())
    mixed, _, _ = micro_batch(_examples(), [[0, 1, 2], [3, 4]], packed=True, pad_id=0, device="cpu")
    assert mixed["input_ids"].shape == (1, 35) and "cu_seq_lens_q" in mixed  # lengths differ: packed
    with torch.no_grad():
        as_plain = model(**plain, use_cache=False).loss
        as_packed = model(**packed, use_cache=False).loss
    assert as_plain.item() == pytest.approx(as_packed.item(), rel=1e-5)


class _FakeVarlen:
    """torch's varlen_attn as a given torch version spells it, computed per example (the CPU has no kernel)."""

    def __init__(self, params):
        self.params, self.calls = frozenset(params), []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, **options):
        from loraship.training.packed_attention import _per_example

        assert set(options) <= self.params and (options.get("window_size") == (-1, 0) or options.get("is_causal"))
        assert k.shape[1] == q.shape[1] or options.get("enable_gqa")
        self.calls.append(options)
        return _per_example(q, k, v, cu_q, options.get("scale", q.shape[-1] ** -0.5), k.shape[1] != q.shape[1])


@pytest.mark.parametrize(
    "params",
    [
        ("window_size", "scale", "enable_gqa"),  # torch 2.13
        ("is_causal",),
    ],
)  # torch 2.10: no scale, no GQA
def test_the_varlen_call_matches_sdpa_per_example_across_torch_versions(params):
    from loraship.training.packed_attention import _per_example, _varlen

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    q, k, v = torch.randn(17, 8, 16), torch.randn(17, 2, 16), torch.randn(17, 2, 16)
    fake = _FakeVarlen(params)
    out = _varlen((fake, fake.params), q, k, v, cu, 11, 0.3, groups=4)
    torch.testing.assert_close(out, _per_example(q, k, v, cu, 0.3, gqa=True))
    assert len(fake.calls) == 1


def test_packing_is_on_by_default_and_trains_every_token(tiny_model, tmp_path):
    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="packed", **SHORT))
    metrics = run_stages(config, ["plan", "train"])["train"]["metrics"]
    assert metrics["packing"]["packed"] and "sdpa-per-example attention" in metrics["packing"]["why"]
    assert metrics["train_tokens_this_run"] == metrics["train_tokens"]
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]


def test_packing_refuses_what_packed_attention_cannot_do(tiny_model, monkeypatch):
    import loraship.stages.train as train
    from loraship.errors import LorashipError
    from loraship.training import packed_attention

    config = parse_config(demo_config_dict(tiny_model, tiny_model.parent, packing="auto"))
    model = _tiny(tiny_model)
    model.config.attention_dropout = 0.1
    packed, why = train.use_packing(config, model, "cpu")
    assert not packed and "attention_dropout is 0.1" in why
    with pytest.raises(LorashipError, match="packing: on, but the model's attention_dropout is 0.1"):
        train.use_packing(config.model_copy(update={"packing": "on"}), model, "cpu")
    model.config.attention_dropout = 0.0
    model.config.sliding_window = 16
    assert "sliding window (16 tokens)" in train.use_packing(config, model, "cpu")[1]
    model.config.sliding_window = None
    # A GPU whose torch has no variable-length attention: auto pads, on packs (right, one SDPA call per example).
    monkeypatch.setattr(packed_attention, "varlen_kernel", lambda: None)
    packed, why = train.use_packing(config, model, "cuda")
    assert not packed and "no variable-length attention" in why
    packed, why = train.use_packing(config.model_copy(update={"packing": "on"}), model, "cuda")
    assert packed and "sdpa-per-example" in why and model.config._attn_implementation == packed_attention.ATTENTION


# --- Gemma 2 and Phi-3 ------------------------------------------------------------------------------
def _family_model(name: str, folder):
    """The tiny family config of loraship/fixtures/families.py with a 512-token vocabulary (seeded random weights)."""
    from transformers import AutoModelForCausalLM

    from loraship.fixtures.families import FAMILIES, model_config

    conf = model_config(FAMILIES[name])
    conf.vocab_size, conf.bos_token_id, conf.eos_token_id, conf.pad_token_id = 512, None, None, None
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(conf).save_pretrained(folder)
    return folder


def test_phi3_lora_adapts_its_fused_linears_and_gemma2_trains_with_eager_attention_padded(tiny_model, tmp_path):
    import loraship.stages.train as train
    from loraship.errors import LorashipError
    from loraship.planning.strategy_record import Strategy
    from loraship.training.lora_targets import lora_targets

    # The Config default (the demo's config names all-linear).
    config = parse_config(
        demo_config_dict(
            tiny_model, tmp_path, packing="auto", lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        )
    )
    strategy = Strategy.from_config(config, 2)
    phi3 = train.load_model(_family_model("phi3", tmp_path / "phi3"), config, strategy, "cpu").model
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in phi3.named_parameters() if ".lora_A." in n}
    assert adapted == {"qkv_proj", "o_proj"}  # not o_proj alone, which PEFT would match of q, k, v, o
    every = config.model_copy(update={"lora_target_modules": "all-linear"})
    assert lora_targets(tmp_path / "phi3", every) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    with pytest.raises(LorashipError, match=r"\['c_attn'\] name no Linear of a phi3 decoder layer"):
        lora_targets(tmp_path / "phi3", config.model_copy(update={"lora_target_modules": ["c_attn"]}))

    gemma2 = train.load_model(_family_model("gemma2", tmp_path / "gemma2"), config, strategy, "cpu").model
    assert gemma2.config._attn_implementation == "eager"  # the one that applies attn_logit_softcapping
    packed, why = train.use_packing(config, gemma2, "cpu")
    assert not packed and "soft-capped (attn_logit_softcapping 50.0)" in why
    with pytest.raises(LorashipError, match="packing: on, but its attention logits are soft-capped"):
        train.use_packing(config.model_copy(update={"packing": "on"}), gemma2, "cpu")


def test_plan_refuses_lora_targets_the_architecture_lacks(tmp_path):
    from loraship.planning.preflight import lora_target_problems

    folder = _family_model("phi3", tmp_path / "phi3")
    config = parse_config(demo_config_dict(folder, tmp_path, lora_target_modules=["q_proj", "c_attn"]))
    (problem,) = lora_target_problems(config, folder)
    assert "['c_attn'] name no Linear of a phi3 decoder layer" in problem and "qkv_proj" in problem
    assert lora_target_problems(config.model_copy(update={"lora_target_modules": ["q_proj", "v_proj"]}), folder) == []


# --- selective gradient checkpointing -----------------------------------------------------------------
@pytest.fixture(scope="module")
def four_layers(tiny_model, tmp_path_factory):
    """The tiny model with four decoder layers (seeded), so that 'the first k' has a middle."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(tiny_model)
    conf.num_hidden_layers = 4
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("four-layers")
    AutoModelForCausalLM.from_config(conf).save_pretrained(folder)
    return folder


def _loss_and_lora_grads(model_dir, config, strategy, offload_layers=0, seen=None):
    import loraship.stages.train as train

    torch.manual_seed(0)  # the same LoRA A initialisation for every k
    loaded = train.load_model(model_dir, config, strategy, "cpu")
    model = loaded.model
    if offload_layers:  # what load_model does on a GPU; on the CPU the stream is a no-op copy
        from loraship.training.offload import offload_frozen_layers

        offload_frozen_layers(model, offload_layers)
    with torch.no_grad():  # LoRA B starts at zero; give it values so gradients reach every LoRA matrix
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    # Calls of each layer's MLP, which runs inside the layer's checkpointed forward: twice where it recomputes.
    # A pre-hook: the recompute stops early once it has rebuilt the last saved tensor (torch's non-reentrant
    # checkpoint), inside the MLP, so a hook after the MLP's forward would not see it.
    layers = train.decoder_layers(model)
    runs = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda *_a, i=i: runs.__setitem__(i, runs[i] + 1))
    ids = torch.tensor([[1, 3, 40, 41, 42, 43, 4, 50, 51, 2, 60, 61], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 2]])
    torch.manual_seed(2)  # the same dropout masks: a recompute replays the RNG state of its forward
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    flags = [layer.gradient_checkpointing for layer in layers]
    if seen is not None:
        seen.append(loaded.activation_offload)
    assert runs == [2 if f else 1 for f in flags]  # the flags are what really recomputes
    return loss.item(), grads, flags


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_checkpointing_some_layers_trains_identically_and_as_planned(four_layers, tmp_path, adapter):
    from loraship.planning.estimate import SAFETY_MARGIN_MIN_GIB, estimate
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy import plan_training
    from loraship.planning.strategy_record import Strategy

    base = parse_config(
        demo_config_dict(
            four_layers, tmp_path, adapter=adapter, gradient_checkpointing=False, lora_dropout=0.1, fused_loss="off"
        )
    )
    mc = json.loads((four_layers / "config.json").read_text())
    user = Strategy.from_config(base, 4)
    # A budget that holds 2 checkpointed layers but not 1: the fast mode must plan exactly 2 of 4.
    need = estimate(shape_from_config(mc), base, user.with_checkpointing(2))["predicted_total_gib"]
    config = base.model_copy(update={"gpu_memory_gib": need + SAFETY_MARGIN_MIN_GIB + 0.002})
    plan = plan_training(shape_from_config(mc), config)
    assert plan["strategy"]["checkpointed_layers"] == 2 and plan["strategy"]["gradient_checkpointing"]

    loss, grads, flags = _loss_and_lora_grads(four_layers, config, plan["strategy"])
    assert flags == [True, True, False, False]  # the first k layers, as the plan says
    assert len(grads) == 4 * 7 * 2 and all(g.abs().sum() > 0 for g in grads.values())
    for k, expected_flags in ((0, None), (4, [True] * 4)):
        other_loss, other_grads, other_flags = _loss_and_lora_grads(four_layers, config, user.with_checkpointing(k))
        if expected_flags:
            assert other_flags == expected_flags
        assert other_loss == pytest.approx(loss, rel=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(other_grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{name} at k={k}")


def test_checkpointing_some_layers_with_offloaded_layers_trains_identically(four_layers, tmp_path):
    from loraship.planning.strategy_record import Strategy

    config = parse_config(demo_config_dict(four_layers, tmp_path, gradient_checkpointing=False, fused_loss="off"))
    user = Strategy.from_config(config, 4)
    loss, grads, flags = _loss_and_lora_grads(four_layers, config, user.with_checkpointing(1), offload_layers=2)
    ref_loss, ref_grads, _ = _loss_and_lora_grads(four_layers, config, user.with_checkpointing(4))
    assert flags == [True, False, False, False]
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_streamed_layers_spread_over_the_checkpointed_ones_train_identically(four_layers, tmp_path):
    """The plan's spread layout (Strategy.streamed) through load_model's fused LoRA nodes and recompute marks:
    layers 0 and 2 streamed, all four checkpointed, the same loss and LoRA gradients as nothing streamed."""
    from loraship.planning.strategy_record import Strategy

    config = parse_config(demo_config_dict(four_layers, tmp_path, gradient_checkpointing=False, fused_loss="off"))
    strategy = Strategy.from_json(
        Strategy.from_config(config, 4).replace(offload_layers=2, offload_spread=True)
    ).with_checkpointing(4)
    assert strategy.streamed(4) == [0, 2]
    loss, grads, flags = _loss_and_lora_grads(four_layers, config, strategy, offload_layers=[0, 2])
    ref_loss, ref_grads, _ = _loss_and_lora_grads(four_layers, config, strategy)
    assert flags == [True] * 4
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("adapter,offload_layers", [("lora", 0), ("qlora", 0), ("lora", 2)])
def test_checkpointed_activations_in_cpu_memory_train_identically(
    four_layers, tmp_path, adapter, offload_layers, monkeypatch
):
    # loraship/training/activation_offload.py recomputes each layer in its own backward, under its forward's RNG state:
    # with dropout the same loss and LoRA gradients as torch's checkpointing, alone or with streamed weights.
    from loraship.training import activation_offload
    from loraship.planning.strategy_record import Strategy

    loaded = []
    real_load = activation_offload.ActivationOffload.load
    monkeypatch.setattr(
        activation_offload.ActivationOffload, "load", lambda self, i: loaded.append(i) or real_load(self, i)
    )

    config = parse_config(
        demo_config_dict(
            four_layers, tmp_path, adapter=adapter, lora_dropout=0.1, fused_loss="off", offload_activations="on"
        )
    )
    user = Strategy.from_config(config, 4)
    assert user.offload_activations is True and user.checkpointed_layers == 4
    seen = []
    loss, grads, flags = _loss_and_lora_grads(four_layers, config, user, offload_layers=offload_layers, seen=seen)
    ref_loss, ref_grads, _ = _loss_and_lora_grads(
        four_layers, config, user.replace(offload_activations=False), offload_layers=offload_layers, seen=seen
    )
    assert flags == [True] * 4
    assert loaded == [3, 2, 1, 0]  # each layer's input came back once, last layer first; none in the reference run
    offload, none = seen
    assert none is None
    # The last two layers' inputs never left the GPU; layer 2's backward prefetched layer 1's, layer 1's layer 0's.
    assert (offload.resident, offload.prefetched, offload.synchronous) == (2, 2, 0)
    assert all(s.source is None for s in offload.saved.values()) and not offload.saved
    assert len(grads) == 4 * 7 * 2 and all(g.abs().sum() > 0 for g in grads.values())
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_the_train_stage_records_activations_in_cpu_memory_and_trains_the_same(tiny_model, tmp_path):
    common = dict(max_steps=3, lora_dropout=0.1, micro_batch_size=4, gradient_accumulation_steps=1, warmup_steps=0)
    on = parse_config(demo_config_dict(tiny_model, tmp_path / "on", run_name="on", offload_activations="on", **common))
    off = parse_config(
        demo_config_dict(tiny_model, tmp_path / "off", run_name="off", offload_activations="off", **common)
    )
    metrics = run_stages(on, ["plan", "train"])["train"]["metrics"]
    assert metrics["strategy"]["offload_activations"] is True
    assert metrics["trained_as"].endswith("checkpointed activations in CPU memory")
    # Where each checkpointed input came back from, over 3 steps (+ the evals, which keep nothing): every one counted.
    inputs = metrics["host_copies"]["checkpointed_inputs"]
    layers = metrics["strategy"]["checkpointed_layers"]
    assert sum(inputs.values()) == 3 * layers and inputs["still_on_gpu"] >= 3, inputs
    assert "streamed_weights" not in metrics["host_copies"]  # offload streams weights on CUDA only
    # Every checkpointed Llama layer's recompute left down_proj's GEMM out (loraship/training/recompute.py): the
    # curves below are equal all the same.
    assert metrics["down_proj_skipped_in_recompute"] == layers
    off_metrics = run_stages(off, ["plan", "train"])["train"]["metrics"]
    assert off_metrics["host_copies"] is None
    for x, y in zip(curve(on), curve(off), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-7), (x, y)


def test_a_plan_streaming_layers_it_does_not_recompute_is_refused_before_the_weights_load(tiny_model, tmp_path):
    """Streamed layers (the first n) must be among the checkpointed first k; a hand-edited plan that breaks this
    is refused by name before any weight is read (the check runs ahead of from_pretrained, so no GPU is needed)."""
    from loraship.errors import LorashipError

    train = importlib.import_module("loraship.stages.train")
    config = parse_config(demo_config_dict(tiny_model, tmp_path))
    bad = {
        "adapter": "lora",
        "offload_layers": 2,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "fused_loss": False,
        "gradient_checkpointing": True,
        "checkpointed_layers": 1,
    }
    with pytest.raises(LorashipError, match="streams 2 layers but checkpoints only 1.*re-plan"):
        train.load_model(tiny_model, config, bad, "cuda")
    with pytest.raises(LorashipError, match="checkpoints only 0"):
        train.load_model(
            tiny_model, config, {**bad, "gradient_checkpointing": False, "checkpointed_layers": None}, "cuda"
        )


def test_activation_offload_refuses_inputs_without_grad(four_layers, tmp_path):
    from loraship.training.activation_offload import ActivationOffload

    with pytest.raises(RuntimeError, match="enable_input_require_grads"):
        ActivationOffload().for_layer(0)(lambda x: x * 2, torch.ones(2))


# --- resume ---------------------------------------------------------------------------------------
class Killed(Exception):
    pass


def test_resume_with_lora_dropout_repeats_the_loss_curve(tiny_model, tmp_path, monkeypatch):
    from loraship.training import checkpoints

    common = dict(
        max_steps=8, save_steps=3, lora_dropout=0.2, micro_batch_size=8, gradient_accumulation_steps=1, warmup_steps=1
    )
    clean = parse_config(demo_config_dict(tiny_model, tmp_path / "a", run_name="clean", **common))
    killed = parse_config(demo_config_dict(tiny_model, tmp_path / "b", run_name="killed", **common))
    run_stages(clean, ["plan", "train"])

    real_save = checkpoints.save_checkpoint

    def save_then_die(folder, model, optimizer, scheduler, step, history):
        real_save(folder, model, optimizer, scheduler, step, history)
        if step == 6:  # the second checkpoint: dropout masks of 6 steps drawn before it
            raise Killed

    monkeypatch.setattr(checkpoints, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        run_stages(killed, ["plan", "train"])
    monkeypatch.setattr(checkpoints, "save_checkpoint", real_save)
    resumed = run_stages(killed, ["plan", "train"])["train"]["metrics"]
    assert resumed["resumed_from_step"] == 6
    a, b = curve(killed), curve(clean)
    assert [h["step"] for h in a] == list(range(1, 9))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-7), (x, y)


def test_checkpoint_carries_the_cuda_rng_state_when_cuda_is_present(tiny_model, tmp_path, monkeypatch):
    from loraship.training import checkpoints

    fake_state = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: fake_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny(tiny_model), LoraConfig(r=4, target_modules=["q_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoints.save_checkpoint(tmp_path, model, opt, sched, 3, [])
    step, _ = checkpoints.load_checkpoint(tmp_path, model, opt, sched)
    assert step == 3 and len(restored) == 1
    assert all(torch.equal(a, b) for a, b in zip(restored[0], fake_state))


# --- out of memory --------------------------------------------------------------------------------
class OutOfResources(Exception):  # the name triton.runtime.errors uses; not a RuntimeError
    pass


@pytest.mark.parametrize(
    "error,oom",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (OutOfResources("out of resource: shared memory, Required: 262144, Hardware limit: 232448."), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_out_of_memory_errors_are_recognised_whatever_their_type(error, oom):
    import loraship.stages.train as train

    assert train.is_out_of_memory(error) is oom


def test_oom_attempt_is_released_before_the_retry_and_the_replan_persists(tiny_model, tmp_path, monkeypatch):
    import loraship.stages.train as train
    from loraship.training import out_of_memory

    config = parse_config(
        demo_config_dict(
            tiny_model,
            tmp_path,
            run_name="oom",
            max_steps=4,
            save_steps=2,
            micro_batch_size=8,
            gradient_accumulation_steps=1,
            warmup_steps=0,
        )
    )
    real_load = train.load_model
    loaded, strategies = [], []

    def load_and_fail_first(model_dir, config_, plan, device, *engine):
        # The first attempt's model must be garbage by the time the retry loads its own.
        assert all(ref() is None for ref in loaded), "the failed attempt's model is still alive at the retry"
        result = real_load(model_dir, config_, plan, device, *engine)
        model = result.model
        loaded.append(weakref.ref(model))
        strategies.append(plan.strategy.to_json())
        if len(strategies) == 1:

            def fail(module, args):
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

            model.get_base_model().model.layers[-1].register_forward_pre_hook(fail)
        elif len(strategies) == 2:
            raise Killed  # the process dies after the re-plan: the rerun must not repeat the first strategy
        return result

    monkeypatch.setattr(train, "load_model", load_and_fail_first)
    with pytest.raises(Killed):
        run_stages(config, ["plan", "train"])
    saved = json.loads((stage_dir(config, "train") / "checkpoints" / out_of_memory.REPLANNED_FILE).read_text())
    assert len(saved["attempts"]) == 1
    loaded.clear()
    result = run_stages(config, ["plan", "train"])["train"]["metrics"]
    first, retried, rerun = strategies
    assert retried == rerun == result["strategy"] == saved["plan"]["strategy"] | {"fused_loss": False}
    # A smaller plan: under optimize: speed the first rung checkpoints more layers, then the micro-batch shrinks.
    assert first["micro_batch_size"] == 8 and (
        rerun["checkpointed_layers"] > first["checkpointed_layers"]
        or rerun["micro_batch_size"] < first["micro_batch_size"]
    )
    assert rerun["micro_batch_size"] * rerun["gradient_accumulation_steps"] == 8  # the effective batch is kept
    assert [a["error"].split(":")[0] for a in result["oom_retries"]] == ["RuntimeError"]
    assert result["oom_retries"][0]["under_predicted"]
    assert f"micro-batch {rerun['micro_batch_size']} x {rerun['gradient_accumulation_steps']}" in result["trained_as"]


def test_allocator_gets_expandable_segments_unless_the_user_set_it(monkeypatch):
    import os

    import loraship.stages.train as train

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert train.configure_cuda_allocator().startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert "set by the user" in train.configure_cuda_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"


class _RecordingModel(torch.nn.Module):
    """Stands in for a PEFT model: records each forward's keyword arguments, returns a fixed loss."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, **kwargs):
        from types import SimpleNamespace

        self.calls.append(sorted(kwargs))
        return SimpleNamespace(loss=torch.tensor(2.0))


def test_the_eval_asks_liger_for_its_fused_loss_and_keeps_no_logits():
    import loraship.stages.train as train

    examples = _examples()
    plain, fused = _RecordingModel(), _RecordingModel()
    for model in (plain, fused):  # fused: what LoadedModel.fused_loss says once Liger's kernels are applied
        assert train.evaluate(model, examples, 2, 0, "cpu", fused_loss=model is fused) == pytest.approx(2.0)
    assert all("skip_logits" not in call for call in plain.calls)
    assert len(fused.calls) == 3 and all("skip_logits" in call for call in fused.calls)


def test_qlora_trains_on_the_cpu_after_the_eval_before_training(tiny_qwen, tmp_path):
    # bitsandbytes repacks NF4 layers for inference the first time they run in eval mode on an AVX512-BF16 CPU,
    # after which training a layer with a bias (Qwen2's q, k, v) failed: "a view of a leaf Variable ... in-place".
    config = parse_config(demo_config_dict(tiny_qwen, tmp_path, run_name="qlora-cpu", adapter="qlora", **SHORT))
    metrics = run_stages(config, ["plan", "train"])["train"]["metrics"]
    assert metrics["trained_as"].startswith("QLoRA") and metrics["steps"] > 0
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]


@pytest.mark.parametrize("next_adapter", ["qlora", "lora"])
def test_an_oom_replan_to_another_precision_of_the_base_starts_again_and_keeps_the_old_checkpoints(
    tiny_qwen, tmp_path, monkeypatch, next_adapter
):
    """Out of memory after the bf16 run checkpointed step 2. A re-plan to NF4 (QLoRA) must not resume the adapter
    and AdamW state fitted against the bf16 weights: it trains from step 0, with the old checkpoints moved aside
    and the restart in the manifest. A re-plan that keeps bf16 (a smaller micro-batch) resumes at step 2."""
    from loraship.planning import strategy as planner
    from loraship.training import checkpoints

    # Accumulating: without it the configured plan holds no LoRA gradients at its peak (estimate), and every
    # smaller micro-batch of this tiny model, accumulating and so holding them, comes within the same 0.01 GiB, which
    # replan_after_oom does not take as smaller.
    config = parse_config(
        demo_config_dict(
            tiny_qwen,
            tmp_path,
            run_name="precision",
            max_steps=4,
            save_steps=2,
            micro_batch_size=8,
            gradient_accumulation_steps=2,
            warmup_steps=0,
        )
    )
    real_save, real_replan = checkpoints.save_checkpoint, planner.replan_after_oom
    attempts = []

    def save_then_run_out_of_memory(folder, model, optimizer, scheduler, step, history):
        real_save(folder, model, optimizer, scheduler, step, history)
        if len(attempts) == 0:
            attempts.append(step)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def replan(plan, shape, config_, measured):
        if next_adapter == "lora":
            return real_replan(plan, shape, config_, measured)  # a smaller micro-batch, still bf16
        return {
            **planner.plan_training(shape, config_.model_copy(update={"adapter": "qlora"})),
            "oom_component": "activations",
        }

    monkeypatch.setattr(checkpoints, "save_checkpoint", save_then_run_out_of_memory)
    monkeypatch.setattr(planner, "replan_after_oom", replan)
    metrics = run_stages(config, ["plan", "train"])["train"]["metrics"]
    checkpoints = stage_dir(config, "train") / "checkpoints"
    assert attempts == [2] and len(metrics["oom_retries"]) == 1
    assert metrics["strategy"]["adapter"] == next_adapter
    if next_adapter == "lora":
        assert metrics["resumed_from_step"] == 2
        assert metrics["restarted_from_step_0"] == []
        assert not list(checkpoints.glob("set-aside-*"))
        return
    assert metrics["resumed_from_step"] == 0
    [restart] = metrics["restarted_from_step_0"]
    assert (restart["from_precision"], restart["to_precision"], restart["set_aside_step"]) == ("bf16", "NF4", 2)
    assert "trained against the bf16 weights" in restart["why"]
    aside = stage_dir(config, "train") / restart["set_aside_to"]
    assert aside.parent == checkpoints
    # The bf16 checkpoint is kept whole; the QLoRA run's own checkpoint took its place.
    old_state = torch.load(aside / "last" / "trainer_state.pt", weights_only=True)
    assert old_state["step"] == 2
    new_state = torch.load(checkpoints / "last" / "trainer_state.pt", weights_only=True)
    assert new_state["step"] == 2 and not torch.equal(
        next(iter(old_state["optimizer"]["state"].values()))["exp_avg"],
        next(iter(new_state["optimizer"]["state"].values()))["exp_avg"],
    )
    # A rerun of the same inputs is done: the restart stays recorded in its manifest.
    assert run_stages(config, ["train"])["train"]["metrics"]["restarted_from_step_0"] == [restart]


def test_sliding_window_models_train_under_flex_attention_on_cuda(tmp_path, monkeypatch):
    """A window shorter than sequence_len: flex attention's block mask on CUDA (SDPA would run the window as a dense
    mask over full causal attention); no window, a long enough window, or the CPU: transformers' default."""
    from loraship.training.model_loading import attention_choice

    monkeypatch.delenv("LORASHIP_ATTENTION", raising=False)

    def choice(sequence_len, device="cuda", **config):
        return attention_choice(config, sequence_len, device)

    gemma3 = {"sliding_window": 1024, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    implementation, why = choice(4096, **gemma3)
    assert implementation == "flex_attention" and "(1024 tokens) are shorter than sequence_len 4096" in why
    assert choice(4096, text_config=gemma3)[0] == "flex_attention"  # a multimodal checkpoint's text model
    assert choice(1024, **gemma3)[0] is None  # the window covers every example
    assert choice(4096, device="cpu", **gemma3)[0] is None
    assert choice(4096, sliding_window=4096, layer_types=["full_attention"])[0] is None  # a window no layer uses
    assert choice(4096, attn_logit_softcapping=50.0, **gemma3)[0] == "eager"  # Gemma 2: only eager caps
    monkeypatch.setenv("LORASHIP_ATTENTION", "sdpa")
    assert choice(4096, **gemma3) == ("sdpa", "set by LORASHIP_ATTENTION")
