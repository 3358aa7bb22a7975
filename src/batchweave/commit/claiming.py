"""A producer's epoch claim, the I/O around ``batchweave.commit.claims``.

A starting producer writes its ticket, gives the first foldable ticket of a pool that
starts together its turn, then commits a version that gives its incarnation the next
epoch: by its ticket folded into whoever claims next, or by a claim of its own when its
ticket cannot be folded (another incarnation's ticket for the same epoch, or the epoch
passed). The claim is a commit through the journal, proven like every other (I8, I10).
``EpochClaim`` is given the store, the journal, the producer's name and layout and a
check of the schema it declares; nothing else of the producer.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from batchweave import logrules
from batchweave.commit.claims import (
    CLAIM_PREFIX,
    CLAIM_TICKET,
    Ticket,
    build_claims,
    foldable,
    next_epoch,
    parse_claim_key,
)
from batchweave.commit.policies import ClaimBackoff
from batchweave.errors import ObjectExistsError, StoreError, StreamEndedError
from batchweave.journal import Journal
from batchweave.journal.overlap import refuse_overlap
from batchweave.log import Layout, LogState, LogVersion, ProducerState
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.store import Store

__all__ = ["Claimed", "EpochClaim"]


class Claimed(NamedTuple):
    """What a claim left: the new state, this incarnation's producer state, and the
    fragile window (seconds) of the claim's last attempt."""

    state: LogState
    me: ProducerState
    window_s: float


class EpochClaim:
    """One incarnation's claim of the next epoch of ``producer_id`` (module doc)."""

    def __init__(
        self,
        store: Store,
        journal: Journal[Any],
        producer_id: str,
        layout: Layout,
        check_schema: Callable[[LogState], None],
    ) -> None:
        self._store = store
        self._journal = journal
        self._producer_id = producer_id
        self._layout = layout
        self._check_schema = check_schema  # raises SchemaError: a declared schema the namespace refuses

    def claim(self, incarnation: str) -> Claimed:
        """Commit the version that gives ``incarnation`` the next epoch. Refuses a namespace
        of another layout (I9), and one whose schema is not the declared one before the
        claim (a doomed incarnation must not fence a working one) and after it."""
        began = time.monotonic()
        state = self._journal.load_state()
        refuse_overlap(self._store, state)  # a namespace being created: none around it, none inside (I13)
        self._check_schema(state)
        ticket = self._write_ticket(state, incarnation)
        try:
            claimed = self._claim_by_ticket(ticket, state, incarnation, time.monotonic() - began)
            self._check_schema(claimed.state)  # another schema may have landed meanwhile
            return claimed
        finally:
            # Folded or passed: dead either way; and a start that failed must not have its
            # ticket folded later for an incarnation that never ran. One that may not delete
            # (or a failing delete) leaves it to the collector.
            with contextlib.suppress(StoreError):
                self._store.delete_if_allowed(ticket.key)

    def _claim_by_ticket(self, ticket: Ticket, state: LogState, incarnation: str, start_s: float) -> Claimed:
        producer_id, layout = self._producer_id, self._layout
        fresh = self._give_the_first_ticket_its_turn(state, ticket, start_s)

        def claim(state: LogState) -> LogVersion | None:
            nonlocal fresh  # the listing just made serves the first attempt
            mine = state.producers.get(producer_id)
            if mine is not None and mine.incarnation == incarnation:
                return None  # our ticket was folded, or our claim landed although the store reported a conflict
            if state.end_of_stream:
                raise StreamEndedError(
                    f"namespace {self._store.url} was ended at log version {state.version}; "
                    f"producer {producer_id!r} cannot start (use a fresh namespace)"
                )
            if ticket.epoch == next_epoch(state, producer_id):
                tickets, fresh = fresh or self._tickets_with(ticket), None
                version = build_claims(state, tickets, time.time(), layout)
                if version is not None and producer_id in version.producers:
                    return version
            return logrules.build_claim(state, producer_id, incarnation, time.time(), layout)

        # A lost race is most likely another claim of a pool starting together, which
        # folded our ticket: back off, then look, instead of racing every rival at once.
        # Without a wait the state is the one just loaded: the first attempt puts without
        # probing again (a claim that landed since costs it a conflict).
        backoff = ClaimBackoff()
        result = self._journal.commit(
            state,
            claim,
            after_conflict=lambda window_s: time.sleep(backoff.pause_s(window_s)),
            probed=fresh is not None,
        )
        return Claimed(result.state, result.state.producers[producer_id], result.fragile_window_s)

    def _give_the_first_ticket_its_turn(self, state: LogState, ticket: Ticket, attempt_s: float) -> list[Ticket] | None:
        """A pool that starts together: the holder of the first foldable ticket (in key
        order) claims for everybody, and the others let it. Each waits twice its own
        start's time (the first's claim is about that much) plus a random part of the
        pool's budget on the head key, ``rivals / HEAD_BUDGET_PER_S``, and then looks: no
        PUT of theirs races the first's, and their reads of its version stay within the
        budget. If the first died, the wait is all it costs: they then claim themselves.
        Returns the tickets listed when there was no wait (still fresh), else None."""
        listed = self._tickets_with(ticket)
        rivals = foldable(state, listed, self._layout)
        if len(rivals) < 2 or min(rivals, key=lambda t: t.key) == ticket:
            return listed
        time.sleep(2 * attempt_s + random.uniform(0, len(rivals) / HEAD_BUDGET_PER_S))
        return None

    def _tickets_with(self, ticket: Ticket) -> list[Ticket]:
        """Every ticket listed under ``_claims/``, and ours (a listing may lag our put)."""
        listed = (parse_claim_key(info.key) for info in self._store.list(CLAIM_PREFIX))
        return [t for t in listed if t is not None and t != ticket] + [ticket]

    def _write_ticket(self, state: LogState, incarnation: str) -> Ticket:
        """Our ticket for the epoch after ``state``'s (its key names our incarnation:
        nobody else writes it)."""
        ticket = Ticket(self._producer_id, next_epoch(state, self._producer_id), self._layout, incarnation)
        try:
            self._store.put_if_absent(ticket.key, CLAIM_TICKET)
        except ObjectExistsError:
            pass  # an attempt whose answer was lost landed: the key is ours alone
        return ticket
