"""What a namespace holds: the data behind ``batchweave inspect`` (and ``watch``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Literal

import msgspec

from batchweave.journal import Journal
from batchweave.journal.namespace import require_namespace
from batchweave.lifecycle.watermarks import Checkpoint, read_watermarks
from batchweave.log import LogState, ProducerState
from batchweave.schema import ArraySchema, Schema
from batchweave.store import Store, open_store

__all__ = [
    "CheckpointInfo",
    "NamespaceInfo",
    "inspect_namespace",
    "live_checkpoints",
    "read_schema",
    "read_state",
    "schema_of",
    "schema_text",
]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One checkpoint that has not been released, seen from the log head."""

    id: str
    complete: bool  # every position of the marking mesh marked: a restore point that holds data back
    position: Fraction  # TGBs consumed when it was taken (the smallest mark): where a resume starts
    version: int  # the log version a resume reads from (the smallest mark)
    lag_steps: Fraction  # steps committed since ``position``: how far training has moved past it

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "complete": self.complete,
            "position": json_number(self.position),
            "version": self.version,
            "lag_steps": json_number(self.lag_steps),
        }


def json_number(value: Fraction) -> int | float:
    """A position as JSON: an integer unless a reshaped mesh left it inside a TGB."""
    return value.numerator if value.denominator == 1 else float(value)


def live_checkpoints(checkpoints: Iterable[Checkpoint], head_steps: int) -> tuple[CheckpointInfo, ...]:
    """The checkpoints not released, with their lag behind a head of ``head_steps`` steps.

    Incomplete ones are listed too (a rank crashed between marks): they protect nothing,
    and seeing them is how an operator notices.
    """
    return tuple(
        CheckpointInfo(c.checkpoint, c.complete, c.position, c.version, head_steps - c.position)
        for c in checkpoints
        if c.marks and not c.released
    )


def read_state(journal: Journal[Any]) -> tuple[LogState, list[Checkpoint]]:
    """The newest state and every checkpoint. Watermarks are read first: a mark points at
    a committed step, so a state loaded after it is at least that new and no lag is negative."""
    checkpoints = read_watermarks(journal.store)
    return journal.load_state(), checkpoints


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """A summary of one namespace at its newest log version."""

    url: str
    latest_version: int
    steps: int
    producers: dict[str, dict[str, Any]]  # id -> {"offset", "epoch"[, "metrics"]}
    end_of_stream: bool
    bytes: int  # bytes of committed TGB objects
    namespace: str = ""  # the id fixed when the namespace was created
    layout: dict[str, Any] | None = None  # {"dp", "cp", "kind"} every TGB has
    reclaimed_steps: int = 0  # steps below this were garbage-collected
    checkpoints: tuple[CheckpointInfo, ...] = ()  # not released, oldest id first
    # Each array's {"dtype", "shape"} by name (``Schema.to_dict``; a shape's None varies),
    # "bytes" for raw bytes, None before the first TGB (or in a log older than schemas)
    schema: dict[str, dict[str, Any]] | Literal["bytes"] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["checkpoints"] = [c.to_dict() for c in self.checkpoints]  # Fractions as JSON numbers
        return out


def producer_dict(state: ProducerState) -> dict[str, Any]:
    """A producer as ``inspect`` and ``watch`` show it: {"offset", "epoch"[, "metrics"]}."""
    out: dict[str, Any] = {"offset": state.offset, "epoch": state.epoch}
    if state.metrics:
        out["metrics"] = dict(state.metrics)
    return out


def inspect_namespace(url: str | Store, *, storage_options: dict[str, Any] | None = None) -> NamespaceInfo:
    """Read the newest state of the namespace at ``url`` (O(1) requests plus the log tail,
    plus one listing and one read per checkpoint watermark)."""
    store = open_store(url, create=False, storage_options=storage_options)
    state, checkpoints = read_state(Journal(store, read_only=True))
    require_namespace(store, state, has_checkpoints=bool(checkpoints))
    return NamespaceInfo(
        url=store.url,
        latest_version=state.version,
        steps=state.steps,
        producers={pid: producer_dict(ps) for pid, ps in sorted(state.producers.items())},
        end_of_stream=state.end_of_stream,
        bytes=state.bytes,
        namespace=state.namespace,
        layout=None if state.layout is None else msgspec.structs.asdict(state.layout),
        reclaimed_steps=state.reclaimed.steps,
        checkpoints=live_checkpoints(checkpoints, state.steps),
        schema=_schema_dict(schema_of(state)),
    )


def schema_of(state: LogState) -> Schema | Literal["bytes"] | None:
    """The schema a log state records: see ``read_schema``."""
    if state.schema is not None:
        return state.schema
    return "bytes" if state.layout is not None and state.layout.kind == "bytes" else None


def _schema_dict(schema: Schema | Literal["bytes"] | None) -> dict[str, dict[str, Any]] | Literal["bytes"] | None:
    return schema.to_dict() if isinstance(schema, Schema) else schema


def schema_text(schema: dict[str, dict[str, Any]] | Literal["bytes"] | None) -> str:
    """``NamespaceInfo.schema`` for people: ``"mask: bool (*,), tokens: int32 (*, 2048)"``
    (``*``: a first dimension that varies), ``"bytes"``, or ``"-"`` before the first TGB."""
    if not isinstance(schema, dict):
        return schema or "-"
    arrays = (ArraySchema(name, spec["dtype"], tuple(spec["shape"])) for name, spec in schema.items())
    return Schema(tuple(arrays)).describe()


def read_schema(url: str | Store, *, storage_options: dict[str, Any] | None = None) -> Schema | Literal["bytes"] | None:
    """The schema of the namespace at ``url``: what every slice of every step holds.

    A ``Schema`` (each array's name, dtype and shape, ``None`` for a first dimension that
    varies) once a TGB of arrays is committed; ``"bytes"`` for a namespace of raw bytes;
    None while nothing is committed (a consumer may start before the first producer), or
    for a namespace of arrays written before schemas were recorded. Costs what opening a
    namespace costs: O(1) requests plus the log's tail. Raises ``ConfigError`` for a local
    directory that does not exist.
    """
    store = open_store(url, create=False, storage_options=storage_options)
    return schema_of(Journal(store, heads_only=True, read_only=True).load_state())
