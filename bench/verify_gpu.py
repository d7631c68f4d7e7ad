"""Verify on the GPU: a real-shaped Qwen2 through loraship's own stages, GGUF-only verify under CUDA llama.cpp.

    python bench/verify_gpu.py --shape qwen2-7b --target-gib 8 --out bench/results/verify_gpu.json

Random weights in the real shapes (examples/models/<shape>/config.json) measure memory and speed
exactly as real weights would; the tokenizer is Qwen's real BPE vocabulary (loraship/fixtures/tinyqwen.py's
files, passed with --tokenizer). The stages are the product's: plan -> train (3 steps at a high learning rate, so that
an adapter exists) -> merge -> reference -> convert -> quantize -> verify, each timed. verify loads
only the Q4_K_M GGUF, every layer on the GPU at n_ctx --n-ctx, and measures its own GPU memory
through NVML. Quality gates mean nothing on random weights; the row keeps their verdicts anyway.
llama.cpp's own buffer sizes (model, KV, compute) are read from verify's verbose log
(LORASHIP_LLAMA_VERBOSE=1), kept beside the results, to see where a prediction error comes from.

On a bare GPU machine with torch and transformers but no registry, carry in one ignored folder:
wheels for pydantic, pydantic-core (cp312), annotated-types, typing-inspection, diskcache and
gguf; the llama-cpp-python sdist (pinned version, .git and vendor/llama.cpp/{docs,benches,models
*.gguf} removed: 11 MB) or the CUDA build from an earlier call (dedupe llama_cpp/lib's three
copies of each .so: 44 MB); the tiny Qwen tokenizer files (loraship.fixtures.tinyqwen.write_tokenizer);
the converter folder of `loraship fetch-converter`. Build with the machine's python3:
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" pip install --no-build-isolation
--no-deps --target /tmp/llama <sdist folder> (308 s on an H200's 16 cores), beside the chain:
LORASHIP_BENCH_WAIT_FOR=<a file touched when the build ends> holds quantize and verify back.
For a 14B (about 100 GB of files in the chain) on a 64 GiB disk: --base-dir /dev/shm --prune.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_random_model(
    shape: str,
    tokenizer_dir: Path,
    out: Path,
    layers: int | None = None,
    device: str = "cuda",
    overrides: dict | None = None,
) -> None:
    """overrides: config.json fields to change (a CPU dry run shrinks the widths; the vocabulary must stay Qwen's)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(REPO / "examples" / "models" / shape)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):  # transformers checks one entry per block
            config.layer_types = config.layer_types[:layers]
    config.bos_token_id, config.eos_token_id = 151643, 151645
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="5GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643})
    )


def chain_config(
    run_name: str,
    base: Path,
    root: Path,
    target_gib: float,
    n_ctx: int,
    quantization,
    device: str = "cuda",
    max_steps: int = 3,
) -> dict:
    """The run's config: the demo's chat data, a few LoRA steps at a high learning rate (so that an adapter
    exists), the target GPU and context verify measures against."""
    return {
        "run_name": run_name,
        "base_model": str(base),
        "workdir": str(root / "work"),
        "output": str(root / "artifacts"),
        "device": device,
        "datasets": [{"path": str(REPO / "data/demo/train.jsonl"), "type": "chat"}],
        "eval_datasets": [{"path": str(REPO / "data/demo/eval.jsonl"), "type": "chat"}],
        "golden_prompts": str(REPO / "data/demo/golden.jsonl"),
        "lora_r": 16,
        "lora_target_modules": ["q_proj", "v_proj"],
        "sequence_len": 256,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": max_steps,
        "learning_rate": 5e-3,
        "save_steps": 100,
        "max_new_tokens": 32,
        "target_gpu_memory_gib": target_gib,
        "target_context": n_ctx,
        "quantization": quantization,
        # The device kit builds no llama.cpp tools; an importance matrix changes neither a GGUF's size nor its memory
        # (its quality effect is measured on real weights: bench/results/quant_ladder_2k.json).
        "imatrix": False,
    }


def llama_buffers(log: str) -> dict:
    """llama.cpp's own report of its GPU buffers (MiB), from verify's verbose load."""
    found = {}
    for what, pattern in (
        ("model", r"CUDA0 model buffer size\s*=\s*([\d.]+) MiB"),
        ("kv", r"CUDA0 KV buffer size\s*=\s*([\d.]+) MiB"),
        ("compute", r"CUDA0 compute buffer size\s*=\s*([\d.]+) MiB"),
        ("host_compute", r"CUDA_Host compute buffer size\s*=\s*([\d.]+) MiB"),
    ):
        values = [float(v) for v in re.findall(pattern, log)]
        found[f"{what}_mib"] = sum(values) if values else None
    return found


def peer_kl_divergence(perplexity_bin: Path, f16: Path, quantized: Path, text: Path, work: Path) -> dict:
    """llama.cpp's own `llama-perplexity --kl-divergence` (the F16 GGUF as base, the quantized one
    scored against it), every layer on the GPU: the figures verify's statistics are named after.
    Its positions are not verify's (it scores the second half of each chunk of one text), so the
    two agree in magnitude, not to the digit."""
    logits = work / "peer-f16-logits.bin"
    common = ["-f", str(text), "-c", "512", "-ngl", "999", "-b", "512"]
    found: dict = {}
    for what, model, extra in (
        ("base_seconds", f16, ["--kl-divergence-base", str(logits)]),
        ("kl_seconds", quantized, ["--kl-divergence-base", str(logits), "--kl-divergence"]),
    ):
        started = time.perf_counter()
        done = subprocess.run([str(perplexity_bin), "-m", str(model), *common, *extra], capture_output=True, text=True)
        found[what] = round(time.perf_counter() - started, 2)
        if done.returncode != 0:
            found["error"] = (done.stdout + done.stderr)[-2000:]
            return found
    out = done.stdout + done.stderr
    for key, pattern in (
        ("ppl_ratio", r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([\d.]+)"),
        ("kl_mean", r"Mean\s+KLD:\s*([-\d.]+)"),
        ("kl_p99", r"99\.0%\s+KLD:\s*([-\d.]+)"),
        ("same_top_percent", r"Same top p:\s*([\d.]+)"),
    ):
        match = re.search(pattern, out)
        found[key] = float(match.group(1)) if match else None
    chunks = re.search(r"computing over (\d+) chunks", out)
    found["chunks_of_512"] = int(chunks.group(1)) if chunks else None
    logits.unlink(missing_ok=True)
    return found


def peer_text(path: Path) -> None:
    """The demo's chat rows as plain text, repeated to a few 512-token chunks for llama-perplexity."""
    rows = [
        json.loads(line)
        for name in ("train.jsonl", "eval.jsonl")
        for line in (REPO / "data/demo" / name).read_text().splitlines()
        if line.strip()
    ]
    text = "\n".join(f"{m['role']}: {m['content']}" for row in rows for m in row["messages"])
    path.write_text((text + "\n") * 3)


def prune(config, stage: str, base: Path) -> None:
    """Delete what no later stage reads once `stage` has finished (the manifests stay)."""
    from loraship.constants import F16_GGUF, MERGED_DIR
    from loraship.runtime.stage import stage_dir

    if stage == "merge":
        shutil.rmtree(base, ignore_errors=True)
    elif stage == "convert":
        for weights in (stage_dir(config, "merge") / MERGED_DIR).glob("*.safetensors"):
            weights.unlink()
    elif stage == "quantize":
        (stage_dir(config, "convert") / F16_GGUF).unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-7b")
    parser.add_argument("--target-gib", type=float, default=8.0)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--root", type=Path, default=Path("/tmp/verify-bench"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--base-dir",
        type=Path,
        help="where the random base model is saved (default ROOT/base; /dev/shm keeps a 14B's 30 GB off a small disk)",
    )
    parser.add_argument(
        "--peer-perplexity",
        type=Path,
        help="llama.cpp's llama-perplexity binary: run its --kl-divergence on the same GGUFs after verify",
    )
    parser.add_argument(
        "--also-target-gib",
        type=float,
        help="run verify again for a smaller target GPU: the layers and context that fit, predicted and measured",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="keep only this many decoder layers of the shape (every width and the vocabulary stay): "
        "the whole chain in a few minutes, when a device call cannot hold the full model's",
    )
    parser.add_argument(
        "--prune",
        action="store_true",
        help="delete each large file once no later stage reads it (base after merge, merged "
        "weights after convert, F16 GGUF after quantize): a 14B chain holds about 100 GB "
        "otherwise, more than the lent machine's 64 GiB disk",
    )
    args = parser.parse_args()

    from loraship.config import parse_config
    from loraship.constants import REFERENCE_FILE, STAGES
    import yaml

    from loraship.runtime.stage import stage_dir

    row: dict = {
        "model": args.shape + (f" ({args.layers} layers)" if args.layers else ""),
        "quant": "Q4_K_M",
        "n_ctx": args.n_ctx,
        "target_gpu_gib": args.target_gib,
        "stage_seconds": {},
    }

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=2))

    base = args.base_dir or args.root / "base"
    started = time.perf_counter()
    if not (base / "config.json").is_file():  # a rerun on the same machine resumes the chain
        build_random_model(args.shape, args.tokenizer, base, args.layers)
    row["build_seconds"] = round(time.perf_counter() - started, 1)
    save()
    config = parse_config(chain_config(args.shape, base, args.root, args.target_gib, args.n_ctx, "Q4_K_M"))
    # Each stage in its own process, as in its container: torch's CUDA libraries and llama.cpp's in
    # one process crashed verify here (a segfault at load).
    args.root.mkdir(parents=True, exist_ok=True)  # --base-dir elsewhere leaves it uncreated
    config_file = args.root / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    # verify loads llama.cpp verbosely (its buffer sizes are parsed below) under faulthandler; its whole
    # log is kept beside the results, since a native crash says nothing in a traceback.
    log_file = args.out.with_suffix(".verify.log")
    for stage in STAGES[:-1]:
        wait_for = os.environ.get("LORASHIP_BENCH_WAIT_FOR")
        if stage in ("quantize", "verify") and wait_for:
            # llama-cpp-python's CUDA build running beside the chain in the same device call
            started = time.perf_counter()
            while not Path(wait_for).exists() and time.perf_counter() - started < 900:
                time.sleep(2)
            row.setdefault("waited_for_llama_build_s", round(time.perf_counter() - started, 1))
        started = time.perf_counter()
        env = dict(os.environ, LORASHIP_LLAMA_VERBOSE="1") if stage == "verify" else None
        done = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-m", f"loraship.stages.{stage}", str(config_file)],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
        )
        row["stage_seconds"][stage] = round(time.perf_counter() - started, 1)
        if stage == "verify":
            log_file.write_text(done.stdout + done.stderr)
            if done.returncode > 0 and "verify failed" in done.stderr:
                # Quality gates fail on random weights; the figures are all in verify.json.
                row["verify_gates_failed_on_random_weights"] = True
                save()
                continue
        if done.returncode != 0:
            row[f"{stage}_error"] = {"returncode": done.returncode, "tail": (done.stderr + done.stdout)[-3000:]}
            save()
            raise SystemExit(f"{stage} failed (rc {done.returncode}): {row[f'{stage}_error']['tail']}")
        row.setdefault("disk_free_gib", {})[stage] = round(shutil.disk_usage(args.root).free / 2**30, 1)
        if args.prune and not (stage == "quantize" and args.peer_perplexity):
            prune(config, stage, base)
        save()
    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    memory = verify["gpu_memory"]
    row.update(
        predicted_gpu_gib=memory["predicted_gib"],
        measured_gpu_gib=memory["measured_gib"],
        fits=verify["gates"]["fits_target_gpu"]["passed"],
        prediction_error=(
            round(memory["predicted_gib"] / memory["measured_gib"] - 1, 4) if memory["measured_gib"] else None
        ),
        prompt_tokens_per_s=verify["prompt_tokens_per_s"],
        gen_tokens_per_s=verify["gen_tokens_per_s"],
        verify_seconds=verify["verify_seconds"],
        gguf_gib=round(verify["gguf_bytes"] / 2**30, 3),
        predicted_components=verify["memory"]["predicted"],
        gates={k: g["passed"] for k, g in verify["gates"].items()},
        eval_agreement=verify["eval_agreement"],
        device=verify["device"],
        n_gpu_layers=verify["n_gpu_layers"],
        reference_top_k_mass=json.loads((stage_dir(config, "reference") / REFERENCE_FILE).read_text())[
            "top_k_mass_mean"
        ],
    )
    save()
    row["llama_cpp_buffers"] = llama_buffers(log_file.read_text())
    save()
    if args.peer_perplexity:
        from loraship.constants import F16_GGUF
        from loraship.constants import quantized_gguf_name

        text = args.root / "peer.txt"
        peer_text(text)
        peer = peer_kl_divergence(
            args.peer_perplexity,
            stage_dir(config, "convert") / F16_GGUF,
            stage_dir(config, "quantize") / quantized_gguf_name("Q4_K_M"),
            text,
            args.root,
        )
        row["peer_llama_perplexity"] = peer
        row["kl_mean_ratio_to_peer"] = (
            round(verify["eval_agreement"]["kl_mean"] / peer["kl_mean"], 3) if peer.get("kl_mean") else None
        )
        if args.prune:
            (stage_dir(config, "convert") / F16_GGUF).unlink(missing_ok=True)
        save()
    if args.also_target_gib:
        smaller = config.model_copy(update={"target_gpu_memory_gib": args.also_target_gib})
        config_file.write_text(yaml.safe_dump(smaller.model_dump(mode="json")))
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-m", "loraship.stages.verify", str(config_file)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        again = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
        row["smaller_target"] = {
            "target_gpu_gib": args.also_target_gib,
            "returncode": done.returncode,
            "seconds": round(time.perf_counter() - started, 1),
            "memory_plan": again["memory"],
            "n_gpu_layers": again["n_gpu_layers"],
            "predicted_gpu_gib": again["gpu_memory"]["predicted_gib"],
            "measured_gpu_gib": again["gpu_memory"]["measured_gib"],
            "prompt_tokens_per_s": again["prompt_tokens_per_s"],
            "gen_tokens_per_s": again["gen_tokens_per_s"],
            "tail": (done.stderr + done.stdout)[-1500:] if done.returncode not in (0, 1) else None,
        }
    try:
        import torch

        row["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the name is a label only
        pass
    save()
    print(
        json.dumps(
            {
                k: row[k]
                for k in (
                    "model",
                    "predicted_gpu_gib",
                    "measured_gpu_gib",
                    "fits",
                    "prompt_tokens_per_s",
                    "gen_tokens_per_s",
                    "verify_seconds",
                )
                if k in row
            }
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
