"""A rank's start on an object store: the round trips before its first batch.

A start learns where the first steps live (the log), reads their slices, and proves what it
read (I10) before it hands a step out. Each of these waits a round trip of about 25 ms on
a cloud store, so a short pass is decided by how many of them come one after another:
the first versions are probed beside the first segment (a short log has none), a version
read while a proof is in flight has its slice read at once (its proof queued behind), and
a start's proof lists the snapshots instead of waiting for the namespace's id being learned.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest
from checks import RecordingStore
from test_proof_rules import grow

import batchweave as bw
from batchweave import keys
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.reading import follower as follower_module
from batchweave.reading.follower import ProvenLog, Unproven
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import FIRST_WINDOW, LogReadAhead
from batchweave.store import Store, open_store
from batchweave.testing.interleave import Background, PausingStore


class RemotePausingStore(PausingStore):
    """Memory with gates, read as an object store is (threads, reads ahead, proofs beside)."""

    @property
    def remote(self) -> bool:
        return True


class RoundTripStore(Store):
    """Memory read as an object store, each request taking ``delay_s``. Every request is
    given its round trip: one more than the latest of those that had ended before it
    began (requests made together share one). A reader's first batch costs the round trip
    of the last request that ended before it."""

    def __init__(self, url: str, delay_s: float) -> None:
        super().__init__(url)
        self.delay_s = delay_s
        self._ended: list[tuple[float, int]] = []  # (when, round trip)
        self._lock = threading.Lock()

    @property
    def remote(self) -> bool:
        return True

    def round_trips_until(self, moment: float) -> int:
        with self._lock:
            return max((trip for ended, trip in self._ended if ended <= moment), default=0)

    def _timed(self, op):
        with self._lock:
            began = time.monotonic()
            trip = 1 + max((t for ended, t in self._ended if ended <= began), default=0)
        time.sleep(self.delay_s)
        try:
            return op()
        finally:
            with self._lock:
                self._ended.append((time.monotonic(), trip))

    def get(self, key: str) -> memoryview:
        return self._timed(lambda: super(RoundTripStore, self).get(key))

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        return self._timed(lambda: super(RoundTripStore, self).get_range(key, start, length))

    def list(self, prefix: str = "") -> Any:
        return iter(self._timed(lambda: list(super(RoundTripStore, self).list(prefix))))


def _url() -> str:
    return f"memory://reader-start-{uuid.uuid4().hex}"


def _commit(url: str, tgbs: int) -> None:
    """A claim and ``tgbs`` versions of one TGB of dp 1 each: a short log, no segment, no snapshot."""
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(tgbs):
            producer.append([{"x": np.full(4, offset, dtype=np.int64)}])
            producer.flush()


def test_a_short_pass_has_its_first_batch_after_two_round_trips():
    """The log's versions (probed beside the first segment), then the slice's read with
    the proof's listing beside it: two round trips, where a start waited five (the missing
    segment, the versions, then the hint, a listing and a second listing for the proof)."""
    url = _url()
    _commit(url, 6)
    # Long round trips: requests made together must not end apart by more than a thread
    # may wait for its turn on a busy machine (at 50 ms, a third trip was seen under load).
    store = RoundTripStore(url, delay_s=0.25)
    with bw.Consumer(store, dp=1, rank=0, timeout_s=30) as consumer:
        batch = next(consumer)
        first_batch = time.monotonic()
        steps = [batch.step, *(next(consumer).step for _ in range(5))]
    assert steps == list(range(6))
    assert store.round_trips_until(first_batch) <= 2


def test_a_start_reads_its_first_version_while_the_first_segment_read_is_held():
    url = _url()
    _commit(url, 3)
    store = RemotePausingStore(url)
    held = store.pause("get", r"_log/_segments/.*")
    reader = LogReadAhead(Journal(store, read_only=True), 1, depth=64)
    try:
        first = Background(reader.next)
        held.wait_reached()
        assert first.result(timeout_s=10).delta.version == 1  # the segment read is still held
    finally:
        store.release_all()
        reader.close()


def test_no_version_is_probed_past_a_miss_already_seen():
    """The first window probes versions 1-8 of a log of 4: once the misses of 5-8 are seen,
    the window growing with each version handed out probes nothing past them."""
    url = _url()
    _commit(url, 3)  # versions 1-4
    store = RecordingStore(url)
    reader = LogReadAhead(Journal(store, read_only=True), 1, depth=64)
    try:
        assert reader.next().delta.version == 1
        first_window = [reader._reads[v] for v in range(5, FIRST_WINDOW + 1)]
        for probe in first_window:
            assert probe.result(timeout=10) is None  # each a miss
        versions = []
        while (read := reader.next()) is not None:
            versions.append(read.delta.version)
    finally:
        reader.close()
    assert versions == [2, 3, 4]
    probed = {int(key[len("_log/") : -len(".json")]) for request, key in store.calls if _is_version(request, key)}
    assert max(probed) == FIRST_WINDOW


def _is_version(request: str, key: str) -> bool:
    return request == "get" and key.startswith("_log/0") and key.endswith(".json")


def test_a_version_read_while_a_proof_is_in_flight_is_handed_out_at_once(monkeypatch):
    """A version read while the proof of the one before is held is handed out at once, with
    the future of the proof queued behind it; that one proof covers every version read
    meanwhile, and runs only after the held one (one proof at a time)."""
    url = _url()
    grow(url, 4)  # versions 1-5
    release, proofs = _hold_first_proof(monkeypatch)
    journal = Journal(open_store(url), read_only=True)
    reader = LogReadAhead(journal, 2, 4)
    follower = iter(ProvenLog(journal, reader, HeadPolling(1), lambda: 0, url, early=True))
    try:
        items = Background(lambda: [next(follower) for _ in range(4)]).result(timeout_s=10)
        assert all(isinstance(item, Unproven) for item in items)
        assert [[read.delta.version for read in item.versions] for item in items] == [[2], [3], [4], [5]]
        first, queued = items[0].proof, {id(item.proof) for item in items[1:]}
        assert len(queued) == 1 and not first.done() and not items[1].proof.done()
        release.set()
        items[1].proof.result(timeout=10)
    finally:
        release.set()
        reader.close()
    assert proofs == [(2, 2), (3, 5)]
    assert journal.anchor_version == 5


def test_a_start_proves_the_versions_of_its_first_wave_together(monkeypatch):
    """The versions read together with a start's first one join its first proof, even when
    they arrive a moment later: proven apart, the second one's step waits a round trip more."""
    url = _url()
    grow(url, 4)  # versions 1-5
    proofs: list[tuple[int, int | None]] = []
    prove = ProvenLog.prove

    def recording(self, lowest, newest):
        proofs.append((lowest, None if newest is None else newest.delta.version))
        prove(self, lowest, newest)

    monkeypatch.setattr(ProvenLog, "prove", recording)
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: False)  # each arrives after the one before
    journal = Journal(open_store(url), read_only=True)
    reader = LogReadAhead(journal, 1, 64)
    follower = iter(ProvenLog(journal, reader, HeadPolling(1), lambda: 0, url, early=True))
    try:
        first = next(follower)
        assert isinstance(first, Unproven)
        first.proof.result(timeout=10)
    finally:
        reader.close()
    assert [read.delta.version for read in first.versions] == [1, 2, 3, 4, 5]
    assert proofs == [(1, 5)]


def test_a_failed_proof_fails_the_one_queued_behind_it(monkeypatch):
    url = _url()
    grow(url, 3)  # versions 1-4
    release = threading.Event()
    calls = []

    def failing_first(self, lowest, newest):
        calls.append(lowest)
        if len(calls) == 1:
            assert release.wait(30)
            raise bw.DataReclaimedError(url, 0, 3)

    monkeypatch.setattr(ProvenLog, "prove", failing_first)
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: False)
    monkeypatch.setattr(LogReadAhead, "pending", lambda reader: False)
    journal = Journal(open_store(url), read_only=True)
    reader = LogReadAhead(journal, 2, 4)
    follower = iter(ProvenLog(journal, reader, HeadPolling(1), lambda: 0, url, early=True))
    try:
        items = Background(lambda: [next(follower) for _ in range(2)]).result(timeout_s=10)
        release.set()
        for item in items:
            with pytest.raises(bw.DataReclaimedError):
                item.proof.result(timeout=10)
    finally:
        release.set()
        reader.close()
    assert calls == [2]  # the queued proof proved nothing after the failure


def test_a_start_proof_lists_instead_of_waiting_for_the_namespace_being_learned():
    url = _url()
    _commit(url, 2)  # no snapshot
    store = RemotePausingStore(url)
    held = store.pause("get", keys.HINT_KEY)
    journal = Journal(store, read_only=True)
    first = journal.read_version_data(1)
    learning = Background(journal.learn_namespace)
    try:
        held.wait_reached()
        assert Background(journal.prove_reads, 1, first).result(timeout_s=10) is True  # the hint is still held
    finally:
        store.release_all()
    learning.result()


def test_a_start_proof_after_learning_there_is_no_snapshot_costs_one_listing():
    url = _url()
    _commit(url, 2)
    store = RecordingStore(url)
    journal = Journal(store, read_only=True)
    first = journal.read_version_data(1)
    journal.learn_namespace()  # no snapshot: no id to learn
    store.calls.clear()
    assert journal.prove_reads(1, first) is True
    assert store.calls == [("list", keys.SNAPSHOT_PREFIX)]


@pytest.mark.parametrize("batch_versions", [2])
def test_a_queued_proof_never_grows_past_a_batch(monkeypatch, batch_versions):
    """``PROOF_BATCH_VERSIONS`` bounds the proof queued behind the one in flight too."""
    monkeypatch.setattr(follower_module, "PROOF_BATCH_VERSIONS", batch_versions)
    url = _url()
    grow(url, 6)  # versions 1-7
    release, proofs = _hold_first_proof(monkeypatch)
    journal = Journal(open_store(url), read_only=True)
    reader = LogReadAhead(journal, 2, 4)
    follower = iter(ProvenLog(journal, reader, HeadPolling(1), lambda: 0, url, early=True))
    try:
        items = Background(lambda: [next(follower) for _ in range(6)]).result(timeout_s=10)
        release.set()
        for item in items:
            item.proof.result(timeout=10)
    finally:
        release.set()
        reader.close()
    assert proofs == [(2, 2), (3, 4), (5, 6), (7, 7)]


def test_the_versions_after_a_backlogs_last_segment_are_probed_a_window_at_a_time():
    """A backlog of 40 versions: segment 32, then the 8 versions after it, probed together
    once segment 64 is found missing (two at a time, growing by one, took four round trips
    for the last 16 versions of 80)."""
    url = _url()
    _commit(url, 39)  # versions 1-40: segment 32 only
    store = RecordingStore(url)
    reader = LogReadAhead(Journal(store, read_only=True), 1, depth=64)
    try:
        versions = [reader.next().delta.version for _ in range(33)]  # through the segment, to version 33
        assert versions == list(range(1, 34))
        issued = [v for v in reader._reads if v > 33]
    finally:
        reader.close()
    assert set(range(34, 33 + FIRST_WINDOW)) <= set(issued)  # the window of 8 from version 33 on


def _hold_first_proof(monkeypatch) -> tuple[threading.Event, list[tuple[int, int | None]]]:
    """Hold the first proof until the returned event is set, record every proof's
    (lowest, newest) versions, and make each version read its own batch."""
    release = threading.Event()
    proofs: list[tuple[int, int | None]] = []
    prove = ProvenLog.prove

    def held_first(self, lowest, newest):
        if not proofs:
            assert release.wait(30)
        proofs.append((lowest, None if newest is None else newest.delta.version))
        prove(self, lowest, newest)

    monkeypatch.setattr(ProvenLog, "prove", held_first)
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: False)  # each version would be a batch
    monkeypatch.setattr(LogReadAhead, "pending", lambda reader: False)
    return release, proofs
