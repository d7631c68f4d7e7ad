"""A stage imports the library (loraship/), never another stage: whatever one stage needs of another's work lives
in loraship/, so the stage graph is the one loraship/stage_table.py declares and nothing in the code adds to it."""

from __future__ import annotations

import ast
from pathlib import Path

from loraship.stage_table import STAGE_NAMES, STAGES_PACKAGE

ROOT = Path(__file__).resolve().parents[1]
# The two names a stage module goes by: installed (pyproject's package-dir) and in a checkout.
STAGE_PACKAGES = (STAGES_PACKAGE, "tasks")


def _is_stage(module: str, own: str) -> bool:
    """Whether `module` is a stage module (or the stage package) other than `own`'s."""
    for package in STAGE_PACKAGES:
        if module == package:
            return True
        if module.startswith(package + "."):
            return module.split(".")[len(package.split("."))] != own
    return False


def stage_imports(source: str, own: str) -> list[str]:
    """Every other stage that `source` (the stage `own`) imports, at any depth (inside functions too):
    import/from-import, relative imports within the stage package, and importlib.import_module("...")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _is_stage(a.name, own)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # `from . import x`, `from .x import y`: a sibling in the stage package
                names = [node.module] if node.module else [a.name for a in node.names]
                modules = [f"{STAGES_PACKAGE}.{n.split('.')[0]}" for n in names]
            elif node.module in STAGE_PACKAGES:  # `from loraship.stages import verify`
                modules = [f"{node.module}.{a.name}" for a in node.names]
            else:
                modules = [node.module or ""]
            if any(_is_stage(m, own) for m in modules):
                found.append(
                    f"from {'.' * node.level}{node.module or ''} import " + ", ".join(a.name for a in node.names)
                )
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _is_stage(node.args[0].value, own)
        ):
            found.append(f"import_module({node.args[0].value!r})")
    return found


def test_no_stage_imports_another_stage():
    files = sorted((ROOT / "tasks").glob("*.py"))
    stages = {p.stem for p in files}
    assert set(STAGE_NAMES) <= stages, f"stage modules missing from tasks/: {set(STAGE_NAMES) - stages}"
    offenders = {p.name: found for p in files if (found := stage_imports(p.read_text(encoding="utf-8"), p.stem))}
    assert not offenders, (
        f"stages import other stages: {offenders}; fix: move what the other stage needs into loraship/ "
        "(a function both stages import from there), so the stage graph stays loraship/stage_table.py's"
    )


def test_the_finder_sees_every_way_to_import_a_stage():
    borrowed = """
import loraship.stages.train
from loraship.stages.quantize import check_loads
from loraship.stages import verify
from tasks.reference import stop_ids
import tasks.convert as convert
from . import merge
from .publish import figures

def later():
    from loraship.stages.train import collate
    importlib.import_module("loraship.stages.merge")
"""
    assert len(stage_imports(borrowed, "plan")) == 9, stage_imports(borrowed, "plan")
    own_and_library = """
import importlib
from loraship.runtime.lineage import converted_from
from loraship.stages.plan import run
from loraship.stage_table import STAGES_PACKAGE
importlib.import_module("loraship.stages.plan")
importlib.import_module(name)
"""
    assert stage_imports(own_and_library, "plan") == []
