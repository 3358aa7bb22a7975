"""Group commit's schedule (``commit.turns``), pass by pass on a clock the test moves.

Other tests check what group commit commits; these check *when* each producer publishes
its intent, reads the others' intents ahead, reads the log and takes its turn, which is
what keeps a pool's commits from colliding and its head key within budget. The commit
thread does not run: the test takes each pass (``_step``) itself, and the producer's
condition passes its waits on the clock instead of blocking, so every moment below is
exact. Times are seconds after the newest version was seen.
"""

from __future__ import annotations

import threading
import time as real_time
from dataclasses import dataclass, field

import msgspec
import pytest
from worker import tgb

import batchweave as bw
from batchweave.commit import turns
from batchweave.commit.group import GroupCommit, turn_rank
from batchweave.commit.intents import IntentBoard
from batchweave.commit.turns import GroupTurns
from batchweave.journal import Journal
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.store import open_store

INTERVAL_S = 1.0
STAGGER_S = 0.5
LEAD_S = INTERVAL_S / 2  # GroupCommit's default intent lead
START = 1000.0  # the clock when the test begins


class Clock:
    """``time`` for ``commit.turns``: monotonic seconds the test moves, and a wall clock
    that moves with them (from the real time when the test began, as versions' build times)."""

    def __init__(self) -> None:
        self.now = START
        self._wall_at_start = real_time.time()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self._wall_at_start + (self.now - START)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class ClockedCondition:
    """The producer's condition: a wait returns at once, noting when the pass would wake
    (the scheduler, ``Pool.run``, moves the clock there before this producer's next pass)."""

    def __init__(self, clock: Clock) -> None:
        self._cond = threading.Condition()
        self._clock = clock
        self.wake = clock.now
        self.waits: list[float] = []

    def __enter__(self) -> bool:
        return self._cond.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._cond.__exit__(*exc)

    def notify_all(self) -> None:
        self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None, "a pass with work to do waited without a bound"
        self.waits.append(timeout)
        self.wake = self._clock.now + timeout
        return False


class NoJitter:
    """The policy's random draws: none (turns come at exactly interval + rank * stagger)."""

    def random(self) -> float:
        return 0.0

    def uniform(self, low: float, high: float) -> float:
        return low


@dataclass
class Member:
    producer: bw.Producer
    turns: GroupTurns
    condition: ClockedCondition


@dataclass
class Pool:
    url: str
    clock: Clock
    events: list[tuple[str, str, float]] = field(default_factory=list)  # (producer, what, when)
    members: dict[str, Member] = field(default_factory=dict)

    def join(self, producer_id: str) -> Member:
        policy = GroupCommit(interval_s=INTERVAL_S, stagger_s=STAGGER_S, rng=NoJitter())  # type: ignore[arg-type]
        producer = bw.Producer(self.url, producer_id, dp=1, commit_policy=policy, pack_steps=1)
        turns = producer.committer
        assert isinstance(turns, GroupTurns)
        condition = ClockedCondition(self.clock)
        producer._shared.cond = condition  # type: ignore[assignment]
        self.members[producer_id] = Member(producer, turns, condition)
        return self.members[producer_id]

    def at(self) -> float:
        return self.clock.now - START

    def run(self, until, *, limit_s: float = 3 * INTERVAL_S) -> None:
        """Passes in time order (ties in joining order) until ``until()`` holds; a pass that
        did not wait goes again at once. As the commit thread's loop, each pass is forced
        while a flush waits."""
        passes = 0
        while not until():
            passes += 1
            assert passes < 1000, f"a tight loop at {self.at():.3f} s: {self.events[-5:]}"
            # A producer with nothing pending waits for an append (its loop, ``run``).
            waiting = [m for m in self.members.values() if m.producer._shared.pending]
            assert waiting, f"nothing pending: {self.events}"
            member = min(waiting, key=lambda m: m.condition.wake)
            self.clock.now = max(self.clock.now, member.condition.wake)
            assert self.at() <= limit_s, f"nothing by {limit_s} s: {self.events}"
            member.condition.wake = self.clock.now
            member.turns._step(member.producer._shared.forced)

    def run_to(self, moment: float) -> None:
        """The passes due before ``moment`` (seconds after the start), then the clock to it."""
        self.run(lambda: min(m.condition.wake for m in self.members.values()) > START + moment)
        self.clock.now = START + moment

    def of(self, producer_id: str) -> list[tuple[str, float]]:
        return [(what, when) for who, what, when in self.events if who == producer_id]

    def close(self) -> None:
        for member in self.members.values():
            member.producer.close(flush=False)


@pytest.fixture
def pool(monkeypatch, tmp_path):
    clock = Clock()
    monkeypatch.setattr(turns, "time", clock)
    monkeypatch.setattr(turns, "random", NoJitter())
    monkeypatch.setattr(GroupTurns, "run", lambda self: None)  # the test takes the passes
    made = Pool(str(tmp_path / "ns"), clock)
    publish, others = IntentBoard.publish, IntentBoard.others

    def recorded(what, method):
        def call(self, *args, **kwargs):
            made.events.append((self.producer_id, what, made.at()))
            return method(self, *args, **kwargs)

        return call

    monkeypatch.setattr(IntentBoard, "publish", recorded("publish", publish))
    monkeypatch.setattr(IntentBoard, "others", recorded("read intents", others))
    yield made
    made.close()


def state_of(url: str):
    return Journal(open_store(url)).load_state()


def committed(url: str, producer_id: str) -> int:
    return state_of(url).producers[producer_id].offset


def test_a_lone_producer_commits_on_its_interval_without_intents(pool):
    """Rank 0 of the version after its claim, and alone: it writes no intent and reads
    none (nobody would fold its own, nobody else has any), and commits at the turn, one
    interval after the version. The next turn counts from that version, one interval on.
    (With another producer, rank 0 publishes and reads ahead: the tests below.)"""
    a = pool.join("a")
    a.producer.append(tgb("a", 0, 1))
    pool.run_to(0.8)
    a.producer.append(tgb("a", 1, 1))  # an append wakes the loop: nothing is due then
    a.condition.wake = pool.clock.now
    pool.run(lambda: committed(pool.url, "a") == 2)  # both at the turn: its own TGBs need no intent
    assert pool.at() == pytest.approx(INTERVAL_S)  # the commit: at the turn, not before
    a.producer.append(tgb("a", 2, 1))
    pool.run(lambda: committed(pool.url, "a") == 3)
    assert pool.at() == pytest.approx(2 * INTERVAL_S)
    assert pool.of("a") == []
    # Each wait ends at the turn, never in a tight loop: to the turn, again to it after
    # the append at 0.8 s woke the loop, then to the next turn.
    assert a.condition.waits[:3] == pytest.approx([INTERVAL_S, INTERVAL_S - 0.8, INTERVAL_S])


def test_the_stand_in_gives_way_to_the_version_rank_0_commits_with_its_intent(pool):
    """Two producers: after both claims, ``a`` is rank 0 and ``b`` the stand-in, due one
    stagger later. ``a`` folds ``b``'s intent at its turn; ``b`` reads the log before its
    own turn comes, finds its TGB committed, and makes no commit attempt."""
    a, b = pool.join("a"), pool.join("b")
    a.producer.append(tgb("a", 0, 1))
    b.producer.append(tgb("b", 0, 1))
    pool.run(lambda: committed(pool.url, "a") == 1)
    assert pool.at() == pytest.approx(INTERVAL_S)
    state = state_of(pool.url)
    assert state.producers["b"].offset == 1 and state.version == 3  # one version: both TGBs
    pool.run(lambda: not b.producer._shared.pending, limit_s=INTERVAL_S + STAGGER_S)
    assert b.producer.metrics()["attempts"] == 0
    first = INTERVAL_S - LEAD_S
    assert pool.of("a") == [("publish", pytest.approx(first)), ("read intents", pytest.approx(first + LEAD_S / 4))]
    assert pool.of("b") == [("publish", pytest.approx(first))]
    # ``b`` saw version 3 only at its own turn, half a second after it was built: its clock
    # for the next turn (now rank 0) counts from the version's build, not from then.
    assert pool.at() == pytest.approx(INTERVAL_S + STAGGER_S)
    pool.events.clear()
    b.producer.append(tgb("b", 1, 1))
    pool.run(lambda: committed(pool.url, "b") == 2)
    assert pool.at() == pytest.approx(2 * INTERVAL_S)
    assert pool.of("b") == [
        ("publish", pytest.approx(INTERVAL_S + first)),
        ("read intents", pytest.approx(INTERVAL_S + first + LEAD_S / 4)),
    ]


def flush_both(pool: Pool) -> tuple[Member, Member]:
    """``a`` (rank 0) and ``b`` (the stand-in) flush 0.2 s after the version, until ``a``'s
    turn has committed."""
    b, a = pool.join("b"), pool.join("a")  # at equal moments b's pass comes first: its intent is out
    b.producer.append(tgb("b", 0, 1))
    a.producer.append(tgb("a", 0, 1))
    pool.clock.now = START + 0.2
    for member in (b, a):
        member.condition.wake = pool.clock.now
        member.producer._shared.flush_waiters += 1  # as flush() does
    pool.run(lambda: committed(pool.url, "a") == 1)
    return a, b


def test_a_flushing_pool_commits_in_rank_order_half_a_stagger_apart(pool):
    """A flush (the end of a run) keeps the order of turns but not the interval: rank 0
    commits at once, folding every intent published by then, before the stand-in's turn
    (half a stagger later) comes."""
    a, b = flush_both(pool)
    assert pool.at() == pytest.approx(0.2)
    assert state_of(pool.url).producers["b"].offset == 1  # folded: no version of its own
    assert pool.of("a") == [("publish", pytest.approx(0.2)), ("read intents", pytest.approx(0.2))]
    pool.run(lambda: not b.producer._shared.pending, limit_s=0.2 + STAGGER_S / 2 + 1e-9)
    assert pool.at() == pytest.approx(0.2 + STAGGER_S / 2)  # the stand-in looked at its turn


def test_a_stand_in_whose_tgbs_were_folded_makes_no_attempt_and_lists_nothing(pool):
    """The stand-in of a flushing pool finds its TGB in rank 0's version and neither lists
    the intents nor makes an attempt (it did both once: at 1,000 producers flushing, a
    listing of every intent each)."""
    _, b = flush_both(pool)
    pool.run(lambda: not b.producer._shared.pending, limit_s=0.2 + STAGGER_S / 2 + 1e-9)
    assert b.producer.metrics()["attempts"] == 0
    assert pool.of("b") == [("publish", pytest.approx(0.2))]


def test_far_from_its_turn_a_producer_reads_the_log_on_the_pools_budget(pool):
    """In a pool of 100 (all in the rotation), a producer ten turns away whose TGBs are
    all in an intent looks at the log within the pool's budget on the head key; with a
    TGB no intent covers yet, or flushing, every quarter interval (its intent must land
    just before the next committer reads)."""
    a = pool.join("a")
    shared = a.producer._shared
    me = shared.state.producers["a"]
    others = {f"p{n:03d}": msgspec.structs.replace(me, last_version=shared.state.version) for n in range(99)}
    crowd = {**others, "a": msgspec.structs.replace(me, last_version=shared.state.version)}
    rotation = sorted(crowd)
    version = (rotation.index("a") - 10) % len(rotation) + len(rotation)  # "a" is rank 10 after it
    shared.state = msgspec.structs.replace(shared.state, producers=crowd, version=version)
    a.turns._version_seen = (version, pool.clock.now)
    assert turn_rank(shared.state, "a", GroupCommit().active_versions) == 10
    budget = 100 / HEAD_BUDGET_PER_S * 0.5  # (the jitter's draw is 0 here)
    assert a.turns._follow_pause_s(False) == pytest.approx(budget)
    assert a.turns._follow_pause_s(True) == pytest.approx(INTERVAL_S / 4)
    a.producer.append(tgb("a", 0, 1))  # no intent covers it yet
    assert a.turns._follow_pause_s(False) == pytest.approx(INTERVAL_S / 4)
    a.turns._published_to = 1  # now one does
    assert a.turns._follow_pause_s(False) == pytest.approx(budget)
    pool.clock.now += 8.0  # half an interval before it becomes the stand-in (rank 1), it looks again
    assert a.turns._follow_pause_s(False) == pytest.approx(0.5)
