"""Reading ahead: the log read with several versions in flight, and what the consumer
chooses by default (how deep to prefetch, whether to read in the iterating thread)."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

import batchweave as bw
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.latency import LatencyModel, LatencyStore
from batchweave.reading import driver
from batchweave.reading.readahead import LogReadAhead
from batchweave.segment import segment_key
from batchweave.store import Store

NO_LATENCY = LatencyModel(put_s=0, first_byte_s=0, head_s=0, list_s=0, delete_s=0, jitter_sigma=0)


class CountingStore(Store):
    """Counts version reads. With ``together`` set, each version read holds until that
    many are in flight at once (or 1 s passes), and ``most_in_flight`` records the most
    seen: reads made one after another never get past 1."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.version_reads: list[int] = []
        self.together = 0
        self.most_in_flight = 0
        self._in_flight = 0
        self._cond = threading.Condition()

    def _perform(self, request, nbytes, op):
        return op()

    def get(self, key: str):
        if key.startswith("_log/") and key.endswith(".json") and "snapshot" not in key:
            with self._cond:
                self.version_reads.append(int(key.rsplit("/", 1)[1].split(".")[0]))
                if self.together:
                    self._in_flight += 1
                    self.most_in_flight = max(self.most_in_flight, self._in_flight)
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._in_flight >= self.together, timeout=1.0)
                    self._in_flight -= 1
        return super().get(key)


def commit_versions(url: str, count: int) -> None:
    """``count`` log versions after the producer's claim, one TGB each."""
    with bw.Producer(url, f"p{uuid.uuid4().hex[:6]}", dp=1, commit_policy=Manual()) as producer:
        for offset in range(count):
            producer.append([b"x"], source_offset=offset)
            producer.flush()


@pytest.fixture
def url() -> str:
    return f"memory://readahead-{uuid.uuid4().hex}"


def test_versions_come_in_order_and_the_head_is_probed_once(url):
    commit_versions(url, 20)
    store = CountingStore(url)
    reader = LogReadAhead(Journal(store), 1, depth=8)
    try:
        got = []
        while (read := reader.next()) is not None:
            got.append(read.delta.version)
        head = got[-1]
        assert got == list(range(1, head + 1))
        assert head >= 20
        overshoot = [v for v in store.version_reads if v > head]
        assert 1 <= len(overshoot) <= 8  # at most one window of probes past the head
        issued = []
        submit = reader._pool.submit
        reader._pool.submit = lambda fn, version, *rest: issued.append(version) or submit(fn, version, *rest)
        assert reader.next() is None  # at the head: one probe, not a window
        assert issued == [head + 1]
    finally:
        reader.close()


def test_a_short_log_is_read_without_a_window_of_misses_past_its_head(url):
    """Regression: the window doubled with every version found, so a reader of a short
    log (no segment yet) was probing 32 versions ahead by its fifth: 27 of one rank's 34
    version reads missed (bench consumers, 128 ranks x 3 steps). It grows by one per
    version found now (doubling once per round trip): misses stay within the versions
    found."""
    commit_versions(url, 4)  # the claim and 4 commits: versions 1..5, no segment
    store = CountingStore(url)
    reader = LogReadAhead(Journal(store), 1, depth=64)  # a remote consumer's depth
    try:
        got = []
        while (read := reader.next()) is not None:
            got.append(read.delta.version)
    finally:
        reader.close()
    assert got == [1, 2, 3, 4, 5]
    misses = [v for v in store.version_reads if v > got[-1]]
    assert 1 <= len(misses) <= len(got) + 2, sorted(misses)


def test_a_version_committed_after_a_miss_is_found(url):
    commit_versions(url, 3)
    reader = LogReadAhead(Journal(CountingStore(url)), 1, depth=8)
    try:
        while reader.next() is not None:
            pass
        head = reader.next_version - 1
        commit_versions(url, 4)  # a new producer: its claim and 4 commits
        assert reader.next().delta.version == head + 1  # the earlier miss was not remembered
    finally:
        reader.close()


def test_a_backlog_is_read_with_reads_overlapping(url):
    """Single versions (where no segment exists) are read several at once too."""
    commit_versions(url, 40)
    store = CountingStore(url)
    store.delete(segment_key(32))  # versions 1..32 one by one
    reader = LogReadAhead(Journal(store), 9, depth=8)  # the window reaches 4 after a few hits
    try:
        for _ in range(4):  # the first reads, before the window is wide
            reader.next()
        store.together = 4
        versions = [reader.next().delta.version for _ in range(12)]
    finally:
        store.together = 0
        reader.close()
    assert versions == list(range(13, 25))
    assert store.most_in_flight >= 4


def test_a_local_directory_is_read_in_the_iterating_thread(tmp_path):
    url = str(tmp_path / "ns")
    commit_versions(url, 5)
    # Only this consumer's threads count: an earlier test's fetch thread may still be
    # winding down in this process (the suite once failed on one).
    before = set(threading.enumerate())
    with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as consumer:
        assert [next(consumer).step for _ in range(3)] == [0, 1, 2]
        assert consumer.inflight == 1
        started = [t for t in threading.enumerate() if t not in before]
        assert not [t for t in started if t.name.startswith("batchweave-fetch")]


@pytest.mark.parametrize(("slice_bytes", "depth"), [(100_000, 64), (4_000_000, 16), (40_000_000, 4)])
def test_an_object_store_prefetches_by_bytes(url, slice_bytes, depth):
    store = LatencyStore(url, NO_LATENCY)
    with bw.Producer(store, "p", dp=1) as producer:
        producer.append([{"x": np.zeros(slice_bytes, np.uint8)}], source_offset=0)
    with bw.Consumer(store, dp=1, rank=0, timeout_s=10) as consumer:
        assert consumer.inflight is None  # not known before the first TGB is read
        next(consumer)
        assert consumer.inflight == depth
    assert driver.auto_depth(slice_bytes) == depth


def test_an_explicit_prefetch_is_kept(tmp_path):
    url = str(tmp_path / "ns")
    commit_versions(url, 3)
    with bw.Consumer(url, dp=1, rank=0, prefetch=3, timeout_s=10) as consumer:
        next(consumer)
        assert consumer.inflight == 3
        assert [t for t in threading.enumerate() if t.name.startswith("batchweave-fetch")]


def test_a_consumer_from_the_start_does_not_load_the_state(url, monkeypatch):
    """Nothing to check a cursor at the start against: the first batch costs no snapshot
    and hint reads, and version 1 still names the namespace in the cursor."""
    commit_versions(url, 3)
    loads = []
    original = Journal.load_state
    monkeypatch.setattr(Journal, "load_state", lambda journal, **kw: loads.append(kw) or original(journal, **kw))
    with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as consumer:
        next(consumer)
        assert loads == []
        assert consumer.state_dict()["namespace"] == Journal(Store(url)).load_state().namespace != ""


@pytest.mark.parametrize("prefetch", [0, -1, True, "4", 2.5])
def test_a_bad_prefetch_is_refused_by_consumer_and_dataset(tmp_path, prefetch):
    from batchweave.torch import TGBDataset

    for make in (bw.Consumer, TGBDataset):
        with pytest.raises(bw.ConfigError, match="prefetch must be a positive number of steps or None"):
            make(str(tmp_path), dp=1, rank=0, prefetch=prefetch)
