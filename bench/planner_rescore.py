"""Re-score the planner as it is now on the loraship rows of bench/results/train_bench.json (issue #24's H200 run).

Each row is predicted again at the strategy it trained with (train_bench.trained_strategy) and compared with its
measured peak reserved and allocated memory. These rows were seen before (the fused-loss transient was derived from
the previous run's rows; every later change was judged against this run), so this is in-sample re-scoring, not a
held-out measurement. 'changed_plan_rows' are the five rows whose plan changed after that fused-loss fix, which the
README's held-out figure scored: the four partially checkpointed defaults and all-linear lean.

    python bench/planner_rescore.py [--out bench/results/planner_rescore.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import train_bench as tb  # noqa: E402

from loraship.planning.estimate import estimate  # noqa: E402
from loraship.planning.shape import shape_from_config  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "train_bench.json"
CHANGED_PLAN_ROWS = [
    ("qwen2-7b-lora", "loraship-default"),
    ("qwen2-7b-lora-all-linear", "loraship-default"),
    ("qwen2-7b-qlora", "loraship-default"),
    ("qwen2-14b-qlora", "loraship-default"),
    ("qwen2-7b-lora-all-linear", "loraship-lean"),
]


def commit_stamp() -> dict:
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", "loraship", "bench", "tasks")),
    }


def summary(rows: list[dict], key: str) -> dict:
    errs = [abs(r[key]) for r in rows]
    return {
        "n": len(errs),
        "median_abs_error": round(statistics.median(errs), 4),
        "worst_abs_error": round(max(errs), 4),
    }


def rescore(bench: dict) -> dict:
    rows = []
    for r in bench["rows"]:
        if not (r.get("ok") and r["trainer"].startswith("loraship") and r.get("reserved_gib")):
            continue
        cfg = tb.bench_config(r)
        strategy = tb.trained_strategy(r, cfg)
        est = estimate(shape_from_config(tb.model_config(tb.CASES[r["case"]][0])), cfg, strategy)
        rows.append(
            {
                "case": r["case"],
                "trainer": r["trainer"],
                "checkpointed_layers": strategy.get("checkpointed_layers"),
                "changed_plan": (r["case"], r["trainer"]) in CHANGED_PLAN_ROWS,
                "peak_phase": est["peak_phase"],
                "measured_reserved_gib": round(r["reserved_gib"], 3),
                "measured_allocated_gib": round(r["allocated_gib"], 3),
                "predicted_in_run_gib": r.get("predicted_reserved_gib"),
                "predicted_reserved_gib": round(est["predicted_reserved_gib"], 3),
                "predicted_allocated_gib": round(est["predicted_allocated_gib"], 3),
                "error_in_run": round(r["predicted_reserved_gib"] / r["reserved_gib"] - 1, 4),
                "error_now": round(est["predicted_reserved_gib"] / r["reserved_gib"] - 1, 4),
                "allocated_error_now": round(est["predicted_allocated_gib"] / r["allocated_gib"] - 1, 4),
            }
        )
    changed = [r for r in rows if r["changed_plan"]]
    return {
        "what": "the planner now (loraship/planning/estimate.py) at each loraship row's trained strategy, against the "
        "row's measured peak; error = predicted / measured - 1 (reserved unless named). In-sample: these rows were "
        "seen before this planner was written, not a held-out measurement.",
        "source": {
            "file": "bench/results/train_bench.json",
            "run_id": bench["run_id"],
            "run_commit": bench["commit"],
            "device": bench["device"],
        },
        **commit_stamp(),
        "all_rows": {
            "now": summary(rows, "error_now"),
            "in_run": summary(rows, "error_in_run"),
            "allocated_now": summary(rows, "allocated_error_now"),
        },
        "changed_plan_rows": {
            "now": summary(changed, "error_now"),
            "in_run": summary(changed, "error_in_run"),
            "allocated_now": summary(changed, "allocated_error_now"),
        },
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "planner_rescore.json")
    args = p.parse_args()
    out = rescore(json.loads(args.results.read_text()))
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for r in out["rows"]:
        print(
            f"{r['case']:26s} {r['trainer']:17s} k={r['checkpointed_layers']:>2} "
            f"reserved {r['measured_reserved_gib']:6.2f} predicted {r['predicted_reserved_gib']:6.2f} "
            f"({r['error_now']:+.2%}; in run {r['error_in_run']:+.2%})"
        )
    print(json.dumps({k: out[k] for k in ("commit", "dirty", "all_rows", "changed_plan_rows")}))


if __name__ == "__main__":
    main()
