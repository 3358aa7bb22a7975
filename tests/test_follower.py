"""Each path of ``ProvenLog`` (``reading.follower``): what it hands out, in which batches,
and which versions each proof covers.

The rule every path keeps: a batch is handed out only with a proof from its first version
to its last (I10), and the proof moves the anchor to the batch's newest version. The tests
record each proof's ``(lowest, newest)`` and check them against the batches handed out;
``LogReadAhead.ready`` and the proof futures' ``done`` are fixed per test, so each path is
taken on purpose rather than by thread timing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from test_proof_rules import grow, put_after

import batchweave as bw
from batchweave import keys
from batchweave.journal import Journal
from batchweave.reading import follower as follower_module
from batchweave.reading.follower import FollowItem, ProvenLog, Unproven
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import LogReadAhead
from batchweave.store import open_store


@pytest.fixture
def url(fast_url) -> str:
    return fast_url


@pytest.fixture
def proofs(monkeypatch) -> list[tuple[int, int | None]]:
    """Every proof a follower runs, as ``(lowest, newest version or None)``."""
    recorded: list[tuple[int, int | None]] = []
    prove = ProvenLog.prove

    def recording(self, lowest, newest):
        recorded.append((lowest, None if newest is None else newest.delta.version))
        prove(self, lowest, newest)

    monkeypatch.setattr(ProvenLog, "prove", recording)
    return recorded


class NeverDoneEarly(Future):
    """A proof's future that looks unfinished whenever the follower peeks (``done``), so the
    follower reads on beside it; ``result`` still waits for the real proof."""

    def __init__(self, real: Future) -> None:
        super().__init__()
        self._real = real

    def done(self) -> bool:
        return False

    def result(self, timeout=None):
        return self._real.result(timeout)


def follow(url: str, first: int, **options) -> tuple[Journal, LogReadAhead, Iterator[FollowItem]]:
    """A follower from version ``first`` on, as its user iterates it (one iterator)."""
    journal = Journal(open_store(url), read_only=True)
    reader = LogReadAhead(journal, first, 4)
    return journal, reader, iter(ProvenLog(journal, reader, HeadPolling(1), lambda: 0, url, **options))


def until_the_head(follower: Iterator[FollowItem]) -> list:
    """The items up to and including the first pause at the head (a float above 0)."""
    items = []
    for item in follower:
        items.append(item)
        if isinstance(item, float) and item > 0:
            return items
    raise AssertionError("the follower ended")


def read_to_the_head(url: str, first: int = 2, **options) -> tuple[Journal, list]:
    """A follower's items from version ``first`` to its first pause at the head."""
    journal, reader, follower = follow(url, first, **options)
    try:
        return journal, until_the_head(follower)
    finally:
        reader.close()


def proven_batches(journal: Journal, items: list, proofs: list, versions: range) -> list[list[int]]:
    """The batches handed out, checked: ``versions`` in order, each batch proven from its
    first version to its last, the anchor moved to the newest."""
    batches = handed_out(items)
    assert list(itertools.chain(*batches)) == list(versions)
    assert proofs == covering(batches)
    assert journal.anchor_version == versions[-1]
    return batches


def handed_out(items: list) -> list[list[int]]:
    batches = [item.versions if isinstance(item, Unproven) else item for item in items if not isinstance(item, float)]
    return [[read.delta.version for read in batch] for batch in batches]


def covering(batches: list[list[int]]) -> list[tuple[int, int]]:
    return [(batch[0], batch[-1]) for batch in batches]


def test_batches_proven_beside_the_next_read_are_handed_out_with_no_pause(url, proofs, monkeypatch):
    """A follower behind the head (``early=False``, a node's) proves each version beside the
    next read: it hands out lists only, each with its own proof, and its only pauses
    before the head are 0 (no sleep while versions are there to read)."""
    grow(url, 5)  # versions 1-6
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: False)
    journal, items = read_to_the_head(url)
    proven_batches(journal, items, proofs, range(2, 7))
    assert not any(isinstance(item, Unproven) for item in items)
    assert all(item == 0.0 for item in items[:-1] if isinstance(item, float))


def test_a_full_batch_waits_for_the_proof_in_flight_and_no_batch_is_larger(url, proofs, monkeypatch):
    """While a proof is in flight the follower reads on, up to ``PROOF_BATCH_VERSIONS``;
    a full batch first waits for that proof (one at a time: each moves the anchor)."""
    monkeypatch.setattr(follower_module, "PROOF_BATCH_VERSIONS", 2)
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: True)
    beside = LogReadAhead.beside
    monkeypatch.setattr(LogReadAhead, "beside", lambda reader, *args: NeverDoneEarly(beside(reader, *args)))
    grow(url, 8)  # versions 1-9
    journal, items = read_to_the_head(url)
    assert [len(batch) for batch in proven_batches(journal, items, proofs, range(2, 10))] == [2, 2, 2, 2]


def test_versions_that_arrive_after_a_pause_are_read_and_proven(url, proofs, monkeypatch):
    """At a miss the batch read is proven and handed out, then the follower pauses; it
    reads on from there when versions arrive."""
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: True)
    grow(url, 3)  # versions 1-4
    journal, reader, follower = follow(url, 2)
    try:
        first = until_the_head(follower)
        put_after(journal.store, journal.load_state(), 2)  # versions 5 and 6
        second = until_the_head(follower)
    finally:
        reader.close()
    assert handed_out(first) == [[2, 3, 4]] and handed_out(second) == [[5, 6]]
    assert proofs[0] == (2, 4) and proofs[-1] == (5, 6)
    assert journal.anchor_version == 6


def test_an_early_follower_hands_out_each_batch_with_its_running_proof(url, proofs, monkeypatch):
    """``early=True`` (a rank's own pipeline): at a miss the batch is handed out as
    ``Unproven`` with the future of its proof, which covers the whole batch."""
    monkeypatch.setattr(LogReadAhead, "ready", lambda reader: True)
    grow(url, 4)  # versions 1-5
    journal, reader, follower = follow(url, 2, early=True)
    try:
        items = until_the_head(follower)
        unproven = [item for item in items if isinstance(item, Unproven)]
        for item in unproven:
            assert isinstance(item.proof, Future)
            assert item.proof.result(timeout=30) is None
    finally:
        reader.close()
    assert handed_out(unproven) == [[2, 3, 4, 5]] and handed_out(items) == [[2, 3, 4, 5]]
    assert proofs == [(2, 5)]
    assert journal.anchor_version == 5


@pytest.mark.parametrize("in_flight", [False, True], ids=["no-proof-in-flight", "a-proof-in-flight"])
def test_at_a_damaged_version_every_version_before_it_is_proven_and_handed_out_first(
    url, proofs, monkeypatch, in_flight
):
    """A damaged version comes after every version before it: the batch read before it is
    proven (from its first version to its last) and handed out, a proof in flight is
    waited for, and then the damage is raised."""
    grow(url, 3)  # versions 1-4
    store = open_store(url)
    put_after(store, Journal(store, read_only=True).load_state(), 2)  # versions 5 and 6
    store.put(keys.version_key(7), b"not a log version")
    first_read = [True]

    def ready(reader) -> bool:  # with a proof in flight: the first version is proven beside the reads
        if in_flight and first_read[0]:
            first_read[0] = False
            return False
        return True

    monkeypatch.setattr(LogReadAhead, "ready", ready)
    monkeypatch.setattr(LogReadAhead, "pending", lambda reader: False)  # no first wave: the first version alone
    beside = LogReadAhead.beside
    monkeypatch.setattr(LogReadAhead, "beside", lambda reader, *args: NeverDoneEarly(beside(reader, *args)))
    journal, reader, follower = follow(url, 2)
    items: list = []
    try:
        with pytest.raises(bw.CorruptDataError) as raised:
            for item in follower:
                items.append(item)
    finally:
        reader.close()
    assert raised.value.key == keys.version_key(7)
    batches = handed_out(items)
    assert batches == ([[2], [3, 4, 5, 6]] if in_flight else [[2, 3, 4, 5, 6]])
    assert proofs == covering(batches)
    assert journal.anchor_version == 6


def test_a_version_that_vanished_with_no_reclaim_is_named_as_damage(url):
    """The anchor deleted by something other than GC (no reclaim recorded): the proof fails
    and names the anchor's key as damage, never "reclaimed"."""
    grow(url, 3)  # versions 1-4
    journal, reader, follower = follow(url, 2)
    try:
        until_the_head(follower)
        anchor = journal.anchor_version
        assert anchor == 4
        state = journal.load_state()
        journal.store.delete(keys.version_key(anchor))
        put_after(journal.store, state, 2)  # versions 5 and 6, proven from the deleted anchor
        with pytest.raises(bw.CorruptDataError) as raised:
            until_the_head(follower)
    finally:
        reader.close()
    assert raised.value.key == keys.version_key(anchor)
    assert str(raised.value) == (
        f"{keys.version_key(anchor)}: this log version vanished although no garbage collection reclaimed it"
    )


def test_a_missing_version_at_or_below_the_cursors_is_damage_not_the_head(url):
    """Versions up to ``present_through`` (the cursor's) exist: a miss there is damage,
    named by its key, not a version yet to be committed."""
    grow(url, 3)  # versions 1-4
    open_store(url).delete(keys.version_key(3))
    journal, reader, follower = follow(url, 3, present_through=3)
    try:
        with pytest.raises(bw.CorruptDataError) as raised:
            next(follower)
    finally:
        reader.close()
    assert raised.value.key == keys.version_key(3)
    assert str(raised.value) == f"{keys.version_key(3)}: the cursor's log version is missing"
