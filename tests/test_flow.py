"""The Prefect flow end to end (ephemeral API, project-local PREFECT_HOME): artifacts and skip-on-rerun."""

from __future__ import annotations

import os
import tempfile

import pytest

from loraship.constants import STAGES
from tests.conftest import demo_config_dict

# Before prefect is imported anywhere in this process: a private, throwaway Prefect home.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="loraship-prefect-"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


PLANTED = "hf_PLANTEDflowSecret0123456789"


@pytest.fixture(scope="module")
def flow_runs(tiny_model, tmp_path_factory):
    from loraship.flows.train_and_ship import train_and_ship
    from loraship.config import parse_config

    from prefect.blocks.system import Secret

    root = tmp_path_factory.mktemp("flow")
    Secret(value=PLANTED).save("loraship-test-token", overwrite=True)
    config = parse_config(demo_config_dict(tiny_model, root, run_name="flow",
                                           env_from_secrets={"LORASHIP_TEST_TOKEN": "loraship-test-token"}))
    first = train_and_ship(config, return_state=True)
    second = train_and_ship(config, return_state=True)
    return config, first, second, root


def test_flow_completes_and_publishes(flow_runs):
    config, first, _, _ = flow_runs
    assert first.is_completed(), first.message
    results = first.result()
    assert list(results) == list(STAGES)
    assert list(STAGES) == ["plan", "train", "merge", "reference", "convert", "quantize", "verify", "publish"]
    assert not any(r["skipped"] for r in results.values())


def test_second_run_skips_every_stage(flow_runs):
    _, _, second, _ = flow_runs
    assert second.is_completed(), second.message
    assert all(r["skipped"] for r in second.result().values())


def test_each_stage_published_a_prefect_artifact(flow_runs):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts()}
    for stage in STAGES:
        assert f"flow-{stage}" in keys, keys


def test_failed_stage_fails_the_flow_with_its_message(tiny_model, tmp_path):
    from loraship.flows.train_and_ship import train_and_ship
    from loraship.config import parse_config

    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="broken", datasets=[
        {"path": str(tmp_path / "missing.jsonl"), "type": "chat"}]))
    state = train_and_ship(config, return_state=True)
    assert state.is_failed()
    assert "missing.jsonl" in state.message and "file not found" in state.message


def test_secret_block_reaches_the_stage_but_no_output(flow_runs):
    _, first, _, root = flow_runs
    assert first.is_completed(), first.message  # every stage loaded the block (a missing one fails it)
    # Each stage holds the secret for its duration only (tests/test_secrets.py); the flow's process keeps none.
    assert "LORASHIP_TEST_TOKEN" not in os.environ
    leaks = [p for p in root.rglob("*") if p.is_file() and PLANTED.encode() in p.read_bytes()]
    assert not leaks


def test_missing_secret_block_is_a_clear_error(tiny_model, tmp_path):
    from loraship.flows.train_and_ship import train_and_ship
    from loraship.config import parse_config

    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="nosecret",
                                           env_from_secrets={"HF_TOKEN": "no-such-block"}))
    state = train_and_ship(config, return_state=True)
    assert state.is_failed() and "no-such-block" in state.message
