"""A rank reads a batch's slices while the batch's proof (I10) is in flight, and delivers
them only once it is done: the proof's round trip overlaps the reads instead of preceding
them (``ProvenLog(early=True)``, ``reading.pipeline``). Forced with a store that holds the
proof's request; a store flagged remote, so the reader reads ahead on threads as it does on
an object store."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
from checks import RecordingStore

import batchweave as bw
import batchweave.reading.follower
from batchweave import keys, log
from batchweave.commit.policies import Manual
from batchweave.errors import DataReclaimedError
from batchweave.journal import Journal
from batchweave.keys import version_key
from batchweave.reading.readahead import LogReadAhead
from batchweave.store import Store, open_store
from batchweave.testing.interleave import Background, PausingStore


class RemotePausingStore(PausingStore):
    """Memory with gates, read as an object store is (threads, reads ahead, proofs beside)."""

    @property
    def remote(self) -> bool:
        return True


def _url() -> str:
    return f"memory://reads-beside-proofs-{uuid.uuid4().hex}"


def _commit(url: str, versions: int) -> None:
    """``versions`` log versions of two TGBs of dp 1; slice ``n`` holds ``n`` everywhere."""
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(2 * versions):
            producer.append([{"x": np.full(8, offset, dtype=np.int64)}])
            if offset % 2:
                producer.flush()


def _resumed(store: PausingStore, url: str, after: int) -> bw.Consumer:
    """A consumer resumed from a cursor checked against the log (anchored on its version),
    so its next proof is one GET of that version; ``after`` odd leaves the cursor in the
    middle of that version, so the first batch the reader proves holds a step to read."""
    first = bw.Consumer(url, dp=1, rank=0, timeout_s=10)
    for _ in range(after):
        next(first)
    state = first.state_dict()
    first.close()
    consumer = bw.Consumer(store, dp=1, rank=0, timeout_s=10)
    consumer.load_state_dict(state)
    return consumer


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_a_step_read_beside_its_proof_is_delivered_once_the_proof_is_done():
    url = _url()
    _commit(url, 3)
    store = RemotePausingStore(url)
    consumer = _resumed(store, url, after=1)
    anchor = consumer.state_dict()["version"]
    # The reader reads the anchor's version again first (it starts there); the second GET
    # of its key is the proof of what it read.
    proof = store.pause("get", version_key(anchor), skip=1)
    try:
        delivery = Background(next, consumer)
        proof.wait_reached()
        _until(lambda: consumer.metrics().fetches >= 1)  # step 1 was read beside the proof...
        assert not delivery.finished.wait(0.5), "a step was delivered before the proof of its log version"
        proof.release()
        batch = delivery.result()
        assert batch.step == 1 and batch.data["x"][0] == 1
        assert [next(consumer).step for _ in range(4)] == [2, 3, 4, 5]
    finally:
        store.release_all()
        consumer.close()


def test_a_failed_proof_wins_over_the_steps_read_beside_it(monkeypatch):
    """GC overtook the reader while it read: the steps already read are never delivered."""
    url = _url()
    _commit(url, 3)
    store = RemotePausingStore(url)
    consumer = _resumed(store, url, after=1)
    anchor = consumer.state_dict()["version"]
    proving = threading.Event()
    original = batchweave.reading.follower.ProvenLog.prove

    def overtaken(self, lowest, newest):
        if newest is None or newest.delta.version <= anchor:
            return original(self, lowest, newest)
        proving.set()
        raise DataReclaimedError(url, 1, 4)

    monkeypatch.setattr(batchweave.reading.follower.ProvenLog, "prove", overtaken)
    try:
        with pytest.raises(DataReclaimedError):
            while True:  # the versions after the anchor are proven in a batch of their own
                batch = next(consumer)
                assert batch.version <= anchor, f"step {batch.step} was delivered from an unproven view"
        assert proving.is_set()
    finally:
        consumer.close()


def test_closing_the_log_reader_waits_for_a_proof_instead_of_cancelling_it():
    """Regression: a proof queued behind the reads was cancelled when the reader closed at
    the end of the stream, and the steps read beside it raised CancelledError."""
    url = _url()
    _commit(url, 2)
    store = RemotePausingStore(url)
    held = [store.pause("get", version_key(v)) for v in (1, 2)]
    reader = LogReadAhead(Journal(store, read_only=True), 1, depth=2)
    try:
        reading = Background(reader.next)
        for gate in held:
            gate.wait_reached()  # both read threads are busy
        proof = reader.beside(lambda: None)
        closing = Background(reader.close)
        for gate in held:
            gate.release()
        closing.result()
        reading.result()
        assert proof.result() is None and not proof.cancelled()
    finally:
        store.release_all()
        reader.close()


def _first_step(store: Store) -> int:
    with bw.Consumer(store, dp=1, rank=0, timeout_s=10) as consumer:
        return int(next(consumer).data["x"][0])


def _snapshot_gets(store: RecordingStore) -> list[str]:
    return [key for request, key in store.calls if request == "get" and key.startswith(keys.SNAPSHOT_PREFIX)]


def test_a_start_learns_the_namespace_id_from_the_hint_without_reading_a_snapshot():
    """Version 1's proof at a start compares its id with the one every snapshot repeats;
    the hint repeats it too, so 10,000 ranks starting at once each GET the small hint
    rather than the hint and then the snapshot (a state that grows with the producers)."""
    url = _url()
    _commit(url, 100)  # a snapshot at version 100, and a hint naming it
    namespace = Journal(open_store(url)).load_state().namespace
    assert namespace and log.decode_hint(bytes(open_store(url).get(keys.HINT_KEY))) == log.Hint(100, namespace)
    store = RecordingStore(url)
    assert _first_step(store) == 0
    assert ("get", keys.HINT_KEY) in store.calls
    assert _snapshot_gets(store) == []


def test_a_hint_without_the_namespace_id_costs_one_snapshot_read_and_a_wrong_one_a_load():
    """Hints written before they named the namespace, and damaged ones: the start still
    proves version 1, by the hinted snapshot, or, when the id does not match, by loading
    the state (never a delivery on a mismatch)."""
    url = _url()
    _commit(url, 100)
    open_store(url).put(keys.HINT_KEY, b'{"version": 100}')
    old_hint = RecordingStore(url)
    assert _first_step(old_hint) == 0
    assert _snapshot_gets(old_hint) == [keys.snapshot_key(100)]
    open_store(url).put(keys.HINT_KEY, b'{"version": 100, "namespace": "not-this-one"}')
    wrong = RecordingStore(url)
    assert _first_step(wrong) == 0
    assert keys.snapshot_key(100) in _snapshot_gets(wrong)  # the load after the mismatch
