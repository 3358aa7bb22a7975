"""One producer's commits under a one-producer policy (DAC, naive, fixed, AIMD): the
background commit loop, the inline commit of ``background_commit=False`` (the paper's
Algorithm 1), and the failure bookkeeping that group commit (``turns``) shares.

``CommitLoop`` is given what it needs: the journal, the store, the policy, the state it
shares with its producer (``SharedState``) and two callbacks into the producer.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable

from batchweave import log, logrules, retry
from batchweave.commit.policies import CommitPolicy
from batchweave.commit.shared import SharedState
from batchweave.errors import NotDurableError, StoreError, TransientStoreError
from batchweave.journal import Journal
from batchweave.log import LogState, TGBDescriptor
from batchweave.store import Store

__all__ = ["CommitLoop", "PublishedMetrics", "note_store_failure", "without_stall"]

# The producer's own messages: users and tests filter on the producer's logger.
_logger = logging.getLogger("batchweave.producer")
# Consecutive failed commit attempts before the producer gives up, for errors the store
# does not retry itself (access denied, a request it refuses): they may be short-lived
# (credentials being rotated), so a few attempts with backoff. A storm of throttling or
# server errors never counts here: the store retries those until its deadline.
_MAX_STORE_FAILURES = 10

# The counters a commit publishes in the log for ``committing`` more of our TGBs, or None.
PublishedMetrics = Callable[[int], "dict[str, float] | None"]


def note_store_failure(shared: SharedState, store: Store, exc: StoreError) -> bool:
    """Count a failed commit attempt; False once the producer has failed for good.

    A TransientStoreError that the store retried until its deadline (storage option
    ``retry_deadline_s``) is final at once: minutes of throttling or outage already
    passed, and more attempts would only hide it; so is a NotDurableError, which no
    attempt of this store can cure. Anything shorter (a storm ends
    within the deadline, so the store never raises) never gets here.
    """
    shared.store_failures += 1
    _logger.warning(
        "producer %s: commit attempt failed (%d in a row): %s", shared.producer_id, shared.store_failures, exc
    )
    retried_out = isinstance(exc, TransientStoreError) and exc.retried_s >= store.retry_deadline_s
    if retried_out or isinstance(exc, NotDurableError) or shared.store_failures >= _MAX_STORE_FAILURES:
        shared.fail(exc)
        return False
    time.sleep(min(5.0, 0.1 * 2**shared.store_failures) * random.random())
    return True


def without_stall(store: Store, window_s: float, stalled_before_s: float) -> float:
    """``window_s`` less the seconds the store spent retrying since ``stalled_before_s``
    was read. A commit that rode out throttling measured the storm, not the log's
    contention: DAC spaces commits about 9 fragile windows apart, so one 60 s window
    would hold every commit back for minutes after the store recovered."""
    return max(0.0, window_s - (store.stalled_s - stalled_before_s))


class CommitLoop:
    """Commits a producer's pending TGBs when its policy says so.

    ``active_producers`` (called under the producer's condition) counts the producers
    contending for the log; ``published_metrics`` gives the counters a commit carries.

    Each attempt learns the head by reading only the head where it can
    (``Journal.commit(jump=True)``): what it reads and decodes per attempt is then flat in
    the number of producers. The state it keeps is then behind on other producers'
    offsets and ``last_version`` (``LogState.skipped_through``), so the count of
    contending producers is also taken from the number of versions others committed
    between two attempts (``SharedState.between_looks``, which ``active_producers``
    reads). A producer with ``max_lag`` reads every version as before: its share of
    ``max_lag`` counts the producers recorded in the last versions
    (``lifecycle.backpressure.active_producers``), which only a full read knows.
    """

    def __init__(
        self,
        shared: SharedState,
        journal: Journal,
        store: Store,
        policy: CommitPolicy,
        active_producers: Callable[[], int],
        published_metrics: PublishedMetrics,
    ) -> None:
        self._shared = shared
        self._journal = journal
        self._store = store
        self._policy = policy
        self._active_producers = active_producers
        self._published_metrics = published_metrics
        self._last_attempt = time.monotonic()
        self._conflict_streak = 0
        self._jump = shared.committed_spans is None  # no max_lag (see the class doc)

    def run(self) -> None:
        """The background commit thread's body."""
        shared = self._shared
        retry.stop_retrying_when(shared.abandoned)
        while True:
            with shared.cond:
                batch = self._wait_for_work()
                if batch is None:
                    return
                forced = shared.forced
            if not self._commit_once(batch, forced):
                return

    def commit_inline(self, target: int, forced: bool) -> None:
        """background_commit=False: commit in the caller's thread (paper, Algorithm 1)."""
        shared = self._shared
        while shared.error is None and shared.committed_offset() < target:
            since = time.monotonic() - self._last_attempt
            if not forced and self._policy.wait_s(len(shared.pending), since) > 0:
                break
            self._commit_once(list(shared.pending), forced)
            if not forced:
                break  # one attempt per append; a flush retries until everything is in
        if shared.error is not None:
            raise shared.error

    def close(self) -> None:
        """Nothing to release: the loop holds no thread or cache of its own."""

    def _wait_for_work(self) -> list[TGBDescriptor] | None:
        """Under the lock: the batch to commit now, or None when the thread should stop."""
        shared = self._shared
        while True:
            if shared.stopping:
                return None
            if shared.pending:
                forced = shared.forced
                since = time.monotonic() - self._last_attempt
                wait = 0.0 if forced else self._policy.wait_s(len(shared.pending), since)
                if wait <= 0:
                    return list(shared.pending)
            else:
                wait = math.inf
            shared.cond.wait(None if math.isinf(wait) else wait)

    def _commit_once(self, batch: list[TGBDescriptor], forced: bool) -> bool:
        """One attempt with its bookkeeping; False once the producer has failed for good."""
        stalled_before_s = self._store.stalled_s
        try:
            success, window_s = self._attempt(batch)
            self._shared.store_failures = 0
        except StoreError as exc:
            return note_store_failure(self._shared, self._store, exc)
        except Exception as exc:  # fenced, ended, a damaged log, or a bug: all final
            # Whatever it is, the caller's next append/flush raises it instead of waiting
            # for a commit thread that is gone.
            self._shared.fail(exc)
            return False
        with self._shared.cond:  # metrics() reads the same tracker from the caller's thread
            producers = self._active_producers()
        self._policy.observe(without_stall(self._store, window_s, stalled_before_s), producers, success)
        self._last_attempt = time.monotonic()
        self._conflict_streak = 0 if success else self._conflict_streak + 1
        if not success and forced:
            # A flush retries without the policy's gap, but with exponential backoff and
            # full jitter, so a pool that flushes at once (end of an epoch, shutdown)
            # thins out instead of colliding again in lockstep.
            time.sleep(random.uniform(0, min(2.0, window_s * 2**self._conflict_streak)))
        return True

    def _attempt(self, batch: list[TGBDescriptor]) -> tuple[bool, float]:
        """One commit attempt: catch up, rebase, conditional put. Returns (success, fragile window s)."""
        shared = self._shared

        def commit(state: LogState) -> log.LogVersion | None:
            remaining = logrules.pending_after_rebase(
                state, shared.producer_id, shared.me, batch, shared.schema, self._store.url
            )
            if not remaining:
                return None
            shared.metrics["attempts"] += 1  # before publishing: the counters include this attempt
            published = self._published_metrics(len(remaining))
            return logrules.build_commit(
                state, shared.producer_id, shared.me, remaining, time.time(), published, shared.schema
            )

        looked_at = shared.state.version
        result = self._journal.commit(shared.state, commit, max_attempts=1, jump=self._jump)
        committed = result.outcome == "committed"
        with shared.cond:
            shared.between_looks.observe(result.state.version - looked_at - committed)
        shared.metrics["successes"] += committed
        shared.metrics["conflicts"] += result.conflicts
        if result.outcome != "nothing":
            shared.metrics["last_fragile_window_s"] = result.fragile_window_s
        with shared.cond:
            shared.take(result.state)
            shared.cond.notify_all()
        return result.outcome != "conflict", result.fragile_window_s
