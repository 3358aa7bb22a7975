"""A producer's ``append`` waits while its commits are behind what it appends
(``batchweave.commit.backlog``), and never where a commit needs a flush or more TGBs.

The commits are held by a store that pauses the log's puts: the hold is observed as the
producer's own counter of it (``held_by_commits_s``), not guessed from the time passing.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from worker import tgb

import batchweave as bw
from batchweave import keys
from batchweave.commit import backlog
from batchweave.commit.group import GroupCommit
from batchweave.commit.shared import SharedState
from batchweave.log import LogState, ProducerState, TGBDescriptor
from batchweave.testing.interleave import Background, PausingStore

LOG_PUT = re.escape(keys.LOG_PREFIX) + r"\d+\.json"
LIMIT_S = 0.2


@pytest.fixture
def short_limit(monkeypatch):
    monkeypatch.setattr(backlog, "MIN_BACKLOG_S", LIMIT_S)


def _descriptor(offset: int) -> TGBDescriptor:
    return TGBDescriptor("p", 1, offset, 1, 1, "bytes", [keys.data_key("p", 1, offset, "ab", 0)], [(0, 0, 1, 0)], 1)


def _state(offset: int) -> LogState:
    return LogState(version=2, producers={"p": ProducerState(offset, 1, "i")})


def test_the_backlog_is_the_wait_of_the_oldest_tgb_no_commit_has_taken():
    shared = SharedState("p", threading.Condition(), threading.Event(), _state(0), ProducerState(0, 1, "i"))
    assert shared.backlog_s(10.0) == 0.0
    shared.queue([_descriptor(0), _descriptor(1)], 1.0)
    shared.queue([_descriptor(2)], 4.0)
    assert shared.backlog_s(10.0) == 9.0
    shared.take(_state(1))  # the first batch is part committed: its wait goes on
    assert shared.backlog_s(10.0) == 9.0
    shared.take(_state(2))
    assert shared.backlog_s(10.0) == 6.0 and [t.source_offset for t in shared.pending] == [2]
    shared.take(_state(3))
    assert shared.backlog_s(10.0) == 0.0 and not shared.pending


def test_the_limit_is_four_gaps_and_at_least_the_floor():
    assert backlog.backlog_limit_s(0.0) == backlog.MIN_BACKLOG_S
    assert backlog.backlog_limit_s(0.4) == backlog.MIN_BACKLOG_S  # group commit's default interval
    assert backlog.backlog_limit_s(20.0) == 80.0  # DAC's gap at a large pool


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def _hold_an_append(producer: bw.Producer, store: PausingStore):
    """Hold ``producer``'s commit of TGB 0 in its put until its wait passes the limit, then
    append TGB 1 in the background and return once that append is held: (gate, append)."""
    gate = store.pause("put_if_absent", LOG_PUT)
    producer.append(tgb("p", 0, 1))
    gate.wait_reached()  # the commit of TGB 0 is held in its put
    _wait_until(lambda: producer.metrics()["commit_backlog_s"] > LIMIT_S)
    held = Background(producer.append, tgb("p", 1, 1))
    _wait_until(lambda: producer.metrics()["held_by_commits_s"] > 0)
    return gate, held


def _group_producer(store: PausingStore) -> bw.Producer:
    return bw.Producer(store, "p", dp=1, commit_policy=GroupCommit(interval_s=0.05), pack_steps=1)


def test_append_waits_while_the_commits_are_behind_and_goes_on_once_they_land(tmp_path, short_limit):
    store = PausingStore(str(tmp_path / "ns"))
    producer = _group_producer(store)
    try:
        gate, held = _hold_an_append(producer, store)
        assert not held.finished.is_set()  # held, not failed
        gate.release()
        assert held.result() == 1
        producer.flush()
        assert bw.inspect_namespace(store).producers["p"]["offset"] == 2
        assert producer.metrics()["commit_backlog_s"] == 0.0
    finally:
        store.release_all()
        producer.close()


def test_a_held_append_raises_the_error_that_ends_its_commits(tmp_path, short_limit):
    store = PausingStore(str(tmp_path / "ns"))
    producer = _group_producer(store)
    try:
        _, held = _hold_an_append(producer, store)
        # A new incarnation (through a store of its own, not paused) fences this one; then its
        # held commit's put finds the claim's version there, and the rebase finds it fenced.
        bw.Producer(str(tmp_path / "ns"), "p", dp=1).close()
        store.release_all()
        with pytest.raises(bw.ProducerFencedError):
            held.result()
    finally:
        store.release_all()
        producer.close(flush=False)


@pytest.mark.parametrize("policy", [bw.Manual(), bw.Fixed(every=100)], ids=["manual", "fixed"])
def test_a_policy_that_commits_only_when_asked_never_holds_append(tmp_path, short_limit, policy):
    # Manual waits for a flush, Fixed for its count of TGBs: holding append would wait for ever.
    producer = bw.Producer(str(tmp_path / "ns"), "p", dp=1, commit_policy=policy, pack_steps=1)
    try:
        producer.append(tgb("p", 0, 1))
        _wait_until(lambda: producer.metrics()["commit_backlog_s"] > LIMIT_S)
        assert producer.append(tgb("p", 1, 1)) == 1
        assert producer.metrics()["held_by_commits_s"] == 0.0
        producer.flush()
        assert bw.inspect_namespace(str(tmp_path / "ns")).producers["p"]["offset"] == 2
    finally:
        producer.close()
