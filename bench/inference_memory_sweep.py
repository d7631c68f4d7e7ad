"""llama.cpp's GPU memory at several n_gpu_layers and contexts, measured, against verify's prediction.

    python bench/inference_memory_sweep.py --shape qwen2-7b --layers 8 --tokenizer <qwen tokenizer dir> \
        --out bench/results/verify_gpu_partial_offload.json

A random-weight model in a real shape (examples/models/<shape>/config.json, fewer blocks with
--layers: every block has the same size, so a few stand for many) is converted to F16 and quantized
to Q4_K_M with llama.cpp. Each row loads it in a fresh process under CUDA llama.cpp (llama_cpp
imported first, as verify's child does), evaluates 600 tokens with every position's logits, and
reads the process's GPU memory through NVML; loraship.planning.inference_memory.predict_gpu predicts the
same from the GGUF. llama.cpp's own buffer sizes are kept per row. Needs a CUDA build of
llama-cpp-python and LORASHIP_LLAMA_CPP_DIR (the converter); see bench/verify_gpu.py for the kit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

LOAD_AND_MEASURE = r"""
import json, sys, time
from llama_cpp import Llama
path, n_gpu_layers, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, logits_all=True, verbose=True, seed=0)
tokens = llm.tokenize(("The quick brown fox jumps over the lazy dog. " * 80).encode())[:600]
started = time.perf_counter()
llm.eval(tokens)
seconds = time.perf_counter() - started
from loraship.planning.inference_memory import gpu_used_by_this_process_gib
print("RESULT " + json.dumps({"measured_gib": gpu_used_by_this_process_gib(), "eval_tokens": len(tokens),
                              "prompt_tokens_per_s": round(len(tokens) / seconds, 1)}), flush=True)
"""


def build_gguf(args) -> Path:
    from verify_gpu import build_random_model

    from loraship.llamacpp.quantizing import quantize

    base, f16, q4 = args.work / "base", args.work / "model-F16.gguf", args.work / "model-Q4_K_M.gguf"
    if q4.is_file():
        return q4
    build_random_model(args.shape, args.tokenizer, base, args.layers)
    converter = Path(os.environ["LORASHIP_LLAMA_CPP_DIR"]) / "convert_hf_to_gguf.py"
    subprocess.run(
        [sys.executable, str(converter), str(base), "--outfile", str(f16), "--outtype", "f16"],
        check=True,
        capture_output=True,
    )
    quantize(f16, q4, "Q4_K_M")  # the quantize stage's own llama_model_quantize run
    return q4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2-7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/memory-sweep"))
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/verify_gpu_partial_offload.json")
    args = parser.parse_args()
    from loraship.planning import inference_memory as im
    from verify_gpu import llama_buffers

    args.work.mkdir(parents=True, exist_ok=True)
    gguf = build_gguf(args)
    layout = im.read_layout(gguf)
    every = im.all_layers(layout)
    cases = [
        (every, 4096),
        (every - 1, 4096),
        (every // 2, 4096),
        (2, 4096),
        (1, 4096),
        (every // 2, 8192),
        (every, 1024),
        (every, 16384),
    ]
    result = {
        "model": f"{args.shape} ({layout.n_layers} blocks, random weights)",
        "quant": "Q4_K_M",
        "n_gpu_layers_meaning": "llama.cpp's: the output layer, then the last n - 1 blocks",
        "all_layers": every,
        "rows": [],
    }
    for n_gpu_layers, n_ctx in cases:
        done = subprocess.run(
            [sys.executable, "-c", LOAD_AND_MEASURE, str(gguf), str(n_gpu_layers), str(n_ctx)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )
        log = done.stdout + done.stderr
        measured = next((json.loads(line[7:]) for line in log.splitlines() if line.startswith("RESULT ")), {})
        predicted = im.predict_gpu(layout, n_ctx, n_gpu_layers)
        row = {
            "n_gpu_layers": n_gpu_layers,
            "n_ctx": n_ctx,
            "returncode": done.returncode,
            **measured,
            "predicted_gib": predicted["total_gib"],
            "predicted_components": predicted,
            "llama_cpp_buffers": llama_buffers(log),
        }
        if measured.get("measured_gib"):
            row["prediction_error"] = round(predicted["total_gib"] / measured["measured_gib"] - 1, 4)
        result["rows"].append(row)
        errors = [abs(r["prediction_error"]) for r in result["rows"] if "prediction_error" in r]
        result["worst_abs_error"] = max(errors) if errors else None
        result["rows_measured"] = len(errors)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(
            n_gpu_layers,
            n_ctx,
            done.returncode,
            measured,
            predicted["total_gib"],
            row.get("prediction_error"),
            flush=True,
        )


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"{time.perf_counter() - started:.0f} s")
