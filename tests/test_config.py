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


BASE = {"base_model": "m", "datasets": [{"path": "x.jsonl", "type": "chat"}]}


@pytest.mark.parametrize(
    "given, listed",
    [
        (None, ["Q4_K_M"]),
        ("Q8_0", ["Q8_0"]),
        (["Q5_K_M", "Q4_K_M", "Q8_0"], ["Q5_K_M", "Q4_K_M", "Q8_0"]),
    ],
)
def test_quantization_is_one_name_or_a_list(given, listed):
    config = parse_config({**BASE, **({"quantization": given} if given else {})})
    assert config.quantization == config.quantizations == listed
    assert config.primary_quantization == listed[0]  # the first is the primary, in the order written
    # The same single quantization written either way is the same config.
    if isinstance(given, str):
        assert config.fingerprint() == parse_config({**BASE, "quantization": [given]}).fingerprint()


@pytest.mark.parametrize(
    "given, message",
    [
        (
            "Q3_K_XL",
            "'Q3_K_XL' is not allowed; use 'Q8_0', 'Q6_K', 'Q5_K_M', 'Q5_K_S', 'Q4_K_M', 'Q4_K_S', 'IQ4_XS', "
            "'Q3_K_L', 'Q3_K_M', 'IQ3_M' or 'auto'",
        ),
        (
            ["Q4_K_M", "IQ2_XXS"],
            "quantization.1: 'IQ2_XXS' is not allowed; use 'Q8_0', 'Q6_K', 'Q5_K_M', 'Q5_K_S', 'Q4_K_M', 'Q4_K_S', "
            "'IQ4_XS', 'Q3_K_L', 'Q3_K_M', 'IQ3_M' or 'auto'",
        ),
        ([], "quantization: list is empty"),
        (["Q8_0", "Q4_K_M", "Q8_0"], "Q8_0 listed more than once"),
    ],
)
def test_bad_quantization_lists_the_valid_ones(given, message):
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, "quantization": given})
    assert message in str(e.value)


def test_plan_sizes_disk_for_every_quantization_and_the_gpu_for_each():
    from loraship.planning.shape import shape_from_config
    from loraship.planning.shipping import plan_disk_and_inference

    shape = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
    }
    one = plan_disk_and_inference(shape_from_config(shape), parse_config(BASE))
    both = plan_disk_and_inference(
        shape_from_config(shape), parse_config({**BASE, "quantization": ["Q4_K_M", "Q8_0"]})
    )
    assert both["inference"]["total_gib"] == one["inference"]["total_gib"]  # the primary's, as before
    assert both["inference"]["quantization"] == "Q4_K_M"
    assert set(both["inference"]["by_quantization"]) == {"Q4_K_M", "Q8_0"}
    q8 = both["inference"]["by_quantization"]["Q8_0"]["gguf_gib"]
    assert both["disk_gib"]["quantize"] == pytest.approx(one["disk_gib"]["quantize"] + q8, abs=0.02)
