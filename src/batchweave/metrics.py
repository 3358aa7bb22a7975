"""What a consumer can tell about its own reading: the figures behind ``Consumer.metrics()``.

Kept apart from the consumer so the arithmetic (percentiles over a window of recent
fetches) is plain, testable logic, and the consumer only records.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ConsumerMetrics", "FetchRecorder"]

FETCH_WINDOW = 1024  # recent fetches the latency percentiles are taken over


@dataclass(frozen=True, slots=True)
class ConsumerMetrics:
    """A consumer's reading since it was created (``Consumer.metrics()``).

    ``wait_s`` is the time ``next()`` spent blocked before a step was ready: time the
    training loop waited for data (on a local directory, where the iterating thread reads
    each step itself, that includes the read). ``behind_head_steps`` counts the steps
    the log had shown the consumer that it has not handed out yet (prefetched or not),
    as of its newest log read. Fetch latencies are per step (its range reads, decoding
    and checksum included), over the last 1024 steps fetched.
    """

    steps: int
    bytes: int
    wait_s: float
    head_version: int
    behind_head_steps: int
    fetches: int
    fetch_p50_s: float
    fetch_p95_s: float
    fetch_max_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FetchRecorder:
    """Fetch latencies and bytes, recorded from the fetching threads."""

    def __init__(self, window: int = FETCH_WINDOW) -> None:
        self._latencies: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self.fetches = 0

    def record(self, seconds: float) -> None:
        with self._lock:
            self._latencies.append(seconds)
            self.fetches += 1

    def percentiles(self) -> tuple[float, float, float]:
        """(P50, P95, max) of the recent fetches, in seconds (NaN before the first)."""
        with self._lock:
            ordered = sorted(self._latencies)
        if not ordered:
            return math.nan, math.nan, math.nan
        return _nearest_rank(ordered, 0.50), _nearest_rank(ordered, 0.95), ordered[-1]


def _nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]
