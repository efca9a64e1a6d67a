"""Kiln's import graph (read with ast, nothing imported): no cycles between modules, and the
layering of DESIGN.md -- kiln_contracts imports only the standard library, runtime never
imports builder or the CLI package kiln, plugins import neither builder nor runtime."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kiln_contracts", "kiln", "builder", "runtime", "plugins")


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = f
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the kiln modules it imports (at module level or inside functions)."""
    mods = modules()

    def resolve(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[m] |= {t for t in map(resolve, names) if t and t != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert "runtime.server.app" in graph and "kiln_contracts.manifest" in graph
    assert cycles(graph) == []


def test_layering():
    graph = import_graph()
    mods = set(graph)

    def is_(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")

    bad = [(a, b) for a in graph for b in graph[a]
           if (is_(a, "kiln_contracts") and not is_(b, "kiln_contracts"))
           or (is_(a, "runtime") and (is_(b, "builder") or is_(b, "kiln")))
           or (is_(a, "plugins") and (is_(b, "builder") or is_(b, "runtime") or is_(b, "kiln")))]
    assert bad == []
    # kiln_contracts imports nothing but the standard library (no torch, no pydantic)
    third_party = set()
    for f in (ROOT / "kiln_contracts").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [])
            third_party |= {n.split(".")[0] for n in names
                            if n.split(".")[0] not in sys.stdlib_module_names
                            and n.split(".")[0] != "kiln_contracts"}
    assert third_party == set() and mods
