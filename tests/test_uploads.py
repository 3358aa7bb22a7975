"""A TGB's objects are uploaded at once on an object store (``writing.packs.PackWriter``): a
TGB of many slices is several objects (``layout.MAX_SLICES_PER_OBJECT``), and one round
trip each, one after another, made the producer of a 1,250-slice TGB 20 round trips slow."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

import batchweave as bw
from batchweave.commit.policies import Manual
from batchweave.errors import StoreError
from batchweave.latency import LatencyModel, LatencyStore

FAST = LatencyModel(put_s=0.001, first_byte_s=0.001, head_s=0.001, list_s=0.001, delete_s=0.001, jitter_sigma=0)


class TrackingStore(LatencyStore):
    """Records the most TGB object puts in flight at once; ``fail_part`` makes that part's put fail."""

    def __init__(self, url: str, together: int = 0, fail_part: str | None = None) -> None:
        super().__init__(url, model=FAST)
        self.together = together  # a put waits (up to 2 s) until this many are in flight
        self.fail_part = fail_part
        self.in_flight = self.most = 0
        self._cond = threading.Condition()

    def stage_if_absent(self, key, data, size=None):
        if not key.startswith("data/"):
            return super().stage_if_absent(key, data, size)
        with self._cond:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.in_flight >= self.together, timeout=2.0)
        try:
            if self.fail_part is not None and key.endswith(self.fail_part):
                raise StoreError(key, "refused (test)")
            return super().stage_if_absent(key, data, size)
        finally:
            with self._cond:
                self.in_flight -= 1


def tgb(dp: int, value: int) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(2, value * dp + d)} for d in range(dp)]


def test_the_objects_of_one_tgb_are_uploaded_at_once_and_read_back_whole():
    url = f"memory://uploads-{uuid.uuid4().hex}"
    store = TrackingStore(url, together=3)
    with bw.Producer(store, "p", dp=150, commit_policy=Manual()) as producer:
        producer.append(tgb(150, 0), source_offset=0)  # 150 slices: 3 objects of at most 64
        producer.flush()
    assert store.most == 3
    bw.end_stream(url)
    for rank in (0, 64, 149):
        with bw.Consumer(url, dp=150, rank=rank, node_sharing=False, timeout_s=10) as consumer:
            assert [int(b.data["x"][0]) for b in consumer] == [rank]


def test_a_failed_object_fails_the_append_after_the_others_ended_and_commits_nothing():
    url = f"memory://uploads-failed-{uuid.uuid4().hex}"
    store = TrackingStore(url, fail_part=".1.bwb")
    producer = bw.Producer(store, "p", dp=150, commit_policy=Manual(), pack_steps=1)
    with pytest.raises(StoreError, match=r"\.1\.bwb"):
        producer.append(tgb(150, 0), source_offset=0)
    assert store.in_flight == 0  # nothing still uploading once append raised
    store.fail_part = None
    producer.append(tgb(150, 0), source_offset=0)  # the same offset again: nothing was taken
    producer.close()
    bw.end_stream(url)
    with bw.Consumer(url, dp=150, rank=100, node_sharing=False, timeout_s=10) as consumer:
        assert [int(b.data["x"][0]) for b in consumer] == [100]


def test_an_append_hands_the_store_its_callers_arrays_not_a_copy(monkeypatch):
    """Regression (issue 44): every TGB object was joined into one buffer before its put (a
    copy of every byte). The store is now given the object's pieces: headers, and views
    of the caller's own arrays."""
    from batchweave.store import core as store_core

    given: list = []
    real_put = store_core.obstore.put

    def spy(store, path, file, **options):
        if path.startswith("data/"):
            given.append(file)
        return real_put(store, path, file, **options)

    monkeypatch.setattr(store_core.obstore, "put", spy)
    arrays = tgb(4, 7)
    url = f"memory://uploads-pieces-{uuid.uuid4().hex}"
    with bw.Producer(url, "p", dp=4, commit_policy=Manual(), pack_steps=1) as producer:
        producer.append(arrays, source_offset=0)
        producer.flush()
    (pieces,) = given
    viewed = [p.obj for p in pieces if isinstance(p, memoryview) and isinstance(p.obj, np.ndarray)]
    assert len(viewed) == 4 and all(np.shares_memory(v, a["x"]) for v, a in zip(viewed, arrays, strict=True))


def _count_wakeups(producer: bw.Producer) -> list[int]:
    """How often the producer wakes its commit thread: each notify of the shared condition,
    by the pending TGBs it saw."""
    woken: list[int] = []
    cond = producer._shared.cond
    real = cond.notify_all

    def counting() -> None:
        woken.append(len(producer._shared.pending))
        real()

    cond.notify_all = counting  # type: ignore[method-assign]
    return woken


def test_appends_behind_pending_tgbs_do_not_wake_a_commit_thread_that_waits_out_a_gap():
    """Regression (issue 44's profile): every append woke the commit thread, which found its
    gap not yet over and slept again: a hand-off of the interpreter lock per TGB for both
    threads. Only the first pending TGB can bring a gap-paced commit forward."""
    url = f"memory://wakeups-{uuid.uuid4().hex}"
    producer = bw.Producer(url, "p", dp=2, commit_policy=bw.DAC(), pack_steps=1)
    producer.policy.gap_s = 3600.0  # the next attempt is an hour away: only a flush commits
    woken = _count_wakeups(producer)
    for offset in range(30):
        producer.append(tgb(2, offset), source_offset=offset)
    assert woken == [1], woken  # the first TGB alone
    producer.close()
    assert producer.resume_offset == 30


def test_an_append_that_reaches_the_count_a_policy_waits_for_wakes_the_commit_thread():
    from batchweave.commit.policies import Fixed

    url = f"memory://wakeups-count-{uuid.uuid4().hex}"
    with bw.Producer(url, "p", dp=2, commit_policy=Fixed(every=4), pack_steps=1) as producer:
        woken = _count_wakeups(producer)
        for offset in range(4):
            producer.append(tgb(2, offset), source_offset=offset)
        deadline = time.monotonic() + 20
        while producer.resume_offset < 4:  # committed by the thread, no flush
            assert time.monotonic() < deadline, "the fourth TGB did not wake the commit thread"
            time.sleep(0.01)
        assert 4 in woken
