"""Secrets from env_from_secrets live in the environment for one stage only, and never reach
the converter's children (tests/test_containers.py::test_child_gets_no_credentials)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from loraship.runtime import prefect_env
from loraship.config import parse_config
from loraship.errors import LorashipError

PLANTED = "hf_PLANTEDstageSecret0123456789"

STAGE_MODULE = """
import os
from loraship.runtime.stage import exclusive

STAGE = "plan"
seen = {}


@exclusive
def run(config):
    seen["token"] = os.environ.get("LORASHIP_TEST_TOKEN")
    return {"stage": STAGE}
"""


@pytest.fixture
def stage(tmp_path):
    path = tmp_path / "fake_stage.py"
    path.write_text(STAGE_MODULE)
    spec = importlib.util.spec_from_file_location("fake_stage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config(tmp_path, **extra):
    return parse_config(
        {
            "base_model": "org/model",
            "workdir": str(tmp_path / "work"),
            "datasets": [{"path": "x.jsonl", "type": "chat"}],
            **extra,
        }
    )


def test_secret_is_exported_for_the_stage_and_removed_after(stage, tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(prefect_env, "_load_secret", lambda block: loads.append(block) or PLANTED)
    monkeypatch.delenv("LORASHIP_TEST_TOKEN", raising=False)
    stage.run(config(tmp_path, env_from_secrets={"LORASHIP_TEST_TOKEN": "test-token"}))
    assert stage.seen["token"] == PLANTED and loads == ["test-token"]
    assert "LORASHIP_TEST_TOKEN" not in os.environ  # not left behind for the next stage or a child
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and PLANTED.encode() in p.read_bytes()]
    assert not leaks  # lock and claim files included


def test_environment_wins_over_the_block(stage, tmp_path, monkeypatch):
    monkeypatch.setattr(prefect_env, "_load_secret", lambda block: pytest.fail("no Prefect needed"))
    monkeypatch.setenv("LORASHIP_TEST_TOKEN", "from-the-pod")
    stage.run(config(tmp_path, env_from_secrets={"LORASHIP_TEST_TOKEN": "test-token"}))
    assert stage.seen["token"] == "from-the-pod" and os.environ["LORASHIP_TEST_TOKEN"] == "from-the-pod"


def test_missing_block_is_a_clear_error(stage, tmp_path, monkeypatch):
    def missing(block):
        raise ValueError(f"Unable to find block document named {block}")

    monkeypatch.setattr(prefect_env, "_load_secret", missing)
    monkeypatch.delenv("LORASHIP_TEST_TOKEN", raising=False)
    with pytest.raises(LorashipError, match="Secret block 'nope' for LORASHIP_TEST_TOKEN not found"):
        stage.run(config(tmp_path, env_from_secrets={"LORASHIP_TEST_TOKEN": "nope"}))
    assert "LORASHIP_TEST_TOKEN" not in os.environ


def test_cli_preflight_sees_the_secret_and_leaves_none_behind(tmp_path, monkeypatch):
    """`loraship run` checks inputs (a gated hub model needs its token) before Prefect runs a stage:
    the secret must be in the environment for that check, and gone after it."""
    import yaml
    from typer.testing import CliRunner

    from loraship import cli

    from loraship.planning import preflight

    seen = {}

    def check_inputs(config):
        seen["token"] = os.environ.get("LORASHIP_TEST_TOKEN")
        raise LorashipError("stop after the check")

    monkeypatch.setattr(prefect_env, "_load_secret", lambda block: PLANTED)
    monkeypatch.setattr(preflight, "check_inputs", check_inputs)
    monkeypatch.delenv("LORASHIP_TEST_TOKEN", raising=False)
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            config(tmp_path, env_from_secrets={"LORASHIP_TEST_TOKEN": "test-token"}).model_dump(mode="json")
        )
    )
    result = CliRunner().invoke(cli.app, ["run", str(path)])
    assert result.exit_code == 2 and "stop after the check" in result.output
    assert seen["token"] == PLANTED
    assert "LORASHIP_TEST_TOKEN" not in os.environ


def test_flow_does_not_export_secrets_itself():
    """Only a stage holds secrets (loraship.runtime.stage.exclusive); the flow process keeps none."""
    import inspect

    import loraship.flows.train_and_ship as flow

    assert "Secret" not in inspect.getsource(flow) and "env_from_secrets" not in inspect.getsource(flow)
