"""Backpressure (I12): ``max_lag`` bounds the TGBs stored above W_global, committed or
only uploaded, for one producer and for a pool (``batchweave.lifecycle.backpressure``)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from worker import tgb

import batchweave as bw
from batchweave.lifecycle.backpressure import (
    ACTIVE_VERSIONS,
    MAX_POLL_S,
    CommittedSpan,
    Hold,
    Shares,
    active_producers,
    held_message,
    listed_checkpoints,
    may_upload,
    pinned_by_reclaim,
    poll_pause_s,
    share,
    shares,
)
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, Watermark, write_watermark
from batchweave.log import LogState, ProducerState
from batchweave.producer import uncommitted_message
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.store import open_store
from benchmarks.scale_count import CountingStore, Tally
from benchmarks.scale_measure import INSTANT


def state(version: int, steps: int, **last_versions: int) -> LogState:
    producers = {p: ProducerState(offset=0, epoch=1, incarnation="i", last_version=v) for p, v in last_versions.items()}
    return LogState(version=version, steps=steps, producers=producers)


def allowed(log: LogState, own_pending: int, spans, w_global_steps: int, max_lag: int) -> bool:
    """``may_upload`` for producer "me", with its share worked out from ``log``."""
    return may_upload(log, shares(log, "me", max_lag), own_pending, spans, w_global_steps)


@given(max_lag=st.integers(1, 500), producers=st.integers(1, 64))
def test_the_shares_add_up_to_the_bound_exactly_and_none_is_zero(max_lag, producers):
    """``share(2, 3, 0)`` was 0: that producer's append held for good, whatever training
    consumed, checkpointed and collected. Below one TGB per producer, each takes one."""
    parts = [share(max_lag, producers, i) for i in range(producers)]
    assert min(parts) >= 1
    assert sum(parts) == max(max_lag, producers)  # max_lag exactly, unless that is below one each
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
    from batchweave.lifecycle import maxlag

    seen: list[int] = []

    def recorded(backoff_s: float, producers: int, draw: float) -> float:
        seen.append(producers)
        return poll_pause_s(backoff_s, producers, draw)

    monkeypatch.setattr(maxlag, "poll_pause_s", recorded)
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


# -- a held producer always moves on, or says why (issue 43) ----------------------------


def test_a_closed_producer_takes_no_share_and_one_idle_long_enough_neither():
    log = state(10, steps=0, me=10, closed=10, crashed=10)
    log = LogState(
        version=10,
        producers=log.producers | {"closed": ProducerState(0, 1, "i", last_version=10, left=True)},
    )
    assert active_producers(log, "me") == ["crashed", "me"]  # a crashed one counts until ACTIVE_VERSIONS pass
    assert shares(log, "me", 9).mine == 5 and shares(log, "me", 1).bound == 2


@pytest.fixture(params=[pytest.param("local"), pytest.param("s3", marks=pytest.mark.s3)])
def local_or_s3_url(request, tmp_path, monkeypatch) -> str:
    """A fresh namespace in a local directory, and on S3 (the moto server)."""
    from conftest import _make_backend_url

    return _make_backend_url(request.param, request, tmp_path, monkeypatch)


def join_all(threads: list[threading.Thread], producers: list[bw.Producer], timeout_s: float) -> None:
    """Join every thread by a deadline; a thread still running there is a hang: the test
    fails, once the producers are closed so that no held append outlives it."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if stuck:
        for producer in producers:
            producer.close(flush=False)
        pytest.fail(f"still running after {timeout_s:.0f} s (a held producer that never moves on): {stuck}")


def test_three_producers_sharing_max_lag_2_all_finish_while_training_checkpoints_and_collects(local_or_s3_url, caplog):
    """``share(2, 3, 0)`` was 0: of three producers with max_lag=2 one never appended its
    second TGB, and training that consumed, checkpointed and collected everything waited
    for it forever. Now each takes at least one TGB (a WARNING says the bound is 3), and
    the two that finish give their shares back when they close."""
    url, each, dp = local_or_s3_url, 4, 1
    caplog.set_level(logging.WARNING, logger="batchweave.producer")
    producers = [bw.Producer(url, f"p{i}", dp=dp, max_lag=2, pack_steps=1) for i in range(3)]
    errors: list[BaseException] = []

    def produce(producer: bw.Producer) -> None:
        try:
            with producer:
                for offset in range(each):
                    producer.append(tgb(producer.producer_id, offset, dp), source_offset=offset)
        except BaseException as exc:
            errors.append(exc)

    def train() -> None:
        try:
            with bw.Consumer(url, dp=dp, rank=0, timeout_s=60) as consumer:
                for step in range(3 * each):
                    next(consumer)
                    consumer.mark_checkpoint(f"ckpt-{step + 1}")
                    if step:
                        bw.release_checkpoint(url, f"ckpt-{step}")
                    bw.collect_garbage(url, grace_s=0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,), name=p.producer_id, daemon=True) for p in producers]
    threads.append(threading.Thread(target=train, name="training", daemon=True))
    for thread in threads:
        thread.start()
    join_all(threads, producers, timeout_s=120)
    assert errors == []
    assert bw.inspect_namespace(url).steps == 3 * each
    adjusted = sorted(r.getMessage() for r in caplog.records if "is below the 3 producers" in r.getMessage())
    assert [m.split(":")[0] for m in adjusted] == ["producer 'p0'", "producer 'p1'", "producer 'p2'"], adjusted
    assert "max_lag=2" in adjusted[0] and "Give max_lag >= 3" in adjusted[0], adjusted


def test_a_closed_producer_gives_its_share_back_at_once(tmp_path):
    """Producers that finished kept counting for 64 log versions: this one was held at
    half of max_lag by a pool member long closed."""
    url = str(tmp_path / "ns")
    other = bw.Producer(url, "other", dp=2, max_lag=4)
    producer = bw.Producer(url, "p", dp=2, max_lag=4, pack_steps=1)  # sees "other": a share of 2
    other.close()  # records that it left
    errors: list[Exception] = []
    thread = append_forever(producer, errors)
    wait_committed(url, 4)  # all of max_lag
    assert thread.is_alive() and data_objects(url) == 4
    producer.close(flush=False)
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture
def held_warning_after(monkeypatch):
    """Set the bound after which a held producer says what holds it (read at each look)."""
    from batchweave.lifecycle import maxlag

    def set_bound(seconds: float) -> None:
        monkeypatch.setattr(maxlag, "HELD_WARNING_S", seconds)

    set_bound(1e9)  # nothing said while a test sets the scene
    return set_bound


def wait_for_warning(caplog, fragment: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [r.getMessage() for r in list(caplog.records) if fragment in r.getMessage()]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no WARNING with {fragment!r}: {[r.getMessage() for r in caplog.records]}"
        time.sleep(0.01)


def test_a_producer_held_by_its_own_share_says_so(tmp_path, caplog, held_warning_after):
    """Before any collection nothing was logged; after one, the warning said to run
    `batchweave gc`, which does not help a producer whose own share is full."""
    caplog.set_level(logging.WARNING, logger="batchweave.producer")
    held_warning_after(0.0)
    url = str(tmp_path / "ns")
    other = bw.Producer(url, "a", dp=2, max_lag=2)
    producer = bw.Producer(url, "b", dp=2, max_lag=2, pack_steps=1)
    producer.append(tgb("b", 0, 2))
    producer.flush()  # one of its own stored, of a share of one
    errors: list[Exception] = []
    thread = append_forever(producer, errors)
    message = wait_for_warning(caplog, "held by max_lag")
    assert message.startswith("producer 'b': held by max_lag=2 for "), message
    assert "its share (1 of max_lag 2 among 2 producers) is full: it has 1 TGB stored at or above step 0" in message
    assert "No checkpoint is live" in message and "batchweave gc" not in message
    assert sum("held by max_lag" in r.getMessage() for r in caplog.records) == 1  # once per hold, not per look
    producer.close(flush=False)
    thread.join(30)
    other.close()


def read_and_mark(ranks: list[bw.Consumer], steps: int, checkpoint: str) -> None:
    for consumer in ranks:
        for _ in range(steps):
            next(consumer)
        consumer.mark_checkpoint(checkpoint)


def test_a_held_producer_names_the_checkpoint_and_the_step_it_pins(tmp_path, caplog, held_warning_after):
    caplog.set_level(logging.WARNING, logger="batchweave.producer")
    url = str(tmp_path / "ns")
    producer = bw.Producer(url, "p", dp=2, max_lag=3, pack_steps=1)
    errors: list[Exception] = []
    thread = append_forever(producer, errors)
    ranks = [bw.Consumer(url, dp=2, rank=r) for r in range(2)]
    wait_steps(url, 3)
    read_and_mark(ranks, 2, "ckpt-2")
    wait_steps(url, 5)  # held again: three stored at or above step 2
    held_warning_after(0.0)
    message = wait_for_warning(caplog, "held by max_lag")
    assert (
        "the 3 TGBs stored at or above step 2 (3 committed, 0 of its own not committed yet) fill max_lag=3" in message
    )
    assert "W_global is step 2, pinned by the oldest live checkpoint 'ckpt-2'" in message, message
    for consumer in ranks:
        consumer.close()
    producer.close(flush=False)
    thread.join(30)


def test_once_collected_a_held_producer_says_when_a_collection_is_what_it_waits_for(
    tmp_path, caplog, held_warning_after
):
    caplog.set_level(logging.WARNING, logger="batchweave.producer")
    url = str(tmp_path / "ns")
    producer = bw.Producer(url, "p", dp=2, max_lag=3, pack_steps=1)
    errors: list[Exception] = []
    thread = append_forever(producer, errors)
    ranks = [bw.Consumer(url, dp=2, rank=r) for r in range(2)]
    wait_steps(url, 3)
    read_and_mark(ranks, 2, "ckpt-2")
    bw.collect_garbage(url, grace_s=0)  # reclaims below step 2
    wait_steps(url, 5)
    read_and_mark(ranks, 2, "ckpt-4")
    bw.release_checkpoint(url, "ckpt-2")  # W_global is 4 now, but nothing collected it
    held_warning_after(0.0)
    message = wait_for_warning(caplog, "held by max_lag")
    assert "Step 2 is where the last collection reclaimed up to" in message, message
    assert "checkpoint 'ckpt-2' was released since: no collection has run since the checkpoints moved" in message
    assert f"Run `batchweave gc {producer._store.url}`" in message
    assert bw.inspect_namespace(url).steps == 5  # still held: only a collection makes room
    for consumer in ranks:
        consumer.close()
    producer.close(flush=False)
    thread.join(30)


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_producer_says_which_appended_tgbs_a_restart_redoes(tmp_path, caplog, interruption):
    """Interrupted after appending up to offset 60 with 48 committed, a producer dropped
    the other 13 silently (right: a restart redoes them; but only a comment said so)."""
    caplog.set_level(logging.WARNING, logger="batchweave.producer")
    url = str(tmp_path / "ns")
    with pytest.raises(interruption):
        with bw.Producer(url, "p", dp=1, commit_policy=bw.Manual(), pack_steps=1) as producer:
            for offset in range(61):
                producer.append(tgb("p", offset, 1))
                if offset == 47:
                    producer.flush()
            raise interruption()
    expected = "producer 'p': 13 appended TGBs (offsets 48-60) were not committed; a restart redoes them from offset 48"
    assert expected in [r.getMessage() for r in caplog.records]
    with bw.Producer(url, "p", dp=1) as again:
        assert again.resume_offset == 48


def test_the_uncommitted_tgbs_are_counted_and_named_exactly():
    assert uncommitted_message("p", 48, 48) == ""
    assert uncommitted_message("p", 48, 49) == (
        "producer 'p': 1 appended TGB (offset 48) was not committed; a restart redoes it from offset 48"
    )
    assert "12 appended TGBs (offsets 48-59)" in uncommitted_message("p", 48, 60)


def test_the_held_warning_says_what_pins_w_global_in_each_case():
    pool = Shares(max_lag=2, producers=("a", "b", "c"), mine=1)
    full = held_message("c", 61.0, Hold(pool, own_pending=1, own_stored=1, committed=2, w_global_steps=7), "X")
    assert (
        "the 3 TGBs stored at or above step 7 (2 committed, 1 of its own not committed yet) fill the pool's bound of 3"
        in full
    )
    assert pinned_by_reclaim(7, None, "s3://b/ns").endswith(
        "run `batchweave gc s3://b/ns` (or bw.collect_garbage) after each checkpoint"
    )
    assert "oldest live checkpoint (of 'c1', 'c2')" in pinned_by_reclaim(7, (["c1", "c2"], []), "u")
    assert "no checkpoint is marked" in pinned_by_reclaim(7, ([], []), "u")
    listing = [f"{CHECKPOINT_PREFIX}c1/0-0.json", f"{CHECKPOINT_PREFIX}c1/_released", f"{CHECKPOINT_PREFIX}c2/0-0.json"]
    assert listed_checkpoints(listing) == (["c2"], ["c1"])
