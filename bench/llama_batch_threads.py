"""llama.cpp's prompt scoring with n_threads_batch left to llama-cpp-python (every core of the host) against one
thread, alone and beside a busy core: what loraship/verification/measure_child.py and loraship/llamacpp/served.py
cap. `python bench/llama_batch_threads.py MODEL.gguf` writes bench/results/llama_batch_threads.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCORE = """
import sys, time
from llama_cpp import Llama
kw = dict(model_path=sys.argv[1], n_ctx=512, n_gpu_layers=0, logits_all=True, n_threads=1, verbose=False)
if sys.argv[2] != "default":
    kw["n_threads_batch"] = int(sys.argv[2])
llm = Llama(**kw)
tokens = llm.tokenize(b"The capital of the kingdom of Ardania is a city on the river. " * 20)[:400]
t = time.time(); llm.reset(); llm.eval(tokens)
print(llm.context_params.n_threads_batch, round(len(tokens) / (time.time() - t), 1))
"""


def score(gguf: str, batch: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", SCORE, gguf, batch]
    threads, rate = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()
    return {"n_threads_batch": int(threads), "set": batch, "prompt_tokens_per_s": float(rate)}


def main() -> None:
    gguf = sys.argv[1]
    rows = [dict(score(gguf, b), beside="nothing") for b in ("default", "1")]
    busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    try:
        rows += [dict(score(gguf, b), beside="a busy core (yes)") for b in ("default", "1", "default", "1")]
    finally:
        busy.kill()
    result = {"gguf": Path(gguf).name, "cpus": os.cpu_count(), "n_threads": 1, "prompt_tokens": 400, "rows": rows}
    out = Path(__file__).parent / "results" / "llama_batch_threads.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
