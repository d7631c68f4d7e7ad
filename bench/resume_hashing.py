"""Resume of a finished 7B-sized run: how long the stages take to decide they are done.

Lays out a finished run's stage folders with real (non-sparse) files of a 7B model's sizes,
scaled to --gib in total (merged bf16 shards 45%, F16 GGUF 45%, Q4_K_M GGUF 8%, adapter 2%),
writes every stage's manifest through the stages' own open_stage/finish, then times a resume:
open_stage of every stage, in order, as `loraship run` does before skipping them. Each mode
starts with the files evicted from the page cache (posix_fadvise DONTNEED after fsync), so
hashing reads the disk as it would after a reboot or on a fresh pod.

Modes, in one run:
  full     LORASHIP_FULL_VERIFY=1: every upstream output hashed in every stage (the old behaviour)
  cold     digest cache deleted first: each file hashed once, then cached
  cached   digest cache as the stages left it: nothing re-read

    .venv/bin/python bench/resume_hashing.py --gib 15    # writes bench/results/resume_hashing.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loraship.runtime import manifest as mf  # noqa: E402
from loraship.config import parse_config  # noqa: E402
from loraship.constants import F16_GGUF, MERGED_DIR, PLAN_FILE, STAGES, STRATEGY_FILE, VERIFY_FILE  # noqa: E402
from loraship.runtime.stage import open_stage, stage_dir  # noqa: E402

BLOCK = 64 * 2**20


def stage_args(stage: str) -> dict:
    from loraship.stage_table import stage_module

    module = stage_module(stage)
    args = {"upstream": module.UPSTREAM, "fields": module.FIELDS}
    if stage == "plan":
        args["extra_inputs"] = {"dataset:data.jsonl": "0" * 64}
    if stage == "train":
        args["depends_on"] = {"plan": (STRATEGY_FILE,)}
    if stage == "publish":
        args["consumes"] = {**module.CONSUMES, "quantize": ("model-Q4_K_M.gguf",)}
    return args


def write_file(path: Path, size: int, block: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def layout(total: int) -> dict[str, dict[str, int]]:
    """Files per stage, in pipeline order; a stage not sized here gets one small file."""
    merged, f16 = int(total * 0.45), int(total * 0.45)
    q4, adapter = int(total * 0.08), total - merged - f16 - int(total * 0.08)
    sized = {
        "plan": {PLAN_FILE: 4096, STRATEGY_FILE: 512},
        "train": {"adapter/adapter_model.safetensors": adapter, "adapter/adapter_config.json": 1024},
        "merge": {
            **{f"{MERGED_DIR}/model-0000{i}-of-00004.safetensors": merged // 4 for i in range(1, 5)},
            f"{MERGED_DIR}/config.json": 1024,
            "probe.json": 512,
        },
        "convert": {F16_GGUF: f16},
        "quantize": {"model-Q4_K_M.gguf": q4},
        "verify": {VERIFY_FILE: 2048},
        "publish": {"artifact/README.md": 2048},
    }
    return {stage: sized.get(stage, {f"{stage}.json": 2048}) for stage in STAGES}


def evict(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def resume(config, root: Path) -> dict:
    hashed = {"files": 0, "bytes": 0}
    real = mf.sha256_file

    def counting(path, *args, **kwargs):
        hashed["files"] += 1
        hashed["bytes"] += Path(path).stat().st_size
        return real(path, *args, **kwargs)

    evict(root)
    mf.sha256_file = counting
    try:
        start = time.perf_counter()
        for stage in STAGES:
            ctx = open_stage(config, stage, **stage_args(stage))
            assert ctx.done is not None, f"{stage} was not taken as done"
        seconds = time.perf_counter() - start
    finally:
        mf.sha256_file = real
    return {
        "seconds": round(seconds, 3),
        "files_hashed": hashed["files"],
        "gib_hashed": round(hashed["bytes"] / 2**30, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=15.0, help="total size of the run's files")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/loraship-bench-resume"))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "resume_hashing.json")
    args = parser.parse_args()

    shutil.rmtree(args.dir, ignore_errors=True)
    total = int(args.gib * 2**30)
    free = shutil.disk_usage(args.dir.parent).free
    if free < total * 1.2:
        sys.exit(
            f"needs {total * 1.2 / 2**30:.1f} GiB free in {args.dir.parent}, {free / 2**30:.1f} GiB is; pass a "
            "smaller --gib"
        )
    config = parse_config(
        {
            "run_name": "bench",
            "base_model": "org/model-7b",
            "workdir": str(args.dir / "work"),
            "output": str(args.dir / "artifacts"),
            "datasets": [{"path": "data.jsonl", "type": "chat"}],
        }
    )
    block = os.urandom(BLOCK)  # incompressible, and every block really allocated (no sparse files)
    start = time.perf_counter()
    for stage, files in layout(total).items():
        ctx = open_stage(config, stage, **stage_args(stage))
        for rel, size in files.items():
            write_file(ctx.dir / rel, size, block)
        ctx.finish({})
    laid_out = time.perf_counter() - start
    run = stage_dir(config, "plan").parent
    on_disk = sum(p.stat().st_blocks * 512 for p in run.rglob("*") if p.is_file())

    os.environ[mf.FULL_VERIFY_ENV] = "1"
    full = resume(config, run)
    del os.environ[mf.FULL_VERIFY_ENV]
    (run / mf.DIGESTS_FILE).unlink()
    cold = resume(config, run)
    cached = resume(config, run)
    result = {
        "what": (
            f"open_stage of all {len(STAGES)} stages on a finished run (resume that skips every stage), "
            "page cache evicted"
        ),
        "files_gib": round(on_disk / 2**30, 2),
        "modes": {
            "full (every upstream output re-hashed; before the digest cache)": full,
            "cold (digest cache deleted: each file hashed once)": cold,
            "cached (digest cache kept)": cached,
        },
        "speedup_cached_vs_full": round(full["seconds"] / max(cached["seconds"], 1e-6), 1),
        "layout_seconds": round(laid_out, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "disk": str(args.dir)},
    }
    print(f"{'mode':<70} {'seconds':>9} {'files':>6} {'GiB hashed':>11}")
    for name, m in result["modes"].items():
        print(f"{name:<70} {m['seconds']:>9.2f} {m['files_hashed']:>6} {m['gib_hashed']:>11.2f}")
    print(f"cached vs full: {result['speedup_cached_vs_full']}x faster ({result['files_gib']} GiB of files)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
