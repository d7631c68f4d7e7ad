"""Invariants of the memory planner (loraship/planning: estimate, strategy, step_time, shipping), each fed the Shape
of a config.json dict (shape_from_config); CPU only, no torch."""

import json
from pathlib import Path

import pytest

from loraship.config import Config
from loraship.planning import knobs, step_time, strategy
from loraship.planning.estimate import CAL, estimate, fused_loss_transient, lora_saved_per_token, safety_margin_gib
from loraship.planning.knobs import checkpoint_every_layer, fused_loss_available
from loraship.planning.shape import shape_from_config
from loraship.planning.shipping import plan_disk_and_inference
from loraship.planning.step_time import PLAN_EXECUTED_TFLOPS, step_seconds
from loraship.planning.strategy import plan_training, PlanRefused, replan_after_oom
from loraship.planning.strategy_record import Strategy
from loraship.planning.targets import lora_modules, lora_target_note, target_names

REPO = Path(__file__).resolve().parents[1]

# Public config.json values (fields the planner reads).
QWEN2_05B = dict(
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
QWEN2_7B = dict(
    model_type="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
QWEN2_14B = dict(
    model_type="qwen2",
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    vocab_size=152064,
    tie_word_embeddings=False,
)
LLAMA3_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
    attention_bias=False,
    head_dim=128,
)
MISTRAL_7B = dict(
    model_type="mistral",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32768,
    head_dim=128,
    sliding_window=None,
)
# Gemma 2: head_dim apart from hidden / heads (2304 / 8 = 288 there), tied 256k embedding, two caps, window 4096.
GEMMA2_2B = dict(
    model_type="gemma2",
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    vocab_size=256000,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
)
GEMMA2_9B = dict(
    GEMMA2_2B,
    hidden_size=3584,
    intermediate_size=14336,
    num_hidden_layers=42,
    num_attention_heads=16,
    num_key_value_heads=8,
)
# Phi-3: fused qkv_proj and gate_up_proj; mini is multi-head (32 kv heads), medium grouped (10).
PHI3_MINI = dict(
    model_type="phi3",
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32064,
    sliding_window=2047,
    tie_word_embeddings=False,
    original_max_position_embeddings=4096,
    max_position_embeddings=4096,
)
PHI3_MEDIUM = dict(
    PHI3_MINI,
    hidden_size=5120,
    intermediate_size=17920,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=10,
)


def cfg(**kw) -> Config:
    # Every layer checkpointed unless a test says otherwise: the planner's mechanics below were written against it.
    # optimize's own choices are tested with gradient_checkpointing unset (test_optimize_*).
    base = dict(
        base_model="org/model", datasets=[{"path": "d.jsonl", "type": "completion"}], gradient_checkpointing=True
    )
    return Config(**{**base, **kw})


def total(mc, **kw) -> float:
    c = cfg(**kw)
    return estimate(shape_from_config(mc), c, Strategy.from_config(c))["predicted_total_gib"]


@pytest.mark.parametrize(
    "mc,params_b",
    [
        (QWEN2_05B, 0.494),
        (QWEN2_7B, 7.62),
        (QWEN2_14B, 14.77),
        (LLAMA3_8B, 8.03),
        (MISTRAL_7B, 7.25),
        (GEMMA2_2B, 2.61),
        (GEMMA2_9B, 9.24),
        (PHI3_MINI, 3.82),
        (PHI3_MEDIUM, 13.96),
    ],
)
def test_configs_parse_to_known_parameter_counts(mc, params_b):
    s = shape_from_config(mc)
    assert s.n_params / 1e9 == pytest.approx(params_b, rel=0.01)


@pytest.mark.parametrize(
    "name,mc",
    [
        ("qwen2-0.5b", QWEN2_05B),
        ("qwen2-7b", QWEN2_7B),
        ("llama-3-8b", LLAMA3_8B),
        ("mistral-7b", MISTRAL_7B),
        ("gemma-2-2b", GEMMA2_2B),
        ("gemma-2-9b", GEMMA2_9B),
        ("phi-3-mini", PHI3_MINI),
        ("phi-3-medium", PHI3_MEDIUM),
    ],
)
def test_parameter_count_equals_the_transformers_model(name, mc):
    """Every parameter the planner counts (and no other) is in the model transformers builds from the config:
    built on the meta device, so no memory is allocated (torch here, unlike the rest of this file)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**mc)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape_from_config(mc).n_params == sum(p.numel() for p in model.parameters())
    linears = {
        n.rsplit(".", 1)[-1]: (m.in_features, m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers.0." in n
    }
    assert shape_from_config(mc).linears() == linears


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_parameter_count_equals_the_tiny_family_models(family):
    """The tiny test models of tests/test_families.py (head_dim 128 on 256 hidden for Gemma 2) count alike."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from loraship.fixtures.families import FAMILIES, model_config

    config = model_config(FAMILIES[family])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape_from_config(config.to_dict()).n_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "targets,expected",
    [
        (["q_proj", "k_proj", "v_proj", "o_proj"], ("qkv_proj", "o_proj")),  # the config's default
        ("all-linear", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
        (["q_proj", "v_proj", "o_proj"], ("qkv_proj", "o_proj")),
        (["gate_proj", "up_proj", "down_proj"], ("gate_up_proj", "down_proj")),
        (["qkv_proj", "gate_up_proj"], ("qkv_proj", "gate_up_proj")),
    ],
)
def test_phi3_llama_names_stand_for_its_fused_linears(targets, expected):
    s = shape_from_config(PHI3_MINI)
    assert lora_modules(s, targets) == expected
    assert target_names(cfg(lora_target_modules=targets), s) == expected
    # LoRA parameters of the fused Linears: r x (in + out) with out = q + 2kv and 2f.
    est = estimate(
        shape_from_config(PHI3_MINI), cfg(lora_target_modules=targets, lora_r=8), Strategy.from_config(cfg())
    )
    lin = s.linears()
    assert est["lora_params"] == s.L * sum(8 * (lin[n][0] + lin[n][1]) for n in expected)


def test_phi3_a_fused_linear_that_adapts_more_than_named_is_said():
    s = shape_from_config(PHI3_MINI)
    note = lora_target_note(s, ["q_proj", "v_proj", "o_proj"])
    assert "q_proj, v_proj -> qkv_proj" in note and "k_proj" in note
    assert lora_target_note(s, ["q_proj", "k_proj", "v_proj", "o_proj"]) is None
    assert lora_target_note(shape_from_config(LLAMA3_8B), ["q_proj", "v_proj"]) is None


@pytest.mark.parametrize(
    "mc,targets,bad",
    [
        (PHI3_MINI, ["q_proj", "c_attn"], "c_attn"),
        (LLAMA3_8B, ["qkv_proj"], "qkv_proj"),
        (GEMMA2_2B, ["gate_up_proj", "o_proj"], "gate_up_proj"),
    ],
)
def test_a_target_module_the_architecture_lacks_is_refused_naming_its_linears(mc, targets, bad):
    s = shape_from_config(mc)
    with pytest.raises(
        ValueError, match=rf"\['{bad}'\] name no Linear of a {s.model_type} decoder layer.*o_proj.*all-linear"
    ):
        lora_modules(s, targets)


def test_gemma2_eager_attention_keeps_every_heads_scores():
    # SDPA takes no softcap: transformers runs Gemma 2 with eager attention, whose kept scores grow with the
    # square of the sequence (per token: 8 bytes x heads x sequence_len per layer).
    c1, c2 = (
        cfg(sequence_len=2048, micro_batch_size=1, fused_loss="on"),
        cfg(sequence_len=4096, micro_batch_size=1, fused_loss="on"),
    )
    st = Strategy.from_config(c1).with_checkpointing(0)
    s = shape_from_config(GEMMA2_9B)
    saved = [
        estimate(shape_from_config(GEMMA2_9B), c, st)["components_gib"]["saved_activations_all_layers"] * 2**30
        for c in (c1, c2)
    ]
    linear_part = [x - s.L * 4096 * 8 * s.heads * n * n / 4096 for x, n in zip(saved, (2048, 4096))]
    assert linear_part[1] == pytest.approx(2 * linear_part[0], rel=1e-3)  # what is left is linear in T
    no_cap = {**GEMMA2_9B, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    assert (
        estimate(shape_from_config(no_cap), c2, st)["components_gib"]["saved_activations_all_layers"]
        < saved[1] / 2**30 / 4
    )


def test_gemma2_final_softcap_adds_to_the_hf_loss_only():
    hf, fused = cfg(fused_loss="off", sequence_len=1024), cfg(fused_loss="on", sequence_len=1024)
    no_cap = {**GEMMA2_2B, "final_logit_softcapping": None}
    T = hf.micro_batch_size * 1024
    loss = lambda mc, c: estimate(shape_from_config(mc), c, Strategy.from_config(c))["components_gib"][
        "logits_and_cross_entropy"
    ]
    assert (loss(GEMMA2_2B, hf) - loss(no_cap, hf)) * 2**30 == pytest.approx(4 * T * 256000, rel=1e-3)
    assert loss(GEMMA2_2B, fused) == loss(no_cap, fused)


def test_gemma2_sliding_layers_and_phi3_fused_shapes_are_read():
    g = shape_from_config(GEMMA2_2B)
    assert (g.q, g.kv, g.tied, g.norms, g.sliding_window, g.sliding_layers) == (8 * 256, 4 * 256, True, 4, 4096, 13)
    assert shape_from_config({**GEMMA2_2B, "layer_types": ["full_attention"] * 26}).sliding_layers == 0
    p = shape_from_config(PHI3_MEDIUM)
    assert p.linears()["qkv_proj"] == (5120, 5120 + 2 * 10 * 128) and p.linears()["gate_up_proj"] == (5120, 2 * 17920)
    assert not p.tied and p.sliding_layers == 0


def test_head_dim_and_gqa_are_read():
    s = shape_from_config({**MISTRAL_7B, "head_dim": 64})
    assert (s.q, s.kv) == (32 * 64, 8 * 64)
    assert shape_from_config(QWEN2_7B).kv == 4 * 128  # head_dim defaults to hidden / heads


@pytest.mark.parametrize(
    "mc,msg",
    [
        ({**QWEN2_7B, "model_type": "gpt2"}, "GPT2Block of GPT2LMHeadModel has no nn.Linear"),
        ({**QWEN2_7B, "model_type": "nosuch"}, "'nosuch' is not known to the installed transformers"),
        ({"model_type": "llama", "hidden_size": 4096}, "lacks"),
    ],
)
def test_bad_model_config_says_why(mc, msg):
    with pytest.raises(ValueError, match=msg):
        shape_from_config(mc)


@pytest.mark.parametrize(
    "field,values",
    [("lora_r", [8, 16, 64, 128]), ("sequence_len", [512, 1024, 4096, 8192]), ("micro_batch_size", [1, 2, 4])],
)
@pytest.mark.parametrize("fused", ["on", "off"])
@pytest.mark.parametrize("ckpt", [True, False])
def test_monotonic(field, values, fused, ckpt):
    totals = [
        total(QWEN2_7B, **{field: v}, fused_loss=fused, gradient_checkpointing=ckpt, lora_target_modules="all-linear")
        for v in values
    ]
    assert totals == sorted(totals) and len(set(totals)) == len(totals)


def test_qlora_weights_smaller_than_lora_and_nf4_keeps_embeddings_bf16():
    c = cfg()
    lora = estimate(shape_from_config(QWEN2_7B), c, Strategy.from_config(c).replace(adapter="lora"))
    qlora = estimate(shape_from_config(QWEN2_7B), c, Strategy.from_config(c).replace(adapter="qlora"))
    assert qlora["components_gib"]["frozen_weights"] < 0.4 * lora["components_gib"]["frozen_weights"]
    # Qwen2-7B NF4 double quant measured on a GPU: 5.30 GiB after load (2 x 1.02 GiB of it bf16 embeddings).
    assert qlora["components_gib"]["frozen_weights"] == pytest.approx(5.30, rel=0.05)


def test_fused_loss_smaller_than_hf_loss():
    assert total(QWEN2_7B, sequence_len=4096, fused_loss="on") < total(QWEN2_7B, sequence_len=4096, fused_loss="off")


QWEN2_14B_EXAMPLE = json.loads((REPO / "examples" / "models" / "qwen2-14b" / "config.json").read_text())
LLAMA_70B = dict(
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
# configs/qwen2-14b-lora.yaml: bf16 LoRA r64 on q,v,o at 2 x 4096 on the default 32 GiB budget.
LORA_14B = dict(
    adapter="lora",
    lora_r=64,
    lora_alpha=128,
    lora_target_modules=["q_proj", "v_proj", "o_proj"],
    sequence_len=4096,
    micro_batch_size=2,
    gradient_accumulation_steps=8,
)


@pytest.mark.parametrize("fused", ["on", "off"])
def test_14b_bf16_lora_on_32gib_offloads_by_default_and_keeps_bf16(fused):
    plan = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), cfg(**LORA_14B, fused_loss=fused))
    st = plan["strategy"]
    assert plan["fits"] and st["adapter"] == "lora" and 0 < st["offload_layers"] < 48
    assert st["micro_batch_size"] * st["gradient_accumulation_steps"] == 16
    assert plan["memory"]["predicted_total_gib"] <= 32 - plan["safety_margin_gib"]
    # The least offload that fits at that micro-batch: one layer fewer does not fit.
    fewer = {**st, "offload_layers": st["offload_layers"] - 1}
    assert not estimate(shape_from_config(QWEN2_14B_EXAMPLE), cfg(**LORA_14B, fused_loss=fused), fewer)["fits"]
    # The plan says why: bf16 LoRA did not fit, not even at micro-batch 1; offload keeps bf16.
    assert "needs" in plan["reason"] and "micro-batch 1 x 16" in plan["reason"] and "keeps bf16" in plan["reason"]
    assert plan["fallback"] == ["offload", "qlora"]


def test_14b_bf16_lora_under_optimize_speed_streams_more_layers_to_checkpoint_fewer():
    """optimize: speed (gradient_checkpointing unset): the least offload that fits checkpoints every layer; streaming
    more layers frees room for later layers' activations, whose recompute is saved, while the copies still hide
    behind the matmuls at the planning rates."""
    c = cfg(**{**LORA_14B, "gradient_checkpointing": None, "gradient_accumulation_steps": 1}, fused_loss="on")
    plan = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)
    st, L = plan["strategy"], 48
    n, k = st["offload_layers"], st["checkpointed_layers"]
    assert plan["fits"] and st["adapter"] == "lora" and 0 < n <= k < L
    least = next(
        s
        for s, _ in strategy.ladder(shape_from_config(QWEN2_14B_EXAMPLE), c)
        if s.offload_layers and estimate(shape_from_config(QWEN2_14B_EXAMPLE), c, s)["fits"]
    )
    assert least.checkpointed_layers == L and least.offload_layers < n
    chosen, rung = (step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, x) for x in (st, least.to_json()))
    assert chosen["step_s"] < 0.99 * rung["step_s"] and chosen["compute_s"] < rung["compute_s"]
    # The fewest checkpointed layers at that offload: one fewer does not fit.
    fewer = Strategy.from_json(st).with_checkpointing(k - 1)
    assert not estimate(shape_from_config(QWEN2_14B_EXAMPLE), c, fewer)["fits"]
    assert f"streaming {n} layers instead of {least.offload_layers}" in plan["reason"]
    assert f"room for {L - k} layers' activations" in plan["reason"]


def test_streaming_stops_where_the_copies_would_take_longer_than_the_matmuls(monkeypatch):
    c = cfg(**{**LORA_14B, "gradient_checkpointing": None, "gradient_accumulation_steps": 1}, fused_loss="on")
    fast = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)["strategy"]["offload_layers"]
    monkeypatch.setattr(
        step_time, "PLAN_HOST_TO_DEVICE_GBPS", 2.5
    )  # a tenth of the bandwidth: streaming more never pays
    slow = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)["strategy"]
    least = next(
        s
        for s, _ in strategy.ladder(shape_from_config(QWEN2_14B_EXAMPLE), c)
        if s.offload_layers and estimate(shape_from_config(QWEN2_14B_EXAMPLE), c, s)["fits"]
    )
    assert slow["offload_layers"] == least.offload_layers < fast


def test_step_model_hides_copies_behind_compute_until_they_are_longer(monkeypatch):
    c = cfg(**{**LORA_14B, "gradient_accumulation_steps": 1}, fused_loss="on")
    st = Strategy.from_config(c, 48).replace(offload_layers=10).with_checkpointing(48)
    monkeypatch.setattr(step_time, "PLAN_HOST_TO_DEVICE_GBPS", 1e6)  # copies take no time: the matmuls alone
    fast = step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, st)
    assert fast["step_s"] == pytest.approx(fast["compute_s"])
    # The same plan with every layer checkpointed costs one more forward per layer than with none.
    from loraship.planning import flops

    none = step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, st.replace(offload_layers=0).with_checkpointing(0))
    forward = (
        2 * 4096 * flops.recompute_flops_per_layer_token(QWEN2_14B_EXAMPLE, c, 4096) / (PLAN_EXECUTED_TFLOPS * 1e12)
    )
    assert fast["compute_s"] - none["compute_s"] == pytest.approx(48 * forward)
    monkeypatch.setattr(step_time, "PLAN_HOST_TO_DEVICE_GBPS", 0.5)  # copies far slower: 10 layers, each copied twice
    slow = step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, st)
    layer_bytes = shape_from_config(QWEN2_14B_EXAMPLE).layer_linear_params * 2
    assert slow["step_s"] > 2 * 10 * layer_bytes / 0.5e9 > fast["step_s"]


def test_optimize_memory_and_explicit_checkpointing_keep_every_layer_checkpointed_under_offload():
    for extra in ({"optimize": "memory", "gradient_checkpointing": None}, {"gradient_checkpointing": True}):
        c = cfg(**{**LORA_14B, **extra, "gradient_accumulation_steps": 1}, fused_loss="on")
        st = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)["strategy"]
        assert st["adapter"] == "lora" and st["offload_layers"] and st["checkpointed_layers"] == 48, extra


def test_14b_fallback_qlora_switches_to_qlora_without_offload():
    plan = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), cfg(**LORA_14B, fused_loss="on", fallback=["qlora"]))
    assert plan["fits"] and plan["strategy"]["adapter"] == "qlora" and plan["strategy"]["offload_layers"] == 0
    assert "rules out offload" in plan["reason"] and "precision change" in plan["reason"]


def test_14b_empty_fallback_refuses_naming_shortfall_and_fix():
    with pytest.raises(PlanRefused) as e:
        plan_training(shape_from_config(QWEN2_14B_EXAMPLE), cfg(**LORA_14B, fused_loss="on", fallback=[]))
    msg = str(e.value)
    assert "nothing fits gpu_memory_gib 32 GiB" in msg and "rules out offload and qlora" in msg
    assert "GiB too much" in msg and "fallback: [offload]" in msg and "fallback: [qlora]" in msg


@pytest.mark.parametrize("fused", ["on", "off"])
def test_70b_on_8gib_is_refused_at_plan_time(fused):
    with pytest.raises(PlanRefused, match=r"nothing fits gpu_memory_gib 8 GiB.*Fix: .*at least \d+ GiB"):
        plan_training(shape_from_config(LLAMA_70B), cfg(gpu_memory_gib=8, fused_loss=fused))
    # device: cpu trains without the GPU budget: the plan is returned, marked as not fitting.
    plan = plan_training(shape_from_config(LLAMA_70B), cfg(gpu_memory_gib=8, fused_loss=fused, device="cpu"))
    assert not plan["fits"] and plan["reason"].startswith("device: cpu")


@pytest.mark.parametrize("mc", [QWEN2_7B, QWEN2_14B, LLAMA3_8B, LLAMA_70B])
@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_qlora_is_never_combined_with_offload(mc, adapter):
    c = cfg(adapter=adapter, sequence_len=8192, micro_batch_size=4, gpu_memory_gib=16)
    for strat, _why in strategy.ladder(shape_from_config(mc), c):
        assert not (strat.adapter == "qlora" and strat.offload_layers), strat


def test_fallback_order_is_the_configured_order():
    def kinds(fallback):
        c = cfg(**LORA_14B, fallback=fallback)
        seen = [
            ("offload" if s.offload_layers else s.adapter) for s, _ in strategy.ladder(shape_from_config(QWEN2_14B), c)
        ]
        return list(dict.fromkeys(k for k in seen if k != "lora"))

    assert kinds(["offload", "qlora"]) == ["offload", "qlora"]
    assert kinds(["qlora", "offload"]) == ["qlora", "offload"]
    assert kinds([]) == []


@pytest.mark.parametrize(
    "setting,device,importable,expected",
    [
        ("auto", "cuda", True, True),
        ("auto", "cuda", False, False),
        ("auto", "cpu", True, False),
        ("on", "cuda", False, True),
        ("on", "cpu", True, False),
        ("off", "cuda", True, False),
    ],
)
def test_fused_loss_auto_means_liger_importable_on_cuda(monkeypatch, setting, device, importable, expected):
    monkeypatch.setattr(
        knobs.importlib.util, "find_spec", lambda name: object() if importable and name == "liger_kernel" else None
    )
    c = cfg(fused_loss=setting)
    assert fused_loss_available(c, device) is expected
    if device == "cuda":  # the plan asks the same question for the GPU it plans
        assert Strategy.from_config(c).fused_loss is expected


def test_small_model_fits_as_asked():
    c = cfg(sequence_len=2048, micro_batch_size=2, gradient_accumulation_steps=4)
    plan = plan_training(shape_from_config(QWEN2_05B), c)
    assert plan["fits"] and plan["strategy"] == Strategy.from_config(c, n_layers=24).to_json()
    assert plan["reason"].startswith("as configured fits")


def test_effective_batch_preserved_when_micro_batch_shrinks():
    c = cfg(sequence_len=4096, micro_batch_size=8, gradient_accumulation_steps=3, fused_loss="off")
    plan = plan_training(shape_from_config(QWEN2_7B), c)
    st = plan["strategy"]
    assert st["micro_batch_size"] < 8
    assert st["micro_batch_size"] * st["gradient_accumulation_steps"] == 24


def test_plan_shape_and_components():
    plan = plan_training(shape_from_config(LLAMA3_8B), cfg(adapter="qlora"))
    assert set(plan) >= {"strategy", "fits", "budget_gib", "safety_margin_gib", "reason", "memory", "alternatives"}
    comps = plan["memory"]["components_gib"]
    for k in (
        "frozen_weights",
        "lora_weights",
        "lora_gradients",
        "optimizer_state",
        "checkpointed_activations",
        "one_layer_recompute_and_backward",
        "logits_and_cross_entropy",
        "cuda_context",
        "allocator_reserve",
    ):
        assert k in comps
    # The train stage keeps bf16 casts of the fp32 LoRA weights through each step (loraship/training/fused_lora.py).
    assert 0 < comps["lora_compute_copies"] == pytest.approx(comps["lora_weights"] / 2, abs=1e-3)
    m = plan["memory"]
    assert m["predicted_total_gib"] == pytest.approx(m["predicted_reserved_gib"] + m["cuda_context_gib"], abs=0.02)
    assert m["weights_only_estimate_gib"] < m["predicted_total_gib"]
    for alt in plan["alternatives"]:
        assert {"adapter", "offload_layers", "micro_batch_size", "predicted_total_gib", "fits"} <= set(alt)


@pytest.mark.parametrize(
    "mc,kw",
    [
        (QWEN2_7B, dict(sequence_len=4096, micro_batch_size=4, gradient_accumulation_steps=2)),
        (QWEN2_14B, dict(sequence_len=8192)),
        (QWEN2_05B, dict()),
    ],
)
@pytest.mark.parametrize("ckpt", [True, False])
def test_replan_gets_strictly_smaller_or_none(mc, kw, ckpt):
    c = cfg(**kw, gradient_checkpointing=ckpt)
    plan = plan_training(shape_from_config(mc), c)
    seen = 0
    while plan is not None and seen < 400:
        measured = {
            "peak_reserved_gib": plan["memory"]["predicted_reserved_gib"] * 1.1,
            "peak_allocated_gib": plan["memory"]["predicted_allocated_gib"],
        }
        nxt = replan_after_oom(plan, shape_from_config(mc), c, measured)
        if nxt is None:
            break
        assert nxt["memory"]["predicted_total_gib"] < plan["memory"]["predicted_total_gib"]
        assert isinstance(nxt["oom_component"], str) and nxt["oom_component"]
        st = nxt["strategy"]
        assert (
            st["micro_batch_size"] * st["gradient_accumulation_steps"]
            == c.micro_batch_size * c.gradient_accumulation_steps
        )
        plan, seen = nxt, seen + 1
    assert plan is None or seen < 400


def test_disk_and_inference():
    d = plan_disk_and_inference(shape_from_config(LLAMA3_8B), cfg(target_context=4096, target_gpu_memory_gib=8))
    disk, inf = d["disk_gib"], d["inference"]
    assert disk["quantize"] < disk["convert"] and disk["total"] == pytest.approx(
        disk["merge"] + disk["convert"] + disk["quantize"], abs=0.02
    )
    assert inf["kv_cache_gib"] == pytest.approx(2 * 32 * 4096 * 1024 * 2 / 2**30, abs=0.01)  # 0.5 GiB with GQA
    assert inf["total_gib"] > inf["gguf_gib"] + inf["kv_cache_gib"]
    assert inf["fits_target"] is True
    longer = plan_disk_and_inference(shape_from_config(LLAMA3_8B), cfg(target_context=32768, target_gpu_memory_gib=8))
    assert longer["inference"]["kv_cache_gib"] > inf["kv_cache_gib"] and not longer["inference"]["fits_target"]


def test_render_plan():
    from rich.console import Console

    from loraship.cli import render_plan

    c = cfg(sequence_len=4096)
    con = Console(record=True, width=140)
    con.print(
        render_plan(
            plan_training(shape_from_config(QWEN2_14B), c), plan_disk_and_inference(shape_from_config(QWEN2_14B), c)
        )
    )
    text = con.export_text()
    assert "frozen weights" in text and "safety margin" in text and "kv_cache" in text


def test_constants_still_match_the_gpu_measurements():
    """Re-predict every measured row of bench/results/memory_matrix.json with the current constants."""
    import json
    import statistics
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "memory_matrix.json"
    if not path.exists():
        pytest.skip("bench/results/memory_matrix.json not present")
    shapes = {
        "qwen2-7b": QWEN2_7B,
        "qwen2-14b": QWEN2_14B,
        "llama-3-8b": LLAMA3_8B,
        "qwen2-0.5b": QWEN2_05B,
        "mistral-7b": {**MISTRAL_7B, "vocab_size": 32768},
    }
    errs = []
    for row in json.loads(path.read_text())["rows"]:
        sp = row["spec"]
        c = cfg(
            adapter=sp["adapter"],
            lora_r=sp["lora_r"],
            lora_alpha=2 * sp["lora_r"],
            gradient_accumulation_steps=1,
            lora_target_modules=["q_proj", "v_proj", "o_proj"] if sp["targets"] == "qvo" else "all-linear",
            sequence_len=sp["sequence_len"],
            micro_batch_size=sp["micro_batch_size"],
            gradient_checkpointing=sp["gradient_checkpointing"],
            fused_loss="on" if sp["fused_loss"] else "off",
        )
        est = estimate(shape_from_config(shapes[sp["shape"]]), c, Strategy.from_config(c), program="harness")
        errs.append(abs(est["predicted_reserved_gib"] / row["measured_reserved_gib"] - 1))
        assert not (est["fits"] and row["oom_under_32gib_cap"]), row["config"]
    assert len(errs) >= 16
    assert statistics.median(errs) <= 0.05 and max(errs) <= 0.10


# --- selective gradient checkpointing ----------------------------------------------------------------
# gradient_checkpointing: false (fast) checkpoints as few of the first layers as the budget needs.
FAST_7B = dict(
    sequence_len=8192,
    micro_batch_size=2,
    gradient_accumulation_steps=4,
    fused_loss="on",
    lora_target_modules="all-linear",
    gradient_checkpointing=False,
)


def test_fast_mode_checkpoints_the_fewest_layers_that_fit_and_more_as_the_budget_shrinks():
    L = shape_from_config(QWEN2_7B).L
    ks = []
    for budget in (200, 120, 80, 64, 48, 40, 36, 32):
        c = cfg(**FAST_7B, gpu_memory_gib=budget)
        plan = plan_training(shape_from_config(QWEN2_7B), c)
        st = plan["strategy"]
        k = st["checkpointed_layers"]
        assert plan["fits"] and (st["micro_batch_size"], st["adapter"], st["offload_layers"]) == (2, "lora", 0)
        assert st["gradient_checkpointing"] is (k > 0)  # the old key still means "any layer checkpointed"
        if k:  # one layer fewer does not fit: k is the smallest
            fewer = Strategy.from_json(st).with_checkpointing(k - 1)
            assert not estimate(shape_from_config(QWEN2_7B), c, fewer)["fits"]
            assert f"checkpointing {k} of {L} layers to fit {budget} GiB" in plan["reason"]
        ks.append(k)
    assert ks == sorted(ks) and ks[0] == 0 and any(0 < k < L for k in ks) and len(set(ks)) > 3


def test_checkpointing_more_layers_predicts_less_memory_and_the_ends_are_the_fitted_modes():
    c = cfg(**FAST_7B)
    L = shape_from_config(QWEN2_7B).L
    user = Strategy.from_config(c, L)
    totals = [
        estimate(shape_from_config(QWEN2_7B), c, user.with_checkpointing(k))["predicted_total_gib"]
        for k in range(L + 1)
    ]
    assert all(a > b for a, b in zip(totals[:-1], totals[1:-1]))
    # ...up to the last layer: its recompute would run right after the loss, beside all it would free, so
    # checkpointing it too saves nothing and keeps one more input.
    assert totals[L] > totals[L - 1]
    # k = 0 and k = L are the all-or-nothing modes the constants were fitted on, unchanged.
    for k, on in ((0, False), (L, True)):
        legacy = {key: v for key, v in user.to_json().items() if key != "checkpointed_layers"} | {
            "gradient_checkpointing": on
        }
        assert estimate(shape_from_config(QWEN2_7B), c, legacy) == estimate(
            shape_from_config(QWEN2_7B), c, user.with_checkpointing(k)
        )


def test_lean_mode_checkpoints_every_layer_on_every_rung():
    c = cfg(**{**FAST_7B, "gradient_checkpointing": True}, gpu_memory_gib=80)
    L = shape_from_config(QWEN2_7B).L
    plan = plan_training(shape_from_config(QWEN2_7B), c)
    assert plan["strategy"]["checkpointed_layers"] == L and plan["reason"].startswith("as configured fits")
    assert all(
        st.checkpointed_layers == 48 and st.gradient_checkpointing
        for st, _ in strategy.ladder(shape_from_config(QWEN2_14B), c)
    )
    # The alternatives show what the fast mode would checkpoint instead.
    assert any(0 < a["checkpointed_layers"] < L and a["fits"] for a in plan["alternatives"])


def test_fast_mode_falls_back_only_when_every_layer_checkpointed_does_not_fit():
    c = cfg(**LORA_14B, fused_loss="on", gradient_checkpointing=False)
    plan = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)
    st = plan["strategy"]
    # As in the lean test above: bf16 LoRA does not fit, so offload, which keeps every layer checkpointed.
    assert 0 < st["offload_layers"] and st["checkpointed_layers"] == 48
    assert "checkpointing more layers" in plan["reason"] and "gradient checkpointing 48 of 48 layers" in plan["reason"]
    for strat, _ in strategy.ladder(shape_from_config(QWEN2_14B_EXAMPLE), c):
        if strat.offload_layers:
            assert strat.checkpointed_layers == 48


def test_render_plan_names_the_checkpointed_layers():
    from rich.console import Console

    from loraship.cli import render_plan

    c = cfg(**FAST_7B, gpu_memory_gib=32)
    plan = plan_training(shape_from_config(QWEN2_7B), c)
    con = Console(record=True, width=200)
    con.print(render_plan(plan, plan_disk_and_inference(shape_from_config(QWEN2_7B), c)))
    assert f"checkpointing {plan['strategy']['checkpointed_layers']} of 28 layers" in con.export_text()


def test_the_train_stage_keeps_less_per_layer_than_the_harness_with_liger_kernels(monkeypatch):
    # The hand model's terms (a cross-check of loraship/planning/trace.py, tests/test_trace.py): the plan traces them.
    monkeypatch.setenv("LORASHIP_PLAN_TRACE", "0")
    # With the fused loss tasks/train.py applies every Liger kernel: RMSNorm keeps bf16 input, SwiGLU no silu output.
    # Its LoRA runs in fused nodes under bf16 autocast: a bf16 input kept once for the modules sharing it (none
    # for o_proj's, which attention keeps), and a 1-byte dropout mask per module, against the harness's fp32
    # dropout output + mask per module.
    c = cfg(**FAST_7B, lora_dropout=0.05)
    st = Strategy.from_config(c).with_checkpointing(0)
    stage, harness = (estimate(shape_from_config(QWEN2_7B), c, st, program=p) for p in ("train-stage", "harness"))
    s = shape_from_config(QWEN2_7B)
    T = c.micro_batch_size * c.sequence_len
    lin = s.linears()
    assert set(lin) == set(target_names(c, s))  # all-linear
    # attention input and MLP input; down_proj's is rebuilt from the SwiGLU's gate and up (SwiGLUDownLora)
    shared_inputs = 2 * (s.h + s.h)
    lora_saved = (
        sum(CAL["lora_input_dropout"] * i + 4 * c.lora_r for i, _ in lin.values())
        - shared_inputs
        - sum(i + 2 * c.lora_r for i, _ in lin.values())
    )
    saved = (
        stage["components_gib"]["saved_activations_all_layers"],
        harness["components_gib"]["saved_activations_all_layers"],
    )
    assert abs((saved[1] - saved[0]) * 2**30 - s.L * T * (4 * s.h + 2 * s.f + lora_saved) * CAL["layer"]) < 2**20
    assert stage["components_gib"]["allocator_reserve"] == CAL["reserve_expandable_gib"]
    hf = cfg(**{**FAST_7B, "fused_loss": "off", "lora_dropout": 0.05})  # no Liger: the LoRA difference only
    st_hf = Strategy.from_config(hf).with_checkpointing(0)
    saved_hf = (
        estimate(shape_from_config(QWEN2_7B), hf, st_hf, program=p)["components_gib"]["saved_activations_all_layers"]
        for p in ("train-stage", "harness")
    )
    # without Liger's SwiGLU the stage keeps down_proj's input for its LoRA too
    assert abs((-next(saved_hf) + next(saved_hf)) * 2**30 - s.L * T * (lora_saved - 2 * s.f) * CAL["layer"]) < 2**20


def test_the_train_stage_reserves_part_of_the_hf_loss_transient(monkeypatch):
    # HF cross-entropy's fp32 blocks stay mapped between steps under expandable segments; Liger's fused loss has none.
    monkeypatch.setitem(CAL, "reserve_hf_loss_expandable", 0.25)
    hf, fused = (cfg(**{**FAST_7B, "fused_loss": f}) for f in ("off", "on"))
    est_hf, est_fused = (
        estimate(shape_from_config(QWEN2_7B), c, Strategy.from_config(c), program="train-stage") for c in (hf, fused)
    )
    loss = est_hf["components_gib"]["logits_and_cross_entropy"]
    assert est_hf["components_gib"]["allocator_reserve"] == pytest.approx(
        CAL["reserve_expandable_gib"] + 0.25 * loss, abs=0.01
    )
    assert est_fused["components_gib"]["allocator_reserve"] == pytest.approx(CAL["reserve_expandable_gib"], abs=0.01)
    # ...but the allocator hands that cache back under pressure: it is not part of what the card must hold.
    assert (
        est_hf["reclaimable_cache_gib"] == pytest.approx(0.25 * loss, abs=0.01)
        and est_fused["reclaimable_cache_gib"] == 0
    )
    monkeypatch.setitem(CAL, "reserve_hf_loss_expandable", 0.0)
    again = estimate(shape_from_config(QWEN2_7B), hf, Strategy.from_config(hf), program="train-stage")
    assert est_hf["predicted_reserved_gib"] - again["predicted_reserved_gib"] == pytest.approx(0.25 * loss, abs=0.02)
    assert est_hf["predicted_total_gib"] == pytest.approx(again["predicted_total_gib"], abs=1e-6)
    assert est_hf["fits"] == again["fits"]


@pytest.mark.parametrize(
    "targets,expected",
    [
        (["q_proj", "v_proj", "o_proj"], lambda s, r: 2 * s.h + 3 * 2 * r),  # q, v share one input; o's is kept anyway
        ("all-linear", lambda s, r: 2 * s.h + 2 * s.h + 2 * s.f + 7 * 2 * r),  # attention in, MLP in, SwiGLU out
    ],
)
def test_lora_modules_reading_one_tensor_keep_it_once_under_autocast(targets, expected):
    c = cfg(lora_target_modules=targets, lora_dropout=0.0, lora_r=64)
    s = shape_from_config(QWEN2_7B)
    names = target_names(c)
    assert lora_saved_per_token(s, c, names, "train-stage") == expected(s, 64)
    # Under Liger's SwiGLU, down_proj's input is rebuilt from gate and up in backward (fused_lora.SwiGLUDownLora).
    down = 2 * s.f if "down_proj" in names else 0
    assert lora_saved_per_token(s, c, names, "train-stage", liger=True) == expected(s, 64) - down
    # The harness: an fp32 copy of the input per module, fp32 lora_A output.
    assert lora_saved_per_token(s, c, names, "harness") == sum(4 * s.linears()[n][0] + 4 * 64 for n in names)


def test_streamed_layer_copies_count_at_a_layer_peak_not_at_the_fused_loss():
    c = cfg(**LORA_14B, fused_loss="on")
    st = Strategy.from_config(c).replace(offload_layers=16)
    est = estimate(shape_from_config(QWEN2_14B_EXAMPLE), c, st)
    s = shape_from_config(QWEN2_14B_EXAMPLE)
    assert est["components_gib"]["streamed_layer_copies"] == round(2 * s.layer_linear_params * 2 / 2**30, 3)
    resident = estimate(shape_from_config(QWEN2_14B_EXAMPLE), c, st.replace(offload_layers=0))
    drop = resident["components_gib"]["frozen_weights"] - est["components_gib"]["frozen_weights"]
    assert abs(drop - 16 * s.layer_linear_params * 2 / 2**30) < 1e-2


# --- checkpointed activations in CPU memory ---------------------------------------------------------------------
LEAN_7B = dict(
    adapter="lora",
    lora_r=64,
    lora_alpha=128,
    lora_target_modules=["q_proj", "v_proj", "o_proj"],
    sequence_len=4096,
    micro_batch_size=2,
    gradient_accumulation_steps=4,
    fused_loss="on",
)


def test_offloaded_activations_leave_two_layers_inputs_on_the_gpu():
    s = shape_from_config(QWEN2_7B)
    T = 2 * 4096
    on, off = (
        estimate(
            shape_from_config(QWEN2_7B),
            cfg(**LEAN_7B, offload_activations=v),
            Strategy.from_config(cfg(**LEAN_7B, offload_activations=v), s.L),
        )
        for v in ("on", "off")
    )
    assert on["components_gib"]["checkpointed_activations"] == round(CAL["keep"] * T * 2 * s.h * 2 / 2**30, 3)
    assert on["activations_in_cpu_memory_gib"] == round(T * 2 * s.h * s.L / 2**30, 3)
    assert off["activations_in_cpu_memory_gib"] == 0
    saved = off["predicted_reserved_gib"] - on["predicted_reserved_gib"]
    assert saved == pytest.approx(CAL["keep"] * T * 2 * s.h * (s.L - 2) / 2**30, rel=1e-6)


def test_auto_offloads_activations_before_shrinking_the_batch_and_off_never_does():
    assert cfg(**LEAN_7B).offload_activations == "auto"  # the default since its CUDA path ran on the H200
    c = cfg(**LEAN_7B, offload_activations="auto")
    s = shape_from_config(QWEN2_7B)
    user = Strategy.from_config(c, s.L)
    assert user.offload_activations is False  # auto: only when it is what makes the plan fit
    with_acts = estimate(shape_from_config(QWEN2_7B), c, user.replace(offload_activations=True))["predicted_total_gib"]
    budget = strategy._card_needed_gib(with_acts) + 0.01  # fits with activations in CPU memory, not without
    assert not estimate(shape_from_config(QWEN2_7B), cfg(**LEAN_7B, gpu_memory_gib=budget), user)["fits"]
    plan = plan_training(
        shape_from_config(QWEN2_7B), cfg(**LEAN_7B, gpu_memory_gib=budget, offload_activations="auto")
    )
    st = plan["strategy"]
    assert st["offload_activations"] and st["micro_batch_size"] == 2 and st["offload_layers"] == 0
    assert "activations kept in CPU memory" in plan["reason"]
    refused = plan_training(
        shape_from_config(QWEN2_7B), cfg(**LEAN_7B, gpu_memory_gib=budget, offload_activations="off")
    )
    assert not refused["strategy"].get("offload_activations") and refused["strategy"]["micro_batch_size"] == 1


def test_a_refusal_with_activations_barred_names_offload_activations_as_the_fix():
    # micro-batch 1 x 1 and fallback []: nothing but checkpointed activations in CPU memory could make it fit.
    single = dict(LEAN_7B, micro_batch_size=1, gradient_accumulation_steps=1, fallback=[])
    user = Strategy.from_config(cfg(**single), shape_from_config(QWEN2_7B).L)
    with_acts = estimate(shape_from_config(QWEN2_7B), cfg(**single), user.replace(offload_activations=True))[
        "predicted_total_gib"
    ]
    budget = strategy._card_needed_gib(with_acts) + 0.01
    with pytest.raises(PlanRefused, match="set offload_activations: auto"):
        plan_training(shape_from_config(QWEN2_7B), cfg(**single, gpu_memory_gib=budget, offload_activations="off"))
    assert plan_training(
        shape_from_config(QWEN2_7B), cfg(**single, gpu_memory_gib=budget, offload_activations="auto")
    )["strategy"]["offload_activations"]


def test_offload_activations_on_applies_to_every_rung_that_checkpoints():
    # fast mode (no checkpointing asked) with `on`: whatever the ladder checkpoints waits in CPU memory.
    c = cfg(**{**LEAN_7B, "gradient_checkpointing": False}, offload_activations="on")
    for strat, _why in strategy.ladder(shape_from_config(QWEN2_7B), c):
        assert strat.offload_activations == (strat.checkpointed(28) > 0), strat


# --- optimize: speed (the default) or memory ------------------------------------------------------------------
def mode(**kw) -> Config:
    """A config with no mode flag set but those given: gradient_checkpointing left to `optimize`."""
    return cfg(**{"gradient_checkpointing": None, **kw})


def test_optimize_speed_is_the_default_and_checkpoints_the_fewest_layers_that_fit():
    c = mode(**LEAN_7B, gpu_memory_gib=32)
    assert c.optimize == "speed" and c.gradient_checkpointing is None
    plan = plan_training(shape_from_config(QWEN2_7B), c)
    st, L = plan["strategy"], shape_from_config(QWEN2_7B).L
    k = st["checkpointed_layers"]
    assert 0 < k < L and not st["offload_activations"] and st["micro_batch_size"] == 2 and st["adapter"] == "lora"
    assert plan["memory"]["predicted_total_gib"] <= 32 - safety_margin_gib(32)
    # one layer fewer would not fit: the fastest strategy that fits the budget with its margin
    assert not estimate(shape_from_config(QWEN2_7B), c, Strategy.from_json(st).with_checkpointing(k - 1))["fits"]
    # a card with room checkpoints nothing
    assert (
        plan_training(shape_from_config(QWEN2_7B), mode(**LEAN_7B, gpu_memory_gib=80))["strategy"][
            "checkpointed_layers"
        ]
        == 0
    )


def test_optimize_memory_gives_the_least_memory():
    speed = plan_training(shape_from_config(QWEN2_7B), mode(**LEAN_7B, gpu_memory_gib=32))
    lean = plan_training(shape_from_config(QWEN2_7B), mode(**LEAN_7B, gpu_memory_gib=32, optimize="memory"))
    st = lean["strategy"]
    # every layer checkpointed (the test below)
    assert st["checkpointed_layers"] == 28 and st["offload_activations"] is True and st["micro_batch_size"] == 2
    assert lean["memory"]["predicted_total_gib"] < speed["memory"]["predicted_total_gib"]
    # nothing on the ladder of the same adapter and batch predicts less
    c = mode(**LEAN_7B, gpu_memory_gib=32, optimize="memory")
    least = min(
        estimate(shape_from_config(QWEN2_7B), c, s)["predicted_total_gib"]
        for s, _ in strategy.ladder(shape_from_config(QWEN2_7B), c)
        if s.adapter == "lora" and not s.offload_layers and s.micro_batch_size == 2
    )
    assert lean["memory"]["predicted_total_gib"] == pytest.approx(least, abs=0.01)


@pytest.mark.parametrize(
    "kw,every,acts",
    [
        (dict(optimize="memory", gradient_checkpointing=False), False, False),  # an explicit knob wins over the mode
        (dict(optimize="memory", offload_activations="off"), True, False),
        (dict(offload_activations="on"), True, True),  # 'on' asks for every checkpointed input in CPU memory
        (dict(gradient_checkpointing=True), True, False),  # today's lean without the mode: activations only if needed
        (dict(), False, False),
    ],
)
def test_optimize_is_overridden_by_the_knobs_that_are_set(kw, every, acts):
    c = mode(**LEAN_7B, **kw)
    user = Strategy.from_config(c, 28)
    assert checkpoint_every_layer(c) is every and user.checkpointed_layers == (28 if every else 0)
    assert user.offload_activations is acts


def test_optimize_speed_keeps_bf16_for_the_14b_on_32_gib():
    plan = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), mode(**LORA_14B, gpu_memory_gib=32, fused_loss="on"))
    assert plan["strategy"]["adapter"] == "lora" and plan["fits"]


@pytest.mark.parametrize(
    "mc,refused",
    [
        (GEMMA2_2B, False),
        (GEMMA2_9B, False),
        (
            {
                **GEMMA2_9B,
                "hidden_size": 4608,
                "num_hidden_layers": 46,
                "num_attention_heads": 32,
                "head_dim": 128,
                "query_pre_attn_scalar": 144,
            },
            False,
        ),  # Gemma-2-27B: 4608 / 32
        ({**GEMMA2_2B, "query_pre_attn_scalar": 144}, True),
        (
            {**GEMMA2_9B, "num_hidden_layers": 46, "query_pre_attn_scalar": 256},
            True,
        ),  # a 46-layer one is taken for the 27B
    ],
)
def test_a_gemma2_whose_query_scale_llama_cpp_would_not_apply_is_refused_at_plan_time(mc, refused):
    from loraship.llamacpp.llamacpp import gemma2_scale_problems

    problems = gemma2_scale_problems(mc)
    assert bool(problems) == refused
    if refused:
        assert "query_pre_attn_scalar" in problems[0] and "llama.cpp" in problems[0]


def test_optimize_memory_checkpoints_every_layer():
    """optimize: memory is the least memory: every layer checkpointed, inputs in CPU memory, even the last, whose
    activations the estimate once counted as free under the loss and which measured 0.06-0.16 GiB more on the GPU
    (README, "A recompute without down_proj's GEMM"). gradient_checkpointing: true means the same."""
    L = shape_from_config(QWEN2_7B).L
    for targets in (["q_proj", "v_proj", "o_proj"], "all-linear"):
        for adapter in ("lora", "qlora"):
            c = cfg(
                **{**FAST_7B, "gradient_checkpointing": None, "lora_target_modules": targets},
                optimize="memory",
                adapter=adapter,
                gpu_memory_gib=32,
            )
            plan = plan_training(shape_from_config(QWEN2_7B), c)
            assert plan["strategy"]["checkpointed_layers"] == L, (targets, adapter)
            assert plan["strategy"]["offload_activations"]
            explicit = plan_training(
                shape_from_config(QWEN2_7B),
                cfg(**{**FAST_7B, "gradient_checkpointing": True, "lora_target_modules": targets}, adapter=adapter),
            )
            assert explicit["strategy"]["checkpointed_layers"] == L


def test_lora_gradients_are_not_at_a_peak_that_comes_before_backward_writes_them():
    # tasks/train.py sets gradients to None after each step: with k < L layers checkpointed and no accumulation the
    # peak (the loss, the last layer's backward) holds none; every layer checkpointed, or accumulating, it holds them.
    c = cfg(**{**FAST_7B, "gradient_accumulation_steps": 1})
    L = shape_from_config(QWEN2_7B).L
    base = Strategy.from_config(c, L)
    lora_g = estimate(shape_from_config(QWEN2_7B), c, base)["components_gib"][
        "lora_weights"
    ]  # gradients: as many bytes (fp32)

    def gap(k, accumulation=1, program="train-stage"):
        st = base.with_checkpointing(k).replace(gradient_accumulation_steps=accumulation)
        est = estimate(shape_from_config(QWEN2_7B), c, st, program=program)
        parts = est["components_gib"]
        return est["predicted_allocated_gib"] - sum(
            parts[n] for n in ("frozen_weights", "lora_weights", "optimizer_state", "lora_gradients")
        ), parts["lora_gradients"]

    for k in (0, 14):
        (rest, grads), (rest_acc, grads_acc) = gap(k), gap(k, accumulation=2)
        assert grads == 0 and grads_acc == pytest.approx(lora_g, abs=1e-3)
        assert rest == pytest.approx(rest_acc, abs=2e-3)  # only the gradients differ
    assert gap(L)[1] == pytest.approx(lora_g, abs=1e-3)
    assert gap(14, program="harness")[1] == pytest.approx(lora_g, abs=1e-3)  # the harness's fit counted them


def test_fused_loss_transient_is_bf16_logits_of_one_chunk_and_three_hidden_sized_tensors():
    # Liger's fused linear cross-entropy at the chunk_mem_const train passes it, 2: 8192 rows / ceil(152064 / 7168)
    # = 372 -> one chunk of 512 rows of bf16 logits, whose gradient its kernel writes in place (no fp32 copy);
    # the final norm's input (kept for its backward) and output, and the input gradient: bf16, T x h each.
    s = shape_from_config(QWEN2_7B)
    assert fused_loss_transient(8192, s) == 512 * 152064 * 2 + 3 * 2 * 8192 * 3584


def test_streamed_layers_are_the_first_n_or_spread_evenly_over_the_checkpointed_ones():
    base = {
        "adapter": "lora",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "fused_loss": True,
        "gradient_checkpointing": True,
    }
    first = Strategy.from_json({**base, "offload_layers": 5}).with_checkpointing(12)
    assert first.streamed(48) == [0, 1, 2, 3, 4]
    assert first.replace(offload_layers=0, offload_spread=True).streamed(48) == []
    assert first.replace(offload_spread=True).with_checkpointing(5).streamed(48) == [
        0,
        1,
        2,
        3,
        4,
    ]
    for n, k in [(5, 12), (17, 40), (21, 36), (47, 48), (1, 48)]:
        spread = (
            Strategy.from_json({**base, "offload_layers": n, "offload_spread": True})
            .with_checkpointing(k)
            .streamed(48)
        )
        gaps = [b - a for a, b in zip(spread, spread[1:])]
        assert len(spread) == n and spread[0] == 0 and spread[-1] + 1 < k  # the layer after the last one recomputes
        assert set(gaps) <= {k // n, -(-k // n)}, (n, k, gaps)  # as even as whole layers allow


def test_spreading_the_streamed_layers_hides_copies_longer_than_one_layers_forward(monkeypatch):
    c = cfg(**{**LORA_14B, "gradient_checkpointing": None, "gradient_accumulation_steps": 1}, fused_loss="on")
    first = Strategy.from_config(c, 48).replace(offload_layers=21).with_checkpointing(36)
    spread = first.replace(offload_spread=True)
    a, b = (step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, x) for x in (first, spread))
    assert a["compute_s"] == b["compute_s"] and b["step_s"] < a["step_s"] - 0.02  # a 14B layer's copy > its forward
    assert estimate(shape_from_config(QWEN2_14B_EXAMPLE), c, first) == estimate(
        shape_from_config(QWEN2_14B_EXAMPLE), c, spread
    )
    monkeypatch.setattr(step_time, "PLAN_HOST_TO_DEVICE_GBPS", 1e6)  # free copies: the layout does not matter
    a, b = (step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, x) for x in (first, spread))
    assert a["step_s"] == pytest.approx(b["step_s"]) == pytest.approx(a["compute_s"])


def test_the_speed_plan_spreads_its_streamed_layers_unless_told_not_to(monkeypatch):
    c = cfg(**{**LORA_14B, "gradient_checkpointing": None, "gradient_accumulation_steps": 1}, fused_loss="on")
    plan = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)
    st = plan["strategy"]
    assert st.get("offload_spread") is True and 0 < st["offload_layers"] < st["checkpointed_layers"] < 48
    assert f"spread over the first {st['checkpointed_layers']}" in plan["reason"]
    from rich.console import Console

    from loraship.cli import render_plan

    con = Console(record=True, width=400)
    con.print(render_plan(plan, plan_disk_and_inference(shape_from_config(QWEN2_14B_EXAMPLE), c)))
    words = (
        f"{st['offload_layers']} of 48 decoder layers' frozen weights streamed from CPU memory (spread over the "
        f"first {st['checkpointed_layers']})"
    )
    assert words in con.export_text()
    monkeypatch.setenv("LORASHIP_OFFLOAD_SPREAD", "0")  # bench/train_bench.py's loraship-contiguous
    contiguous = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)
    assert "offload_spread" not in contiguous["strategy"] and "spread" not in contiguous["reason"]
    assert (
        step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, st)["step_s"]
        < step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, contiguous["strategy"])["step_s"]
    )


def test_the_least_memory_plan_spreads_its_streamed_layers_at_no_memory_cost(monkeypatch):
    """optimize: memory streams the least that fits and checkpoints all 48 layers: spreading those few costs nothing
    and hides their copies better, so the plan spreads them; with LORASHIP_OFFLOAD_SPREAD=0 it keeps the first n."""
    c = cfg(
        **{**LORA_14B, "optimize": "memory", "gradient_checkpointing": None, "gradient_accumulation_steps": 1},
        fused_loss="on",
    )
    plan = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)
    st = plan["strategy"]
    n = st["offload_layers"]
    assert st["offload_spread"] is True and st["checkpointed_layers"] == 48 and 0 < n < 48
    assert Strategy.from_json(st).streamed(48) == [j * 48 // n for j in range(n)]
    assert (
        f"its {n} streamed layers spread over the first 48" in plan["reason"] and "the same memory" in plan["reason"]
    )
    monkeypatch.setenv("LORASHIP_OFFLOAD_SPREAD", "0")
    first = plan_training(shape_from_config(QWEN2_14B_EXAMPLE), c)
    assert first["strategy"] == {k: v for k, v in st.items() if k != "offload_spread"}
    assert first["memory"] == plan["memory"]
    assert (
        step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, st)["step_s"]
        < step_seconds(shape_from_config(QWEN2_14B_EXAMPLE), c, first["strategy"])["step_s"]
    )


def test_a_refusal_offers_no_liger_install_for_a_model_type_liger_has_no_fused_loss_for(tmp_path):
    # Granite scales its logits: installing liger-kernel would not give it the fused loss (knobs.LIGER_NO_FUSED_LOSS).
    granite = dict(
        model_type="granite",
        architectures=["GraniteForCausalLM"],
        hidden_size=4096,
        intermediate_size=12800,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=49155,
        tie_word_embeddings=True,
        embedding_multiplier=12.0,
        logits_scaling=16.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
    )
    (tmp_path / "config.json").write_text(json.dumps(granite))
    with pytest.raises(PlanRefused) as e:
        plan_training(
            shape_from_config(granite), cfg(base_model=str(tmp_path), gpu_memory_gib=8, fused_loss="auto", fallback=[])
        )
    assert "nothing fits gpu_memory_gib 8 GiB" in str(e.value) and "install liger-kernel" not in str(e.value)
