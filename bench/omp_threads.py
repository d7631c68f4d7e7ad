"""Torch threads per pytest-xdist worker on this machine: the same CPU training loop (a 4-layer Llama, 32k vocabulary,
16 x 96 tokens, 25 AdamW steps) run two at once with OMP_NUM_THREADS=2 and =1, and alone with 2. Writes
bench/results/omp_threads.json; the Makefile's test target reads the answer (one thread per worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

LOOP = """
import time, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=32000)
m = AutoModelForCausalLM.from_config(cfg)
opt = torch.optim.AdamW(m.parameters(), 1e-4)
x = torch.randint(0, 32000, (16, 96))
t = time.time()
for _ in range(25):
    m(input_ids=x, labels=x).loss.backward(); opt.step(); opt.zero_grad()
print(round(time.time() - t, 2))
"""


def run(copies: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", LOOP], env=env, stdout=subprocess.PIPE, text=True)]
    procs += [
        subprocess.Popen([sys.executable, "-c", LOOP], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(copies - 1)
    ]
    loops = [float(p.communicate()[0]) for p in procs]
    return {"copies": copies, "omp_threads": threads, "loop_s": loops, "wall_s": round(time.monotonic() - start, 1)}


def main() -> None:
    rows = [run(2, 2), run(2, 1), run(1, 2)]
    two_loops_serial = rows[2]["loop_s"][0] * 2
    result = {
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "cpus": os.cpu_count(),
        "runs": rows,
        "two_loops_s": {
            "two_workers_2_threads": max(rows[0]["loop_s"]),
            "two_workers_1_thread": max(rows[1]["loop_s"]),
            "one_process_2_threads_twice": round(two_loops_serial, 2),
        },
    }
    out = Path(__file__).parent / "results" / "omp_threads.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["two_loops_s"]))


if __name__ == "__main__":
    main()
