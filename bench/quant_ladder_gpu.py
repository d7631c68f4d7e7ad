"""The quantization ladder on the GPU: each rung's GGUF size and GPU memory for a real-shaped model against the
plan's predictions and the target GPU, with its prompt and generation speed (random weights: memory and speed only).

    python bench/quant_ladder_gpu.py --out bench/results/quant_ladder_gpu.json      # on the lent H200 (the kit's
                                                                                    # chain.sh runs it: LADDER=only)
    python bench/quant_ladder_gpu.py --device cpu --tiny --out /tmp/ladder.json     # a CPU dry run of the same chain

A random-weight Qwen2-7B (examples/models/qwen2-7b with Qwen's real vocabulary: bench/verify_gpu.py
build_random_model; the tokenizer from loraship.fixtures.tinyqwen unless --tokenizer) goes through loraship's own
stages, each `python -m loraship.stages.<stage> CONFIG` in its own process (bench/verify_served_gpu.py run_stage):
plan with quantization: auto (loraship/constants.py AUTO_LADDER: IQ3_M, Q3_K_M, IQ4_XS, Q4_K_M, Q5_K_M, Q6_K, Q8_0)
at --target-gib / --n-ctx, train (2 LoRA steps), merge, convert; then, rung by rung, the quantize stage with that rung
alone (the same config but its `quantization`), and the rung's GGUF loaded the way verify loads it:
loraship/verification/measure_child.py measure_apart in a fresh process, every layer on the GPU at n_ctx =
target_context, llama-cpp-python's defaults otherwise (flash attention off), its GPU memory read through NVML in that
process (inference_memory.gpu_used_by_this_process_gib, as verify's measure() does), after a 512-token prompt is timed
(logits at its last position only, as llama-server computes a prompt) and 128 tokens of verify's greedy() generation.
verify's own GGUF-based prediction (loraship/verification/device.py memory_plan) stands beside the plan's (plan.json
inference.by_quantization). The reference and verify stages are left out: their quality gates mean nothing on random
weights.

One quantize call per rung rather than one for the ladder: the stage wants 0.6 x the F16 GGUF free per rung before it
starts (60 GiB for the seven rungs of a 7B), more than the lent machine's disk holds beside the F16 GGUF; each call
clears the last rung's GGUF, measured by then, so one rung at a time is on disk. The base model goes once merged,
the merged weights once converted, the F16 GGUF after the last rung (bench/verify_gpu.py prune; --keep keeps them).

Rungs run in the order given: by default Q4_K_M first (bench/results/verify_gpu.json measured it), then the rungs
either side of the default 6 GiB target at 4096 tokens (Q5_K_M, Q6_K), Q8_0, Q3_K_M, and the importance quants last:
they cost llama.cpp's quantizer 3x (IQ4_XS) and 5x (IQ3_M) Q4_K_M's time (bench/results/quantize_cost.json). With
--deadline-s a rung starts only if it is expected to end in time (expected_quantize_seconds); those that would not
are listed as skipped, with the plan's figures only. The JSON is rewritten after every step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

GIB = 2**30
DEFAULT_ORDER = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M", "IQ4_XS", "IQ3_M")
# llama_model_quantize's time per rung relative to Q4_K_M on a Qwen2-7B-shaped GGUF
# (bench/results/quantize_cost.json, one thread; two threads scale the same).
QUANTIZE_COST = {
    "IQ3_M": 4.88,
    "Q3_K_M": 0.57,
    "IQ4_XS": 3.0,
    "Q4_K_M": 1.0,
    "Q5_K_M": 0.86,
    "Q6_K": 0.51,
    "Q8_0": 0.09,
}
MEASURE_ALLOWANCE_S = 30  # a 7B rung's load, prompt, generation and NVML read, with room
PROMPT_REPEATS = 3
GEN_PROMPT_TOKENS = 32
# A CPU dry run's shape: widths that are multiples of 256 (llama.cpp's K- and I-quants stay exact), Qwen's vocabulary.
TINY = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2}
# The random model is built in a child: this process then holds no CUDA context of its own, which NVML's
# device-wide figure (verify's stand-in where it cannot list the measuring process) would count.
_BUILD_MODEL = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from verify_gpu import build_random_model
a = json.loads(sys.argv[2])
build_random_model(a["shape"], Path(a["tokenizer"]), Path(a["out"]), a["layers"], a["device"], a["overrides"])
"""


# -- in verify's child, after measure_apart loaded the GGUF ---------------------------------------
def speed_and_memory(job: dict, llm, load_seconds: float) -> dict:
    """verify's child entry for one rung: a prompt's processing and greedy generation timed, then this
    process's GPU memory as verify's measure() reads it."""
    import statistics

    import llama_cpp

    from loraship.planning import inference_memory as im
    from loraship.verification.llama_ops import greedy

    ids = llm.tokenize(job["prompt_text"].encode("utf-8"), add_bos=False, special=False)
    ids = (ids * (job["prompt_tokens"] // len(ids) + 1))[: job["prompt_tokens"]]
    # llama-server computes a prompt's logits at its last position only; the Llama verify loads keeps every
    # position's (logits_all), and copying prompt_tokens x vocab floats would be what is timed.
    llm._logits_all = False
    try:
        seconds = []
        for _ in range(1 + PROMPT_REPEATS):  # the first run warms llama.cpp's kernels up and is not counted
            llm.reset()
            started = time.perf_counter()
            llm.eval(ids)
            llama_cpp.llama_synchronize(llm._ctx.ctx)
            seconds.append(time.perf_counter() - started)
    finally:
        llm._logits_all = True
    answer, _, gen_seconds = greedy(llm, ids[:GEN_PROMPT_TOKENS], job["gen_tokens"], stops=set())
    cuda = job["device"] == "cuda"
    out = {
        "load_seconds": round(load_seconds, 2),
        "prompt_tokens": len(ids),
        "prompt_seconds": [round(s, 4) for s in seconds[1:]],
        "prompt_tokens_per_s": round(len(ids) / statistics.median(seconds[1:]), 1),
        "gen_tokens": len(answer),
        "gen_tokens_per_s": round(len(answer) / gen_seconds, 1),
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "gpu_used_gib": im.gpu_used_by_this_process_gib() if cuda else None,
    }
    handle = im._nvml_handle() if cuda else None
    if handle is not None:  # which figure verify's reading was: this process's own, or the device's
        import pynvml

        out["nvml_lists_this_process"] = any(
            p.pid == os.getpid() for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        )
        out["nvml_device_used_gib"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / GIB
    return out


# -- rows ------------------------------------------------------------------------------------------
def expected_quantize_seconds(quantization: str, done: dict[str, float]) -> float | None:
    """A rung's quantize-stage time scaled from those measured so far by QUANTIZE_COST: the slowest per unit of
    cost, a rung cheaper than Q4_K_M counted as Q4_K_M (the stage's process start, hashing and load check do
    not shrink with the quantizer's work). None before any rung has run."""
    if not done:
        return None
    unit = max(seconds / max(1.0, QUANTIZE_COST.get(q, 1.0)) for q, seconds in done.items())
    return unit * max(1.0, QUANTIZE_COST.get(quantization, 1.0))


def plan_figures(plan_rung: dict) -> dict:
    """What the plan says of a rung, measured or not (plan.json rounds gguf_gib to 0.01 GiB: 0.1-0.3% of a 7B's)."""
    return {
        "predicted_bytes": round(plan_rung["gguf_gib"] * GIB),
        "predicted_gpu_gib": {"plan": plan_rung["total_gib"]},
        "fits_target_predicted": {"plan": plan_rung["fits_target"]},
    }


def rung_row(
    quantization: str,
    plan_rung: dict,
    gguf_bytes: int,
    quantize_seconds: float,
    memory: dict,
    measured: dict,
    target_gib: float,
) -> dict:
    """One measured rung. memory: verify's memory_plan of the GGUF; measured: speed_and_memory's."""
    row = {"quant": quantization, "bytes": gguf_bytes, **plan_figures(plan_rung)}
    used = measured.get("gpu_used_gib")
    row["predicted_gpu_gib"]["verify"] = memory["predicted"]["total_gib"]
    row["fits_target_predicted"]["verify"] = memory["fits"]
    row.update(
        size_error=round(gguf_bytes / row["predicted_bytes"] - 1, 4),
        measured_gpu_gib=round(used, 3) if used is not None else None,
        prediction_error={
            basis: round(gib / used - 1, 4) if used else None for basis, gib in row["predicted_gpu_gib"].items()
        },
        fits_target_measured=used <= target_gib if used is not None else None,
        prompt_tokens_per_s=measured["prompt_tokens_per_s"],
        gen_tokens_per_s=measured["gen_tokens_per_s"],
        quantize_seconds=quantize_seconds,
    )
    return row


def fit_verdict(row: dict, basis: str) -> bool | None:
    if basis == "measured":
        return row.get("fits_target_measured")
    return row.get("fits_target_predicted", {}).get(basis)


def summary(rows: list[dict], ladder: tuple[str, ...]) -> dict:
    """What auto would pick on the target fit alone (quality gates aside: the smallest rung that fits) and the
    largest rung that fits, by the plan, by verify's GGUF-based prediction and measured, each over the rungs that
    have that verdict; where the measured fit disagrees with a prediction; the largest size and memory errors."""
    by_quant = {r["quant"]: r for r in rows}
    ordered = [by_quant[q] for q in ladder if q in by_quant]
    out: dict = {"auto_pick_on_fit_alone": {}, "largest_fitting": {}, "fit_disagrees_with_measured": {}}
    for basis in ("plan", "verify", "measured"):
        fitting = [r["quant"] for r in ordered if fit_verdict(r, basis)]
        out["auto_pick_on_fit_alone"][basis] = fitting[0] if fitting else None
        out["largest_fitting"][basis] = fitting[-1] if fitting else None
        if basis != "measured":
            out["fit_disagrees_with_measured"][basis] = [
                r["quant"]
                for r in ordered
                if fit_verdict(r, "measured") is not None and fit_verdict(r, basis) != fit_verdict(r, "measured")
            ]
    out["rungs_skipped"] = [r["quant"] for r in ordered if "skipped" in r]

    def largest(values: dict[str, float]) -> dict | None:
        if not values:
            return None
        quant = max(values, key=lambda q: abs(values[q]))
        return {"quant": quant, "value": values[quant]}

    out["max_abs_size_error"] = largest({r["quant"]: r["size_error"] for r in ordered if "size_error" in r})
    out["max_abs_memory_prediction_error"] = {
        basis: largest(
            {
                r["quant"]: r["prediction_error"][basis]
                for r in ordered
                if (r.get("prediction_error") or {}).get(basis) is not None
            }
        )
        for basis in ("plan", "verify")
    }
    return out


# -- the chain -------------------------------------------------------------------------------------
def llama_log_facts(log: str) -> dict:
    """From verify's verbose llama.cpp load: its buffers, flash attention, the layers it offloaded."""
    from verify_gpu import llama_buffers

    flash = re.search(r"flash_attn\s*=\s*(\w+)", log)
    offloaded = re.search(r"offloaded (\d+/\d+) layers to GPU", log)
    return {
        "llama_cpp_buffers": llama_buffers(log),
        "flash_attn": flash.group(1) if flash else None,
        "offloaded": offloaded.group(1) if offloaded else None,
    }


def measure_rung(
    config,
    quantization: str,
    gguf: Path,
    work: Path,
    device: str,
    prompt_text: str,
    prompt_tokens: int,
    gen_tokens: int,
) -> dict:
    """The rung's GGUF as verify predicts (memory_plan) and loads it (measure_apart), timed by speed_and_memory."""
    from loraship.llamacpp.gguf_info import read_gguf_apart
    from loraship.planning import inference_memory as im
    from loraship.verification.device import memory_plan
    from loraship.verification.measure_child import measure_apart

    info = read_gguf_apart(gguf)
    memory = memory_plan(im.GGUFLayout(**info["layout"]), config)
    job = {
        "gguf": str(gguf),
        "n_ctx": config.target_context,
        "n_gpu_layers": -1 if device == "cuda" else 0,
        "device": device,
        "seed": config.seed,
        "prompt_text": prompt_text,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
    }
    work.mkdir(parents=True, exist_ok=True)
    log = io.StringIO()
    # The child imports this module by name; verbose, llama.cpp logs its buffer sizes (read back from the log).
    child = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")])),
        "LORASHIP_LLAMA_VERBOSE": "1",
    }
    try:
        with environ(child), contextlib.redirect_stderr(log):
            measured = measure_apart(
                SimpleNamespace(dir=work), job, entry="speed_and_memory", module=Path(__file__).stem
            )
    finally:
        (work / f"{quantization}.log").write_text(log.getvalue())
    return {"memory": memory, "measured": measured, **llama_log_facts(log.getvalue())}


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """os.environ with these values while the block runs (measure_apart's child inherits them)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_for_build(built: Path) -> float:
    """Seconds waited for llama-cpp-python's CUDA build beside the chain (bench/verify_kit/chain.sh touches
    `built`, or built.failed): convert's load check and everything after need it."""
    failed = built.with_name(built.name + ".failed")
    started = time.perf_counter()
    while not built.exists() and not failed.exists():
        time.sleep(1)
    if not built.exists():
        raise SystemExit("the llama-cpp-python CUDA build failed: " + failed.read_text()[-1500:])
    return round(time.perf_counter() - started, 1)


@contextlib.contextmanager
def gpu_lock(lock: Path | None):
    """The kit's lock (bench/verify_served_gpu.py --lock): no other run's verify on the GPU while a rung is
    measured. Yields the seconds waited."""
    if lock is None:
        yield 0.0
        return
    import fcntl

    started = time.perf_counter()
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield round(time.perf_counter() - started, 1)


def run_stage_timed(stage: str, config_file: Path, log_file: Path) -> tuple[int, float, str]:
    from verify_served_gpu import run_stage

    started = time.perf_counter()
    rc, lines = run_stage(stage, config_file, log_file, dict(os.environ, PYTHONUNBUFFERED="1"))
    return rc, round(time.perf_counter() - started, 1), "\n".join(line for _, line in lines[-40:])[-3000:]


def write_config(data: dict, path: Path) -> None:
    import yaml

    path.write_text(yaml.safe_dump(data))


def machine() -> dict:
    from loraship.planning.resources import cpu_count

    found = {"cpus": os.cpu_count(), "quantize_threads": cpu_count(), "platform": platform.platform()}
    with contextlib.suppress(Exception):
        found["gpu"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            or None
        )
    return found


def commit() -> str | None:
    if os.environ.get("LORASHIP_COMMIT"):
        return os.environ["LORASHIP_COMMIT"]
    with contextlib.suppress(OSError):
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() or None
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-7b", help="a folder of examples/models")
    parser.add_argument(
        "--layers", type=int, help="keep this many decoder layers (every width and the vocabulary stay)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help=f"a CPU dry run's widths ({TINY}), 2 layers unless --layers"
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--target-gib", type=float, default=6.0, help="target_gpu_memory_gib")
    parser.add_argument("--n-ctx", type=int, default=4096, help="target_context, the n_ctx each rung is loaded at")
    parser.add_argument("--quants", nargs="+", default=list(DEFAULT_ORDER), help="rungs, in the order they run")
    parser.add_argument("--max-steps", type=int, default=2, help="LoRA steps of the train stage")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="Qwen's tokenizer files (default: written by loraship.fixtures.tinyqwen.write_tokenizer)",
    )
    parser.add_argument("--root", type=Path, default=Path("/tmp/quant-ladder-gpu"))
    parser.add_argument("--base-dir", type=Path, help="where the random base model is saved (default ROOT/base)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--deadline-s",
        type=float,
        help="start no rung expected to end later than this many seconds after this script started",
    )
    parser.add_argument(
        "--wait-for",
        type=Path,
        help="hold convert and what follows until this file exists "
        "(llama-cpp-python's CUDA build beside the chain; FILE.failed ends the run)",
    )
    parser.add_argument("--lock", type=Path, help="a lock file held while each rung is measured")
    parser.add_argument("--keep", action="store_true", help="keep the base, merged and F16 files")
    args = parser.parse_args()
    started_all = time.perf_counter()

    from loraship.config import parse_config
    from loraship.constants import AUTO_LADDER, PLAN_FILE, quantized_gguf_name
    from loraship.runtime.stage import stage_dir
    from verify_gpu import chain_config, peer_text, prune
    from verify_served_gpu import versions

    unknown = [q for q in args.quants if q not in AUTO_LADDER]
    if unknown:
        raise SystemExit(f"--quants: {unknown} are not rungs of quantization auto's ladder {AUTO_LADDER}")
    root = args.root
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    layers = args.layers or (2 if args.tiny else None)
    result: dict = {
        "what": "bench/quant_ladder_gpu.py: a random-weight model in a real shape with Qwen's vocabulary through "
        "loraship's stages (plan with quantization: auto -> train -> merge -> convert -> quantize, one rung "
        "per quantize call); each rung loaded as verify loads it (loraship/verification/measure_child.py "
        "measure_apart: every layer "
        "on the GPU at n_ctx = target_context, flash attention off), its GPU memory through NVML in that "
        "process, a prompt and greedy generation timed; predictions from plan.json and verify's memory_plan",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": args.shape + (f" ({layers} layers)" if layers else "") + (" (tiny widths)" if args.tiny else ""),
        "device": args.device,
        "target_gpu_memory_gib": args.target_gib,
        "target_context": args.n_ctx,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "machine": machine(),
        "versions": versions(),
        "stage_seconds": {},
        "disk_free_gib": {},
        "rows": [],
        "skipped": {},
    }
    rows: dict[str, dict] = {}
    plan_rungs: dict[str, dict] = {}

    def save():
        listed = [
            rows.get(q)
            or {"quant": q, "skipped": result["skipped"].get(q, "not run yet"), **plan_figures(plan_rungs[q])}
            for q in AUTO_LADDER
            if q in rows or q in plan_rungs
        ]
        result["rows"] = listed
        result["summary"] = summary(listed, AUTO_LADDER)
        result["total_seconds"] = round(time.perf_counter() - started_all, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    def stage(name: str, config_file: Path, key: str | None = None) -> None:
        rc, seconds, tail = run_stage_timed(name, config_file, logs / f"{key or name}.log")
        result["stage_seconds"][key or name] = seconds
        result["disk_free_gib"][key or name] = round(shutil.disk_usage(root).free / GIB, 1)
        print(f"{key or name}: rc {rc} in {seconds} s", flush=True)
        if rc != 0:
            result["error"] = {"stage": key or name, "returncode": rc, "tail": tail}
            save()
            raise SystemExit(f"{key or name} failed (rc {rc}):\n{tail}")

    tokenizer = args.tokenizer
    if tokenizer is None:
        from loraship.fixtures.tinyqwen import write_tokenizer

        tokenizer = root / "tokenizer"
        if not (tokenizer / "tokenizer.json").is_file():
            started = time.perf_counter()
            tokenizer.mkdir(exist_ok=True)
            write_tokenizer(tokenizer)
            result["stage_seconds"]["tokenizer"] = round(time.perf_counter() - started, 1)
    base = args.base_dir or root / "base"
    if not (base / "config.json").is_file():  # a rerun on the same machine resumes the chain
        started = time.perf_counter()
        spec = {
            "shape": args.shape,
            "tokenizer": str(tokenizer),
            "out": str(base),
            "layers": layers,
            "device": args.device,
            "overrides": TINY if args.tiny else None,
        }
        done = subprocess.run(
            [sys.executable, "-c", _BUILD_MODEL, str(BENCH), json.dumps(spec)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"building the random model failed:\n{done.stderr[-3000:]}")
        result["stage_seconds"]["build_model"] = round(time.perf_counter() - started, 1)

    data = chain_config(
        args.shape.replace("/", "-"), base, root, args.target_gib, args.n_ctx, "auto", args.device, args.max_steps
    )
    config = parse_config(data)
    config_file = root / "config.yaml"
    write_config(config.model_dump(mode="json"), config_file)
    for name in ("plan", "train", "merge"):
        stage(name, config_file)
        if name == "plan":
            plan = json.loads((stage_dir(config, "plan") / PLAN_FILE).read_text())
            plan_rungs.update(plan["inference"]["by_quantization"])
            result["plan"] = {"inference": plan["inference"], "disk_gib": plan["disk_gib"]}
        if not args.keep:
            prune(config, name, base)
        save()
    if args.wait_for:
        result["waited_for_llama_build_s"] = wait_for_build(args.wait_for)
    stage("convert", config_file)
    if not args.keep:
        prune(config, "convert", base)
    save()

    prompt_file = root / "prompt.txt"
    peer_text(prompt_file)  # the demo's chat rows as plain text
    prompt_text = prompt_file.read_text()
    result["skipped"].update({q: "not in --quants" for q in AUTO_LADDER if q not in args.quants})
    done_seconds: dict[str, float] = {}
    for quantization in args.quants:
        expected = expected_quantize_seconds(quantization, done_seconds)
        elapsed = time.perf_counter() - started_all
        if args.deadline_s and expected is not None and elapsed + expected + MEASURE_ALLOWANCE_S > args.deadline_s:
            result["skipped"][quantization] = (
                f"--deadline-s {args.deadline_s:g}: at {elapsed:.0f} s, quantizing is "
                f"expected to take {expected:.0f} s, measuring {MEASURE_ALLOWANCE_S} s"
            )
            print(f"{quantization}: skipped, {result['skipped'][quantization]}", flush=True)
            save()
            continue
        rung_data = {**config.model_dump(mode="json"), "quantization": [quantization]}
        rung_file = root / f"config-{quantization}.yaml"
        write_config(rung_data, rung_file)
        rc, seconds, tail = run_stage_timed("quantize", rung_file, logs / f"quantize-{quantization}.log")
        result["stage_seconds"][f"quantize/{quantization}"] = seconds
        result["disk_free_gib"][f"quantize/{quantization}"] = round(shutil.disk_usage(root).free / GIB, 1)
        if rc != 0:
            result["skipped"][quantization] = f"the quantize stage failed (rc {rc}): {tail[-1500:]}"
            print(f"{quantization}: quantize failed (rc {rc})", flush=True)
            save()
            continue
        done_seconds[quantization] = seconds
        gguf = stage_dir(config, "quantize") / quantized_gguf_name(quantization)
        started = time.perf_counter()
        try:
            with gpu_lock(args.lock) as waited:
                measuring = time.perf_counter()
                found = measure_rung(
                    config,
                    quantization,
                    gguf,
                    root / "measure",
                    args.device,
                    prompt_text,
                    args.prompt_tokens,
                    args.gen_tokens,
                )
                measure_seconds = round(time.perf_counter() - measuring, 1)
        except Exception as e:  # noqa: BLE001 - a rung llama.cpp cannot load is a result; the others go on
            result["skipped"][quantization] = f"measuring failed: {str(e)[-1500:]}"
            print(f"{quantization}: measuring failed: {str(e)[-500:]}", flush=True)
            save()
            continue
        measured = found["measured"]
        if args.device == "cuda" and not measured["gpu_offload"]:
            raise SystemExit("--device cuda, but this llama-cpp-python has no GPU offload: install its CUDA build")
        row = rung_row(
            quantization,
            plan_rungs[quantization],
            gguf.stat().st_size,
            seconds,
            found["memory"],
            measured,
            args.target_gib,
        )
        row.update(
            measure_seconds=measure_seconds,
            lock_waited_s=waited,
            load_seconds=measured["load_seconds"],
            prompt_seconds=measured["prompt_seconds"],
            predicted_components=found["memory"]["predicted"],
            llama_cpp_buffers=found["llama_cpp_buffers"],
            flash_attn=found["flash_attn"],
            offloaded=found["offloaded"],
            llama_cpp_gpu_offload=measured["gpu_offload"],
            **{k: measured[k] for k in ("nvml_lists_this_process", "nvml_device_used_gib") if k in measured},
        )
        rows[quantization] = row
        result["stage_seconds"][f"measure/{quantization}"] = round(time.perf_counter() - started, 1)
        print(
            f"{quantization:7s} {row['bytes'] / GIB:6.3f} GiB (plan {row['predicted_bytes'] / GIB:6.3f}, "
            f"{row['size_error']:+.1%})  GPU {row['measured_gpu_gib']} GiB (plan {row['predicted_gpu_gib']['plan']}, "
            f"verify {row['predicted_gpu_gib']['verify']})  pp {row['prompt_tokens_per_s']} tok/s  "
            f"tg {row['gen_tokens_per_s']} tok/s  quantize {seconds} s",
            flush=True,
        )
        save()
    if not args.keep:
        prune(config, "quantize", base)  # the F16 GGUF
    save()
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
