"""A producer pool's request load as it grows to 1,000 producers, and garbage
collection's as the history grows to 100,000 versions (issue 29).

Real ``Producer`` objects in threads of one process, on the counting latency model
(``scale_count.CountingStore``), in three states:

1. *claiming at start*: P producers constructed together on a fresh namespace, each
   claiming its epoch by a ticket that whoever commits a claim folds (``commit.claims``);
2. *following the log*: P producers appending small TGBs, paced so the pool makes
   ``pool_tgb_per_s`` TGBs a second in all (a training job's step rate), committing in
   group mode (taking turns, following the log while they have TGBs pending) or direct
   mode (DAC, each its own);
3. *held by max_lag*: P producers whose ``append`` waits for a checkpoint that never
   advances, polling ``_checkpoints/`` where one checkpoint of ``marks`` watermarks lies.

Each returns flat records: requests per second on ``_log/`` (PUT, GET; mean and peak
1-s window) or ``_checkpoints/`` (LIST, GET), the busiest key's peak and mean 1-s
window, and per producer. Sizes too heavy for threads on this machine are projected from
the largest one measured, linearly in P (``how``: "measured" or "projected").
``gc_rows`` runs ``bench gc-history``'s collections for bench scale's table.

Targets at 1,000 producers: <= 100 requests/s on any one key, <= 1,000 PUT/s and
<= 3,000 GET/s on the ``_log/`` prefix.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from batchweave.commit.claims import CLAIM_PREFIX
from batchweave.commit.policies import Manual
from batchweave.errors import BatchWeaveError
from batchweave.inspect import inspect_namespace
from batchweave.journal import Journal
from batchweave.latency import CLOUD_DEFAULTS, LatencyModel
from batchweave.lifecycle.gc import collect_garbage
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, Watermark, write_watermark
from batchweave.pooljob import start_delay_s
from batchweave.producer import Producer
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.store import open_store
from benchmarks.gc_history import collections_at
from benchmarks.scale_count import CountingStore, Request, Tally, hottest_key_windows
from benchmarks.scale_measure import INSTANT

__all__ = [
    "FAST",
    "GET_TARGET_PER_S",
    "KEY_TARGET_PER_S",
    "PUT_TARGET_PER_S",
    "PoolConfig",
    "claims",
    "following",
    "gc_rows",
    "held",
    "measure_pool",
]

KEY_TARGET_PER_S = 100.0  # any one key
PUT_TARGET_PER_S = 1_000.0  # the _log/ prefix
GET_TARGET_PER_S = 3_000.0  # the _log/ prefix
LOG = "_log/"
S3_LIST_PAGE = 1_000  # keys a LIST returns per page on S3 (and per request counted here: one)

# A tenth of the cloud model's latencies: fast enough for 64 producers in a test, slow
# enough that the requests of threads overlap as on a store.
FAST = LatencyModel(put_s=0.004, first_byte_s=0.0025, head_s=0.0015, list_s=0.004, delete_s=0.002, jitter_sigma=0.3)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    sizes: tuple[int, ...] = (16, 64, 256, 1000)
    largest_measured: int = 256  # held before any collection: larger pools are projected (1.25 M first reads)
    model: LatencyModel = CLOUD_DEFAULTS
    pool_tgb_per_s: float = 3.0  # the whole pool's appends: a training job's step rate
    warmup_s: float = 4.0  # after the pool started, before counting
    window_s: float = 10.0  # counted
    policies: tuple[str, ...] = ("group", "dac")
    marks: int = 1_250  # one checkpoint of 10,000 ranks at tp = 8
    gc_versions: tuple[int, ...] = (1_000, 10_000, 100_000)

    @classmethod
    def quick(cls) -> PoolConfig:
        return cls(
            sizes=(16, 64),
            largest_measured=16,
            model=FAST,
            pool_tgb_per_s=6.0,
            warmup_s=0.5,
            window_s=4.0,  # long enough for a commit in the window under a loaded CI machine
            marks=100,
            gc_versions=(100, 400),
        )


def measure_pool(config: PoolConfig, advance: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """Every state at every size: measured, or projected above ``largest_measured`` where noted."""
    records: list[dict[str, Any]] = []
    # Claims are measured at every size: with tickets a pool of 1,000 claims in seconds.
    records.extend(claims(p, config.model, staggered=staggered) for staggered in (False, True) for p in config.sizes)
    advance()
    # So are following and held polls after a collection (a few requests a producer); held
    # polls before any collection read every mark at first (1.25 million GETs at 1,000):
    # measured up to ``largest_measured``, projected above.
    everywhere = max(config.sizes)
    for measure, largest in (
        (lambda p: [following(p, policy, config) for policy in config.policies], everywhere),
        (lambda p: [held(p, config, collected=True)], everywhere),
        (lambda p: [held(p, config)], config.largest_measured),
    ):
        records.extend(_measured_or_projected(measure, config.sizes, largest))
        advance()
    return records


def _measured_or_projected(
    measure: Callable[[int], list[dict[str, Any]]], sizes: tuple[int, ...], largest_measured: int
) -> list[dict[str, Any]]:
    measured = [r for p in sizes if p <= largest_measured for r in measure(p)]
    largest = max(r["producers"] for r in measured)
    base = [r for r in measured if r["producers"] == largest]
    projected = [_project(r, p) for p in sizes if p > largest_measured for r in base]
    return measured + projected


def _project(record: dict[str, Any], producers: int) -> dict[str, Any]:
    """``record`` at ``producers``: every rate and count scaled linearly in the pool (each
    producer sends what it did at the measured size); the busiest key's too, as one key
    (a listed prefix) takes the requests of every producer."""
    factor = producers / record["producers"]
    out = dict(record, producers=producers, how="projected", projected_from=record["producers"])
    for key, value in record.items():
        rate = key.endswith("_per_s") and not key.endswith("_per_producer_s")
        count = isinstance(value, int) and key not in ("producers", "marks")
        if rate or count:
            out[key] = value * factor
    return out


# -- counting ------------------------------------------------------------------------------


def _rates(requests: list[Request], prefix: str, seconds: float, producers: int) -> dict[str, Any]:
    """Requests on ``prefix`` per second by operation (mean and peak 1-s window, and per
    producer), and the busiest key's peak and mean 1-s window (any prefix)."""
    chosen = [r for r in requests if r.key.startswith(prefix)]
    name = prefix.strip("_/")
    out: dict[str, Any] = {}
    for op in ("put", "get", "list", "head", "delete"):
        ops = [r for r in chosen if r.request == op]
        if not ops and op not in ("put", "get", "list"):
            continue
        out[f"{name}_{op}s"] = len(ops)
        out[f"{name}_{op}_per_s"] = len(ops) / seconds
        out[f"{name}_{op}_peak_per_s"] = _peak_per_s(ops)
        out[f"{name}_{op}_per_producer_s"] = len(ops) / seconds / producers
    hot_max, hot_mean, hot_key = hottest_key_windows(requests)
    out.update(hot_key_per_s=hot_max, hot_key_mean_per_s=hot_mean, hot_key=hot_key)
    out["requests"] = len(requests)
    out["seconds"] = seconds
    return out


def _peak_per_s(requests: list[Request]) -> float:
    """The most requests in one 1-s window (from the first request)."""
    if not requests:
        return 0.0
    start = min(r.at_s for r in requests)
    return float(max(Counter(int(r.at_s - start) for r in requests).values()))


# -- the pool ------------------------------------------------------------------------------


def _start_pool(
    url: str,
    tally: Tally,
    model: LatencyModel,
    producers: int,
    policy: str,
    *,
    counted: bool = True,
    staggered: bool = False,
    **options: Any,
) -> list[Producer]:
    """``producers`` Producers constructed together in threads (each claims its epoch),
    or ``staggered`` as a producer pool starts its workers (``pooljob.start_delay_s``).
    Not ``counted``: the claims take no modelled time and are not recorded (``claims``
    measures them apart)."""
    pool: list[Producer | None] = [None] * producers
    ready = threading.Barrier(producers)

    def start(i: int) -> None:
        store = CountingStore(url, tally, "producer", model, seed=i)
        ready.wait()
        if staggered:
            time.sleep(start_delay_s(i))
        with store.paused() if not counted else contextlib.nullcontext():
            pool[i] = Producer(store, f"p{i:04d}", dp=2, commit_policy=policy, pack_steps=1, **options)

    _run_all([lambda i=i: start(i) for i in range(producers)])
    if any(p is None for p in pool):
        raise RuntimeError("a producer failed to start (see the thread's traceback above)")
    return [p for p in pool if p is not None]


def _run_all(tasks: list[Callable[[], None]]) -> None:
    """Each task in its own thread, all at once; returns when all are done."""
    threads = [threading.Thread(target=task) for task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _close_all(pool: list[Producer]) -> None:
    """At once, dropping what is not committed: closed one by one, 1,000 would take minutes."""
    for producer in pool:
        producer._store.active = False  # type: ignore[attr-defined]  # closing is past the counted part
    _run_all([lambda p=p: p.close(flush=False) for p in pool])


def _slices() -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(64, d, dtype=np.uint8)} for d in range(2)]


# -- 1. claims at start --------------------------------------------------------------------


def claims(producers: int, model: LatencyModel = INSTANT, *, staggered: bool = False) -> dict[str, Any]:
    """``producers`` producers starting together on an empty namespace: the requests of
    their epoch claims (the create-only PUTs of log versions grew as P**2 without backoff,
    P log P with it; with tickets the first claims for all: a few). ``staggered``: as a
    producer pool starts them, ``pooljob.START_RATE_PER_S`` a second, so no key sees
    more than the budget."""
    url = f"memory://scale-claims-{uuid.uuid4().hex}"
    tally = Tally()
    started = time.monotonic()
    pool = _start_pool(url, tally, model, producers, "dac", staggered=staggered)
    seconds = time.monotonic() - started
    requests = tally.between(started, time.monotonic())
    versions = inspect_namespace(url).latest_version  # before any commit: the claims' versions
    _close_all(pool)
    rates = _rates(requests, LOG, seconds, producers)
    return {
        "state": "claiming at start" + (", as a pool starts them" if staggered else ""),
        "policy": "dac",
        "producers": producers,
        "how": "measured",
        "seconds_to_claim_all": seconds,
        "claim_versions": versions,
        "log_puts_per_producer": rates["log_puts"] / producers,
        "ticket_requests": sum(1 for r in requests if r.key.startswith(CLAIM_PREFIX)),
        **rates,
    }


# -- 2. following the log ------------------------------------------------------------------


def following(producers: int, policy: str, config: PoolConfig) -> dict[str, Any]:
    """``producers`` producers appending one small TGB each ``producers / pool_tgb_per_s``
    seconds (their starts spread over that period), counted for ``window_s`` after
    ``warmup_s``; visibility is append to commit, as the producer sees it."""
    url = f"memory://scale-follow-{uuid.uuid4().hex}"
    tally = Tally()
    pool = _start_pool(url, tally, config.model, producers, policy, counted=False)
    every_s = producers / config.pool_tgb_per_s
    # Long enough for every producer to have followed the log once after the claims: a
    # producer far from its turn looks about every producers / 70 s.
    warmup_s = max(config.warmup_s, 2 * producers / HEAD_BUDGET_PER_S)
    stop = threading.Event()
    errors: list[BaseException] = []
    visibility = _Visibility()
    started = time.monotonic()
    appenders = [
        threading.Thread(
            target=_append_paced, args=(p, started + i * every_s / producers, every_s, stop, errors, visibility)
        )
        for i, p in enumerate(pool)
    ]
    for thread in appenders:
        thread.start()
    count_from = started + warmup_s
    time.sleep(max(0.0, count_from - time.monotonic()))
    wall_from = time.time()
    time.sleep(config.window_s)
    count_to, wall_to = time.monotonic(), time.time()
    stop.set()
    for thread in appenders:
        thread.join()
    seen = visibility.measure(url, wall_from, wall_to)
    _close_all(pool)
    if errors:
        raise RuntimeError(f"{len(errors)} producers failed: {errors[0]!r}") from errors[0]
    seconds = count_to - count_from
    requests = tally.between(count_from, count_to)
    return {
        "state": f"following the log, {'group' if policy == 'group' else 'direct (DAC)'}",
        "policy": policy,
        "producers": producers,
        "how": "measured",
        "tgb_every_s": every_s,
        **seen,
        "tgbs_committed_per_s": seen["tgbs_committed"] / seconds,
        **_rates(requests, LOG, seconds, producers),
    }


class _Visibility:
    """Seconds from each append to the ``committed_at`` of the version that holds it, read
    from the log afterwards: what a consumer sees, whichever producer committed the TGB
    and however late its own producer noticed (one far from its turn reads the log
    seldom). A TGB appended in the window and not committed by its end counts as
    visible at the end (a lower bound)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.handed: list[tuple[str, int, float]] = []  # (producer, offset, appended at: wall clock)

    def appended(self, producer: Producer, offset: int, at_s: float) -> None:
        with self._lock:
            self.handed.append((producer.producer_id, offset, at_s))

    def measure(self, url: str, start_s: float, end_s: float) -> dict[str, float]:
        """Over appends in ``[start_s, end_s)`` (wall clock): TGBs committed in the window,
        and the visibility percentiles."""
        committed_at = {}
        for delta in Journal(open_store(url), read_only=True).versions_after(0):
            for tgb in delta.tgbs:
                committed_at[(tgb.producer, tgb.source_offset)] = delta.committed_at
        committed = sum(1 for at in committed_at.values() if start_s <= at < end_s)
        with self._lock:
            chosen = [
                min(committed_at.get((p, o), end_s), end_s) - at for p, o, at in self.handed if start_s <= at < end_s
            ]
        if not chosen:
            return {"tgbs_committed": committed, "visibility_p50_s": float("nan"), "visibility_p95_s": float("nan")}
        p50, p95 = np.percentile(chosen, [50, 95])
        return {"tgbs_committed": committed, "visibility_p50_s": float(p50), "visibility_p95_s": float(p95)}


def _append_paced(
    producer: Producer,
    first_s: float,
    every_s: float,
    stop: threading.Event,
    errors: list[BaseException],
    visibility: _Visibility | None = None,
) -> None:
    due = first_s
    try:
        while not stop.wait(max(0.0, due - time.monotonic())):
            at_s = time.time()  # wall clock: compared with the versions' committed_at
            offset = producer.append(_slices())
            if visibility is not None:
                visibility.appended(producer, offset, at_s)
            due += every_s
    except BatchWeaveError as exc:
        errors.append(exc)


# -- 3. held by max_lag ----------------------------------------------------------------------


def held(producers: int, config: PoolConfig, *, collected: bool = False) -> dict[str, Any]:
    """``producers`` producers with ``max_lag=1`` on a log one step past a complete
    checkpoint (``marks`` watermarks): every first ``append`` is held at once, and looks
    again with backoff (50 ms doubling to 2 s, or the pool's budget) until closed. Before
    any collection a look lists ``_checkpoints/`` and each producer's first look reads
    every mark once (counted apart); once ``collected``, it probes the log's head for the
    reclaim point. Counted for ``window_s`` after ``warmup_s``."""
    url = f"memory://scale-held-{uuid.uuid4().hex}"
    _write_checkpoint(url, config.marks, collected)
    tally = Tally()
    started = time.monotonic()
    pool = _start_pool(url, tally, config.model, producers, "dac", counted=False, max_lag=1)
    stop = threading.Event()
    errors: list[BaseException] = []
    appenders = [threading.Thread(target=_append_paced, args=(p, 0.0, 0.0, stop, errors)) for p in pool]
    for thread in appenders:
        thread.start()
    marks_read = 0 if collected else producers * config.marks
    # Past each producer's first looks (spread over the pool's budget; the first loads
    # the log's state), as for following: the steady looks are counted.
    warmup_s = max(config.warmup_s, 2 * producers / HEAD_BUDGET_PER_S)
    count_from = _when_all_read_marks(tally, marks_read, started + warmup_s)
    time.sleep(config.window_s)
    count_to = time.monotonic()
    _close_all(pool)  # (each held append then raises: closed)
    for thread in appenders:
        thread.join()
    if any(not isinstance(e, BatchWeaveError) for e in errors):
        raise RuntimeError(f"held producers failed: {errors[0]!r}")
    seconds = count_to - count_from
    requests = tally.between(count_from, count_to)
    first_gets = sum(1 for r in tally.between(started, count_from) if _is_mark_get(r))
    rates = _rates(requests, CHECKPOINT_PREFIX, seconds, producers)
    lists = rates.get("checkpoints_lists", 0)
    return {
        "state": f"held by max_lag, {config.marks:,} marks, " + ("collected" if collected else "never collected"),
        "policy": "dac",
        "producers": producers,
        "how": "measured",
        "marks": config.marks,
        "first_poll_gets_per_producer": first_gets / producers,
        "s3_list_pages_per_s": lists * -(-config.marks // S3_LIST_PAGE) / seconds,
        "log_per_s": sum(1 for r in requests if r.key.startswith(LOG)) / seconds,
        **rates,
    }


def _write_checkpoint(url: str, marks: int, collected: bool) -> None:
    """A checkpoint complete one step below the head: W_global = 0 with one TGB committed;
    or, ``collected``, 1 with two, and step 0 reclaimed."""
    with Producer(open_store(url), "setup", dp=2, commit_policy=Manual(), pack_steps=1) as producer:
        for _ in range(1 + collected):
            producer.append(_slices())
        producer.flush()
    store = open_store(url)
    for d in range(marks):
        mark = Watermark("ck", dp=marks, cp=1, d=d, c=0, position=Fraction(int(collected)), version=1 + collected)
        write_watermark(store, mark)
    if collected:
        collect_garbage(url, grace_s=0)


def _is_mark_get(request: Request) -> bool:
    return request.request == "get" and request.key.startswith(CHECKPOINT_PREFIX)


def _when_all_read_marks(tally: Tally, gets: int, not_before_s: float, timeout_s: float = 300.0) -> float:
    """When every held producer has read every mark (its first poll), and not before
    ``not_before_s``: the polls counted after are the steady ones."""
    deadline = time.monotonic() + timeout_s
    seen, read = 0, 0
    while read < gets:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the held producers read {read:,} of {gets:,} marks")
        time.sleep(0.2)
        new = tally.requests[seen:]  # (appended to only: the slice is a consistent prefix)
        seen += len(new)
        read += sum(1 for r in new if _is_mark_get(r))
    time.sleep(max(0.0, not_before_s - time.monotonic()))
    return time.monotonic()


# -- 4. garbage collection ----------------------------------------------------------------


def gc_rows(config: PoolConfig) -> list[dict[str, Any]]:
    """``bench gc-history``'s collections at each history length of ``gc_versions``."""
    return [row for versions in config.gc_versions for row in collections_at(versions)]
