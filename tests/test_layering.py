"""The package's modules import one another without a cycle: each can be read knowing only
the modules below it. Counted: every import of a ``batchweave`` module anywhere in a module,
the lazy ones inside functions too (they are a dependency all the same)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "batchweave"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from batchweave import x`` names a module
    only where x is one; otherwise it is a name from the package's ``__init__``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= (candidates & modules) or ({node.module} & modules)
    return found - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that is on one (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "batchweave.pooljob" in graph["batchweave.ray_pool"]  # the graph sees real imports
    # The package's __init__ re-exports the public API: it imports everything and nothing
    # imports it back except through ``import batchweave as bw`` in code outside the package.
    found = [cycle for cycle in cycles(graph) if "batchweave" not in cycle]
    assert found == [], "\n".join(" -> ".join(cycle) for cycle in found)
