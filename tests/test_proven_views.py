"""Issue 18, invariant I10: no actor acts on log content that nothing proves genuine.

Each test forces the interleaving that broke it on the code before I10 (``PausingStore``
holds a stale writer between its put into a key garbage collection freed and the check
that would have deleted it again), then shows that the actor reading that version
reloads or raises instead of acting on it.
"""

from __future__ import annotations

import re
import time

import pytest
from checks import RecordingStore
from worker import origin_of, tgb

import batchweave as bw
from batchweave import keys, log
from batchweave.commit.claims import CLAIM_PREFIX
from batchweave.commit.group import GroupCommit
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.reading import polling as polling_module
from batchweave.store import Store, open_store
from batchweave.testing.interleave import Background, PausingStore

VERSION_KEY = r"_log/\d{20}\.json"


@pytest.fixture
def url(fast_url) -> str:
    return fast_url


def versions_up_to(version: int) -> str:
    """A key pattern matching log versions 1..``version``: the anchor a held writer re-reads."""
    return "|".join(re.escape(keys.version_key(v)) for v in range(1, version + 1))


def head(url: str) -> log.LogState:
    return Journal(open_store(url)).load_state()


def commit(prod: bw.Producer, count: int) -> None:
    for _ in range(count):
        prod.append(tgb(prod.producer_id, prod.next_offset, prod.mesh.dp))
        prod.flush()


def checkpoint_at(url: str, steps: int, name: str) -> dict:
    with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as reader:
        while reader.state_dict()["step"] < steps:
            next(reader)
        reader.mark_checkpoint(name)
        return reader.state_dict()


def overtake(url: str, stale_version: int) -> dict:
    """Commit far past ``stale_version`` (20 versions: no segment yet, so readers probe
    single versions) and collect, so every version up to it is gone; returns the cursor of
    the live checkpoint."""
    with bw.Producer(url, "fast", dp=1, commit_policy=Manual(), snapshot_every=10) as fast:
        commit(fast, 20)
    cursor = checkpoint_at(url, head(url).steps - 2, "late")
    bw.collect_garbage(url, grace_s=0)
    assert open_store(url).size(keys.version_key(stale_version + 1)) is None, "GC did not free the stale view"
    return cursor


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def quiet() -> GroupCommit:
    """Group commit whose turns never come on their own: intents at once, commits at flush()."""
    return GroupCommit(interval_s=3600.0, intent_lead_s=3600.0)


def test_group_producer_never_adopts_a_fold_put_into_a_freed_key(url):
    """Scenario 1: two idle group-mode producers; GC frees the key after their view; the
    committer folds the other's intent into that key and is held before its check. The
    owner must not take that fold for a commit: its TGBs stay pending and land for real."""
    store = PausingStore(url)
    owner = bw.Producer(store, "owner", dp=1, commit_policy=quiet(), snapshot_every=10)
    committer = bw.Producer(store, "committer", dp=1, commit_policy=quiet(), snapshot_every=10)
    owner.append(tgb("owner", 0, 1))
    owner.flush()
    owner.append(tgb("owner", 1, 1))
    owner.append(tgb("owner", 2, 1))
    committer.append(tgb("committer", 0, 1))
    stale = head(url).version
    wait_for(lambda: committer.metrics()["log_version"] == stale, "the committer to see the owner's commit")
    cursor = overtake(url, stale)

    held = store.pause("get", versions_up_to(stale))  # the committer's check of its anchor
    folding = Background(committer.flush)
    held.wait_reached()
    fake = open_store(url).get(keys.version_key(stale + 1))
    assert b'"owner"' in bytes(fake), "the stale committer did not fold the owner's intent"

    owner.flush(timeout_s=30)  # reads the fold; must prove it before dropping anything
    assert owner.resume_offset == 3
    # The committer is still held (it might as well have been killed): what the owner
    # believes committed must be in the live log now, not in a key below the reclaim.
    assert head(url).producers["owner"].offset == 3
    held.release()
    folding.result()
    owner.close()
    committer.close()
    state = head(url)
    assert (state.producers["owner"].offset, state.producers["committer"].offset) == (3, 1)
    bw.end_stream(url)
    with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as reader:
        reader.load_state_dict(cursor)
        seen = [origin_of(batch.data) for batch in reader]
    assert ("owner", 1) in seen and ("owner", 2) in seen


def test_lagging_reader_never_delivers_a_version_put_into_a_freed_key(url):
    """Scenario 2: a reader no checkpoint protects lags behind GC; a stale writer puts the
    version after the reader's into the freed key and is held before its check. The reader
    must raise DataReclaimedError, never hand that TGB to training as the next step."""
    store = PausingStore(url)
    stale_writer = bw.Producer(store, "w", dp=1, commit_policy=Manual(), snapshot_every=10)
    commit(stale_writer, 1)  # w:0 is step 0; the writer's view ends here
    reader = bw.Consumer(url, dp=1, rank=0, timeout_s=5)
    assert origin_of(next(reader).data) == ("w", 0)
    stale = head(url).version
    overtake(url, stale)

    held = store.pause("get", versions_up_to(stale))
    stale_writer.append(tgb("w", 1, 1))
    committing = Background(stale_writer.flush)
    held.wait_reached()  # w:1 sits in the freed key after the reader's version
    try:
        with pytest.raises(bw.DataReclaimedError, match="reclaimed"):
            next(reader)
    finally:
        held.release()
        committing.result()
        reader.close()
        stale_writer.close()


def test_consumer_overtaken_at_the_head_raises_instead_of_waiting(url, monkeypatch):
    """Scenario 3: a reader waiting at the head while GC reclaims past it must say so
    (DataReclaimedError), not wait forever (timeout_s=None) as if no step had come."""
    monkeypatch.setattr(polling_module, "IDLE_PROOF_S", 0.2)
    with bw.Producer(url, "p", dp=1, commit_policy=Manual(), snapshot_every=10) as p:
        commit(p, 2)
    reader = bw.Consumer(url, dp=1, rank=0, max_poll_interval_s=0.05)
    assert [next(reader).step for _ in range(2)] == [0, 1]
    overtake(url, head(url).version)
    waiting = Background(next, reader)
    try:
        with pytest.raises(bw.DataReclaimedError):
            waiting.result(timeout_s=20)
    finally:
        reader.close()


def test_a_reader_proves_a_backlog_once_per_batch_not_per_step(url, monkeypatch):
    """The proof's cost: one request per batch of versions read without waiting (a segment
    of 32 here), nothing per step."""
    with bw.Producer(url, "p", dp=1, commit_policy=Manual(), snapshot_every=10) as p:
        commit(p, 100)  # versions 2..101: segments 32, 64 and 96, then single versions
    bw.end_stream(url)
    proofs = []
    prove_reads = Journal.prove_reads

    def counted(journal, lowest, newest=None):
        proofs.append(lowest)
        return prove_reads(journal, lowest, newest)

    monkeypatch.setattr(Journal, "prove_reads", counted)
    with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as reader:
        assert [batch.step for batch in reader] == list(range(100))
    assert 3 <= len(proofs) <= 3 + 7  # three segments, then the last versions one by one


class AmbiguousAboveStore(Store):
    """The first log-version put numbered above ``above`` is applied, then reported as a
    timeout: an ambiguous outcome in the live log, after a reload."""

    above = 10**9
    fired: str | None = None

    def put_if_absent(self, key, data):
        super().put_if_absent(key, data)
        if self.fired is None and re.fullmatch(VERSION_KEY, key) and int(key[5:25]) > self.above:
            self.fired = key
            raise bw.TransientStoreError(key, "simulated timeout after the write was applied")


def test_a_retry_from_a_state_older_than_the_anchor_reloads_instead_of_committing_below_it(url):
    """Found by the simulation: a stale writer's put into a freed key fails its check and
    it reloads (its anchor moves to the head); its next put, in the live log, times out
    after landing. The producer retries from the state it held before the reload, below
    the journal's anchor: the anchor cannot prove anything below it, so the retry must
    reload again, never 'commit' into the freed keys and keep committing there."""
    store = AmbiguousAboveStore(url)
    p = bw.Producer(store, "p", dp=1, commit_policy=Manual(), snapshot_every=10)
    commit(p, 1)
    stale = head(url).version
    overtake(url, stale)
    store.above = head(url).version  # the put after the reload, at the head, is the ambiguous one
    for offset in range(1, 4):
        p.append(tgb("p", offset, 1))
        p.flush(timeout_s=30)
    assert store.fired is not None
    p.close()
    assert head(url).producers["p"].offset == 4  # every flushed TGB is in the live log


def test_versions_read_before_a_miss_are_proven_and_delivered(url, monkeypatch):
    """A finished read the reader counted on (``ready()``) can be a miss: the versions read
    before it are proven and their steps handed out before the reader pauses, never left
    in an unproven batch (the consumer then waited at the head with steps in hand)."""
    from batchweave.reading.readahead import LogReadAhead

    with bw.Producer(url, "p", dp=1, commit_policy=Manual(), snapshot_every=10) as p:
        commit(p, 10)
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: True)  # every read looks finished
    with bw.Consumer(url, dp=1, rank=0, timeout_s=5) as reader:
        assert [next(reader).step for _ in range(10)] == list(range(10))


def test_a_producer_starts_on_a_fresh_namespace_in_nine_sequential_requests(url):
    """Every request of a producer's start is a round trip before its first append (40 ms
    on S3): the empty log is proven by one listing after version 1's miss, as a verify
    would prove it, not by reading version 1 and listing again; and a listing is not
    followed by a probe for a newer snapshot (it is as recent as the probe would be). The
    claim's ticket costs three (its put, one listing of the tickets, its delete): what a
    pool starting together saves is a version per producer raced over and over. The claim
    puts the version it built on the state just loaded without probing again (a claim
    that landed since would cost it a conflict), and a producer at epoch 1 lists no
    intents of older epochs (there are none). Where
    namespaces could nest (a directory, an object store), a namespace being created also
    lists its own prefix and, through stores of their own, each prefix above it
    (``journal.overlap``, I13)."""
    store = RecordingStore(url)
    bw.Producer(store, "p", dp=1).close(flush=False)
    v1, snapshots = keys.version_key(1), keys.SNAPSHOT_PREFIX
    ticket = [key for op, key in store.calls if op == "put" and key.startswith(CLAIM_PREFIX)]
    assert len(ticket) == 1, store.calls
    overlap = [("list", "")] if store.may_nest else []  # no namespace inside this one
    assert store.calls[: 9 + len(overlap)] == [
        ("get", keys.HINT_KEY),  # no hint: a fresh namespace
        ("list", snapshots),  # no snapshot
        ("get", v1),  # no version 1 ...
        ("list", snapshots),  # ... and still no snapshot after that miss: the empty log, proven
        *overlap,
        ("put", ticket[0]),  # the ticket
        ("list", CLAIM_PREFIX),  # nobody else's: this producer claims, with this listing
        ("put", v1),  # the claim, on the state just loaded
        ("list", snapshots),  # its check: still no snapshot, so nothing was ever deleted
        ("delete", ticket[0]),  # folded: dead
    ]
    assert not any(key.startswith(keys.INTENT_PREFIX) for _, key in store.calls)  # epoch 1: no older intents
