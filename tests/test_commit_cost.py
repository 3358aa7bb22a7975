"""What a direct-mode commit costs, counted: a producer learns the head from the head
alone (``Journal.commit(jump=True)``), so the requests it makes and the log bytes it
reads per commit attempt are the same with 8 and with 128 other producers committing;
and what the jump must never lose: a claim that fences it, its own ambiguous put that
landed, logs older than the fields it reads (issue 44, "Commits that keep up").

The producers' commits interleave in a fixed order (each round, every other producer
commits one TGB, then ours commits one): no sleeps, no timing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from functools import partial

import msgspec
import pytest
from checks import assert_exactly_once

import batchweave as bw
from batchweave import keys, log, logrules
from batchweave import producer as producer_module
from batchweave.commit.policies import Manual, RecentCommitters, VersionsBetweenLooks
from batchweave.errors import ObjectExistsError, ProducerFencedError, TransientStoreError
from batchweave.journal import Journal
from batchweave.journal.objects import LogObjects
from batchweave.log import Layout, LogState, TGBDescriptor
from batchweave.segment import SEGMENT_VERSIONS, decode_segment, segment_key
from batchweave.store import Store, open_store
from batchweave.testing.interleave import AmbiguousOnceStore

NO_SNAPSHOTS = 10**6  # snapshot_every: the counted attempts write none (see the last test for one)


def _tgb(pid: str, offset: int, epoch: int) -> TGBDescriptor:
    return TGBDescriptor(
        producer=pid,
        epoch=epoch,
        source_offset=offset,
        dp=1,
        cp=1,
        kind="bytes",
        objects=[keys.data_key(pid, epoch, offset, "ab", 0)],
        slices=[(0, 0, 4, 0)],
        nbytes=4,
    )


class Others:
    """``count`` producers that each commit one TGB per round, through one journal that
    reads every version (as group commit and collectors still do)."""

    def __init__(self, url: str, count: int, *, old_format: bool = False, snapshot_every: int = NO_SNAPSHOTS) -> None:
        self.journal = Journal(open_store(url), snapshot_every)
        self.state = self.journal.load_state()
        self.old_format = old_format
        self.pids = [f"other{i:04d}" for i in range(count)]
        self.offsets = dict.fromkeys(self.pids, 0)
        for pid in self.pids:
            self._commit(lambda s, pid=pid: logrules.build_claim(s, pid, uuid.uuid4().hex, time.time(), Layout(1, 1)))

    def round(self) -> None:
        for pid in self.pids:
            self.commit_one(pid)

    def commit_one(self, pid: str) -> None:
        self._commit(lambda s: self._one_tgb(s, pid))
        self.offsets[pid] += 1

    def _one_tgb(self, state: LogState, pid: str) -> log.LogVersion:
        me = state.producers[pid]
        return logrules.build_commit(state, pid, me, [_tgb(pid, self.offsets[pid], me.epoch)], time.time())

    def _commit(self, build) -> None:
        if self.old_format:  # a writer older than the cumulative fields: it writes neither
            build = _without_new_fields(build)
        done = self.journal.commit(self.state, build)
        assert done.outcome == "committed"
        self.state = done.state


def _without_new_fields(build):
    def old(state: LogState) -> log.LogVersion:
        return msgspec.structs.replace(build(state), bytes=None, changed_at=None)

    return old


def _producer(url: str, pid: str = "me") -> bw.Producer:
    return bw.Producer(url, pid, dp=1, commit_policy=Manual(), background_commit=False, snapshot_every=NO_SNAPSHOTS)


def _one_commit(producer: bw.Producer, payload: bytes = b"data") -> tuple[int, int]:
    """Append one TGB and commit it (one attempt: nobody races it): the requests the
    producer's journal made and the log bytes it read."""
    requests, read = producer.log_requests, producer.log_bytes_read
    attempts = producer.metrics()["attempts"]
    producer.append([payload])
    producer.flush()
    assert producer.metrics()["attempts"] == attempts + 1
    return producer.log_requests - requests, producer.log_bytes_read - read


def _cost_per_commit(others: int, url: str = "") -> list[tuple[int, int]]:
    url = url or f"memory://commit-cost/{uuid.uuid4().hex}"
    producer = _producer(url)
    try:
        pool = Others(url, others)
        pool.round()
        _one_commit(producer)  # reads the claims: each one changes what a commit needs
        costs = []
        for _ in range(3):
            pool.round()
            costs.append(_one_commit(producer))
        return costs
    finally:
        producer.close()


def test_a_commit_costs_the_same_with_8_and_128_producers_committing():
    few, many = _cost_per_commit(8), _cost_per_commit(128)
    # A LIST of the keys after its view, a GET of the head, the put, a GET of its anchor.
    assert [requests for requests, _ in few] == [requests for requests, _ in many] == [4, 4, 4]
    # The bytes of one version: the head, another producer's one TGB (a few digits longer
    # at 128 producers: its version number, steps and bytes).
    head_bytes = {read for _, read in few + many}
    assert max(head_bytes) - min(head_bytes) <= 16, (few, many)
    assert max(head_bytes) < 1024


def test_a_commit_costs_the_same_whatever_the_producers_on_every_store(store_backend_url):
    """On each store: the same four requests per attempt with 2 and with 12 others; on
    Azure, whose listing cannot start at a key, every version is read as before."""
    few = _cost_per_commit(2, f"{store_backend_url}/few")
    many = _cost_per_commit(12, f"{store_backend_url}/many")
    if open_store(store_backend_url).lists_from_a_key:
        assert [requests for requests, _ in few] == [requests for requests, _ in many] == [4, 4, 4]
    else:
        # Each other producer's version, the miss after them, the put, the anchor.
        assert [requests for requests, _ in many] == [12 + 3] * 3
        assert [requests for requests, _ in few] == [2 + 3] * 3


def test_a_zombie_is_fenced_after_jumping():
    """A restart's claim between two commits of the old incarnation: the head (another
    producer's commit, after the claim) says the log changed since, so the old incarnation
    reads every version, meets the claim and stops."""
    url = f"memory://commit-cost/{uuid.uuid4().hex}"
    zombie = _producer(url)
    try:
        pool = Others(url, 8)
        pool.round()
        _one_commit(zombie)
        pool.round()
        _one_commit(zombie)  # jumped to the head: the state it holds skipped versions
        assert zombie._shared.state.skipped_through > 0
        restarted = _producer(url)  # claims the next epoch of "me": the zombie is fenced
        try:
            pool.round()  # the head is no claim: only its changed_at tells
            zombie.append([b"late"])
            with pytest.raises(ProducerFencedError, match="fenced by a newer incarnation"):
                zombie.flush()
        finally:
            restarted.close()
    finally:
        zombie.close(flush=False)
    assert_exactly_once(url, {"me": 2, **pool.offsets})


def _about_to_lose_a_put(store_type):
    """A journal of producer "me" on a ``store_type`` store, with 4 other producers
    committing, claimed and caught up (proven); and its commit of TGB 0, rebased on the
    state it is given. The setup of every test whose own put's outcome goes astray."""
    url = f"memory://commit-cost/{uuid.uuid4().hex}"
    pool = Others(url, 4)
    store = store_type(url)
    journal = Journal(store, NO_SNAPSHOTS, heads_only=True)
    state = journal.load_state()
    done = journal.commit(state, lambda s: logrules.build_claim(s, "me", "inc", time.time(), Layout(1, 1)))
    state, me = done.state, done.state.producers["me"]
    pool.round()
    state = journal.commit(state, lambda s: None).state  # caught up, proven

    def commit(newest: LogState) -> log.LogVersion | None:
        remaining = logrules.pending_after_rebase(newest, "me", me, [_tgb("me", 0, me.epoch)])
        return logrules.build_commit(newest, "me", me, remaining, time.time()) if remaining else None

    return url, pool, store, journal, state, commit


def test_an_ambiguous_put_that_landed_is_not_committed_twice():
    """Our put's outcome is lost (it landed, the store said timeout), others commit after
    it, and the retry jumps to the head: it reads our version first, finds its bytes, and
    commits nothing again (I3)."""
    url, pool, store, journal, state, commit = _about_to_lose_a_put(AmbiguousOnceStore)

    store.armed = True
    with pytest.raises(TransientStoreError):
        journal.commit(state, commit, jump=True)
    assert store.fired == keys.version_key(state.version + 1)
    pool.round()
    pool.round()
    requests = journal.requests
    done = journal.commit(state, commit, jump=True)  # from the state before the lost put, as a producer retries
    assert done.outcome == "nothing"
    assert done.state.producers["me"].offset == 1
    # The LIST, the head, our own version, the anchor: not the 8 versions between.
    assert journal.requests - requests == 4
    assert_exactly_once(url, {"me": 1, **pool.offsets})


def test_a_log_older_than_the_fields_is_read_version_by_version():
    """Versions without ``changed_at`` or ``bytes`` (older writers): the head cannot tell
    the state, so every version is read, as before; nothing is lost or repeated."""
    url = f"memory://commit-cost/{uuid.uuid4().hex}"
    producer = _producer(url)
    try:
        pool = Others(url, 8, old_format=True)
        for _ in range(3):
            pool.round()
            requests, _ = _one_commit(producer)
            assert requests >= 8 + 2  # every version of the round, the miss after them, the put
            assert not producer._shared.state.skipped_through
        pool.old_format = False  # the writers upgraded: their versions carry the fields again
        pool.round()
        _one_commit(producer)
        pool.round()
        assert _one_commit(producer)[0] == 4
    finally:
        producer.close()
    assert_exactly_once(url, {"me": 5, **pool.offsets})


def test_a_snapshot_is_never_written_from_a_jumped_state():
    """The committer of a snapshot's version, its state behind on other producers, writes
    the snapshot of the exact state: the previous snapshot and the versions since, proven
    by that snapshot's digest. It goes on from that exact state."""
    url = f"memory://commit-cost/{uuid.uuid4().hex}"
    every = 20
    producer = bw.Producer(url, "me", dp=1, commit_policy=Manual(), background_commit=False, snapshot_every=every)
    try:
        pool = Others(url, 8, snapshot_every=every)  # versions 2-9: the pool's claims
        pool.round()  # 10-17
        _one_commit(producer)  # 18: read every version (the claims)
        pool.round()  # 19-26, and the pool writes the snapshot of 20
        _one_commit(producer)  # 27: jumped
        assert producer._shared.state.skipped_through == 25  # 19-25 skipped, the head (26) read
        while pool.state.version < 2 * every - 1:
            pool.commit_one(pool.pids[0])
        _one_commit(producer)  # 40, a snapshot's version, from a state that skipped 28-38
        assert producer._shared.state.version == 2 * every
        assert producer._shared.state.skipped_through == 0  # exact again
    finally:
        producer.close()
    key = keys.snapshot_key(2 * every)
    written = log.decode_snapshot(open_store(url).get(key), key)
    exact = _replayed(url, 2 * every)
    assert written == msgspec.structs.replace(exact, digest=written.digest)
    assert written.digest == exact.digest != ""


def _replayed(url: str, through: int) -> LogState:
    journal = Journal(open_store(url))
    state = LogState()
    for version in range(1, through + 1):
        read = journal.read_version_data(version)
        assert read is not None
        state = logrules.apply_version(state, read.delta, keys.version_key(version), log.digest(read.data))
    return state


def test_a_jumped_committer_of_a_segments_last_version_still_writes_the_segment():
    """The versions of the segment a jump skipped are read after the commit, proven by a
    version held from before them, and the segment is written as a full reader writes it."""
    url = f"memory://commit-cost/{uuid.uuid4().hex}"
    producer = _producer(url)
    try:
        pool = Others(url, 8)  # versions 2-9: the pool's claims
        pool.round()  # 10-17
        _one_commit(producer)  # 18: read every version (the claims)
        pool.round()  # 19-26
        _one_commit(producer)  # 27: jumped over 19-25
        while pool.state.version < SEGMENT_VERSIONS - 1:
            pool.commit_one(pool.pids[0])
        requests, _ = _one_commit(producer)  # 32, the segment's last, jumped over 28-30
        assert producer._shared.state.version == SEGMENT_VERSIONS
        # The jump's four, then the ten skipped versions and the re-read of version 18.
        assert requests == 4 + 10 + 1
    finally:
        producer.close()
    store = open_store(url)
    written = decode_segment(store.get(segment_key(SEGMENT_VERSIONS)), SEGMENT_VERSIONS)
    assert [bytes(v.data) for v in written] == [
        bytes(store.get(keys.version_key(v))) for v in range(1, SEGMENT_VERSIONS + 1)
    ]


def test_the_versions_between_two_looks_count_the_producers_contending():
    between = VersionsBetweenLooks(alpha=0.5)
    assert between.count() == 1  # nothing seen yet: this producer alone
    between.observe(8)
    assert between.count() == 9
    between.observe(0)
    assert between.count() == 5  # half way down: the pool shrank, or a quiet moment
    between.observe(-3)  # a reload that went back counts as nothing landed
    assert between.count() == 3
    with pytest.raises(bw.ConfigError):
        VersionsBetweenLooks(alpha=0)


def test_a_jumping_producer_still_counts_the_producers_committing(monkeypatch):
    """It reads one head per commit, so it sees one other producer commit each time; the
    versions between its looks tell it how many there are (DAC's N, producers_active)."""
    # Committers count only when noticed just now: what a jump shows of them is the head's.
    monkeypatch.setattr(producer_module, "RecentCommitters", partial(RecentCommitters, min_window_s=0.0))
    url = f"memory://commit-cost/{uuid.uuid4().hex}"
    producer = _producer(url)
    try:
        pool = Others(url, 8)
        for _ in range(4):
            pool.round()
            _one_commit(producer)
        assert producer._shared.state.skipped_through > 0
        assert producer.metrics()["producers_active"] >= 9
    finally:
        producer.close()


@pytest.mark.parametrize("versions", [1, 2, 3, 7, 64, 129])
def test_the_head_after_a_version_is_found_by_the_store_or_by_probes(versions, fast_url):
    """A listing (memory) or stats of names (a local directory): the same answer, one
    request counted either way."""
    store = open_store(fast_url)
    for version in range(1, versions + 1):
        store.put(keys.version_key(version), b"{}")
    store.put(keys.snapshot_key(versions), b"{}")  # under the log's prefix, never a version
    objects = LogObjects(store)
    found = [objects.newest_version_after(after) for after in (0, 1, versions - 1, versions, versions + 5)]
    assert found == [versions, versions if versions > 1 else None, versions, None, None]
    assert objects.requests == 5


class FailsTheProofAfterAPut(Store):
    """A real ``Store`` that, once ``armed``, lets the next log-version put land and fails
    the GET right after it (the anchor's re-read that proves the commit): the commit raises
    after its version landed, which the writer was told."""

    armed = False
    landed: str | None = None
    failed = False

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        super().put_if_absent(key, data)
        if self.armed and self.landed is None and key.startswith(keys.LOG_PREFIX + "0"):
            self.landed = key

    def get(self, key: str) -> memoryview:
        self._fail_once(key)
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        self._fail_once(key)  # the proof reads the anchor's head
        return super().get_range(key, start, length)

    def _fail_once(self, key: str) -> None:
        if self.landed is not None and not self.failed:
            self.failed = True
            raise TransientStoreError(key, "simulated failure of the proof's read")


def test_a_put_that_landed_before_its_proof_failed_is_not_committed_twice():
    """Regression (a duplicate found by tests/test_latency.py's chaos run): our put landed
    and said so, then the read that proves it failed, so the commit raised. The retry from
    the state before it jumps over our version; it must still read it as ours (I3)."""
    url, pool, store, journal, state, commit = _about_to_lose_a_put(FailsTheProofAfterAPut)

    store.armed = True
    with pytest.raises(TransientStoreError, match="proof's read"):
        journal.commit(state, commit, jump=True)
    assert store.landed == keys.version_key(state.version + 1)
    pool.round()
    pool.round()
    done = journal.commit(state, commit, jump=True)
    assert done.outcome == "nothing"
    assert done.state.producers["me"].offset == 1
    assert_exactly_once(url, {"me": 1, **pool.offsets})


class LandsThenTimesOut(Store):
    """A real ``Store`` whose next log-version put, once ``armed``, is applied and then
    answered by a timeout, so the store's own retry of it finds the key taken (by that
    first attempt)."""

    armed = False
    fired = False

    def _perform(self, request, nbytes, op):
        result = op()
        if self.armed and not self.fired and request == "put":
            self.fired = True
            raise TimeoutError("request timed out after the write was applied")
        return result


def test_a_create_only_put_retried_after_a_lost_answer_says_the_key_may_be_its_own(fast_url):
    store = LandsThenTimesOut(f"{fast_url}/retried", storage_options={"retry_deadline_s": 30})
    store.armed = True
    with pytest.raises(ObjectExistsError) as retried:
        store.put_if_absent("_log/x.json", b"ours")
    assert store.fired and retried.value.after_retry
    assert bytes(store.get("_log/x.json")) == b"ours"
    with pytest.raises(ObjectExistsError) as plain:
        store.put_if_absent("_log/x.json", b"another writer's")
    assert not plain.value.after_retry


def test_a_put_the_store_retried_into_its_own_landed_version_is_not_committed_twice():
    """Regression (the same chaos run, after the fix above): our put lands, its answer is
    lost, the store retries it and finds the key taken, by our own first attempt. The
    commit sees a lost race; others commit after it; the retry jumps to the head and must
    read that version as ours (I3)."""
    url, pool, store, journal, state, commit = _about_to_lose_a_put(LandsThenTimesOut)

    store.armed = True
    lost = journal.commit(state, commit, max_attempts=1, jump=True)
    assert store.fired and lost.outcome == "conflict"
    pool.round()
    pool.round()
    done = journal.commit(lost.state, commit, jump=True)
    assert done.outcome == "nothing"
    assert done.state.producers["me"].offset == 1
    assert_exactly_once(url, {"me": 1, **pool.offsets})


def test_the_versions_between_two_looks_never_count_more_producers_than_the_log_records():
    """Regression (a fresh-clone run of `bench pool-shrink --quick`: 3 producers counted of
    2): the other producer committed several versions while this one waited out its gap.
    Versions between looks count producers only up to the ids the log records."""
    import threading

    from batchweave.commit.contention import Contention
    from batchweave.commit.shared import SharedState
    from batchweave.log import ProducerState

    producers = {pid: ProducerState(epoch=1, incarnation=pid, offset=0) for pid in ("me", "other")}
    state = LogState(version=9, producers=producers)
    shared = SharedState("me", threading.Condition(), threading.Event(), state, producers["me"])
    for _ in range(20):
        shared.between_looks.observe(4)  # four versions of the other producer every look
    assert shared.between_looks.count() == 5
    contention = Contention(shared, Manual(), RecentCommitters())
    assert contention.active() == contention.seen() == 2


def test_a_commit_after_a_fresh_look_puts_without_probing_again(fast_url):
    """``probed``: the caller has just caught up, so the first attempt is the put and the
    proof's re-read of the anchor, one request fewer on the head key; a version that
    landed since the look costs that attempt a conflict, never a wrong version."""
    store = open_store(fast_url)
    journal = Journal(store)
    state = journal.commit(LogState(), lambda s: logrules.build_claim(s, "me", "inc", time.time(), Layout(1, 1))).state
    me = state.producers["me"]

    def commit_offset(offset: int) -> Callable[[LogState], log.LogVersion | None]:
        def build(newest: LogState) -> log.LogVersion | None:
            remaining = logrules.pending_after_rebase(newest, "me", me, [_tgb("me", offset, me.epoch)])
            return logrules.build_commit(newest, "me", me, remaining, time.time()) if remaining else None

        return build

    state, _ = journal.catch_up(state)
    before = journal.requests
    state = journal.commit(state, commit_offset(0), probed=True).state
    assert journal.requests - before == 2  # the put, the anchor's re-read
    before = journal.requests
    state = journal.commit(state, commit_offset(1)).state
    assert journal.requests - before == 3  # the probe too

    rival = Journal(open_store(fast_url))
    rival_state = rival.load_state()
    rival.commit(rival_state, lambda s: logrules.build_claim(s, "rival", "inc-r", time.time(), Layout(1, 1)))
    done = journal.commit(state, commit_offset(2), probed=True)  # stale: the rival's claim landed since
    assert done.outcome == "committed" and done.conflicts == 1
    assert done.state.producers["me"].offset == 3 and "rival" in done.state.producers
