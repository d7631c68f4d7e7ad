"""GitOps: a failed run is retried only on request, with the same training content; the loraship
release and the image are part of a run's identity."""

from __future__ import annotations

import pytest

from loraship.runtime import gitops
from loraship.runtime.gitops import spec_hash, trigger_changed_specs
from tests.test_deploy import SPEC, _commit, _git, repo  # noqa: F401 - the scratch repository fixture


class LatestFirstTrigger:
    """Like the Prefect server: one run per idempotency key; find returns the latest run of a tag."""

    def __init__(self, states: list[str]):
        self.states, self.runs = list(states), []

    def find(self, deployment, key, tag):
        return next((r for r in reversed(self.runs) if tag in r["tags"]), None)

    def run(self, deployment, parameters, key, tags, wait):
        existing = next((r for r in self.runs if r["key"] == key), None)
        if existing is None:
            existing = {
                "flow_run_id": f"run-{len(self.runs)}",
                "flow_run_name": key[-8:],
                "key": key,
                "tags": tags,
                "state": self.states.pop(0),
                "parameters": parameters,
            }
            self.runs.append(existing)
        return {k: existing[k] for k in ("flow_run_id", "flow_run_name", "state")}


def test_failed_run_is_retried_only_with_retry_failed(repo):  # noqa: F811
    c0 = _git(repo, "rev-parse", "HEAD")
    c1 = _commit(repo, {"deploy/gitops/specs/a.yaml": SPEC})
    trigger = LatestFirstTrigger(["FAILED", "COMPLETED"])
    first = trigger_changed_specs(c0, c1, repo=repo, trigger=trigger)
    assert first[0]["action"] == "triggered" and not first[0]["ok"]

    again = trigger_changed_specs(c0, c1, repo=repo, trigger=trigger)  # a re-run CI job: no surprise retrain
    assert again[0]["action"] == "already-triggered" and "--retry-failed" in again[0]["hint"]
    assert len(trigger.runs) == 1

    retried = trigger_changed_specs(c0, c1, repo=repo, trigger=trigger, retry_failed=True)
    assert retried[0]["action"] == "retried" and retried[0]["ok"] and retried[0]["retry_of"] == "run-0"
    assert trigger.runs[1]["parameters"] == trigger.runs[0]["parameters"]  # same training content
    assert trigger.runs[1]["key"].endswith(":retry-of:run-0")

    # The retry completed: asking again changes nothing.
    done = trigger_changed_specs(c0, c1, repo=repo, trigger=trigger, retry_failed=True)
    assert done[0]["action"] == "already-triggered" and done[0]["ok"] and len(trigger.runs) == 2


def test_completed_run_is_not_retried(repo):  # noqa: F811
    c0 = _git(repo, "rev-parse", "HEAD")
    c1 = _commit(repo, {"deploy/gitops/specs/a.yaml": SPEC})
    trigger = LatestFirstTrigger(["COMPLETED"])
    trigger_changed_specs(c0, c1, repo=repo, trigger=trigger)
    assert (
        trigger_changed_specs(c0, c1, repo=repo, trigger=trigger, retry_failed=True)[0]["action"]
        == "already-triggered"
    )


def test_release_and_image_are_part_of_the_key(monkeypatch):
    config = gitops.load_spec(SPEC, "deploy/gitops/specs/a.yaml")
    base = spec_hash(config)
    monkeypatch.setattr(gitops, "__version__", "99.0")
    assert spec_hash(config) != base
    monkeypatch.setenv(gitops.IMAGE_DIGEST_ENV, "sha256:" + "ab" * 32)
    assert len({base, spec_hash(config)}) == 2


def test_cli_has_retry_failed():
    from typer.testing import CliRunner

    from loraship.cli import app

    result = CliRunner().invoke(app, ["gitops", "--help"])
    assert "--retry-failed" in result.output
    with pytest.raises(SystemExit):
        gitops.main(["--help"])
