"""Invariants of one pipeline run on the tiny model (see conftest.pipeline_run)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from loraship.constants import F16_GGUF, GGUF_FILE_TYPES, MANIFEST_NAME, MERGED_DIR, STAGES, quantized_gguf_name
from loraship.llamacpp.gguf_info import read_gguf
from loraship.runtime.manifest import sha256_file
from loraship.runtime.stage import stage_dir


def test_every_stage_wrote_a_manifest_with_checksums(pipeline_run):
    config, manifests = pipeline_run
    for stage in STAGES:
        manifest = json.loads((stage_dir(config, stage) / MANIFEST_NAME).read_text())
        assert manifest["stage"] == stage
        assert manifest["outputs"], stage
        for rel, info in manifest["outputs"].items():
            assert sha256_file(stage_dir(config, stage) / rel) == info["sha256"]
        assert manifest["versions"]["llama-cpp-python"]


def test_published_artifact(pipeline_run):
    config, _ = pipeline_run
    root = Path(config.output) / config.run_name
    gguf = root / quantized_gguf_name(config.primary_quantization)
    assert read_gguf(gguf)["fields"]["general.file_type"] == GGUF_FILE_TYPES["Q4_K_M"] == 15
    assert (root / "adapter" / "adapter_model.safetensors").is_file()
    published = json.loads((root / MANIFEST_NAME).read_text())
    for rel, info in published["files"].items():
        assert sha256_file(root / rel) == info["sha256"], rel
    for stage in STAGES[:-1]:
        assert (root / "manifests" / f"{stage}.json").is_file()
    verify = json.loads((root / "verify.json").read_text())
    assert verify["passed"] and all(g["passed"] for g in verify["gates"].values())


def test_training_improved_eval_loss(pipeline_run):
    _, manifests = pipeline_run
    m = manifests["train"]["metrics"]
    assert m["eval_loss_after"] < m["eval_loss_before"]


def test_merge_probe_invariant(pipeline_run):
    _, manifests = pipeline_run
    probe = manifests["merge"]["metrics"]
    assert probe["merge_matches_adapter"] and probe["merge_differs_from_base"]
    assert probe["argmax_agreement_merged_vs_adapter"] == 1.0


def test_fp32_merge_equals_base_plus_adapter_exactly(pipeline_run, tiny_model, tmp_path):
    """Without bf16 storage rounding, the shard merge equals PEFT's unmerged forward."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraship.stages.merge import merge_shards

    config, _ = pipeline_run
    adapter = stage_dir(config, "train") / "adapter"
    merge_shards(tiny_model, adapter, tmp_path, dtype_name="float32")
    ids = torch.tensor([[1, 3, 40, 41, 42, 4, 50, 51]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(merged, base_logits, atol=1e-2)


def test_gguf_reads_back(pipeline_run):
    config, _ = pipeline_run
    f16 = read_gguf(stage_dir(config, "convert") / F16_GGUF)
    q4 = read_gguf(stage_dir(config, "quantize") / quantized_gguf_name("Q4_K_M"))
    assert f16["fields"]["general.file_type"] == 1
    assert q4["fields"]["general.file_type"] == 15
    assert q4["tensor_count"] == f16["tensor_count"] > 0
    assert q4["fields"]["tokenizer.chat_template"]
    assert q4["fields"]["general.architecture"] == "llama"


def test_llama_cpp_greedy_equals_hf_greedy_on_f16(pipeline_run):
    """On the F16 GGUF (no quantization noise) llama.cpp must decode exactly like HF."""
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraship.chat import render
    from loraship.data import read_rows
    from loraship.verification.llama_ops import greedy

    config, _ = pipeline_run
    merged = stage_dir(config, "merge") / MERGED_DIR
    tok = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    llm = Llama(str(stage_dir(config, "convert") / F16_GGUF), n_ctx=256, logits_all=True, verbose=False)
    rows = read_rows(config.golden_prompts, "golden")
    for row in rows:
        prompt = render(tok, row["messages"], add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )[0, len(ids) :].tolist()
        hf = out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
        assert greedy(llm, ids, 10, {tok.eos_token_id})[0] == hf


def test_resume_after_one_output_is_deleted(pipeline_run):
    """Delete the quantized GGUF: only quantize reruns. Its output is bit-identical, so verify
    and publish, keyed on content hashes rather than timestamps, stay skipped."""
    config, first = pipeline_run
    (stage_dir(config, "quantize") / quantized_gguf_name(config.primary_quantization)).unlink()
    again = {stage: importlib.import_module(f"loraship.stages.{stage}").run(config) for stage in STAGES}
    ran = {stage for stage, m in again.items() if not m.get("_skipped")}
    assert ran == {"quantize"}
    assert again["quantize"]["outputs"] == first["quantize"]["outputs"]  # deterministic requantization


def test_changed_upstream_output_reruns_downstream(pipeline_run):
    """A different quantization re-plans (cheap) and requantizes; training and merge are untouched."""
    config, _ = pipeline_run
    q8 = config.model_copy(update={"quantization": ["Q8_0"], "run_name": config.run_name})
    again = {stage: importlib.import_module(f"loraship.stages.{stage}").run(q8) for stage in STAGES}
    ran = {stage for stage, m in again.items() if not m.get("_skipped")}
    assert ran == {"plan", "quantize", "verify", "publish"}
    assert again["verify"]["metrics"]["passed"]
    # Back to the fixture's configuration for the tests that follow (plan too: its manifest is keyed on
    # the quantizations, and tests that copy the trained stages expect it to be skipped).
    for stage in ("plan", "quantize", "verify", "publish"):
        importlib.import_module(f"loraship.stages.{stage}").run(config)


def test_corrupt_upstream_output_is_refused(pipeline_run):
    from loraship.errors import IntegrityError

    config, _ = pipeline_run
    f16 = stage_dir(config, "convert") / F16_GGUF
    original = f16.read_bytes()
    try:
        f16.write_bytes(original[: len(original) // 2])
        with pytest.raises(IntegrityError, match="model-F16.gguf"):
            importlib.import_module("loraship.stages.quantize").run(
                config.model_copy(update={"quantization": ["Q8_0"]})
            )
    finally:
        f16.write_bytes(original)


def test_publish_to_an_fsspec_url(pipeline_run):
    """Any fsspec URL works as output; the manifest lands last and lists every file's sha256."""
    import fsspec

    config, _ = pipeline_run
    remote = config.model_copy(update={"output": "memory://bucket/models"})
    manifest = importlib.import_module("loraship.stages.publish").run(remote)
    fs = fsspec.filesystem("memory")
    published = json.loads(fs.cat_file(f"/bucket/models/{config.run_name}/{MANIFEST_NAME}"))
    assert manifest["metrics"]["destination"] == f"memory://bucket/models/{config.run_name}"
    for rel, info in published["files"].items():
        data = fs.cat_file(f"/bucket/models/{config.run_name}/{rel}")
        assert len(data) == info["size"], rel
    assert published["verified"] is True


def test_hub_id_is_resolved_through_huggingface_hub(monkeypatch, tiny_model):
    """A hub id downloads config + tokenizer for plan, and safetensors (never pickles) for training."""
    import huggingface_hub

    from loraship.config import parse_config
    from loraship.models import resolve_base_model

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return str(tiny_model)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    config = parse_config(
        {
            "base_model": "Qwen/Qwen2-7B",
            "base_model_revision": "abc123",
            "datasets": [{"path": "x.jsonl", "type": "chat"}],
        }
    )
    assert resolve_base_model(config, weights=False) == tiny_model
    assert resolve_base_model(config, weights=True) == tiny_model
    (repo, rev, meta), (_, _, full) = calls
    assert repo == "Qwen/Qwen2-7B" and rev == "abc123"
    assert "config.json" in meta and "*.safetensors" not in meta
    assert "*.safetensors" in full and not any(p.endswith(".bin") for p in full)


def test_qlora_trains_on_cpu_and_merges_into_the_bf16_base(tiny_model, tmp_path):
    """bitsandbytes NF4 (double quant) on the CPU; the merge goes into the bf16 base and measures
    how far that is from the NF4 view the adapter was trained against."""
    from loraship.config import parse_config
    from tests.conftest import demo_config_dict

    config = parse_config(
        demo_config_dict(tiny_model, tmp_path, run_name="qlora", adapter="qlora", max_steps=24, micro_batch_size=8)
    )
    manifests = {s: importlib.import_module(f"loraship.stages.{s}").run(config) for s in ("plan", "train", "merge")}
    train = manifests["train"]["metrics"]
    assert train["strategy"]["adapter"] == "qlora"
    assert train["eval_loss_after"] < train["eval_loss_before"]
    merge = manifests["merge"]["metrics"]
    assert merge["merge_matches_adapter"] and merge["merge_differs_from_base"]
    assert 0 < merge["kl_nf4_training_view_to_merged_bf16"] < 0.1
    merged_config = json.loads((stage_dir(config, "merge") / MERGED_DIR / "config.json").read_text())
    assert merged_config["torch_dtype"] == "bfloat16" and "quantization_config" not in merged_config


# --- issue 25 ---------------------------------------------------------------------------------
def test_convert_manifest_without_merge_outputs_cannot_vouch_for_the_gguf(pipeline_run):
    """The digest of the merged model convert recorded is the one reference stored; a convert manifest that lost
    merge's outputs is refused loudly, not passed over."""
    from loraship.constants import REFERENCE_FILE
    from loraship.errors import IntegrityError

    from loraship.runtime.lineage import converted_from

    config, _ = pipeline_run
    reference = json.loads((stage_dir(config, "reference") / REFERENCE_FILE).read_text())
    assert converted_from(config) == reference["merged_digest"]
    manifest_path = stage_dir(config, "convert") / MANIFEST_NAME
    original = manifest_path.read_text()
    try:
        for lost in ({}, {"merge": {"outputs": {}}}, {"merge": {"outputs": {f"{MERGED_DIR}/config.json": {}}}}):
            manifest_path.write_text(json.dumps({**json.loads(original), "inputs": lost}))
            with pytest.raises(
                IntegrityError,
                match=r"records no merged model files \(inputs.merge.outputs\).*run the "
                r"convert stage again",
            ):
                converted_from(config)
    finally:
        manifest_path.write_text(original)


def test_a_gguf_llama_cpp_cannot_load_is_named_with_llama_cpps_reason(pipeline_run, tmp_path):
    from loraship.errors import IntegrityError
    from tests.test_bad_inputs import tiny_gguf

    from loraship.llamacpp.quantizing import check_loads

    config, _ = pipeline_run
    check_loads(stage_dir(config, "quantize") / quantized_gguf_name(config.primary_quantization))
    broken = tiny_gguf(tmp_path / "two-tensors.gguf")  # an F16 "llama" GGUF without the model's hyperparameters
    with pytest.raises(IntegrityError, match=r"two-tensors.gguf: llama.cpp .* cannot load it \(exit 3\):\n.*llama"):
        check_loads(broken)
    # The shipped GGUF loads, but a file that is no LoRA adapter cannot be applied to it.
    with pytest.raises(IntegrityError, match=r"two-tensors.gguf: llama.cpp .* cannot apply this LoRA adapter"):
        check_loads(stage_dir(config, "quantize") / quantized_gguf_name(config.primary_quantization), lora=broken)


@pytest.fixture(scope="module")
def lm_head_only(tiny_qwen, tmp_path_factory) -> Path:
    """The tiny Qwen2 (tied embeddings) saved with its embedding under lm_head.weight only, as some exports do."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("lm-head-only") / "model"
    shutil.copytree(tiny_qwen, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    return folder


def _through(config, stages):
    return {s: importlib.import_module(f"loraship.stages.{s}").run(config) for s in stages}


def _lm_head_config(model: Path, root: Path, **more):
    from loraship.config import parse_config
    from tests.conftest import demo_config_dict

    return parse_config(
        demo_config_dict(
            model,
            root,
            run_name="lm-head",
            max_steps=2,
            micro_batch_size=4,
            gradient_accumulation_steps=1,
            warmup_steps=0,
            **more,
        )
    )


@pytest.fixture(scope="module")
def lm_head_trained(lm_head_only, tmp_path_factory):
    """plan and train on lm_head_only, once for the two tests below, which train the same config and differ from
    merge on (each copies these stages, as tests/test_adapter_gguf.py does): one train of the tiny Qwen less."""
    config = _lm_head_config(lm_head_only, tmp_path_factory.mktemp("lm-head-trained"))
    _through(config, ["plan", "train"])
    return config


def _trained_copy(trained, model: Path, root: Path, **more):
    import shutil

    from loraship.runtime.manifest import DIGESTS_FILE
    from loraship.runtime.stage import run_dir

    ours = _lm_head_config(model, root, **more)
    for stage in ("plan", "train"):
        shutil.copytree(stage_dir(trained, stage), stage_dir(ours, stage))
    shutil.copy2(run_dir(trained) / DIGESTS_FILE, run_dir(ours) / DIGESTS_FILE)
    return ours


def test_a_tied_embedding_stored_only_as_lm_head_is_merged_under_its_own_name(lm_head_only, lm_head_trained, tmp_path):
    """transformers loads such a checkpoint, but llama.cpp's converter would write no token_embd.weight: the merge
    writes the embedding as model.embed_tokens.weight, and the GGUFs hold token_embd.weight and load."""
    from safetensors import safe_open

    from loraship.llamacpp.gguf_info import open_gguf

    # imatrix off: which tensors the GGUFs hold is the question, not how they are quantized.
    config = _trained_copy(lm_head_trained, lm_head_only, tmp_path, imatrix=False)
    manifests = _through(config, ["plan", "train", "merge", "convert", "quantize"])
    assert manifests["train"].get("_skipped")  # the copied stages stand: train is keyed on nothing imatrix changes
    assert manifests["merge"]["metrics"]["renamed_tensors"] == {"lm_head.weight": "model.embed_tokens.weight"}
    with safe_open(stage_dir(config, "merge") / MERGED_DIR / "model.safetensors", framework="pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    for gguf in (
        stage_dir(config, "convert") / F16_GGUF,
        stage_dir(config, "quantize") / quantized_gguf_name(config.primary_quantization),
    ):
        assert "token_embd.weight" in {t.name for t in open_gguf(gguf).tensors}, gguf


def test_a_gguf_without_token_embd_is_refused_at_convert(lm_head_only, lm_head_trained, tmp_path, monkeypatch):
    """Without the merge's renaming, the converter writes a GGUF llama.cpp cannot load: convert refuses it, naming
    the missing tensor, and writes no manifest (nothing downstream takes it)."""
    from loraship.errors import IntegrityError

    merge = importlib.import_module("loraship.stages.merge")
    monkeypatch.setattr(merge, "embedding_only_as_lm_head", lambda folder: False)
    config = _trained_copy(lm_head_trained, lm_head_only, tmp_path)
    _through(config, ["plan", "train", "merge"])
    with pytest.raises(IntegrityError, match=r"model-F16.gguf: llama.cpp .* cannot load it(.|\n)*token_embd.weight"):
        _through(config, ["convert"])
    assert not (stage_dir(config, "convert") / MANIFEST_NAME).exists()
