"""A consumer's waits are bounded: ``next()`` raises StepTimeoutError within ``timeout_s``
whatever it waits on (the log, a step's range read, the proof of its log versions) and
then waits for the same step again; and a consumer left without ``close()`` never keeps
its process alive (a script that breaks out of its loop, on an object store).

Reads are held with gates (``interleave.PausingStore``) on a store read as an object
store is (``LatencyStore``: threads, a fetch pool, proofs beside the reads)."""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import CancelledError

import numpy as np
import pytest

import batchweave as bw
from batchweave.commit.policies import Manual
from batchweave.keys import version_key
from batchweave.latency import LatencyModel, LatencyStore
from batchweave.reading import driver, pipeline
from batchweave.testing.interleave import Background, PausingStore

FAST = LatencyModel(put_s=0.001, first_byte_s=0.001, head_s=0.001, list_s=0.001, delete_s=0.001, jitter_sigma=0)
TIMEOUT_S = 1.5
NO_HANG_S = 10.0  # a loose bound: proves a call did not hang, not how fast it was


class HeldStore(PausingStore, LatencyStore):
    """A remote-like store (memory behind a tiny latency model) whose requests can be held."""

    def __init__(self, url: str) -> None:
        super().__init__(url, model=FAST)


def _commit(url: str, versions: int) -> None:
    """``versions`` log versions of two TGBs of dp 1; step ``n`` holds ``n`` everywhere, in
    an object of its own (the tests hang the reads of one step's key)."""
    with bw.Producer(url, "p", dp=1, commit_policy=Manual(), pack_steps=1) as producer:
        for offset in range(2 * versions):
            producer.append([{"x": np.full(8, offset, dtype=np.int64)}], source_offset=offset)
            if offset % 2:
                producer.flush()
    bw.end_stream(url)


def _url() -> str:
    return f"memory://timeouts-{uuid.uuid4().hex}"


def _timed_out(consumer: bw.Consumer) -> float:
    """Seconds ``next(consumer)`` took to raise StepTimeoutError (on a thread: a
    regression fails here instead of hanging the test)."""
    started = time.monotonic()
    with pytest.raises(bw.StepTimeoutError) as raised:
        Background(next, consumer).result(timeout_s=NO_HANG_S)
    assert consumer.timeout_s is not None and str(consumer.timeout_s) in str(raised.value)
    return time.monotonic() - started


def test_a_hung_range_read_times_out_and_the_same_step_comes_next():
    url = _url()
    _commit(url, 4)  # steps 0-7
    store = HeldStore(url)
    held = store.pause("get_range", r"data/p/e\d+/000000000003-.*")  # step 3's slice
    consumer = bw.Consumer(store, dp=1, rank=0, prefetch=2, timeout_s=TIMEOUT_S)
    try:
        assert [int(next(consumer).data["x"][0]) for _ in range(3)] == [0, 1, 2]
        held.wait_reached()
        before = consumer.state_dict()
        assert _timed_out(consumer) < NO_HANG_S
        assert consumer.state_dict() == before  # still right after step 2
        held.release()
        batch = Background(next, consumer).result(timeout_s=NO_HANG_S)
        assert (batch.step, int(batch.data["x"][0])) == (3, 3)  # neither skipped nor repeated
        assert [int(b.data["x"][0]) for b in consumer] == [4, 5, 6, 7]
    finally:
        store.release_all()
        consumer.close()


def test_a_hung_proof_times_out_and_the_steps_read_beside_it_come_next():
    url = _url()
    _commit(url, 3)  # steps 0-5
    first = bw.Consumer(url, dp=1, rank=0, timeout_s=10)
    next(first)
    state = first.state_dict()  # in the middle of version 1: its step 1 is read beside the proof
    first.close()
    store = HeldStore(url)
    consumer = bw.Consumer(store, dp=1, rank=0, prefetch=2, timeout_s=TIMEOUT_S)
    consumer.load_state_dict(state)  # anchored on version 1: the next proof is one GET of it
    # The reader reads the anchor's version again first (it starts there); the second GET
    # of its key is the proof of what it read.
    proof = store.pause("get", version_key(state["version"]), skip=1)
    try:
        timing = Background(_timed_out, consumer)
        proof.wait_reached()
        assert timing.result(timeout_s=NO_HANG_S) < NO_HANG_S
        assert consumer.state_dict() == state  # the cursor did not move: step 1 is next
        proof.release()
        batch = Background(next, consumer).result(timeout_s=NO_HANG_S)
        assert (batch.step, int(batch.data["x"][0])) == (1, 1)
        assert [int(b.data["x"][0]) for b in consumer] == [2, 3, 4, 5]
    finally:
        store.release_all()
        consumer.close()


def test_closing_a_consumer_whose_read_hangs_returns_within_a_bound(monkeypatch):
    """Regression: close() waited for every fetch thread, however long a read hung."""
    monkeypatch.setattr(driver, "CLOSE_WAIT_S", 0.5)
    url = _url()
    _commit(url, 4)
    store = HeldStore(url)
    held = store.pause("get_range", r"data/p/e\d+/000000000003-.*")
    consumer = bw.Consumer(store, dp=1, rank=0, prefetch=2, timeout_s=TIMEOUT_S)
    try:
        assert [int(next(consumer).data["x"][0]) for _ in range(3)] == [0, 1, 2]
        held.wait_reached()
        Background(consumer.close).result(timeout_s=NO_HANG_S)
        assert [int(b.data["x"][0]) for b in itertools.islice(consumer, 2)] == [3, 4]  # from the cursor
    finally:
        store.release_all()
        consumer.close()


def test_closing_while_the_first_next_builds_the_pipeline_stops_that_pipeline(monkeypatch):
    """Regression (found as a flake of test_retry's stall test under load): the pipeline
    starts its threads while it is built, and close() from another thread then found no
    pipeline yet, so the one being built went on retrying a stalled store for 600 s."""
    url = _url()
    _commit(url, 2)
    built, release, made = threading.Event(), threading.Event(), []
    build = pipeline.Pipeline.__init__

    def held_open(self, *args, **kwargs):
        build(self, *args, **kwargs)
        made.append(self)
        built.set()
        release.wait(NO_HANG_S)  # still being built: its follow thread already runs

    monkeypatch.setattr(pipeline.Pipeline, "__init__", held_open)
    consumer = bw.Consumer(url, dp=1, rank=0, prefetch=2, timeout_s=TIMEOUT_S)

    def first_step():  # whatever the closing pipeline answers: a step, or how it stopped
        try:
            return next(consumer).step
        except (bw.BatchWeaveError, CancelledError) as exc:
            return exc

    iterating = Background(first_step)
    assert built.wait(NO_HANG_S)
    closing = Background(consumer.close)
    release.set()
    closing.result(timeout_s=NO_HANG_S)
    iterating.result(timeout_s=NO_HANG_S)
    assert made[0]._stop.is_set()


# -- a consumer left without close() ------------------------------------------------------


def test_a_consumer_dropped_while_a_read_hangs_is_collected_without_waiting_for_it():
    """Regression: ``Consumer.__del__`` closed the pipeline, waiting for every fetch thread:
    a garbage collection (on whatever thread ran it) waited for a hung read."""
    url = _url()
    _commit(url, 4)
    store = HeldStore(url)
    held = store.pause("get_range", r"data/p/e\d+/000000000003-.*")
    consumers = [bw.Consumer(store, dp=1, rank=0, prefetch=2, timeout_s=TIMEOUT_S)]
    try:
        assert [int(next(consumers[0]).data["x"][0]) for _ in range(3)] == [0, 1, 2]
        held.wait_reached()
        Background(lambda: consumers.clear() or gc.collect()).result(timeout_s=NO_HANG_S)
    finally:
        store.release_all()


PRODUCERS, DP, CP, TGBS, READ = 4, 2, 2, 240, 80

LEAVE_EARLY = textwrap.dedent(
    """
    import gc, sys
    import batchweave as bw

    consumer = bw.Consumer(sys.argv[1], dp={dp}, cp={cp}, rank=0, timeout_s=60)
    for step, batch in enumerate(consumer):
        if step + 1 == {read}:
            break
    if sys.argv[2] == "del":
        del consumer, batch
        gc.collect()
    print("left", step + 1, flush=True)
    """
).format(dp=DP, cp=CP, read=READ)


def _fill(url: str) -> None:
    """``TGBS`` TGBs of dp x cp slices from ``PRODUCERS`` producers at once, then the end."""

    def produce(index: int) -> None:
        with bw.Producer(url, f"p{index}", dp=DP, cp=CP) as producer:
            for offset in range(TGBS // PRODUCERS):
                producer.append([{"x": np.full(64, offset, np.int32)}] * (DP * CP), source_offset=offset)

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(PRODUCERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bw.end_stream(url)


@pytest.mark.s3
@pytest.mark.parametrize("left", ["at-exit", "del"])
def test_a_script_that_leaves_its_consumer_loop_early_exits(left, tmp_path, monkeypatch, request):
    """Regression: the interpreter's exit joined the fetch threads, which waited forever
    for turns that the steps never handed out would have opened (a torchrun job whose
    script broke out of ``for batch in consumer`` hung); the same once the consumer was
    garbage collected mid-iteration."""
    from conftest import _make_backend_url

    url = _make_backend_url("s3", request, tmp_path, monkeypatch)
    _fill(url)
    proc = subprocess.Popen(
        [sys.executable, "-c", LEAVE_EARLY, url, left],
        env=os.environ.copy(),  # the moto server's endpoint and credentials, set by the fixture
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert out.split() == ["left", str(READ)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
