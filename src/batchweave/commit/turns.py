"""Group commit's turn-taking loop: one producer's side of ``batchweave.commit.group``.

Each producer publishes intents for its TGBs, follows the log, and commits when its turn
comes, folding the others' intents with its own TGBs. ``GroupTurns`` is given what it
needs: the journal, the store, the intent board, the group policy, the state it shares
with its producer (``SharedState``) and a callback for the counters a commit publishes.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator

from batchweave import log, logrules, retry
from batchweave.commit.group import GroupCommit, build_group_commit, follow_pause_s, turn_rank
from batchweave.commit.intents import IntentBoard
from batchweave.commit.loop import PublishedMetrics, note_store_failure, without_stall
from batchweave.commit.shared import SharedState
from batchweave.errors import StoreError
from batchweave.intent import Intent, intent_key
from batchweave.journal import Journal
from batchweave.log import LogState
from batchweave.store import Store

__all__ = ["GroupTurns"]


class GroupTurns:
    """Publishes intents, follows the log, and commits when it is this producer's turn."""

    def __init__(
        self,
        shared: SharedState,
        journal: Journal,
        store: Store,
        intents: IntentBoard,
        group: GroupCommit,
        published_metrics: PublishedMetrics,
    ) -> None:
        self._shared = shared
        self._journal = journal
        self._store = store
        self._intents = intents
        self._group = group
        self._published_metrics = published_metrics
        self._conflict_streak = 0
        self._published_to = shared.me.offset  # intents cover offsets below this
        self._published: list[tuple[str, int]] = []  # this incarnation's intents: (key, end offset)
        self._version_seen = (shared.state.version, time.monotonic())  # newest version, when it was committed
        self._seen_committed_at: float | None = None  # the newest version's build time
        self._noticed_at = time.monotonic()  # when we first saw the newest version
        self._turn = (-1, 0, 0.0)  # (version, our rank after it, when our turn comes)
        self._flush_since: float | None = None  # when the current flush began
        self._published_for = (-1, 0)  # (the newest version seen, the interval after it) of our last intent
        self._follow_after = 0.0  # when the loop reads the log again
        self._prefetched_for = -1  # the version after which we last read intents ahead

    def run(self) -> None:
        """The background commit thread's body."""
        shared = self._shared
        retry.stop_retrying_when(shared.abandoned)
        while True:
            with shared.cond:
                if shared.stopping:
                    return
                if not shared.pending:
                    shared.cond.wait()
                    continue
                forced = shared.forced
            if not self.take_a_pass(forced):
                return

    def step(self) -> bool:
        """One pass of ``run``'s loop, in the caller's thread: publish intents, follow the
        log, commit if this producer's turn came (a wait inside is the producer's
        condition's). For a driver that runs the commit thread's passes itself, the
        deterministic simulation, whose producers' threads never start; never while the
        commit thread runs. Returns False, having done nothing, when nothing is pending
        (``run`` would wait for an append). Raises the producer's final error (fenced,
        ended, a damaged log) as its ``append`` would; a failing store is retried by the
        next step, as by the loop."""
        shared = self._shared
        with shared.cond:
            error, pending, forced = shared.error, bool(shared.pending), shared.forced
        if error is not None:
            raise error
        if not pending:
            return False
        self.take_a_pass(forced)  # a final error (fenced, ended, a damaged log) is kept
        with shared.cond:
            error = shared.error
        if error is not None:
            raise error
        return True

    @contextlib.contextmanager
    def flushing(self) -> Iterator[None]:
        """Within: every ``step`` is a flush's, forced (``SharedState.forced``), as while
        ``Producer.flush`` waits."""
        shared = self._shared
        with shared.cond:
            shared.flush_waiters += 1
        try:
            yield
        finally:
            with shared.cond:
                shared.flush_waiters -= 1

    def commit_inline(self, target: int, forced: bool) -> None:
        """Never called: group commit needs the commit thread (``GroupCommit.background_only``)."""
        raise RuntimeError("group commit takes turns on the commit thread; it has no inline commit")

    def close(self) -> None:
        self._intents.close()

    def take_a_pass(self, forced: bool) -> bool:
        """One pass with its failure bookkeeping; False once the producer has failed for good."""
        try:
            self._step(forced)
            self._shared.store_failures = 0
        except StoreError as exc:
            return note_store_failure(self._shared, self._store, exc)
        except Exception as exc:  # fenced, ended, a damaged log, or a bug: all final
            self._shared.fail(exc)
            return False
        return True

    def _step(self, forced: bool) -> None:
        """One pass: publish, look at the log, then commit if the turn has come, else wait."""
        shared = self._shared
        was_alone = self._alone()
        self._publish_intents(forced)
        now = time.monotonic()
        followed = forced or now >= self._follow_after
        looked_at = -1  # the intent requests made when the log was last read in this pass
        if followed:
            # Not on every wake-up: appends wake this loop, and a producer appending
            # hundreds of TGBs a second would read the log as often. Near its turn a
            # quarter interval keeps the turn clock; far from it, the pool's budget on
            # the head key (``follow_pause_s``); a commit reads on to the newest version.
            self._follow_log()
            self._follow_after = time.monotonic() + self._follow_pause_s(forced)
            if was_alone and not self._alone():
                # Alone no more: another has claimed since this producer last looked. Its
                # intent goes out now, in this pass, as it would have before the look (in a
                # pool flushing together the first to flush folds it at once).
                self._publish_intents(forced)
            looked_at = self._intents.requests
        with shared.cond:
            if not shared.pending:
                # Another's turn folded all of ours: no attempt, and no listing of every
                # intent (in a flushing pool each stand-in would list them all).
                return
        due = self._turn_due(forced)
        if time.monotonic() < due:
            self._prefetch_intents()
            # Wake for the turn, to look at the log again, or to publish what lingered.
            poll_s = self._group.interval_s if not forced else self._group.stagger() / 2
            wake = min(due, time.monotonic() + poll_s)
            for moment in (self._publish_from(), self._prefetch_from()):
                if moment > time.monotonic():
                    wake = min(wake, moment)
            with shared.cond:
                if shared.pending and forced == shared.forced:
                    shared.cond.wait(max(0.0, wake - time.monotonic()))
            return
        if self._commit_once(forced, looked_at) or not forced:
            self._conflict_streak = 0
            return
        # A flush that lost the race backs off with full jitter before it tries again:
        # the winner has most likely folded our intent already.
        self._conflict_streak += 1
        time.sleep(random.uniform(0, min(2.0, self._group.stagger() * 2**self._conflict_streak)))

    def _follow_pause_s(self, forced: bool) -> float:
        """A quarter interval while this producer has TGBs no intent covers yet: its intent
        must land just before the next turn's committer reads them, and that moment is
        counted from the newest version (budgeting it cost 128 paced producers a P95 of
        2.0 s instead of 1.2 s). Otherwise, waiting for a fold, ``follow_pause_s``."""
        with self._shared.cond:
            unpublished = any(t.source_offset >= self._published_to for t in self._shared.pending)
        if forced or unpublished:
            return self._group.interval_s / 4
        seen = self._version_seen[1]
        state = self._shared.state
        rank = turn_rank(state, self._shared.producer_id, self._group.active_versions)
        # Every producer the log knows follows alike, not only the rotation's few.
        producers = len(state.producers)
        return follow_pause_s(rank, producers, self._group.interval_s, time.monotonic() - seen, random.random())

    def _alone(self) -> bool:
        """Whether the log, as this producer last read it, knows no other producer. Then
        nobody can have an intent to fold (a producer claims before it publishes) nor fold
        ours: a lone producer publishes and lists none and commits its own TGBs, three
        requests fewer per commit (an intent's put and delete, the listing). One that
        claimed since is seen at the next look; until then its intents wait one turn, as
        any intent written after a listing does."""
        with self._shared.cond:
            return self._shared.state.producers.keys() <= {self._shared.producer_id}

    def _prefetch_from(self) -> float:
        """When the next committer (rank 0) reads the intents written for its turn (a
        quarter lead after they were due, time for their puts): at the turn it folds these, with no request on its
        critical path but the version's probe and put."""
        if self._turn[1] != 0 or self._prefetched_for == self._version_seen[0] or self._alone():
            return math.inf
        return self._first_publish_at() + self._group.intent_lead_s / 4

    def _prefetch_intents(self) -> None:
        if time.monotonic() >= self._prefetch_from():
            version = self._version_seen[0]
            self._intents.others(self._shared.state)
            self._prefetched_for = version

    def _first_publish_at(self) -> float:
        return self._version_seen[1] + self._group.publish_after_version_s()

    def _publish_slot(self) -> tuple[int, float]:
        """Which interval after the newest version we know of this is, and when its
        intent is due. Intents go out once an interval on our own clock, whether or not
        we have seen the versions since (a producer far from its turn reads the log
        seldom): the committer of each turn then finds what was appended before it."""
        first, interval = self._first_publish_at(), self._group.interval_s
        slot = max(0, math.floor((time.monotonic() - first) / interval))
        return slot, first + slot * interval

    def _publish_from(self) -> float:
        """When the next intent is due (never for a producer alone)."""
        if self._alone():
            return math.inf
        slot, due = self._publish_slot()
        if self._published_for == (self._version_seen[0], slot):
            return due + self._group.interval_s
        return due

    def _publish_intents(self, forced: bool) -> None:
        """Write the TGBs that have no intent yet as one intent, once per version, shortly
        before the next turn (or at once for a flush): whoever commits then folds them.
        TGBs appended after it wait for the next version's intent."""
        shared = self._shared
        if self._alone():
            return
        with shared.cond:
            version = self._version_seen[0]
            slot, due = self._publish_slot()
            if not forced and (self._published_for == (version, slot) or time.monotonic() < due):
                return
            batch = [t for t in shared.pending if t.source_offset >= self._published_to]
        if not batch:
            return
        end = self._intents.publish(shared.me.epoch, batch)
        with shared.cond:
            self._published.append((intent_key(shared.producer_id, shared.me.epoch, batch[0].source_offset), end))
            self._published_to = max(self._published_to, end)
            self._published_for = (version, slot)

    def _follow_log(self) -> None:
        """Read the versions committed since we last looked (one GET when there are none)."""
        state, read = self._journal.catch_up(self._shared.state)
        if read:
            self._adopt(state, self._journal.newest_committed_at)

    def _adopt(self, state: LogState, committed_at: float | None) -> None:
        """Take ``state`` as the newest: drop committed TGBs, restart the turn clock and
        delete our intents the log now holds."""
        shared = self._shared
        with shared.cond:
            if state.version > self._version_seen[0]:
                self._observe_gap(state.version, committed_at, turn=state.steps > shared.state.steps)
                self._version_seen = (state.version, self._committed_when(committed_at))
            offset = shared.take(state)
            self._published_to = max(self._published_to, offset)
            shared.cond.notify_all()
        if self._published:
            self._published = self._intents.collect(state, self._published)

    def _observe_gap(self, version: int, committed_at: float | None, turn: bool) -> None:
        """Group commit learns how late turns are taken from consecutive versions' build
        times (``GroupCommit.observe_gap``): every producer, from every version it sees
        that carries TGBs (a claim is not a turn). Two versions may come from hosts whose
        clocks disagree: the gap is never taken as longer than we saw pass between them
        on our own clock."""
        previous, self._seen_committed_at = self._seen_committed_at, committed_at
        noticed, self._noticed_at = self._noticed_at, time.monotonic()
        if committed_at is None or previous is None or not turn:
            return
        if version == self._version_seen[0] + 1:  # versions read together: only the newest's time is known
            self._group.observe_gap(min(committed_at - previous, self._noticed_at - noticed))

    def _committed_when(self, committed_at: float | None) -> float:
        """The newest version's commit time on our monotonic clock. Turns count from it,
        not from when each producer happened to notice the version, so every producer's
        clock starts together (hosts' clocks agree to well under a turn; a clock that does
        not cannot push the start later than now or earlier than one interval ago)."""
        now = time.monotonic()
        if committed_at is None:
            return now
        age = min(max(0.0, time.time() - committed_at), self._group.interval_s)
        return now - age

    def _turn_due(self, forced: bool) -> float:
        """When this producer commits if no newer version shows up first.

        A flush (``forced``) keeps the order of turns but not the interval, and steps one
        commit's time per rank: when a whole pool flushes at once (the end of a run), the
        first folds everybody's intents and the others find their TGBs committed instead
        of colliding with it.
        """
        version, seen = self._version_seen
        if self._turn[0] != version:
            rank = turn_rank(self._shared.state, self._shared.producer_id, self._group.active_versions)
            self._turn = (version, rank, seen + self._group.wait_after_version_s(rank))
        _, rank, due = self._turn
        if not forced:
            self._flush_since = None
            return due
        if self._flush_since is None:
            self._flush_since = time.monotonic()
        return min(due, max(seen, self._flush_since) + rank * self._group.stagger() / 2)

    def _commit_once(self, forced: bool = True, looked_at: int = -1) -> bool:
        """One attempt: read the others' intents, then fold them with our own pending TGBs.
        False when another writer took the version. Unless ``forced`` (a flush), the
        attempt gives way to a version that landed since the turn began. ``looked_at``:
        the intent requests made when this pass read the log (-1: it did not); with none
        since, the attempt puts without probing the head again (``Journal.commit``'s
        ``probed``)."""
        shared = self._shared
        stalled_before_s = self._store.stalled_s
        turn_version, rank, _ = self._turn
        intents = self._intents_for_turn(forced, turn_version, rank)
        probed = looked_at == self._intents.requests
        with shared.cond:
            batch = list(shared.pending)

        def commit(state: LogState) -> log.LogVersion | None:
            remaining = logrules.pending_after_rebase(
                state, shared.producer_id, shared.me, batch, shared.schema, self._store.url
            )
            if state.end_of_stream:
                return None  # pending_after_rebase raised if any of ours were left
            if not forced and state.version > turn_version:
                # Somebody took this turn while we listed the intents: it folded ours if
                # they were published; the rest waits for the next turn. Racing on for the
                # next version would only cost the pool a conflict or an extra version.
                return None
            shared.metrics["attempts"] += 1
            published = self._published_metrics(len(remaining))
            return build_group_commit(
                state, shared.producer_id, shared.me, remaining, intents, time.time(), published, shared.schema
            )

        result = self._journal.commit(shared.state, commit, max_attempts=1, probed=probed)
        shared.metrics["successes"] += result.outcome == "committed"
        shared.metrics["conflicts"] += result.conflicts
        if result.outcome != "nothing":
            shared.metrics["last_fragile_window_s"] = result.fragile_window_s
            self._group.observe_commit(without_stall(self._store, result.fragile_window_s, stalled_before_s))
            if result.outcome == "committed":
                self._group.won_race()
            else:
                self._group.lost_race()
        committed_at = result.delta.committed_at if result.delta is not None else self._journal.newest_committed_at
        self._adopt(result.state, committed_at)
        return result.outcome != "conflict"

    def _intents_for_turn(self, forced: bool, turn_version: int, rank: int) -> list[Intent]:
        """The intents a commit folds. Listing and reading them is most of a commit's time
        on a loaded store, so only the one whose turn it is pays for it, once: rank 0 read
        them ahead (``_prefetch_intents``) and folds what it read then (an intent written
        since waits one turn); a stand-in folds only what it read at an earlier turn and
        commits its own TGBs, so a missing rank 0 costs one stagger, not a pile of
        listings (the next version's rank 0 folds the rest). A flush lists: its producer
        is leaving, and the first to flush folds the others'. A producer alone reads none."""
        if self._alone():
            return []
        if forced or (rank == 0 and self._prefetched_for != turn_version):
            return self._intents.others(self._shared.state)
        return self._intents.cached()
