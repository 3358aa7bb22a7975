"""Copies of the newest log versions (``batchweave.journal.headcopies``): written by every
committer once its put is proven, read at the head by the followers of a large job, proven
like the version's own key, and never a way to a step the log does not hold."""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
import uuid

import numpy as np
import pytest

import batchweave as bw
from batchweave import keys, retry
from batchweave.commit.policies import Manual
from batchweave.errors import ConfigError
from batchweave.journal import Journal, headcopies, proof
from batchweave.journal.headcopies import read_copy
from batchweave.journal.objects import LogObjects
from batchweave.latency import LatencyModel, LatencyStore
from batchweave.log import LogState, Reclaim
from batchweave.reading import node, readahead
from batchweave.reading.readahead import LogReadAhead
from batchweave.store import Store
from batchweave.store.core import head_copies_setting

FAST = LatencyModel(put_s=0.001, first_byte_s=0.001, head_s=0.001, list_s=0.001, delete_s=0.001, jitter_sigma=0)


class CountingStore(Store):
    """A memory store counting GETs of versions' own keys and of their copies."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gets: collections.Counter[str] = collections.Counter()

    def get(self, key: str):
        if key.startswith(keys.HEAD_PREFIX):
            self.gets["copy"] += 1
        elif key.startswith("_log/0"):
            self.gets["own"] += 1
        return super().get(key)


@pytest.fixture
def url() -> str:
    return f"memory://headcopies-{uuid.uuid4().hex}"


@pytest.fixture
def three_copies(monkeypatch):
    """Writers and readers keep 3 copies (a memory store keeps none by default; it writes
    them inline, so a test sees them as soon as the commit returns)."""
    monkeypatch.setenv("BATCHWEAVE_HEAD_COPIES", "3")


def commit_versions(url: str, count: int) -> None:
    with bw.Producer(url, f"p{uuid.uuid4().hex[:6]}", dp=1, commit_policy=Manual()) as producer:
        for offset in range(count):
            producer.append([b"x"], source_offset=offset)
            producer.flush()


def test_every_committed_version_has_its_copies_with_the_version_bytes(url, three_copies):
    commit_versions(url, 5)
    bw.end_stream(url)  # another writer: every commit writes its copies
    store = Store(url)
    state = Journal(store, read_only=True).load_state()
    assert state.version == 7  # the claim, five TGBs, the end
    for version in range(1, state.version + 1):
        own = bytes(store.get(keys.version_key(version)))
        copy = headcopies.encode_copy(version, state.namespace, own)  # the bytes, and whose they are
        assert [bytes(store.get(keys.head_copy_key(version, c))) for c in range(3)] == [copy] * 3
        assert store.size(keys.head_copy_key(version, 3)) is None


def test_an_object_store_keeps_ten_copies_unless_the_environment_says_otherwise(monkeypatch):
    assert LatencyStore("memory://remote", model=FAST).head_copies == keys.HEAD_COPIES == 10
    assert Store("memory://local").head_copies == 0  # a local follower's probes cost no requests
    assert head_copies_setting("0", remote=True) == 0
    assert head_copies_setting(" 12 ", remote=False) == 12
    for bad in ("-1", "33", "eight"):
        with pytest.raises(ConfigError, match="BATCHWEAVE_HEAD_COPIES"):
            head_copies_setting(bad, remote=True)


def test_a_copy_counts_only_for_the_version_it_holds(url, three_copies, caplog):
    commit_versions(url, 69)  # 70 versions: the ring of 64 slots went round once
    objects = LogObjects(Store(url))
    namespace = Journal(Store(url), read_only=True).load_state().namespace
    assert read_copy(objects, 70, 1, namespace).delta.version == 70
    assert read_copy(objects, 6, 1, namespace) is True  # its slot holds version 70: version 6 exists, read its own key
    assert read_copy(objects, 71, 1, namespace) is None  # its slot still holds version 7: not committed yet
    Store(url).put(keys.head_copy_key(72, 2), b'{"version": 72, "garbage')
    with caplog.at_level(logging.WARNING):
        assert read_copy(objects, 72, 2, namespace) is True  # damaged: read around it, by the own key
    assert "damaged copy of log version 72" in caplog.text
    # Invalid UTF-8 is damage like any other: read around.
    Store(url).put(keys.head_copy_key(73, 2), b'{"\xff": 1, "version": 73}')
    assert read_copy(objects, 73, 2, namespace) is True
    # Damage inside the version a copy holds, too.
    Store(url).put(
        keys.head_copy_key(74, 2), b'{"version": 74, "namespace": "%s", "data": {"version": 74}}' % namespace.encode()
    )
    assert read_copy(objects, 74, 2, namespace) is True


def _follow_one_by_one(url: str, versions: int, store: CountingStore, copies: int) -> list[int]:
    """A reader at the head probes each new version (committed only once it missed)."""
    reader = LogReadAhead(Journal(store, read_only=True), 1, 1, copies=copies)
    found: list[int] = []
    with bw.Producer(url, "p-head", dp=1, commit_policy=Manual()) as producer:
        while (read := reader.next()) is not None:  # the claim: a backlog of one
            found.append(read.delta.version)
        store.gets.clear()
        for offset in range(versions):
            producer.append([b"x"], source_offset=offset)
            producer.flush()
            for _ in range(200):  # each probe picks one of the version's keys at random
                if (read := reader.next()) is not None:
                    found.append(read.delta.version)
                    break
            assert reader.next() is None  # at the head again
    return found


def test_at_the_head_a_reader_spreads_its_probes_over_the_copies(url, three_copies, monkeypatch):
    monkeypatch.setattr(readahead, "random", random.Random(7))
    store = CountingStore(url)
    found = _follow_one_by_one(url, 30, store, copies=3)
    assert found == list(range(1, 32))
    assert store.gets["copy"] > 2 * store.gets["own"]  # 3 keys in 4 are copies


def test_without_copies_written_a_reader_still_finds_every_version_by_its_own_key(url, monkeypatch):
    monkeypatch.setattr(readahead, "random", random.Random(8))
    store = CountingStore(url)  # the writers keep none; the reader looks for 3
    found = _follow_one_by_one(url, 10, store, copies=3)
    assert found == list(range(1, 12))
    assert store.gets["own"] >= 10


def test_a_backlog_is_read_without_copies(url, three_copies):
    commit_versions(url, 40)
    store = CountingStore(url)
    reader = LogReadAhead(Journal(store, read_only=True), 1, 1, copies=3)
    versions = []
    while (read := reader.next()) is not None:
        versions.append(read.delta.version)
    assert versions == list(range(1, 42))
    assert store.gets["copy"] == 0


def _read(journal: Journal, versions: range) -> list:
    return [journal.read_version_data(v) for v in versions]


def test_a_spread_anchor_is_drawn_from_the_newest_proven_versions(url, monkeypatch):
    commit_versions(url, 30)
    journal = Journal(Store(url), read_only=True)
    journal.spread_anchors(8)
    monkeypatch.setattr(proof, "random", random.Random(3))
    anchors = set()
    for version in range(1, 31):
        read = journal.read_version_data(version)
        assert journal.prove_reads(version, read)
        anchors.add(journal.anchor_version)
        assert version - 8 < journal.anchor_version <= version
    assert len(anchors) > 10  # not always the newest


def test_a_spread_anchor_gc_passed_proves_the_reads_by_the_state_and_a_vanished_one_does_not(url, monkeypatch):
    commit_versions(url, 30)
    store = Store(url)
    journal = Journal(store, read_only=True)
    journal.spread_anchors(16)
    monkeypatch.setattr(proof, "random", random.Random(4))
    for version in range(1, 21):
        assert journal.prove_reads(version, journal.read_version_data(version))
    anchor = journal.anchor_version
    assert anchor is not None and anchor < 20
    store.delete(keys.version_key(anchor))
    reads = _read(journal, range(21, 25))
    own = journal._proof  # the state a proof would load, chosen here

    def state(reclaimed: int):
        return lambda: LogState(reclaimed=Reclaim(0, reclaimed, 0))

    assert not own.prove_reads(21, reads[-1], state(0))  # vanished, nothing reclaimed: damage, not proven
    assert not own.prove_reads(21, reads[-1], state(22))  # the reads themselves were reclaimed
    assert own.prove_reads(21, reads[-1], state(anchor + 1))  # GC passed the anchor, not the reads
    assert journal.anchor_version >= 21 - 16


def test_without_spread_a_reader_anchors_on_the_newest_and_draws_no_randomness(url, monkeypatch):
    commit_versions(url, 5)
    journal = Journal(Store(url), read_only=True)

    class NoDraws:
        def randrange(self, *_):
            raise AssertionError("a reader without spread drew an anchor")

    monkeypatch.setattr(proof, "random", NoDraws())
    for version in range(1, 6):
        assert journal.prove_reads(version, journal.read_version_data(version))
        assert journal.anchor_version == version


@pytest.mark.parametrize("sharing", [False, True], ids=["alone", "node-sharing"])
def test_ranks_of_a_large_job_read_copies_at_the_head_and_get_every_step_once(sharing):
    """Ranks of a 150-rank job (tp 150; with node sharing, 75 nodes of 2): more followers
    than the head budget's one probe a second each, so they read copies (10 on an object
    store), alone or through their node's hub."""
    if sharing and not node.sharing_supported():
        pytest.skip("node sharing needs Linux")
    url = f"memory://headcopies-consumer-{uuid.uuid4().hex}"
    store = LatencyStore(url, model=FAST)
    counting: collections.Counter[str] = collections.Counter()
    original_get = store.get

    def get(key):
        counting["copy" if key.startswith(keys.HEAD_PREFIX) else "other"] += 1
        return original_get(key)

    store.get = get  # type: ignore[method-assign]
    ranks = (0, 1) if sharing else (0,)
    seen: dict[int, list[int]] = {rank: [] for rank in ranks}
    delivered = threading.Condition()
    producer = bw.Producer(LatencyStore(url, model=FAST), "p", dp=1, commit_policy=Manual())
    producer.append([{"x": np.full(2, 0)}], source_offset=0)
    producer.flush()

    def consume(rank: int) -> None:
        where = {"local_rank": rank, "local_world_size": 2} if sharing else {}
        consumer = bw.Consumer(store, dp=1, tp=150, rank=rank, node_sharing=sharing, timeout_s=30, **where)
        for batch in consumer:
            with delivered:
                seen[rank].append(int(batch.data["x"][0]))
                delivered.notify_all()
        consumer.close()

    readers = [threading.Thread(target=consume, args=(rank,)) for rank in ranks]
    for reader in readers:
        reader.start()
    for step in range(1, 15):
        with delivered:  # every rank at the head, then the next commit
            assert delivered.wait_for(lambda s=step: all(len(v) >= s for v in seen.values()), timeout=30)
        producer.append([{"x": np.full(2, step)}], source_offset=step)
        producer.flush()
    producer.close()
    bw.end_stream(url)
    for reader in readers:
        reader.join(60)
    assert seen == {rank: list(range(15)) for rank in ranks}
    assert counting["copy"] > 0


def test_near_the_head_a_reader_catches_up_two_versions_at_a_time(url, three_copies):
    """A follower of a large job finds several versions after each pause; a window growing
    as in a backlog probed past the head on every visit (2.1 requests a version a node at
    1,250 nodes, 1.6 with the window held at two)."""
    asked: list[int] = []

    class Asking(Store):
        def get(self, key):
            if key.startswith(keys.HEAD_PREFIX) or key.startswith("_log/0"):
                asked.append(len(asked))
            return super().get(key)

    commit_versions(url, 3)
    reader = LogReadAhead(Journal(Asking(url), read_only=True), 1, 8, copies=3)
    try:
        while reader.next() is not None:
            pass  # the backlog, then the first miss: the head
        with bw.Producer(url, "p-late", dp=1, commit_policy=Manual()) as producer:
            for offset in range(12):
                producer.append([b"x"], source_offset=offset)
                producer.flush()
        asked.clear()
        found = 0
        while reader.next() is not None:
            found += 1
        assert found == 13  # the claim and twelve TGBs
        assert len(asked) <= found + 2  # each version once, and at most two probes past the head
    finally:
        reader.close()


class HeldPuts:
    """A store whose puts wait until ``release`` is set, recording for each which thread ran
    it, whether its retries were stopped there, and how many ran at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.puts: list[tuple[str, str, bool]] = []  # (key, thread name, retries stopped)
        self.running = 0
        self.most_at_once = 0

    def put(self, key: str, data: bytes) -> None:
        stop = retry.stop_event()
        with self._lock:
            self.puts.append((key, threading.current_thread().name, stop is not None and stop.is_set()))
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.release.wait(30)
        with self._lock:
            self.running -= 1


def test_copy_puts_are_bounded_in_flight_tried_once_and_the_bound_frees_as_they_end(caplog):
    """The process's copy puts: at most ``_MAX_IN_FLIGHT`` submitted at a time (one more is
    skipped, and the DEBUG line names it), ``_THREADS`` running, each on a named thread
    with retries stopped (best effort: one attempt); once they end, the bound is free again."""
    background = headcopies._Background()
    store = HeldPuts()

    def submit_round(prefix: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=headcopies.__name__):
            for n in range(headcopies._MAX_IN_FLIGHT + 1):
                background.submit(store, f"{prefix}{n}", b"copy")  # type: ignore[arg-type]
        return [r.getMessage() for r in caplog.records if r.name == headcopies.__name__]

    def all_ended() -> None:
        store.release.set()
        wait_for(lambda: background._in_flight == 0, "the copy puts to end", timeout_s=10)
        store.release.clear()

    last = headcopies._MAX_IN_FLIGHT
    try:
        skipped = submit_round("first-")
        wait_for(lambda: len(store.puts) == headcopies._THREADS, "the pool's threads to take puts", timeout_s=10)
        assert skipped == [f"skipped the head copy first-{last}: {last} copy puts in flight"]
        all_ended()
        assert submit_round("again-") == [f"skipped the head copy again-{last}: {last} copy puts in flight"]
        all_ended()
    finally:
        store.release.set()
    assert len(store.puts) == 2 * headcopies._MAX_IN_FLIGHT
    assert store.most_at_once == headcopies._THREADS
    assert all(thread.startswith("batchweave-head-copy") for _, thread, _ in store.puts)
    assert all(stopped for _, _, stopped in store.puts)


def wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
