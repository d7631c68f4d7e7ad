"""verify's bad input: each ends with one message that names the problem and the fix."""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest

from loraship.planning import inference_memory as im
from loraship.errors import IntegrityError, LorashipError
from loraship.runtime.stage import stage_dir

verify = importlib.import_module("loraship.stages.verify")
MIB = 2**20


def _layout(block_bytes=400 * MIB):
    return im.GGUFLayout(
        n_layers=28,
        layer_bytes=[block_bytes] * 28,
        output_bytes=426 * MIB,
        cpu_bytes=292 * MIB,
        n_embd=3584,
        n_embd_kv=512,
        n_head=28,
        n_ff=18944,
        n_vocab=152064,
        n_ctx_train=32768,
    )


def test_gguf_that_does_not_fit_with_one_layer_is_refused_with_the_fix():
    config = SimpleNamespace(target_context=4096, target_gpu_memory_gib=1.0)
    with pytest.raises(LorashipError) as caught:
        verify.memory_plan(_layout(), config)
    message = str(caught.value)
    assert "does not fit target_gpu_memory_gib 1 even with one layer" in message
    assert "smaller quantization" in message and message.count("\n") == 0


def test_gguf_too_large_for_every_layer_gets_the_layers_and_context_that_fit():
    config = SimpleNamespace(target_context=4096, target_gpu_memory_gib=6.0)
    plan = verify.memory_plan(_layout(), config)
    assert plan["fits"] is False
    layers = plan["gpu_layers_at_target_context"]
    assert 2 <= layers < im.all_layers(_layout())
    assert (
        im.predict_gpu(_layout(), 4096, layers)["total_gib"]
        <= 6.0
        < im.predict_gpu(_layout(), 4096, layers + 1)["total_gib"]
    )


def test_gpu_smaller_than_the_plan_target_is_refused(monkeypatch):
    monkeypatch.setattr(im, "gpu_total_gib", lambda: 7.6)
    config = SimpleNamespace(target_gpu_memory_gib=8.0)
    with pytest.raises(
        LorashipError, match=r"this GPU has 7.6 GiB, less than target_gpu_memory_gib 8 .*lower target_gpu_memory_gib"
    ):
        verify.check_gpu_size(config, "cuda")
    verify.check_gpu_size(config, "cpu")  # CPU runs (the tests) have no GPU to compare
    monkeypatch.setattr(im, "gpu_total_gib", lambda: 11.9)
    verify.check_gpu_size(config, "cuda")


def test_reference_made_for_another_merged_model_is_refused(pipeline_run):
    config, _ = pipeline_run
    reference = json.loads((stage_dir(config, "reference") / verify.REFERENCE_FILE).read_text())
    verify.check_lineage(config, reference)  # the run's own reference passes
    with pytest.raises(IntegrityError, match="computed for another merged model.*run the reference stage again"):
        verify.check_lineage(config, {**reference, "merged_digest": "0" * 64})
