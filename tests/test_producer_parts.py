"""``Producer`` is a thin class over its parts (docs/architecture.md, "The producer's
parts"): each part is given what it uses, never the producer, and nothing outside
``producer.py`` reaches the producer's privates (the simulation steps group commit through
``Producer.committer`` and ``GroupTurns.step``)."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_layering import import_graph

import batchweave as bw
from batchweave.commit.group import GroupCommit
from batchweave.commit.turns import GroupTurns
from batchweave.errors import ProducerFencedError
from batchweave.journal import Journal
from batchweave.store import open_store

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


class _NeverStarted:
    """A commit thread that never runs, as in the simulation: the caller steps its loop."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


def test_group_commit_is_stepped_through_public_calls_when_its_thread_never_runs(tmp_path, monkeypatch):
    """What the simulation's driver does, on a real directory: ``Producer.committer``'s
    ``step`` does nothing with nothing pending, commits within ``flushing``, and raises the
    producer's final error (here: fenced by a newer incarnation)."""
    from batchweave import producer as producer_module

    shim = SimpleNamespace(Thread=_NeverStarted, Condition=threading.Condition, Event=threading.Event)
    monkeypatch.setattr(producer_module, "threading", shim)
    url = str(tmp_path / "ns")
    producer = bw.Producer(url, "g", dp=1, commit_policy=GroupCommit(interval_s=0.05), pack_steps=1)
    turns = producer.committer
    assert isinstance(turns, GroupTurns)
    assert turns.step() is False  # nothing pending: nothing done
    producer.append([b"first"])
    step_until(turns, lambda: producer.resume_offset == 1)
    assert Journal(open_store(url)).load_state().producers["g"].offset == 1

    producer.append([b"second"])
    bw.Producer(url, "g", dp=1, commit_policy="group").close()  # a newer incarnation fences this one
    with pytest.raises(ProducerFencedError):
        step_until(turns, lambda: False)
    producer.close(flush=False)


def step_until(turns: GroupTurns, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with turns.flushing():
        while not done():
            assert turns.step(), "nothing pending"
            assert time.monotonic() < deadline, "no commit within the deadline"
