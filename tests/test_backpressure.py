"""Backpressure (I12): ``max_lag`` bounds the TGBs stored above W_global, committed or
only uploaded, for one producer and for a pool (``batchweave.lifecycle.backpressure``)."""

from __future__ import annotations

import threading
import time
import uuid
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st
from worker import tgb

import batchweave as bw
from batchweave.lifecycle.backpressure import (
    ACTIVE_VERSIONS,
    MAX_POLL_S,
    CommittedSpan,
    active_producers,
    may_upload,
    own_share,
    poll_pause_s,
    share,
)
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, Watermark, write_watermark
from batchweave.log import LogState, ProducerState
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.store import open_store
from benchmarks.scale_count import CountingStore, Tally
from benchmarks.scale_measure import INSTANT


def state(version: int, steps: int, **last_versions: int) -> LogState:
    producers = {p: ProducerState(offset=0, epoch=1, incarnation="i", last_version=v) for p, v in last_versions.items()}
    return LogState(version=version, steps=steps, producers=producers)


def allowed(log: LogState, own_pending: int, spans, w_global_steps: int, max_lag: int) -> bool:
    """``may_upload`` for producer "me", with its share worked out from ``log``."""
    return may_upload(log, own_share(log, "me", max_lag), own_pending, spans, w_global_steps, max_lag)


@given(room=st.integers(-5, 500), producers=st.integers(1, 64))
def test_the_shares_add_up_to_the_bound_exactly(room, producers):
    parts = [share(room, producers, i) for i in range(producers)]
    assert sum(parts) == max(0, room)
    assert max(parts) - min(parts) <= 1  # fair: nobody holds more than one over another


def test_a_producer_counts_its_uploaded_tgbs_against_its_share():
    log = state(10, steps=6, me=10)
    mine = [CommittedSpan(0, 6, 6)]
    assert allowed(log, 3, mine, w_global_steps=0, max_lag=10)  # 6 + 3 < 10
    assert not allowed(log, 4, mine, w_global_steps=0, max_lag=10)  # 6 + 4 = 10
    assert allowed(log, 4, mine, w_global_steps=2, max_lag=10)  # a checkpoint made room


def test_a_producer_counts_at_most_the_steps_its_commits_could_hold_above_w_global():
    span = CommittedSpan(first=10, end=20, count=4)  # four of ours among steps 10-19
    assert [span.at_or_above(w) for w in (0, 10, 16, 17, 19, 20, 30)] == [4, 4, 4, 3, 1, 0, 0]


def test_in_a_pool_each_producer_answers_for_its_own_share():
    log = state(10, steps=6, me=10, other=10)  # five max_lag each
    assert allowed(log, 2, [CommittedSpan(0, 6, 2)], w_global_steps=0, max_lag=10)
    assert not allowed(log, 3, [CommittedSpan(0, 6, 2)], w_global_steps=0, max_lag=10)
    # The steps it sees above W_global bound it too: a departed producer's steps still count.
    assert not allowed(state(10, steps=9, me=10, other=10), 1, [], w_global_steps=0, max_lag=10)


def test_producers_idle_for_a_while_take_no_share():
    log = state(100, steps=0, a=100, b=100 - ACTIVE_VERSIONS, gone=100 - ACTIVE_VERSIONS - 1)
    assert active_producers(log, "me") == ["a", "b", "me"]
    assert [share(9, 3, i) for i in range(3)] == [3, 3, 3]
    assert allowed(log, 2, [], w_global_steps=0, max_lag=9)
    assert not allowed(log, 3, [], w_global_steps=0, max_lag=9)


def data_objects(url) -> int:
    return sum(1 for _ in open_store(url).list("data/"))


def append_forever(producer, errors):
    def run():
        try:
            for offset in range(producer.resume_offset, 10_000):
                producer.append(tgb(producer.producer_id, offset, 2))
        except bw.BatchWeaveError as exc:  # closed while held: the end of the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_committed(url, steps, timeout_s=30.0):
    with bw.Consumer(url, dp=2, rank=0, timeout_s=timeout_s) as consumer:
        for _ in range(steps):
            next(consumer)


def test_fast_appends_stop_at_max_lag_uploaded_not_committed(tmp_path):
    """Appends are far faster than commits: counting committed steps only, a producer
    with max_lag=20 uploaded hundreds before it was held (229 at max_lag=80)."""
    url = str(tmp_path / "ns")
    producer = bw.Producer(url, "p", dp=2, max_lag=20, pack_steps=1)
    errors: list[Exception] = []
    thread = append_forever(producer, errors)
    wait_committed(url, 20)  # all 20 committed: the producer is held now, nothing in flight
    assert data_objects(url) == 20
    assert thread.is_alive()
    with bw.Consumer(url, dp=2, rank=0) as c0, bw.Consumer(url, dp=2, rank=1) as c1:
        for _ in range(5):
            next(c0), next(c1)
        c0.mark_checkpoint("ckpt-5")
        c1.mark_checkpoint("ckpt-5")
    wait_committed(url, 25)  # W_global = 5: room for five more
    assert data_objects(url) == 25
    producer.close(flush=False)
    thread.join(30)
    assert not thread.is_alive()


def test_a_pool_of_producers_stays_within_max_lag_together(tmp_path):
    url = str(tmp_path / "ns")
    producers = [bw.Producer(url, f"p{i}", dp=2, max_lag=30, pack_steps=1) for i in range(3)]
    for producer in producers:  # each has seen the others' claims once it committed one
        producer.append(tgb(producer.producer_id, 0, 2))
        producer.flush()
    errors: list[Exception] = []
    threads = [append_forever(producer, errors) for producer in producers]
    wait_committed(url, 30)
    assert data_objects(url) == 30  # ten each, however fast each appends
    assert all(thread.is_alive() for thread in threads)
    for producer in producers:
        producer.close(flush=False)
    for thread in threads:
        thread.join(30)


def test_a_held_producer_reads_each_watermark_once_however_often_it_polls():
    """Held by max_lag, a producer polled every watermark on every poll: 1,250 marks per
    checkpoint made ~38,000 GETs a second on _checkpoints/ at 1,000 held producers. Marks
    are create-only, so a poll now lists them and reads only the new ones."""
    url = f"memory://held-{uuid.uuid4().hex}"
    tally = Tally()
    store = CountingStore(url, tally, "producer", INSTANT)
    marks = 40  # of a 64-position mesh: the checkpoint is not complete, so W_global stays at 0
    for d in range(marks):
        write_watermark(open_store(url), Watermark("ck", dp=64, cp=1, d=d, c=0, position=Fraction(0), version=1))
    producer = bw.Producer(store, "p", dp=2, max_lag=4, pack_steps=1)
    errors: list[Exception] = []
    thread = append_forever(producer, errors)
    wait_committed(url, 4)

    def polls() -> int:
        return sum(1 for r in tally.requests if r.request == "list" and r.key.startswith(CHECKPOINT_PREFIX))

    deadline = time.monotonic() + 30
    while polls() < 4:  # the backoff doubles from 50 ms: four polls within a second or two
        assert time.monotonic() < deadline, "the held producer never polled four times"
        time.sleep(0.01)
    gets = [r for r in tally.requests if r.request == "get" and r.key.startswith(CHECKPOINT_PREFIX)]
    assert len(gets) == marks, len(gets)  # each mark once, not once per poll
    assert thread.is_alive() and data_objects(url) == 4
    producer.close(flush=False)
    thread.join(30)


@given(backoff=st.floats(0.05, 2.0), producers=st.integers(1, 5_000), draw=st.floats(0.0, 0.999))
def test_held_producers_poll_within_the_pools_budget(backoff, producers, draw):
    """1,000 held producers polling every 2 s listed _checkpoints/ 500 times a second."""
    mean = max(backoff, min(MAX_POLL_S, producers / HEAD_BUDGET_PER_S))  # never shorter than its own backoff
    assert mean / 2 <= poll_pause_s(backoff, producers, draw) < mean * 1.5
    # Pauses average to the mean (draws are uniform), so the pool's rate keeps the budget.
    mean_pause = (poll_pause_s(backoff, producers, 0.0) + poll_pause_s(backoff, producers, 0.999999)) / 2
    assert producers / mean_pause <= max(HEAD_BUDGET_PER_S, producers / MAX_POLL_S) * 1.001


def test_a_held_producer_paces_its_polls_by_the_pool_it_sees(tmp_path, monkeypatch):
    from batchweave import producer as producer_module

    seen: list[int] = []

    def recorded(backoff_s: float, producers: int, draw: float) -> float:
        seen.append(producers)
        return poll_pause_s(backoff_s, producers, draw)

    monkeypatch.setattr(producer_module, "poll_pause_s", recorded)
    url = str(tmp_path / "ns")
    others = [bw.Producer(url, f"other{i}", dp=2) for i in range(2)]  # their claims are in the log
    producer = bw.Producer(url, "p", dp=2, max_lag=4)
    errors: list[Exception] = []
    thread = append_forever(producer, errors)
    deadline = time.monotonic() + 30
    while 3 not in seen:
        assert time.monotonic() < deadline, f"the held producer never paced by the pool of 3 it sees: {seen}"
        time.sleep(0.01)
    assert set(seen) <= {1, 2, 3}
    producer.close(flush=False)
    thread.join(30)
    for other in others:
        other.close()


def wait_steps(url: str, steps: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while bw.inspect_namespace(url).steps < steps:
        assert time.monotonic() < deadline, f"never {steps} steps committed"
        time.sleep(0.01)


def test_once_collected_a_held_producer_reads_the_reclaim_point_not_the_watermarks():
    """Reading every watermark cost each held producer a GET per mark and checkpoint
    (1,250 x 1,000 producers: 1.25 million GETs a checkpoint). Once the namespace is
    collected, the log's reclaim point bounds what is stored: a probe of the head."""
    url = f"memory://held-reclaim-{uuid.uuid4().hex}"
    tally = Tally()
    producer = bw.Producer(CountingStore(url, tally, "producer", INSTANT), "p", dp=2, max_lag=10)
    errors: list[Exception] = []
    thread = append_forever(producer, errors)
    ranks = [bw.Consumer(url, dp=2, rank=r) for r in range(2)]

    def read_and_mark(steps: int, checkpoint: str) -> None:
        for consumer in ranks:
            for _ in range(steps):
                next(consumer)
            consumer.mark_checkpoint(checkpoint)

    wait_steps(url, 10)  # held
    read_and_mark(4, "ckpt-4")
    bw.collect_garbage(url)  # reclaims the steps below 4: room for four more
    wait_steps(url, 14)
    polls_before = len(tally.requests)
    read_and_mark(4, "ckpt-8")
    bw.release_checkpoint(url, "ckpt-4")  # W_global moves to 8, but nothing more is reclaimed yet
    deadline = time.monotonic() + 30
    while sum(1 for r in tally.requests[polls_before:] if r.key.startswith("_log/")) < 3:
        assert time.monotonic() < deadline, "the held producer never probed the log"
        time.sleep(0.01)
    assert bw.inspect_namespace(url).steps == 14  # still held: the log's reclaim point says 4
    bw.collect_garbage(url)
    wait_steps(url, 18)  # released by the collection: four more
    checkpoint_reads = [r for r in tally.requests[polls_before:] if r.key.startswith(CHECKPOINT_PREFIX)]
    assert checkpoint_reads == [], checkpoint_reads[:5]
    for consumer in ranks:
        consumer.close()
    producer.close(flush=False)
    thread.join(30)
