"""Backpressure (``Producer(max_lag=...)``): whether a producer may upload one more TGB.

Invariant I12: the TGBs stored at or above ``W_global`` (the oldest live checkpoint's
watermark), committed or only uploaded, never exceed ``max_lag``. Counting committed
steps alone is not enough: a producer appends far faster than it commits (an append is
one put; a commit waits its turn), so hundreds of uploaded TGBs would pile up between
two commits with nothing holding them back.

Each producer answers for its own TGBs: it takes a fixed share of ``max_lag`` and holds
``append`` while its own TGBs above ``W_global`` (committed, and uploaded but not
committed) fill it. The shares of the producers active in the log add up to ``max_lag``
exactly, so the bound holds for the pool without any producer knowing what the others
uploaded, and a stale view of the others' commits cannot break it: a producer counts
only what it knows for certain, its own TGBs. It does not learn the exact step of each
of its committed TGBs (another producer's group commit may fold them), only that ``count``
of them landed among the steps a state change added (``CommittedSpan``): at most
``end - max(W_global, first)`` of those are at or above ``W_global``, exact when no
other producer committed in between. Besides, the committed steps it sees above
``W_global`` plus its own uploads stay within ``max_lag`` (a producer that left the pool
answers for nothing, but its steps still count there).

A producer counts as active when a log version among the last ``ACTIVE_VERSIONS``
recorded it (a commit or a claim); one that left the pool stops taking a share once its
last record is that far behind.

A held producer reads W_global again after a pause (``poll_pause_s``). Every held
producer of the pool reads the same keys (the log's head, or the watermarks), so the pauses
carry a floor from a request budget, as the log's followers do (``reading.polling``):
1,000 held producers look about every 14 s each, 70 a second in all, not 500. The
pool is every producer the log knows: a held producer commits nothing, so counting the
ones active lately would leave the held ones out. Being released a few seconds late
costs a held producer nothing it was not already waiting for. Pure: values in, values
out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchweave.log import LogState
from batchweave.reading.polling import HEAD_BUDGET_PER_S

__all__ = [
    "ACTIVE_VERSIONS",
    "MAX_BACKOFF_S",
    "MAX_POLL_S",
    "CommittedSpan",
    "active_producers",
    "may_upload",
    "own_share",
    "poll_pause_s",
    "share",
]

# Versions after which a producer that recorded nothing no longer takes a share. A held
# producer commits nothing either, but it still counts itself, and its share comes back
# as soon as it commits again: a short overshoot of at most its share, never a stall.
ACTIVE_VERSIONS = 64
# A held producer's own backoff between two reads of W_global tops out here; the
# pool's budget (``poll_pause_s``) may make the pause longer.
MAX_BACKOFF_S = 2.0
# The budget's pause never exceeds this: past about 4,200 producers in the log (ids that
# ever claimed) a held producer still looks once a minute.
MAX_POLL_S = 60.0


@dataclass(frozen=True, slots=True)
class CommittedSpan:
    """``count`` of one producer's TGBs were committed at steps in ``[first, end)``."""

    first: int
    end: int
    count: int

    def at_or_above(self, w_global_steps: int) -> int:
        """How many of them may be at or above step ``w_global_steps`` (at most)."""
        return min(self.count, max(0, self.end - max(w_global_steps, self.first)))


def active_producers(state: LogState, me: str) -> list[str]:
    """The producers sharing ``max_lag``, in a fixed order every producer agrees on."""
    recent = state.version - ACTIVE_VERSIONS
    return sorted({me} | {p for p, s in state.producers.items() if s.last_version >= recent})


def share(total: int, producers: int, index: int) -> int:
    """Producer ``index``'s part of ``total``: the parts of ``producers`` add up to it exactly."""
    if total <= 0:
        return 0
    return total * (index + 1) // producers - total * index // producers


def own_share(state: LogState, me: str, max_lag: int) -> int:
    """Producer ``me``'s share of ``max_lag`` among the producers active in ``state``
    (O(producers): callers keep it for as long as they hold the same state)."""
    producers = active_producers(state, me)
    return share(max_lag, len(producers), producers.index(me))


def poll_pause_s(backoff_s: float, producers: int, draw: float) -> float:
    """The pause before a held producer reads W_global again: its own backoff, or
    the pool's budget floor (``producers / HEAD_BUDGET_PER_S``) when that is longer,
    jittered by ``draw`` in [0, 1) over [mean/2, 3 mean/2] so the pool does not poll in
    step."""
    mean = max(backoff_s, min(MAX_POLL_S, producers / HEAD_BUDGET_PER_S))
    return mean * (0.5 + draw)


def may_upload(
    state: LogState,
    own_share: int,
    own_pending: int,
    own_committed: Iterable[CommittedSpan],
    w_global_steps: int,
    max_lag: int,
) -> bool:
    """True when a producer whose share of ``max_lag`` is ``own_share``,
    with ``own_pending`` TGBs uploaded and not committed yet and ``own_committed`` since
    it started, may upload one more without the pool passing ``max_lag`` stored TGBs at
    or above ``W_global``."""
    if max(0, state.steps - w_global_steps) + own_pending >= max_lag:
        return False
    mine = own_pending + sum(span.at_or_above(w_global_steps) for span in own_committed)
    return mine < own_share
