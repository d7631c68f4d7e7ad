"""Check a finished `prefect deployment run` of train-and-ship: its state, its children, its artifacts.

    python deploy/local/check_run.py RUN_LOG [RUN_NAME]

RUN_LOG is the captured output of `prefect deployment run ... --watch` (it prints the flow run's
UUID). Exits non-zero unless the parent COMPLETED, every stage ran as its own child flow run
(when LORASHIP_STAGE_DEPLOYMENTS is in use) and every stage left its Prefect artifact.
"""

from __future__ import annotations

import re
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

from loraship.constants import STAGES


def main(run_log: str, run_name: str = "demo") -> int:
    text = open(run_log, encoding="utf-8").read()
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", text)
    if not match:
        print("could not find the flow run id in the `prefect deployment run` output")
        return 1
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(match.group(1))
        print(f"parent flow run {run.name}: {run.state.type.value} {run.state.message or ''}".rstrip())
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])), limit=100
        )
        for child in sorted(children, key=lambda r: r.start_time or r.expected_start_time):
            seconds = child.total_run_time.total_seconds()
            print(
                f"  child {child.name} ({child.parameters.get('stage')}): {child.state.type.value} in {seconds:.0f} s"
            )
        keys = {a.key for a in client.read_artifacts(limit=200) if a.key}
    wanted = [re.sub(r"[^a-z0-9-]+", "-", f"{run_name}-{s}".lower()) for s in STAGES]
    print(f"stage artifacts in Prefect: {', '.join(k for k in wanted if k in keys)}")
    problems = []
    if run.state.type.value != "COMPLETED":
        problems.append(f"parent ended {run.state.type.value}")
    if children and {c.parameters.get("stage") for c in children} != set(STAGES):
        problems.append(f"child stages {sorted(c.parameters.get('stage') for c in children)} != {list(STAGES)}")
    if missing := [k for k in wanted if k not in keys]:
        problems.append(f"no Prefect artifact {missing}")
    for p in problems:
        print(f"FAILED: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
