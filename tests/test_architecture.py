"""docs/architecture.md's table of layers is the code's: every module of the package stands
in exactly one layer, and no module imports one from a layer above its own. A module moved
or an import added across the layers fails here until the page says where it belongs."""

from __future__ import annotations

import re
from pathlib import Path

from test_layering import import_graph

PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
ROW = re.compile(r"^\|\s*(\d+)\.\s[^|]*\|([^|]*)\|")
NAME = re.compile(r"`([a-z_.]+)`")


def layers_of(page: str) -> dict[str, int]:
    """Each name of the page's layer table (a module, or a package standing for all of
    its modules) and the number of its layer."""
    section = page.split("## The layers", 1)[1].split("\n## ", 1)[0]
    named: dict[str, int] = {}
    for line in section.splitlines():
        row = ROW.match(line)
        if row:
            for name in NAME.findall(row.group(2)):
                assert name not in named, f"{name} stands in two layers"
                named[name] = int(row.group(1))
    return named


def layer(module: str, named: dict[str, int]) -> int | None:
    """The layer of ``batchweave.x.y``: the layer of its longest named prefix."""
    parts = module.split(".")[1:]
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in named:
            return named[".".join(parts[:end])]
    return None


def misplaced(graph: dict[str, set[str]], named: dict[str, int]) -> list[str]:
    problems = [f"{m}: in no layer of the page" for m in sorted(graph) if m != "batchweave" and layer(m, named) is None]
    for module, imported in sorted(graph.items()):
        own = layer(module, named)
        if own is None or module == "batchweave":
            continue
        for target in sorted(imported - {"batchweave"}):
            theirs = layer(target, named)
            if theirs is not None and theirs > own:
                problems.append(f"{module} (layer {own}) imports {target} (layer {theirs})")
    return problems


def test_the_checker_finds_an_upward_import_and_a_module_in_no_layer():
    named = {"low": 1, "high": 2}
    graph = {"batchweave.low.a": {"batchweave.high"}, "batchweave.high": set(), "batchweave.stray": set()}
    assert misplaced(graph, named) == [
        "batchweave.stray: in no layer of the page",
        "batchweave.low.a (layer 1) imports batchweave.high (layer 2)",
    ]


def test_every_name_on_the_page_is_a_module_of_the_package():
    graph = import_graph()
    for name in layers_of(PAGE.read_text()):
        assert f"batchweave.{name}" in graph, f"docs/architecture.md names {name}, which the package does not have"


def test_the_code_keeps_to_the_layers_of_the_page():
    named = layers_of(PAGE.read_text())
    assert len(set(named.values())) >= 5  # the table was read
    assert misplaced(import_graph(), named) == []


def test_every_name_the_page_points_to_exists():
    """The data path and the change guide name functions and classes in full
    (``batchweave.layout.encode_tgb``): each resolves, so a rename updates the page."""
    import importlib

    names = set(re.findall(r"`(batchweave(?:\.\w+)+)`", PAGE.read_text()))
    assert len(names) >= 10  # the page was read
    missing = []
    for name in sorted(names):
        parts = name.split(".")
        for split in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:split]))
            except ModuleNotFoundError:
                continue
            for attribute in parts[split:]:
                found = getattr(found, attribute, None)
            if found is None:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert missing == []


def test_the_producer_names_no_commit_mode():
    """A commit mode is one change in ``commit/`` (the page's "Adding a commit mode"): the
    producer imports none of the modes or their policies, only ``committer_for``."""
    graph = import_graph()
    modes = {f"batchweave.commit.{name}" for name in ("loop", "turns", "group", "intents")}
    assert "batchweave.commit.committer" in graph["batchweave.producer"]
    assert graph["batchweave.producer"] & modes <= {"batchweave.commit.loop"}  # its ``without_stall`` helper
    source = (PAGE.parents[1] / "src" / "batchweave" / "producer.py").read_text()
    assert "GroupCommit" not in source.replace("``batchweave.commit.group.GroupCommit``", "")
    assert "CommitLoop" not in source and "GroupTurns" not in source
