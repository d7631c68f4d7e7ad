"""The Prefect flow end to end (ephemeral API, project-local PREFECT_HOME): artifacts and skip-on-rerun."""

from __future__ import annotations

import os
import tempfile

import pytest

from loraship.constants import STAGES
from tests.conftest import demo_config_dict

# Before prefect is imported anywhere in this process: a private, throwaway Prefect home.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="loraship-prefect-"))


PLANTED = "hf_PLANTEDflowSecret0123456789"


@pytest.fixture(scope="module")
def flow_runs(tiny_model, tmp_path_factory):
    from loraship.flows.train_and_ship import train_and_ship
    from loraship.config import parse_config

    from prefect.blocks.system import Secret

    root = tmp_path_factory.mktemp("flow")
    Secret(value=PLANTED).save("loraship-test-token", overwrite=True)
    config = parse_config(
        demo_config_dict(
            tiny_model, root, run_name="flow", env_from_secrets={"LORASHIP_TEST_TOKEN": "loraship-test-token"}
        )
    )
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

    config = parse_config(
        demo_config_dict(
            tiny_model,
            tmp_path,
            run_name="broken",
            datasets=[{"path": str(tmp_path / "missing.jsonl"), "type": "chat"}],
        )
    )
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

    config = parse_config(
        demo_config_dict(tiny_model, tmp_path, run_name="nosecret", env_from_secrets={"HF_TOKEN": "no-such-block"})
    )
    state = train_and_ship(config, return_state=True)
    assert state.is_failed() and "no-such-block" in state.message


def _config_file(config, path) -> str:
    import yaml

    # Without env_from_secrets: the planted block's variable is not in a fresh process's environment, and loading
    # a Prefect Secret block needs the Prefect API, which a no-op rerun does not start.
    path.write_text(
        yaml.safe_dump({k: v for k, v in config.model_dump(mode="json").items() if k != "env_from_secrets"})
    )
    return str(path)


def test_a_rerun_with_nothing_to_do_reports_every_stage_without_prefect(flow_runs, tmp_path):
    import subprocess
    import sys

    config, _, _, _ = flow_runs
    script = (
        "import sys\nfrom loraship.cli import app\napp(['run', sys.argv[1]], standalone_mode=False)\n"
        "print('imported:', sorted(m for m in ('prefect', 'torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, _config_file(config, tmp_path / "flow.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for stage in STAGES:
        assert f"{stage}: up to date (same inputs, outputs intact), skipped" in done.stdout
    assert f"shipped flow -> {config.output}/flow" in done.stdout
    assert "imported: []" in done.stdout  # decided from the manifests: no Prefect server, no torch


def test_a_stale_stage_still_goes_through_the_flow(flow_runs, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import loraship.flows.train_and_ship as flows
    from loraship.cli import app

    config, _, _, _ = flow_runs
    calls = []
    flow = flows.train_and_ship
    monkeypatch.setattr(flows, "train_and_ship", lambda *a, **k: calls.append(k.get("stages")) or flow(*a, **k))
    elsewhere = tmp_path / "elsewhere"
    result = CliRunner().invoke(
        app, ["run", _config_file(config, tmp_path / "flow.yaml"), "--set", f"output={elsewhere}"]
    )
    assert result.exit_code == 0, result.output
    assert calls == [None]  # publish is stale (its output moved): the whole flow ran, the other stages skipping in it
    assert f"shipped flow -> {elsewhere}/flow" in result.output and (elsewhere / "flow" / "manifest.json").is_file()
