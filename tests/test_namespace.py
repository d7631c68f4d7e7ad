"""One installed namespace: tasks/ is loraship.stages and flows/ is loraship.flows, in a wheel, an
editable install and a plain checkout on PYTHONPATH; imports run core <- stages <- the flow."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from loraship.stage_table import STAGE_TABLE

ROOT = Path(__file__).resolve().parent.parent
# What setuptools reads to build the package (pyproject's readme too).
BUILD_INPUTS = ("pyproject.toml", "README.md", "loraship", "tasks", "flows")


def _source_copy(tmp_path: Path) -> Path:
    """The package's sources in a scratch folder, so a build leaves no build/ or egg-info here."""
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    return src


def _python(code: str, cwd: Path, *flags: str, pythonpath: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    done = subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_wheel_installs_only_loraship(tmp_path):
    pytest.importorskip("setuptools")
    src = _source_copy(tmp_path)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "wheel").glob("loraship-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"loraship"}, top
    assert len(top) == 2, top
    assert {"loraship/stages/verify.py", "loraship/flows/train_and_ship.py"} <= set(names)
    assert {f"loraship/stages/{stage.name}.py" for stage in STAGE_TABLE} <= set(names)


def test_editable_install_maps_stages_and_flows(tmp_path):
    """setuptools' editable finder, alone on sys.meta_path (-S: not this venv's own install)."""
    pytest.importorskip("setuptools")
    src = _source_copy(tmp_path)
    out = tmp_path / "editable"
    out.mkdir()
    name = _python(f"from setuptools import build_meta; print(build_meta.build_editable({str(out)!r}))", src).split()[
        -1
    ]
    site = tmp_path / "site"
    zipfile.ZipFile(out / name).extractall(site)
    (finder,) = site.glob("__editable___*_finder.py")
    origins = _python(
        f"import site; site.addsitedir({str(site)!r})\n"
        f"from {finder.stem} import _EditableFinder as f\n"
        "import loraship\n"
        "print(f.find_spec('loraship.stages').origin, f.find_spec('loraship.flows').origin, loraship.__file__)",
        tmp_path,
        "-S",
    ).split()
    assert origins == [
        str(src / "tasks" / "__init__.py"),
        str(src / "flows" / "__init__.py"),
        str(src / "loraship" / "__init__.py"),
    ]


def test_checkout_without_install_imports_stages_and_flows(tmp_path):
    """PYTHONPATH=<checkout>, nothing installed (-S), run from elsewhere: loraship/__init__.py's hook."""
    code = (
        "import importlib.util, loraship.stages, loraship.flows\n"
        "print(importlib.util.find_spec('loraship.stages.verify').origin)\n"
        "print(importlib.util.find_spec('loraship.flows.train_and_ship').origin)"
    )
    assert _python(code, tmp_path, "-S", pythonpath=ROOT).split() == [
        str(ROOT / "tasks" / "verify.py"),
        str(ROOT / "flows" / "train_and_ship.py"),
    ]
    # With the dependencies (this venv's site-packages), the modules themselves import.
    code = "import loraship.stages.verify as v, loraship.flows.train_and_ship as f\nprint(v.__file__, f.__file__)"
    assert _python(code, tmp_path, pythonpath=ROOT).split() == [
        str(ROOT / "tasks" / "verify.py"),
        str(ROOT / "flows" / "train_and_ship.py"),
    ]


def test_every_stage_module_of_the_table_is_a_file_in_tasks():
    for stage in STAGE_TABLE:
        assert stage.module == f"loraship.stages.{stage.name}"
        assert importlib.util.find_spec(stage.module).origin == str(ROOT / "tasks" / f"{stage.name}.py")


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(f"{node.module}.{alias.name}", id(node) in top) for alias in node.names]
    return found


def test_imports_run_one_way():
    """core (loraship/) <- stages (tasks/) <- flows (flows/): the core reaches a stage only through
    stage_table.stage_module(), the flow through the same; only the CLI's `run` imports the flow."""
    for path in sorted((ROOT / "loraship").rglob("*.py")):
        for module, top in _imports(path):
            assert not module.startswith(("loraship.stages", "tasks", "flows")), f"{path.name} imports {module}"
            if module.startswith("loraship.flows"):
                assert path.name == "cli.py" and not top, f"{path.name} imports {module}"
    for path in sorted((ROOT / "tasks").glob("*.py")):
        for module, _top in _imports(path):
            assert not module.startswith(("loraship.flows", "loraship.cli", "tasks", "flows")), (
                f"{path} imports {module}"
            )
    for path in sorted((ROOT / "flows").glob("*.py")):
        for module, _top in _imports(path):
            assert not module.startswith(("loraship.stages", "tasks")), f"{path} imports {module}"


# loraship/ by concern, each group importing (at module level) only the groups before it: the core
# (config, constants, errors, stage table, chat, data, models) <- planning, training, runtime <- llamacpp,
# publishing <- verification, fixtures <- the CLI, its helpers (--set, --only/--from, the plan report) and init
# (the application).
LAYERS = {
    "core": set(),
    "planning": {"core"},
    "training": {"core"},
    "runtime": {"core"},
    "llamacpp": {"core", "planning", "runtime"},
    "publishing": {"core", "runtime"},
    "verification": {"core", "planning", "runtime", "llamacpp"},
    "fixtures": {"core", "planning", "runtime", "llamacpp"},
    "app": {"core", "planning", "training", "runtime", "llamacpp", "publishing", "verification", "fixtures"},
}
APP = {"cli", "starter", "config_overrides", "stage_selection", "plan_report"}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "app" if len(parts) > 1 and parts[1] in APP else "core"


def test_library_groups_import_one_way():
    for path in sorted((ROOT / "loraship").rglob("*.py")):
        rel = path.relative_to(ROOT / "loraship")
        own = rel.parts[0] if len(rel.parts) > 1 else ("app" if path.stem in APP else "core")
        for module, top in _imports(path):
            if top and module.startswith("loraship.") and not module.startswith(("loraship.stages", "loraship.flows")):
                used = _layer(module)
                assert used == own or used in LAYERS[own], f"{rel} ({own}) imports {module} ({used})"
