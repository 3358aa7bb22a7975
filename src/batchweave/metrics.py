"""What a consumer can tell about its own reading: the figures behind ``Consumer.metrics()``,
a periodic INFO log line of them, and a Prometheus collector for consumers and producers.

Kept apart from the consumer so the arithmetic (percentiles over a window of recent
fetches) is plain, testable logic, and the consumer only records.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from batchweave.errors import ConfigError

__all__ = ["ConsumerMetrics", "FetchRecorder", "PeriodicLog", "describe", "register_prometheus"]

FETCH_WINDOW = 1024  # recent fetches the latency percentiles are taken over


@dataclass(frozen=True, slots=True)
class ConsumerMetrics:
    """A consumer's reading since it was created (``Consumer.metrics()``).

    ``wait_s`` is the time ``next()`` spent blocked before a step was ready: time the
    training loop waited for data (on a local directory, where the iterating thread reads
    each step itself, that includes the read). ``behind_head_steps`` counts the steps
    the log had shown the consumer that it has not handed out yet (prefetched or not),
    as of its newest log read. Fetch latencies are per read (a step's range reads, or a
    pack's steps read together, decoding and checksum included; ``fetches`` counts them),
    over the last 1024 reads. ``store_retries`` counts
    the store requests retried after throttling, server errors or timeouts, and
    ``store_stalled_s`` the seconds during which at least one request was being retried
    (wall-clock, not summed over threads; the consumer's store, in this process): a storm
    the store rode out, which ``wait_s`` alone would not explain. ``store_rate_limit_per_s``
    is how many requests a second this process may send to the bucket now (``inf`` unless
    the store has been throttling it: see ``batchweave.retry.RequestRateLimiter``), and
    ``store_rate_limited_s`` the seconds it was limited so far. ``log_requests`` counts
    the requests this rank made to the log itself (probes of the head, version reads and
    the proofs of what it read): what it costs the log's hottest keys, to multiply by the
    ranks (a node's hub reads for the ranks that share it, and its requests are its own).
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
    store_retries: int
    store_stalled_s: float
    store_rate_limit_per_s: float = math.inf
    store_rate_limited_s: float = 0.0
    log_requests: int = 0

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


def describe(metrics: ConsumerMetrics) -> str:
    """One line for a log: what a training engineer checks first (is the GPU waiting?)."""
    return (
        f"{metrics.steps} steps, {metrics.bytes / 1e6:.1f} MB, waited {metrics.wait_s:.2f} s for data, "
        f"{metrics.behind_head_steps} steps behind log version {metrics.head_version}, "
        f"fetch P50 {metrics.fetch_p50_s * 1e3:.1f} ms P95 {metrics.fetch_p95_s * 1e3:.1f} ms"
        + (
            f", stalled {metrics.store_stalled_s:.1f} s on the store ({metrics.store_retries} retries)"
            if metrics.store_retries
            else ""
        )
        + (
            f", requests limited to {metrics.store_rate_limit_per_s:.1f}/s (store throttling)"
            if math.isfinite(metrics.store_rate_limit_per_s)
            else ""
        )
    )


class PeriodicLog:
    """Calls ``emit`` at most once every ``interval_s`` seconds of ``tick()`` calls (one
    clock read per tick: cheap enough for every step)."""

    def __init__(self, interval_s: float, emit: Callable[[], None], clock: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._emit = emit
        self._clock = clock
        self._next = clock() + interval_s

    def tick(self) -> None:
        now = self._clock()
        if now >= self._next:
            self._next = now + self._interval_s
            self._emit()


def register_prometheus(source: Any, registry: Any = None, **labels: str) -> Any:
    """Expose ``source.metrics()`` (a ``Consumer`` or a ``Producer``) to Prometheus.

    Every numeric field becomes a gauge ``batchweave_consumer_<field>`` (or
    ``batchweave_producer_<field>``), read when Prometheus scrapes, labelled with
    ``labels`` (say ``rank="3"``). Needs the ``prometheus_client`` package; serve the
    registry the way you already do (``prometheus_client.start_http_server(port)``).
    Returns the collector (``registry.unregister(collector)`` removes it).
    """
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import GaugeMetricFamily
    except ImportError as exc:
        raise ConfigError("register_prometheus needs prometheus_client: pip install 'batchweave[metrics]'") from exc

    kind = "consumer" if hasattr(source, "mark_checkpoint") else "producer"

    class _Collector:
        def collect(self) -> Any:
            current = source.metrics()
            values = current.to_dict() if hasattr(current, "to_dict") else current
            for name, value in sorted(values.items()):
                if isinstance(value, int | float) and not isinstance(value, bool):
                    gauge = GaugeMetricFamily(f"batchweave_{kind}_{name}", f"{kind} {name}", labels=list(labels))
                    gauge.add_metric(list(labels.values()), float(value))
                    yield gauge

    collector = _Collector()
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
