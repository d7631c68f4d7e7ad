"""Render the Kubernetes Job of every kubernetes-pool deployment and validate it offline.

    python deploy/kubernetes/render.py                     # validate, print a summary
    python deploy/kubernetes/render.py --out build/k8s     # also write one YAML per deployment
    python deploy/kubernetes/render.py --k8s-version 1.31.0

The Job is built the way a Prefect Kubernetes worker builds it: the variables' defaults from
base-job-template.json, overridden by the deployment's job_variables in deploy/prefect.yaml,
applied to the template with Prefect's own templating (`apply_values`); then the worker's
per-run fields (name, `prefect flow-run execute`, PREFECT_* env) are filled in and the env
mapping becomes a list and the command an argument list, as prefect-kubernetes does. Each
manifest is checked against the Kubernetes OpenAPI schemas by kubernetes-validate (strict: no
unknown fields), so a typo in the template fails here, not at 2 a.m. on the cluster.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "base-job-template.json"
PREFECT_YAML = HERE.parent / "prefect.yaml"
POOL = "loraship-kubernetes"
DEFAULT_K8S_VERSION = "1.31.0"

# What the worker fills in per flow run (placeholders; a real run has its own ids and URL).
WORKER_VALUES = {
    "command": "prefect flow-run execute",
    "labels": {"prefect.io/flow-run-id": "00000000-0000-0000-0000-000000000000"},
}
WORKER_ENV = {
    "PREFECT_API_URL": "http://prefect-server.loraship.svc.cluster.local:4200/api",
    "PREFECT__FLOW_RUN_ID": "00000000-0000-0000-0000-000000000000",
}


def kubernetes_deployments(prefect_yaml: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    data = yaml.safe_load(prefect_yaml.read_text(encoding="utf-8"))
    return [d for d in data["deployments"] if d["work_pool"]["name"] == POOL]


def render(deployment: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """The Job manifest a worker would submit for one flow run of this deployment."""
    from prefect.utilities.templating import apply_values
    from prefect.workers.base import BaseJobConfiguration

    config = copy.deepcopy(template["job_configuration"])
    variables = BaseJobConfiguration._get_base_config_defaults(template["variables"]["properties"])
    variables.update(copy.deepcopy(deployment["work_pool"].get("job_variables") or {}))
    variables.update(WORKER_VALUES)
    variables["name"] = f"loraship-{deployment['name']}"
    variables["env"] = {**WORKER_ENV, **(variables.get("env") or {})}
    job = apply_values(template=config, values=variables)["job_manifest"]

    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": str(v)} for k, v in container["env"].items()]
    if isinstance(container.get("args"), str):
        container["args"] = shlex.split(container["args"])
    return job


def validate(manifest: dict[str, Any], k8s_version: str) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(manifest, desired_version=k8s_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        return [f"{path or '(root)'}: {e.message}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write <deployment>.yaml manifests into this folder")
    parser.add_argument("--k8s-version", default=DEFAULT_K8S_VERSION)
    args = parser.parse_args(argv)

    template = json.loads(TEMPLATE.read_text(encoding="utf-8"))
    failures = 0
    for deployment in kubernetes_deployments():
        manifest = render(deployment, template)
        problems = validate(manifest, args.k8s_version)
        pod = manifest["spec"]["template"]["spec"]
        gpus = pod["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu", "0")
        status = "ok" if not problems else "INVALID"
        print(f"{deployment['name']:<22} {status:<8} gpu={gpus} nodeSelector={pod.get('nodeSelector') or {}}")
        for problem in problems:
            print(f"    {problem}")
        failures += bool(problems)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{deployment['name']}.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False), encoding="utf-8")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
