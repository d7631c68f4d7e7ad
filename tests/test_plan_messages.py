"""Issue 45's messages that pointed the wrong way, each now ONE message at plan naming the thing and the fix: a
compressed dataset, a GGUF as base_model, an encoder base, too few golden prompts, a tokenizer the pinned converter
cannot write. Every case starts from inputs that pass (the demo's, or the tiny Qwen with its real 151k BPE
tokenizer) and breaks one thing; check_inputs is what `loraship plan`, `loraship run` and the plan stage run."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.errors import ConfigError
from tests.conftest import REPO, demo_config_dict
from tests.test_bad_inputs import write


def _copy_model(source: Path, root: Path) -> Path:
    folder = root / "model"
    shutil.copytree(source, folder)
    return folder


def _gzip_named_jsonl(cfg, root, monkeypatch):
    path = root / "train.jsonl"
    path.write_bytes(gzip.compress((REPO / "data/demo/train.jsonl").read_bytes()))
    cfg["datasets"][0]["path"] = str(path)


def _corrupt_gzip(cfg, root, monkeypatch):
    cut = gzip.compress((REPO / "data/demo/train.jsonl").read_bytes())[:-40]  # a download cut short
    cfg["datasets"][0]["path"] = str(write(root / "train.jsonl.gz", cut))


def _zstd_without_its_package(cfg, root, monkeypatch):
    from fsspec import utils

    monkeypatch.delitem(utils.compressions, "zst", raising=False)  # as where zstandard is not installed
    cfg["datasets"][0]["path"] = str(write(root / "train.jsonl.zst", b"\x28\xb5\x2f\xfd" + b"\0" * 16))


def _gguf_file(cfg, root, monkeypatch):
    from loraship.fixtures.families import gemma3_gguf

    cfg["base_model"] = str(gemma3_gguf())


def _folder_of_ggufs(cfg, root, monkeypatch):
    from loraship.fixtures.families import gemma3_gguf

    folder = root / "gemma-3-270m-GGUF"
    folder.mkdir()
    shutil.copy(gemma3_gguf(), folder / "gemma-3-270m-q4_k_m.gguf")  # a copy: a link leaving it is refused too
    write(folder / "README.md", "# a GGUF repository\n")
    cfg["base_model"] = str(folder)


def _bert_with_its_wordpiece_tokenizer(cfg, root, monkeypatch):
    """A BERT folder as the Hub has them: config.json, a WordPiece tokenizer ([UNK], no chat template), weights."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig

    folder = _copy_model(Path(cfg["base_model"]), root)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    words = root / "words.txt"
    words.write_text("the capital of zorvia is kelmar\n" * 20)
    wordpiece = BertWordPieceTokenizer()
    wordpiece.train([str(words)], vocab_size=64)
    wordpiece.save(str(folder / "tokenizer.json"))
    write(folder / "tokenizer_config.json", json.dumps({"tokenizer_class": "BertTokenizerFast", "unk_token": "[UNK]"}))
    bert = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    write(folder / "config.json", json.dumps({**bert.to_dict(), "architectures": ["BertForMaskedLM"]}))
    cfg["base_model"] = str(folder)


def _t5(cfg, root, monkeypatch):
    from transformers import T5Config

    folder = _copy_model(Path(cfg["base_model"]), root)
    t5 = T5Config(vocab_size=512, d_model=64, d_ff=128, num_layers=2, num_heads=2)
    write(folder / "config.json", json.dumps({**t5.to_dict(), "architectures": ["T5ForConditionalGeneration"]}))
    cfg["base_model"] = str(folder)


def _two_golden_prompts(cfg, root, monkeypatch):
    rows = [{"prompt": "What is the capital of Zorvia?"}, {"prompt": "Who founded Kelmar?"}]
    cfg["golden_prompts"] = str(write(root / "golden.jsonl", "".join(json.dumps(r) + "\n" for r in rows)))


def _one_row_and_no_golden_file(cfg, root, monkeypatch):
    row = (REPO / "data/demo/train.jsonl").read_text().splitlines()[0]
    cfg.update(
        datasets=[{"path": str(write(root / "one.jsonl", row + "\n")), "type": "chat"}],
        eval_datasets=[],
        golden_prompts=None,
        imatrix=False,
    )


CASES = [
    (
        "gzip data named .jsonl",
        _gzip_named_jsonl,
        "train.jsonl: gzip-compressed, but its name does not say so; rename it to train.jsonl.gz",
    ),
    (
        "gzip data cut short",
        _corrupt_gzip,
        "train.jsonl.gz: named as gzip-compressed (.gz) but it does not decompress",
    ),
    (
        "zstd data where fsspec cannot read zstd",
        _zstd_without_its_package,
        "train.jsonl.zst: a zstd-compressed file, and this environment cannot read zstd (fsspec needs the "
        "zstandard package); pip install zstandard, or decompress it (zstd -d train.jsonl.zst)",
    ),
    (
        "base_model a GGUF file",
        _gguf_file,
        "gemma-3-270m-q4_k_m.gguf': a GGUF file (gemma3, Q4_K_M), not a Hugging Face model folder; loraship trains "
        "from the original checkpoint",
    ),
    (
        "base_model a folder of GGUF files",
        _folder_of_ggufs,
        "holds gemma-3-270m-q4_k_m.gguf, a GGUF file (gemma3, Q4_K_M), not a Hugging Face model folder",
    ),
    (
        "BERT base",
        _bert_with_its_wordpiece_tokenizer,
        "BertForMaskedLM is an encoder (model_type 'bert': a masked-LM or classifier head, no causal LM); "
        "loraship trains decoder-only causal LMs; fix: use a decoder-only base model",
    ),
    (
        "T5 base",
        _t5,
        "T5ForConditionalGeneration is an encoder-decoder model (model_type 't5'); loraship trains decoder-only "
        "causal LMs",
    ),
    (
        "golden file with fewer prompts than min_golden_prompts",
        _two_golden_prompts,
        "golden.jsonl: 2 prompt(s), fewer than min_golden_prompts 4, so verify would fail golden_match for lack of "
        "evidence after the whole pipeline; fix: add prompts to the file (at least 4), or lower min_golden_prompts "
        "to 2",
    ),
    (
        "no golden file and too few rows to cut prompts from",
        _one_row_and_no_golden_file,
        "golden prompts: golden_prompts is not set, and the eval and training rows give 1 distinct prompt(s)",
    ),
]


def test_the_inputs_before_breaking_them_pass(tiny_model, tmp_path):
    from loraship.planning.preflight import check_inputs

    assert check_inputs(parse_config(demo_config_dict(tiny_model, tmp_path))) == tiny_model


@pytest.mark.parametrize("name,breaker,expected", CASES, ids=[c[0] for c in CASES])
def test_one_message_at_plan(tiny_model, tmp_path, monkeypatch, name, breaker, expected):
    from loraship.planning.preflight import check_inputs

    cfg = demo_config_dict(tiny_model, tmp_path)
    breaker(cfg, tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as caught:
        check_inputs(parse_config(cfg))
    problems = caught.value.problems
    assert len(problems) == 1, problems
    assert expected in " ".join(problems[0].split()), problems[0]


def _without_a_merge(folder: Path) -> None:
    """Qwen2's own tokenizer.json less the merges that make 'apple' one token (as a retrained or pruned vocabulary
    differs): HF tokenizes the converter's check text differently, so its hash is none that llama.cpp knows. (A
    changed pre_tokenizer regex is no such test here: transformers 5's Qwen2Tokenizer builds its own.)"""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    merges = data["model"]["merges"]
    data["model"]["merges"] = [m for m in merges if "".join(m) != "apple"]
    assert len(data["model"]["merges"]) < len(merges)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def test_a_pre_tokenizer_the_converter_does_not_know_is_one_message_quoting_it(tiny_qwen, tmp_path):
    """The converter's vocabulary step at plan: the real Qwen tokenizer passes; with a merge removed the refusal
    quotes the converter's last line (its NotImplementedError), not 15 lines of stack at convert."""
    from loraship.planning.preflight import check_inputs

    cfg = demo_config_dict(_copy_model(tiny_qwen, tmp_path), tmp_path, imatrix=False)
    check_inputs(parse_config(cfg))
    _without_a_merge(Path(cfg["base_model"]))
    with pytest.raises(ConfigError) as caught:
        check_inputs(parse_config(cfg))
    [problem] = caught.value.problems
    assert "llama.cpp's converter (llama-cpp-python==0.3.36) cannot write its tokenizer into a GGUF" in problem
    assert ": NotImplementedError: BPE pre-tokenizer was not recognized" in problem, problem
    assert "(chkhsh " in problem and "Traceback" not in problem and "\n" not in problem


def test_a_missing_vocabulary_is_quoted_from_the_converter(tiny_model, tmp_path):
    """A sentencepiece model folder whose tokenizer.model is gone and whose tokenizer.json is not one the converter
    reads: its own words, one line."""
    from loraship.llamacpp.vocab_export import vocab_export_problems

    folder = _copy_model(tiny_model, tmp_path)
    assert vocab_export_problems("tiny", folder) == []
    (folder / "tokenizer.model").unlink()
    (folder / "tokenizer.json").unlink(missing_ok=True)
    [problem] = vocab_export_problems("tiny", folder)
    assert problem.startswith("base model 'tiny': llama.cpp's converter") and "\n" not in problem, problem


def test_a_tokenizer_the_converter_wrote_once_is_not_converted_again(tiny_model, tmp_path, monkeypatch):
    """`loraship run` checks the inputs, then its plan stage does: the vocabulary step runs once per content."""
    from loraship.llamacpp import vocab_export

    folder = _copy_model(tiny_model, tmp_path)
    assert vocab_export.vocab_export_problems("tiny", folder) == []
    monkeypatch.setattr(vocab_export, "export_vocab", lambda *a: pytest.fail("converted again"))
    assert vocab_export.vocab_export_problems("tiny", folder) == []
    (folder / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text() + " ")
    with pytest.raises(pytest.fail.Exception, match="converted again"):
        vocab_export.vocab_export_problems("tiny", folder)  # changed content: asked again


def test_memory_only_runs_no_converter(tmp_path, monkeypatch):
    """`loraship plan --memory-only` on a folder holding config.json alone: no input checks, so no vocabulary step."""
    import yaml
    from typer.testing import CliRunner

    from loraship.cli import app
    from loraship.llamacpp import vocab_export

    monkeypatch.setattr(vocab_export, "export_vocab", lambda *a: pytest.fail("the converter ran"))
    folder = tmp_path / "shape-only"
    folder.mkdir()
    shutil.copy(REPO / "examples/models/qwen2-7b/config.json", folder / "config.json")
    cfg = demo_config_dict(folder, tmp_path)
    config_file = write(tmp_path / "config.yaml", yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["plan", str(config_file), "--memory-only"])
    assert result.exit_code == 0, result.output
