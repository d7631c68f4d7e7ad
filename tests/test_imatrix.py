"""imatrix: true (the default, see the README's quantization section): the importance matrix from the run's own
training texts, made by llama.cpp's llama-imatrix and used by llama-quantize --imatrix, both built from the pinned
source (loraship/llamacpp/tools.py); imatrix: false keeps llama-cpp-python's quantize binding."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.constants import IMATRIX_FILE, IMATRIX_TEXT_FILE, MODEL_CARD, quantized_gguf_name
from loraship.errors import ConfigError, DataError, LorashipError
from loraship.runtime.manifest import read_manifest, sha256_file
from loraship.runtime.stage import stage_dir


@pytest.fixture(scope="session")
def llama_tools() -> Path:
    """The three tools, built once per llama.cpp version into LORASHIP_CACHE (minutes on a cold cache) and shared
    by every test and run of the session."""
    from loraship.llamacpp.tools import tools_dir

    return tools_dir()


@pytest.fixture(scope="module")
def imatrix_run(llama_tools, pipeline_run):
    """The session's demo run, made with the default imatrix: true."""
    config, manifests = pipeline_run
    assert config.imatrix  # the default
    return config, manifests


def copy_of_run(config, tmp_path: Path, **changes):
    """The session pipeline's stage folders copied, with a config that differs in `changes`: a stage run here cannot
    disturb the run the other tests share."""
    shutil.copytree(Path(config.workdir) / config.run_name, tmp_path / "work" / config.run_name, symlinks=True)
    return parse_config(
        {
            **config.model_dump(mode="json"),
            "workdir": str(tmp_path / "work"),
            "output": str(tmp_path / "artifacts"),
            **changes,
        }
    )


def test_tools_are_built_from_the_pinned_source(llama_tools):
    from loraship.constants import LLAMA_CPP_PYTHON_VERSION
    from loraship.llamacpp.tools import TOOLS, build_info

    for name in TOOLS:
        assert (llama_tools / name).is_file()
    info = build_info()
    if info:  # absent only for tools given by LORASHIP_LLAMA_CPP_TOOLS_DIR
        assert info["llama_cpp_python"] == LLAMA_CPP_PYTHON_VERSION and info["tools"] == list(TOOLS)
        assert "-DBUILD_SHARED_LIBS=OFF" in info["cmake_args"]


def test_the_importance_matrix_is_computed_once_and_used_by_every_quantization(imatrix_run):
    from gguf import GGUFReader

    config, manifests = imatrix_run
    assert not manifests["quantize"].get("_skipped")
    made = manifests["quantize"]["metrics"]
    imatrix = made["imatrix"]
    folder = stage_dir(config, "quantize")
    assert imatrix["sha256"] == sha256_file(folder / IMATRIX_FILE)
    assert IMATRIX_FILE in manifests["quantize"]["outputs"]  # resumable like every stage output
    # llama-imatrix's GGUF, read back with gguf-py: sums of squared activations and counts per weight it saw.
    reader = GGUFReader(folder / IMATRIX_FILE)
    sums = {t.name.removesuffix(".in_sum2"): t for t in reader.tensors if t.name.endswith(".in_sum2")}
    counts = {t.name.removesuffix(".counts") for t in reader.tensors if t.name.endswith(".counts")}
    assert sums and set(sums) == counts and len(sums) == imatrix["weights"]
    assert all(name.startswith("blk.") for name in sums)  # output.weight is left out, as llama.cpp advises
    assert all((t.data >= 0).all() and t.data.sum() > 0 for t in sums.values())
    assert imatrix["chunks"] >= 2 and imatrix["chunk_tokens"] == min(512, config.imatrix_min_tokens // 2)
    assert imatrix["text_tokens"] >= config.imatrix_min_tokens
    # The training texts as training saw them: the chat template's markers are in the calibration text.
    text = (folder / IMATRIX_TEXT_FILE).read_text(encoding="utf-8")
    assert imatrix["texts"] == sum(1 for _ in open(config.datasets[0].path, encoding="utf-8"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stage_dir(config, "merge") / "merged")
    marker = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)
    assert marker in text
    for q, each in made["quantizations"].items():
        assert each["imatrix_sha256"] == imatrix["sha256"] and each["quantizer"].startswith("llama-quantize --imatrix")
    card = (Path(config.output) / config.run_name / MODEL_CARD).read_text(encoding="utf-8")
    assert "Quantized with an importance matrix computed by llama.cpp's `llama-imatrix`" in card
    assert f"{imatrix['text_tokens']:,} tokens" in card


def test_imatrix_false_quantizes_with_the_binding(imatrix_run, tmp_path):
    # In the folder of a run made with the matrix, imatrix: false makes the binding's GGUF anew.
    config, manifests = imatrix_run
    plain = copy_of_run(config, tmp_path, imatrix=False)
    made = importlib.import_module("loraship.stages.quantize").run(plain)
    assert not made.get("_skipped") and made["metrics"]["imatrix"] is None
    q4 = made["metrics"]["quantizations"]["Q4_K_M"]
    assert q4["quantizer"] == "llama-cpp-python llama_model_quantize" and q4["imatrix_sha256"] is None
    assert not q4["reused"]  # a GGUF made with the importance matrix is not what imatrix: false makes
    assert not (stage_dir(plain, "quantize") / IMATRIX_FILE).exists()
    # The importance matrix changed the weights: the two Q4_K_M files differ.
    name = quantized_gguf_name("Q4_K_M")
    assert made["outputs"][name]["sha256"] != manifests["quantize"]["outputs"][name]["sha256"]
    # Back to imatrix: true in the same folder: the binding's GGUF is not kept as if made with the matrix.
    again = importlib.import_module("loraship.stages.quantize").run(
        parse_config({**plain.model_dump(mode="json"), "imatrix": True})
    )
    q4 = again["metrics"]["quantizations"]["Q4_K_M"]
    assert not q4["reused"] and q4["quantizer"].startswith("llama-quantize --imatrix")
    assert again["outputs"][name]["sha256"] != made["outputs"][name]["sha256"]


def test_rerun_keeps_the_importance_matrix_and_the_ggufs_made_with_it(imatrix_run, tmp_path):
    config, manifests = imatrix_run
    both = copy_of_run(config, tmp_path, quantization=["Q4_K_M", "Q8_0"])
    # The copy's own manifest, not the fixture's: a test elsewhere in this process may have rerun quantize on the
    # shared run since (xdist puts files in other orders), which leaves an equal matrix with its own timing.
    before = read_manifest(stage_dir(both, "quantize"))["metrics"]["imatrix"]
    made = importlib.import_module("loraship.stages.quantize").run(both)["metrics"]
    assert made["imatrix"]["sha256"] == before["sha256"] == manifests["quantize"]["metrics"]["imatrix"]["sha256"]
    assert made["imatrix"].get("seconds") == before.get("seconds")  # not made again
    assert made["quantizations"]["Q4_K_M"]["reused"] and not made["quantizations"]["Q8_0"]["reused"]
    assert made["quantizations"]["Q8_0"]["imatrix_sha256"] == made["imatrix"]["sha256"]


def test_too_little_training_text_names_the_count_and_the_fix(imatrix_run, tmp_path):
    config, manifests = imatrix_run
    tokens = manifests["quantize"]["metrics"]["imatrix"]["text_tokens"]
    short = copy_of_run(config, tmp_path, imatrix_min_tokens=tokens + 1)
    with pytest.raises(DataError) as caught:
        importlib.import_module("loraship.stages.quantize").run(short)
    message = str(caught.value)
    assert f"the training texts are {tokens} tokens, fewer than imatrix_min_tokens {tokens + 1}" in message
    assert "lower imatrix_min_tokens" in message and "imatrix: false" in message


def test_a_large_split_is_sampled_down_to_imatrix_max_tokens(imatrix_run, tmp_path):
    """Past imatrix_max_tokens whole training rows are drawn in a seeded order (not the split's first rows) until
    that many tokens; the manifest and the card say what they were drawn from."""
    from loraship.stages import quantize

    config, manifests = imatrix_run
    full = manifests["quantize"]["metrics"]["imatrix"]
    small = copy_of_run(config, tmp_path / "a", imatrix_min_tokens=256, imatrix_max_tokens=512)
    made = quantize.run(small)["metrics"]["imatrix"]
    assert made["split_texts"] == full["texts"] and made["split_tokens"] == full["text_tokens"]
    assert 512 <= made["text_tokens"] < full["text_tokens"] and made["texts"] < full["texts"]
    # Each row drawn was needed: without any one of them the draw was still short of the cap.
    from transformers import AutoTokenizer

    from loraship.data import encoded_splits

    train, _ = encoded_splits(small, AutoTokenizer.from_pretrained(stage_dir(small, "merge") / "merged"))
    assert made["text_tokens"] - max(len(record["input_ids"]) for _, record in train) < 512
    # Seeded: the same config draws the same rows; another seed draws others.
    again = quantize.run(copy_of_run(config, tmp_path / "b", imatrix_min_tokens=256, imatrix_max_tokens=512))
    assert again["metrics"]["imatrix"]["text_sha256"] == made["text_sha256"]
    other = quantize.run(copy_of_run(config, tmp_path / "c", imatrix_min_tokens=256, imatrix_max_tokens=512, seed=7))
    assert other["metrics"]["imatrix"]["text_sha256"] != made["text_sha256"]
    from loraship.publishing.model_card import imatrix_line

    assert f"drawn by seed from the split's {full['texts']} texts" in imatrix_line(quantize.run(small)["metrics"])


def test_imatrix_max_tokens_below_the_minimum_is_refused():
    base = {"base_model": "org/model", "datasets": [{"path": "train.jsonl", "type": "chat"}]}
    with pytest.raises(ConfigError, match="imatrix_max_tokens .600. is below imatrix_min_tokens .1024."):
        parse_config({**base, "imatrix_max_tokens": 600})


def test_the_plan_refuses_too_little_text_before_training(imatrix_run, tmp_path):
    """The plan counts the training split's tokens as quantize does, and stops the run before any GPU hour; with
    imatrix: false the same data passes."""
    from loraship.planning.preflight import check_inputs

    config, manifests = imatrix_run
    tokens = manifests["quantize"]["metrics"]["imatrix"]["text_tokens"]
    check_inputs(copy_of_run(config, tmp_path / "enough", imatrix_min_tokens=tokens))
    with pytest.raises(ConfigError) as caught:
        check_inputs(copy_of_run(config, tmp_path / "short", imatrix_min_tokens=tokens + 1))
    message = str(caught.value)
    assert f"the training texts are {tokens} tokens, fewer than imatrix_min_tokens {tokens + 1}" in message
    assert "Add training data" in message and "imatrix: false" in message
    check_inputs(copy_of_run(config, tmp_path / "off", imatrix_min_tokens=tokens + 1, imatrix=False))


def test_a_machine_without_cmake_is_told_what_to_install(monkeypatch, tmp_path):
    from loraship.llamacpp import tools

    monkeypatch.setenv("LORASHIP_CACHE", str(tmp_path))  # nothing built here
    monkeypatch.delenv("LORASHIP_LLAMA_CPP_TOOLS_DIR", raising=False)
    real_which = shutil.which
    monkeypatch.setattr(tools.shutil, "which", lambda name: None if name == "cmake" else real_which(name))
    with pytest.raises(LorashipError) as caught:
        tools.tools_dir()
    message = str(caught.value)
    assert "needs cmake" in message and "apt-get install cmake g++ make" in message
    assert "LORASHIP_LLAMA_CPP_TOOLS_DIR" in message and "imatrix: false" in message
    assert not (tmp_path / "llama.cpp-src-0.3.36").exists()  # refused before downloading anything


def test_tools_dir_from_the_environment_must_hold_the_tools(monkeypatch, tmp_path):
    from loraship.llamacpp import tools

    monkeypatch.setenv("LORASHIP_LLAMA_CPP_TOOLS_DIR", str(tmp_path))
    with pytest.raises(LorashipError, match="does not hold the executables llama-imatrix, llama-quantize"):
        tools.tools_dir()


def test_imatrix_min_tokens_below_two_chunks_of_128_is_refused():
    base = {"base_model": "org/model", "datasets": [{"path": "train.jsonl", "type": "chat"}]}
    with pytest.raises(ConfigError, match="imatrix_min_tokens"):
        parse_config({**base, "imatrix_min_tokens": 100})
    assert parse_config(base).imatrix is True
    assert parse_config({**base, "imatrix": False}).imatrix is False


def test_a_q8_0_only_run_skips_the_matrix_it_could_not_use(imatrix_run, tmp_path):
    """llama.cpp's Q8_0 ignores an importance matrix: a run making only Q8_0 computes none, asks the plan for no
    minimum of text, says why in the manifest, and its Q8_0 tensors are those the matrix run made."""
    from gguf import GGUFReader

    from loraship.planning.preflight import check_inputs

    config, manifests = imatrix_run
    tokens = manifests["quantize"]["metrics"]["imatrix"]["text_tokens"]
    both = copy_of_run(config, tmp_path / "both", quantization=["Q4_K_M", "Q8_0"])
    with_matrix = importlib.import_module("loraship.stages.quantize").run(both)
    assert with_matrix["metrics"]["quantizations"]["Q8_0"]["imatrix_sha256"]  # a mixed run passes it to Q8_0 too
    q8 = copy_of_run(config, tmp_path / "q8", quantization="Q8_0", imatrix_min_tokens=tokens + 1)
    assert q8.imatrix and not q8.imatrix_in_use
    assert copy_of_run(config, tmp_path / "auto", quantization="auto").imatrix_in_use  # the ladder has K- and I-quants
    check_inputs(q8)  # too little text for a matrix, but none is needed
    made = importlib.import_module("loraship.stages.quantize").run(q8)
    metrics = made["metrics"]
    assert metrics["imatrix"] is None and "Q8_0 cannot use one" in metrics["imatrix_unused"]
    assert metrics["quantizer"] == "llama-cpp-python llama_model_quantize"
    assert not (stage_dir(q8, "quantize") / IMATRIX_FILE).exists()
    name = quantized_gguf_name("Q8_0")

    def tensors(path):
        return {t.name: t.data.tobytes() for t in GGUFReader(path).tensors}

    assert tensors(stage_dir(q8, "quantize") / name) == tensors(stage_dir(both, "quantize") / name)
    from loraship.publishing.model_card import imatrix_line

    assert "Q8_0 cannot use one" in imatrix_line(metrics)
