"""Where the test suite's CPU goes: sums LORASHIP_TEST_CPU_LOG's lines (tests/conftest.py) per file and per test.

    LORASHIP_TEST_CPU_LOG=/tmp/cpu.jsonl make test
    python bench/test_cpu.py /tmp/cpu.jsonl [--out bench/results/test_cpu.json]

CPU seconds, not durations: on 2 shared cores a duration says as much about the neighbours as about the test, while
the CPU a test costs is what `make test` on 2 cores must pay for (its floor is the total over 2).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def summarize(rows: list[dict]) -> dict:
    if not rows:
        raise SystemExit("no test rows in the log: was LORASHIP_TEST_CPU_LOG set for the pytest run?")
    files: dict[str, dict] = defaultdict(lambda: {"tests": 0, "cpu_s": 0.0, "wall_s": 0.0})
    for row in rows:
        entry = files[row["test"].split("::", 1)[0]]
        entry["tests"] += 1
        entry["cpu_s"] += row["cpu_s"]
        entry["wall_s"] += row["wall_s"]
    total = sum(r["cpu_s"] for r in rows)
    by_file = sorted(files.items(), key=lambda kv: -kv[1]["cpu_s"])
    return {
        "tests": len(rows),
        "cpu_s": round(total, 1),
        "floor_on_2_cores_s": round(total / 2, 1),
        "files": {
            name: {**{k: round(v, 1) for k, v in e.items()}, "share": round(e["cpu_s"] / total, 3)}
            for name, e in by_file
        },
        "slowest_tests": [
            {"test": r["test"], "cpu_s": r["cpu_s"]} for r in sorted(rows, key=lambda r: -r["cpu_s"])[:40]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.log.read_text(encoding="utf-8").splitlines() if line.strip()]
    summary = summarize(rows)
    floor = summary["floor_on_2_cores_s"]
    print(f"{summary['tests']} tests, {summary['cpu_s']:.0f} CPU-s (floor on 2 cores {floor:.0f} s)")
    for name, e in list(summary["files"].items())[:25]:
        print(f"{e['cpu_s']:8.1f} CPU-s {e['share']:6.1%} {e['tests']:4d} tests  {name}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
