"""The package's modules import each other without cycles (any import statement counts, also one
inside a function: a cycle there is a knot a reader has to untangle, even when Python tolerates it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# installed names -> source folders (pyproject's package-dir)
PACKAGE_DIRS = {"ps_bridge": ROOT / "ps_bridge", "ps_bridge.providers": ROOT / "providers", "ps_bridge.models": ROOT / "models"}


def package_modules() -> dict:
    """module name -> source file, for every module of the installed package."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package] + parts)
            # a sub-folder of ps_bridge that is mapped elsewhere is not part of this package
            if not any(name.startswith(other + ".") or name == other for other in PACKAGE_DIRS if other != package and other.startswith(package + ".") ):
                modules[name] = path
    return modules


def imported_modules(path: Path, this: str, is_package: bool, modules: dict) -> set:
    """The package's modules that `this` names in an import statement."""
    out = set()
    base = this if is_package else this.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                module = f"{anchor}.{node.module}" if node.module else anchor
            else:
                module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in modules] or [module]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` of a function/class: its module
                name = name.rpartition(".")[0]
            if name and name != this:
                out.add(name)
    return out


def import_graph() -> dict:
    modules = package_modules()
    return {
        name: imported_modules(path, name, path.name == "__init__.py", modules) for name, path in modules.items()
    }


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "ps_bridge.providers.registry" in graph and "ps_bridge.models.attention" in graph
    assert "ps_bridge.layout" in graph["ps_bridge.rows"]


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def reachable(graph: dict, start: str) -> set:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for name in graph.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def tooling_reached_from(graph: dict, package: str) -> dict:
    """module of `package` -> the tooling modules (`ps_bridge.tools`) it reaches."""
    found = {}
    for name in graph:
        if name == package or name.startswith(package + "."):
            tools = sorted(m for m in reachable(graph, name) if m == "ps_bridge.tools" or m.startswith("ps_bridge.tools."))
            if tools:
                found[name] = tools
    return found


def test_the_tooling_check_sees_an_import_of_the_tools():
    graph = {"ps_bridge.verl.engine": {"ps_bridge.layout"}, "ps_bridge.layout": {"ps_bridge.tools.bench"}}
    assert tooling_reached_from(graph, "ps_bridge.verl") == {"ps_bridge.verl.engine": ["ps_bridge.tools.bench"]}


def test_the_plugin_package_holds_only_what_verl_loads():
    names = sorted(p.name for p in (ROOT / "ps_bridge" / "verl").iterdir() if p.name != "__pycache__")
    assert names == ["__init__.py", "batch.py", "engine.py", "micro_batches.py"]


@pytest.mark.parametrize("package", ["ps_bridge.verl", "ps_bridge.providers", "ps_bridge.models", "ps_bridge.parallel"])
def test_the_core_imports_no_tooling(package):
    """verl loads `ps_bridge.verl` (`external_lib`); it and the model code it runs stand below the bench,
    the CLI and verl-check, so none of them may reach `ps_bridge.tools`, even through another module."""
    graph = import_graph()
    assert any(name.startswith(package) for name in graph)
    found = tooling_reached_from(graph, package)
    assert not found, f"{package} reaches the tooling: {found}"


def test_only_the_tooling_imports_the_tooling():
    graph = import_graph()
    outside = {
        name: sorted(m for m in imports if m.startswith("ps_bridge.tools"))
        for name, imports in graph.items()
        if not name.startswith("ps_bridge.tools")
    }
    outside = {name: tools for name, tools in outside.items() if tools}
    assert not outside, f"modules outside ps_bridge.tools import it: {outside}"


@pytest.mark.parametrize("name", ["testing", "verl_testing"])
def test_no_test_support_inside_the_package(name):
    assert not (ROOT / "ps_bridge" / f"{name}.py").exists()
