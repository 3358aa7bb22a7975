"""What a namespace holds: the data behind ``batchweave inspect``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from batchweave.journal import Journal
from batchweave.log import ProducerState
from batchweave.store import Store, open_store

__all__ = ["NamespaceInfo", "inspect_namespace"]


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _producer(state: ProducerState) -> dict[str, Any]:
    out: dict[str, Any] = {"offset": state.offset, "epoch": state.epoch}
    if state.metrics:
        out["metrics"] = dict(state.metrics)
    return out


def inspect_namespace(url: str | Store, **store_options: Any) -> NamespaceInfo:
    """Read the newest state of the namespace at ``url`` (O(1) requests plus the log tail)."""
    store = open_store(url, create=False, **store_options)
    state = Journal(store).load_state()
    return NamespaceInfo(
        url=store.url,
        latest_version=state.version,
        steps=state.steps,
        producers={pid: _producer(ps) for pid, ps in sorted(state.producers.items())},
        end_of_stream=state.end_of_stream,
        bytes=state.bytes,
        namespace=state.namespace,
        layout=None if state.layout is None else msgspec.structs.asdict(state.layout),
        reclaimed_steps=state.reclaimed.steps,
    )
