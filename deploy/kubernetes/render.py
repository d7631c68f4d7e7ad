"""Render the Kubernetes Job of every kubernetes-pool deployment and validate it offline.

    python deploy/kubernetes/render.py                     # validate, print a summary
    python deploy/kubernetes/render.py --out build/k8s     # also write one YAML per deployment
    python deploy/kubernetes/render.py --k8s-version 1.31.0
    python deploy/kubernetes/render.py --pools             # "<pool> <template>" per line, to create the pools

One pool per hardware class (deploy/render_prefect_yaml.py K8S_POOLS): the CPU pool, the training GPU node's and the
inference GPU's, each with its own base job template. Beyond the schemas, each stage must land on its class's pool,
a GPU stage's Job must request and limit nvidia.com/gpu (train the training node's all, others one) and its pool's
template must require it; a CPU stage's Job must request none.

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
POOL = "loraship-kubernetes"  # the CPU pool (and the parent's)


def _generator():
    """deploy/render_prefect_yaml.py, the pools' one source (a script, not a package: loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("loraship_prefect_render", HERE.parent / "render_prefect_yaml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_GEN = _generator()
# pool -> (hardware class, its base job template)
POOLS = {pool: (kind, _GEN.K8S_GPU_TEMPLATES.get(kind, TEMPLATE)) for kind, pool in _GEN.K8S_POOLS.items()}
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
    return [d for d in data["deployments"] if d["work_pool"]["name"] in POOLS or "kubernetes" in d["name"]]


def template_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """The base job template of the deployment's pool (the CPU pool's for a pool this file does not know: gpu_problems
    names that)."""
    return json.loads(POOLS.get(deployment["work_pool"]["name"], (None, TEMPLATE))[1].read_text(encoding="utf-8"))


def _template_requires_gpu(template: dict[str, Any]) -> bool:
    """The template's resources variable requires nvidia.com/gpu in requests and limits, and defaults to some."""
    res = template["variables"]["properties"].get("resources", {})
    parts = res.get("properties", {})
    required = all("nvidia.com/gpu" in parts.get(k, {}).get("required", []) for k in ("requests", "limits"))
    default = res.get("default", {})
    return required and all(default.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits"))


def gpu_problems(deployment: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """Where a stage lands and what it asks for, against the stage table's hardware class."""
    from loraship.stage_table import STAGES_BY_NAME

    pool = deployment["work_pool"]["name"]
    stage = (deployment.get("parameters") or {}).get("stage")
    kind = STAGES_BY_NAME[stage].gpu if stage in STAGES_BY_NAME else "none"  # the parent runs on CPU
    want = _GEN.K8S_POOLS[kind]
    problems = []
    if pool != want:
        problems.append(
            f"work_pool {pool!r}: the {kind if kind != 'none' else 'CPU'} stage {stage or 'parent'} "
            f"belongs on {want!r}; fix: regenerate deploy/prefect.yaml (python deploy/render_prefect_yaml.py)"
        )
    res = manifest["spec"]["template"]["spec"]["containers"][0].get("resources") or {}
    asked = {k: (res.get(k) or {}).get("nvidia.com/gpu") for k in ("requests", "limits")}
    if kind == "none":
        if any(asked.values()):
            problems.append(f"resources: a CPU stage requests nvidia.com/gpu {asked}; fix: drop it")
        return problems
    if pool in POOLS and not _template_requires_gpu(template_of(deployment)):
        problems.append(
            f"pool {pool!r}: its template {POOLS[pool][1].name} does not require nvidia.com/gpu in "
            "resources; fix: regenerate it (python deploy/render_prefect_yaml.py)"
        )
    stage_row = STAGES_BY_NAME[stage]
    count = str(_GEN.gpu_count(stage_row))
    if asked["requests"] != asked["limits"] or asked["limits"] is None or str(asked["limits"]) != count:
        problems.append(
            f"resources: the {kind} GPU stage {stage} must request and limit nvidia.com/gpu {count}, "
            f"got requests {asked['requests']!r}, limits {asked['limits']!r}; fix: regenerate "
            "deploy/prefect.yaml"
        )
    return problems


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
    parser.add_argument("--pools", action="store_true", help="print '<pool> <template path>' per pool and exit")
    args = parser.parse_args(argv)

    if args.pools:
        root = HERE.parent.parent
        for pool, (_kind, template) in POOLS.items():
            print(pool, template.relative_to(root))
        return 0
    failures = 0
    for deployment in kubernetes_deployments():
        manifest = render(deployment, template_of(deployment))
        problems = validate(manifest, args.k8s_version) + gpu_problems(deployment, manifest)
        pod = manifest["spec"]["template"]["spec"]
        gpus = pod["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu", "0")
        status = "ok" if not problems else "INVALID"
        print(
            f"{deployment['name']:<22} {status:<8} pool={deployment['work_pool']['name']:<34} gpu={gpus} "
            f"nodeSelector={pod.get('nodeSelector') or {}}"
        )
        for problem in problems:
            print(f"    {problem}")
        failures += bool(problems)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{deployment['name']}.yaml").write_text(
                yaml.safe_dump(manifest, sort_keys=False), encoding="utf-8"
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
