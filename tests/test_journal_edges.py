"""The journal's edges that the scenario tests pass over: what a commit with nothing to do
costs, what ``catch_up`` counts, which of its puts an overtaken writer deletes, what it
logs, and how a follower's proof names what it found. Each was a survivor of ``make
mutation``: a one-point change no other fast test noticed."""

from __future__ import annotations

import logging
import random
import re
import uuid

import pytest
from checks import RecordingStore
from test_proof_rules import grow
from test_proven_views import head, overtake

import batchweave as bw
from batchweave import keys, log, logrules
from batchweave.errors import StoreError
from batchweave.journal import Journal, proof
from batchweave.log import LogState
from batchweave.reading import follower as follower_module
from batchweave.reading.follower import ANCHOR_SPREAD, ProvenLog, log_reader
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import LogReadAhead
from batchweave.store import open_store
from batchweave.testing.interleave import Background, PausingStore


@pytest.fixture
def url(fast_url) -> str:
    return fast_url


def test_a_commit_with_nothing_to_do_on_a_proven_view_costs_one_probe():
    url = f"memory://journal-edges/{uuid.uuid4().hex}"  # a store whose every read is a request
    grow(url, 2)
    store = RecordingStore(url)
    writer = Journal(store, heads_only=True)
    state = writer.load_state()
    store.calls.clear()
    done = writer.commit(state, lambda newest: None)
    assert (done.outcome, done.state, done.conflicts) == ("nothing", state, 0)
    assert store.calls == [("get", keys.version_key(state.version + 1))]  # nothing read: nothing to prove
    grow(url, 0)  # another writer's claim: one version to read, then prove
    store.calls.clear()
    done = writer.commit(state, lambda newest: None)
    assert done.outcome == "nothing" and done.state.version == state.version + 1
    assert store.calls == [
        ("get", keys.version_key(state.version + 1)),
        ("get", keys.version_key(state.version + 2)),
        ("get", keys.version_key(state.version)),  # the anchor, once: the view is proven, and that is all
    ]


def test_catch_up_counts_the_versions_it_read_and_one_for_a_reload(url):
    grow(url, 2)
    store = open_store(url)
    writer = Journal(store, heads_only=True)
    state = writer.load_state()
    assert writer.catch_up(state) == (state, 0)
    grow(url, 2)  # a claim and two commits
    newer, read = writer.catch_up(state)
    assert read == 3 and newer.version == state.version + 3
    overtake(url, newer.version)  # the anchor is gone
    # A put whose answer was lost is unproven too: nothing new is read, the check fails, and
    # the reload counts as one version read (the caller's state does not continue).
    writer._proof.unverified.add(newer.version + 1)
    reloaded, read = writer.catch_up(newer)
    assert read == 1 and reloaded == head(url)


def test_an_overtaken_writer_deletes_its_puts_below_what_gc_kept_and_only_those(url, caplog):
    grow(url, 3)
    overtake(url, 3)
    store = open_store(url)
    kept = head(url).reclaimed.versions
    stale = log.encode(logrules.next_version(head(url), 1.0))
    store.put(keys.version_key(kept - 1), stale)  # our put into a freed key
    recording = RecordingStore(url)
    writer = Journal(recording, heads_only=True)
    writer.load_state()
    writer._proof.unverified.update({kept - 1, kept})  # we may have put both (a put at `kept` is live)
    writer._proof.anchor = (kept - 5, log.digest(b"gone"))
    recording.calls.clear()
    with caplog.at_level(logging.INFO, logger="batchweave.journal"):
        assert writer._recover_from_stale_view() == head(url)
    assert ("list", keys.SNAPSHOT_PREFIX) in recording.calls  # the hint may be as stale as the view: listed
    assert store.size(keys.version_key(kept - 1)) is None and store.size(keys.version_key(kept)) is not None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "garbage collection overtook this writer's view of the log; reloading")
    ]


def test_a_writer_that_opened_an_empty_log_says_so_at_info_when_it_reloads(url, caplog):
    writer = Journal(open_store(url), heads_only=True)
    assert writer.load_state().version == 0 and writer.anchor_version == 0
    with caplog.at_level(logging.INFO, logger="batchweave.journal"):
        writer._recover_from_stale_view()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "the log grew its first snapshot before this writer's first commit; reloading")
    ]


def test_a_journal_caught_up_from_nothing_loads_without_blaming_gc(url, caplog):
    # Regression: every ingestion benchmark warned "garbage collection overtook" once per
    # run, from following a log (no collector running) with a journal that never loaded.
    grow(url, 3)
    with caplog.at_level(logging.INFO, logger="batchweave.journal"):
        state, read = Journal(open_store(url), heads_only=True).catch_up(LogState())
    assert state == head(url) and read >= 1
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "this journal had not loaded the log before reading it; loading")
    ]


def test_a_writer_that_may_not_delete_leaves_its_stale_put_to_gc_and_says_which(url, caplog, monkeypatch):
    writer = Journal(open_store(url), heads_only=True)

    def denied(key):
        raise StoreError(key, "delete denied")

    monkeypatch.setattr(writer.store, "delete_if_allowed", denied)
    with caplog.at_level(logging.WARNING, logger="batchweave.journal"):
        writer._delete_stale_put(keys.version_key(4))
    assert caplog.records[0].getMessage() == (
        f"left a version put into the reclaimed region for garbage collection: {keys.version_key(4)}: delete denied"
    )


def test_a_follower_anchored_below_gc_hears_data_reclaimed_naming_the_namespace(url):
    """The anchor (here version 1), not the lowest version read, decides whether GC overtook
    the follower: reads from above what GC kept, on an anchor it deleted, are reclaimed."""
    grow(url, 3)
    overtake(url, 3)
    kept = head(url).reclaimed
    journal = Journal(open_store(url), read_only=True)
    journal.anchor_on(1, log.digest(b"version 1 as read"))
    follower = ProvenLog(journal, LogReadAhead(journal, kept.versions + 2, 1), HeadPolling(1), lambda: 7, url)
    with pytest.raises(bw.DataReclaimedError, match=f"^{url}: step 7 was reclaimed") as raised:
        follower.prove(kept.versions + 2, None)
    assert raised.value.oldest == kept.steps


def test_a_follower_of_an_empty_namespace_pauses_rather_than_calling_it_damage(url):
    journal = Journal(open_store(url), read_only=True)
    reader = LogReadAhead(journal, 1, 1)
    try:
        item = next(iter(ProvenLog(journal, reader, HeadPolling(1), lambda: 0, url)))
    finally:
        reader.close()
    assert isinstance(item, float) and item > 0


def test_a_follower_at_the_head_of_a_large_job_spreads_its_anchors_and_passes_on_its_settings(url, monkeypatch):
    made = {}

    class Spy:
        def __init__(self, journal, first, depth, *, stop=None, copies=0):
            made.update(journal=journal, first=first, depth=depth, stop=stop, copies=copies)

    monkeypatch.setattr(follower_module, "LogReadAhead", Spy)
    journal, stop = Journal(open_store(url), read_only=True), follower_module.threading.Event()
    log_reader(journal, 5, 7, HeadPolling(1), stop)
    assert made == {"journal": journal, "first": 5, "depth": 7, "stop": stop, "copies": 0}
    assert journal._proof.spread == 1  # a small job: anchored on the newest version read
    log_reader(journal, 5, 7, HeadPolling(10_000, copies=3), stop)
    assert made["copies"] == 3 and journal._proof.spread == ANCHOR_SPREAD


# -- the log's rules ----------------------------------------------------------------------


def test_a_first_claim_sets_the_layout_before_any_tgb_is_committed(url):
    """I9: a namespace's layout is fixed by its first claim; a producer of another layout is
    refused before either commits a TGB, and the refusal says what to do."""
    with bw.Producer(url, "a", dp=2, commit_policy=bw.Manual()):
        assert head(url).layout is not None and (head(url).layout.dp, head(url).layout.cp) == (2, 1)
        with pytest.raises(bw.LayoutError, match="use the namespace's dp and cp, or a new namespace$"):
            bw.Producer(url, "b", dp=4, commit_policy=bw.Manual())
    with bw.Producer(url, "c", dp=2, commit_policy=bw.Manual()):  # the same layout: its claim sets nothing
        pass
    claims = [v for v in Journal(open_store(url)).versions_after(0) if v.producers]
    assert [v.layout is not None for v in claims] == [True, False]


def test_a_claim_built_without_a_ticket_sets_the_layout_only_of_a_namespace_without_one():
    """``build_claim`` (a claim whose ticket was not folded) records the layout when it is
    the namespace's first, and only then (I9: set once)."""
    first = logrules.build_claim(log.LogState(), "p", "inc-1", 1.0, log.Layout(2, 1))
    assert first.layout == log.Layout(2, 1) and first.producers["p"].epoch == 1
    state = logrules.apply_version(log.LogState(), first, keys.version_key(1))
    again = logrules.build_claim(state, "q", "inc-2", 2.0, log.Layout(2, 1))
    assert again.layout is None and again.producers["q"].incarnation == "inc-2"
    assert logrules.build_claim(log.LogState(), "p", "inc-3", 3.0).layout is None  # no layout given: none set


def test_a_forked_producer_is_named_with_where_its_offsets_should_continue():
    seen = {"p": (2, 5)}
    forked = log.LogVersion(
        format=log.LOG_FORMAT, version=9, first_step=4, tgbs=[_tgb("p", 3, epoch=3)], producers={}, end_of_stream=False
    )
    forked_message = (
        r"TGB p@3 \(epoch 3\) does not continue that producer's offsets at 5 \(epoch 2\): the log was forked; "
        r"does the store honour conditional puts\?$"
    )
    with pytest.raises(bw.CorruptDataError, match=forked_message) as raised:
        logrules.check_continuity(seen, forked, keys.version_key(9))
    assert raised.value.key == keys.version_key(9)
    assert seen == {"p": (2, 5)}


def _tgb(producer: str, offset: int, epoch: int) -> log.TGBDescriptor:
    return log.TGBDescriptor(
        producer=producer,
        epoch=epoch,
        source_offset=offset,
        dp=1,
        cp=1,
        kind="tensors",
        objects=[],
        slices=[],
        nbytes=0,
    )


# -- reading through head copies ------------------------------------------------------------


def test_a_head_copy_read_is_the_versions_own_read_for_the_proof(monkeypatch):
    """A version read through a copy counts as read (version 1's bytes for a start's proof);
    a copy that cannot tell sends the read to the version's own key."""
    monkeypatch.setenv("BATCHWEAVE_HEAD_COPIES", "3")
    url = f"memory://journal-edges/{uuid.uuid4().hex}"
    grow(url, 12)  # versions 1-13, a snapshot at 10, three copies of each
    store = RecordingStore(url)
    start = Journal(store, read_only=True)
    first = start.read_head_copy(1, 2)
    assert first is not None and bytes(first.data) == bytes(store.get(keys.version_key(1)))
    store.calls.clear()
    assert start.prove_reads(1, first)
    assert [op for op, _ in store.calls] == ["get", "get"]  # the namespace's id and version 1: no listing
    grow(url, 60)  # the ring of 64 went round: version 6's slots hold version 70
    again = start.read_head_copy(6, 0)
    assert again is not None and again.delta.version == 6


def test_a_version_not_committed_yet_reads_as_none_and_a_committed_one_as_itself(url):
    grow(url, 2)  # versions 1-3
    journal = Journal(open_store(url), read_only=True)
    assert journal.read_version(4) is None and journal.read_version_data(4) is None
    assert journal.read_version(3).version == 3
    assert journal.read_version_data(3).delta == journal.read_version(3)


def test_version_1_read_by_its_own_key_proves_a_start_by_the_namespace_id():
    """A start from step 0 past the first snapshot: version 1's bytes, read by its own key,
    are kept for the proof, which needs the namespace's id and version 1 again, no listing
    and no state (P2)."""
    url = f"memory://journal-edges/{uuid.uuid4().hex}"
    grow(url, 12)  # versions 1-13, a snapshot at 10
    store = RecordingStore(url)
    start = Journal(store, read_only=True)
    first = start.read_version_data(1)
    assert first is not None
    store.calls.clear()
    assert start.prove_reads(1, first)
    assert [op for op, _ in store.calls] == ["get", "get"]


def test_a_spread_anchor_is_drawn_from_each_of_the_newest_proven_versions(url, monkeypatch):
    """A follower with a spread of 2 anchors each proof on one of the two newest versions it
    proved, drawn at random: over many proofs, on each of them (the keys share the GETs)."""
    monkeypatch.setattr(proof, "random", random.Random(7))
    grow(url, 20)  # versions 1-21
    journal = Journal(open_store(url), read_only=True)
    journal.spread_anchors(2)
    behind_newest = []
    for version in range(2, 22):
        assert journal.prove_reads(version, journal.read_version_data(version))
        behind_newest.append(version - journal.anchor_version)
    assert set(behind_newest[1:]) == {0, 1}  # (the first proof has one version to draw from)


def test_with_no_snapshot_a_proof_without_an_anchor_costs_one_listing(url):
    """No snapshot yet means no version was ever deleted: a reader's first proof, from any
    version, lists the snapshots and needs no state."""
    grow(url, 3)  # versions 1-4, no snapshot
    store = RecordingStore(url)
    journal = Journal(store, read_only=True)
    read = journal.read_version_data(2)
    store.calls.clear()
    assert journal.prove_reads(2, read)
    assert store.calls == [("list", keys.SNAPSHOT_PREFIX)]


def test_the_newest_snapshot_is_found_from_the_hint_without_a_listing(url):
    grow(url, 12)  # a snapshot at version 10
    store = RecordingStore(url)
    assert Journal(store, read_only=True).newest_snapshot_version() == 10
    assert store.calls and all(op == "get" for op, _ in store.calls)  # the hint, then the snapshot it names


def test_a_damaged_version_is_named_by_its_key(url):
    grow(url, 2)  # versions 1-3
    open_store(url).put(keys.version_key(4), b"not a log version")
    with pytest.raises(bw.CorruptDataError) as raised:
        Journal(open_store(url), read_only=True).read_version(4)
    assert raised.value.key == keys.version_key(4)


def test_a_readers_journal_refuses_to_commit_naming_the_namespace(url):
    grow(url, 1)
    with pytest.raises(bw.ConfigError) as raised:
        Journal(open_store(url), read_only=True).commit(None, lambda state: None)
    assert str(raised.value) == f"{url}: this journal only reads the log (a reader's); it cannot commit"


def test_a_load_that_collection_overtakes_loads_again_from_the_newer_snapshot(url):
    """The snapshot's version is freed while the load reads the tail after it: the load
    cannot prove what it read, and starts again from the newer snapshot."""
    grow(url, 12)  # a snapshot at version 10, versions 11-13 after it
    store = PausingStore(url)
    held = store.pause("get", re.escape(keys.version_key(10)))  # the load's proof of its anchor
    loading = Background(Journal(store, read_only=True).load_state)
    held.wait_reached()
    overtake(url, 10)  # twenty more versions, a checkpoint, a collection: version 10 freed
    held.release()
    assert loading.result() == head(url)


def test_a_journal_that_has_loaded_nothing_has_no_anchor_to_verify(url):
    grow(url, 2)
    assert Journal(open_store(url)).verify() is False
