"""One error path for `loraship run`: a failure inside the flow is said once, on stderr, with exit 2 for input the
user must fix and 1 for a stage that failed; through the real command line, in a subprocess. The plan has run
(in this process), so `--from train` starts the flow past the command's own input checks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, demo_config_dict

# A log record on the console (the format loraship.cli's logging.basicConfig sets); anything else is the CLI's own.
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
# The second line of Prefect's "Starting temporary server" record.
PREFECT_SERVER_HINT = "See https://www.prefect.io/docs/v3/concepts/server#how-to-guides"
RESUME = "Finished stages are kept; fix the problem and run the same command again to resume."


@pytest.fixture(scope="module")
def planned(tiny_model, tmp_path_factory):
    from loraship.config import load_config
    from loraship.stage_table import stage_module

    root = tmp_path_factory.mktemp("failures")
    data = root / "train.jsonl"
    shutil.copy(REPO / "data" / "demo" / "train.jsonl", data)
    cfg = demo_config_dict(tiny_model, root, run_name="failing", datasets=[{"path": str(data), "type": "chat"}])
    config_file = root / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    config = load_config(config_file)
    stage_module("plan").run(config)
    return config_file, config, data


def loraship_run(*argv: str, script: str = "") -> subprocess.CompletedProcess:
    """`loraship run ARGV`, or the same entry point after `script` ran in the process."""
    head = [sys.executable, "-m", "loraship.cli"] if not script else [sys.executable, "-c", script]
    return subprocess.run(
        [*head, "run", *argv], capture_output=True, text=True, cwd=REPO, timeout=900, env={**os.environ}
    )


def said(stderr: str) -> tuple[list[str], list[str]]:
    """(log records, everything else) on stderr."""
    lines = stderr.splitlines()
    logs = [line for line in lines if LOG_RECORD.match(line)]
    rest = [line for line in lines if not LOG_RECORD.match(line) and not line.startswith(PREFECT_SERVER_HINT)]
    return logs, rest


def test_a_bad_row_found_inside_the_flow_is_said_once_and_exits_2(planned):
    config_file, _, data = planned
    good = data.read_text()
    lines = len(good.splitlines())
    data.write_text(good + '{"conversation": []}\n')  # after the plan: train reads it
    try:
        result = loraship_run(str(config_file), "--from", "train")
    finally:
        data.write_text(good)
    problem = f"line {lines + 1}: missing field 'messages' (chat rows need a non-empty list of {{role, content}})"
    logs, rest = said(result.stderr)
    assert result.returncode == 2, result.stderr
    assert rest == [
        f"error: run 'failing' failed: train: dataset {data} (chat): 1 bad line(s):",
        f"  {problem}",
        RESUME,
    ], result.stderr
    assert result.stderr.count(problem) == 1 and "NoneType" not in result.stderr
    assert not [line for line in logs if " ERROR " in line], logs


def test_a_stage_that_crashes_is_said_once_and_exits_1(planned):
    from loraship.runtime.stage import run_dir

    config_file, config, _ = planned
    crash = (
        "import sys\nimport loraship.stages.train as train\n"
        "def run(config):\n    raise RuntimeError('simulated crash in the train stage')\n"
        "train.run = run\nsys.argv = ['loraship', *sys.argv[1:]]\nfrom loraship.cli import main\nmain()\n"
    )
    result = loraship_run(str(config_file), "--from", "train", script=crash)
    trace = run_dir(config) / ".logs" / "train-traceback.txt"
    logs, rest = said(result.stderr)
    assert result.returncode == 1, result.stderr
    assert rest == [
        f"error: run 'failing' failed: train: RuntimeError: simulated crash in the train stage (traceback in {trace})",
        RESUME,
    ], result.stderr
    assert result.stderr.count("simulated crash") == 1 and "Traceback" not in result.stderr
    assert not [line for line in logs if " ERROR " in line], logs
    assert trace.read_text().splitlines()[-1] == "RuntimeError: simulated crash in the train stage"


def test_exit_codes_by_kind():
    from loraship.errors import ConfigError, DataError, IntegrityError, OutputError, StageFailed, exit_code_of

    for user_input in (ConfigError("x", ["y"]), DataError("x"), OutputError("x"), IntegrityError("x")):
        assert exit_code_of(user_input) == 2
    assert exit_code_of(StageFailed("verify failed")) == 1  # verify's gates: not input to fix
    assert exit_code_of(RuntimeError("a crash")) == 1 and exit_code_of(None) == 1
