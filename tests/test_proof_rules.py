"""Each rule of the proof of a view (``journal.proof``, invariants I8 and I10), and the fault
it exists for, forced by hand: a one-point change to any rule fails a test here.

- the anchor's bytes, not only its presence: the anchor's key re-created with other bytes;
- version 1 re-read at a start's proof: a start from step 0 whose later reads came from
  keys garbage collection freed after version 1 was read;
- the reclaim boundary: a view from the lowest version kept is proven, one from below not;
- a resume's order: the cursor's version is read *before* the state that proves it;
- "nothing to do" is proven too: a commit whose view came from a freed key;
- handed out only once proven: a follower, and a node's hub, give out no version before
  its proof has ended.

Issue 30 found these rules unguarded: the simulation and the scenario tests passed with
each of them broken. Each test says which change it catches.
"""

from __future__ import annotations

import re
import threading
import time

import msgspec
import pytest
from checks import RecordingStore
from test_node import CountingStore, fill, read_node
from test_proven_views import commit, head, overtake

import batchweave as bw
from batchweave import keys, log, logrules
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.log import LogState
from batchweave.mesh import Mesh
from batchweave.reading import follower as follower_module
from batchweave.reading import nodehub
from batchweave.reading.cursor import checked_cursor, parse_cursor
from batchweave.reading.follower import ProvenLog
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import LogReadAhead
from batchweave.store import Store, open_store
from batchweave.testing.interleave import Background, PausingStore


@pytest.fixture
def url(fast_url) -> str:
    return fast_url


def grow(url: str, versions: int) -> None:
    """A claim and ``versions`` commits of one TGB each."""
    with bw.Producer(url, "p", dp=1, commit_policy=Manual(), snapshot_every=10) as producer:
        commit(producer, versions)


def recreate(store: Store, version: int, genuine: bytes) -> None:
    """A stale writer's put into the key GC freed: ``version`` built again (another commit
    time), so it still follows its predecessor, with other bytes."""
    key = keys.version_key(version)
    assert store.size(key) is None, f"GC did not free {key}"
    delta = log.decode_version(genuine, key, version)
    store.put(key, log.encode(msgspec.structs.replace(delta, committed_at=delta.committed_at + 1.0)))


def put_after(store: Store, state: LogState, count: int) -> None:
    """``count`` valid empty versions after ``state``, put into keys GC freed (stale writers)."""
    for _ in range(count):
        delta = logrules.next_version(state, time.time())
        data = log.encode(delta)
        store.put(keys.version_key(delta.version), data)
        state = logrules.apply_version(state, delta, keys.version_key(delta.version), log.digest(data))


# -- the anchor: its bytes ---------------------------------------------------------------


def test_an_anchor_re_created_with_other_bytes_proves_nothing(url):
    """Catches ``Proof.verify`` reduced to "the anchor exists" (its digest unchecked)."""
    grow(url, 3)
    store = open_store(url)
    writer, reader = Journal(store), Journal(store, read_only=True)
    writer.load_state()
    reader.load_state()
    anchor = writer.anchor_version
    assert anchor is not None and writer.verify() and reader.anchor_version == anchor
    genuine = bytes(store.get(keys.version_key(anchor)))
    overtake(url, anchor)
    recreate(store, anchor, genuine)
    assert not writer.verify()
    assert not reader.prove_reads(anchor + 1)


# -- a start from version 1 --------------------------------------------------------------


def test_a_start_from_version_1_is_not_proven_by_version_1_alone(url):
    """Catches a start's proof that trusts version 1 for its namespace id without reading it
    again: GC freed the versions after it, and the next read came from a re-created key."""
    grow(url, 3)
    store = open_store(url)
    control = Journal(store, read_only=True)
    control.read_version_data(1)
    assert control.prove_reads(1, control.read_version_data(2))  # nothing collected: proven

    start = Journal(store, read_only=True)
    assert start.read_version_data(1) is not None  # a reader from step 0 reads version 1 first
    second = bytes(store.get(keys.version_key(2)))
    overtake(url, 2)
    recreate(store, 2, second)
    read = start.read_version_data(2)
    assert read is not None and bytes(read.data) != second
    assert not start.prove_reads(1, read)


# -- the reclaim boundary ----------------------------------------------------------------


def test_a_view_from_the_lowest_version_kept_is_proven_and_one_from_below_is_not(url):
    """Catches an off-by-one between ``reclaimed.versions`` (the lowest version kept) and the
    lowest version a reader read, in either direction, with and without a spread anchor."""
    grow(url, 3)
    overtake(url, 3)
    store = open_store(url)
    kept = head(url).reclaimed.versions
    assert store.size(keys.version_key(kept)) is not None and store.size(keys.version_key(kept - 1)) is None

    start = Journal(store, read_only=True)
    assert start.prove_reads(kept, start.read_version_data(kept))
    assert not Journal(store, read_only=True).prove_reads(kept - 1)

    gone = log.digest(b"a version GC deleted")
    passed = Journal(store, read_only=True)  # a spread anchor GC passed, reads from the lowest kept
    passed.spread_anchors(256)
    passed.anchor_on(kept - 1, gone)
    assert passed.prove_reads(kept, passed.read_version_data(kept))

    below = Journal(store, read_only=True)  # ... reads from below it
    below.spread_anchors(256)
    below.anchor_on(kept - 1, gone)
    assert not below.prove_reads(kept - 1)

    vanished = Journal(store, read_only=True)  # an anchor GC did not pass, yet not as it was: damage
    vanished.spread_anchors(256)
    vanished.anchor_on(kept, gone)
    assert not vanished.prove_reads(kept + 1)


# -- a resume's order --------------------------------------------------------------------


def test_a_resume_reads_its_cursors_version_before_the_state_that_proves_it(url):
    """Catches ``checked_cursor`` loading the state before it reads the cursor's version:
    GC frees that version between the two and a stale writer re-creates it; the state,
    loaded first, could not show the reclaim, and the reader would anchor on other bytes."""
    grow(url, 12)  # a snapshot at version 10: loading the state reads no version below it
    with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as reader:
        for _ in range(3):
            next(reader)
        saved = reader.state_dict()
    version = saved["version"]
    genuine = bytes(open_store(url).get(keys.version_key(version)))

    store = PausingStore(url)
    held = store.pause("get", re.escape(keys.version_key(version)))
    resuming = Background(checked_cursor, parse_cursor(saved, Mesh(dp=1)), Journal(store, read_only=True), url)
    held.wait_reached()
    try:
        overtake(url, version)
        recreate(open_store(url), version, genuine)
    finally:
        held.release()
    with pytest.raises(bw.DataReclaimedError):
        resuming.result()


# -- "nothing to do" -----------------------------------------------------------------------


def test_a_commit_proves_its_view_before_it_answers_nothing_to_do(url):
    """Catches ``Journal.commit`` answering "nothing" without proving its view: the version
    it read says the stream ended, but it was put into a key GC freed. Acting on it would
    lose the end of stream (here) or drop pending TGBs (a producer)."""
    grow(url, 3)
    store = open_store(url)
    writer = Journal(store, heads_only=True)
    state = writer.load_state()
    overtake(url, state.version)
    store.put(keys.version_key(state.version + 1), log.encode(logrules.build_end_of_stream(state, time.time())))
    built: list[LogState] = []

    def end_unless_ended(newest: LogState):
        built.append(newest)
        return None if newest.end_of_stream else logrules.build_end_of_stream(newest, time.time())

    done = writer.commit(state, end_unless_ended)
    assert built[0].end_of_stream  # it did read the re-created version first
    assert done.outcome == "committed" and head(url).end_of_stream


# -- handed out only once proven -----------------------------------------------------------


@pytest.mark.parametrize(
    ("batch_versions", "ready"),
    [(follower_module.PROOF_BATCH_VERSIONS, True), (2, True), (follower_module.PROOF_BATCH_VERSIONS, False)],
    ids=["at-a-miss", "full-batch", "beside-the-next-read"],
)
def test_a_follower_hands_out_no_version_before_its_proof_ends(url, monkeypatch, batch_versions, ready):
    """Catches ``ProvenLog`` (``early=False``: a node's follower) yielding a batch before its
    proof ends, on each of its paths: proven at a miss, a full batch, and a batch proven
    beside the next read (``ready`` fixes which: whether the next read looks finished). The
    versions read came from keys GC freed; the follower must raise before handing any out."""
    monkeypatch.setattr(follower_module, "PROOF_BATCH_VERSIONS", batch_versions)
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: ready)
    grow(url, 3)
    store = open_store(url)
    journal = Journal(store, read_only=True)
    state = journal.load_state()
    overtake(url, state.version)
    put_after(store, state, 3)

    reader = LogReadAhead(journal, state.version + 1, 4)
    handed: list[int] = []
    try:
        with pytest.raises(bw.DataReclaimedError):
            for item in ProvenLog(journal, reader, HeadPolling(1), lambda: 0, url):
                if isinstance(item, list):
                    handed += [read.delta.version for read in item]
    finally:
        reader.close()
    assert handed == []


def test_an_end_of_stream_read_from_a_freed_key_ends_no_reader(url):
    """Catches a reader that ends its stream on an end marker before the marker's proof has
    ended (found by the simulation: a lagging reader told the stream ended at step 16 of 82).
    GC overtakes a reader; a stale writer re-creates, in the key freed after the reader's
    position, a version that ends the stream. The reader must hear DataReclaimedError,
    never StopIteration, which says every step was delivered."""
    grow(url, 3)  # versions 1-4, steps 0-2
    with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as reader:
        delivered = [next(reader).step for _ in range(3)]
        stale = head(url)  # version 4, as a stale writer still holds it
        overtake(url, stale.version)  # twenty more versions, collected: version 5 freed
        end = logrules.build_end_of_stream(stale, time.time())
        open_store(url).put(keys.version_key(end.version), log.encode(end))
        with pytest.raises(bw.DataReclaimedError):
            next(reader)
    assert delivered == [0, 1, 2]


def test_a_nodes_hub_publishes_only_versions_whose_proof_has_ended(monkeypatch):
    """Catches a node's hub handing its ranks versions while their proof is still running
    (an early follower's batches, or a batch yielded before its proof)."""
    lock = threading.Lock()
    proven_through = [0]  # the newest version a hub follower's proof has ended for
    early: list[int] = []
    prove, publish = ProvenLog.prove, nodehub._Hub._publish

    def recording_prove(self, lowest, newest):
        prove(self, lowest, newest)
        if newest is not None and not self._early:  # a hub's follower (a rank's own runs early)
            with lock:
                proven_through[0] = max(proven_through[0], newest.delta.version)

    def checked_publish(self, generation, batch):
        with lock:
            early.extend(r.delta.version for r in batch if r.delta.version > proven_through[0])
        return publish(self, generation, batch)

    monkeypatch.setattr(ProvenLog, "prove", recording_prove)
    monkeypatch.setattr(nodehub._Hub, "_publish", checked_publish)
    store = CountingStore("memory://b/hub-publishes-proven")  # remote-like: ranks share a hub
    fill(store, 12, 2)
    seen = read_node(store, range(4), dp=2, tp=2, sharing=True)
    assert all(len(records) == 12 for records in seen.values())
    assert proven_through[0] > 0, "the hub's follower proved nothing: the test did not reach its point"
    assert early == []


# -- a resume's cursor, at its boundaries ----------------------------------------------------


def cursor_at(steps: int, version: int, dp: int = 1):
    return parse_cursor(
        {"format": "batchweave.cursor/2", "version": version, "position_numerator": steps,
         "position_denominator": 1, "step": steps, "dp": dp, "cp": 1},
        Mesh(dp=dp),
    )  # fmt: skip


def test_a_cursor_at_the_newest_version_or_before_any_step_resumes_as_saved(url):
    """Catches ``checked_cursor`` refusing a cursor at the log's newest version, or losing
    a field of a cursor saved before any step (version 0)."""
    grow(url, 3)  # a claim (version 1), then versions 2-4 with steps 0-2
    store = open_store(url)
    newest = head(url)
    at_head = checked_cursor(cursor_at(3, newest.version), Journal(store, read_only=True), url)
    assert (at_head.version, at_head.position, at_head.namespace) == (newest.version, 3, newest.namespace)
    assert at_head.digest == log.digest(store.get(keys.version_key(newest.version)))
    before_any = checked_cursor(cursor_at(0, 0), Journal(store, read_only=True), url)
    assert before_any == (0, 0, 0, newest.namespace, "")
    with pytest.raises(bw.ConfigError, match="consumed 1 TGBs at log version 0"):
        checked_cursor(cursor_at(1, 0), Journal(store, read_only=True), url)
    with pytest.raises(bw.ConfigError, match="log ends at version"):
        checked_cursor(cursor_at(3, newest.version + 1), Journal(store, read_only=True), url)


def test_a_cursor_below_what_gc_kept_is_refused_by_its_steps_or_its_version(url):
    """Catches the reclaim check of a resume reduced to one of its two conditions, and a
    message that does not name the namespace and the oldest step kept."""
    grow(url, 3)
    overtake(url, 3)
    store = open_store(url)
    state = head(url)
    kept = state.reclaimed
    genuine = store.get(keys.version_key(kept.versions))
    first = log.decode_version(genuine, keys.version_key(kept.versions), kept.versions).first_step
    with pytest.raises(bw.DataReclaimedError, match=re.escape(f"{url}: step 0 was reclaimed")) as raised:
        checked_cursor(cursor_at(0, kept.versions + 1), Journal(store, read_only=True), url)  # steps below
    assert raised.value.oldest == kept.steps
    with pytest.raises(bw.DataReclaimedError):  # a version below, its steps (as edited) above
        checked_cursor(cursor_at(max(first, kept.steps) + 1, kept.versions - 1), Journal(store, read_only=True), url)


def test_a_cursor_whose_version_vanished_with_no_reclaim_is_named_as_damage(url):
    """A cursor's version that is missing though the state, loaded after the read, shows no
    reclaim of it was not deleted by GC (which records a reclaim before deleting): damage,
    named by its key, never "reclaimed" (which sends people after a checkpoint they do not need)."""
    grow(url, 12)  # a snapshot at version 10: the state is loaded from it
    open_store(url).delete(keys.version_key(5))  # holds step 3
    with pytest.raises(bw.CorruptDataError, match=rf"{keys.version_key(5)}: the cursor's log version vanished"):
        checked_cursor(cursor_at(4, 5), Journal(open_store(url), read_only=True), url)


def test_a_cursor_whose_version_holds_other_steps_says_which(url):
    grow(url, 3)  # versions 2-4 hold steps 0, 1 and 2
    with pytest.raises(bw.ConfigError, match=r"log version 2 holds TGB 2, but it holds steps 0\.\.0: the state was "
                       r"edited or is from another namespace$"):  # fmt: skip
        checked_cursor(cursor_at(3, 2), Journal(open_store(url), read_only=True), url)


def test_a_cursor_from_before_any_step_reads_no_version(url):
    grow(url, 1)
    store = RecordingStore(url)
    checked_cursor(cursor_at(0, 0), Journal(store, read_only=True), url)
    assert ("get", keys.version_key(0)) not in store.calls  # the state alone: no version 0 to read
