"""Config: every shipped YAML validates; bad configs list all their problems at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loraship.config import load_config, parse_config
from loraship.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(REPO.glob("configs/*.yaml")) + sorted(REPO.glob("deploy/gitops/specs/*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_yaml_validates(path):
    config = load_config(path)
    assert config.datasets


def test_there_are_shipped_configs():
    assert any(p.name == "demo.yaml" for p in SHIPPED)


def test_all_errors_listed_at_once():
    bad = {
        "base_model": "m",
        "datasets": [{"path": "x.jsonl", "type": "oasst"}],
        "lora_r": 0,
        "quantization": "Q3_XL",
        "learning_rate": -1,
        "micro_batchsize": 2,
    }
    with pytest.raises(ConfigError) as e:
        parse_config(bad, source="bad.yaml")
    text = str(e.value)
    for needle in ("datasets.0.type", "lora_r", "quantization", "learning_rate", "micro_batchsize"):
        assert needle in text, text
    assert len(e.value.problems) == 5
    assert "did you mean 'micro_batch_size'" in text
    assert "'Q3_XL' is not allowed" in text


def test_run_name_cannot_escape_artifact_root():
    with pytest.raises(ConfigError, match="run_name"):
        parse_config({"base_model": "m", "datasets": [{"path": "a", "type": "chat"}], "run_name": "../../etc"})


def test_run_name_defaults_to_file_stem(tmp_path):
    path = tmp_path / "my-model.yaml"
    path.write_text(yaml.safe_dump({"base_model": "m", "datasets": [{"path": "a", "type": "chat"}]}))
    assert load_config(path).run_name == "my-model"


def test_hub_id_and_local_path_are_told_apart():
    make = lambda b: parse_config({"base_model": b, "datasets": [{"path": "a", "type": "chat"}]})  # noqa: E731
    assert not make("Qwen/Qwen2-7B").base_model_is_local()
    assert make("./models/x").base_model_is_local()
    assert make("/abs/path").base_model_is_local()
