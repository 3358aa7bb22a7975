"""What a producer and its commit loop share: one small object both hold.

The producer appends to ``pending`` and raises ``error`` to its caller; the commit loop
(``batchweave.commit.loop`` or, in group commit, ``batchweave.commit.turns``) commits
``pending`` and records what the log now says. Fields are read and written under
``cond``, the producer's condition, unless a comment says otherwise.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchweave.commit.policies import VersionsBetweenLooks
from batchweave.errors import ProducerClosedError, StreamEndedError
from batchweave.lifecycle.backpressure import CommittedSpan
from batchweave.log import LogState, ProducerState, TGBDescriptor
from batchweave.schema import Schema

if TYPE_CHECKING:
    import threading

__all__ = ["SharedState"]


def _counters() -> dict[str, float]:
    return {
        "attempts": 0,
        "conflicts": 0,
        "successes": 0,
        "tgbs_committed": 0,
        "bytes_written": 0,
        "last_fragile_window_s": math.nan,
    }


@dataclass(eq=False)
class SharedState:
    """One producer's view of the log and its uncommitted TGBs, with the flags that stop
    its commit loop."""

    producer_id: str
    cond: threading.Condition
    abandoned: threading.Event  # set with abandon: the commit loop stops retrying a failing store
    state: LogState  # the newest log state this producer has read
    me: ProducerState  # this incarnation, as its claim left it (its epoch)
    pending: list[TGBDescriptor] = field(default_factory=list)
    # When each batch of ``pending`` joined it: (the offset after the batch, monotonic time),
    # oldest first, to tell how long the oldest uncommitted TGB has waited (``backlog_s``).
    queued: deque[tuple[int, float]] = field(default_factory=deque)
    # The schema our TGBs of arrays fit: declared, the namespace's, or our first TGB's. Set
    # before the first TGB that needs it is pending, and never changed after.
    schema: Schema | None = None
    error: Exception | None = None  # the commit thread's final error, raised to the caller
    told: Exception | None = None  # ``error``, once append or flush raised it (close does not again)
    closed: bool = False
    abandon: bool = False  # close(flush=False): drop what is not committed
    flush_waiters: int = 0
    store_failures: int = 0  # consecutive failed commit attempts (commit loop only)
    metrics: dict[str, float] = field(default_factory=_counters)
    # Where our TGBs were committed, for backpressure (``lifecycle.backpressure``); None
    # when the producer has no max_lag (nothing would ever prune it).
    committed_spans: list[CommittedSpan] | None = None
    # The versions others committed between two of our commit attempts (the direct commit
    # loop observes them): how many producers contend, where our jumps to the head no
    # longer tell who committed (``commit.loop``).
    between_looks: VersionsBetweenLooks = field(default_factory=VersionsBetweenLooks)

    def committed_offset(self) -> int:
        return self.state.producers[self.producer_id].offset

    @property
    def forced(self) -> bool:
        """A flush is waiting, or the producer is closing: commit without the policy's gap."""
        return self.flush_waiters > 0 or self.closed

    @property
    def stopping(self) -> bool:
        """The commit loop has nothing more to do: failed, or closed with nothing to commit."""
        return self.error is not None or (self.closed and (self.abandon or not self.pending))

    def queue(self, tgbs: Sequence[TGBDescriptor], now: float) -> None:
        """Under ``cond``: ``tgbs`` (uploaded, in offset order) join ``pending`` at ``now``."""
        if tgbs:
            self.pending.extend(tgbs)
            self.queued.append((tgbs[-1].source_offset + 1, now))

    def backlog_s(self, now: float) -> float:
        """Under ``cond``: how long the oldest TGB still pending has waited for a commit."""
        return now - self.queued[0][1] if self.queued else 0.0

    def take(self, state: LogState) -> int:
        """Under ``cond``: take ``state`` as the newest and drop the TGBs it commits;
        returns our committed offset."""
        before, steps_before = len(self.pending), self.state.steps
        self.state = state
        offset = self.committed_offset()
        self.pending = [t for t in self.pending if t.source_offset >= offset]
        while self.queued and self.queued[0][0] <= offset:
            self.queued.popleft()
        committed = before - len(self.pending)
        self.metrics["tgbs_committed"] += committed
        if committed and self.committed_spans is not None:
            self.committed_spans.append(CommittedSpan(steps_before, state.steps, committed))
        return offset

    def raise_if_unusable(self, url: str) -> None:
        """Under ``cond``: raise the commit thread's error (noting it told), or refuse a
        closed producer or an ended namespace (``url`` names it)."""
        if self.error is not None:
            self.told = self.error
            raise self.error
        if self.closed:
            raise ProducerClosedError(self.producer_id)
        if self.state.end_of_stream:
            raise StreamEndedError(f"namespace {url} was ended at log version {self.state.version}; no TGB is accepted")

    def fail(self, exc: Exception) -> None:
        with self.cond:
            self.error = exc
            self.cond.notify_all()
