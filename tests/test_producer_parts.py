"""``Producer`` is a thin class over its parts (docs/architecture.md, "The producer's
parts"): each part is given what it uses, never the producer, and nothing outside
``producer.py`` reaches the producer's privates (the simulation steps group commit through
``Producer.committer`` and ``GroupTurns.step``)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import import_graph

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "batchweave"
PARTS = (
    "batchweave.commit.claiming",
    "batchweave.commit.contention",
    "batchweave.writing.packs",
    "batchweave.writing.schemas",
    "batchweave.lifecycle.maxlag",
)


def producer_privates() -> set[str]:
    """The private attributes and methods of ``Producer``, as its source defines them."""
    tree = ast.parse((PACKAGE / "producer.py").read_text())
    producer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Producer")
    names = {n.name for n in producer.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    for node in ast.walk(producer):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
    return {name for name in names if not name.startswith("__")}


def reached_from_outside(path: Path, private: set[str]) -> list[str]:
    """``x.<private>`` in ``path``, where ``x`` is a producer's name: anything but ``self``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in private:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if "producer" in name.lower() or name in {"p", "prod"}:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_of_the_package_reaches_the_producers_privates():
    private = producer_privates()
    assert {"_shared", "_committer", "_packs", "_journal", "_next_offset"} <= private  # the source was read
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "producer.py"
        for hit in reached_from_outside(path, private)
    ]
    assert found == []


def test_the_parts_are_given_what_they_use_not_the_producer():
    graph = import_graph()
    for part in PARTS:
        assert "batchweave.producer" not in graph[part], f"{part} imports the producer"
    assert set(PARTS) <= graph["batchweave.producer"]
