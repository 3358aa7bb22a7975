"""A producer's hold on ``append`` while its commits have fallen behind what it appends.

A producer uploads a TGB's objects in ``append`` and a commit makes it visible later. When
commits fall behind (the machine's cores go to appending, so the turn's committer runs
late; a slow store), appending on only grows the queue: the intents and versions to
build grow with it, the turns come later still, and what was appended becomes visible
long after. Measured with 128 producers of 100 KB TGBs on 2 cores: 204 MB/s appended in a
20 s window and 58 MB/s of it visible within the window, turns 1.7 s apart where group
commit plans 0.4 s. So ``append`` waits while the oldest TGB this producer has queued for
a commit has waited longer than ``BACKLOG_GAPS`` of its policy's gaps between commits (at
least ``MIN_BACKLOG_S``), as a message queue's client blocks when its buffer of
unacknowledged records is full. A producer whose commits keep up never waits here: group
commit makes a TGB visible within a turn or two, DAC within its gap.

It holds only while the policy commits what is queued without more TGBs (``wait_s`` is
finite): ``Manual`` waits for a flush and ``Fixed`` for its count, and holding their
``append`` would wait for ever. The wait ends when a commit takes the oldest TGBs (the commit loop notifies the
producer's condition), when the commit thread fails (its error is raised, as ever), or
when the producer closes. Held longer than ``HELD_WARNING_S``, it logs once what holds it.
Only a producer with a commit thread holds: without one, ``append`` itself commits.
"""

from __future__ import annotations

import logging
import math
import time

from batchweave.commit.policies import CommitPolicy
from batchweave.commit.shared import SharedState

__all__ = ["BACKLOG_GAPS", "MIN_BACKLOG_S", "CommitBacklog", "backlog_limit_s"]

_logger = logging.getLogger("batchweave.producer")  # the producer's messages, under the producer's name
BACKLOG_GAPS = 4.0
# Group commit's interval is 0.4 s: a TGB queued just after a turn's intent waits about two
# intervals, and a turn a stand-in takes one stagger more; 2 s is past all of those.
MIN_BACKLOG_S = 2.0
HELD_WARNING_S = 60.0
_RECHECK_S = 1.0  # a held append looks again at least this often (for its warning)


def backlog_limit_s(gap_s: float) -> float:
    """How long the oldest queued TGB may wait before ``append`` holds, for a policy whose
    commits come ``gap_s`` apart."""
    return max(MIN_BACKLOG_S, BACKLOG_GAPS * gap_s)


class CommitBacklog:
    """Holds ``append`` while this producer's commits are behind (module doc). Given the
    state it shares with its commit thread, the namespace's URL (for errors) and its
    commit policy (its ``gap_s``, where it has one, and ``wait_s``)."""

    def __init__(self, shared: SharedState, url: str, policy: CommitPolicy) -> None:
        self._shared = shared
        self._url = url
        self._policy = policy
        self._held_s = 0.0  # seconds append waited here in all, before the wait going on
        self._holding_since: float | None = None  # under the condition: when the wait going on began

    def held_s(self, now: float) -> float:
        """Under the producer's condition: the seconds ``append`` has waited here in all,
        the wait going on included (``Producer.metrics``)."""
        return self._held_s + (0.0 if self._holding_since is None else now - self._holding_since)

    def wait(self) -> None:
        """Return once the oldest queued TGB has waited no longer than the limit (at once
        while commits keep up); raise the commit thread's error if it fails meanwhile."""
        shared = self._shared
        with shared.cond:
            try:
                self._hold(shared)
            finally:
                if self._holding_since is not None:
                    self._held_s += time.monotonic() - self._holding_since
                    self._holding_since = None

    def _behind(self, now: float) -> bool:
        """Under the condition: the oldest queued TGB has waited past the limit, and the
        policy commits it without more TGBs."""
        shared = self._shared
        limit_s = backlog_limit_s(getattr(self._policy, "gap_s", 0.0))
        return shared.backlog_s(now) > limit_s and math.isfinite(self._policy.wait_s(len(shared.pending), 0.0))

    def _hold(self, shared: SharedState) -> None:
        """Under the condition: wait while commits are behind (``wait``)."""
        warned = False
        while True:
            shared.raise_if_unusable(self._url)
            now = time.monotonic()
            if not self._behind(now):
                return
            since = self._holding_since = self._holding_since or now
            if not warned and now - since >= HELD_WARNING_S:
                warned = True
                waited_s, limit_s = shared.backlog_s(now), backlog_limit_s(getattr(self._policy, "gap_s", 0.0))
                _logger.warning(
                    "producer %r: append held %.0f s: its oldest TGB queued for a commit has waited %.0f s "
                    "(more than %.1f s): its commits to %s are behind what it appends",
                    shared.producer_id,
                    now - since,
                    waited_s,
                    limit_s,
                    self._url,
                )
            shared.cond.wait(_RECHECK_S)
