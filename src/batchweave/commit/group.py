"""Group commit: one log version carries many producers' TGBs. Pure: no clock, no I/O.

With DAC every producer commits its own TGBs, and the gap that keeps conflicts rare
grows with the pool (paper eq. 8), so at 128 producers a TGB waits tens of seconds to
become visible. Group commit separates publishing from committing:

- A producer writes each batch of its pending descriptors as a small immutable
  *intent*, create-only, at ``_intents/<producer>/e<epoch>/<first offset>.json``.
- Whoever commits next folds every visible intent into its version, so one commit
  makes many producers' work visible and a lost race loses nothing: the intents stay
  for the winner or the next committer.
- Producers take turns: the committer after version ``v`` is the ``v``-th of the
  active producers in a rotation every producer computes alike from the log; the
  others wait a little longer each (their *rank*), and a newer version resets every
  clock. So commits come about once per ``interval_s`` whatever the pool size, and a
  dead or idle producer's turn passes to the next after one stagger.

Exactly-once and fencing hold as with direct commits (invariant I3): an intent is
folded only when its epoch is the producer's epoch in the log and it covers the
producer's next offset; only the TGBs from that offset on are taken (a producer may
have committed a prefix itself), and the version records the producer's new offset, so
no intent is ever folded twice and a fenced incarnation's intents never are.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

import msgspec

from batchweave import logrules
from batchweave.errors import ConfigError
from batchweave.intent import Intent
from batchweave.log import LogState, LogVersion, ProducerState, TGBDescriptor
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.schema import Schema

__all__ = [
    "GroupCommit",
    "TurnDelay",
    "build_group_commit",
    "fold_intents",
    "follow_pause_s",
    "rotation",
    "turn_rank",
    "worth_reading",
]

_MIN_STAGGER_S = 0.05
_MAX_STAGGER_S = 2.0  # the least cap of a learned stagger; see GroupCommit.max_stagger_s
_DEFAULT_COMMIT_S = 0.25  # before any commit was timed: a few cloud round trips


def fold_intents(
    state: LogState, intents: Iterable[Intent], schema: Schema | None = None
) -> dict[str, list[TGBDescriptor]]:
    """Per producer, the TGBs the next version may commit from ``intents``: those that
    continue the producer's offset in ``state`` under its current epoch, chained across
    consecutive intents. Anything else (folded already, a fenced epoch, a gap, a layout
    that does not fit, arrays of another schema than the namespace's or, while it has
    none, the committer's ``schema``) is left out: their producer's own turn says why."""
    schema = state.schema or schema
    by_producer: dict[str, list[Intent]] = {}
    for intent in intents:
        by_producer.setdefault(intent.producer, []).append(intent)
    folded: dict[str, list[TGBDescriptor]] = {}
    for producer, mine in sorted(by_producer.items()):
        recorded = state.producers.get(producer)
        if recorded is None:
            continue  # an intent is always written after its producer's claim: not caught up yet
        tgbs = _chain(recorded, sorted(mine, key=lambda i: i.first_offset))
        tgbs = [
            t for t in tgbs if not logrules.layout_mismatch(state.layout, t) and not logrules.schema_mismatch(schema, t)
        ]
        if tgbs:
            folded[producer] = tgbs
    return folded


def worth_reading(state: LogState, listed: Iterable[tuple[str, int, int]]) -> set[tuple[str, int, int]]:
    """Of the intents ``listed`` as (producer, epoch, first offset), from their keys, those
    that may hold TGBs ``state`` lacks: of the producer's epoch in the log, from its offset
    in the log on. A folded intent stays listed until its producer sees the fold and deletes
    it, and each new committer read it again (at 128 producers, every intent about twice).

    One that starts below the producer's offset is folded whole: an offset in the log moves
    to the end of what a fold took (whole intents, chained) or to all its producer had
    pending when it committed itself, intents included (they are written from its pending
    TGBs, on the thread that commits them). Were it not so, the tail would still be
    committed, by its own producer's turn: skipping a read never commits anything twice."""
    wanted: set[tuple[str, int, int]] = set()
    for producer, epoch, first in listed:
        recorded = state.producers.get(producer)
        if recorded is None or (epoch == recorded.epoch and first >= recorded.offset):
            wanted.add((producer, epoch, first))
    return wanted


def _chain(recorded: ProducerState, intents: Sequence[Intent]) -> list[TGBDescriptor]:
    next_offset, tgbs = recorded.offset, []
    for intent in intents:
        if intent.epoch != recorded.epoch or not intent.first_offset <= next_offset < intent.end_offset:
            continue
        tgbs.extend(intent.tgbs[next_offset - intent.first_offset :])
        next_offset = intent.end_offset
    return tgbs


def build_group_commit(
    state: LogState,
    producer_id: str,
    me: ProducerState,
    own: Sequence[TGBDescriptor],
    intents: Iterable[Intent],
    committed_at: float,
    metrics: dict[str, float] | None = None,
    schema: Schema | None = None,
) -> LogVersion | None:
    """The next version: the committer's own pending TGBs (already rebased) and every
    other producer's foldable intents, producers in id order. None if there is nothing.
    ``schema`` is the committer's (see ``logrules.build_commit``)."""
    folded = fold_intents(state, (i for i in intents if i.producer != producer_id), schema)
    if own:
        folded[producer_id] = list(own)
    if not folded:
        return None
    tgbs: list[TGBDescriptor] = []
    producers: dict[str, ProducerState] = {}
    for producer in sorted(folded):
        batch = folded[producer]
        tgbs.extend(batch)
        if producer == producer_id:
            producers[producer] = ProducerState(batch[-1].source_offset + 1, me.epoch, me.incarnation, metrics)
        else:
            recorded = state.producers[producer]
            producers[producer] = msgspec.structs.replace(
                recorded,
                offset=batch[-1].source_offset + 1,
                last_version=0,  # stamped when applied
            )
    return logrules.next_version(
        state, committed_at, tgbs=tgbs, producers=producers, schema=logrules.schema_to_set(state, schema, tgbs)
    )


def turn_rank(state: LogState, producer_id: str, active_versions: int) -> int:
    """This producer's place in the rotation for the version after ``state.version``: 0
    commits first, rank ``r`` after ``r`` staggers. The rotation is the producers the log
    recorded within the last ``active_versions`` versions, rotated by the version; every
    other producer (idle, or not folded lately) ranks after all of them, so an idle one's
    turn is not waited for and, however few the active ones, only one producer has rank
    0: every producer computes the same order from the same version. (Counting oneself
    into the rotation instead gave every producer outside it a rotation of its own, and
    at 128 producers a dozen rank 0s, each reading every intent.)"""
    active = rotation(state, active_versions)
    if producer_id in active:
        return (active.index(producer_id) - state.version) % len(active)
    rest = sorted(({p for p in state.producers if p not in active}) | {producer_id})
    return len(active) + (rest.index(producer_id) - state.version) % len(rest)


def rotation(state: LogState, active_versions: int) -> list[str]:
    """The producers taking turns after ``state.version``: those the log recorded within
    the last ``active_versions`` versions, in id order, but for those that left (closed)."""
    horizon = state.version - active_versions
    return sorted(p for p, s in state.producers.items() if s.last_version > horizon and not s.left)


def follow_pause_s(rank: int, producers: int, interval_s: float, since_version_s: float, draw: float) -> float:
    """How long a producer waits before it reads the log again (probing the head key every
    producer probes). The next committer and its stand-in (ranks 0 and 1) look every
    quarter interval: their turn clock starts at each new version. The others are
    ``rank`` turns away and act only on a schedule (intents go out once per interval on
    their own clock), so they look within the pool's budget on that key, as readers do
    (``reading.polling``: a mean of ``producers / HEAD_BUDGET_PER_S``, ``producers``
    being every one the log knows, jittered by ``draw`` in [0, 1)), and again half an
    interval before the version after which they
    become the stand-in. 1,000 producers then probe the head ~70 times a second, not
    5,000, and a pool of up to 17 looks as often as before."""
    quick = interval_s / 4
    if rank <= 1:
        return quick
    budget = max(quick, producers / HEAD_BUDGET_PER_S) * (0.5 + draw)
    near_turn = (rank - 1.5) * interval_s - since_version_s
    return max(quick, min(budget, near_turn))


class TurnDelay:
    """How late the pool's turns are taken, learned from the log. Pure.

    A stand-in (rank ``r > 0``) must not move before rank 0's version has landed, or
    both put the same version and one loses a race that costs the store a conflict and
    the pool a turn. How long rank 0 takes after its due moment is in the log: every
    version carries its build time (``committed_at``), so the gap between two consecutive
    versions, less the interval, is how late the committer built it (its listing and
    reads of the intents). Every producer sees every gap, so every producer learns the
    same delay from a sample per version, whoever committed. The estimate is a mean and
    a mean deviation (Jacobson's round-trip estimator, as TCP times retransmissions):
    ``mean + 4 * deviation`` covers the slow turns of a loaded store, not just the
    typical one. The seed counts as the first sample. A sample is capped at the current
    estimate, so a turn that a stand-in took (late by a whole stagger) moves the estimate
    by one step (at most 1.875 times itself), never by its own size.

    A lost race doubles a backoff factor (up to ``max_backoff``) and a won one halves it
    back towards 1: a producer that stood in too early waits longer next time.
    """

    def __init__(self, seed_s: float, gain: float = 0.125, dev_gain: float = 0.25, max_backoff: float = 8.0) -> None:
        self.mean_s = seed_s
        self.dev_s = seed_s / 2  # as TCP seeds its variance: wide until samples come in
        self.gain = gain
        self.dev_gain = dev_gain
        self.max_backoff = max_backoff
        self.backoff = 1.0
        self.samples = 0

    def estimate_s(self) -> float:
        """A delay that rank 0's turns exceed rarely, before the backoff."""
        return self.mean_s + 4 * self.dev_s

    def observe_gap(self, gap_s: float, interval_s: float) -> None:
        """Fold one gap between consecutive versions' build times (seconds)."""
        delay = min(max(0.0, gap_s - interval_s), self.estimate_s())
        self.dev_s += self.dev_gain * (abs(delay - self.mean_s) - self.dev_s)
        self.mean_s += self.gain * (delay - self.mean_s)
        self.samples += 1

    def lost(self) -> None:
        self.backoff = min(self.max_backoff, self.backoff * 2)

    def won(self) -> None:
        self.backoff = max(1.0, self.backoff / 2)


class GroupCommit:
    """The group-commit mode, as a commit policy: ``Producer(..., commit_policy="group")``.

    Args:
        interval_s: target time between two versions; visibility latency is about this
            plus one commit, whatever the pool size.
        stagger_s: extra wait per rank before a producer takes a turn that is not its
            own; None: learned. It is how late turns are taken, read from the log's
            build times (``TurnDelay``: mean plus four deviations, doubled after each
            lost race and halved after each win), plus this producer's smoothed time
            to put a version, so the next in line waits until the one before must
            have landed, even on a loaded store; at most ``max(2, 10 * interval_s)``.
        active_versions: a producer is in the rotation while the log recorded it within
            this many versions.
        intent_lead_s: how long before the next turn a producer writes its TGBs so far
            as one intent; None: half of ``interval_s``, so that the intents have landed
            when the next committer reads them (an eighth of an interval later) and it
            has read them by its turn. One intent per producer per
            version, not one per append: each is a put now and a delete later.
        alpha: EMA coefficient of the time to put a version.
    """

    name = "group"
    background_only = True  # its turns are taken on the producer's commit thread

    def __init__(
        self,
        interval_s: float = 0.4,
        stagger_s: float | None = None,
        active_versions: int = 8,
        intent_lead_s: float | None = None,
        alpha: float = 0.2,
        rng: random.Random | None = None,
    ) -> None:
        if not (interval_s > 0 and (stagger_s is None or stagger_s > 0) and active_versions >= 1):
            raise ConfigError(
                f"GroupCommit needs interval_s > 0, stagger_s > 0 or None, active_versions >= 1; got "
                f"interval_s={interval_s}, stagger_s={stagger_s}, active_versions={active_versions}"
            )
        if not ((intent_lead_s is None or intent_lead_s >= 0) and 0 < alpha <= 1):
            raise ConfigError(f"GroupCommit needs intent_lead_s >= 0 and 0 < alpha <= 1; got {intent_lead_s}, {alpha}")
        self.interval_s = interval_s
        self.stagger_s = stagger_s
        self.active_versions = active_versions
        self.intent_lead_s = interval_s / 2 if intent_lead_s is None else min(intent_lead_s, interval_s)
        self.alpha = alpha
        self.rng = rng or random.Random()
        self.commit_ema_s: float | None = None  # seeded by the first observation
        self.delay: TurnDelay | None = None  # seeded with the first commit's duration
        # A learned stagger never exceeds this: a store so slow that turns come later
        # still gets commits (at the price of races), and a wrong sample cannot park a
        # dead producer's turn for minutes.
        self.max_stagger_s = max(_MAX_STAGGER_S, 10 * interval_s)
        self.gap_s = interval_s  # read by Producer.metrics()

    def observe_commit(self, duration_s: float) -> None:
        """Fold the time one commit of ours took to put its version (probe and put) into
        the EMA. The producer seeds it with its claim, and the claim also seeds how late
        turns are taken until the log has shown some."""
        if self.commit_ema_s is None:
            self.commit_ema_s = duration_s
        else:
            self.commit_ema_s = (1 - self.alpha) * self.commit_ema_s + self.alpha * duration_s
        if self.delay is None:
            # Until the log shows how late turns come: a commit is the intents' listing
            # and reads, about another probe and put, before its own; and a claim on an
            # idle store is quicker than turns will be, so never below a few round trips.
            self.delay = TurnDelay(self._seed_s(duration_s))

    def observe_gap(self, gap_s: float) -> None:
        """Two consecutive versions were built ``gap_s`` seconds apart (their ``committed_at``)."""
        self._delay().observe_gap(gap_s, self.interval_s)

    def lost_race(self) -> None:
        self._delay().lost()

    def won_race(self) -> None:
        self._delay().won()

    def _delay(self) -> TurnDelay:
        if self.delay is None:
            self.delay = TurnDelay(self._seed_s(self.commit_ema_s or _DEFAULT_COMMIT_S))
        return self.delay

    def _seed_s(self, commit_s: float) -> float:
        return max(2 * commit_s, min(self.interval_s, _DEFAULT_COMMIT_S))

    def stagger(self) -> float:
        if self.stagger_s is not None:
            return self.stagger_s
        delay = self._delay()
        put_s = self.commit_ema_s or _DEFAULT_COMMIT_S
        learned = delay.backoff * (delay.estimate_s() + put_s)
        return min(self.max_stagger_s, max(_MIN_STAGGER_S, learned))

    def publish_after_version_s(self) -> float:
        """Seconds after a new version is seen until intents are written for the next."""
        return self.interval_s - self.intent_lead_s

    def wait_after_version_s(self, rank: int) -> float:
        """Seconds after a new version is seen until this producer (at ``rank``) commits,
        with a little jitter so two producers that disagree on the rotation rarely
        collide on the same instant."""
        return (self.interval_s + rank * self.stagger()) * (1 + 0.1 * self.rng.random())

    # The CommitPolicy protocol, for code that treats every policy alike; the producer
    # drives group commit through the methods above instead.
    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
        return math.inf if pending_tgbs == 0 else max(0.0, self.interval_s - since_last_attempt_s)

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        pass

    def __repr__(self) -> str:
        return (
            f"GroupCommit(interval_s={self.interval_s}, stagger_s={self.stagger_s}, "
            f"active_versions={self.active_versions})"
        )
