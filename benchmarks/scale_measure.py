"""Measured request rates of real consumers, producers, the collector and ``watch``, each
run for a short time on the counting latency model (threads of one process).

Every scenario returns a flat record: the requests of one role in one state, per rank
and step, per rank and second, per TGB or per commit, split by key class (``c:<class>``)
and operation (``op:<request>``). ``measure_all`` runs them all; the projection takes its
per-follower and per-producer rates from these records.
"""

from __future__ import annotations

import inspect
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchweave.commit.policies import Manual
from batchweave.consumer import Consumer
from batchweave.errors import StepTimeoutError
from batchweave.latency import LatencyModel
from batchweave.lifecycle.gc import collect_garbage
from batchweave.producer import Producer
from batchweave.segment import SEGMENT_VERSIONS
from batchweave.store import open_store
from batchweave.watch import SnapshotReader
from benchmarks.scale_count import (
    DATA,
    HINT,
    LOG_CLASSES,
    LOG_LIST,
    LOG_NEXT,
    LOG_VERSION,
    SEGMENT,
    SNAPSHOT,
    CountingStore,
    Request,
    Tally,
    by_class,
    by_op,
    hottest_key_windows,
)

__all__ = [
    "OWN",
    "SHARED",
    "MeasureConfig",
    "Ranks",
    "measure_all",
    "node_sharing_available",
]

# The collector and watch run alone, one request at a time: what they ask does not depend
# on how long the store takes, so they are counted without the modelled latency.
INSTANT = LatencyModel(put_s=0.0, first_byte_s=0.0, head_s=0.0, list_s=0.0, delete_s=0.0, jitter_sigma=0.0)


@dataclass(frozen=True, slots=True)
class MeasureConfig:
    dp: int = 2
    tp: int = 4
    steps_per_s: float = 3.0  # the committer's cadence: one TGB per version
    behind_steps: int = 300  # steps each rank reads behind the head
    flowing_s: float = 12.0  # counted at the head while commits flow
    idle_s: float = 21.0  # counted at the head with no commits (two idle proofs a rank)
    producers: int = 4
    producer_s: float = 6.0
    producer_tgb_every_s: float = 0.1  # each producer appends a TGB this often
    watch_refreshes: int = 5
    watch_interval_s: float = 2.0  # `batchweave watch`'s default
    slice_bytes: int = 1024
    seed: int = 0

    settle_s: float = 1.0  # before counting at the head: into the cadence, then into idle backoff
    gc_versions: int = 300

    @classmethod
    def quick(cls) -> MeasureConfig:
        return cls(
            behind_steps=60,
            flowing_s=0.8,
            idle_s=0.8,
            producers=2,
            producer_s=0.6,
            watch_refreshes=2,
            settle_s=0.3,
            gc_versions=40,
        )

    @property
    def ranks(self) -> int:
        return self.dp * self.tp


def node_sharing_available() -> bool:
    """Whether this checkout's Consumer shares one follower among the ranks of a node."""
    return "node_sharing" in inspect.signature(Consumer).parameters


def measure_all(config: MeasureConfig, progress: Any = None, task: Any = None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    sharing = (False, True) if node_sharing_available() else (False,)
    steps = [
        lambda: records.extend(_side_by_side(lambda s: [consumer_behind(config, s)], sharing)),
        lambda: records.extend(_side_by_side(lambda s: consumer_at_head(config, s), sharing)),
        lambda: records.extend(_side_by_side(lambda policy: [producers(config, policy)], ("dac", "group"))),
        lambda: records.extend(gc_runs(config)),
        lambda: records.append(watch(config)),
    ]
    for step in steps:
        step()
        if progress is not None:
            progress.advance(task)
    return records


def _side_by_side(measure: Any, variants: tuple[Any, ...]) -> list[dict[str, Any]]:
    """``measure(variant)`` for each variant at once, in threads (they mostly wait on
    the latency model), the records in the variants' order."""
    out: dict[Any, list[dict[str, Any]]] = {}
    threads = [threading.Thread(target=lambda v=v: out.__setitem__(v, measure(v))) for v in variants]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    missing = [v for v in variants if v not in out]
    if missing:
        raise RuntimeError(f"measuring {missing} failed (see the thread's traceback above)")
    return [record for v in variants for record in out[v]]


# -- records -----------------------------------------------------------------------------


def _record(state: str, role: str, requests: list[Request], per: dict[str, float], **extra: Any) -> dict[str, Any]:
    """``requests`` divided by each divisor in ``per`` (name -> count), split by class and op."""
    record: dict[str, Any] = {"state": state, "role": role, "requests": len(requests), **extra}
    for name, divisor in per.items():
        record[f"per_{name}"] = len(requests) / divisor if divisor else float("nan")
    main = next(iter(per))
    divisor = per[main] or float("nan")
    for name, count in sorted(by_class(requests).items()):
        record[f"c:{name}"] = count / divisor
    for name, count in sorted(by_op(requests).items()):
        record[f"op:{name}"] = count / divisor
    for (cls, op), count in sorted(Counter((r.key_class, r.request) for r in requests).items()):
        record[f"j:{cls}|{op}"] = count / divisor
    record["per"] = main
    return record


def _slices(config: MeasureConfig) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(config.slice_bytes, d, dtype=np.uint8)} for d in range(config.dp)]


def _commit(producer: Producer, config: MeasureConfig, offset: int) -> None:
    producer.append(_slices(config), source_offset=offset)
    producer.flush()


# -- consumers ---------------------------------------------------------------------------


class Ranks:
    """The ranks of a dp x tp mesh as Consumers in threads, each on its own counting store."""

    def __init__(
        self,
        url: str,
        tally: Tally,
        config: MeasureConfig,
        *,
        sharing: bool,
        limit: int | None = None,
        started: int | None = None,
    ) -> None:
        """``started``: only the first this many ranks of the mesh run (one node of a larger
        job); all of them by default."""
        count = config.ranks if started is None else started
        self.stores = [CountingStore(url, tally, "consumer", seed=config.seed + r) for r in range(count)]
        # Node sharing: the ranks are one node's (local ranks 0..7), the hub in this process.
        node: dict[str, Any] = {"node_sharing": sharing} if node_sharing_available() else {}
        if sharing:
            node.update(local_world_size=count)
        self.consumers = [
            Consumer(
                store,
                dp=config.dp,
                tp=config.tp,
                rank=rank,
                timeout_s=0.2,
                **node,
                **({"local_rank": rank} if sharing else {}),
            )
            for rank, store in enumerate(self.stores)
        ]
        self.steps = [0] * count
        self.delivered: dict[int, float] = {}  # step -> when rank 0 had it (wall clock)
        self.limit = limit
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._iterate, args=(r,), daemon=True) for r in range(count)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _iterate(self, rank: int) -> None:
        consumer = self.consumers[rank]
        while not self.stop.is_set():
            if self.limit is not None and self.steps[rank] >= self.limit:
                return  # (a rank done early waits for the others: a node's hub serves them)
            try:
                next(consumer)
            except StepTimeoutError:
                continue
            except StopIteration:
                return
            if rank == 0:
                self.delivered[self.steps[0]] = time.time()
            self.steps[rank] += 1

    def wait_for(self, steps: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while min(self.steps) < steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks reached only {self.steps} of {steps} steps")
            time.sleep(0.01)

    def close(self) -> None:
        for store in self.stores:
            store.active = False  # what follows is past the measured stretch
        self.stop.set()
        for thread in self.threads:
            thread.join()
        # At once: closed one by one, each rank left would take over the node's hub in turn.
        closing = [threading.Thread(target=c.close) for c in self.consumers]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()


OWN = "each rank its own follower"
SHARED = "node sharing (one node of 8 ranks)"


def _setup(sharing: bool) -> str:
    return SHARED if sharing else OWN


def consumer_behind(config: MeasureConfig, sharing: bool = False) -> dict[str, Any]:
    """Every rank reads ``behind_steps`` steps of a log committed long before, one TGB per
    version, and far more versions than it reads (no head in sight). Counted until the
    last rank has them all (so with sharing, the hub's reads for every rank)."""
    url = f"memory://scale-behind-{uuid.uuid4().hex}"
    with Producer(open_store(url), "p0", dp=config.dp, commit_policy=Manual(), pack_steps=1) as producer:
        for offset in range(config.behind_steps + 64):
            _commit(producer, config, offset)
    tally = Tally()
    ranks = Ranks(url, tally, config, sharing=sharing, limit=config.behind_steps)
    started = time.monotonic()
    ranks.start()
    ranks.wait_for(config.behind_steps)
    elapsed = time.monotonic() - started
    ranks.close()
    requests = [r for r in tally.between(0, float("inf")) if _needed(r, config.behind_steps)]
    step_ranks = config.ranks * config.behind_steps
    data = [r for r in requests if r.key_class == DATA]
    # Reading on, each rank reads each segment (or version) once; the start's reads (hint,
    # snapshot, listing) are once per rank and reported apart.
    per_key = Counter(r.key for r in requests if r.key_class in (SEGMENT, LOG_VERSION))
    start = sum(1 for r in requests if r.key_class in (HINT, SNAPSHOT, LOG_LIST))
    return _record(
        "behind the head",
        "consumer",
        requests,
        {"rank_step": step_ranks, "node_step": config.behind_steps},
        setup=_setup(sharing),
        ranks=config.ranks,
        seconds=elapsed,
        log_per_rank_step=sum(1 for r in requests if r.key_class in LOG_CLASSES) / step_ranks,
        data_reads_per_rank_step=len(data) / step_ranks,
        data_reads_per_step=len(data) / config.behind_steps,
        distinct_slices_per_step=config.dp,
        followers=1 if sharing else config.ranks,
        max_log_requests_per_key=max(per_key.values()) if per_key else 0,
        start_requests_per_rank=start / config.ranks,
    )


def _needed(request: Request, steps: int) -> bool:
    """Whether ``request`` served the first ``steps`` steps (one TGB per version, one
    producer: step s is offset s in version s + 2, after the claim), not the reading ahead
    a rank does past the end of the measured stretch."""
    name = request.key.rsplit("/", 1)[-1]
    number = name.split(".")[0].split("-")[0]
    if not number.isdigit():
        return True  # the hint, listings: costs of the start
    if request.key_class == DATA:
        return int(number) < steps
    if request.key_class == SEGMENT:
        return int(number) - SEGMENT_VERSIONS < steps + 1
    if request.key_class in (LOG_VERSION, LOG_NEXT):
        return int(number) <= steps + 1
    return True


def consumer_at_head(config: MeasureConfig, sharing: bool = False) -> list[dict[str, Any]]:
    """Ranks at the head while a producer commits one TGB per version at ``steps_per_s``,
    then the same ranks idle at the head once it stops."""
    url = f"memory://scale-head-{uuid.uuid4().hex}"
    tally = Tally()
    producer = Producer(
        CountingStore(url, tally, "committer"), "p0", dp=config.dp, commit_policy=Manual(), pack_steps=1
    )
    for offset in range(3):
        _commit(producer, config, offset)
    ranks = Ranks(url, tally, config, sharing=sharing)
    ranks.start()
    ranks.wait_for(3)
    stop = threading.Event()
    committed = [3]

    def commit_steadily() -> None:
        interval = 1.0 / config.steps_per_s
        due = time.monotonic()
        while not stop.is_set():
            due += interval
            if stop.wait(max(0.0, due - time.monotonic())):
                return
            _commit(producer, config, committed[0])
            committed[0] += 1

    committer = threading.Thread(target=commit_steadily, daemon=True)
    committer.start()
    time.sleep(config.settle_s)  # settle into the cadence
    flowing_start, steps_before = time.monotonic(), min(ranks.steps)
    time.sleep(config.flowing_s)
    flowing_end, steps_after = time.monotonic(), min(ranks.steps)
    stop.set()
    committer.join()
    ranks.wait_for(committed[0])
    time.sleep(2 * config.settle_s)  # every rank's backoff reaches its longest pause (about 2 s)
    idle_start = time.monotonic()
    time.sleep(config.idle_s)
    idle_end = time.monotonic()
    ranks.close()
    producer.close()
    records = []
    for state, start, end, steps in (
        ("at the head, commits flowing", flowing_start, flowing_end, steps_after - steps_before),
        ("idle at the head", idle_start, idle_end, 0),
    ):
        requests = tally.between(start, end, "consumer")
        seconds = end - start
        hot_max, hot_mean, hot_key = hottest_key_windows(requests)
        per = {"rank_s": config.ranks * seconds, "node_s": seconds}
        if steps:
            per["rank_step"] = config.ranks * steps
        records.append(
            _record(
                state,
                "consumer",
                requests,
                per,
                setup=_setup(sharing),
                ranks=config.ranks,
                followers=1 if sharing else config.ranks,
                seconds=seconds,
                steps=steps,
                steps_per_s=steps / seconds,
                log_per_rank_s=sum(1 for r in requests if r.key_class in LOG_CLASSES) / (config.ranks * seconds),
                hot_key_max_per_s=hot_max,
                hot_key_mean_per_s=hot_mean,
                hot_key=hot_key,
            )
        )
    return records


# -- producers, collector, watch -----------------------------------------------------------


def producers(config: MeasureConfig, policy: str) -> dict[str, Any]:
    """``producers`` producers appending a TGB every ``producer_tgb_every_s`` each, committing
    in direct mode (DAC, each its own) or group mode (taking turns)."""
    url = f"memory://scale-producers-{uuid.uuid4().hex}"
    tally = Tally()
    pool = [
        Producer(
            CountingStore(url, tally, "producer", seed=config.seed + i),
            f"p{i}",
            dp=config.dp,
            commit_policy=policy,
            pack_steps=1,
        )
        for i in range(config.producers)
    ]
    started = time.monotonic()

    def append(producer: Producer) -> None:
        offset, due = 0, time.monotonic()
        while time.monotonic() - started < config.producer_s:
            producer.append(_slices(config), source_offset=offset)
            offset += 1
            due += config.producer_tgb_every_s
            time.sleep(max(0.0, due - time.monotonic()))

    threads = [threading.Thread(target=append, args=(p,)) for p in pool]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for producer in pool:
        producer.close()
    elapsed = time.monotonic() - started
    metrics = [p.metrics() for p in pool]
    tgbs = sum(m["tgbs_committed"] for m in metrics)
    commits = sum(m["successes"] for m in metrics)
    requests = [r for r in tally.between(started, float("inf"))]
    mode = "direct (DAC)" if policy == "dac" else "group"
    return _record(
        f"producing, {mode}",
        "producer",
        requests,
        {"tgb": tgbs, "commit": commits, "producer_s": config.producers * elapsed},
        producers=config.producers,
        seconds=elapsed,
        tgbs=tgbs,
        commits=commits,
        tgbs_per_commit=tgbs / commits if commits else float("nan"),
        non_data_per_tgb=sum(1 for r in requests if r.key_class != DATA) / tgbs if tgbs else float("nan"),
    )


def gc_runs(config: MeasureConfig) -> list[dict[str, Any]]:
    """``collect_garbage`` on a namespace with history and one checkpoint: the run that
    reclaims, then a repeat with nothing new to reclaim."""
    url = f"memory://scale-gc-{uuid.uuid4().hex}"
    steps = config.gc_versions
    with Producer(open_store(url), "p0", dp=config.dp, commit_policy=Manual(), pack_steps=1) as producer:
        for offset in range(steps):
            _commit(producer, config, offset)
    for rank in range(config.dp):  # a checkpoint is complete with every d's watermark
        with Consumer(open_store(url), dp=config.dp, rank=rank) as consumer:
            for _ in range(steps // 2):
                next(consumer)
            consumer.mark_checkpoint("ck1")
    tally = Tally()
    records = []
    for run in ("reclaiming", "repeat"):
        start = time.monotonic()
        report = collect_garbage(CountingStore(url, tally, "gc", INSTANT), grace_s=0.0)
        requests = tally.between(start, float("inf"))
        records.append(
            _record(
                f"gc run, {run}",
                "gc",
                requests,
                {"run": 1},
                versions=steps,
                deleted_objects=len(report.deleted_objects),
                deleted_versions=report.deleted_versions,
            )
        )
    return records


def watch(config: MeasureConfig) -> dict[str, Any]:
    """``batchweave watch``'s refreshes, ``watch_interval_s`` apart at ``steps_per_s``
    versions a second (the versions between refreshes are committed without waiting)."""
    url = f"memory://scale-watch-{uuid.uuid4().hex}"
    between = round(config.watch_interval_s * config.steps_per_s)
    with Producer(open_store(url), "p0", dp=config.dp, commit_policy=Manual(), pack_steps=1) as producer:
        for offset in range(20):
            _commit(producer, config, offset)
        tally = Tally()
        reader = SnapshotReader(CountingStore(url, tally, "watch", INSTANT))
        reader()  # the first refresh loads the state; the ones after catch up
        start = time.monotonic()
        offset = 20
        for _ in range(config.watch_refreshes):
            for _ in range(between):
                _commit(producer, config, offset)
                offset += 1
            reader()
        requests = tally.between(start, float("inf"))
    return _record(
        "watch refreshing",
        "watch",
        requests,
        {"s": config.watch_refreshes * config.watch_interval_s, "refresh": config.watch_refreshes},
        interval_s=config.watch_interval_s,
    )
