"""Backpressure (``Producer(max_lag=...)``): whether a producer may upload one more TGB.

Invariant I12: the TGBs stored at or above ``W_global`` (the oldest live checkpoint's
watermark), committed or only uploaded, never exceed ``max_lag``. Counting committed
steps alone is not enough: a producer appends far faster than it commits (an append is
one put; a commit waits its turn), so hundreds of uploaded TGBs would pile up between
two commits with nothing holding them back.

Each producer answers for its own TGBs: it takes a fixed share of ``max_lag`` and holds
``append`` while its own TGBs above ``W_global`` (committed, and uploaded but not
committed) fill it. The shares of the producers active in the log add up to ``max_lag``
exactly (to one per producer where that is more, below), so the bound holds for the pool
without any producer knowing what the others uploaded, and a stale view of the others'
commits cannot break it: a producer counts only what it knows for certain, its own TGBs.
It does not learn the exact step of each of its committed TGBs (another producer's group
commit may fold them), only that ``count`` of them landed among the steps a state change
added (``CommittedSpan``): at most ``end - max(W_global, first)`` of those are at or
above ``W_global``, exact when no other producer committed in between. Besides, the
committed steps it sees above ``W_global`` plus its own uploads stay within that bound
(a producer that left the pool answers for nothing, but its steps still count there).

A producer counts as active when a log version among the last ``ACTIVE_VERSIONS``
recorded it (a commit or a claim) and it has not left: ``Producer.close`` of a producer
with ``max_lag`` records that it left (``ProducerState.left``), so a producer that
finished gives its share back at once, and a restart of the same id claims and counts
again. One that crashed (never closed) stops taking a share once its last record is that
far behind.

No share is ever 0: a producer with no room at all would hold ``append`` for good,
whatever training consumed, checkpointed and collected. So a ``max_lag`` below the
producers that share it (fewer than one TGB each) is *adjusted*, not refused: each takes
at least one, and the pool's bound is ``pool_bound(max_lag, producers)``, one TGB per
producer; the producer logs a WARNING that says so and the smallest ``max_lag`` that
keeps the bound it was given (at its start or when the pool it sees first outgrows
``max_lag``, and again each time that pool has doubled). A refusal at start could not
keep the rule anyway: the producers each one sees differ (a pool that starts together
has its claims folded into one version, and two producers that start at once each see
the other or not depending on which claim landed first), a held producer commits
nothing, so the others stop counting it after ``ACTIVE_VERSIONS`` versions while it
still counts itself, and a pool that grows while it runs would have to fail producers
that already work. Refusing the one that starts last would fail a job's start by the
luck of a race; adjusting costs at most one TGB per producer past ``max_lag``, and says
so.

A producer held longer than a bound says why, once per hold (``held_message``): which
limit holds it (its own share, or the pool's bound) and what pins ``W_global`` (the
oldest live checkpoint, or the last collection's reclaim point), from what its last look
read (a checkpoint's name comes with the watermarks it read; once the namespace was
collected, one listing of ``_checkpoints/`` per hold says whether a checkpoint was
released since: ``listed_checkpoints``).

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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, released_key
from batchweave.log import LogState
from batchweave.reading.polling import HEAD_BUDGET_PER_S

__all__ = [
    "ACTIVE_VERSIONS",
    "MAX_BACKOFF_S",
    "MAX_POLL_S",
    "CommittedSpan",
    "Hold",
    "Shares",
    "active_producers",
    "adjusted_message",
    "held_message",
    "listed_checkpoints",
    "may_upload",
    "measure",
    "own_share",
    "pinned_by_checkpoint",
    "pinned_by_reclaim",
    "poll_pause_s",
    "pool_bound",
    "share",
    "shares",
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
    """The producers sharing ``max_lag``, in a fixed order every producer agrees on:
    ``me``, and those recorded lately that have not left."""
    recent = state.version - ACTIVE_VERSIONS
    return sorted({me} | {p for p, s in state.producers.items() if s.last_version >= recent and not s.left})


def pool_bound(max_lag: int, producers: int) -> int:
    """The TGBs a pool of ``producers`` may store at or above W_global: ``max_lag``, or
    one per producer where there are more (a share is whole TGBs, and never 0)."""
    return max(max_lag, producers)


def share(total: int, producers: int, index: int) -> int:
    """Producer ``index``'s part of ``total`` among ``producers``: at least 1, and the
    parts add up to ``pool_bound(total, producers)`` exactly (``total`` itself unless that
    is below one each). ``total`` and ``producers`` are positive (``max_lag`` is checked)."""
    if total < 1 or producers < 1 or not 0 <= index < producers:
        raise ValueError(f"no share {index} of {total} among {producers} producers")
    bound = pool_bound(total, producers)
    return bound * (index + 1) // producers - bound * index // producers


@dataclass(frozen=True, slots=True)
class Shares:
    """How ``max_lag`` splits among the producers active in one log state, as one of them
    (whose share is ``mine``) sees it."""

    max_lag: int
    producers: tuple[str, ...]  # active, in the order every producer agrees on
    mine: int

    @property
    def bound(self) -> int:
        """What the pool may store at or above W_global (``pool_bound``)."""
        return pool_bound(self.max_lag, len(self.producers))

    def describe(self) -> str:
        return f"{self.mine} of max_lag {self.max_lag} among {len(self.producers)} producers"


def shares(state: LogState, me: str, max_lag: int) -> Shares:
    """Producer ``me``'s share of ``max_lag`` among the producers active in ``state``
    (O(producers): callers keep it for as long as they hold the same state)."""
    producers = active_producers(state, me)
    return Shares(max_lag, tuple(producers), share(max_lag, len(producers), producers.index(me)))


def own_share(state: LogState, me: str, max_lag: int) -> int:
    """Producer ``me``'s share alone (``shares``)."""
    return shares(state, me, max_lag).mine


def _names(ids: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(repr(i) for i in ids[:most])
    return shown + (f" and {len(ids) - most} more" if len(ids) > most else "")


def _tgbs(count: int) -> str:
    return f"{count} TGB" if count == 1 else f"{count} TGBs"


def adjusted_message(producer_id: str, pool: Shares) -> str:
    """The WARNING of a producer whose ``max_lag`` is below the producers sharing it."""
    count = len(pool.producers)
    return (
        f"producer {producer_id!r}: max_lag={pool.max_lag} is below the {count} producers that share it "
        f"({_names(pool.producers)}); each takes at least one TGB, so up to {pool.bound} TGBs may be stored at "
        f"or above W_global. Give max_lag >= {count} (one per producer, plus the steps between checkpoints) "
        "to keep the bound you set; a producer stops counting once it is closed"
    )


def poll_pause_s(backoff_s: float, producers: int, draw: float) -> float:
    """The pause before a held producer reads W_global again: its own backoff, or
    the pool's budget floor (``producers / HEAD_BUDGET_PER_S``) when that is longer,
    jittered by ``draw`` in [0, 1) over [mean/2, 3 mean/2] so the pool does not poll in
    step."""
    mean = max(backoff_s, min(MAX_POLL_S, producers / HEAD_BUDGET_PER_S))
    return mean * (0.5 + draw)


@dataclass(frozen=True, slots=True)
class Hold:
    """A producer's room under ``max_lag`` as it knows it: its share, its own TGBs at or
    above W_global (``own_pending`` uploaded or held for a pack, not committed, and at
    most ``own_stored`` in all), and the committed steps it sees there."""

    pool: Shares
    own_pending: int
    own_stored: int
    committed: int
    w_global_steps: int

    @property
    def pool_full(self) -> bool:
        """The committed steps it sees and its own uploads fill the pool's bound (a
        producer that left still has its steps counted here)."""
        return self.committed + self.own_pending >= self.pool.bound

    @property
    def share_full(self) -> bool:
        return self.own_stored >= self.pool.mine

    @property
    def room(self) -> bool:
        """It may upload one more TGB."""
        return not (self.pool_full or self.share_full)


def measure(
    state: LogState, pool: Shares, own_pending: int, own_committed: Iterable[CommittedSpan], w_global_steps: int
) -> Hold:
    """The room of a producer whose share is ``pool.mine``, with ``own_pending`` TGBs
    uploaded and not committed yet and ``own_committed`` since it started."""
    stored = own_pending + sum(span.at_or_above(w_global_steps) for span in own_committed)
    return Hold(pool, own_pending, stored, max(0, state.steps - w_global_steps), w_global_steps)


def may_upload(
    state: LogState, pool: Shares, own_pending: int, own_committed: Iterable[CommittedSpan], w_global_steps: int
) -> bool:
    """True when the producer may upload one more TGB without the pool passing
    ``pool.bound`` stored TGBs at or above ``W_global`` (``measure``)."""
    return measure(state, pool, own_pending, own_committed, w_global_steps).room


def held_message(producer_id: str, held_s: float, hold: Hold, pinned: str) -> str:
    """The WARNING of a producer held ``held_s`` seconds: which limit holds it, then
    ``pinned`` (``pinned_by_checkpoint`` or ``pinned_by_reclaim``): what pins W_global."""
    pool, w = hold.pool, hold.w_global_steps
    head = f"producer {producer_id!r}: held by max_lag={pool.max_lag} for {held_s:.0f} s: "
    if hold.pool_full:
        bound = f"max_lag={pool.max_lag}"
        if pool.bound > pool.max_lag:
            bound = f"the pool's bound of {pool.bound} (one TGB per producer: max_lag is below its producers)"
        limit = (
            f"the {hold.committed + hold.own_pending} TGBs stored at or above step {w} ({hold.committed} committed, "
            f"{hold.own_pending} of its own not committed yet) fill {bound}"
        )
    else:
        limit = (
            f"its share ({pool.describe()}) is full: it has {_tgbs(hold.own_stored)} stored at or above step {w} "
            "(each producer answers for its own share; one that is closed gives its share back)"
        )
    return f"{head}{limit}. {pinned}"


def pinned_by_checkpoint(checkpoint: str | None, w_global_steps: int) -> str:
    """What pins W_global before any collection: the oldest live checkpoint, read from
    the watermarks by the producer's last look (``checkpoint`` its name, None: none)."""
    if checkpoint is None:
        return (
            "No checkpoint is live (marked by every rank and not released), so W_global is step 0 until training "
            "marks one (Consumer.mark_checkpoint)"
        )
    return (
        f"W_global is step {w_global_steps}, pinned by the oldest live checkpoint {checkpoint!r}: it moves once "
        f"every rank marked a newer checkpoint and {checkpoint!r} is released (bw.release_checkpoint)"
    )


def pinned_by_reclaim(w_global_steps: int, listed: tuple[Sequence[str], Sequence[str]] | None, url: str) -> str:
    """What pins W_global once the namespace was collected: the log's reclaim point,
    which only a collection moves. ``listed`` is what one listing of ``_checkpoints/``
    shows (``listed_checkpoints``: marked, released), None if it could not be listed."""
    where = f"Step {w_global_steps} is where the last collection reclaimed up to (only a collection moves it)"
    if listed is None:
        return f"{where}: run `batchweave gc {url}` (or bw.collect_garbage) after each checkpoint"
    marked, released = listed
    if released:
        return (
            f"{where}, and checkpoint {_names(released)} was released since: no collection has run since the "
            f"checkpoints moved. Run `batchweave gc {url}` (or bw.collect_garbage) to make room, and after each "
            "checkpoint from now on"
        )
    if marked:
        return (
            f"{where}, and no checkpoint was released since, so the oldest live checkpoint (of {_names(marked)}) "
            f"still pins it: release it once a newer one is marked by every rank, then run `batchweave gc {url}`"
        )
    return (
        f"{where}, and no checkpoint is marked: training must mark one (Consumer.mark_checkpoint), then run "
        f"`batchweave gc {url}`"
    )


def listed_checkpoints(keys: Iterable[str]) -> tuple[list[str], list[str]]:
    """The checkpoints a listing of ``_checkpoints/`` shows: (those with marks and no
    release, those released), each sorted. Collection deletes a released checkpoint's
    objects, so one listed as released was released after the last collection."""
    marked: set[str] = set()
    released: set[str] = set()
    for key in keys:
        checkpoint = key[len(CHECKPOINT_PREFIX) :].partition("/")[0]
        if key == released_key(checkpoint):
            released.add(checkpoint)
        elif key.startswith(CHECKPOINT_PREFIX) and key.endswith(".json"):
            marked.add(checkpoint)
    return sorted(marked - released), sorted(released)
