"""A secret planted in a Prefect Secret block, used by a whole train-and-ship run, is found in no
file of the Prefect home (its database: flow and task run parameters, logs, artifacts), in no log
or artifact the API returns, and in no file of the run's workdir or artifact folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.test_flow import PLANTED, flow_runs  # noqa: F401 - the flow run with the planted Secret block


def _files(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob("*") if p.is_file()]


def test_planted_secret_is_in_no_prefect_database_log_artifact_or_file(flow_runs):  # noqa: F811
    from prefect.client.orchestration import get_client

    _, first, _, root = flow_runs
    assert first.is_completed(), first.message
    home = Path(os.environ["PREFECT_HOME"])
    files = _files(home, root)
    database = [p for p in files if p.name.startswith("prefect.db")]
    assert database, f"no Prefect database under {home}"
    # The scan can see plain text in the database: the Secret block's name is there, its value is
    # stored encrypted by the Prefect server.
    assert any(b"loraship-test-token" in p.read_bytes() for p in database)
    assert not [p for p in files if PLANTED.encode() in p.read_bytes()]

    with get_client(sync_client=True) as client:
        logs, offset = [], 0
        while batch := client.read_logs(limit=200, offset=offset):
            logs += batch
            offset += len(batch)
        artifacts = client.read_artifacts()
    assert logs and artifacts
    assert not [log.message for log in logs if PLANTED in log.message]
    assert not [a.key for a in artifacts if PLANTED in json.dumps(a.model_dump(mode="json"), default=str)]
