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
    (folder / "model.safetensors").write_bytes(b"")
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


CASES = [
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
