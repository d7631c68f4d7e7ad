"""bench/quant_ladder_gpu.py's rows and summary, and how it decides which rungs still fit a device call."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import quant_ladder_gpu as ladder  # noqa: E402

from loraship.constants import AUTO_LADDER  # noqa: E402

GIB = 2**30


def plan_rung(gguf_gib: float, total_gib: float, target: float = 6.0) -> dict:
    return {"gguf_gib": gguf_gib, "total_gib": total_gib, "fits_target": total_gib <= target}


def measured_row(quant: str, gguf_gib: float, plan_total: float, verify_total: float, used: float | None) -> dict:
    memory = {"predicted": {"total_gib": verify_total}, "fits": verify_total <= 6.0}
    measured = {"gpu_used_gib": used, "prompt_tokens_per_s": 1000.0, "gen_tokens_per_s": 100.0}
    return ladder.rung_row(
        quant, plan_rung(gguf_gib, plan_total), round(gguf_gib * 1.02 * GIB), 60.0, memory, measured, 6.0
    )


def test_summary_picks_by_each_basis_and_names_the_disagreements():
    rows = [
        {"quant": "IQ3_M", "skipped": "deadline", **ladder.plan_figures(plan_rung(3.45, 4.66))},
        measured_row("Q3_K_M", 3.54, 4.75, 4.70, 4.60),
        measured_row("Q4_K_M", 4.29, 5.50, 5.28, 5.27),
        # the plan counts the input embedding on the GPU, llama.cpp keeps it on the CPU: fits, measured
        measured_row("Q5_K_M", 5.04, 6.24, 5.95, 5.93),
        measured_row("Q6_K", 5.80, 7.00, 6.70, 6.68),
        {"quant": "Q8_0", "skipped": "deadline", **ladder.plan_figures(plan_rung(7.5, 8.7))},
    ]
    q5 = rows[3]
    assert q5["prediction_error"] == {"plan": round(6.24 / 5.93 - 1, 4), "verify": round(5.95 / 5.93 - 1, 4)}
    assert q5["fits_target_predicted"] == {"plan": False, "verify": True} and q5["fits_target_measured"] is True

    out = ladder.summary(rows, AUTO_LADDER)
    # a skipped rung has the plan's verdict only: it counts for the plan, not for what was measured
    assert out["auto_pick_on_fit_alone"] == {"plan": "IQ3_M", "verify": "Q3_K_M", "measured": "Q3_K_M"}
    assert out["largest_fitting"] == {"plan": "Q4_K_M", "verify": "Q5_K_M", "measured": "Q5_K_M"}
    assert out["fit_disagrees_with_measured"] == {"plan": ["Q5_K_M"], "verify": []}
    assert out["rungs_skipped"] == ["IQ3_M", "Q8_0"]
    assert out["max_abs_memory_prediction_error"]["plan"] == {"quant": "Q5_K_M", "value": round(6.24 / 5.93 - 1, 4)}
    assert out["max_abs_size_error"]["quant"] in {"Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K"}


def test_summary_without_gpu_measurements_has_no_measured_verdicts():
    rows = [measured_row(q, 4.0, 5.0, 5.0, None) for q in ("Q8_0", "Q4_K_M")]  # a CPU dry run, out of ladder order
    out = ladder.summary(rows, AUTO_LADDER)
    assert rows[0]["fits_target_measured"] is None and rows[0]["prediction_error"] == {"plan": None, "verify": None}
    assert out["auto_pick_on_fit_alone"] == {"plan": "Q4_K_M", "verify": "Q4_K_M", "measured": None}
    assert out["max_abs_memory_prediction_error"] == {"plan": None, "verify": None}


def test_expected_quantize_seconds_scales_from_the_slowest_unit_and_floors_cheap_rungs():
    assert ladder.expected_quantize_seconds("Q4_K_M", {}) is None  # the first rung always starts
    done = {"Q4_K_M": 118.0, "Q8_0": 40.0}
    # Q8_0's quantizer work is a tenth of Q4_K_M's, but the stage's fixed costs are not: counted as Q4_K_M
    assert ladder.expected_quantize_seconds("Q8_0", done) == 118.0
    assert ladder.expected_quantize_seconds("IQ3_M", done) == 118.0 * ladder.QUANTIZE_COST["IQ3_M"]
    # a cheap rung that took long raises the unit for the rest
    assert ladder.expected_quantize_seconds("IQ4_XS", {"Q8_0": 150.0}) == 150.0 * ladder.QUANTIZE_COST["IQ4_XS"]
    assert set(ladder.QUANTIZE_COST) == set(AUTO_LADDER) == set(ladder.DEFAULT_ORDER)
