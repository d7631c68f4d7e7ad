"""Bad input: a clear message naming the problem and the fix, exit code != 0, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def fake_model(root: Path) -> Path:
    """Enough of a model folder for the checks that run before any loading."""
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (folder / "tokenizer.json").write_text("{}")
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


def good_dataset(root: Path) -> Path:
    path = root / "train.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(row) + "\n")
    return path


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _missing_base(cfg, root):
    cfg["base_model"] = str(root / "no-such-model")


def _missing_dataset(cfg, root):
    cfg["datasets"][0]["path"] = str(root / "nope.jsonl")


def _malformed_line(cfg, root):
    good = (root / "train.jsonl").read_text()
    cfg["datasets"][0]["path"] = str(write(root / "bad.jsonl", good + good + '{"messages": [\n'))


def _empty_dataset(cfg, root):
    cfg["datasets"][0]["path"] = str(write(root / "empty.jsonl", "\n\n"))


def _unknown_type(cfg, root):
    cfg["datasets"][0]["type"] = "sharegpt"


def _unknown_quant(cfg, root):
    cfg["quantization"] = "Q3_K_XL"


def _unwritable_output(cfg, root):
    blocker = write(root / "a-file", "not a folder")
    cfg["output"] = str(blocker / "artifacts")


def _non_utf8(cfg, root):
    cfg["datasets"][0]["path"] = str(write(root / "latin1.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1")))
    cfg["datasets"][0]["type"] = "completion"


def _missing_fields(cfg, root):
    cfg["datasets"][0]["path"] = str(write(root / "alpaca.jsonl", json.dumps({"instruction": "x"}) + "\n"))
    cfg["datasets"][0]["type"] = "alpaca"


def _no_tokenizer(cfg, root):
    (Path(cfg["base_model"]) / "tokenizer.json").unlink()


def _pickle_only(cfg, root):
    (Path(cfg["base_model"]) / "model.safetensors").unlink()
    write(Path(cfg["base_model"]) / "pytorch_model.bin", b"\x80\x04")


def _unknown_key(cfg, root):
    cfg["lora_rank"] = 8


def _out_of_range(cfg, root):
    cfg["lora_r"] = 0
    cfg["lora_dropout"] = 1.5


def _no_config_json(cfg, root):
    (Path(cfg["base_model"]) / "config.json").unlink()


def _unsupported_architecture(cfg, root):
    (Path(cfg["base_model"]) / "config.json").write_text(json.dumps({"architectures": ["FrobnicatorForCausalLM"]}))


def _unknown_pre_tokenizer(cfg, root):
    """A BPE tokenizer whose pre-tokenizer no llama.cpp hash table entry knows."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world", "some other text", "zorvia kelmar"] * 50,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    folder = Path(cfg["base_model"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def _chat_without_assistant(cfg, root):
    row = {"messages": [{"role": "user", "content": "hi"}]}
    cfg["datasets"][0]["path"] = str(write(root / "noanswer.jsonl", json.dumps(row) + "\n"))


def _chat_bad_role(cfg, root):
    row = {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    cfg["datasets"][0]["path"] = str(write(root / "role.jsonl", json.dumps(row) + "\n"))


def _remote_code(cfg, root):
    (Path(cfg["base_model"]) / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))


def _warmup_too_long(cfg, root):
    cfg["warmup_steps"] = 10
    cfg["max_steps"] = 5


def _bad_golden_regex(cfg, root):
    row = {"prompt": "hi", "expect_regex": "(unclosed"}
    cfg["golden_prompts"] = str(write(root / "golden.jsonl", json.dumps(row) + "\n"))


def _run_name_escape(cfg, root):
    cfg["run_name"] = "../../etc"


def _negative_learning_rate(cfg, root):
    cfg["learning_rate"] = -0.1


CASES = [
    ("values out of range", _out_of_range, "lora_r: Input should be greater than or equal to 1"),
    ("model folder without config.json", _no_config_json, "no config.json"),
    ("architecture the converter cannot handle", _unsupported_architecture,
     "FrobnicatorForCausalLM is not supported by llama.cpp's converter"),
    ("pre-tokenizer llama.cpp does not recognise", _unknown_pre_tokenizer, "pre-tokenizer is not recognised"),
    ("chat row without assistant turn", _chat_without_assistant, "no assistant message"),
    ("chat message with unknown role", _chat_bad_role, "messages[0] must be"),
    ("model needing remote code", _remote_code, "set trust_remote_code: true"),
    ("warmup longer than training", _warmup_too_long, "warmup_steps (10) must be smaller than max_steps (5)"),
    ("golden prompt with a bad regex", _bad_golden_regex, "expect_regex is not a valid regular expression"),
    ("run name escaping the artifact root", _run_name_escape, "run_name: String should match pattern"),
    ("negative learning rate", _negative_learning_rate, "learning_rate: Input should be greater than 0"),
    ("missing base model folder", _missing_base, "folder does not exist"),
    ("missing dataset file", _missing_dataset, "file not found"),
    ("malformed JSONL line", _malformed_line, "line 3: malformed JSON"),
    ("empty dataset", _empty_dataset, "empty (no rows)"),
    ("unknown dataset type", _unknown_type, "'sharegpt' is not allowed"),
    ("unknown quantization", _unknown_quant, "'Q3_K_XL' is not allowed"),
    ("unwritable output", _unwritable_output, "cannot write there"),
    ("non-UTF-8 dataset", _non_utf8, "not UTF-8"),
    ("alpaca row missing output", _missing_fields, "alpaca rows need instruction/output"),
    ("model folder without tokenizer", _no_tokenizer, "no tokenizer"),
    ("pickle-only checkpoint", _pickle_only, "only pickle checkpoints"),
    ("unknown config key", _unknown_key, "did you mean 'lora_r'"),
]


def test_yaml_syntax_error(tmp_path):
    config_file = write(tmp_path / "broken.yaml", "base_model: [unclosed\n")
    result = subprocess.run([sys.executable, "-m", "loraship.cli", "run", str(config_file)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "not valid YAML" in result.stderr and "Traceback" not in result.stderr


def test_table_has_at_least_twenty_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name,breaker,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_reported_clearly(tmp_path, name, breaker, expected):
    cfg = {
        "run_name": "bad",
        "base_model": str(fake_model(tmp_path)),
        "datasets": [{"path": str(good_dataset(tmp_path)), "type": "chat"}],
        "workdir": str(tmp_path / "work"),
        "output": str(tmp_path / "artifacts"),
    }
    breaker(cfg, tmp_path)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    result = subprocess.run(
        [sys.executable, "-m", "loraship.cli", "run", str(config_file)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert expected in " ".join(output.split()), output
    assert "Traceback" not in output, output
    assert not (tmp_path / "work" / "bad" / "train").exists()  # nothing ran
