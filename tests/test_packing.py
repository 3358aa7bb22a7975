"""Packs: a producer writes consecutive small TGBs as one object, a rank's slices of all of
them back to back (``batchweave.packing``, ``layout.encode_pack``), and garbage collection
deletes a pack only with the last TGB that reads it."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

import batchweave as bw
from batchweave.commit.policies import Manual
from batchweave.errors import ConfigError, StoreError
from batchweave.journal import Journal
from batchweave.layout import frame_tgb
from batchweave.packing import MAX_PACK_STEPS, PACK_RUN_BYTES, Held, PackBuffer, pack_limit
from batchweave.store import open_store
from tests.test_uploads import TrackingStore

DP = 3


def tgb(step: int, size: int = 16) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(size, step * 10 + rank, np.int32)} for rank in range(DP)]


def committed(url: str) -> list:
    return [t for v in Journal(open_store(url)).versions_after(0) for t in getattr(v, "tgbs", ())]


def read_all(url: str, rank: int, **options) -> list[int]:
    with bw.Consumer(url, dp=DP, rank=rank, node_sharing=False, timeout_s=20, **options) as consumer:
        return [int(batch.data["x"][0]) for batch in consumer]


# -- when to write a pack (pure) ------------------------------------------------------------


def test_the_pack_size_follows_the_slice_size():
    def framed(slice_bytes: int, slices: int = 1):
        return frame_tgb([b"x" * slice_bytes] * slices, slices, 1)

    assert pack_limit(framed(1_000), None) == MAX_PACK_STEPS  # tiny slices: the step bound
    assert pack_limit(framed(100_000), None) == PACK_RUN_BYTES // framed(100_000).largest_slice  # 10
    assert pack_limit(framed(PACK_RUN_BYTES), None) == 1  # 1 MiB slices are never held
    assert pack_limit(framed(600_000, slices=128), None) == 1  # 77 MB a TGB: past the memory bound
    assert pack_limit(framed(PACK_RUN_BYTES), 4) == 4  # asked for: as asked


def test_a_pack_is_due_when_full_or_when_the_next_append_would_come_too_late():
    framed = frame_tgb([b"x"], 1, 1)
    buffer = PackBuffer(pack_delay_s=1.0)
    for offset, now in enumerate((0.0, 0.1, 0.2)):
        buffer.appended(now)
        buffer.hold(Held(offset, framed, ""), limit=3, now=now)
        assert buffer.due(now) == (offset == 2)  # appends 0.1 s apart: full before the delay
    buffer.take()
    slow = PackBuffer(pack_delay_s=1.0)
    slow.appended(0.0)
    slow.hold(Held(0, framed, ""), limit=16, now=0.0)
    assert not slow.due(0.0)
    slow.appended(0.6)  # appends 0.6 s apart: the next one is expected at 1.2 s
    slow.hold(Held(1, framed, ""), limit=16, now=0.6)
    assert slow.due(0.6)  # waiting for it would hold offset 0 for 1.2 s: write the two now
    assert slow.deadline() == 1.0
    assert not slow.fits(limit=2)  # a TGB whose own pack holds 2 does not join a pack of 2
    assert slow.fits(limit=16)


def test_pack_options_are_checked():
    with pytest.raises(ConfigError, match="pack_steps"):
        bw.Producer(f"memory://packs-{uuid.uuid4().hex}", "p", dp=1, pack_steps=0)
    with pytest.raises(ConfigError, match="pack_delay_s"):
        bw.Producer(f"memory://packs-{uuid.uuid4().hex}", "p", dp=1, pack_delay_s=-1)


# -- producer and consumer ------------------------------------------------------------------


def test_packed_tgbs_share_objects_and_every_rank_reads_its_exact_steps(backend_url):
    with bw.Producer(backend_url, "p", dp=DP, pack_steps=4, commit_policy=Manual()) as producer:
        for step in range(10):
            producer.append(tgb(step))
    bw.end_stream(backend_url)
    tgbs = committed(backend_url)
    assert [len({key for t in tgbs for key in t.objects})] == [3]  # packs of 4, 4 and 2
    for first, count in ((0, 4), (4, 4), (8, 2)):
        pack = tgbs[first : first + count]
        assert len({tuple(t.objects) for t in pack}) == 1
        for rank in range(DP):
            ranges = [t.slices[rank] for t in pack]
            assert all(b[1] == a[1] + a[2] for a, b in zip(ranges, ranges[1:], strict=False))  # back to back
    for rank in range(DP):
        assert read_all(backend_url, rank) == [step * 10 + rank for step in range(10)]


def test_held_tgbs_wait_for_their_pack_and_a_flush_writes_them(fast_url):
    producer = bw.Producer(fast_url, "p", dp=DP, pack_steps=8, commit_policy=Manual())
    buffer = np.zeros(16, np.int32)
    for step in range(3):
        buffer[:] = step * 10  # the caller's one batch buffer, refilled every step
        producer.append([{"x": buffer + rank} for rank in range(DP)])
    assert producer.metrics()["held_tgbs"] == 3
    assert not list(open_store(fast_url).list("data/"))  # nothing written yet
    producer.flush()
    assert producer.metrics()["held_tgbs"] == 0
    assert len(list(open_store(fast_url).list("data/"))) == 1
    producer.close()
    bw.end_stream(fast_url)
    assert read_all(fast_url, 1) == [1, 11, 21]  # each step its own copy, not the reused buffer


def test_a_stalled_producers_pack_is_written_at_its_deadline(backend_url):
    """Appends stop (the next shard is slow to download): the held TGBs become visible
    within the delay, with no flush."""
    with bw.Producer(backend_url, "p", dp=DP, pack_steps=8, pack_delay_s=0.3) as producer:
        producer.append(tgb(0))
        producer.append(tgb(1))
        with bw.Consumer(backend_url, dp=DP, rank=2, node_sharing=False, timeout_s=20) as consumer:
            assert [int(next(consumer).data["x"][0]) for _ in range(2)] == [2, 12]
        assert producer.metrics()["held_tgbs"] == 0


def test_one_watcher_thread_writes_every_stalled_pack_at_its_deadline_and_ends_at_close(fast_url):
    """Three packs in turn, each stalled past its deadline: each is written by it, all by
    one thread (a thread a pack cost 1,000-1,500 thread starts in a 20 s window of a
    benchmark), and that thread ends with the producer."""

    def watchers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "batchweave-pack"]

    before = watchers()
    producer = bw.Producer(fast_url, "p", dp=DP, pack_steps=8, pack_delay_s=0.05, commit_policy=Manual())
    seen = set()
    for step in range(3):
        producer.append(tgb(step))
        deadline = time.monotonic() + 20
        while producer.metrics()["held_tgbs"] and time.monotonic() < deadline:
            seen.update(t for t in watchers() if t not in before)
            time.sleep(0.01)
        assert producer.metrics()["held_tgbs"] == 0, f"pack {step} still held past its deadline"
    assert len(seen) == 1
    producer.close()
    (watcher,) = seen
    watcher.join(10)
    assert not watcher.is_alive()
    bw.end_stream(fast_url)
    assert read_all(fast_url, 0) == [0, 10, 20]


def test_close_without_flush_drops_held_tgbs_and_a_restart_resumes_before_them(fast_url):
    producer = bw.Producer(fast_url, "p", dp=DP, pack_steps=4, commit_policy=Manual())
    for step in range(6):  # one pack of 4 written, 2 held
        producer.append(tgb(step))
    producer.flush()
    producer.append(tgb(6))
    producer.close(flush=False)
    again = bw.Producer(fast_url, "p", dp=DP, pack_steps=4, commit_policy=Manual())
    assert again.resume_offset == 6
    for step in range(again.resume_offset, 9):
        again.append(tgb(step), source_offset=step)
    again.close()
    bw.end_stream(fast_url)
    assert read_all(fast_url, 0) == [step * 10 for step in range(9)]


def test_a_failed_pack_write_fails_the_append_that_was_due_and_keeps_the_others():
    url = f"memory://packs-failed-{uuid.uuid4().hex}"
    store = TrackingStore(url, fail_part=".0.bwb")
    producer = bw.Producer(store, "p", dp=DP, pack_steps=2, commit_policy=Manual())
    producer.append(tgb(0), source_offset=0)  # held
    with pytest.raises(StoreError, match=r"\.0\.bwb"):
        producer.append(tgb(1), source_offset=1)  # the pack is due: its write fails
    assert producer.metrics()["held_tgbs"] == 1  # offset 0 is still held, offset 1 was not taken
    store.fail_part = None
    producer.append(tgb(1), source_offset=1)  # the same offset again
    producer.close()
    bw.end_stream(url)
    assert read_all(url, 2) == [2, 12]


def test_large_slices_are_never_held():
    url = f"memory://packs-large-{uuid.uuid4().hex}"
    producer = bw.Producer(url, "p", dp=1, commit_policy=Manual())
    producer.append([{"x": np.zeros(PACK_RUN_BYTES // 4, np.float32)}])
    assert producer.metrics()["held_tgbs"] == 0
    assert len(list(open_store(url).list("data/"))) == 1
    producer.close()


def test_concurrent_appends_keep_offsets_and_packs_in_order(fast_url):
    producer = bw.Producer(fast_url, "p", dp=DP, pack_steps=3, commit_policy=Manual())
    start = threading.Barrier(2)

    def appender(count: int) -> list[int]:
        start.wait()
        return [producer.append(tgb(0)) for _ in range(count)]

    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda: results.append(appender(7))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    producer.close()
    assert sorted(o for r in results for o in r) == list(range(14))
    assert [t.source_offset for t in committed(fast_url)] == list(range(14))


# -- garbage collection ---------------------------------------------------------------------


def test_gc_keeps_a_pack_until_its_last_tgb_is_reclaimed(backend_url):
    with bw.Producer(backend_url, "p", dp=DP, pack_steps=4, commit_policy=Manual()) as producer:
        for step in range(8):
            producer.append(tgb(step))
    bw.end_stream(backend_url)
    first_pack, second_pack = sorted({t.objects[0] for t in committed(backend_url)})
    at_2 = checkpoint_at(backend_url, 2, "ckpt-2")  # inside the first pack

    report = bw.collect_garbage(backend_url, grace_s=0)
    assert report.reclaimed_steps == 2
    assert first_pack not in report.deleted_objects  # steps 2 and 3 still read it
    assert {first_pack, second_pack} <= {info.key for info in open_store(backend_url).list("data/")}
    assert resume(backend_url, at_2[1], rank=1) == [step * 10 + 1 for step in range(2, 8)]

    at_5 = checkpoint_at(backend_url, 5, "ckpt-5", resumed=at_2)
    bw.release_checkpoint(backend_url, "ckpt-2")  # now past the first pack's last TGB (step 3)
    report = bw.collect_garbage(backend_url, grace_s=0)
    assert report.reclaimed_steps == 5
    assert first_pack in report.deleted_objects and second_pack not in report.deleted_objects
    assert resume(backend_url, at_5[0], rank=0) == [step * 10 for step in range(5, 8)]


def checkpoint_at(url: str, step: int, name: str, resumed: list[dict] | None = None) -> list[dict]:
    """Every rank reads to ``step`` (from its saved cursor, if given) and marks ``name``;
    returns each rank's cursor."""
    cursors = []
    for rank in range(DP):
        with bw.Consumer(url, dp=DP, rank=rank, node_sharing=False, timeout_s=20) as consumer:
            if resumed is not None:
                consumer.load_state_dict(resumed[rank])
            for _ in range(step - consumer.state_dict()["step"]):
                next(consumer)
            consumer.mark_checkpoint(name)
            cursors.append(consumer.state_dict())
    return cursors


def resume(url: str, state: dict, rank: int) -> list[int]:
    with bw.Consumer(url, dp=DP, rank=rank, node_sharing=False, timeout_s=20) as consumer:
        consumer.load_state_dict(state)
        return [int(batch.data["x"][0]) for batch in consumer]
