"""A producer's ``max_lag`` backpressure: the I/O around ``batchweave.lifecycle.backpressure``.

``MaxLag.wait`` holds ``append`` while this producer's share of ``max_lag`` is taken
(``backpressure.measure``). While there is room it makes no request; held, it reads
``W_global`` again with backoff within the pool's budget on the head key
(``backpressure.poll_pause_s``), and held past ``HELD_WARNING_S`` it logs once what holds
it. At its close, a producer with ``max_lag`` records in the log that it left
(``MaxLag.leave``), so the others' shares stop counting it at once. ``MaxLag`` is given the
store, the state the producer shares with its commit thread, and how many TGBs its pack
writer holds; nothing else of the producer.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from batchweave import logrules, retry
from batchweave.commit.policies import ClaimBackoff
from batchweave.commit.shared import SharedState
from batchweave.errors import BatchWeaveError, StoreError
from batchweave.journal import Journal
from batchweave.lifecycle.backpressure import (
    ACTIVE_VERSIONS,
    MAX_BACKOFF_S,
    Hold,
    Shares,
    adjusted_message,
    held_message,
    listed_checkpoints,
    measure,
    pinned_by_checkpoint,
    pinned_by_reclaim,
    poll_pause_s,
    shares,
)
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, MarkCache, global_watermark, read_watermarks
from batchweave.log import LogState
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.store import Store

__all__ = ["HELD_WARNING_S", "MaxLag"]

_logger = logging.getLogger("batchweave.producer")  # the producer's messages, under the producer's name
# A producer held by max_lag this long says what holds it, once per hold: its share or the
# pool's bound, and the checkpoint or the collection that W_global waits for.
HELD_WARNING_S = 60.0
# Set: the store's retries of a producer's last record end at once (``MaxLag.leave``).
_NO_RETRIES = threading.Event()
_NO_RETRIES.set()


class _Look(NamedTuple):
    """What a held producer's look at W_global found: the step, whether it is the log's
    reclaim point (the namespace was collected), and else the name of the oldest live
    checkpoint, which pins it (None: no checkpoint is live)."""

    steps: int
    collected: bool
    checkpoint: str | None


class MaxLag:
    """One producer's room under ``max_lag`` (module doc)."""

    def __init__(self, max_lag: int, store: Store, shared: SharedState, held: Callable[[], int]) -> None:
        self.max_lag = max_lag
        self._store = store
        self._shared = shared
        self._held = held  # TGBs held for a pack: uploaded soon, so they count
        self._w_global_steps = 0  # cached; refreshed only while append is held back
        self._marks: MarkCache = {}  # the watermarks read while held: each is read once
        self._reclaim_view: tuple[Journal[Any], LogState] | None = None  # the log as a held producer reads it
        self._pool: Shares | None = None  # this producer's share of max_lag, as of log version _pool_version
        self._pool_version = -1
        self._warn_above = max_lag  # a pool bound above this gets a WARNING (``_pool_shares``)
        shared.committed_spans = []
        with shared.cond:  # at start: says so if max_lag is below the producers sharing it
            self._pool_shares()

    def wait(self) -> None:
        """Hold ``append`` while this producer's share of ``max_lag`` is taken by its own
        TGBs at or past ``W_global``, committed or only uploaded, or the committed steps it
        sees leave no room (``lifecycle.backpressure``). Woken by our own commits; W_global
        is read again with backoff, within the pool's budget (``backpressure.poll_pause_s``),
        and only while held (``_read_w_global``). Held past ``HELD_WARNING_S``, it says once
        what holds it (``_warn_held``). Raises what makes the producer unusable."""
        shared, pause = self._shared, 0.05
        # The cached W_global goes first: no request while there is room. Then a first look
        # at a random moment within the pool's budget: a pool is often held all at once.
        held_since, warned = time.monotonic(), False
        poll_at = held_since + random.uniform(0, self._known_producers() / HEAD_BUDGET_PER_S)
        while True:
            with shared.cond:
                shared.raise_if_unusable(self._store.url)
                if self._room().room:
                    return
                shared.cond.wait(max(0.0, poll_at - time.monotonic()))
                if self._room().room:
                    return
            if time.monotonic() >= poll_at:
                look = self._read_w_global()
                self._w_global_steps = look.steps
                poll_at = time.monotonic() + poll_pause_s(pause, self._known_producers(), random.random())
                pause = min(MAX_BACKOFF_S, pause * 2)
                if not warned and time.monotonic() - held_since > HELD_WARNING_S:
                    warned = self._warn_held(time.monotonic() - held_since, look)

    def _warn_held(self, held_s: float, look: _Look) -> bool:
        """Log what holds this producer (``backpressure.held_message``), from what its look
        read; False when that look gave it room (nothing to tell). Once the namespace was
        collected, the look read only the log's reclaim point: one listing of
        ``_checkpoints/`` (once per hold, never per look) says whether a checkpoint was
        released since, that is whether a collection is what it waits for."""
        with self._shared.cond:
            hold = self._room()
        if hold.room:
            return False
        if look.collected:
            pinned = pinned_by_reclaim(look.steps, self._listed_checkpoints(), self._store.url)
        else:
            pinned = pinned_by_checkpoint(look.checkpoint, look.steps)
        _logger.warning("%s", held_message(self._shared.producer_id, held_s, hold, pinned))
        return True

    def _listed_checkpoints(self) -> tuple[list[str], list[str]] | None:
        """The checkpoints one listing shows (``backpressure.listed_checkpoints``); None if
        the store failed (the warning then says less)."""
        try:
            return listed_checkpoints(info.key for info in self._store.list(CHECKPOINT_PREFIX))
        except StoreError:
            return None

    def _known_producers(self) -> int:
        """Every producer the log knows, in the newest state we hold: any may be held and
        looking alike (a held producer commits nothing, so "active lately" would leave
        the held ones out)."""
        with self._shared.cond:
            known = len(self._shared.state.producers)
        if self._reclaim_view is not None:
            known = max(known, len(self._reclaim_view[1].producers))
        return max(1, known)

    def _read_w_global(self) -> _Look:
        """W_global in steps, as a held producer reads it, and whether it came from a
        collection. Once the namespace has been collected, it is the log's reclaim point:
        a probe of the head (on a read-only journal of our own: the commit thread owns
        the other), however many ranks marked, and proven like every view of the log.
        What is stored is what collection has not reclaimed, so that is what ``max_lag``
        bounds; reading every watermark instead cost each held producer one GET per mark
        and checkpoint (1,250 marks x 1,000 producers: 1.25 million GETs a checkpoint).
        Before any collection: the watermarks (a listing, and each new mark once), and the
        name of the checkpoint that pins W_global with them."""
        if self._reclaim_view is None:
            journal = Journal(self._store, heads_only=True, read_only=True)
            self._reclaim_view = (journal, journal.load_state())
        journal, state = self._reclaim_view
        state, _ = journal.catch_up(state)
        self._reclaim_view = (journal, state)
        if state.reclaimed.steps > 0:
            # The reclaim point alone: it only moves up, where a W_global read from the
            # marks before may have been above it (a checkpoint marked lower since).
            return _Look(state.reclaimed.steps, True, None)
        live = global_watermark(read_watermarks(self._store, self._marks))
        return _Look(0, False, None) if live is None else _Look(int(live.position), False, live.checkpoint)

    def _room(self) -> Hold:
        """Under ``shared.cond``: this producer's room under ``max_lag``. The share
        (O(producers) to work out) is kept per log version, and spans are pruned only
        when W_global moved."""
        shared = self._shared
        pool = self._pool_shares()
        w_global = self._w_global_steps
        spans = shared.committed_spans or []
        if spans and spans[0].end <= w_global:
            spans = shared.committed_spans = [s for s in spans if s.end > w_global]
        return measure(shared.state, pool, len(shared.pending) + self._held(), spans, w_global)

    def _pool_shares(self) -> Shares:
        """Under ``shared.cond``: this producer's share among the producers active in the
        newest state, worked out once per log version. Logs a WARNING when ``max_lag`` is
        below the producers sharing it (each then takes one TGB), and again each time the
        pool it sees has doubled since: a pool of 1,000 that starts one by one with too
        small a max_lag logs about 10 lines per producer, not one per producer joining."""
        state = self._shared.state
        if self._pool is None or self._pool_version != state.version:
            self._pool, self._pool_version = shares(state, self._shared.producer_id, self.max_lag), state.version
            if self._pool.bound > self._warn_above:
                self._warn_above = 2 * self._pool.bound - 1
                _logger.warning("%s", adjusted_message(self._shared.producer_id, self._pool))
        return self._pool

    def leave(self, journal: Journal[Any], patient: bool) -> None:
        """Record in the log that this incarnation closed (``logrules.build_leave``), so the
        others' shares of ``max_lag`` stop counting it at once: one log version per close,
        paid by producers with ``max_lag`` only. Those share it, as the pool's producers
        all do where it is used; one without it holds to no share, and a version per close
        everywhere (a pool of 1,000 ending) would buy nothing where nobody uses it. Such a
        producer, closed, counts in a max_lag producer's shares for ``ACTIVE_VERSIONS``
        versions, as a crashed one does: a smaller share, never none.

        After a clean close it waits its turn as a claim does; otherwise (closed without a
        flush, or failing) it makes a few attempts without the store's retries: a producer
        stopped by Ctrl-C must not wait out a storm for it. ``journal`` is the producer's,
        once its commit thread has stopped."""
        with self._shared.cond:
            state, me = self._shared.state, self._shared.me
        if state.end_of_stream:
            return  # nobody appends any more: nothing to give back
        backoff = ClaimBackoff()
        previous = retry.stop_event()
        if not patient:
            retry.stop_retrying_when(_NO_RETRIES)
        try:
            result = journal.commit(
                state,
                lambda newest: logrules.build_leave(newest, self._shared.producer_id, me, time.time()),
                max_attempts=None if patient else 3,
                after_conflict=lambda window_s: time.sleep(backoff.pause_s(window_s)),
            )
        except BatchWeaveError as exc:
            outcome = f"failed: {exc}"
        else:
            with self._shared.cond:
                self._shared.state = result.state
            outcome = "" if result.outcome != "conflict" else "lost every race for the next log version"
        finally:
            retry.stop_retrying_when(previous)
        if outcome:
            _logger.info(
                "producer %r: recording in the log that it closed %s; the others count it for at most %d more "
                "log versions",
                self._shared.producer_id,
                outcome,
                ACTIVE_VERSIONS,
            )
