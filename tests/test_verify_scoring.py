"""verify's scoring maths and gate selection on arrays and records made up here (no model, no llama.cpp)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from loraship.verification.gates import agreement_gates, golden_gates
from loraship.verification.scoring import exact_kl, kl_stats, topk_bound_kl


def _logsoftmax(x):
    x = np.asarray(x, dtype=np.float64)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_exact_kl_is_zero_on_equal_distributions_and_the_top_k_bound_stays_below_it():
    rng = np.random.default_rng(0)
    p, q = _logsoftmax(rng.normal(size=(5, 50))), _logsoftmax(rng.normal(size=(5, 50)))
    assert np.allclose(exact_kl(p, p), 0.0)
    full = exact_kl(p, q)
    assert (full > 0).all()
    ids = np.argsort(-p, axis=1)[:, :8]
    bound = topk_bound_kl(ids, np.take_along_axis(p, ids, axis=1), q)
    assert (bound <= full + 1e-12).all()  # the log-sum inequality: top-k + one tail bucket never exceeds the full KL
    every = np.argsort(-p, axis=1)  # with every token in the "top-k" the bound is the exact KL
    assert np.allclose(topk_bound_kl(every, np.take_along_axis(p, every, axis=1), q), full)


def test_kl_stats_clip_rounding_below_zero():
    assert kl_stats([-1e-9, 0.5, 0.25], prefix="x") == {"x_mean": 0.25, "x_median": 0.25, "x_p99": 0.495, "x_max": 0.5}


def test_a_quantization_gets_its_gates_in_verify_jsons_order():
    config = SimpleNamespace(
        perplexity_ratio_max=1.1,
        kl_mean_max=0.1,
        kl_p99_max=1.0,
        same_top_min=0.9,
        min_scored_tokens=1,
        kl_topk_mass_min=0.9,
        finetune_kl_fraction_max=0.5,
        golden_match_min=0.75,
        golden_margin=1.0,
        decisive_flips_max=0.0,
        min_golden_prompts=1,
        min_decisive_positions=1,
        max_new_tokens=8,
    )
    agreement = {
        "scored_tokens": 10,
        "perplexity_ratio": 1.0,
        "kl_method": "exact",
        "kl_tokens": 10,
        "kl_mean": 0.0,
        "kl_p99": 0.0,
        "same_top_rate": 1.0,
    }
    names = [g.name for g in agreement_gates({"equal": 2, "checked": 2}, agreement, config, config, 8)]
    assert names == [
        "tokenizer_parity",
        "perplexity_ratio",
        "kl_divergence_mean",
        "kl_divergence_p99",
        "same_top_token",
    ]
    scored_base = {**agreement, "finetune_tokens": 10, "finetune_kl_ratio": 0.1}
    assert agreement_gates({"equal": 2, "checked": 2}, scored_base, config, config, 8)[-1].name == "finetune_kept_kl"
    answer = {"kind": "chat", "prompt": "p", "hf_stop": 7, "gguf_stop": 7, "match": True}
    golden = {"answers": [answer], "matches": 1, "formatted": 1, "decisive": 1, "agreed": 1}
    reference = {"golden": [{"kind": "chat", "base_answer_ids": [1]}], "tokenizer": {"turn_end_id": 7}}
    assert [g.name for g in golden_gates(golden, reference, config, config)] == [
        "golden_match",
        "golden_decisive_agreement",
        "golden_format",
        "finetune_kept_answers",
        "golden_ends_turn",
    ]
    completion = {"golden": [{"kind": "text", "base_answer_ids": None}], "tokenizer": {"turn_end_id": None}}
    assert all(g.passed for g in golden_gates(golden, completion, config, config))
    assert len(golden_gates(golden, completion, config, config)) == 3
