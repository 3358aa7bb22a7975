"""Epoch claims by ticket (``batchweave.commit.claims``): a pool that starts together
claims its epochs in a few log versions, and no ticket can fence a newer incarnation."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from worker import tgb

import batchweave as bw
from batchweave.commit.claims import (
    CLAIM_PREFIX,
    Ticket,
    build_claims,
    claim_key,
    dead_tickets,
    foldable,
    parse_claim_key,
)
from batchweave.errors import ProducerFencedError
from batchweave.log import Layout, LogState, ProducerState
from batchweave.store import Store, open_store
from batchweave.testing.interleave import Background, PausingStore

L = Layout(2, 1)


def state(version: int = 5, layout: Layout | None = L, **epochs: int) -> LogState:
    producers = {p: ProducerState(offset=3, epoch=e, incarnation=f"{e:x}") for p, e in epochs.items()}
    return LogState(version=version, steps=0, producers=producers, layout=layout)


@given(
    producer=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
    epoch=st.integers(1, 10**7),
    dp=st.integers(1, 4096),
    cp=st.integers(1, 64),
    incarnation=st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
)
def test_a_ticket_key_says_everything_a_listing_needs(producer, epoch, dp, cp, incarnation):
    ticket = Ticket(producer, epoch, Layout(dp, cp), incarnation)
    assert parse_claim_key(claim_key(producer, epoch, Layout(dp, cp), incarnation)) == ticket


def test_stray_keys_are_not_tickets():
    for key in (
        "_claims/",
        "_claims/p/e000001/2x1-",
        "_claims/p/1/2x1-ab",
        "_intents/p/e000001/2x1-ab",
        "_claims/p/e1/x",
    ):
        assert parse_claim_key(key) is None, key


def test_only_the_epoch_after_the_logs_is_folded():
    log = state(a=2)
    tickets = [Ticket("a", 2, L, "old"), Ticket("a", 3, L, "new"), Ticket("b", 1, L, "first"), Ticket("c", 2, L, "gap")]
    assert {(t.producer, t.incarnation) for t in foldable(log, tickets, L)} == {("a", "new"), ("b", "first")}


def test_an_old_ticket_never_fences_a_newer_incarnation():
    """Incarnation "0d" wrote its ticket for epoch 3, then another claimed epoch 3 on its
    own: the old ticket must stay unfolded forever, or it would fence the newer one."""
    log = state(a=3)
    assert build_claims(log, [Ticket("a", 3, L, "0d")], 0.0, L) is None
    old, later = claim_key("a", 3, L, "0d"), claim_key("a", 4, L, "4e")
    assert dead_tickets(log, [old, later]) == [old]


def test_two_tickets_of_one_producer_for_one_epoch_are_not_folded():
    """Which incarnation should win is not the folder's to say: each claims on its own."""
    log = state(a=1)
    tickets = [Ticket("a", 2, L, "0a"), Ticket("a", 2, L, "0b"), Ticket("b", 1, L, "0c")]
    assert [t.producer for t in foldable(log, tickets, L)] == ["b"]
    assert foldable(log, [Ticket("a", 2, L, "0a"), Ticket("a", 2, L, "0a")], L) == [Ticket("a", 2, L, "0a")]


def test_a_ticket_of_another_layout_is_not_folded():
    log = state(a=1)
    assert foldable(log, [Ticket("b", 1, Layout(4, 1), "x")], L) == []
    fresh = state(version=0, layout=None)  # the first version: the folder's layout rules
    assert foldable(fresh, [Ticket("b", 1, Layout(4, 1), "x")], L) == []
    version = build_claims(fresh, [Ticket("b", 1, L, "x"), Ticket("c", 1, L, "y")], 1.0, L)
    assert version is not None and version.layout == L
    assert {p: (s.epoch, s.incarnation, s.offset) for p, s in version.producers.items()} == {
        "b": (1, "x", 0),
        "c": (1, "y", 0),
    }


def test_a_folded_claim_keeps_the_producers_offset():
    version = build_claims(state(a=2), [Ticket("a", 3, L, "new")], 1.0, L)
    assert version is not None and version.producers["a"].offset == 3  # resumes where the log says


VERSION_PUT = r"_log/\d+\.json"


def log_version(url: str) -> int:
    return bw.inspect_namespace(url).latest_version


def test_a_producer_that_lost_the_race_finds_its_ticket_folded_by_the_winner(tmp_path):
    """Before tickets, every claim was a version of its own, and a pool that started
    together raced for each one (P**2 PUTs, or P log P with backoff)."""
    url = str(tmp_path / "ns")
    held = PausingStore(url)
    gate = held.pause("put_if_absent", VERSION_PUT)  # b's first attempt: its ticket is written
    b = Background(bw.Producer, held, "b", dp=2)
    gate.wait_reached()
    a = bw.Producer(url, "a", dp=2)  # folds b's ticket with its own into version 1
    assert log_version(url) == 1
    gate.release()
    producer_b = b.result()
    assert log_version(url) == 1  # b lost the race for version 1 and wrote nothing more
    assert (a.epoch, producer_b.epoch) == (1, 1)
    assert list(open_store(url).list(CLAIM_PREFIX)) == []  # each deleted its folded ticket
    for producer in (a, producer_b):
        producer.append(tgb(producer.producer_id, 0, 2))
        producer.close()
    assert log_version(url) >= 2  # both commit under the epochs the fold gave them


def test_two_incarnations_with_tickets_for_one_epoch_each_claim_on_their_own_and_the_later_fences(tmp_path):
    url = str(tmp_path / "ns")
    held = PausingStore(url)
    gate = held.pause("put_if_absent", VERSION_PUT)
    first = Background(bw.Producer, held, "x", dp=2)  # its ticket for epoch 1 is written
    gate.wait_reached()
    second = bw.Producer(url, "x", dp=2)  # two tickets for x's epoch 1: neither folded, a claim of its own
    assert second.epoch == 1
    gate.release()
    late = first.result()  # its ticket is passed, never folded: it claims epoch 2 itself
    assert late.epoch == 2
    second.append(tgb("x", 0, 2))
    with pytest.raises(ProducerFencedError):
        second.flush()
    late.append(tgb("x", 0, 2))
    late.close()
    second.close(flush=False)
    report = bw.collect_garbage(url)
    assert report.deleted_tickets == 0 and list(open_store(url).list(CLAIM_PREFIX)) == []


def test_the_collector_deletes_the_tickets_a_producer_could_not(tmp_path):
    url = str(tmp_path / "ns")
    producer = bw.Producer(url, "a", dp=2)
    store = open_store(url)
    store.put_if_absent(claim_key("a", 1, L, "0dead"), b"")  # a crashed start's, passed
    store.put_if_absent(claim_key("b", 1, L, "0live"), b"")  # may still be folded
    assert bw.collect_garbage(url, dry_run=True).deleted_tickets == 1
    assert bw.collect_garbage(url).deleted_tickets == 1
    assert [info.key for info in store.list(CLAIM_PREFIX)] == [claim_key("b", 1, L, "0live")]
    producer.close()


def test_a_start_that_failed_leaves_no_ticket_for_another_to_fold(tmp_path, monkeypatch):
    """Regression (test_model, CI): a start whose claim put was lost raised, but its ticket
    stayed, and the next producer's claim folded it: the log then held an epoch for an
    incarnation that never ran."""
    url = str(tmp_path / "ns")
    real = Store.put_if_absent
    lost: list[str] = []

    def loses_the_first_version(store, key, data):
        if not lost and re.fullmatch(r"_log/\d{20}\.json", key):
            lost.append(key)
            raise bw.TransientStoreError(key, "simulated: the put never landed")
        return real(store, key, data)

    with monkeypatch.context() as patched:
        patched.setattr(Store, "put_if_absent", loses_the_first_version)
        with pytest.raises(bw.TransientStoreError):
            bw.Producer(url, "a", dp=2, background_commit=False)
    assert lost and list(open_store(url).list(CLAIM_PREFIX)) == []
    other = bw.Producer(url, "b", dp=2)
    assert set(bw.inspect_namespace(url).producers) == {"b"}
    other.close()


def test_a_ticket_put_whose_answer_was_lost_is_taken_as_written():
    """CI at this change's parent: 10% ambiguous writes (``test_latency``) lost a ticket's
    answer; the retry found the key and the producer failed to start with ObjectExistsError."""

    class LostAnswer(Store):
        lost = False

        def put_if_absent(self, key, data):
            super().put_if_absent(key, data)
            if key.startswith(CLAIM_PREFIX) and not self.lost:
                self.lost = True
                super().put_if_absent(key, data)  # the retry of a put that landed: it exists

    store = LostAnswer("memory://claims-lost-answer")
    with bw.Producer(store, "p", dp=1) as producer:
        producer.append(tgb("p", 0, 1))
    assert store.lost
    assert [info.key for info in store.list(CLAIM_PREFIX)] == []  # its ticket deleted as usual
