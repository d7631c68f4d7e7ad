"""Offline checks of everything under images/ and deploy/, and of loraship.runtime.gitops.

No server, Docker or network: the real runs are deploy/local/run.sh and deploy/docker/run_ci.sh.
Lint tools come from deploy/requirements-ci.txt; a test whose tool is missing is skipped.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from loraship.config import load_config, parse_config
from loraship.constants import STAGES
from loraship.errors import LorashipError
from loraship.runtime.gitops import TAG_PREFIX, load_spec, trigger_changed_specs
from loraship.stage_table import IMAGES, STAGE_TABLE, STAGES_BY_NAME, gpu_stages

ROOT = Path(__file__).resolve().parent.parent
IMAGES_DIR = ROOT / "images"
DEPLOY = ROOT / "deploy"
POOLS = {"local": "loraship-process", "docker": "loraship-docker", "kubernetes": "loraship-kubernetes"}
GPU_STAGES = gpu_stages()
TRAINING_GPU_STAGES = gpu_stages("training")


def _load(path: Path, name: str):
    """The scripts under images/ and deploy/ are not a package: load them by path."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_pin = _load(IMAGES_DIR / "pin.py", "loraship_images_pin")
k8s_render = _load(DEPLOY / "kubernetes" / "render.py", "loraship_k8s_render")
prefect_render = _load(DEPLOY / "render_prefect_yaml.py", "loraship_prefect_render")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(str(Path(sys.executable).parent / name))
    if not found:
        pytest.skip(f"{name} not installed: pip install -r deploy/requirements-ci.txt")
    return found


def _prefect_yaml() -> dict:
    return yaml.safe_load((DEPLOY / "prefect.yaml").read_text(encoding="utf-8"))


def _deployments() -> dict[str, dict]:
    return {d["name"]: d for d in _prefect_yaml()["deployments"]}


# ---- the stage table -------------------------------------------------------------------------
def _extra_names(stage) -> set[str]:
    """Distribution names a stage's image installs from the extras (plus its picks by name)."""
    extras = PYPROJECT["optional-dependencies"]
    return {_pin._name(r) for extra in stage.extras for r in extras[extra]} | set(stage.also)


def test_stage_table_is_the_pipeline():
    assert STAGES == tuple(s.name for s in STAGE_TABLE) and len(set(STAGES)) == len(STAGES)
    assert STAGES[0] == "plan" and STAGES[-1] == "publish"
    assert all(s.gpu in ("training", "inference", "none") for s in STAGE_TABLE)


def test_stage_table_extras_exist_and_images_hold_one_requirement_set():
    extras = PYPROJECT["optional-dependencies"]
    every = {_pin._name(r) for names in extras.values() for r in names}
    for stage in STAGE_TABLE:
        assert set(stage.extras) <= set(extras), f"{stage.name}: unknown extra in {stage.extras}"
        assert set(stage.also) <= every, f"{stage.name}: {stage.also} not in any pyproject extra"
    for image in IMAGES:
        rows = {(s.extras, s.also) for s in STAGE_TABLE if s.image == image}
        assert len(rows) == 1, f"the stages in image {image} must name the same extras: {rows}"


def test_verify_runs_the_gguf_alone_on_the_inference_gpu():
    verify = STAGES_BY_NAME["verify"]
    assert verify.gpu == "inference" and gpu_stages("inference") == {"verify"}
    assert {"torch", "transformers"}.isdisjoint(_extra_names(verify)), "the verify image has no torch"
    assert "llama-cpp-python" in _extra_names(verify)
    assert TRAINING_GPU_STAGES == {"train", "reference"}, "reference runs the merged HF model where train ran"


def test_kubernetes_quantities_parse():
    for stage in STAGE_TABLE:
        r = stage.resources
        assert re.fullmatch(r"\d+(\.\d+)?", r.cpu), (stage.name, r.cpu)
        assert re.fullmatch(r"\d+(Mi|Gi)", r.memory) and re.fullmatch(r"\d+(Mi|Gi)", r.shm), stage.name
        assert r.docker_shm is None or re.fullmatch(r"\d+[mg]", r.docker_shm), stage.name


# ---- images ----------------------------------------------------------------------------------
DOCKERFILE = IMAGES_DIR / "Dockerfile"


def _dockerfile_stages() -> dict[str, tuple[str, str]]:
    """Build stage name -> (what it is FROM, its own lines)."""
    stages = {}
    for part in re.split(r"^FROM\s+", DOCKERFILE.read_text(encoding="utf-8"), flags=re.M)[1:]:
        first, _, body = part.partition("\n")
        match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", first.strip())
        assert match, f"every FROM in images/Dockerfile names its stage: FROM {first}"
        stages[match[2]] = (match[1], body)
    return stages


def _target_text(name: str) -> tuple[list[str], str]:
    """A target's chain of stages (itself first) and their lines, base first."""
    stages = _dockerfile_stages()
    chain, text = [], ""
    while name in stages:
        chain.append(name)
        name, body = stages[name][0], stages[name][1]
        text = body + text
    assert name == "${BASE_IMAGE}", f"{chain[-1]} must start from the BASE_IMAGE build argument"
    return chain, text


@pytest.mark.parametrize("dockerfile", sorted(IMAGES_DIR.glob("*Dockerfile")), ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    result = subprocess.run([_tool("hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_one_dockerfile_for_every_stage_image():
    assert sorted(p.name for p in IMAGES_DIR.glob("*Dockerfile")) == ["Dockerfile", "base-cuda.Dockerfile"]
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M), "the base image must be a build argument"
    assert not re.search(r"(?i)(token|password|secret|api_key)\s*=", text), "no secrets in any layer"
    assert "# syntax=" not in text, "a syntax line makes BuildKit fetch a frontend from a registry"
    assert set(IMAGES) <= set(_dockerfile_stages())


@pytest.mark.parametrize("image", IMAGES)
def test_image_target_installs_what_its_stages_need(image):
    """Each target: its own entrypoint, uid 1000, the requirement set of its stages' extras, torch
    only when an extra asks for it, llama.cpp's binding only when an extra asks for it."""
    chain, text = _target_text(image)
    own = _dockerfile_stages()[image][1]
    assert re.findall(r"^ENTRYPOINT (.*)$", own, re.M)[-1] == f'["python", "-m", "{STAGES_BY_NAME[image].module}"]'
    assert re.findall(r"^USER (.*)$", text, re.M)[-1] == "1000:1000", "stages run as the non-root uid 1000"
    assert text.rindex("COPY src/") > max(text.rindex(w) for w in ("RUN ", "COPY requirements/")), "source last"

    stage = next(s for s in STAGE_TABLE if s.image == image)
    names = _extra_names(stage)
    installed = re.findall(r"^COPY requirements/(\S+)\.txt ", text, re.M)
    assert len(installed) == 1, f"{image}: one requirements file, got {installed}"
    requirements = _pin.image_requirements()
    assert requirements[installed[0]] == requirements[image], f"{image} installs {installed[0]}'s requirements"
    assert ("torch" in chain) == ("torch" in names), f"{image}: torch layer iff an extra of its stages needs torch"
    binding = "COPY --from=llama-cpp /out/wheels/" in text
    assert binding == ("llama-cpp-python" in names), image
    if binding:
        # The binding comes from its own wheel, outside the requirements file, so the extras its
        # pyproject requirement names (verify's server) must be on that install line (CI once ran
        # a verify image without sse-starlette).
        extras = PYPROJECT["optional-dependencies"]
        wanted = {r for extra in stage.extras for r in extras[extra] if _pin._name(r) == "llama-cpp-python"}
        wanted_extras = {m for r in wanted for m in re.findall(r"\[([^\]]*)\]", r)}
        installed_lines = re.findall(r'"llama-cpp-python(\[[^\]]*\])?==\$\{LLAMA_CPP_PYTHON_VERSION\}"', text)
        assert installed_lines, f"{image}: installs the binding at the pinned version"
        assert {m.strip("[]") for m in installed_lines if m} == wanted_extras, (image, installed_lines, wanted)
    if binding or stage.name == "plan":  # plan's GGUF check reads the converter's architecture list
        assert "LORASHIP_LLAMA_CPP_DIR=/opt/llama.cpp" in text


def test_build_all_builds_every_image_target():
    result = subprocess.run([sys.executable, str(IMAGES_DIR / "pin.py"), "images"], capture_output=True, text=True)
    assert result.stdout.split() == list(IMAGES)
    script = (IMAGES_DIR / "build_all.sh").read_text(encoding="utf-8")
    assert "pin.py images" in script and '-f images/Dockerfile --target "$image"' in script


def test_constraints_pin_exact_versions():
    lines = [ln for ln in (IMAGES_DIR / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines and all(re.fullmatch(r"[a-z0-9-]+==[^=\s]+", ln) for ln in lines), lines[:5]
    names = {ln.split("==")[0] for ln in lines}
    assert {"torch", "llama-cpp-python"}.isdisjoint(names), "CPU vs CUDA builds: pinned by build argument / wheel"
    assert {"prefect", "transformers", "peft"} <= names


# ---- deploy/prefect.yaml ---------------------------------------------------------------------
def test_prefect_yaml_is_what_the_generator_writes():
    assert (DEPLOY / "prefect.yaml").read_text(encoding="utf-8") == prefect_render.render(), (
        "deploy/prefect.yaml differs from loraship/stage_table.py and configs/demo.yaml: "
        "run `python deploy/render_prefect_yaml.py` and commit deploy/prefect.yaml"
    )


def test_generator_follows_the_table(monkeypatch):
    """A row's resources reach its deployments (and only its own)."""
    table = tuple(
        dataclasses.replace(s, resources=dataclasses.replace(s.resources, memory="12Gi", docker_shm="2g"))
        if s.name == "verify"
        else s
        for s in STAGE_TABLE
    )
    monkeypatch.setattr(prefect_render, "STAGE_TABLE", table)
    deployments = {d["name"]: d for d in prefect_render.deployments()}
    k8s = deployments["verify-kubernetes"]["work_pool"]["job_variables"]["resources"]
    assert k8s == {
        "requests": {"cpu": "4", "memory": "12Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "12Gi", "nvidia.com/gpu": "1"},
    }
    assert deployments["verify-docker"]["work_pool"]["job_variables"]["container_create_kwargs"]["shm_size"] == "2g"
    assert deployments["quantize-kubernetes"] == _deployments()["quantize-kubernetes"]


def test_one_parent_and_one_deployment_per_stage_and_pool():
    names = [d["name"] for d in _prefect_yaml()["deployments"]]
    expected = [name for suffix in POOLS for name in (suffix, *(f"{stage}-{suffix}" for stage in STAGES))]
    assert sorted(names) == sorted(expected) and len(names) == len(set(names))


def test_documented_deployment_counts_follow_prefect_yaml():
    count = len(_prefect_yaml()["deployments"])
    assert count == len(POOLS) * (len(STAGES) + 1)
    for rel in (
        "README.md",
        "deploy/README.md",
        "deploy/local/run.sh",
        "deploy/docker/run_ci.sh",
        "deploy/prefect.yaml",
    ):
        path = ROOT / rel
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        for written in re.findall(r"\b(\d+) deployments\b", text):
            assert int(written) == count, f"{rel} says {written} deployments; deploy/prefect.yaml has {count}"


def test_gpu_stages_match_the_flow():
    flow = pytest.importorskip("loraship.flows.train_and_ship")
    assert flow.GPU_STAGES == GPU_STAGES == {"train", "reference", "verify"}


def test_training_gpu_stages_share_the_training_node():
    """reference runs the merged HF model where train ran; verify needs only an inference GPU."""
    deployments = _deployments()
    k8s = {stage: deployments[f"{stage}-kubernetes"]["work_pool"]["job_variables"] for stage in GPU_STAGES}

    def node(variables: dict) -> dict:  # all but the image and the GPU count (train takes the node's all)
        out = {k: v for k, v in variables.items() if k != "image"}
        out["resources"] = {
            part: {k: v for k, v in q.items() if k != "nvidia.com/gpu"} for part, q in variables["resources"].items()
        }
        return out

    def docker_node(kwargs: dict) -> dict:
        return {**kwargs, "device_requests": [{**r, "count": None} for r in kwargs["device_requests"]]}

    for stage in TRAINING_GPU_STAGES:
        assert node(k8s[stage]) == node(k8s["train"]), stage
        assert (
            deployments[f"{stage}-kubernetes"]["work_pool"]["name"]
            == deployments["train-kubernetes"]["work_pool"]["name"]
        )
        docker = deployments[f"{stage}-docker"]["work_pool"]["job_variables"]["container_create_kwargs"]
        assert docker_node(docker) == docker_node(
            deployments["train-docker"]["work_pool"]["job_variables"]["container_create_kwargs"]
        ), stage
    for stage in GPU_STAGES - TRAINING_GPU_STAGES:
        assert k8s[stage]["node_selector"] != k8s["train"]["node_selector"], stage

    def gib(quantity: str) -> float:
        return float(quantity[:-2]) * {"Mi": 1 / 1024, "Gi": 1, "Ti": 1024}[quantity[-2:]]

    verify, train = k8s["verify"]["resources"], k8s["train"]["resources"]
    assert gib(verify["requests"]["memory"]) < gib(train["requests"]["memory"]), "verify loads only the GGUF"


@pytest.mark.parametrize("suffix", POOLS)
def test_prefect_yaml_names_every_stage_for_each_pool(suffix):
    deployments = _deployments()
    parent = deployments[suffix]
    assert parent["entrypoint"] == "flows/train_and_ship.py:train_and_ship"
    assert parent["work_pool"]["name"] == POOLS[suffix]
    assert parent["work_pool"]["job_variables"]["env"]["LORASHIP_STAGE_DEPLOYMENTS"] == suffix
    for stage in STAGES:
        d = deployments[f"{stage}-{suffix}"]
        assert d["entrypoint"] == "flows/train_and_ship.py:run_stage"
        assert d["parameters"] == {"stage": stage}
        kind = STAGES_BY_NAME[stage].gpu
        assert d["work_pool"]["name"] == (prefect_render.K8S_POOLS[kind] if suffix == "kubernetes" else POOLS[suffix])
        jv = d["work_pool"].get("job_variables") or {}
        if suffix != "local":
            assert jv["image"] == f"loraship-{STAGES_BY_NAME[stage].image}:0.1.0"
            assert d["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "/opt/loraship"
        if suffix == "docker":
            kwargs = jv["container_create_kwargs"]
            assert kwargs["entrypoint"] == ["/usr/bin/env"], "the worker's command must replace the stage entrypoint"
            assert bool(kwargs.get("device_requests")) == (stage in GPU_STAGES)
            assert any(v.endswith(":/shared") for v in jv["volumes"])
        if suffix == "kubernetes":
            gpus = jv["resources"]["limits"].get("nvidia.com/gpu")
            assert gpus == jv["resources"]["requests"].get("nvidia.com/gpu")
            want = str(prefect_render.TRAINING_NODE_GPUS) if stage == "train" else "1" if stage in GPU_STAGES else None
            assert gpus == want, stage
            assert bool(jv["tolerations"]) == (stage in GPU_STAGES)
            assert ("concurrency_limit" in d) == (stage in GPU_STAGES), "GPU stages hold a bounded number of slots"
            assert jv["node_selector"]


def test_flow_names_match_the_deployments():
    flow = pytest.importorskip("loraship.flows.train_and_ship")
    assert flow.train_and_ship.name == "train-and-ship"
    assert flow.run_stage.name == "loraship-stage"
    assert flow.STAGE_DEPLOYMENTS_ENV == "LORASHIP_STAGE_DEPLOYMENTS"


def test_parent_parameters_are_the_demo_config():
    demo = load_config(ROOT / "configs" / "demo.yaml").model_dump(mode="json")
    path_fields = {"base_model", "datasets", "eval_datasets", "golden_prompts", "workdir", "output"}
    for suffix in POOLS:
        config = parse_config(_deployments()[suffix]["parameters"]["config"]).model_dump(mode="json")
        assert {k: v for k, v in config.items() if k not in path_fields} == {
            k: v for k, v in demo.items() if k not in path_fields
        }, f"{suffix}: regenerate deploy/prefect.yaml from configs/demo.yaml (python deploy/render_prefect_yaml.py)"
        if suffix == "local":
            assert config == demo
        else:
            paths = [config["base_model"], config["golden_prompts"], config["workdir"], config["output"]]
            paths += [d["path"] for d in config["datasets"] + config["eval_datasets"]]
            assert all(p.startswith("/shared/") for p in paths), "containers share only the /shared volume"


# ---- deploy/kubernetes -----------------------------------------------------------------------
def test_kubernetes_manifests_validate():
    pytest.importorskip("kubernetes_validate")
    deployments = k8s_render.kubernetes_deployments()
    assert len(deployments) == len(STAGES) + 1
    for d in deployments:
        job = k8s_render.render(d, k8s_render.template_of(d))
        assert k8s_render.validate(job, k8s_render.DEFAULT_K8S_VERSION) == [], d["name"]
        assert k8s_render.gpu_problems(d, job) == [], d["name"]
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["args"] == ["prefect", "flow-run", "execute"]
        assert {"name": "PREFECT__FLOW_RUN_ID", "value": "00000000-0000-0000-0000-000000000000"} in container["env"]
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {m["mountPath"] for m in container["volumeMounts"]} == {"/dev/shm", "/shared"}
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_kubernetes_validation_catches_a_bad_template():
    pytest.importorskip("kubernetes_validate")
    template = json.loads(k8s_render.TEMPLATE.read_text())
    bad = copy.deepcopy(template)
    bad["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    job = k8s_render.render(k8s_render.kubernetes_deployments()[0], bad)
    assert k8s_render.validate(job, k8s_render.DEFAULT_K8S_VERSION)


def test_one_kubernetes_pool_per_hardware_class():
    """The training node's GPUs, the inference GPU, CPU: each its own pool and template; a GPU pool's template asks
    for nvidia.com/gpu by default and requires it, a Prefect-valid variables schema."""
    from prefect.utilities.schema_tools import is_valid_schema, validate

    assert set(prefect_render.K8S_POOLS) == {"none", "training", "inference"}
    assert len(set(prefect_render.K8S_POOLS.values())) == 3
    used = {d["work_pool"]["name"] for d in k8s_render.kubernetes_deployments()}
    assert used == set(k8s_render.POOLS) == set(prefect_render.K8S_POOLS.values())
    for pool, (kind, path) in k8s_render.POOLS.items():
        template = json.loads(path.read_text(encoding="utf-8"))
        is_valid_schema(template["variables"], preprocess=False)
        assert k8s_render._template_requires_gpu(template) == (kind != "none"), pool
        if kind != "none":
            default = template["variables"]["properties"]["resources"]["default"]
            want = str(prefect_render.TRAINING_NODE_GPUS if kind == "training" else 1)
            assert default["limits"]["nvidia.com/gpu"] == default["requests"]["nvidia.com/gpu"] == want
            no_gpu = {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}}
            with pytest.raises(Exception, match="nvidia.com/gpu"):
                validate(no_gpu, template["variables"], raise_on_error=True, preprocess=False, ignore_required=False)
            zero = {"resources": {"requests": {"nvidia.com/gpu": "0"}, "limits": {"nvidia.com/gpu": "0"}}}
            with pytest.raises(Exception):
                validate(zero, template["variables"], raise_on_error=True, preprocess=False, ignore_required=False)
    listed = subprocess.run(
        [sys.executable, str(DEPLOY / "kubernetes" / "render.py"), "--pools"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert {line.split()[0] for line in listed if line} == set(k8s_render.POOLS), "deploy/local/run.sh creates these"


@pytest.mark.parametrize("fault", ["no-gpu-request", "cpu-pool", "one-gpu-for-train", "gpu-on-cpu-stage"])
def test_render_fails_a_stage_on_the_wrong_pool_or_without_its_gpus(fault):
    deployments = {d["name"]: copy.deepcopy(d) for d in k8s_render.kubernetes_deployments()}
    d = deployments["plan-kubernetes" if fault == "gpu-on-cpu-stage" else "train-kubernetes"]
    res = d["work_pool"]["job_variables"]["resources"]
    if fault == "no-gpu-request":
        res["requests"].pop("nvidia.com/gpu"), res["limits"].pop("nvidia.com/gpu")
    elif fault == "cpu-pool":
        d["work_pool"]["name"] = "loraship-kubernetes"
    elif fault == "one-gpu-for-train":
        res["requests"]["nvidia.com/gpu"] = res["limits"]["nvidia.com/gpu"] = "1"
    else:
        res["requests"]["nvidia.com/gpu"] = res["limits"]["nvidia.com/gpu"] = "1"
    job = k8s_render.render(d, k8s_render.template_of(d))
    problems = k8s_render.gpu_problems(d, job)
    assert problems and all("fix:" in p for p in problems), problems


def test_generated_gpu_templates_are_committed():
    for path, text in prefect_render.render_gpu_templates().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.name} is stale: run python deploy/render_prefect_yaml.py"
        )


# ---- deploy/gitops workflow ------------------------------------------------------------------
WORKFLOW = ROOT / ".github" / "workflows" / "loraship-gitops.yml"  # the one copy


def test_workflow_matches_github_schema():
    result = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_workflow_has_no_high_zizmor_finding():
    result = subprocess.run(
        [_tool("zizmor"), "--offline", "--format", "json", str(WORKFLOW)], capture_output=True, text=True
    )
    findings = json.loads(result.stdout or "[]")
    high = [f["ident"] for f in findings if f["determinations"]["severity"] == "High"]
    assert not high, high


def test_workflow_triggers_on_specs_and_runs_gitops():
    wf = yaml.safe_load(WORKFLOW.read_text())
    on = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as True
    assert on["push"]["paths"] == ["deploy/gitops/specs/**"]
    steps = " ".join(s.get("run", "") for s in wf["jobs"]["train-and-ship"]["steps"])
    assert "prefect --no-prompt deploy --prefect-file deploy/prefect.yaml" in steps
    assert "loraship gitops --from" in steps


@pytest.mark.parametrize("spec", sorted((DEPLOY / "gitops" / "specs").glob("*.y*ml")), ids=lambda p: p.name)
def test_shipped_specs_are_valid_configs(spec):
    config = load_spec(spec.read_text(encoding="utf-8"), str(spec.relative_to(ROOT)))
    assert config.run_name


# ---- loraship.runtime.gitops against a scratch git repository ----------------------------------------
class FakeTrigger:
    """Records runs like the Prefect server does: by tag, and one run per idempotency key."""

    def __init__(self, final_state: str = "COMPLETED"):
        self.runs: dict[str, dict] = {}
        self.final_state = final_state

    def find(self, deployment, key, tag):
        return next((r for r in self.runs.values() if tag in r["tags"] and r["deployment"] == deployment), None)

    def run(self, deployment, parameters, key, tags, wait):
        run = self.runs.setdefault(
            key,
            {
                "flow_run_id": f"run-{len(self.runs)}",
                "flow_run_name": key[-8:],
                "state": self.final_state,
                "deployment": deployment,
                "tags": tags,
                "parameters": parameters,
            },
        )
        return {k: run[k] for k in ("flow_run_id", "flow_run_name", "state")}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


SPEC = "base_model: models/tiny\ndatasets:\n  - {path: data/train.jsonl, type: chat}\n"


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "start")
    return tmp_path


def _commit(repo: Path, files: dict[str, str | None], message: str = "change") -> str:
    for rel, text in files.items():
        path = repo / rel
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def test_gitops_dry_run_lists_changed_specs_only(repo):
    start = _git(repo, "rev-parse", "HEAD")
    _commit(
        repo,
        {
            "deploy/gitops/specs/a.yaml": SPEC,
            "deploy/gitops/specs/b.yml": SPEC + "lora_r: 8\n",
            "deploy/gitops/specs/notes.md": "not a spec",
            "configs/other.yaml": SPEC,
        },
    )
    results = trigger_changed_specs(start, "HEAD", repo=repo, dry_run=True, trigger=FakeTrigger())
    assert [(r["spec"], r["action"], r["run_name"]) for r in results] == [
        ("deploy/gitops/specs/a.yaml", "dry-run", "a"),
        ("deploy/gitops/specs/b.yml", "dry-run", "b"),
    ]
    assert all(re.fullmatch(r"[0-9a-f]{64}", r["sha256"]) for r in results)


def test_gitops_triggers_once_per_content_hash(repo):
    trigger = FakeTrigger()
    c0 = _git(repo, "rev-parse", "HEAD")
    c1 = _commit(repo, {"deploy/gitops/specs/a.yaml": SPEC})
    first = trigger_changed_specs(c0, c1, repo=repo, deployment="train-and-ship/docker", trigger=trigger)
    assert [r["action"] for r in first] == ["triggered"] and first[0]["ok"]
    run = next(iter(trigger.runs.values()))
    assert run["parameters"]["config"]["run_name"] == "a"
    assert TAG_PREFIX + first[0]["sha256"][:16] in run["tags"]

    # The same range again (a re-run CI job): nothing new.
    again = trigger_changed_specs(c0, c1, repo=repo, deployment="train-and-ship/docker", trigger=trigger)
    assert [r["action"] for r in again] == ["already-triggered"] and len(trigger.runs) == 1

    # Only comments and layout change: the validated config is the same, so no run.
    c2 = _commit(repo, {"deploy/gitops/specs/a.yaml": "# tweaked\n" + SPEC.replace("{path", "{ path")})
    cosmetic = trigger_changed_specs(c1, c2, repo=repo, deployment="train-and-ship/docker", trigger=trigger)
    assert [r["action"] for r in cosmetic] == ["already-triggered"] and len(trigger.runs) == 1

    # A real change runs; the same content on another deployment is another run.
    c3 = _commit(repo, {"deploy/gitops/specs/a.yaml": SPEC + "lora_r: 32\n"})
    changed = trigger_changed_specs(c2, c3, repo=repo, deployment="train-and-ship/docker", trigger=trigger)
    assert [r["action"] for r in changed] == ["triggered"] and changed[0]["sha256"] != first[0]["sha256"]
    other = trigger_changed_specs(c2, c3, repo=repo, deployment="train-and-ship/kubernetes", trigger=trigger)
    assert [r["action"] for r in other] == ["triggered"] and len(trigger.runs) == 3

    # Reverting to the first content: that config already ran there.
    c4 = _commit(repo, {"deploy/gitops/specs/a.yaml": SPEC})
    reverted = trigger_changed_specs(c3, c4, repo=repo, deployment="train-and-ship/docker", trigger=trigger)
    assert [r["action"] for r in reverted] == ["already-triggered"]


def test_gitops_deleted_specs_and_first_push(repo):
    trigger = FakeTrigger()
    c1 = _commit(repo, {"deploy/gitops/specs/a.yaml": SPEC})
    # GitHub's "before" of a branch's first push is all zeros: compare with the empty tree.
    results = trigger_changed_specs("0" * 40, c1, repo=repo, trigger=trigger)
    assert [r["spec"] for r in results] == ["deploy/gitops/specs/a.yaml"]
    c2 = _commit(repo, {"deploy/gitops/specs/a.yaml": None})
    assert trigger_changed_specs(c1, c2, repo=repo, trigger=trigger) == []


def test_gitops_failed_run_is_not_ok(repo):
    c0 = _git(repo, "rev-parse", "HEAD")
    c1 = _commit(repo, {"deploy/gitops/specs/a.yaml": SPEC})
    results = trigger_changed_specs(c0, c1, repo=repo, trigger=FakeTrigger(final_state="FAILED"))
    assert results[0]["action"] == "triggered" and results[0]["ok"] is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (SPEC + "lora_rank: 8\n", "lora_rank: unknown key (did you mean 'lora_r'?)"),
        ("datasets: []\n", "base_model: required field is missing"),
        ("base_model: [unclosed\n", "not valid YAML"),
    ],
)
def test_gitops_invalid_spec_triggers_nothing(repo, text, expected):
    trigger = FakeTrigger()
    c0 = _git(repo, "rev-parse", "HEAD")
    c1 = _commit(repo, {"deploy/gitops/specs/good.yaml": SPEC, "deploy/gitops/specs/bad.yaml": text})
    with pytest.raises(LorashipError, match=re.escape(expected)) as info:
        trigger_changed_specs(c0, c1, repo=repo, trigger=trigger)
    assert "deploy/gitops/specs/bad.yaml" in str(info.value)
    assert trigger.runs == {}


def test_gitops_unknown_ref_says_how_to_fix(repo):
    with pytest.raises(LorashipError, match="fetch-depth: 0"):
        trigger_changed_specs("no-such-ref", "HEAD", repo=repo, dry_run=True)


def test_tiny_demo_spec_is_the_demo_on_shared_paths():
    spec = DEPLOY / "gitops" / "specs" / "tiny-demo.yaml"
    config = load_spec(spec.read_text(encoding="utf-8"), str(spec)).model_dump(mode="json")
    docker = parse_config(_deployments()["docker"]["parameters"]["config"]).model_dump(mode="json")
    assert config == docker, "tiny-demo.yaml is the docker deployment's demo config: keep them equal"


@pytest.mark.parametrize("stage", STAGES)
def test_docker_job_variables_are_accepted_by_docker_py(stage):
    """The worker hands container_create_kwargs to docker-py's containers.create as they are."""
    containers = pytest.importorskip("docker.models.containers")
    jv = _deployments()[f"{stage}-docker"]["work_pool"]["job_variables"]
    args = containers._create_container_args(
        {
            "image": jv["image"],
            "command": "prefect flow-run execute",
            "volumes": jv["volumes"],
            "version": "1.41",
            **jv["container_create_kwargs"],
        }
    )
    assert args["entrypoint"] == ["/usr/bin/env"]
    requests = args["host_config"].get("DeviceRequests") or []
    assert [r["Capabilities"] for r in requests] == ([[["gpu"]]] if stage in GPU_STAGES else [])
