"""Runs (``reading.runs``): a rank's back-to-back ranges of consecutive steps in one object
are read with one request, each step taking its own bytes of it, its own failure, and
nothing left behind; end to end, a consumer reading packs of k steps per object makes
about one GET per k steps on a real S3 server."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable

import pytest

import batchweave as bw
from batchweave import keys, layout
from batchweave.commit.policies import Manual
from batchweave.errors import CorruptDataError, TransientStoreError
from batchweave.journal import Journal
from batchweave.latency import LatencyModel, LatencyStore
from batchweave.log import TGBDescriptor
from batchweave.metrics import FetchRecorder
from batchweave.reading import node
from batchweave.reading.fetch import SliceFetcher
from batchweave.reading.reshard import SliceRead
from batchweave.reading.runs import MAX_RUN_BYTES, RangeRuns
from batchweave.store import Store, open_store
from batchweave.testing.interleave import Background

BLOB = bytes(range(256)) * 64  # 16 KiB of distinguishable bytes
FAST = LatencyModel(put_s=0.001, first_byte_s=0.001, head_s=0.001, list_s=0.001, delete_s=0.001, jitter_sigma=0)


class CountingGet:
    """A fake ``get`` over in-memory objects that records each read."""

    def __init__(self, objects: dict[str, bytes], release: threading.Event | None = None) -> None:
        self.objects = objects
        self.calls: list[tuple[str, int, int]] = []
        self._release = release
        self._lock = threading.Lock()

    def __call__(self, key: str, start: int, length: int) -> memoryview:
        with self._lock:
            self.calls.append((key, start, length))
        if self._release is not None:
            assert self._release.wait(30), "the test never let the read go"
        return memoryview(self.objects[key][start : start + length])


def expect_all(runs: RangeRuns, ranges: list[tuple[str, int, int]]) -> None:
    for key, offset, length in ranges:
        runs.expect(key, offset, length)


def read_all(runs: RangeRuns, ranges: list[tuple[str, int, int]], get: CountingGet) -> list[bytes]:
    return [bytes(runs.read(key, offset, length, get)) for key, offset, length in ranges]


def exact(ranges: list[tuple[str, int, int]], objects: dict[str, bytes]) -> list[bytes]:
    return [objects[key][offset : offset + length] for key, offset, length in ranges]


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for ``condition`` (re-checked every few ms), failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        threading.Event().wait(0.005)


# -- the run logic, with a counting fake get ----------------------------------------------


def test_k_adjacent_ranges_are_one_read_and_each_member_gets_exactly_its_bytes():
    objects = {"data/pack": BLOB}
    ranges = [("data/pack", 100 * i, 100) for i in range(16)]
    runs, get = RangeRuns(), CountingGet(objects)
    expect_all(runs, ranges)
    assert read_all(runs, ranges, get) == exact(ranges, objects)
    assert get.calls == [("data/pack", 0, 1600)]
    assert runs.pending == 0 and runs.open_runs == 0


def test_a_gap_or_another_object_starts_a_new_run():
    objects = {"data/a": BLOB, "data/b": BLOB}
    ranges = [("data/a", 0, 100), ("data/a", 100, 50), ("data/a", 151, 49), ("data/b", 200, 10), ("data/a", 200, 5)]
    runs, get = RangeRuns(), CountingGet(objects)
    expect_all(runs, ranges)
    assert read_all(runs, ranges, get) == exact(ranges, objects)
    # a:0-150 together; a:151 after a one-byte gap; b alone; a:200 continues a:151-200.
    assert get.calls == [("data/a", 0, 150), ("data/a", 151, 54), ("data/b", 200, 10)]


def test_a_run_never_reads_more_than_its_cap_and_a_longer_range_is_read_alone():
    objects = {"data/pack": BLOB}
    ranges = [("data/pack", 100 * i, 100) for i in range(5)] + [("data/pack", 500, 400), ("data/pack", 900, 100)]
    runs, get = RangeRuns(max_run_bytes=250), CountingGet(objects)
    expect_all(runs, ranges)
    assert read_all(runs, ranges, get) == exact(ranges, objects)
    assert get.calls == [
        ("data/pack", 0, 200),
        ("data/pack", 200, 200),
        ("data/pack", 400, 100),  # 100 + 400 would pass the cap
        ("data/pack", 500, 400),  # longer than the cap: alone
        ("data/pack", 900, 100),
    ]
    assert MAX_RUN_BYTES == 4 << 20


def test_a_range_never_expected_is_read_on_its_own_and_a_run_being_read_takes_no_new_member():
    objects = {"data/pack": BLOB}
    runs, get = RangeRuns(), CountingGet(objects)
    runs.expect("data/pack", 0, 100)
    assert bytes(runs.read("data/pack", 0, 100, get)) == BLOB[:100]
    runs.expect("data/pack", 100, 100)  # after the run was read: a run of its own
    assert bytes(runs.read("data/pack", 100, 100, get)) == BLOB[100:200]
    assert bytes(runs.read("data/pack", 300, 7, get)) == BLOB[300:307]  # never expected
    assert get.calls == [("data/pack", 0, 100), ("data/pack", 100, 100), ("data/pack", 300, 7)]


def test_members_reading_at_once_from_threads_share_one_read_and_each_gets_its_bytes():
    objects = {"data/pack": BLOB}
    ranges = [("data/pack", 1000 * i, 1000) for i in range(8)]
    release = threading.Event()
    runs, get = RangeRuns(), CountingGet(objects, release)
    expect_all(runs, ranges)
    start = threading.Barrier(len(ranges))

    def member(key: str, offset: int, length: int) -> bytes:
        start.wait(30)
        return bytes(runs.read(key, offset, length, get))

    readers = [Background(member, *rng) for rng in reversed(ranges)]  # the last step may come first
    wait_until(lambda: runs.pending == 0)  # every member took its place: one reads, the rest wait
    release.set()
    assert [reader.result(30) for reader in reversed(readers)] == exact(ranges, objects)
    assert get.calls == [("data/pack", 0, 8000)]


def test_a_failing_read_raises_in_every_member_and_leaves_nothing_behind():
    ranges = [("data/pack", 10 * i, 10) for i in range(4)]
    runs = RangeRuns()
    expect_all(runs, ranges)
    calls = []

    def failing(key: str, start: int, length: int) -> memoryview:
        calls.append((key, start, length))
        raise TransientStoreError(key, "the store did not answer")

    for key, offset, length in ranges:
        with pytest.raises(TransientStoreError, match="did not answer"):
            runs.read(key, offset, length, failing)
    assert calls == [("data/pack", 0, 40)]
    assert runs.pending == 0 and runs.open_runs == 0


def test_close_forgets_every_expected_range_and_a_member_read_later_reads_alone():
    objects = {"data/pack": BLOB}
    runs, get = RangeRuns(), CountingGet(objects)
    expect_all(runs, [("data/pack", 0, 10), ("data/pack", 10, 10), ("data/other", 0, 5)])
    assert runs.pending == 3 and runs.open_runs == 2
    runs.close()
    assert runs.pending == 0 and runs.open_runs == 0
    assert bytes(runs.read("data/pack", 10, 10, get)) == BLOB[10:20]
    assert get.calls == [("data/pack", 10, 10)]


# -- through the fetcher: each step keeps its own checks ----------------------------------


class ShortNode:
    """A node hub that answers every read with its bytes cut short (a truncated object)."""

    def __init__(self, data: bytes, cut: int) -> None:
        self.data = data
        self.cut = cut
        self.calls: list[tuple[str, int, int]] = []

    def read(self, key: str, start: int, length: int) -> memoryview:
        self.calls.append((key, start, length))
        return memoryview(self.data[start : min(start + length, self.cut)])


def packed(steps: list[list[bytes]], key: str) -> tuple[bytes, list[TGBDescriptor]]:
    """The steps' slices (dp=1, cp=len(slices)) as one pack under ``key``
    (``layout.encode_pack``, as a producer writes it), and the steps' descriptors."""
    cp = len(steps[0])
    pack = layout.encode_pack([layout.frame_tgb(slices, 1, cp) for slices in steps])
    body = b"".join(bytes(piece) for piece in pack.parts[0])
    tgbs = [
        TGBDescriptor(
            producer="p",
            epoch=1,
            source_offset=t,
            dp=1,
            cp=cp,
            kind="bytes",
            objects=[key],
            slices=[(r.object_index, r.offset, r.length, r.crc32c) for r in refs],
            nbytes=nbytes,
        )
        for t, (refs, nbytes) in enumerate(zip(pack.slices, pack.tgb_nbytes(), strict=True))
    ]
    return body, tgbs


def _end(tgb: TGBDescriptor, index: int) -> int:
    """Where slice ``index`` of ``tgb`` ends in its object."""
    return tgb.slices[index][1] + tgb.slices[index][2]


def fetcher_on(node: ShortNode, runs: RangeRuns) -> SliceFetcher:
    store = open_store(f"memory:///runs-{uuid.uuid4().hex}")
    return SliceFetcher(
        store,
        Journal(store, read_only=True),
        slice_index=0,
        sequence_axis=0,
        fetches=FetchRecorder(),
        start=0,
        node=node,
        runs=runs,
    )


def test_a_run_read_short_fails_each_step_past_the_cut_with_corrupt_data_and_serves_the_rest():
    key = keys.data_key("p", 1, 0, "ab", 0)
    payloads = [bytes([i]) * 200 for i in range(4)]
    body, tgbs = packed([[payload] for payload in payloads], key)
    cut = tgbs[2].slices[0][1] + 5  # the object ends 5 bytes into step 2's slice
    node, runs = ShortNode(body, cut), RangeRuns()
    fetcher = fetcher_on(node, runs)
    for step, tgb in enumerate(tgbs):
        fetcher.expect(tgb, SliceRead(step, 0, 1))
    assert [fetcher.fetch_as_written(tgbs[i], i, 1)[0].data for i in range(2)] == payloads[:2]
    for step in (2, 3):
        with pytest.raises(CorruptDataError, match="truncated"):
            fetcher.fetch_as_written(tgbs[step], step, 1)
    assert node.calls == [(key, 0, _end(tgbs[3], 0))]  # one read through the hub for the four steps
    assert runs.pending == 0 and runs.open_runs == 0


def test_a_reshard_read_of_slices_apart_in_a_pack_reads_each_back_to_back_group_not_the_gap():
    """CP shrank 2-fold: a step reads slices 0 and 1 of its TGB, which a pack of two TGBs
    keeps apart (slice 0 of both steps, then slice 1 of both): the step's two ranges each
    join the same slice of the next step, and nothing between them is read twice."""
    key = keys.data_key("p", 1, 0, "ab", 0)
    payloads = [[bytes([10 * t + i]) * 64 for i in range(2)] for t in range(2)]
    body, tgbs = packed(payloads, key)  # slice 0 of both steps, then slice 1 of both
    node, runs = ShortNode(body, len(body)), RangeRuns()
    fetcher = fetcher_on(node, runs)
    reads = [SliceRead(t, 0, 2) for t in range(2)]
    for tgb, read in zip(tgbs, reads, strict=True):
        fetcher.expect(tgb, read)
    got = [fetcher.fetch(tgb, read, t, 1, t + 1)[0].data for t, (tgb, read) in enumerate(zip(tgbs, reads, strict=True))]
    assert got == [b"".join(step) for step in payloads]
    half = _end(tgbs[1], 0)
    assert node.calls == [(key, 0, half), (key, half, _end(tgbs[1], 1) - half)]


# -- end to end on SeaweedFS ------------------------------------------------------------


@pytest.fixture
def counted_seaweedfs(seaweedfs_server, monkeypatch):
    """A namespace URL on SeaweedFS, reached through a proxy that counts the requests."""
    from batchweave.testing import servers
    from batchweave.testing.proxy import LatencyProxy

    with LatencyProxy(seaweedfs_server) as proxy:
        for var in servers.S3_ENV_UNSET:
            monkeypatch.delenv(var, raising=False)
        for var, value in servers.s3_env(proxy.endpoint).items():
            monkeypatch.setenv(var, value)
        yield f"s3://batchweave-test/runs-{uuid.uuid4().hex[:12]}", proxy


def commit_packs(url: str | Store, steps: int, k: int, dp: int, repeat: int = 50) -> list[list[bytes]]:
    """Steps 0..steps-1 of ``dp`` bytes slices (about ``repeat`` * 17 bytes each), written k
    steps per object by the producer's packs (``Producer(pack_steps=k)``) and committed one
    pack per log version; each step's payloads."""
    payloads = [[f"step {t} rank {r} ".encode() * (repeat + t % 7) for r in range(dp)] for t in range(steps)]
    with bw.Producer(url, "p", dp=dp, commit_policy=Manual(), pack_steps=k, pack_delay_s=3600) as producer:
        for t in range(steps):
            producer.append(payloads[t], source_offset=t)
            if (t + 1) % k == 0:
                producer.flush()
    bw.end_stream(url)
    return payloads


@pytest.mark.seaweedfs
def test_a_consumer_reads_packs_of_k_steps_with_one_get_per_pack_on_seaweedfs(counted_seaweedfs):
    url, proxy = counted_seaweedfs
    steps, k, dp = 64, 8, 2
    payloads = commit_packs(url, steps, k, dp)
    for rank in range(dp):
        proxy.reset()
        with bw.Consumer(url, dp=dp, rank=rank, prefetch=16, node_sharing=False) as consumer:
            got = [batch.data for batch in consumer]
        assert got == [payloads[t][rank] for t in range(steps)]
        # One ranged GET per pack (log reads are whole objects), a few more if a pack's
        # steps reached the reader in two log reads.
        assert steps // k <= proxy.counters().range_gets <= steps // k + 2


class RangeCountingStore(LatencyStore):
    """Memory read as an object store is (threads, a fetch pool, node sharing), counting
    the range reads by (key, start, length)."""

    def __init__(self, url: str) -> None:
        super().__init__(url, model=FAST)
        self.ranges: collections.Counter[tuple[str, int, int]] = collections.Counter()
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        with self._lock:
            self.ranges[(key, start, length)] += 1
        return super().get_range(key, start, length)


@pytest.mark.skipif(not node.sharing_supported(), reason="node sharing needs Linux")
def test_tp_ranks_sharing_a_node_hub_read_each_pack_run_once_for_the_node():
    steps, k, dp, tp = 48, 8, 2, 2
    store = RangeCountingStore(f"memory://runs/{uuid.uuid4().hex}")
    payloads = commit_packs(store, steps, k, dp)
    store.ranges.clear()
    mesh, seen, failures = bw.Mesh(dp=dp, tp=tp), {}, []
    finished = threading.Barrier(dp * tp)  # the ranks stop together: the hub's rank does not leave early

    def rank_reads(rank: int) -> None:
        try:
            with bw.Consumer(
                store,
                dp=dp,
                tp=tp,
                rank=rank,
                local_rank=rank,
                local_world_size=dp * tp,
                node_sharing=True,
                prefetch=16,
                timeout_s=30,
            ) as consumer:
                seen[rank] = [batch.data for batch in consumer]
                finished.wait(30)
        except BaseException as exc:
            failures.append(exc)

    ranks = [Background(rank_reads, rank) for rank in range(dp * tp)]
    for rank in ranks:
        rank.result(60)
    assert not failures, failures
    for rank in range(dp * tp):
        assert seen[rank] == [payloads[t][mesh.coords(rank).dp] for t in range(steps)], rank
    # One read per pack and data-parallel slice for the whole node: the TP ranks of a
    # slice made the same run and the hub read it once for both.
    assert len(store.ranges) == steps // k * dp and set(store.ranges.values()) == {1}


def test_a_consumer_closed_in_the_middle_of_a_pack_leaves_no_expected_range_behind():
    store = RangeCountingStore(f"memory://runs/{uuid.uuid4().hex}")
    payloads = commit_packs(store, 32, 8, 1)
    consumer = bw.Consumer(store, dp=1, rank=0, prefetch=4, timeout_s=30)
    assert [next(consumer).data for _ in range(3)] == [payloads[t][0] for t in range(3)]
    pipeline = consumer._pipeline
    assert pipeline is not None
    runs = pipeline._fetcher._runs
    assert runs is not None
    wait_until(lambda: runs.pending >= 32 - 8)  # the packs after the first are expected, not read
    consumer.close()
    assert runs.pending == 0 and runs.open_runs == 0


class HeldRangeStore(LatencyStore):
    """Memory read as an object store, whose data range reads wait until ``release``;
    ``in_flight`` counts those waiting."""

    def __init__(self, url: str) -> None:
        super().__init__(url, model=FAST)
        self.in_flight = 0
        self.released = threading.Event()
        self._changed = threading.Condition()

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        if key.startswith("data/"):
            with self._changed:
                self.in_flight += 1
                self._changed.notify_all()
            self.released.wait(30)
        return super().get_range(key, start, length)

    def wait_in_flight(self, count: int) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.in_flight >= count, timeout=10)


def test_the_window_counts_reads_so_the_later_steps_of_a_pack_take_no_slot():
    """prefetch=2 is two reads in flight: two packs at once, not the first two steps of
    one pack (the second of which only waits for the first's read)."""
    store = HeldRangeStore(f"memory://runs/{uuid.uuid4().hex}")
    payloads = commit_packs(store, steps=32, k=8, dp=1)
    with bw.Consumer(store, dp=1, rank=0, prefetch=2, node_sharing=False, timeout_s=30) as consumer:
        first = Background(lambda: next(consumer))
        try:
            assert store.wait_in_flight(2), f"{store.in_flight} read(s) in flight, not 2"
        finally:
            store.released.set()
        assert first.result().data == payloads[0][0]
        assert [batch.data for batch in consumer] == [payloads[t][0] for t in range(1, 32)]


def test_fetch_latencies_are_the_reads_not_the_steps_that_took_their_bytes_from_one():
    """A pack's later steps take their bytes in microseconds from the run's read: recorded
    as fetches, they made P50 microseconds and P95 the read (P95/P50 of 20,000x in
    ``bench consumers``). Only reads are recorded."""
    store = LatencyStore(f"memory://runs/{uuid.uuid4().hex}", model=FAST)
    payloads = commit_packs(store, steps=32, k=8, dp=1)
    with bw.Consumer(store, dp=1, rank=0, prefetch=4, node_sharing=False, timeout_s=30) as consumer:
        assert [batch.data for batch in consumer] == [payloads[t][0] for t in range(32)]
        metrics = consumer.metrics()
    assert metrics.fetches == 32 // 8  # one read per pack, each timed from issue to decode
