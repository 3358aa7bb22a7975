"""Epoch claims by ticket: a pool that starts together claims in a few log versions.

A producer's start commits a version that gives its incarnation the next epoch, fencing
every older one (invariant I3). One version per claim made a pool of P producers that
start together race for the same version over and over: about 0.4 P**2 create-only PUTs
without backoff, P log P with it, and at best one claim per round trip, so 1,000
producers took minutes to start. Instead:

- A starting producer writes a *ticket* at
  ``_claims/<producer>/e<epoch>/<dp>x<cp>-<incarnation>``: the epoch it claims (one past
  the one the log records), its layout and its incarnation, all in the key, so a
  listing is enough to read every ticket.
- Whoever commits a claim folds every ticket the log can take (``foldable``) into its
  version: one version claims for the whole pool, and a producer that lost the race
  usually finds its own ticket folded by the winner and writes nothing more.

Fencing holds as before: a ticket names the one epoch it claims and is folded only
while that epoch is exactly one past the log's (an older ticket can never fence a newer
incarnation); two incarnations of one producer with tickets for the same epoch are
never folded, so both claim on their own and the later claim fences the other, as two
racing claims always did; and a folded ticket's incarnation gets exactly what
``logrules.build_claim`` would have given it. A ticket of another layout than the
namespace's is never folded (I9).
Pure: keys and states in, versions out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchweave import logrules
from batchweave.keys import CLAIM_PREFIX, LAYOUT
from batchweave.log import Layout, LogState, LogVersion, ProducerState
from batchweave.logrules import next_epoch

__all__ = [
    "CLAIM_PREFIX",
    "CLAIM_TICKET",
    "Ticket",
    "build_claims",
    "claim_key",
    "dead_tickets",
    "foldable",
    "next_epoch",
    "parse_claim_key",
]

CLAIM_TICKET = b"batchweave.claim/1\n"  # what a ticket holds: its key says everything


@dataclass(frozen=True, slots=True)
class Ticket:
    """A claim waiting to be folded: ``incarnation`` of ``producer`` asks for ``epoch``."""

    producer: str
    epoch: int
    layout: Layout
    incarnation: str

    @property
    def key(self) -> str:
        return claim_key(self.producer, self.epoch, self.layout, self.incarnation)


def claim_key(producer: str, epoch: int, layout: Layout, incarnation: str) -> str:
    return f"{CLAIM_PREFIX}{producer}/e{epoch:06d}/{layout.dp}x{layout.cp}-{incarnation}"


def parse_claim_key(key: str) -> Ticket | None:
    """The ticket a key names; None for anything else (a stray object is ignored): the
    claim layout of ``keys.LAYOUT``, in full."""
    match = LAYOUT["claim"].fullmatch(key)
    if match is None:
        return None
    layout = Layout(int(match["dp"]), int(match["cp"]))
    return Ticket(match["producer"], int(match["epoch"]), layout, match["incarnation"])


def foldable(state: LogState, tickets: Iterable[Ticket], layout: Layout | None) -> list[Ticket]:
    """The tickets the version after ``state`` may fold, in key order: each claims the
    epoch after the one ``state`` records for its producer, in the namespace's layout
    (``layout`` when the namespace has none yet: the folder's own). A producer with two
    such tickets (two incarnations starting at once) gets none folded: which one should
    win is not the folder's to say, and each claims on its own."""
    expected = state.layout or layout
    chosen: dict[str, list[Ticket]] = {}
    for ticket in sorted(set(tickets), key=lambda t: t.key):
        if ticket.epoch != next_epoch(state, ticket.producer):
            continue
        if expected is not None and (ticket.layout.dp, ticket.layout.cp) != (expected.dp, expected.cp):
            continue
        chosen.setdefault(ticket.producer, []).append(ticket)
    return [mine[0] for mine in chosen.values() if len(mine) == 1]


def build_claims(state: LogState, tickets: Iterable[Ticket], committed_at: float, layout: Layout) -> LogVersion | None:
    """The version that folds ``tickets`` (``foldable`` ones only); None when none is.
    The first version of a namespace sets ``layout``, the folder's own."""
    claims = foldable(state, tickets, layout)
    if not claims:
        return None
    producers = {}
    for ticket in claims:
        old = state.producers.get(ticket.producer)
        producers[ticket.producer] = ProducerState(
            offset=old.offset if old else 0, epoch=ticket.epoch, incarnation=ticket.incarnation
        )
    new_layout = Layout(layout.dp, layout.cp) if state.layout is None else None
    return logrules.next_version(state, committed_at, producers=producers, layout=new_layout)


def dead_tickets(state: LogState, keys: Iterable[str]) -> list[str]:
    """Tickets ``state`` has made useless: folded (their producer's epoch reached theirs),
    or lost to another claim of that epoch. Their producers delete them once folded;
    these are a crashed start's or a failed deletion's."""
    dead = []
    for key in keys:
        ticket = parse_claim_key(key)
        recorded = state.producers.get(ticket.producer) if ticket else None
        if ticket is not None and recorded is not None and ticket.epoch <= recorded.epoch:
            dead.append(key)
    return dead
