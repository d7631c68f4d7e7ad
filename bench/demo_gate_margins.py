"""How far the demo's quality gates are from failing, across seeds and CPU thread counts.

The demo (configs/demo.yaml) and every test that runs a pipeline through verify train the tiny
model on whatever CPU runs them; a gate that passes on one machine and fails on another is a flaky
product, not a flaky test. This runs the demo's stages (plan .. verify, no Prefect) once per
(seed, threads) in its own process and records each gate's value next to its threshold.

    .venv/bin/python bench/demo_gate_margins.py --seeds 42 1 7 --threads 1 2 --out bench/results/demo_gate_margins.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ONE_RUN = """
import json, sys, importlib
import torch
torch.set_num_threads(int(sys.argv[3]))
from loraship.config import load_config
from loraship.runtime.stage import stage_dir
config = load_config(sys.argv[1])
for stage in ("plan", "train", "merge", "reference", "convert", "quantize"):
    importlib.import_module(f"loraship.stages.{stage}").run(config)
try:
    importlib.import_module("loraship.stages.verify").run(config)
except Exception as e:
    print("verify failed:", e, file=sys.stderr)
verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
train = json.loads((stage_dir(config, "train") / "manifest.json").read_text())["metrics"]
fields = ("passed", "value", "threshold", "evidence")
json.dump({"passed": verify["passed"], "eval_loss_after": train.get("eval_loss_after"),
           "gates": {k: {x: g.get(x) for x in fields} for k, g in verify["gates"].items()}},
          open(sys.argv[2], "w"))
"""


def run_one(seed: int, threads: int, root: Path) -> dict:
    import yaml

    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config.update(
        seed=seed,
        run_name=f"margins-{seed}-{threads}",
        workdir=str(root / "work"),
        output=str(root / "out"),
        base_model=str(REPO / config["base_model"]),
        datasets=[{**d, "path": str(REPO / d["path"])} for d in config["datasets"]],
        eval_datasets=[{**d, "path": str(REPO / d["path"])} for d in config["eval_datasets"]],
        golden_prompts=str(REPO / config["golden_prompts"]),
    )
    cfg = root / f"{config['run_name']}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    result = root / f"{config['run_name']}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-c", ONE_RUN, str(cfg), str(result), str(threads)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not result.is_file():
        return {"seed": seed, "threads": threads, "error": done.stderr[-2000:]}
    return {
        "seed": seed,
        "threads": threads,
        "seconds": round(time.time() - started, 1),
        **json.loads(result.read_text()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 7])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "demo_gate_margins.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for threads in args.threads:
                row = run_one(seed, threads, Path(tmp))
                rows.append(row)
                gates = row.get("gates", {})
                shown = {
                    k: gates[k]["value"]
                    for k in (
                        "golden_match",
                        "golden_decisive_agreement",
                        "golden_format",
                        "golden_ends_turn",
                        "kl_divergence_mean",
                    )
                    if k in gates
                }
                print(f"seed {seed} threads {threads}: passed={row.get('passed')} {shown}", flush=True)
    out = {
        "command": " ".join(sys.argv),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(),
        },
        "config": "configs/demo.yaml",
        "rows": rows,
        "all_passed": all(r.get("passed") for r in rows),
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print("all passed" if out["all_passed"] else "SOME FAILED", "->", args.out)


if __name__ == "__main__":
    main()
