"""adapter_gguf: the LoRA alone as a GGUF, applied by llama.cpp to the base GGUF, gated against the merged GGUF.

The trained stages (plan, train, merge, reference) are copied from conftest.pipeline_run, which the
suite runs once anyway; convert, quantize and verify run again here with adapter_gguf on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.constants import (
    ADAPTER_DIR,
    ADAPTER_GGUF,
    GGUF_FILE_TYPES,
    GGUF_KEY_FILE_TYPE,
    REFERENCE_FILE,
    VERIFY_FILE,
    base_gguf_name,
    quantized_gguf_name,
)
from loraship.errors import LorashipError
from loraship.llamacpp.gguf_info import read_gguf
from loraship.runtime.manifest import DIGESTS_FILE
from loraship.runtime.stage import run_dir, stage_dir
from tests.conftest import demo_config_dict

TRAINED = ("plan", "train", "merge", "reference")
ADAPTER_GATES = ("adapter_kl_divergence_mean", "adapter_same_top_token")


def trained_copy(pipeline_run, tiny_model, root: Path, **overrides):
    """A config like pipeline_run's with adapter_gguf on, in root, holding a copy of its trained stages."""
    config, _ = pipeline_run
    ours = parse_config(demo_config_dict(tiny_model, root, run_name=config.run_name, adapter_gguf=True, **overrides))
    for stage in TRAINED:
        shutil.copytree(stage_dir(config, stage), stage_dir(ours, stage))
    shutil.copy2(run_dir(config) / DIGESTS_FILE, run_dir(ours) / DIGESTS_FILE)
    return ours


def run_stages(config, stages=("convert", "quantize", "verify")) -> dict:
    import importlib

    return {stage: importlib.import_module(f"loraship.stages.{stage}").run(config) for stage in stages}


@pytest.fixture(scope="module")
def adapter_run(pipeline_run, tiny_model, tmp_path_factory):
    config = trained_copy(pipeline_run, tiny_model, tmp_path_factory.mktemp("adapter"))
    return config, run_stages(config)


def test_trained_stages_were_reused_not_rerun(adapter_run):
    """adapter_gguf keys no stage before convert: the copied trained stages stand as they are."""
    config, _ = adapter_run
    for stage, result in run_stages(config, TRAINED).items():
        assert result.get("_skipped"), stage


def test_adapter_gguf_is_a_lora_of_the_trained_adapter(adapter_run):
    from gguf import Keys
    from safetensors import safe_open

    from loraship.llamacpp.gguf_info import open_gguf

    config, manifests = adapter_run
    convert = stage_dir(config, "convert")
    fields = read_gguf(convert / ADAPTER_GGUF)["fields"]
    assert fields[Keys.General.TYPE] == "adapter" and fields[Keys.Adapter.TYPE] == "lora"
    assert fields[Keys.Adapter.LORA_ALPHA] == config.lora_alpha
    names = [t.name for t in open_gguf(convert / ADAPTER_GGUF).tensors]
    assert names and all(n.endswith((".lora_a", ".lora_b")) for n in names)
    with safe_open(stage_dir(config, "train") / ADAPTER_DIR / "adapter_model.safetensors", "np") as peft:
        assert len(names) == 2 * sum(".lora_A." in key for key in peft.keys())  # every adapted module, A and B
    base = read_gguf(convert / base_gguf_name(config.primary_quantization))["fields"]
    assert base[GGUF_KEY_FILE_TYPE] == GGUF_FILE_TYPES[config.primary_quantization]  # quantized like the merged model
    assert not (convert / "base-F16.gguf").exists()  # the step on the way is not kept
    metrics = manifests["convert"]["metrics"]["adapter_gguf"]
    assert metrics["adapter_tensor_count"] == len(names)
    assert {ADAPTER_GGUF, base_gguf_name(config.primary_quantization)} <= set(manifests["convert"]["outputs"])


def test_llama_cpp_applies_the_adapter_to_the_base(adapter_run):
    """Base + adapter is close to the merged GGUF and far from the base alone."""
    import numpy as np
    from llama_cpp import Llama

    config, _ = adapter_run
    convert = stage_dir(config, "convert")
    base, lora = str(convert / base_gguf_name(config.primary_quantization)), str(convert / ADAPTER_GGUF)
    merged = str(stage_dir(config, "quantize") / quantized_gguf_name(config.primary_quantization))
    ids = json.loads((stage_dir(config, "reference") / REFERENCE_FILE).read_text())["eval"][0]["input_ids"]

    def logits(**kwargs):
        llm = Llama(n_ctx=256, logits_all=True, verbose=False, **kwargs)
        llm.eval(ids)
        return np.asarray(llm.scores[: len(ids)], dtype=np.float64)

    want = logits(model_path=merged)
    adapted, alone = logits(model_path=base, lora_path=lora), logits(model_path=base)
    assert np.abs(adapted - want).mean() < 0.1 * np.abs(alone - want).mean()
    assert (adapted.argmax(-1) == want.argmax(-1)).mean() >= 0.9 > (alone.argmax(-1) == want.argmax(-1)).mean()


def test_verify_gates_base_plus_adapter_against_the_merged_gguf(adapter_run):
    config, manifests = adapter_run
    verdict = json.loads((stage_dir(config, "verify") / VERIFY_FILE).read_text())
    assert verdict["passed"]
    for name in ADAPTER_GATES:
        assert verdict["gates"][name]["passed"]
        assert verdict["gates"][name]["evidence"] >= config.min_scored_tokens
    report = verdict["adapter_gguf"]
    assert report["kl_mean"] <= config.adapter_kl_mean_max and report["same_top_rate"] >= config.adapter_same_top_min
    assert report["scored_tokens"] == verdict["eval_agreement"]["scored_tokens"]
    assert manifests["verify"]["metrics"]["adapter_gguf"]["kl_mean"] == report["kl_mean"]
    assert not list(stage_dir(config, "verify").glob(".merged-topk*"))


def test_publish_ships_the_adapter_and_its_base(adapter_run):
    from huggingface_hub import ModelCard

    from loraship.constants import ADAPTER_GGUF, MANIFEST_NAME, MODEL_CARD, base_gguf_name

    config, _ = adapter_run
    run_stages(config, ("publish",))
    root = Path(config.output) / config.run_name
    base = base_gguf_name(config.primary_quantization)
    published = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
    assert {ADAPTER_GGUF, base}.issubset(published)
    assert read_gguf(root / ADAPTER_GGUF)["fields"]["general.type"] == "adapter"
    card = ModelCard.load(root / MODEL_CARD)
    assert f"llama-server -m {base} --lora {ADAPTER_GGUF}" in card.text
    assert "| adapter_kl_divergence_mean | pass |" in card.text


def test_without_the_key_there_is_no_adapter_gguf_and_no_gate(pipeline_run):
    config, manifests = pipeline_run
    assert not config.adapter_gguf
    assert not (stage_dir(config, "convert") / ADAPTER_GGUF).exists()
    assert "adapter_gguf" not in manifests["convert"]["metrics"]
    gates = json.loads((stage_dir(config, "verify") / VERIFY_FILE).read_text())["gates"]
    assert not set(ADAPTER_GATES) & set(gates)


def test_too_little_evidence_fails_the_adapter_gate(adapter_run, pipeline_run, tiny_model, tmp_path):
    config, _ = adapter_run
    scored = json.loads((stage_dir(config, "verify") / VERIFY_FILE).read_text())["adapter_gguf"]["scored_tokens"]
    ours = trained_copy(pipeline_run, tiny_model, tmp_path)
    for stage in ("convert", "quantize"):
        shutil.copytree(stage_dir(config, stage), stage_dir(ours, stage))
    ours.min_scored_tokens = scored + 1  # the HF gates fail on it too: the adapter's must not pass on 0/0 either
    with pytest.raises(LorashipError, match="adapter_kl_divergence_mean"):
        run_stages(ours, ("verify",))
    gates = json.loads((stage_dir(ours, "verify") / VERIFY_FILE).read_text())["gates"]
    for name in ADAPTER_GATES:
        assert not gates[name]["passed"] and "not enough evidence" in gates[name]["note"]


@pytest.mark.parametrize("factor", [0.0, 3.0], ids=["zeroed", "scaled-up"])
def test_a_wrong_adapter_gguf_fails_the_gate(pipeline_run, tiny_model, tmp_path, monkeypatch, factor):
    """convert writes the adapter GGUF from a PEFT adapter whose lora_B weights were multiplied by
    factor: base + that adapter no longer agrees with the merged GGUF, and verify says so."""
    from safetensors.torch import load_file, save_file

    import loraship.stages.convert as convert_stage

    real = convert_stage.convert_adapter

    def wrong_adapter(adapter_dir, base_dir, out_file, progress_key=None):
        bent = tmp_path / "bent-adapter"
        shutil.copytree(adapter_dir, bent)
        weights = load_file(bent / "adapter_model.safetensors")
        save_file(
            {k: v * factor if "lora_B" in k else v for k, v in weights.items()}, bent / "adapter_model.safetensors"
        )
        real(bent, base_dir, out_file, progress_key)

    monkeypatch.setattr(convert_stage, "convert_adapter", wrong_adapter)
    config = trained_copy(pipeline_run, tiny_model, tmp_path / "run")
    with pytest.raises(LorashipError, match="adapter_"):
        run_stages(config)
    verdict = json.loads((stage_dir(config, "verify") / VERIFY_FILE).read_text())
    assert not verdict["passed"]
    assert not all(verdict["gates"][name]["passed"] for name in ADAPTER_GATES)
    # Only the adapter is wrong: the merged GGUF's own gates still pass.
    assert all(g["passed"] for name, g in verdict["gates"].items() if not name.startswith("adapter_"))


def test_a_converter_folder_without_the_lora_converter_is_named(tmp_path, monkeypatch):
    from loraship.llamacpp.llamacpp import lora_converter

    for name in ("convert_hf_to_gguf.py", "conversion", "gguf-py"):
        (tmp_path / name).mkdir() if "." not in name else (tmp_path / name).write_text("")
    monkeypatch.setenv("LORASHIP_LLAMA_CPP_DIR", str(tmp_path))
    with pytest.raises(LorashipError, match="convert_lora_to_gguf.py.*adapter_gguf: false"):
        lora_converter()


def test_a_gguf_that_lost_the_fine_tune_fails_the_fine_tune_gates(adapter_run, tmp_path):
    """The base model's own GGUF, verified against the merged model's reference as if it were the
    shipped file: exact KL to the merged model is as large as the base's, and the golden answers the
    fine-tune changed come back as the base's, so both fine-tune gates fail (and the shipped GGUF passes them)."""
    from types import SimpleNamespace

    from loraship.constants import REFERENCE_TOPK_FILE
    from loraship.verification.gates import finetune_answers_gate, finetune_kl_gate
    from loraship.verification.measure_child import measure_apart

    config, _ = adapter_run
    reference_dir = stage_dir(config, "reference")
    job = {
        "gguf": str(stage_dir(config, "convert") / base_gguf_name(config.primary_quantization)),
        "n_ctx": 256,
        "n_gpu_layers": 0,
        "device": "cpu",
        "seed": config.seed,
        "reference": str(reference_dir / REFERENCE_FILE),
        "topk": str(reference_dir / REFERENCE_TOPK_FILE),
        "fields": {},
        "max_new_tokens": config.max_new_tokens,
        "golden_margin": config.golden_margin,
        "min_scored_tokens": config.min_scored_tokens,
    }
    measured = measure_apart(SimpleNamespace(dir=tmp_path), job)
    agreement = measured["eval_agreement"]
    assert agreement["kl_method"] == "exact" and agreement["finetune_tokens"] >= config.min_scored_tokens
    kl_gate = finetune_kl_gate(agreement, config)
    answers_gate = finetune_answers_gate(measured["golden"], config)
    assert not kl_gate.passed and kl_gate.value > 0.5, kl_gate
    assert not answers_gate.passed, answers_gate
    shipped = json.loads((stage_dir(config, "verify") / VERIFY_FILE).read_text())["gates"]
    assert shipped["finetune_kept_kl"]["passed"] and shipped["finetune_kept_answers"]["passed"]
