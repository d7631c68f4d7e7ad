"""verify's gates one by one, on figures made up here (no model, no llama.cpp)."""

from __future__ import annotations

import math

import pytest

from loraship.config import Config
from loraship.verification.gates import (
    eval_loss_gate,
    file_type_gate,
    finetune_answers_gate,
    finetune_kl_gate,
    golden_decisive_gate,
    golden_match_gate,
    kl_mean_gate,
    kl_p99_gate,
    perplexity_ratio_gate,
    same_top_gate,
    served_gate,
    tokenizer_parity_gate,
)
from loraship.verification.scoring import parting

_DEFAULTS = Config.model_construct(**{name: f.default for name, f in Config.model_fields.items()})
CONFIG = _DEFAULTS.model_copy(update=_DEFAULTS.gate_limits("Q4_K_M"))  # what verify gates a Q4_K_M against


def agreement(scored: int, **figures) -> dict:
    return {"scored_tokens": scored, **figures}


def test_perplexity_ratio_passes_fails_and_needs_evidence():
    ok = perplexity_ratio_gate(agreement(200, perplexity_ratio=1.01), CONFIG)
    assert ok.to_json() == {
        "passed": True,
        "value": 1.01,
        "threshold": CONFIG.perplexity_ratio_max,
        "evidence": 200,
        "minimum": CONFIG.min_scored_tokens,
    }
    assert not perplexity_ratio_gate(agreement(200, perplexity_ratio=1.5), CONFIG).passed
    few = perplexity_ratio_gate(agreement(10, perplexity_ratio=1.0), CONFIG)
    assert not few.passed and few.note.startswith("not enough evidence: 10 < 64 (min_scored_tokens)")
    none = perplexity_ratio_gate(agreement(0), CONFIG)  # eval_agreement saw no position: no figures at all
    assert not none.passed and math.isnan(none.value) and none.evidence == 0


def test_kl_and_same_top():
    exact = dict(kl_method="exact", kl_tokens=100)
    assert kl_mean_gate(agreement(100, kl_mean=0.01, **exact), CONFIG, 64).passed
    assert not kl_mean_gate(agreement(100, kl_mean=0.5, **exact), CONFIG, 64).passed
    assert "exact KL" in kl_p99_gate(agreement(100, kl_p99=0.1, **exact), CONFIG, 64).note
    # Exact KL over too few tokens is not enough evidence, however small.
    few = kl_mean_gate(agreement(100, kl_mean=0.0, kl_method="exact", kl_tokens=10), CONFIG, 64)
    assert not few.passed and few.evidence == 10
    # The top-k bound counts only where HF's top-k holds most of the mass.
    bound = dict(kl_method="top-k", kl_tokens=100, kl_mean=0.01)
    assert kl_mean_gate(agreement(100, top_k_mass_mean=0.99, **bound), CONFIG, 64).passed
    thin = kl_mean_gate(agreement(100, top_k_mass_mean=0.6, **bound), CONFIG, 64)
    assert not thin.passed and "kl_topk_mass_min" in thin.note
    assert same_top_gate(agreement(100, same_top_rate=0.9), CONFIG).passed
    assert not same_top_gate(agreement(100, same_top_rate=0.5), CONFIG).passed
    assert not same_top_gate(agreement(0), CONFIG).passed


def test_zero_evidence_never_passes_as_0_of_0():
    # agreed == decisive == 0 and equal == checked == 0 would read as "all"; the evidence count says otherwise.
    decisive = golden_decisive_gate({"agreed": 0, "decisive": 0}, CONFIG)
    assert decisive.value == "0/0" and not decisive.passed and "not enough evidence" in decisive.note
    parity = tokenizer_parity_gate({"equal": 0, "checked": 0})
    assert not parity.passed and parity.evidence == 0
    assert not golden_match_gate({"matches": 0}, 0, CONFIG).passed
    # The same gate with a minimum of 1 and one position seen passes.
    one = golden_decisive_gate({"agreed": 1, "decisive": 1}, CONFIG.model_copy(update={"min_decisive_positions": 1}))
    assert one.passed and one.evidence == 1 and "not enough evidence" not in one.note


def test_decisive_agreement_lets_coarse_quantizations_flip_a_small_share():
    q8 = _DEFAULTS.model_copy(update=_DEFAULTS.gate_limits("Q8_0"))
    q3 = _DEFAULTS.model_copy(update=_DEFAULTS.gate_limits("Q3_K_M"))
    one_flip = {"agreed": 44, "decisive": 45}  # what the real SmolLM2's Q3_K_M did
    assert not golden_decisive_gate(one_flip, q8).passed  # 5 bits and up: every decisive token
    assert golden_decisive_gate(one_flip, q3).passed and golden_decisive_gate(one_flip, CONFIG).passed
    assert golden_decisive_gate(one_flip, q3).threshold == "flips <= 5.0%"
    assert not golden_decisive_gate({"agreed": 40, "decisive": 45}, q3).passed  # 11% flipped
    assert not golden_decisive_gate({"agreed": 0, "decisive": 0}, q3).passed  # nothing seen


def test_golden_match_rate():
    assert golden_match_gate({"matches": 4}, 5, CONFIG).to_json() | {"note": ""} == {
        "passed": True,
        "value": 0.8,
        "threshold": 0.75,
        "evidence": 5,
        "minimum": 4,
        "note": "",
    }
    assert not golden_match_gate({"matches": 3}, 5, CONFIG).passed
    # Answers that part from the merged model's only where it was at a near-tie count...
    tied = golden_match_gate({"matches": 1, "parted_at_near_tie": 4}, 5, CONFIG)
    assert tied.passed and tied.value == 1.0 and "1/5 token for token, 4 more parted at a near-tie" in tied.note
    # ...those that part where it was decided do not.
    assert not golden_match_gate({"matches": 1, "parted_at_near_tie": 2}, 5, CONFIG).passed


def test_parting_finds_where_an_answer_leaves_the_merged_models_and_its_lead_there():
    record = {"answer_ids": [5, 6, 7], "stop_id": 2, "margins": [3.0, 0.2, 4.0, 6.0]}  # 7 positions: 3 + stop
    assert parting([5, 6, 7], record) == (None, None)
    assert parting([5, 9, 7], record) == (1, 0.2)  # at a near-tie (0.2 nats)
    assert parting([5, 6, 8], record) == (2, 4.0)  # where the merged model was decided
    assert parting([5, 6], record) == (2, 4.0)  # stopped early: left at position 2
    assert parting([5, 6, 7, 9], record) == (3, 6.0)  # ran past the merged model's stop
    assert parting([5, 6, 7, 9, 9], {**record, "margins": [3.0, 0.2, 4.0]}) == (
        3,
        None,
    )  # past the scores: no lead known


def test_gates_without_evidence_counts():
    assert file_type_gate({"general.file_type": 15}, "Q4_K_M").to_json() == {
        "passed": True,
        "value": 15,
        "threshold": 15,
    }
    assert not file_type_gate({"general.file_type": 7}, "Q4_K_M").passed
    assert eval_loss_gate({"eval_loss_before": 2.0, "eval_loss_after": 1.5}).passed
    assert not eval_loss_gate({"eval_loss_before": 2.0, "eval_loss_after": None}).passed


def test_fine_tune_gates_fail_a_gguf_that_drifted_back_to_the_base():
    kept = finetune_kl_gate(
        {"finetune_kl_ratio": 0.01, "finetune_tokens": 100, "finetune_kl_mean": 0.01, "base_kl_mean": 1.0}, CONFIG
    )
    assert kept.passed and kept.evidence == 100
    lost = finetune_kl_gate(
        {"finetune_kl_ratio": 0.9, "finetune_tokens": 100, "finetune_kl_mean": 0.9, "base_kl_mean": 1.0}, CONFIG
    )
    assert not lost.passed
    unmoved = finetune_kl_gate(
        {"finetune_kl_ratio": None, "finetune_tokens": 100, "finetune_kl_mean": 0.0, "base_kl_mean": 0.0}, CONFIG
    )
    assert not unmoved.passed and "did not move the model" in unmoved.note
    answers = [{"changed_by_finetune": True, "match": True}] * 3 + [{"changed_by_finetune": False, "match": False}]
    assert finetune_answers_gate({"answers": answers}, CONFIG).value == "3/3"
    reverted = [{"changed_by_finetune": True, "match": False}] * 3
    assert not finetune_answers_gate({"answers": reverted}, CONFIG).passed
    tie_flips = [{"changed_by_finetune": True, "match": False, "parted_at_near_tie": True, "equals_base": False}] * 3
    assert finetune_answers_gate({"answers": tie_flips}, CONFIG).passed
    back_to_base = [dict(a, equals_base=True) for a in tie_flips]
    assert not finetune_answers_gate({"answers": back_to_base}, CONFIG).passed
    assert not finetune_answers_gate({"answers": []}, CONFIG).passed  # nothing seen is no pass


def _served(n: int, **wrong) -> dict:
    answer = {
        "prompt": "p",
        "served": "Answer: X.",
        "streamed": "Answer: X.",
        "gguf_greedy": "Answer: X.",
        "reference": "Answer: X.",
        "finish_reason": "stop",
        "streamed_finish_reason": "stop",
        "equal_to_reference": True,
        "equal_to_gguf_greedy": True,
        "streamed_equal": True,
        "markers_leaked": [],
        "whole_equal_to_gguf": True,
        "whole_gguf_parted_at": None,
        "whole_gguf_lead_there": None,
        "whole_merged_lead_there": None,
        "streamed_equal_to_gguf": True,
        "streamed_gguf_parted_at": None,
        "streamed_gguf_lead_there": None,
        "streamed_merged_lead_there": None,
    }
    answers = [dict(answer) for _ in range(n)]
    if answers:
        answers[0].update(wrong)
    counts = {
        k: sum(bool(a[k]) for a in answers) for k in ("equal_to_reference", "equal_to_gguf_greedy", "streamed_equal")
    }
    return {
        "requests": n,
        "answers": answers,
        "without_markers": sum(not a["markers_leaked"] for a in answers),
        "finished_by_stop": sum(a["finish_reason"] == a["streamed_finish_reason"] == "stop" for a in answers),
        **counts,
    }


def test_served_gate_holds_serving_to_the_gguf():
    assert served_gate(_served(8), CONFIG).passed
    # How the GGUF's own greedy answers compare with HF's is golden_match's question, not asked twice...
    flips = _served(8, equal_to_reference=False)
    flips["equal_to_reference"] = 5
    assert served_gate(flips, CONFIG).passed and served_gate(flips, CONFIG).value["equal_to_reference"] == 5
    # ...but serving may change nothing: a run-on answer, a leaked marker, a different stream or answer fails.
    for wrong in (
        {"finish_reason": "length"},
        {"markers_leaked": ["<|im_end|>"]},
        {"streamed_equal_to_gguf": False, "streamed_gguf_lead_there": 5.0},
        {"whole_equal_to_gguf": False, "whole_gguf_lead_there": 5.0},
        {"whole_equal_to_gguf": False, "whole_gguf_lead_there": None},
    ):
        assert not served_gate(_served(8, **wrong), CONFIG).passed, wrong
    # A server answer that parts from the GGUF's own only where llama.cpp was at a near-tie passes.
    assert served_gate(_served(8, whole_equal_to_gguf=False, whole_gguf_lead_there=0.1), CONFIG).passed
    assert not served_gate(_served(0), CONFIG).passed  # nothing served is no pass


def test_served_gate_calls_a_decided_token_decided_and_a_near_tie_a_near_tie():
    # Issue #34's case: the served answer left the GGUF's greedy one, the merged model's, where llama.cpp led by
    # 1.53 nats (golden_margin 1.0): decided, never a near-tie.
    decided = served_gate(
        _served(
            10,
            served='{"country": "Ukraine", "capital": "Kyiv"}',
            equal_to_gguf_greedy=False,
            whole_equal_to_gguf=False,
            whole_gguf_parted_at=4,
            whole_gguf_lead_there=1.53,
            whole_merged_lead_there=1.71,
        ),
        CONFIG,
    )
    assert not decided.passed
    assert (
        "served: parted at step 4 where it was decided: llama.cpp's own top token led by 1.53 nats >= golden_margin "
        f"{CONFIG.golden_margin}; the merged model, whose answer the GGUF's is, led by 1.71"
    ) in decided.note
    assert "near-tie" not in decided.note and "streamed: equal to it" in decided.note
    # A stream cut short that parted at a near-tie too: each side named as what it was.
    tie = served_gate(
        _served(
            10,
            streamed_finish_reason="length",
            streamed_equal_to_gguf=False,
            streamed_gguf_parted_at=2,
            streamed_gguf_lead_there=0.2,
        ),
        CONFIG,
    )
    assert not tie.passed
    assert (
        f"streamed: parted at step 2 at a near-tie: llama.cpp's own top token led by 0.20 nats < golden_margin "
        f"{CONFIG.golden_margin}"
    ) in tie.note and "merged model" not in tie.note
    past = served_gate(_served(10, whole_equal_to_gguf=False, whole_gguf_parted_at=7), CONFIG)
    assert "served: parted at step 7, past the GGUF's own answer and stop (no lead known there)" in past.note


def test_server_defaults_are_reported_never_gated():
    served = _served(10)
    served["server_defaults"] = {
        "settings": {"repeat_penalty": 1.1, "top_k": 40},
        "requests": 10,
        "differ_from_gguf_greedy": 3,
    }
    verdict = served_gate(served, CONFIG)
    assert verdict.passed and verdict.note.startswith("3 of 10 answers differ under the server's default settings")


def test_parting_from_maps_a_text_difference_to_the_greedy_step_and_its_lead():
    from loraship.llamacpp.served import parting_from

    # Tokens " Answer", ":", " Gant", "esan", "." (leading space stripped for comparison), then the stop.
    own = {"text": " Answer: Gantesan.", "prefix_bytes": [7, 8, 13, 17, 18], "leads": [9.0, 8.0, 2.0, 0.16, 3.0, 7.0]}
    assert parting_from("Answer: Gantesan.", own) == (None, None)
    assert parting_from("Answer: Gantes.", own) == (3, 0.16)  # parts inside "esan": step 3, a near-tie
    assert parting_from("Answer: Kara.", own) == (2, 2.0)  # parts at " Gant": decided
    assert parting_from("Answer: Gantesan. More", own) == (5, 7.0)  # ran past the GGUF's stop
    assert parting_from("Answer: Gantesan. More", {**own, "leads": own["leads"][:5]}) == (5, None)
    # An incomplete UTF-8 piece the server held back is no parting.
    assert parting_from("Answer Ravebri.", {**own, "text": " Answer\ufffd Ravebri."}) == (None, None)


def test_each_quantization_has_its_own_calibrated_limits_unless_the_config_sets_them():
    from loraship.constants import GGUF_FILE_TYPES, QUANT_GATES

    assert set(QUANT_GATES) == set(GGUF_FILE_TYPES) - {"F16"}  # every quantization loraship ships has its gates
    q8, q4, q3 = (_DEFAULTS.gate_limits(q) for q in ("Q8_0", "Q4_K_M", "Q3_K_M"))
    # Coarser quantizations are allowed more error, and never less.
    assert q8["kl_mean_max"] < q4["kl_mean_max"] < q3["kl_mean_max"]
    assert q8["same_top_min"] > q4["same_top_min"] > q3["same_top_min"]
    order = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_L", "Q3_K_M"]  # finest first (K-quants)
    for name in ("kl_mean_max", "kl_p99_max", "perplexity_ratio_max", "decisive_flips_max"):
        values = [next(g.limit for g in QUANT_GATES[q] if g.name == name) for q in order]
        assert values == sorted(values), name
    # llama.cpp's Llama-3-8B figures (loraship/constants.py) pass their own quantization's defaults.
    for q, kld, same_top, ppl_ratio in (
        ("Q8_0", 0.00136, 0.977, 1.0004),
        ("Q6_K", 0.00545, 0.960, 1.0035),
        ("Q4_K_M", 0.0313, 0.919, 1.028),
        ("Q3_K_M", 0.102, 0.86, 1.105),
    ):
        limits = _DEFAULTS.gate_limits(q)
        assert (
            kld <= limits["kl_mean_max"]
            and same_top >= limits["same_top_min"]
            and ppl_ratio <= limits["perplexity_ratio_max"]
        )
    assert _DEFAULTS.model_copy(update={"kl_mean_max": 0.5}).gate_limits("Q8_0")["kl_mean_max"] == 0.5


def _judged(name: str, value: float, limits):
    """The verify gate a QuantGate named `name` limits, judged on a figure of `value` with plenty of evidence."""
    from loraship.verification import gates

    agreement = {"scored_tokens": 10_000, "kl_tokens": 10_000, "kl_method": "exact"}
    if name == "decisive_flips_max":  # the share of 1000 decisive tokens flipped
        flipped = round(value * 1000)
        return gates.golden_decisive_gate({"decisive": 1000, "agreed": 1000 - flipped}, limits)
    metric, gate = {
        "kl_mean_max": ("kl_mean", lambda a: gates.kl_mean_gate(a, limits, 40)),
        "kl_p99_max": ("kl_p99", lambda a: gates.kl_p99_gate(a, limits, 40)),
        "same_top_min": ("same_top_rate", lambda a: gates.same_top_gate(a, limits)),
        "perplexity_ratio_max": ("perplexity_ratio", lambda a: gates.perplexity_ratio_gate(a, limits)),
    }[name]
    return gate({**agreement, metric: value})


@pytest.mark.parametrize("quantization", ["Q8_0", "Q4_K_M", "IQ3_M"])
def test_each_quant_gate_record_says_which_verify_gate_it_limits_and_which_way(quantization):
    from loraship.constants import QUANT_GATES

    records = QUANT_GATES[quantization]
    limits = _DEFAULTS.model_copy(update=_DEFAULTS.gate_limits(quantization))
    assert [g.name for g in records] == list(_DEFAULTS.gate_limits(quantization))
    for g in records:
        assert g.direction == g.name.rpartition("_")[2] and g.why, g
        beyond = g.limit + 0.01 if g.direction == "max" else g.limit - 0.01
        at, past = _judged(g.name, g.limit, limits), _judged(g.name, beyond, limits)
        assert at.name == past.name == g.metric, g
        # verify's own gate agrees with the record: the limit itself passes, a figure past it fails.
        assert (at.passed, past.passed) == (g.passes(g.limit), g.passes(beyond)) == (True, False), g


def test_a_gate_is_a_typed_record_whose_json_is_verify_jsons():
    import dataclasses

    import pytest

    from loraship.verification.gates import Gate, judge

    # No evidence counted: the record has no evidence, minimum or (empty) note keys, as verify.json always had.
    plain = judge("file_type", 15, 15, True)
    assert plain == Gate("file_type", True, 15, 15) and plain.to_json() == {
        "passed": True,
        "value": 15,
        "threshold": 15,
    }
    # Zero evidence with no minimum still fails, and says what it saw; the minimum is kept only beside evidence.
    none = judge("x", "0/0", "all", True, evidence=0)
    assert none.to_json() == {
        "passed": False,
        "value": "0/0",
        "threshold": "all",
        "evidence": 0,
        "note": "not enough evidence: 0 seen",
    }
    assert judge("x", 1, 1, True, minimum=5).to_json() == {"passed": True, "value": 1, "threshold": 1}
    few = judge("x", 1.0, 1.1, True, "why", evidence=3, minimum=4, minimum_key="min_scored_tokens")
    assert list(few.to_json()) == ["passed", "value", "threshold", "evidence", "minimum", "note"]
    assert few.note == (
        "not enough evidence: 3 < 4 (min_scored_tokens); add eval data or golden prompts, or lower "
        "min_scored_tokens; why"
    )
    assert judge("x", 0, 0, 1).passed is True  # a truthy figure is stored as a bool
    with pytest.raises(dataclasses.FrozenInstanceError):
        few.passed = True


def test_special_tokens_gate_judges_what_the_child_saw_llama_cpp_do():
    from loraship.verification.gates import special_tokens_gate

    reference = {"tokenizer": {"adds_bos": True, "bos_id": 1, "stop_ids": [2]}}
    fields = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.eos_token_id": 2}
    ok = special_tokens_gate({"adds_bos": True, "stop_ids_not_eog": []}, fields, reference)
    assert (
        ok.name == "special_tokens" and ok.passed and ok.value["gguf_bos"] == 1 and ok.threshold["hf_stop_ids"] == [2]
    )
    assert not special_tokens_gate({"adds_bos": False, "stop_ids_not_eog": []}, fields, reference).passed
    assert not special_tokens_gate({"adds_bos": True, "stop_ids_not_eog": [2]}, fields, reference).passed
    other_bos = special_tokens_gate(
        {"adds_bos": True, "stop_ids_not_eog": []}, {**fields, "tokenizer.ggml.bos_token_id": 7}, reference
    )
    assert not other_bos.passed
    no_stop = special_tokens_gate(
        {"adds_bos": True, "stop_ids_not_eog": []}, fields, {"tokenizer": {**reference["tokenizer"], "stop_ids": []}}
    )
    assert not no_stop.passed and "never end" in no_stop.note
