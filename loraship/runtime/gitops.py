"""GitOps: one `train-and-ship` run per run spec changed between two git refs.

A run spec is a loraship config YAML under deploy/gitops/specs/ (one file per model to ship);
its file name is the run_name unless it sets one. CI calls

    loraship gitops --from "$BEFORE_SHA" --to "$GITHUB_SHA" --deployment train-and-ship/docker

Idempotency: a spec is identified by the sha256 of its *validated* config (Config.fingerprint:
defaults filled in, keys sorted), not of its bytes, so reformatting or editing comments never
triggers a run, and two commits that end up with the same config trigger it once. The record of
what was triggered lives in the Prefect server itself, not in a state file: each run carries
the tag `loraship-spec:<hash[:16]>` and the idempotency key `<deployment>:<hash>`. The tag lets
any CI runner (ephemeral, no shared disk) find the earlier run before triggering; the key makes
the server return the existing run instead of creating a second one when two pipelines race.
A state file would need a shared, locked location and would drift from what the server ran.
The hash covers the resolved config, defaults included, the loraship version and, when CI sets
LORASHIP_IMAGE_DIGEST, the stage image's digest: the same YAML under another release or image is
a different run (it may train differently) once its spec changes; specs that git does not show as
changed are never looked at.
A run that ended FAILED, CRASHED or CANCELLED is not started again by itself (the same push
re-run must not retrain by surprise); `--retry-failed` starts it again with the same training
content, under the key `<deployment>:<hash>:retry-of:<failed run id>`, so two CI jobs retrying the
same failure still start one run. To run a completed config again, change it (e.g. bump `seed`).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import yaml

from loraship import __version__
from loraship.config import Config, parse_config
from loraship.errors import ConfigError, LorashipError
from loraship.runtime.manifest import sha256_json

SPEC_SUFFIXES = (".yaml", ".yml")
TAG_PREFIX = "loraship-spec:"
# `git diff` against this object compares with nothing: GitHub sends an all-zero "before" sha
# on the first push of a branch.
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
FINAL_OK = "COMPLETED"
RETRYABLE = ("FAILED", "CRASHED", "CANCELLED")
IMAGE_DIGEST_ENV = "LORASHIP_IMAGE_DIGEST"


class Trigger(Protocol):
    """Where runs are recorded and started (Prefect by default; a fake in tests)."""

    def find(self, deployment: str, key: str, tag: str) -> dict[str, Any] | None: ...

    def run(
        self, deployment: str, parameters: dict[str, Any], key: str, tags: list[str], wait: bool
    ) -> dict[str, Any]: ...


def _git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise LorashipError(f"git {' '.join(args)} failed in {repo}: {result.stderr.strip()}")
    return result.stdout


def _resolve_ref(repo: Path, ref: str) -> str:
    if re.fullmatch(r"0+", ref):
        return EMPTY_TREE
    try:
        return _git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}").strip()
    except LorashipError as e:
        raise LorashipError(
            f"unknown git ref {ref!r} in {repo}; fetch enough history (actions/checkout fetch-depth: 0)"
        ) from e


def changed_specs(
    from_ref: str, to_ref: str, *, repo: Path = Path("."), specs_dir: str = "deploy/gitops/specs"
) -> list[str]:
    """Spec paths added, modified or renamed between the refs (deleted specs trigger nothing)."""
    old, new = _resolve_ref(repo, from_ref), _resolve_ref(repo, to_ref)
    out = _git(repo, "diff", "--name-only", "--no-renames", "--diff-filter=AM", old, new, "--", specs_dir)
    return sorted(p for p in out.splitlines() if p.endswith(SPEC_SUFFIXES))


def load_spec(text: str, path: str) -> Config:
    """Validate a spec the way load_config does (run_name defaults to the file stem)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(path, [f"not valid YAML: {e}"]) from e
    if isinstance(data, dict):
        data.setdefault("run_name", PurePosixPath(path).stem)
    return parse_config(data, source=path)


def spec_hash(config: Config) -> str:
    """Identity of a run of a spec: its validated config, the loraship release and the image."""
    return sha256_json(
        {"config": config.fingerprint(), "loraship": __version__, "image": os.environ.get(IMAGE_DIGEST_ENV, "")}
    )


@dataclass
class PrefectTrigger:
    """Runs through the Prefect API (PREFECT_API_URL); the server holds the idempotency record."""

    def find(self, deployment: str, key: str, tag: str) -> dict[str, Any] | None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowRunFilter,
            FlowRunFilterTags,
        )
        from prefect.client.schemas.sorting import FlowRunSort

        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name(deployment)
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])),
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                sort=FlowRunSort.EXPECTED_START_TIME_DESC,  # the latest attempt (a retry after a failure)
                limit=1,
            )
        return _describe(runs[0]) if runs else None

    def run(
        self, deployment: str, parameters: dict[str, Any], key: str, tags: list[str], wait: bool
    ) -> dict[str, Any]:
        from prefect.deployments import run_deployment

        flow_run = run_deployment(
            name=deployment,
            parameters=parameters,
            idempotency_key=key,
            tags=tags,
            timeout=None if wait else 0,
        )
        return _describe(flow_run)


def _describe(flow_run: Any) -> dict[str, Any]:
    state = flow_run.state
    return {
        "flow_run_id": str(flow_run.id),
        "flow_run_name": flow_run.name,
        "state": state.type.value if state else None,
        "message": (state.message or "") if state else "",
    }


def trigger_changed_specs(
    from_ref: str,
    to_ref: str,
    *,
    repo: Path = Path("."),
    specs_dir: str = "deploy/gitops/specs",
    deployment: str = "train-and-ship/local",
    wait: bool = True,
    dry_run: bool = False,
    trigger: Trigger | None = None,
    retry_failed: bool = False,
) -> list[dict[str, Any]]:
    """Start one run of `deployment` per spec changed between the refs, at most once per content.

    Every changed spec is validated first; one invalid spec stops all of them before any run
    starts. Each result has spec, sha256, action ("triggered", "already-triggered", "retried",
    "dry-run"), flow_run_id/flow_run_name/state when a run exists, and ok: False when a run this
    call waited on (or found) ended anything but COMPLETED. retry_failed: start a spec again whose
    latest run ended FAILED, CRASHED or CANCELLED.
    """
    repo = Path(repo)
    paths = changed_specs(from_ref, to_ref, repo=repo, specs_dir=specs_dir)
    new = _resolve_ref(repo, to_ref)
    specs: list[tuple[str, Config]] = []
    problems: list[str] = []
    for path in paths:
        try:
            specs.append((path, load_spec(_git(repo, "show", f"{new}:{path}"), path)))
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise LorashipError("invalid run spec(s); nothing was triggered:\n" + "\n".join(problems))

    trigger = trigger or PrefectTrigger()
    results: list[dict[str, Any]] = []
    for path, config in specs:
        digest = spec_hash(config)
        key, tag = f"{deployment}:{digest}", TAG_PREFIX + digest[:16]
        result: dict[str, Any] = {
            "spec": path,
            "sha256": digest,
            "run_name": config.run_name,
            "deployment": deployment,
        }
        if dry_run:
            results.append({**result, "action": "dry-run", "ok": True})
            continue
        earlier = trigger.find(deployment, key, tag)
        action = "triggered"
        if earlier is not None:
            failed = earlier.get("state") in RETRYABLE
            if not (failed and retry_failed):
                ok = earlier.get("state") in (FINAL_OK, None, "SCHEDULED", "PENDING", "RUNNING")
                hint = (
                    {
                        "hint": f"its run ended {earlier.get('state')}; fix the cause and rerun with --retry-failed "
                        "(same training content)"
                    }
                    if failed
                    else {}
                )
                results.append({**result, **earlier, **hint, "action": "already-triggered", "ok": ok})
                continue
            key, action = f"{key}:retry-of:{earlier['flow_run_id']}", "retried"
            result["retry_of"] = earlier["flow_run_id"]
        started = trigger.run(
            deployment, {"config": config.model_dump(mode="json")}, key, ["loraship", "gitops", tag], wait
        )
        ok = started.get("state") == FINAL_OK if wait else started.get("state") not in RETRYABLE
        results.append({**result, **started, "action": action, "ok": ok})
    return results


def main(argv: list[str] | None = None) -> int:
    """`python -m loraship.runtime.gitops --from A --to B` (the same as `loraship gitops`)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=trigger_changed_specs.__doc__.splitlines()[0])
    parser.add_argument("--from", dest="from_ref", required=True)
    parser.add_argument("--to", dest="to_ref", default="HEAD")
    parser.add_argument("--repo", type=Path, default=Path("."))
    parser.add_argument("--specs-dir", default="deploy/gitops/specs")
    parser.add_argument("--deployment", default="train-and-ship/local")
    parser.add_argument("--no-wait", dest="wait", action="store_false")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--retry-failed", action="store_true")
    args = parser.parse_args(argv)
    try:
        results = trigger_changed_specs(
            args.from_ref,
            args.to_ref,
            repo=args.repo,
            specs_dir=args.specs_dir,
            deployment=args.deployment,
            wait=args.wait,
            dry_run=args.dry_run,
            retry_failed=args.retry_failed,
        )
    except LorashipError as e:
        print(f"error: {e}")
        return 2
    for r in results:
        print(json.dumps(r, sort_keys=True))
    if not results:
        print(f"no run spec changed under {args.specs_dir} between {args.from_ref} and {args.to_ref}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
