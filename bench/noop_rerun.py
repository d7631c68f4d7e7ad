"""How long `loraship run configs/demo.yaml` takes when every stage is up to date (issue #25: at most 5 s),
against the same rerun through the train-and-ship flow, which starts Prefect's ephemeral server first (the
CLI's only path before it decided skips from the manifests).

    python bench/noop_rerun.py [--repeats 5]

One cold run of the demo (every stage runs) into a private workdir, output and PREFECT_HOME under a
temporary folder (the checkout's .loraship/work/demo may be another run's), then, alternating, REPEATS
no-op reruns of `loraship run` and REPEATS all-skipped runs of the flow, each a fresh process timed from
start to exit. Prints a table and writes bench/results/noop_rerun.json: the commands, the machine, its
load average around each run (this machine's cores are shared, so figures are noisy) and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "noop_rerun.json"
CONFIG = "configs/demo.yaml"
TARGET_S = 5.0
LORASHIP = [str(Path(sys.executable).with_name("loraship"))]

# The flow path as `loraship run` took it before: the inputs checked, then the flow, every stage skipping.
FLOW = """
import sys
from pathlib import Path
from loraship.runtime.prefect_env import configure_local_prefect
configure_local_prefect()
from loraship.cli import _load
from loraship.planning.preflight import check_inputs
config = _load(Path(sys.argv[1]), sys.argv[2:])
check_inputs(config)
from loraship.flows.train_and_ship import train_and_ship
state = train_and_ship(config, return_state=True)
results = state.result()
if not all(r["skipped"] for r in results.values()):
    sys.exit(f"not every stage skipped: {results}")
"""


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def timed(cmd: list[str], env: dict) -> dict:
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(
            f"{' '.join(cmd)} failed (its folders are kept) (exit {done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return {
        "seconds": round(seconds, 2),
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="loraship-noop-")  # kept when a run fails, to look into
    sets = ["--set", f"workdir={tmp}/work", "--set", f"output={tmp}/artifacts"]
    env = {
        **os.environ,
        "PREFECT_HOME": f"{tmp}/prefect",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "LORASHIP_CACHE": os.environ.get("LORASHIP_CACHE", str(ROOT / ".loraship" / "cache")),
    }
    run = [*LORASHIP, "run", CONFIG, *sets]
    flow = [sys.executable, "-c", FLOW, CONFIG, *[s for s in sets if s != "--set"]]
    print(f"cold run: {' '.join(run)}", flush=True)
    cold = timed(run, env)
    noop, skipped_flow = [], []
    for i in range(args.repeats):
        noop.append(timed(run, env))
        lines = noop[-1]["stdout"]
        if "shipped demo" not in lines or lines.count("up to date") != 8:
            sys.exit(f"the rerun did not report all eight stages up to date:\n{lines}")
        skipped_flow.append(timed(flow, env))
        print(
            f"repeat {i + 1}: no-op rerun {noop[-1]['seconds']} s, all-skipped flow {skipped_flow[-1]['seconds']} s",
            flush=True,
        )
    shutil.rmtree(tmp)
    median_noop = statistics.median(r["seconds"] for r in noop)
    median_flow = statistics.median(r["seconds"] for r in skipped_flow)
    keep = ("seconds", "load_1min_before", "load_1min_after")
    result = {
        "what": "wall time of `loraship run configs/demo.yaml` with every stage up to date (no Prefect), against the "
        "same rerun through the train-and-ship flow (Prefect's ephemeral server started first); each a fresh "
        "process, alternating",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git,
        "commands": {
            "no_op_rerun": " ".join(["loraship", *run[1:]]).replace(tmp, "$TMP"),
            "all_skipped_flow": "python -c FLOW "
            "(bench/noop_rerun.py: check_inputs, then train_and_ship) with the same config and --set values",
            "private": "workdir, output and PREFECT_HOME in a temporary folder",
        },
        "machine": machine(),
        "noise": "the cores are shared with other engineers' jobs: see each run's 1-minute load average",
        "cold_run": {k: cold[k] for k in keep},
        "no_op_rerun": [{k: r[k] for k in keep} for r in noop],
        "all_skipped_flow": [{k: r[k] for k in keep} for r in skipped_flow],
        "median_no_op_rerun_s": median_noop,
        "median_all_skipped_flow_s": median_flow,
        "ratio_no_op_to_flow": round(median_noop / median_flow, 3),
        "target_s": TARGET_S,
        "target_met": median_noop <= TARGET_S,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n| run | median s | runs |\n|---|---|---|\n| cold (every stage runs) | {cold['seconds']} | 1 |\n"
        f"| no-op `loraship run` | {median_noop} | {len(noop)} |\n"
        f"| all-skipped flow (Prefect) | {median_flow} | {len(skipped_flow)} |\n"
        f"ratio no-op / flow: {result['ratio_no_op_to_flow']}; target <= {TARGET_S} s: "
        f"{'met' if result['target_met'] else 'NOT met'}\nwrote {RESULTS}"
    )


if __name__ == "__main__":
    main()
