"""Kiln's import graph (read with ast, nothing imported): no cycles between modules, and the
layering of DESIGN.md -- kiln.contracts imports only the standard library, the runtime never
imports the builder or the CLI (kiln, kiln.cli, kiln.ci_cli), the plugins import neither builder
nor runtime; and every import names the one installed package, kiln."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# installed package -> its folder in the checkout (pyproject.toml's package-dir)
PACKAGES = {"kiln": "kiln", "kiln.contracts": "contracts", "kiln.builder": "builder",
            "kiln.runtime": "runtime", "kiln.plugins": "plugins"}
# the top-level names these packages had before they were installed under kiln
OLD_TOP_LEVEL = {"builder", "runtime", "plugins", "kiln_contracts"}


def modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([pkg, *parts])] = f
    return found


def layer(module: str) -> str:
    """The package a module belongs to: the longest PACKAGES prefix (kiln = the CLI)."""
    return max((p for p in PACKAGES if module == p or module.startswith(p + ".")), key=len)


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
    assert "kiln.runtime.server.app" in graph and "kiln.contracts.manifest" in graph
    assert cycles(graph) == []


def test_layering():
    graph = import_graph()
    mods = set(graph)

    # what each package may not import
    forbidden = {"kiln.contracts": {"kiln", "kiln.builder", "kiln.runtime", "kiln.plugins"},
                 "kiln.runtime": {"kiln", "kiln.builder"},
                 "kiln.plugins": {"kiln", "kiln.builder", "kiln.runtime"}}
    bad = [(a, b) for a in graph for b in graph[a]
           if layer(b) in forbidden.get(layer(a), ())]
    assert bad == []
    # kiln.contracts imports nothing but the standard library (no torch, no pydantic)
    third_party = set()
    for f in (ROOT / "contracts").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [])
            third_party |= {n.split(".")[0] for n in names
                            if n.split(".")[0] not in sys.stdlib_module_names
                            and not n.startswith("kiln.contracts")}
    assert third_party == set() and mods


def test_every_import_names_the_kiln_package():
    """No code of the checkout (the packages, tests, benchmarks, scripts) imports a package by
    its folder name: `runtime` or `plugins` as a top-level name collides with other software."""
    stale = []
    folders = [*PACKAGES.values(), "tests", "bench", "scripts"]
    for f in (f for folder in folders for f in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     and node.module else [])
            stale += [f"{f.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] in OLD_TOP_LEVEL]
    assert stale == []


def test_no_plugin_imports_another_plugins_private_name():
    """A plugin (a folder of plugins/) may use another plugin's public names only; what two
    plugins share privately lives in a shared module of plugins/ (cpp_build, triton_common)."""
    private = []
    for f in (ROOT / "plugins").rglob("*.py"):
        parts = f.relative_to(ROOT / "plugins").parts
        mine = parts[0] if len(parts) > 1 else None   # None: a shared module of plugins/
        for node in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.startswith("kiln.plugins.")):
                continue
            theirs = node.module.split(".")[2]
            if (ROOT / "plugins" / theirs).is_dir() and theirs != mine:
                private += [f"{f.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
    assert private == []
