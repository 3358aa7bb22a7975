"""How often a log follower probes the head: a request budget per key, not per rank.

A follower that finds no new version probes the next version's key again after a pause.
Every follower of a job probes the *same* key, so the rate that key sees is the number
of followers divided by the pause. ``HeadPolling`` chooses pauses so that rate stays
within ``budget_per_s`` however many followers there are, and so a follower that knows
the commit cadence does not waste probes between commits:

- **A floor from the budget.** ``followers / budget_per_s`` is the shortest mean pause:
  10,000 ranks as 1,250 node followers at 70 requests/s on the key probe each about
  every 18 s, 8 followers every 0.11 s (the floor then never binds).
- **A start from the cadence.** After a version is found, the first probe waits a
  quarter of the commit interval the log shows (the ``committed_at`` of consecutive
  versions, smoothed); the pause doubles from there up to ``max_poll_s``. A follower
  of a log committing every 2 s misses about three times per version instead of
  about eight.
- **Jitter.** Every pause is drawn uniformly from [p/2, 3p/2]: a mean of p, so
  followers that found a version together spread their next probes over a whole pause
  rather than arriving at once.
- **Copies.** Where the floor binds (more than ``budget_per_s * max_poll_s`` followers)
  and the writers keep ``copies`` copies of each version near the head
  (``journal.headcopies``), each probe and read goes to one of ``copies + 1`` keys at
  random, so the floor divides by ``copies + 1`` (less a share for the reads): 1,250
  node followers with 10 copies probe about every 2 s. Below that, the version's own
  key alone: the floor does not bind there.

The same floor bounds a follower's idle re-proof of its anchor (``idle_proof_s``): that
GET goes to one key every follower of the job reads too; and it spreads the followers'
first requests when a job starts (``start_pause_s``).

Pure: no I/O, no clock; the follower passes times in. Given the namespace's ``url``, it
also tells a ``SilenceWatch`` (``reading.silence``) of each find and miss, which logs
when the log stays silent (a mistyped prefix should not wait without a word).
"""

from __future__ import annotations

import random

from batchweave.errors import ConfigError
from batchweave.reading.silence import SilenceWatch

__all__ = ["HEAD_BUDGET_PER_S", "IDLE_PROOF_S", "MIN_PAUSE_S", "HeadPolling"]

# Requests a second the job's followers together send to one log key while waiting at
# the head, on average. Azure documents about 500 a second per blob, S3 about 5,500 GETs
# a second per prefix; a mean of 70 keeps the busiest second under 100 (random arrivals
# vary: at a mean of 80, the simulation in `bench scale` saw a busiest second of 103 at
# 10,000 ranks), and leaves room for the readers behind the head, the producers and
# the collector on that prefix.
HEAD_BUDGET_PER_S = 70.0
# A waiting follower re-checks its anchor at least this often (I10): a miss may be a
# version GC deleted rather than one not committed yet.
IDLE_PROOF_S = 10.0
MIN_PAUSE_S = 0.01
_SMOOTHING = 0.25  # weight of the newest commit interval in the smoothed one
# With copies, a key takes the reads of the version it holds besides the probes for it
# (every follower reads each version from one of its keys within a pause): pausing a
# fifth longer keeps both within the budget (``bench scale``'s simulation: a busiest
# second of 76-85 at 1,250 node followers, 95 without it).
_COPY_READS = 1.2


class HeadPolling:
    """The pauses of one log follower waiting at the head.

    Args:
        followers: followers of the job probing the same key (node followers when ranks
            share one per node, ranks otherwise); at least 1.
        budget_per_s: requests a second all of them together may send to one key.
        max_poll_s: the longest pause the follower's own backoff reaches (the budget's
            floor may be longer).
        rng: source of jitter (a seeded one in tests and simulations).
        copies: copies of each version near the head the writers keep (``Store.head_copies``).
        url: the namespace; given, a long silence at the head is logged (``silence``).
    """

    def __init__(
        self,
        followers: int,
        *,
        budget_per_s: float = HEAD_BUDGET_PER_S,
        max_poll_s: float = 1.0,
        rng: random.Random | None = None,
        copies: int = 0,
        url: str = "",
    ) -> None:
        if followers < 1 or not budget_per_s > 0 or not max_poll_s > 0:
            raise ConfigError(
                f"head polling needs followers >= 1, a positive budget_per_s and max_poll_s; got {followers}, "
                f"{budget_per_s}, {max_poll_s}"
            )
        self.followers = followers
        self.budget_per_s = budget_per_s
        self.max_poll_s = max_poll_s
        self.floor_s = followers / budget_per_s  # the mean pause that keeps one key within budget
        # Copies the probes spread over (0: the version's own key only), and the floor then.
        self.copies = copies if self.floor_s > max_poll_s else 0
        self.probe_floor_s = self.floor_s / (self.copies + 1) * (_COPY_READS if self.copies else 1.0)
        self.commit_interval_s: float | None = None  # smoothed, from the versions found
        self._last_commit: float | None = None
        self._pause = 0.0  # the mean pause the next miss starts from (0: just found a version)
        self._rng = rng  # None: the random module's (which a simulation replaces)
        self.silence = SilenceWatch(url) if url else None

    @property
    def idle_proof_s(self) -> float:
        """How often a waiting follower re-proves its anchor: every ``IDLE_PROOF_S``, or
        less often when the job's followers would otherwise exceed the budget on that key."""
        return max(IDLE_PROOF_S, self.floor_s)

    def found(self, committed_at: float) -> None:
        """A version was found (``committed_at`` from the version, 0 when it has none):
        learn the cadence and start the next wait afresh."""
        if committed_at > 0:
            if self._last_commit is not None and committed_at > self._last_commit:
                interval = committed_at - self._last_commit
                previous = self.commit_interval_s
                self.commit_interval_s = interval if previous is None else previous + _SMOOTHING * (interval - previous)
            self._last_commit = max(committed_at, self._last_commit or 0.0)
        self._pause = 0.0
        if self.silence is not None:
            self.silence.found()

    def missed(self) -> float:
        """The pause before probing again after a probe found nothing new."""
        if self.silence is not None:
            self.silence.missed()
        if self._pause == 0.0:
            start = MIN_PAUSE_S if self.commit_interval_s is None else self.commit_interval_s / 4
            self._pause = min(self.max_poll_s, max(MIN_PAUSE_S, start))
        else:
            self._pause = min(self.max_poll_s, self._pause * 2)
        mean = max(self._pause, self.probe_floor_s)
        return (self._rng or random).uniform(mean / 2, mean * 1.5)

    def start_pause_s(self) -> float:
        """How long a follower that starts with the job waits before its first request.
        Every follower's first requests go to the same few keys (the snapshot hint, the
        versions and segments at the start), so followers that all start within a second
        spread them over the budget's floor: 1,250 node followers over about 18 s. Up to
        ``budget_per_s`` followers start at once: within the budget as they are."""
        if self.floor_s <= 1.0:
            return 0.0
        return (self._rng or random).uniform(0, self.floor_s)

    def mean_rate_per_s(self) -> float:
        """Requests a second this follower sends to the head keys while idle (for sizing)."""
        return 1.0 / max(self.max_poll_s, self.probe_floor_s)
