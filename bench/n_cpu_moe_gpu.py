"""n_cpu_moe on a GPU: verify's prediction of a mixture of experts' GPU memory with the experts of the first N blocks
in CPU memory (loraship/planning/inference_memory.py predict_gpu) against what the CUDA llama.cpp process holds, and
generation speed at each N.

    python bench/n_cpu_moe_gpu.py model --out /tmp/nc          # random Qwen3-MoE in a real width, F16 GGUF
    python bench/n_cpu_moe_gpu.py quantize --out /tmp/nc       # Q4_K_M through llama-cpp-python's binding
    python bench/n_cpu_moe_gpu.py measure --out /tmp/nc --n-cpu-moe 0 2 4 6 --result result.json

The model: Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, 8 routed, 32 heads, 4 KV heads) with 6 of its 48
layers and the real Qwen3 tokenizer (--tokenizer: a folder with its files); random weights load and run as real ones
do. Each N is loaded in a fresh process (loraship/llamacpp/cpu_moe.py sets the overrides, as verify's measuring child
does), a 512-token prompt is evaluated (the batch that makes llama.cpp copy CPU-held experts to the GPU) and 64 tokens
generated greedily; the GPU memory is the device's used memory (nvidia-smi) less the idle reading before the load.
bench/n_cpu_moe_call.sh runs it on the lent GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYERS = int(os.environ.get("NC_LAYERS", 6))  # NC_LAYERS, NC_EXPERTS, NC_DEVICE: a small local trial
N_CTX = 4096

_CHILD = (
    """
import json, sys, time
from llama_cpp import Llama
from loraship.llamacpp.cpu_moe import keep_experts_in_cpu_memory
gguf, n_cpu_moe, idle = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
keep_experts_in_cpu_memory(n_cpu_moe)
llm = Llama(model_path=gguf, n_ctx=%d, n_gpu_layers=-1, verbose=True, seed=0)
prompt = [(i * 7919) %% 150000 + 10 for i in range(512)]
t0 = time.perf_counter(); llm.eval(prompt); prompt_s = time.perf_counter() - t0
t0 = time.perf_counter(); n = 0
for tok in llm.generate(prompt[:8], temp=0.0, reset=True):
    n += 1
    if n == 64:
        break
gen_s = time.perf_counter() - t0
import subprocess
used = float(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True).stdout.split()[0])
print(json.dumps({"n_cpu_moe": n_cpu_moe, "gpu_used_mib": used - idle, "prompt_tokens_per_s": 512 / prompt_s,
                  "gen_tokens_per_s": 64 / gen_s}), flush=True)
"""
    % N_CTX
)


def gpu_used_mib() -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    return float(out.stdout.split()[0])


def make_model(out: Path, tokenizer: Path, converter: Path) -> None:
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = out / "model"
    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        if f.name != "config.json":
            shutil.copy(f, folder / f.name)
    config = AutoConfig.from_pretrained(tokenizer)
    qwen3_30b_a3b = json.loads((REPO / "examples/models/qwen3-30b-a3b/config.json").read_text())
    for key in ("hidden_size", "moe_intermediate_size", "intermediate_size", "num_attention_heads", "head_dim"):
        setattr(config, key, qwen3_30b_a3b[key])
    config.num_key_value_heads, config.num_hidden_layers = qwen3_30b_a3b["num_key_value_heads"], LAYERS
    config.num_experts = int(os.environ.get("NC_EXPERTS", qwen3_30b_a3b["num_experts"]))
    config.num_experts_per_tok = qwen3_30b_a3b["num_experts_per_tok"]
    torch.manual_seed(0)
    with torch.device(os.environ.get("NC_DEVICE", "cuda")):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    subprocess.run(
        [
            sys.executable,
            str(converter / "convert_hf_to_gguf.py"),
            str(folder),
            "--outtype",
            "f16",
            "--outfile",
            str(out / "model-F16.gguf"),
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": f"{converter / 'gguf-py'}"},
    )
    shutil.rmtree(folder)  # the safetensors: room on the disk for the Q4_K_M


def quantize(out: Path) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = int(os.environ.get("NC_THREADS", 16))
    started = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(
        str(out / "model-F16.gguf").encode(), str(out / "model-Q4_K_M.gguf").encode(), params
    )
    print(f"quantized rc={rc} in {time.perf_counter() - started:.0f} s", flush=True)


def measure(out: Path, counts: list[int], result: Path) -> None:
    from loraship.planning import inference_memory as im

    gguf = out / "model-Q4_K_M.gguf"
    layout = im.read_layout(gguf)
    rows = []
    for k in counts:
        idle = gpu_used_mib()
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(gguf), str(k), str(idle)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"},
        )
        line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
        buffers = {
            name: float(mib)
            for name, mib in re.findall(r"(\S+ (?:model|KV|compute) buffer) size =\s*([\d.]+) MiB", done.stderr)
        }
        overridden = len(re.findall(r"buffer type overridden", done.stderr))
        predicted = im.predict_gpu(layout, N_CTX, None, k)
        row = {
            **(json.loads(line) if line else {"error": done.stderr[-1500:]}),
            "predicted": predicted,
            "llama_cpp_buffers_mib": buffers,
            "tensors_overridden": overridden,
        }
        if line:
            row["measured_gib"] = round(row["gpu_used_mib"] / 1024, 3)
            row["predicted_minus_measured_gib"] = round(predicted["total_gib"] - row["measured_gib"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    experts = layout.expert_bytes
    result.write_text(
        json.dumps(
            {
                "what": "n_cpu_moe on a GPU: predicted (inference_memory.predict_gpu) vs measured, and speed",
                "model": f"random Qwen3-MoE, Qwen3-30B-A3B's layer, {LAYERS} layers, Q4_K_M, n_ctx {N_CTX}",
                "gguf_gib": round(gguf.stat().st_size / 2**30, 3),
                "expert_gib_per_layer": round(max(experts) / 2**30, 3),
                "rows": rows,
            },
            indent=1,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["model", "quantize", "measure"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--converter", type=Path)
    ap.add_argument("--n-cpu-moe", type=int, nargs="*", default=[0, 2, 4, 6])
    ap.add_argument("--result", type=Path)
    a = ap.parse_args()
    if a.phase == "model":
        make_model(a.out, a.tokenizer, a.converter)
    elif a.phase == "quantize":
        quantize(a.out)
    else:
        measure(a.out, a.n_cpu_moe, a.result)


if __name__ == "__main__":
    main()
