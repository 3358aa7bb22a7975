"""The fetch window (``reading.window``): a rank's steps are fetched in order, at most
``depth`` ahead of the one it is handed, and a step handed out starts the next fetch at
once, whatever the thread that reads the log is waiting for."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np

import batchweave as bw
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.reading import driver
from batchweave.reading.window import FetchWindow, WindowRoom
from batchweave.store import open_store
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


def test_a_byte_budget_opens_as_many_steps_as_fit():
    room = WindowRoom(depth=8, budget_bytes=100)
    assert [list(room.queue(30)) for _ in range(4)] == [[0], [1], [2], []]  # 90 fit, 120 do not
    assert list(room.queue(10)) == []  # in order: the fourth waits, so does the fifth
    assert list(room.hand()) == [3, 4]  # 60 + 30 + 10
    assert room.open_bytes == 100


def test_the_first_step_not_handed_out_always_fits_however_large():
    room = WindowRoom(depth=8, budget_bytes=100)
    assert list(room.queue(500)) == [0]
    assert list(room.queue(1)) == []  # nothing beside a step over the budget
    assert list(room.hand()) == [1]


def test_larger_steps_later_get_fewer_in_flight_never_more_bytes():
    """The budget is fixed from the first step's size; later steps ten times larger
    get a tenth of the steps in flight."""
    room = WindowRoom(depth=64, budget_bytes=64 * 100_000)
    opened = [t for _ in range(64) for t in room.queue(100_000)]
    assert opened == list(range(64))
    for _ in range(64):
        room.queue(1_000_000)
    for _ in range(64):
        room.hand()
        assert room.open_bytes <= 64 * 100_000 or room.opened - room.handed == 1
    assert room.opened - room.handed == 6  # 6 steps of 1 MB in 6.4 MB


def test_no_byte_budget_counts_steps_only():
    room = WindowRoom(depth=2)
    assert [list(room.queue(10**9)) for _ in range(3)] == [[0], [1], []]
    assert list(room.hand()) == [2]


def test_a_fetch_thread_waits_for_bytes_not_only_for_a_slot():
    window = FetchWindow(8, threading.Event(), budget_bytes=100)
    turns = [window.queue(60), window.queue(60)]
    assert window.wait_turn(turns[0])
    second = Background(window.wait_turn, turns[1])
    assert not second.finished.wait(0.2), "a fetch started past the byte budget"
    window.handed()
    assert second.result(5) is True


class InFlightStore(RemotePausingStore):
    """Records the most bytes of slice reads in flight at once; each read takes a moment."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.most_bytes = 0
        self._bytes = 0
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, length: int):
        with self._lock:
            self._bytes += length
            self.most_bytes = max(self.most_bytes, self._bytes)
        try:
            time.sleep(0.02)
            return super().get_range(key, start, length)
        finally:
            with self._lock:
                self._bytes -= length


def test_prefetch_none_bounds_the_bytes_in_flight_when_later_steps_are_larger(monkeypatch):
    """The window's depth comes from the first step (4 steps of ~1 KB here); steps twice as
    large later get half as many reads in flight, never twice the bytes."""
    monkeypatch.setattr(driver, "AUTO_PREFETCH_BYTES", 3000)
    url = f"memory://fetch-window-{uuid.uuid4().hex}"
    # pack_steps=1: the bound is on steps' reads; a pack's steps read together may pass it
    # by one read of up to reading.runs.MAX_RUN_BYTES (docs/reading.md)
    schema = {"x": ("uint8", (None,))}
    with bw.Producer(url, "p", dp=1, commit_policy=Manual(), schema=schema, pack_steps=1) as producer:
        for step, size in enumerate([1000] + [2000] * 12):
            producer.append([{"x": np.full(size, step, np.uint8)}])
        producer.flush()
    store = InFlightStore(url)
    first_slice = Journal(open_store(url)).read_version(2).tgbs[0].slices[0][2]
    with bw.Consumer(store, dp=1, rank=0, timeout_s=30) as consumer:
        assert [int(next(consumer).data["x"][0]) for _ in range(13)] == list(range(13))
        assert consumer.inflight == 4
    later_slice = Journal(open_store(url)).read_version(2).tgbs[1].slices[0][2]
    budget = driver.auto_budget(first_slice)
    assert budget < 3 * later_slice  # three of the later steps would not fit
    # Ahead of the step next() waits for (handed out as the call takes it): the budget.
    assert later_slice < store.most_bytes <= budget + later_slice
