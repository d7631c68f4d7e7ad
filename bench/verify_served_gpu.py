"""Verify's served check on the GPU: one run of loraship's own stages, verify under CUDA llama.cpp.

    python bench/verify_served_gpu.py --name demo --model .loraship/models/tiny-llama --out /tmp/vs/demo.json
    python bench/verify_served_gpu.py --name qwen2-base --family qwen2-base --model MODEL --out /tmp/vs/qwen2-base.json

The config is what a user writes: configs/demo.yaml (the demo), or for --family the demo config with
tests/test_families.py's overrides (FAMILY_OVERRIDES, SEQUENCE_LEN, the family's chat template), as
run_family runs it; device: cuda, so verify refuses to fall back to the CPU
(loraship/verification/device.py pick_device). Each stage runs as its image does, `python -m loraship.stages.<stage>
CONFIG` in its own process, timed (torch's CUDA libraries and llama.cpp's in one process crashed
verify once: bench/verify_gpu.py). publish is left out.

--wait-for FILE holds convert (its load check is llama.cpp's), quantize and verify back until FILE
exists: llama-cpp-python's CUDA build running beside the chain in the same device call; FILE.failed
ends the run. --lock FILE serializes convert -> verify between runs started side by side, so one
verify's GPU figures are its own.

While verify runs, NVML's device-wide memory use is sampled every 0.2 s; the window after verify
logs "serving ..." is the served check (the server in its own process, n_gpu_layers as verify chose),
so its peak shows where the server held its model. Afterwards --probe-server starts the same server
once more with --verbose True on the same GGUF and keeps llama.cpp's own lines about the CUDA device,
the layers offloaded and the buffers: the proof that llama_cpp.server ran on the GPU.

Written after every step to --out: every verify gate (passed, value, threshold), verify.json's
`served` block, device / n_ctx / n_gpu_layers / GPU memory as verify reports them, stage seconds,
versions and the GPU's name.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SERVING_LINE = "through llama.cpp's OpenAI-compatible server"


def config_dict(name: str, model: Path, root: Path, family: str | None, device: str, max_steps: int | None) -> dict:
    import yaml

    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data.update(
        run_name=name,
        base_model=str(model),
        workdir=str(root / "work"),
        output=str(root / "artifacts"),
        datasets=[{"path": str(REPO / "data/demo/train.jsonl"), "type": "chat"}],
        eval_datasets=[{"path": str(REPO / "data/demo/eval.jsonl"), "type": "chat"}],
        golden_prompts=str(REPO / "data/demo/golden.jsonl"),
        device=device,
        imatrix=False,
    )  # the device kit builds no llama.cpp tools: the binding quantizes
    if family:
        from loraship.fixtures.families import FAMILIES
        from tests.test_families import FAMILY_OVERRIDES, SEQUENCE_LEN

        data.update(FAMILY_OVERRIDES, sequence_len=SEQUENCE_LEN.get(family, 64))
        if FAMILIES[family].chat_template:
            data["chat_template"] = FAMILIES[family].chat_template
    if max_steps:  # a CPU dry run of this script only
        data.update(
            max_steps=max_steps, save_steps=max_steps, warmup_steps=min(data.get("warmup_steps", 0), max_steps - 1)
        )
    return data


class GpuSampler:
    """Device-wide GPU memory in use (MiB), sampled with time stamps; nothing where NVML is missing."""

    def __init__(self, every: float = 0.2):
        self.samples: list[tuple[float, float]] = []
        self.every, self._stop = every, threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVIDIA driver (a CPU dry run)
            self._handle = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
            self.samples.append((time.time(), used))
            self._stop.wait(self.every)

    def __enter__(self):
        if self._handle is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, start: float, end: float) -> float | None:
        values = [u for t, u in self.samples if start <= t <= end]
        return round(max(values), 1) if values else None

    def baseline(self, before: float) -> float | None:
        values = [u for t, u in self.samples if t < before]
        return round(min(values), 1) if values else None


def run_stage(stage: str, config_file: Path, log_file: Path, env: dict) -> tuple[int, list[tuple[float, str]]]:
    """The stage as its image runs it; its output lines, time-stamped as they arrive, also into log_file."""
    lines: list[tuple[float, str]] = []
    with open(log_file, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", f"loraship.stages.{stage}", str(config_file)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
        )
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
            sink.write(line)
            sink.flush()
        return proc.wait(), lines


def gates_of(verify: dict) -> dict:
    return {
        name: {
            "passed": g.get("passed"),
            "value": g.get("value"),
            "threshold": g.get("threshold"),
            **({"note": g["note"][:300]} if g.get("note") else {}),
        }
        for name, g in verify["gates"].items()
    }


def probe_server(gguf: Path, n_ctx: int, n_gpu_layers: int, log_file: Path, env: dict) -> dict:
    """llama_cpp.server as served.py starts it, but verbose: llama.cpp's own lines on where the model went."""
    from loraship.llamacpp.served import _ready, free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        "loraship",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_gpu_layers",
        str(n_gpu_layers),
        "--verbose",
        "True",
    ]
    started = time.perf_counter()
    with open(log_file, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while time.perf_counter() - started < 120 and proc.poll() is None and not _ready(port):
            time.sleep(0.2)
        ready = proc.poll() is None and _ready(port)
        seconds = round(time.perf_counter() - started, 2)
        answer = None
        if ready:
            from openai import OpenAI

            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="probe", timeout=60, max_retries=0)
            done = client.chat.completions.create(
                model="loraship", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
            )
            answer = {"content": done.choices[0].message.content, "finish_reason": done.choices[0].finish_reason}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()
    text = log_file.read_text(errors="replace")
    keep = [
        line
        for line in text.splitlines()
        if re.search(
            r"ggml_cuda_init|Device \d+:|offload|CUDA_Host|using device|model buffer|KV buffer|"
            r"compute buffer",
            line,
        )
        and "assigned to device" not in line
    ]
    layers: dict[str, int] = {}
    for device in re.findall(r"layer\s+\d+ assigned to device (\S+?),", text):
        layers[device] = layers.get(device, 0) + 1
    return {
        "ready": ready,
        "ready_seconds": seconds,
        "answer": answer,
        "layers_by_device": layers,
        "offloaded": next((m.group(0) for m in re.finditer(r"offloaded \d+/\d+ layers to GPU", text)), None),
        "lines": keep[:40],
    }


# Where the server's model load could fail on a CUDA build (on the H200 a CUDA load after `import numpy`
# segfaulted: bench/results/verify_gpu_bisect.json): the same GGUF loaded in a bare child, after llama_cpp alone
# and after the server's own modules (fastapi, pydantic, uvicorn, ...), as `python -m llama_cpp.server` imports them.
_LOAD = """
import sys, time
{imports}
from llama_cpp import Llama
t = time.perf_counter()
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_gpu_layers=int(sys.argv[3]), verbose=False)
out = llm.create_chat_completion(messages=[{{"role": "user", "content": "Hello"}}], max_tokens=8, temperature=0)
print("LOADED", round(time.perf_counter() - t, 2), repr(out["choices"][0]["message"]["content"]))
"""
LOAD_VARIANTS = {
    "llama_cpp_only": "import llama_cpp",
    "after_server_modules": "import llama_cpp, llama_cpp.server.app, llama_cpp.server.settings, "
    "llama_cpp.server.model, uvicorn",
}


def load_bisect(gguf: Path, n_ctx: int, n_gpu_layers: int, env: dict) -> dict:
    found = {}
    for name, imports in LOAD_VARIANTS.items():
        done = subprocess.run(
            [
                sys.executable,
                "-X",
                "faulthandler",
                "-c",
                _LOAD.format(imports=imports),
                str(gguf),
                str(n_ctx),
                str(n_gpu_layers),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        found[name] = {
            "rc": done.returncode,
            "loaded": "LOADED" in done.stdout,
            "tail": (done.stdout + done.stderr)[-1200:],
        }
    return found


def versions() -> dict:
    import importlib.metadata as md

    found = {"python": sys.version.split()[0]}
    for name in (
        "llama_cpp_python",
        "openai",
        "fastapi",
        "uvicorn",
        "sse-starlette",
        "starlette",
        "pydantic",
        "pydantic-settings",
        "httpx2",
        "torch",
        "transformers",
        "peft",
        "gguf",
        "numpy",
    ):
        with contextlib.suppress(md.PackageNotFoundError):
            found[name] = md.version(name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="run_name")
    parser.add_argument("--model", type=Path, required=True, help="the base model folder")
    parser.add_argument("--family", help="a loraship.fixtures.families name: the family test's config overrides")
    parser.add_argument("--root", type=Path, default=Path("/tmp/vs"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"))
    parser.add_argument("--wait-for", type=Path, help="hold convert, quantize and verify until this file exists")
    parser.add_argument("--lock", type=Path, help="a lock file held from convert through verify")
    parser.add_argument("--max-steps", type=int, help="CPU dry runs only: fewer training steps")
    parser.add_argument("--no-probe-server", action="store_true")
    args = parser.parse_args()

    import yaml

    from loraship.constants import STAGES, quantized_gguf_name
    from loraship.config import load_config
    from loraship.runtime.stage import stage_dir

    root = args.root / args.name
    root.mkdir(parents=True, exist_ok=True)
    config_file = root / "config.yaml"
    config_file.write_text(
        yaml.safe_dump(config_dict(args.name, args.model.resolve(), root, args.family, args.device, args.max_steps))
    )
    config = load_config(config_file)
    row: dict = {
        "run": args.name,
        "family": args.family,
        "base_model": str(args.model),
        "device_asked": args.device,
        "config": yaml.safe_load(config_file.read_text()),
        "stage_seconds": {},
        "stage_returncodes": {},
    }
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
        row["base_model_build"] = json.loads((args.model / "pretrain_log.json").read_text())

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=2))

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lock = None
    started_all = time.perf_counter()
    for stage in STAGES[:-1]:  # publish left out
        if stage == "convert":
            if args.wait_for:
                waited = time.perf_counter()
                failed = args.wait_for.with_name(args.wait_for.name + ".failed")
                while not args.wait_for.exists() and not failed.exists():
                    time.sleep(1)
                row["waited_for_llama_build_s"] = round(time.perf_counter() - waited, 1)
                if failed.exists():
                    row["error"] = "the llama-cpp-python CUDA build failed: " + failed.read_text()[-1500:]
                    save()
                    raise SystemExit(row["error"])
            if args.lock:
                waited = time.perf_counter()
                lock = open(args.lock, "w")
                fcntl.flock(lock, fcntl.LOCK_EX)
                row["waited_for_lock_s"] = round(time.perf_counter() - waited, 1)
        started = time.perf_counter()
        with GpuSampler() as sampler:
            rc, lines = run_stage(stage, config_file, root / f"{stage}.log", env)
        ended = time.time()
        row["stage_seconds"][stage] = round(time.perf_counter() - started, 1)
        row["stage_returncodes"][stage] = rc
        if stage == "verify":
            serving = next((t for t, line in lines if SERVING_LINE in line), None)
            row["gpu_memory_sampled_mib"] = {
                "samples": len(sampler.samples),
                "baseline": sampler.baseline(ended - row["stage_seconds"][stage] + 0.5),
                "peak_before_serving": sampler.peak(0, serving or ended),
                "peak_while_serving": sampler.peak(serving, ended) if serving else None,
                "serving_seconds": round(ended - serving, 1) if serving else None,
                "note": "device-wide NVML memory in use during verify; while serving, only the server process holds "
                "a model (the measure child has ended)",
            }
        if rc != 0:
            tail = "\n".join(line for _, line in lines[-40:])
            row.setdefault("stage_errors", {})[stage] = tail[-3000:]
            if stage != "verify":  # verify goes on below: the probe and the bisect say more than its error
                save()
                raise SystemExit(f"{stage} failed (rc {rc}):\n{tail[-3000:]}")
        save()
    verify_file = stage_dir(config, "verify") / "verify.json"
    if verify_file.exists():
        verify = json.loads(verify_file.read_text())
        row.update(
            verify_passed=verify["passed"],
            gates=gates_of(verify),
            served=verify.get("served"),
            device=verify.get("device"),
            n_ctx=verify.get("n_ctx"),
            n_gpu_layers=verify.get("n_gpu_layers"),
            load_seconds=verify.get("load_seconds"),
            gpu_memory=verify.get("gpu_memory"),
            memory_plan_fits=verify.get("memory", {}).get("fits"),
            prompt_tokens_per_s=verify.get("prompt_tokens_per_s"),
            gen_tokens_per_s=verify.get("gen_tokens_per_s"),
            golden_match=verify.get("golden_match"),
            golden_parted_at_near_tie=verify.get("golden_parted_at_near_tie"),
            verify_seconds=verify.get("verify_seconds"),
            gguf_bytes=verify.get("gguf_bytes"),
            builtin_template_engine=verify.get("builtin_template_engine"),
        )
    server_log = stage_dir(config, "verify") / f"server-{config.primary_quantization}.log"
    if server_log.exists():
        row["server_log_tail"] = server_log.read_text(errors="replace")[-2000:]
    save()
    gguf = stage_dir(config, "quantize") / quantized_gguf_name(config.primary_quantization)
    # Without verify.json (verify stopped with an error) the context and layers verify would have used on the GPU.
    n_ctx = row.get("n_ctx") or config.target_context
    n_gpu_layers = (
        row.get("n_gpu_layers") if row.get("n_gpu_layers") is not None else (-1 if args.device == "cuda" else 0)
    )
    if gguf.exists() and not args.no_probe_server:
        try:
            row["server_probe"] = probe_server(gguf, n_ctx, n_gpu_layers, root / "server-probe.log", env)
        except Exception as e:  # noqa: BLE001 - the probe is evidence, not the measurement
            row["server_probe"] = {"error": repr(e)[:1000]}
        save()
    served_ok = (row.get("gates", {}).get("served") or {}).get("passed")
    if gguf.exists() and (not served_ok or not (row.get("server_probe") or {}).get("ready")):
        row["load_bisect"] = load_bisect(gguf, n_ctx, n_gpu_layers, env)  # the server failed: which load fails
    if lock:
        lock.close()
    row["total_seconds"] = round(time.perf_counter() - started_all, 1)
    row["versions"] = versions()
    with contextlib.suppress(Exception):
        row["gpu"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            or None
        )
    with contextlib.suppress(Exception):
        import llama_cpp

        row["llama_supports_gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    save()
    summary = {k: row.get(k) for k in ("run", "verify_passed", "device", "n_gpu_layers", "stage_seconds")}
    summary["served"] = {k: v for k, v in (row.get("served") or {}).items() if k != "answers"}
    print(json.dumps(summary))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
