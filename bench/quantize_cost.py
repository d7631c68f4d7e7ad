"""What each rung of quantization auto's ladder costs llama.cpp's quantizer, relative to Q4_K_M, on the CPU.

    python bench/quantize_cost.py --out bench/results/quantize_cost.json

A GGUF with a real shape's metadata (examples/models/<shape>/config.json: the architecture, widths, heads and
block count llama.cpp picks each tensor's type from) whose every tensor keeps its row length but has 1/--scale of
its rows: llama_model_quantize (llama-cpp-python's binding, as the quantize stage calls it without an importance
matrix) chooses the same type per tensor as for the real model and does 1/--scale of the work. Timed per rung at
--threads threads. bench/quant_ladder_gpu.py orders its rungs by these ratios and scales them from the quantize
time it measures, to decide which rungs still fit a device call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def write_scaled_gguf(shape: str, scale: int, path: Path) -> int:
    """A Qwen2-architecture F16 GGUF with the shape's metadata and tensors of 1/scale of its rows; its weight count."""
    import gguf
    import numpy as np

    cfg = json.loads((REPO / "examples" / "models" / shape / "config.json").read_text())
    if cfg["model_type"] != "qwen2":
        raise SystemExit(f"{shape}: only the qwen2 tensor layout is written here")
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    kv = kv_heads * h // heads
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(cfg.get("max_position_embeddings", 32768))
    writer.add_embedding_length(h)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(f)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(cfg.get("rope_theta", 1e6))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(0)
    weights = 0

    def matrix(rows: int, cols: int):
        nonlocal weights
        data = (rng.standard_normal((max(rows // scale, 1), cols), dtype=np.float32) * 0.02).astype(np.float16)
        weights += data.size
        return data

    def vector(n: int, value: float = 0.0):
        return np.full(n, value, dtype=np.float32)

    writer.add_tensor("token_embd.weight", matrix(vocab, h))
    for i in range(layers):
        block = f"blk.{i}."
        writer.add_tensor(block + "attn_norm.weight", vector(h, 1.0))
        for name, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(block + name + ".weight", matrix(rows, h))
            writer.add_tensor(block + name + ".bias", vector(rows))
        writer.add_tensor(block + "attn_output.weight", matrix(h, h))
        writer.add_tensor(block + "ffn_norm.weight", vector(h, 1.0))
        writer.add_tensor(block + "ffn_gate.weight", matrix(f, h))
        writer.add_tensor(block + "ffn_up.weight", matrix(f, h))
        writer.add_tensor(block + "ffn_down.weight", matrix(h, f))
    writer.add_tensor("output_norm.weight", vector(h, 1.0))
    if not cfg.get("tie_word_embeddings"):
        writer.add_tensor("output.weight", matrix(vocab, h))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def quantize_seconds(src: Path, dst: Path, quantization: str, threads: int) -> float:
    import llama_cpp

    from loraship.constants import GGUF_FILE_TYPES

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = GGUF_FILE_TYPES[quantization]
    params.nthread = threads
    started = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize to {quantization} failed (rc {rc})")
    return time.perf_counter() - started


def main() -> None:
    from loraship.constants import AUTO_LADDER

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-7b")
    parser.add_argument("--scale", type=int, default=64, help="keep 1/SCALE of every tensor's rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quants", nargs="+", default=list(AUTO_LADDER))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="quantize-cost-") as tmp:
        src = Path(tmp) / "scaled-F16.gguf"
        weights = write_scaled_gguf(args.shape, args.scale, src)
        rungs = {}
        for quantization in args.quants:
            dst = Path(tmp) / f"scaled-{quantization}.gguf"
            seconds = quantize_seconds(src, dst, quantization, args.threads)
            rungs[quantization] = {"seconds": round(seconds, 2), "bytes": dst.stat().st_size}
            dst.unlink()
            print(f"{quantization:7s} {seconds:6.2f} s", flush=True)
    anchor = rungs.get("Q4_K_M", {}).get("seconds")
    for row in rungs.values():
        row["vs_Q4_K_M"] = round(row["seconds"] / anchor, 3) if anchor else None
    import llama_cpp

    result = {
        "what": "bench/quantize_cost.py: llama_model_quantize (no importance matrix) per rung on a GGUF with "
        f"{args.shape}'s metadata and 1/{args.scale} of every tensor's rows ({weights:,} weights, the same "
        "type per tensor as the real model), one process, rungs one after another",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_at_end": list(os.getloadavg()),
        },
        "llama_cpp_python": llama_cpp.__version__,
        "rungs": rungs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({q: r["vs_Q4_K_M"] for q, r in rungs.items()}))


if __name__ == "__main__":
    main()
