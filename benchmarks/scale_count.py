"""Counting the store requests of real BatchWeave actors, by role, operation and key class.

``CountingStore`` is the latency model (``LatencyStore`` over ``memory://``, so
``remote`` is True and the actors behave as on a cloud store) with every request
attempt recorded in a shared ``Tally``: when, by which role, which operation, which
key, and whether it found the object. ``key_class`` sorts keys into the classes whose
request rates the scale projection needs; ``prefix_of`` names the prefix a store would
partition them under.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from batchweave.errors import ObjectNotFoundError
from batchweave.latency import CLOUD_DEFAULTS, LatencyModel, LatencyStore

__all__ = ["HEAD_COPY", "CountingStore", "Request", "Tally", "key_class", "prefix_of"]

T = TypeVar("T")

# Key classes (what the projection multiplies out). A log version GET that finds nothing
# is a probe of the next version: the key every follower at the head asks for.
LOG_NEXT = "log next (miss)"
LOG_VERSION = "log version"
LOG_LIST = "log listing"
HEAD_COPY = "head copy"  # a copy of a version near the head (journal.headcopies)
SEGMENT = "segment"
SNAPSHOT = "snapshot"
HINT = "snapshot hint"
DATA = "data"
INTENTS = "intents"
WATERMARKS = "watermarks"
PROBE = "probe"
GC_SUMMARY = "gc summary"
OTHER = "other"
KEY_CLASSES = (
    *(LOG_NEXT, LOG_VERSION, LOG_LIST, HEAD_COPY, SEGMENT, SNAPSHOT, HINT),
    *(DATA, INTENTS, WATERMARKS, PROBE, GC_SUMMARY, OTHER),
)
LOG_CLASSES = frozenset({LOG_NEXT, LOG_VERSION, LOG_LIST, HEAD_COPY, SEGMENT, SNAPSHOT, HINT})
_VERSION_KEY = re.compile(r"_log/\d{20}\.json")


def key_class(request: str, key: str, found: bool) -> str:
    """The class of one request on ``key`` (``found``: it did not miss)."""
    if request == "list":
        if key.startswith("_log/"):
            return LOG_LIST
        return {
            "_intents/": INTENTS,
            "_checkpoints/": WATERMARKS,
            "data/": DATA,
            "_probe/": PROBE,
            "_gc/": GC_SUMMARY,
        }.get(_top(key), OTHER)
    if _VERSION_KEY.fullmatch(key):
        return LOG_VERSION if found or request != "get" else LOG_NEXT
    for prefix, name in (
        ("_head/", HEAD_COPY),
        ("_log/_segments/", SEGMENT),
        ("_log/_snapshots/", SNAPSHOT),
        ("_log/_last_snapshot", HINT),
        ("data/", DATA),
        ("_intents/", INTENTS),
        ("_checkpoints/", WATERMARKS),
        ("_probe/", PROBE),
        ("_gc/", GC_SUMMARY),
    ):
        if key.startswith(prefix):
            return name
    return OTHER


def _top(key: str) -> str:
    head, sep, _ = key.partition("/")
    return head + sep


def prefix_of(key: str) -> str:
    """The prefix a store partitions ``key`` under, as the projection counts them: the
    log, the intents and the watermarks are one prefix each, data one per producer."""
    if key.startswith("data/"):
        parts = key.split("/")
        return "data/<producer>/" if len(parts) > 2 else "data/"
    return _top(key) or key


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float  # monotonic seconds
    role: str
    request: str  # get, put, head, list, delete
    key: str
    found: bool

    @property
    def key_class(self) -> str:
        return key_class(self.request, self.key, self.found)


class Tally:
    """Every request attempt of the stores sharing it, in order (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: list[Request] = []

    def add(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def between(self, start_s: float, end_s: float, role: str | None = None) -> list[Request]:
        with self._lock:
            chosen = list(self.requests)
        return [r for r in chosen if start_s <= r.at_s < end_s and (role is None or r.role == role)]


def by_class(requests: Iterable[Request]) -> Counter[str]:
    return Counter(r.key_class for r in requests)


def by_op(requests: Iterable[Request]) -> Counter[str]:
    return Counter(r.request for r in requests)


def hottest_key_windows(requests: list[Request], window_s: float = 1.0) -> tuple[float, float, str]:
    """The busiest key's requests in each ``window_s`` window: (max, mean, the key at the max)."""
    if not requests:
        return 0.0, 0.0, ""
    start = min(r.at_s for r in requests)
    windows: dict[int, Counter[str]] = {}
    for r in requests:
        windows.setdefault(int((r.at_s - start) // window_s), Counter())[r.key] += 1
    tops = [(counts.most_common(1)[0][1], counts.most_common(1)[0][0]) for _, counts in sorted(windows.items())]
    full = tops[:-1] or tops  # the last window is partial
    worst = max(tops)
    return worst[0] / window_s, sum(n for n, _ in full) / len(full) / window_s, worst[1]


class CountingStore(LatencyStore):
    """A ``LatencyStore`` that records each request attempt in ``tally`` under ``role``.

    ``active`` is cleared when an actor's counted part is over (what it does after, such
    as a reader probing past the end of a measured stretch, is not recorded).
    """

    def __init__(
        self, url: str, tally: Tally, role: str, model: LatencyModel = CLOUD_DEFAULTS, *, seed: int | None = None
    ) -> None:
        super().__init__(url, model, seed=seed)
        self.tally = tally
        self.role = role
        self.active = True

    def _attempt(self, key: str, op: Callable[[], T], request: str, *args: Any) -> T:
        found = True
        try:
            return super()._attempt(key, op, request, *args)
        except ObjectNotFoundError:
            found = False
            raise
        finally:
            if self.active and not self._paused:
                self.tally.add(Request(time.monotonic(), self.role, request, key, found))

    def __reduce__(self) -> Any:  # never pickled: it shares a live tally
        raise TypeError("CountingStore is for threads of one process")
