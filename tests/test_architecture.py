"""The import graph of loraship/: no circles among top-level imports (an import inside a function is allowed)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """loraship.* module name -> file."""
    out = {}
    for p in sorted((root / "loraship").rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imported(path: Path, name: str, modules: dict[str, Path], lazy: bool = False) -> set[str]:
    """The loraship modules `path` imports at its top level (in any function too, with `lazy`)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if lazy else tree.body
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..y import z
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in out if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    modules = module_files()
    return {m: imported(p, m, modules, lazy) for m, p in modules.items()}


def test_no_import_cycles_among_top_level_imports():
    graph = import_graph()
    assert len(graph) > 20 and sum(map(len, graph.values())) > 20, "the import graph came out (nearly) empty"
    found = cycles(graph)
    assert not found, (
        f"import circles among top-level imports in loraship/: {found}; fix: move the shared part into "
        f"a module both import, or import inside the function that needs it"
    )


def test_the_cycle_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_planning_has_no_circles_even_through_lazy_imports():
    """The planner's modules layer strictly (shape -> targets, knobs -> estimate, flops -> step_time -> strategy):
    not even an import inside a function goes back up."""
    graph = import_graph(lazy=True)
    planning = {
        m: {w for w in ws if w.startswith("loraship.planning")}
        for m, ws in graph.items()
        if m.startswith("loraship.planning")
    }
    assert len(planning) > 5
    assert not cycles(planning), cycles(planning)


def test_training_has_no_circles_even_through_lazy_imports():
    """The training modules layer strictly too: fused_lora and recompute share the frozen-weight helpers through
    frozen_weights.py, not by importing each other inside functions."""
    graph = import_graph(lazy=True)
    training = {
        m: {w for w in ws if w.startswith("loraship.training")}
        for m, ws in graph.items()
        if m.startswith("loraship.training")
    }
    assert {"loraship.training.fused_lora", "loraship.training.recompute"} <= set(training)
    assert not cycles(training), cycles(training)
