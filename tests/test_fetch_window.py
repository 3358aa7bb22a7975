"""The fetch window (``reading.window``): a rank's steps are fetched in order, at most
``depth`` ahead of the one it is handed, and a step handed out starts the next fetch at
once, whatever the thread that reads the log is waiting for."""

from __future__ import annotations

import threading
import uuid

import numpy as np

import batchweave as bw
from batchweave.commit.policies import Manual
from batchweave.reading.window import FetchWindow
from batchweave.testing.interleave import Background, PausingStore


class RemotePausingStore(PausingStore):
    """Memory with gates, read as an object store is (threads, a fetch pool)."""

    @property
    def remote(self) -> bool:
        return True


def test_turns_come_in_order_as_steps_are_handed_out():
    window = FetchWindow(2, threading.Event())
    turns = [window.queue() for _ in range(4)]
    assert turns == [0, 1, 2, 3] and window.waiting == 4
    assert window.wait_turn(0) and window.wait_turn(1)
    third = Background(window.wait_turn, 2)
    assert not third.finished.wait(0.2), "a third fetch started with two steps not handed out"
    window.handed()
    assert third.result(5) is True
    assert window.waiting == 3


def test_each_step_handed_out_opens_exactly_the_next_turn():
    window = FetchWindow(2, threading.Event())
    for _ in range(4):
        window.queue()
    third, fourth = Background(window.wait_turn, 2), Background(window.wait_turn, 3)
    window.handed()
    assert third.result(5) is True
    assert not fourth.finished.wait(0.2), "one step handed out opened two turns"
    window.handed()
    assert fourth.result(5) is True


def test_room_for_more_steps_frees_as_steps_are_handed_out_and_closing_wakes_every_waiter():
    stop = threading.Event()
    window = FetchWindow(1, stop)
    for _ in range(3):
        window.queue()
    room = Background(window.wait_room, 2)
    assert not room.finished.wait(0.2)
    window.handed()
    assert room.result(5) is True
    turn = Background(window.wait_turn, 2)  # one step handed out, depth 1: turn 1 only
    assert not turn.finished.wait(0.2)
    stop.set()
    window.close()
    assert turn.result(5) is False  # the reader is closing: no fetch


def test_a_step_handed_out_starts_the_next_fetch_while_the_log_reader_waits():
    """Regression: the fetches beyond the first ``prefetch`` started only at the log
    reader's next event; a reader waiting for the next log version (here held) left the
    window idle and the consumer waited with it. Versions 1-32 come in one segment, so
    the reader hands them out as one batch before it waits for version 33."""
    url = f"memory://fetch-window-{uuid.uuid4().hex}"
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(31):  # versions 2-32, a step each: the segment ending at 32
            producer.append([{"x": np.full(8, offset, dtype=np.int64)}])
            producer.flush()
    store = RemotePausingStore(url)
    assert store.size("_log/_segments/00000000000000000032.json.z")  # versions 1-32 in one read
    after_segment = store.pause("get", r"_log/_segments/00000000000000000064\.json\.z")
    after_probe = store.pause("get", r"_log/00000000000000000033\.json")
    consumer = bw.Consumer(store, dp=1, rank=0, prefetch=2, timeout_s=10)
    try:
        steps = [int(next(consumer).data["x"][0]) for _ in range(31)]
        assert steps == list(range(31))
        assert after_segment.reached or after_probe.reached  # the log reader was held past the batch
    finally:
        store.release_all()
        consumer.close()
