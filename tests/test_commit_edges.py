"""Edges of the commit package (``batchweave.commit``) that the protocol tests pass over.

A producer that keeps failing to commit gives up after a bounded, backed-off number of
attempts (and at once for failures no retry can cure); the inline producer
(``background_commit=False``) asks its policy before each attempt, makes one attempt per
append and retries a flush with backoff; the policies' defaults and parameter checks; the
claim backoff's bounds; and the intent board's request count, warnings and fork safety.
Everything runs on memory stores or with numbers, in milliseconds.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import re
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from checks import RecordingStore
from worker import payload, tgb

import batchweave as bw
from batchweave import intent as intent_module
from batchweave import keys, logrules
from batchweave.commit import group as group_module
from batchweave.commit import loop as loop_module
from batchweave.commit import turns as turns_module
from batchweave.commit.claims import CLAIM_TICKET, claim_key
from batchweave.commit.group import GroupCommit, TurnDelay
from batchweave.commit.intents import IntentBoard
from batchweave.commit.loop import note_store_failure
from batchweave.commit.policies import AIMD, DAC, ClaimBackoff, Fixed, Manual, Naive
from batchweave.commit.shared import SharedState
from batchweave.errors import (
    ConfigError,
    CorruptDataError,
    NotDurableError,
    ProducerFencedError,
    StorePermissionError,
    TransientStoreError,
)
from batchweave.intent import INTENT_FORMAT, Intent, decode_intent, encode_intent, intent_key
from batchweave.journal import Journal
from batchweave.log import Layout, LogState, ProducerState, TGBDescriptor
from batchweave.schema import Schema
from batchweave.store import Store, open_store
from batchweave.testing.interleave import Background, PausingStore

VERSION_KEY = re.compile(r"_log/\d{20}\.json")


def memory_url() -> str:
    return f"memory://commit-edges/{uuid.uuid4().hex}"


class Draws:
    """Stands in for the ``random`` module of ``batchweave.commit.loop``: fixed draws, recorded."""

    def __init__(self, draw: float = 0.5) -> None:
        self.draw = draw
        self.uniform_bounds: list[tuple[float, float]] = []

    def random(self) -> float:
        return self.draw

    def uniform(self, low: float, high: float) -> float:
        self.uniform_bounds.append((low, high))
        return low  # no real pause: the test reads the bounds


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    """The commit loop's pauses, recorded instead of slept; its jitter draws are 0.5."""
    slept: list[float] = []
    fake_time = SimpleNamespace(sleep=slept.append, monotonic=time.monotonic, time=time.time)
    monkeypatch.setattr(loop_module, "time", fake_time)
    monkeypatch.setattr(loop_module, "random", Draws(0.5))
    return slept


def lone_producer_state(producer_id: str = "p") -> SharedState:
    me = ProducerState(0, 1, "inc-1")
    return SharedState(producer_id, threading.Condition(), threading.Event(), LogState(producers={producer_id: me}), me)


# -- note_store_failure: when a failing store ends the producer --------------------------


def test_ten_refused_commits_in_a_row_end_the_producer_with_growing_capped_pauses(pauses):
    """An error the store does not retry (access denied) is tried again, with exponential
    backoff and full jitter capped at 5 s, and the tenth failure in a row is final: the
    producer's error is the store's, so the caller's next append raises it."""
    shared = lone_producer_state()
    store = open_store(memory_url())
    refused = StorePermissionError("_log/00000000000000000002.json", "access denied")
    outcomes = [note_store_failure(shared, store, refused) for _ in range(10)]
    assert outcomes == [True] * 9 + [False]
    assert shared.error is refused
    bounds = [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0, 5.0]  # 0.1 s doubled per failure, at most 5 s
    assert pauses == pytest.approx([bound * 0.5 for bound in bounds])  # the draw is 0.5 of the bound


def test_a_request_retried_until_the_deadline_is_final_at_once(pauses):
    """A TransientStoreError whose retries already took ``retry_deadline_s`` (exactly the
    deadline counts) ends the producer at the first failure: more attempts would hide an
    outage that has lasted that long. One retried for less is tried again."""
    store = open_store(memory_url(), storage_options={"retry_deadline_s": 30.0})
    shared = lone_producer_state()
    short = TransientStoreError("_log/x", "503 slow down", retried_s=29.5)
    assert note_store_failure(shared, store, short) is True and shared.error is None
    retried_out = TransientStoreError("_log/x", "503 slow down", retried_s=30.0)
    assert note_store_failure(lone_producer_state(), store, retried_out) is False
    fresh = lone_producer_state()
    assert note_store_failure(fresh, store, retried_out) is False
    assert fresh.error is retried_out
    assert len(pauses) == 1  # only the short one waited for another attempt


def test_a_failed_fsync_is_final_at_once(pauses):
    """A NotDurableError cannot be cured by another attempt of the same store: the first
    one ends the producer, without a pause."""
    shared = lone_producer_state()
    lost = NotDurableError("_log/00000000000000000002.json", "fsync failed")
    assert note_store_failure(shared, open_store(memory_url()), lost) is False
    assert shared.error is lost and pauses == []


def test_a_failed_commit_attempt_is_logged_with_the_producer_the_count_and_the_error(pauses, caplog):
    """The warning an operator reads names the producer, how many attempts failed in a row
    and the store's error."""
    shared = lone_producer_state("trainer-7")
    store = open_store(memory_url())
    refused = StorePermissionError("_log/00000000000000000009.json", "access denied")
    with caplog.at_level(logging.WARNING, logger="batchweave.producer"):
        note_store_failure(shared, store, refused)
        note_store_failure(shared, store, refused)
    last = [r.getMessage() for r in caplog.records if r.name == "batchweave.producer"][-1]
    assert last == f"producer trainer-7: commit attempt failed (2 in a row): {refused}"


# -- the inline producer (background_commit=False) ---------------------------------------


class WaitFor:
    """A policy that always asks for ``wait`` more seconds, and records what it is asked."""

    name = "wait-for"

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self.asked: list[tuple[int, float]] = []

    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
        self.asked.append((pending_tgbs, since_last_attempt_s))
        return self.wait if pending_tgbs else math.inf

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        pass


class RivalFirstStore(Store):
    """A store on which, for the next ``races`` log-version puts, a rival producer commits
    just before ours: each of those attempts loses the race for its version."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.races = 0
        self.rival: bw.Producer | None = None

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if self.races and VERSION_KEY.fullmatch(key):
            self.races -= 1
            assert self.rival is not None
            self.rival.append(tgb("rival", self.rival.next_offset, 1))
            self.rival.flush()
        super().put_if_absent(key, data)


def test_an_inline_producer_commits_only_when_its_policy_says_so():
    """An append asks the policy with the seconds since the last attempt and, told to wait
    even half a second, commits nothing; a flush commits everything regardless."""
    url = memory_url()
    policy = WaitFor(0.5)
    started = time.monotonic()
    with bw.Producer(url, "p", dp=1, commit_policy=policy, background_commit=False, pack_steps=1) as producer:
        for offset in range(3):
            producer.append(tgb("p", offset, 1))
        elapsed = time.monotonic() - started
        assert producer.resume_offset == 0 and producer.metrics()["attempts"] == 0
        assert [pending for pending, _ in policy.asked] == [1, 2, 3]
        assert all(0 <= since <= elapsed for _, since in policy.asked), policy.asked
        producer.flush()
        assert producer.resume_offset == 3


def test_a_commit_thread_asks_its_policy_again_after_each_wait_and_commits_only_when_told():
    """The background loop asks the policy with the TGBs pending and the seconds since the
    last attempt, waits what it is told (half a second here, every time) and asks again:
    it never commits on its own; a flush commits everything regardless."""
    policy = WaitFor(0.5)
    with bw.Producer(memory_url(), "p", dp=1, commit_policy=policy) as producer:
        for offset in range(3):
            producer.append(tgb("p", offset, 1))
        deadline = time.monotonic() + 20
        while sum(pending == 3 for pending, _ in policy.asked) < 3:  # asked again after two waits
            assert time.monotonic() < deadline, policy.asked
            time.sleep(0.01)
        assert producer.resume_offset == 0 and producer.metrics()["attempts"] == 0
        sinces = [since for pending, since in policy.asked if pending == 3]
        assert sinces == sorted(sinces) and sinces[-1] - sinces[0] >= 2 * 0.5 * 0.9, policy.asked
        producer.flush()
        assert producer.resume_offset == 3


def test_an_inline_append_makes_one_attempt_and_a_flush_retries_with_backoff(pauses):
    """Losing a race in ``append`` costs one attempt and leaves the TGB pending (the next
    append takes it along); a flush that loses one backs off with full jitter, then tries
    again until everything is in."""
    url = memory_url()
    store = RivalFirstStore(url)
    draws = loop_module.random
    with (
        bw.Producer(url, "rival", dp=1, commit_policy=Manual(), background_commit=False) as rival,
        bw.Producer(store, "p", dp=1, commit_policy=Naive(), background_commit=False, pack_steps=1) as producer,
    ):
        store.rival = rival
        store.races = 1
        producer.append(tgb("p", 0, 1))
        counters = producer.metrics()
        assert (producer.resume_offset, counters["attempts"], counters["conflicts"]) == (0, 1, 1)
        assert draws.uniform_bounds == []  # an append does not wait after a lost race
        producer.append(tgb("p", 1, 1))
        assert producer.resume_offset == 2

    url = memory_url()
    store = RivalFirstStore(url)
    with (
        bw.Producer(url, "rival", dp=1, commit_policy=Manual(), background_commit=False) as rival,
        bw.Producer(store, "p", dp=1, commit_policy=Manual(), background_commit=False) as producer,
    ):
        store.rival = rival
        producer.append(tgb("p", 0, 1))
        store.races = 1
        producer.flush()
        counters = producer.metrics()
        assert (producer.resume_offset, counters["attempts"], counters["conflicts"]) == (1, 2, 1)
        assert len(draws.uniform_bounds) == 1
        low, high = draws.uniform_bounds[0]
        assert low == 0 and 0 < high <= 2.0  # full jitter, at most 2 s


def test_an_inline_append_of_a_fenced_incarnation_raises_at_once():
    """When a newer incarnation has claimed the producer id, the append whose commit finds
    out raises ProducerFencedError itself, not a later call."""
    url = memory_url()
    old = bw.Producer(url, "p", dp=1, commit_policy=Naive(), background_commit=False, pack_steps=1)
    new = bw.Producer(url, "p", dp=1, commit_policy=Manual())
    with pytest.raises(ProducerFencedError, match="fenced by a newer incarnation"):
        old.append(tgb("p", 0, 1))
    new.close()
    old.close(flush=False)


# -- policies: defaults, bounds and messages --------------------------------------------


class TopDraw:
    def random(self) -> float:
        return 1.0


def test_a_fresh_dac_commits_at_once_and_its_default_jitter_is_a_quarter_gap():
    """Before any attempt DAC reports an estimate of 0 for one producer and asks for no
    wait; its default ``rho`` lets a draw at the top lengthen the gap by a quarter."""
    fresh = DAC()
    assert fresh.wait_s(1, 0.0) == 0.0
    assert (fresh.fragile_window_ema_s, fresh.producers, fresh.gap_s) == (0.0, 1, 0.0)
    policy = DAC(rng=TopDraw())  # type: ignore[arg-type]
    tau = 0.1
    assert policy.next_gap(tau, 1, True) == pytest.approx((1 - 0.1) / 0.1 * tau * 1.25)


def test_dac_refuses_an_infinite_jitter():
    """``rho`` must be finite: an infinite one would make every gap infinite."""
    with pytest.raises(ConfigError, match="rho=inf"):
        DAC(rho=math.inf)


def test_aimd_defaults_start_at_ten_tgbs_and_take_one_off_per_success():
    """AIMD() commits at 10 pending TGBs, not 9; a success moves it to 9, a conflict doubles it."""
    policy = AIMD()
    assert (policy.wait_s(9, 0.0), policy.wait_s(10, 0.0)) == (math.inf, 0.0)
    policy.observe(0.05, 4, True)
    assert (policy.wait_s(8, 0.0), policy.wait_s(9, 0.0)) == (math.inf, 0.0)
    policy.observe(0.05, 4, False)
    assert (policy.wait_s(17, 0.0), policy.wait_s(18, 0.0)) == (math.inf, 0.0)


@pytest.mark.parametrize("kwargs", [{"step": 0}, {"backoff": 0}, {"backoff": 1}, {"start": 0.5}])
def test_aimd_refuses_parameters_that_never_move_or_never_commit(kwargs):
    """A zero step, a backoff of at most 1, or a start below one TGB is refused, and the
    message says what AIMD needs."""
    with pytest.raises(ConfigError, match=r"AIMD needs finite start>=1 TGB, step>0 TGBs, backoff>1"):
        AIMD(**kwargs)


def test_aimd_accepts_a_start_of_one_tgb():
    """``start=1`` is the smallest interval AIMD keeps: valid, and it commits every TGB."""
    assert AIMD(start=1).wait_s(1, 0.0) == 0.0


def test_fixed_refuses_zero_with_a_message_saying_why():
    with pytest.raises(ConfigError, match=r"Fixed policy needs every >= 1 TGBs, got 0"):
        Fixed(0)


@pytest.mark.parametrize("policy", [Manual(), Naive()])
def test_the_repr_of_a_policy_reads_back_as_the_same_policy(policy):
    """What a log line shows of a producer's policy names it so it can be built again."""
    again = eval(repr(policy), {"Manual": Manual, "Naive": Naive})
    assert type(again) is type(policy) and again.name == policy.name


def test_group_commit_as_a_plain_policy_waits_out_its_interval():
    """Through the CommitPolicy protocol group commit asks for an attempt once per
    ``interval_s`` and never with nothing pending."""
    policy = GroupCommit(interval_s=0.4)
    assert policy.wait_s(0, 10.0) == math.inf
    assert policy.wait_s(1, 0.0) == pytest.approx(0.4)
    assert policy.wait_s(5, 0.1) == pytest.approx(0.3)
    assert policy.wait_s(5, 1.0) == 0.0


def test_turn_delay_counts_the_gaps_it_has_folded():
    """``samples`` is how many version gaps the delay estimate has seen (the seed is none)."""
    delay = TurnDelay(0.1)
    assert delay.samples == 0
    for gap in (0.45, 0.5, 0.7):
        delay.observe_gap(gap, 0.4)
    assert delay.samples == 3


class UpperEnd:
    """A ``random.Random`` stand-in whose uniform draws are at the top, recorded."""

    def __init__(self) -> None:
        self.ranges: list[tuple[float, float]] = []

    def uniform(self, low: float, high: float) -> float:
        self.ranges.append((low, high))
        return high


def test_a_lost_claim_waits_up_to_a_bound_doubling_from_two_attempts_to_the_cap():
    """Full jitter: each pause is drawn from [0, bound], the bound two attempts' time after
    the first loss, doubling with each loss, at most ``max_s``."""
    rng = UpperEnd()
    backoff = ClaimBackoff(min_attempt_s=0.01, max_s=1.0, rng=rng)  # type: ignore[arg-type]
    pauses = [backoff.pause_s(0.05) for _ in range(6)]
    assert pauses == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert [low for low, _ in rng.ranges] == [0] * 6
    assert backoff.losses == 6


# -- the intent board ---------------------------------------------------------------------


def desc(producer: str, offset: int, epoch: int = 1, slices: int = 1, schema: str = "") -> TGBDescriptor:
    """A well-formed dp=1 descriptor, unless ``slices`` says otherwise; ``schema`` is the
    digest of its arrays' schema ("" as in a log older than schemas)."""
    return TGBDescriptor(
        producer=producer,
        epoch=epoch,
        source_offset=offset,
        dp=1,
        cp=1,
        kind="arrays",
        objects=[f"data/{producer}/e{epoch:06d}/{offset:012d}-t.0.bwb"],
        slices=[(0, 0, 10, 0)] * slices,
        nbytes=10,
        schema=schema,
    )


def test_the_intent_board_counts_every_request_it_makes():
    """``requests`` equals the store requests the board made: a LIST and a GET per new
    intent, then only the LIST while the intents are cached."""
    store = RecordingStore(memory_url())
    for producer in ("a", "b"):
        IntentBoard(open_store(store.url), producer).publish(1, [desc(producer, 0), desc(producer, 1)])
    board = IntentBoard(store, "c")
    assert sorted(i.producer for i in board.others()) == ["a", "b"]
    assert board.requests == len(store.calls) == 3
    board.others()
    assert board.requests == len(store.calls) == 4
    assert board.publish(1, [desc("c", 0)]) == 1
    assert board.requests == len(store.calls) == 5
    assert board.publish(1, [desc("c", 0), desc("c", 1)]) == 1  # a retry finds the first try's intent
    assert board.requests == len(store.calls) == 7  # its put, refused, and a GET of what is there


def _recorded(**offsets: tuple[int, int]) -> LogState:
    """A state that records each producer at (epoch, next offset)."""
    producers = {p: ProducerState(offset, epoch, "inc") for p, (epoch, offset) in offsets.items()}
    return LogState(version=9, producers=producers)


def test_an_intent_the_log_shows_folded_or_fenced_is_not_worth_reading():
    state = _recorded(a=(2, 30), b=(1, 5))
    listed = [
        ("a", 1, 40),  # an epoch the log fenced
        ("a", 2, 0),  # below the producer's offset in the log: folded
        ("a", 2, 29),  # folded too
        ("a", 2, 30),  # the producer's next offset: waiting
        ("a", 2, 34),  # after it: waiting
        ("b", 1, 0),  # folded
        ("b", 3, 9),  # an epoch the log has not seen yet: never foldable by this state
        ("c", 1, 0),  # a producer this state does not know yet: read
    ]
    assert group_module.worth_reading(state, listed) == {("a", 2, 30), ("a", 2, 34), ("c", 1, 0)}


def test_a_committer_reads_no_intent_the_log_shows_folded():
    """Each new committer used to read every listed intent, folded ones too (they linger
    until their producer sees the fold): a GET and a decode each, for nothing."""
    store = RecordingStore(memory_url())
    board_a = IntentBoard(open_store(store.url), "a")
    for first in (0, 2, 4):
        board_a.publish(1, [desc("a", first), desc("a", first + 1)])
    board = IntentBoard(store, "c")
    intents = board.others(_recorded(a=(1, 4)))
    assert [(i.producer, i.first_offset) for i in intents] == [("a", 4)]
    assert board.requests == len(store.calls) == 2  # the LIST and one GET
    folded = group_module.fold_intents(_recorded(a=(1, 4)), intents)
    assert [t.source_offset for t in folded["a"]] == [4, 5]


def test_a_damaged_intent_is_reported_as_skipped(caplog):
    """The warning for another producer's unreadable intent says it is skipped (not fatal)
    and names its key; the readable ones are still returned."""
    store = open_store(memory_url())
    IntentBoard(store, "a").publish(1, [desc("a", 0)])
    bad_key = intent_key("b", 1, 0)
    store.put_if_absent(bad_key, encode_intent(Intent("batchweave.intent/99", "b", 1, [desc("b", 0)])))
    with caplog.at_level(logging.WARNING, logger="batchweave.commit.intents"):
        assert [i.producer for i in IntentBoard(store, "c").others()] == ["a"]
    warnings = [r for r in caplog.records if r.name == "batchweave.commit.intents"]
    assert len(warnings) == 1
    assert warnings[0].getMessage().startswith(f"skipping a damaged intent: {bad_key}: unsupported intent format")
    # Whose thread logged it, for a thread dump: from a store on this machine, the committer's.
    assert warnings[0].threadName == threading.current_thread().name


def test_intents_across_a_network_are_read_by_the_processs_readers(caplog):
    store = DictStore({**one_intent("a"), intent_key("b", 1, 0): b"{"})
    with caplog.at_level(logging.WARNING, logger="batchweave.commit.intents"):
        assert [i.producer for i in IntentBoard(store, "c").others()] == ["a"]  # type: ignore[arg-type]
    (warning,) = [r for r in caplog.records if r.name == "batchweave.commit.intents"]
    assert warning.threadName.startswith("batchweave-intents")


def test_a_pools_intents_are_read_thirty_two_at_once():
    """The next committer reads a pool's new intents 32 at a time, a few round trips for
    the whole pool: every read here waits until 31 others are in flight with it."""
    together = threading.Barrier(32, timeout=10)

    class InFlightStore(DictStore):
        def get(self, key: str) -> bytes:
            together.wait()
            return super().get(key)

    objects: dict[str, bytes] = {}
    for index in range(64):
        objects.update(one_intent(f"p{index:02d}"))
    board = IntentBoard(InFlightStore(objects), "reader")  # type: ignore[arg-type]
    assert len(board.others()) == 64


@pytest.mark.parametrize(
    "bad, problem",
    [
        (b"{not json", "damaged intent"),
        (encode_intent(Intent(INTENT_FORMAT, "b", 1, [])), "intent carries no TGB"),
        (encode_intent(Intent(INTENT_FORMAT, "a", 1, [desc("a", 0)])), "intent of a@0 e1 under this key"),
        (encode_intent(Intent(INTENT_FORMAT, "b", 1, [desc("b", 0), desc("b", 2)])), "TGB b@2 e1 breaks the intent"),
        (encode_intent(Intent(INTENT_FORMAT, "b", 1, [desc("b", 0, slices=2)])), "TGB b@0: 2 slices for dp=1"),
    ],
)
def test_every_refused_intent_names_its_key_and_the_damage(bad, problem):
    """Whatever is wrong with an intent, the error says which object and what: an operator
    finds and deletes it from the message alone."""
    key = intent_key("b", 1, 0)
    with pytest.raises(CorruptDataError) as info:
        decode_intent(bad, key)
    assert str(info.value).startswith(f"{key}: {problem}")


class DictStore:
    """Just what an IntentBoard reads: ``list`` and ``get`` over a dict (no I/O runtime,
    which would not survive fork)."""

    remote = True  # as an object store's: its intents are read by the process's readers

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def list(self, prefix: str = ""):
        return [SimpleNamespace(key=k) for k in self.objects if k.startswith(prefix)]

    def get(self, key: str) -> bytes:
        return self.objects[key]


def one_intent(producer: str) -> dict[str, bytes]:
    return {intent_key(producer, 1, 0): encode_intent(Intent(INTENT_FORMAT, producer, 1, [desc(producer, 0)]))}


def read_intents_in_child() -> None:
    hung = threading.Timer(10, os._exit, args=(3,))  # a hang ends the child (exit code 3), not the test run
    hung.start()
    board = IntentBoard(DictStore(one_intent("child")), "reader")  # type: ignore[arg-type]
    assert [i.producer for i in board.others()] == ["child"]
    hung.cancel()


def test_a_forked_child_reads_intents_with_readers_of_its_own():
    """A process forked after its parent read intents (a data loader's workers) reads
    intents too: the parent's reader threads do not exist in the child."""
    parent = IntentBoard(DictStore(one_intent("parent")), "reader")  # type: ignore[arg-type]
    assert [i.producer for i in parent.others()] == ["parent"]  # the process's readers exist now
    child = multiprocessing.get_context("fork").Process(target=read_intents_in_child)
    child.start()
    child.join(60)  # returns as soon as the child is done (a hung child ends itself after 10 s)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, "the forked child could not read intents (3: it hung)"


def test_a_producer_never_reads_its_own_intents_nor_stray_objects():
    """``others`` is every *other* producer's intent: a producer's own (which it never
    folds) and objects under the prefix that are not intents are left out."""
    store = open_store(memory_url())
    IntentBoard(store, "a").publish(1, [desc("a", 0)])
    IntentBoard(store, "b").publish(1, [desc("b", 0)])
    store.put_if_absent("_intents/notes.txt", b"not an intent")
    assert [i.producer for i in IntentBoard(store, "a").others()] == ["b"]


def producer_at(producer_id: str, offset: int) -> LogState:
    return LogState(version=3, producers={producer_id: ProducerState(offset, 1, "inc-1")})


def test_collecting_deletes_the_intents_the_log_holds_and_counts_the_deletes():
    """Intents whose TGBs are all committed are deleted, one request each; the rest are
    returned, oldest first, for the next collection."""
    store = RecordingStore(memory_url())
    board = IntentBoard(store, "p")
    published = [(intent_key("p", 1, first), board.publish(1, [desc("p", first)])) for first in range(4)]
    requests, calls = board.requests, len(store.calls)
    left = board.collect(producer_at("p", 2), published)
    assert left == published[2:]
    assert board.requests - requests == len(store.calls) - calls == 2
    assert sorted(info.key for info in store.list("_intents/")) == [key for key, _ in published[2:]]


class DeniedDeletes(RecordingStore):
    """Credentials that may not delete: every delete is refused (and recorded)."""

    def delete(self, key: str) -> None:
        self.calls.append(("delete", key))
        raise StorePermissionError(key, "access denied", action="s3:DeleteObject")


def test_without_delete_permission_committed_intents_are_forgotten_after_one_refusal():
    """A producer that may not delete asks once, then leaves its committed intents to the
    garbage collector: no further delete request, none counted, none kept for retrying."""
    store = DeniedDeletes(memory_url())
    board = IntentBoard(store, "p")
    published = [(intent_key("p", 1, first), board.publish(1, [desc("p", first)])) for first in range(3)]
    requests, calls = board.requests, len(store.calls)
    assert board.collect(producer_at("p", 3), published) == []
    assert [request for request, _ in store.calls[calls:]] == ["delete"]
    assert board.requests - requests == 1


class FlakyDeletes(Store):
    """A store whose deletes fail with a transient error."""

    def delete(self, key: str) -> None:
        raise TransientStoreError(key, "HTTP 503 SlowDown; still failing after 600 s")


def test_an_intent_that_could_not_be_deleted_is_kept_and_the_reason_logged(caplog):
    """A delete that fails is harmless: the intent is kept for the next collection, and
    the log says which intent and why."""
    store = FlakyDeletes(memory_url())
    board = IntentBoard(store, "p")
    key = intent_key("p", 1, 0)
    published = [(key, board.publish(1, [desc("p", 0)]))]
    with caplog.at_level(logging.INFO, logger="batchweave.commit.intents"):
        assert board.collect(producer_at("p", 1), published) == published
    messages = [r.getMessage() for r in caplog.records if r.name == "batchweave.commit.intents"]
    assert len(messages) == 1
    assert messages[0].startswith(f"could not delete committed intent {key}: ") and "SlowDown" in messages[0]


def test_a_claim_sweeps_only_this_producers_intents_of_older_epochs():
    """After claiming epoch 3 a producer deletes its intents of epochs 1 and 2 (never
    foldable now), keeps its current epoch's and every other producer's, and counts a
    LIST and a DELETE each."""
    store = RecordingStore(memory_url())
    IntentBoard(open_store(store.url), "q").publish(1, [desc("q", 0)])
    open_store(store.url).put_if_absent("_intents/p/stray.txt", b"not an intent")
    board = IntentBoard(store, "p")
    for epoch, first in ((1, 0), (1, 7), (2, 7), (3, 0), (3, 2)):
        board.publish(epoch, [desc("p", first, epoch=epoch)])
    assert board.sweep_older_epochs(3) == 3
    assert board.requests == len(store.calls) == 5 + 1 + 3  # the puts, a LIST, a DELETE each
    remaining = sorted(info.key for info in store.list("_intents/"))
    assert remaining == sorted(
        [intent_key("p", 3, 0), intent_key("p", 3, 2), intent_key("q", 1, 0), "_intents/p/stray.txt"]
    )


def test_a_sweep_without_delete_permission_stops_at_the_first_refusal():
    """Denied, the sweep deletes none, says so, and does not ask again for the others."""
    store = DeniedDeletes(memory_url())
    for first in (0, 5, 9):
        IntentBoard(open_store(store.url), "p").publish(1, [desc("p", first)])
    board = IntentBoard(store, "p")
    calls = len(store.calls)
    assert board.sweep_older_epochs(2) == 0
    assert [request for request, _ in store.calls[calls:]] == ["list", "delete"]
    assert board.requests == 2


# -- group commit's turns (``batchweave.commit.turns``) ----------------------------------


def test_a_flush_in_group_mode_that_loses_races_backs_off_from_two_staggers_doubling_to_2_s(monkeypatch):
    """A group producer's flush that loses the race for its version waits a pause drawn
    from [0, 2 staggers] after its first lost race, the bound doubling with each further
    one up to 2 s, then commits."""
    draws = Draws(0.5)
    monkeypatch.setattr(turns_module, "random", draws)
    url = memory_url()
    store = RivalFirstStore(url)
    with (
        bw.Producer(url, "rival", dp=1, commit_policy=Manual(), background_commit=False) as rival,
        bw.Producer(store, "p", dp=1, commit_policy=GroupCommit(3600.0, stagger_s=0.3, intent_lead_s=3600.0)) as p,
    ):
        store.rival = rival
        p.append(tgb("p", 0, 1))
        store.races = 3
        p.flush()
        assert p.resume_offset == 1 and p.metrics()["conflicts"] == 3
    assert draws.uniform_bounds == [(0, pytest.approx(0.6)), (0, pytest.approx(1.2)), (0, pytest.approx(2.0))]


class KeyedStore(Store):
    """A memory store whose ``_perform`` (where faults go) knows the key of the request,
    per thread."""

    def __init__(self, url: str, **options) -> None:
        super().__init__(url, **options)
        self._key = threading.local()

    def _call(self, key, op, request, nbytes=0, *, conditional=False):
        self._key.value = key
        return super()._call(key, op, request, nbytes, conditional=conditional)


class LogOutage(KeyedStore):
    """A memory store whose log requests fail with a server error while ``down``;
    ``retried`` is set once a failing log request is being retried."""

    def __init__(self, url: str, **options) -> None:
        super().__init__(url, **options)
        self.down = False
        self.failures = 0
        self.retried = threading.Event()

    def _perform(self, request, nbytes, op):
        key = self._key.value
        if self.down and key.startswith("_log/"):
            self.failures += 1
            if self.failures >= 2:
                self.retried.set()
            raise TransientStoreError(key, "HTTP 500 InternalError")
        return super()._perform(request, nbytes, op)


def test_closing_a_group_producer_without_a_flush_during_an_outage_does_not_wait_it_out():
    """close(flush=False) drops what is not committed, so the group commit thread stops
    retrying the failing log at once instead of for the store's 600 s deadline."""
    store = LogOutage(memory_url())
    producer = bw.Producer(store, "p", dp=1, commit_policy=GroupCommit(3600.0, intent_lead_s=3600.0))
    store.down = True
    producer.append(tgb("p", 0, 1))  # the commit thread follows the log, and retries
    assert store.retried.wait(30)
    Background(producer.close, flush=False).result(timeout_s=60)  # a hang would be the 600 s deadline


class LandingStore(Store):
    """A store that tells when log version ``version`` has been put."""

    def __init__(self, url: str, version: int) -> None:
        super().__init__(url)
        self.key = keys.version_key(version)
        self.landed = threading.Event()

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        super().put_if_absent(key, data)
        if key == self.key:
            self.landed.set()


def test_the_first_turn_after_a_pool_claimed_in_version_one_folds_the_others_intents():
    """A pool whose claims were all folded into version 1: the producer whose turn comes
    first reads the intents written for it and folds them with its own TGBs."""
    url = memory_url()
    store = LandingStore(url, 2)
    store.put_if_absent(claim_key("a", 1, Layout(1, 1), "a0"), CLAIM_TICKET)  # a's start, folded by b's claim
    # Of the schema b's TGBs have (worker.payload's): b's version sets it, and folds a's.
    schema = Schema.from_arrays(payload("a", 0, 0)).digest
    IntentBoard(store, "a").publish(1, [desc("a", 0, schema=schema), desc("a", 1, schema=schema)])
    with bw.Producer(store, "b", dp=1, commit_policy=GroupCommit(interval_s=0.2)) as b:
        assert Journal(open_store(url)).load_state().version == 1  # a and b claimed together
        b.append(tgb("b", 0, 1))
        assert store.landed.wait(30)
        after = Journal(open_store(url)).load_state()
        assert after.version == 2 and after.producers["a"].offset == 2 and after.producers["b"].offset == 1


def test_group_commits_are_counted_published_won_and_timed():
    """A group producer's commits show in its counters and in the log (publish_metrics);
    each won race keeps the stagger's backoff at 1; and every version after the first
    gives the turn-delay estimate a gap to learn from."""
    url = memory_url()
    policy = GroupCommit(3600.0, intent_lead_s=3600.0)
    with bw.Producer(url, "p", dp=1, commit_policy=policy, publish_metrics=True) as p:
        for offset in range(3):
            p.append(tgb("p", offset, 1))
            p.flush()
        counters = p.metrics()
        assert (counters["attempts"], counters["successes"], counters["conflicts"]) == (3, 3, 0)
        assert counters["tgbs_committed"] == 3 and counters["last_fragile_window_s"] > 0
        assert policy.delay is not None and policy.delay.backoff == 1.0 and policy.delay.samples == 2
    published = bw.inspect_namespace(url).producers["p"]["metrics"]
    assert (published["attempts"], published["successes"], published["tgbs_committed"]) == (3, 3, 3)


class RefusedLog(KeyedStore):
    """A memory store that refuses the next ``refusals`` log requests (access denied)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.refusals = 0

    def _perform(self, request, nbytes, op):
        key = self._key.value
        if self.refusals and key.startswith("_log/"):
            self.refusals -= 1
            raise StorePermissionError(key, "access denied (credentials being rotated)")
        return super()._perform(request, nbytes, op)


def test_a_group_producer_rides_out_nine_refusals_in_a_row_and_stops_at_ten(pauses):
    """Group commit counts failed passes as the commit loop does: nine refusals in a row
    after a good pass are ridden out (with backoff) and the flush lands; ten end the
    producer with the store's error."""
    store = RefusedLog(memory_url())
    with bw.Producer(store, "p", dp=1, commit_policy=GroupCommit(3600.0, intent_lead_s=3600.0)) as p:
        p.append(tgb("p", 0, 1))
        p.flush()
        store.refusals = 9
        p.append(tgb("p", 1, 1))
        p.flush(timeout_s=30)
        assert p.resume_offset == 2 and len(pauses) == 9
        store.refusals = 10
        p.append(tgb("p", 2, 1))
        with pytest.raises(StorePermissionError, match="credentials being rotated"):
            p.flush(timeout_s=30)


def test_producers_two_or_more_turns_away_look_again_half_an_interval_before_standing_in():
    """Ranks 0 and 1 look every quarter interval; rank ``r >= 2`` (in a pool large enough
    that the head budget allows no more) looks again half an interval before it becomes
    the stand-in, ``(r - 1.5)`` intervals after the version."""
    interval = 0.4
    assert group_module.follow_pause_s(1, 10_000, interval, 0.0, 0.5) == pytest.approx(interval / 4)
    assert group_module.follow_pause_s(2, 10_000, interval, 0.0, 0.5) == pytest.approx(0.5 * interval)
    assert group_module.follow_pause_s(3, 10_000, interval, 0.1, 0.5) == pytest.approx(1.5 * interval - 0.1)


@pytest.mark.parametrize(
    "key, parsed",
    [
        (intent_key("p", 100_000, 7), ("p", 100_000, 7)),
        ("_claimsX/p/e000001/000000000000.json", None),  # another prefix of the same length
        ("_intents/p/e000001/000000000000.txt", None),
    ],
)
def test_intent_keys_parse_only_under_the_prefix_and_with_the_json_suffix(key, parsed):
    """Only ``_intents/<producer>/e<epoch>/<offset>.json`` names an intent; its epoch is
    every digit after the ``e``."""
    assert intent_module.parse_intent_key(key) == parsed


def test_group_commit_defaults_and_limits():
    """By default a version every 0.4 s and a rotation of the producers recorded within 8
    versions; one version is the smallest rotation allowed, and ``alpha`` above 1 is
    refused."""
    default = GroupCommit()
    assert default.wait_s(1, 0.0) == pytest.approx(0.4) and default.active_versions == 8
    assert default.publish_after_version_s() == pytest.approx(0.2)  # intents half an interval ahead
    assert GroupCommit(active_versions=1).active_versions == 1
    lead_zero = GroupCommit(interval_s=2.0, intent_lead_s=0.0, alpha=1.0)
    assert lead_zero.publish_after_version_s() == 2.0
    assert GroupCommit(interval_s=2.0, intent_lead_s=0.5).publish_after_version_s() == 1.5
    with pytest.raises(ConfigError, match="0 < alpha <= 1"):
        GroupCommit(alpha=1.5)
    with pytest.raises(ConfigError, match="stagger_s > 0"):
        GroupCommit(stagger_s=0.0)


def test_turns_rotate_backwards_through_the_producers_by_the_version():
    """Every producer derives the same order: after version ``v`` the active producer at
    index ``(v mod n)`` of the id order commits first, the one before it next, and so on;
    producers outside the rotation take the same kind of turns after it."""
    recent = LogState(version=5, producers={p: ProducerState(1, 1, f"i-{p}", last_version=5) for p in "abc"})
    assert [group_module.turn_rank(recent, p, 8) for p in "abc"] == [1, 2, 0]
    idle = LogState(version=20, producers={p: ProducerState(1, 1, f"i-{p}", last_version=1) for p in "xyz"})
    assert [group_module.turn_rank(idle, p, 8) for p in "xyz"] == [1, 2, 0]


def test_the_turn_delay_is_seeded_by_the_first_commit_only():
    """How late turns come is seeded from the first commit's duration (the claim's);
    later commits move only the put-time average."""
    policy = GroupCommit(interval_s=0.4, alpha=0.2)
    policy.observe_commit(0.1)
    policy.observe_commit(1.0)
    seed = max(2 * 0.1, 0.25)
    put_s = 0.8 * 0.1 + 0.2 * 1.0
    assert policy.stagger() == pytest.approx(seed + 4 * seed / 2 + put_s)


def test_a_group_producer_fails_at_once_when_its_store_retried_out():
    """In group mode too, a log request the store retried for its whole deadline ends the
    producer with that error at the first failure (here a 50 ms deadline)."""
    store = LogOutage(memory_url(), storage_options={"retry_deadline_s": 0.05})
    with bw.Producer(store, "p", dp=1, commit_policy=GroupCommit(3600.0, intent_lead_s=3600.0)) as producer:
        store.down = True
        producer.append(tgb("p", 0, 1))
        with pytest.raises(TransientStoreError, match="HTTP 500 InternalError"):
            producer.flush(timeout_s=30)
        assert producer.metrics()["attempts"] == 0


@pytest.mark.parametrize(("min_attempt_s", "max_s"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)])
def test_claim_backoff_refuses_bounds_that_are_not_positive(min_attempt_s, max_s):
    with pytest.raises(ConfigError) as raised:
        ClaimBackoff(min_attempt_s=min_attempt_s, max_s=max_s)
    assert str(raised.value) == f"ClaimBackoff needs positive min_attempt_s and max_s, got {min_attempt_s}, {max_s}"


def test_a_new_producers_counters_start_at_zero_with_no_fragile_window_yet():
    with bw.Producer(memory_url(), "p", dp=1, commit_policy=Manual()) as producer:
        counters = producer.metrics()
    assert {key: counters[key] for key in ("attempts", "conflicts", "successes", "tgbs_committed")} == dict.fromkeys(
        ("attempts", "conflicts", "successes", "tgbs_committed"), 0
    )
    assert counters["bytes_written"] == 0 and math.isnan(counters["last_fragile_window_s"])


def test_a_journal_commit_counts_every_race_it_loses_before_it_commits():
    url = memory_url()
    store = RivalFirstStore(url)
    with bw.Producer(url, "rival", dp=1, commit_policy=Manual(), background_commit=False) as rival:
        store.rival = rival
        journal = Journal(store)
        state = journal.load_state()
        store.races = 2
        result = journal.commit(state, lambda newest: logrules.next_version(newest, time.time()), max_attempts=5)
    assert (result.outcome, result.conflicts) == ("committed", 2)
    assert result.state.version == state.version + 3  # the rival's two versions, then ours


def test_a_closed_producer_says_so_with_its_own_error():
    producer = bw.Producer(memory_url(), "p", dp=1, pack_steps=1)
    producer.append(tgb("p", 0, 1))
    producer.close()
    with pytest.raises(bw.ProducerClosedError, match="producer 'p' is closed") as closed:
        producer.append(tgb("p", 1, 1))
    assert isinstance(closed.value, ValueError) and closed.value.producer_id == "p"


def test_a_flush_that_runs_out_of_time_raises_flush_timeout_and_loses_nothing():
    store = PausingStore(memory_url())
    producer = bw.Producer(store, "p", dp=1, commit_policy=bw.Manual(), pack_steps=1)
    try:
        gate = store.pause("put_if_absent", re.escape(keys.LOG_PREFIX) + r"\d+\.json")
        producer.append(tgb("p", 0, 1))
        with pytest.raises(bw.FlushTimeoutError, match="1 TGB\\(s\\) uncommitted") as late:
            producer.flush(timeout_s=0.2)
        assert isinstance(late.value, TimeoutError) and late.value.uncommitted == 1
        gate.wait_reached()
        gate.release()
        producer.flush(timeout_s=30)  # the pending TGB is committed after all
        assert bw.inspect_namespace(store).producers["p"]["offset"] == 1
    finally:
        store.release_all()
        producer.close()
