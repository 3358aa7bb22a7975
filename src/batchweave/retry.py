"""Riding out throttling and outages: how long a store request is retried, how long it
pauses between attempts, and what a process records and logs while it is stalled.

Plain logic with the clock given: ``Store._call`` drives it (see ``batchweave.store.requests``).

Why the deadline is minutes, not seconds: a training job that loses one rank restarts
every rank from its last checkpoint, which costs the work since that checkpoint plus
minutes of startup on hundreds of GPUs. Cloud stores throttle for tens of seconds at a
time as a matter of routine (S3 answers ``503 SlowDown`` while it repartitions a prefix;
Azure answers ``503 ServerBusy``), and an endpoint restart or a failover takes a minute
or two. Ten minutes rides out all of those; a store down for longer is an outage that
someone must look at, and then the typed error is the right answer.

Why full jitter and a cap: every rank of a job hits the same throttle at the same moment;
a pause drawn uniformly from ``[0, bound]`` spreads their retries instead of sending them
in lockstep, and the bound doubles from 50 ms to 10 s, so a stalled process sends a few
requests a second at first and about one every five seconds per stalled request later
(the AWS architecture blog, "Exponential Backoff And Jitter", 2015). The cap bounds how
long a process keeps waiting after the store has recovered.

Why a request-rate limiter as well: backoff spaces the retries of each request, but a
process with 64 fetch threads still sends 64 times what one request would, and new
requests keep arriving at full speed. ``RequestRateLimiter`` slows the process as a
whole, per bucket: once the store throttles, the allowed rate halves with every round of
throttled answers and climbs back linearly as requests succeed (AIMD: additive increase,
multiplicative decrease, the rule TCP uses to share a congested link: processes that
all follow it converge on a fair share of what the store takes instead of oscillating
together). While the store never throttles it does nothing but count.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_RETRY_DEADLINE_S",
    "FIRST_BACKOFF_S",
    "MAX_BACKOFF_S",
    "MIN_RATE_PER_S",
    "RECOVERY_S",
    "UNREACHABLE_DEADLINE_S",
    "WARN_EVERY_S",
    "RateNotice",
    "RequestRateLimiter",
    "StallMeter",
    "backoff_bound_s",
    "jittered_pause_s",
    "stop_event",
    "stop_retrying_when",
]

#: Seconds a failing store request is retried before it raises (storage option ``retry_deadline_s``).
DEFAULT_RETRY_DEADLINE_S = 600.0
#: Seconds a request is retried while it cannot even connect and no request of this store
#: (in this process) ever got an answer: a mistyped endpoint fails in seconds, not minutes.
UNREACHABLE_DEADLINE_S = 10.0
#: The bound of the first pause; it doubles with every retry up to ``MAX_BACKOFF_S``.
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 10.0
#: While requests stay stalled, a WARNING at the first retry and then at most this often.
WARN_EVERY_S = 30.0


_thread_stop = threading.local()


def stop_retrying_when(event: threading.Event | None) -> None:
    """End this thread's store retries as soon as ``event`` is set (None: never early).

    For the threads of a reader that is closing, or of a producer closed without a
    flush: what they fetch or commit would be thrown away, so ``close()`` must not wait
    out a storm or the deadline for them. Use it as a thread
    pool's ``initializer``, or call it at the start of a thread's target.
    """
    _thread_stop.event = event


def stop_event() -> threading.Event | None:
    """The event set by ``stop_retrying_when`` for this thread, if any."""
    return getattr(_thread_stop, "event", None)


def backoff_bound_s(retry: int) -> float:
    """The longest pause before retry number ``retry`` (1, 2, ...), in seconds."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2.0 ** min(retry - 1, 64))


def jittered_pause_s(retry: int, draw: float) -> float:
    """Full jitter: the pause before retry ``retry`` for a uniform ``draw`` in [0, 1)."""
    return draw * backoff_bound_s(retry)


class StallMeter:
    """One store's retries and the seconds it spent stalled, counted across threads.

    ``stalled_s`` is wall-clock time during which at least one request was failing and
    being retried: 64 fetch threads stalled through the same 10 s count 10 s, not 640.
    ``begin`` and ``end`` bracket one request's retries; ``retried`` counts one retry and
    says whether it is time for a WARNING (the first retry of a stall, then every
    ``WARN_EVERY_S``); ``end`` returns the stall's length when the last stalled request
    ended one that was warned about, so the caller can say the store is answering again.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.retries = 0
        self._stalled_requests = 0
        self._since = 0.0  # when the current stall began
        self._past_s = 0.0  # stalls that ended
        self._next_warning = -math.inf
        self._warned = False  # about the current stall

    @property
    def stalled_s(self) -> float:
        with self._lock:
            current = self._clock() - self._since if self._stalled_requests else 0.0
            return self._past_s + current

    @property
    def current_s(self) -> float:
        """How long the current stall has lasted (0 when nothing is being retried)."""
        with self._lock:
            return self._clock() - self._since if self._stalled_requests else 0.0

    def begin(self) -> None:
        with self._lock:
            if self._stalled_requests == 0:
                self._since = self._clock()
                self._warned = False
                self._next_warning = -math.inf
            self._stalled_requests += 1

    def retried(self) -> bool:
        """Count one retry; True when it should be logged."""
        with self._lock:
            self.retries += 1
            now = self._clock()
            if now < self._next_warning:
                return False
            self._next_warning = now + WARN_EVERY_S
            self._warned = True
            return True

    def end(self) -> float | None:
        """One request stopped retrying; the stall's seconds if that ended a warned stall."""
        with self._lock:
            self._stalled_requests -= 1
            if self._stalled_requests:
                return None
            length = self._clock() - self._since
            self._past_s += length
            return length if self._warned else None


# -- the request-rate limiter ----------------------------------------------------------

#: The lowest request rate, per second, the limiter ever allows one process on one bucket.
MIN_RATE_PER_S = 1.0
#: The factor a throttled answer cuts the allowed rate by.
DECREASE_FACTOR = 0.5
#: Seconds of successful requests the allowed rate takes to climb from the floor back to
#: the rate the process had before it was throttled (then the limit is lifted).
RECOVERY_S = 20.0
#: A rate is measured over at least this many seconds (a shorter window reads too high).
MIN_WINDOW_S = 1.0
#: One success credits at most this many seconds of growth (a success after a long idle
#: spell is no evidence that the store takes a much higher rate).
MAX_CREDIT_S = 1.0
#: Tokens a limited process may bank while idle: one request may go at once, not a burst.
BURST = 1.0
_EPSILON_S = 1e-9


@dataclass(frozen=True, slots=True)
class RateNotice:
    """A change of the allowed request rate worth a WARNING line.

    ``kind`` is "started" (the first throttled answer: requests are now limited),
    "lowered" (still throttled, the limit cut again; said at most every ``WARN_EVERY_S``)
    or "ended" (the limit climbed back and was lifted; said only after a "started" was).
    """

    kind: str
    limit_per_s: float  # the new limit (inf once lifted)
    before_per_s: float  # the limit before, or the rate measured before throttling began
    limited_s: float  # how long this spell of limiting has lasted


class RequestRateLimiter:
    """How fast one process may send requests to one bucket: AIMD on a request rate.

    Unlimited until the store answers a request with throttling (HTTP 503 SlowDown, 429).
    Then the allowed rate starts at half the rate measured since the last spell (or
    since the start), and is halved again by each throttled answer to a request sent
    after the previous cut (the answers to requests already in flight at a cut say
    nothing about the new rate: a burst of them cuts once), from the rate the process
    really requested since that cut if lower; never below ``MIN_RATE_PER_S``. Successful
    answers raise it additively, by the pre-throttle rate / ``RECOVERY_S`` per second of
    successes, and once it is back at that rate the limit is lifted. Requests take a
    ticket (``reserve``) and wait until the token bucket has issued it (``wait_s``); the
    tickets already waiting are issued at the new rate when it changes.

    Plain logic: the clock is given to every call that needs it. Thread-safe. While not
    limited, a caller need only test ``limit_per_s is None`` and count ``sent``.
    """

    def __init__(self, now: float) -> None:
        self._lock = threading.Lock()
        #: Requests per second allowed now; None while not limited.
        self.limit_per_s: float | None = None
        #: Requests sent so far. While not limited the caller counts them itself (``sent +=
        #: 1``: the only cost of the limiter then, unlocked, as a lost count only blurs an
        #: estimate); ``reserve`` counts the others. A ticket is one of these numbers.
        self.sent = 0
        self._mark = (now, 0)  # (time, sent) the pre-throttle rate is measured from
        # The token bucket: ``issued`` tokens as of ``issued_t``; ticket n may go once issued > n.
        self._issued = 0.0
        self._issued_t = 0.0
        self._cut: tuple[float, int] = (0.0, 0)  # (time, sent) of the last cut
        self._ceiling = math.inf  # the pre-throttle rate: the limit is lifted once it is back there
        self._step_per_s = 0.0  # how much the limit grows per second of successes
        self._credited_t = 0.0  # growth was credited up to here
        self._since = 0.0  # when this spell of limiting began
        self._past_s = 0.0  # spells that ended
        self._warned = False  # about this spell
        self._next_warning = -math.inf

    # -- the request path ------------------------------------------------------------

    def reserve(self, clock: Callable[[], float]) -> int | None:
        """Take a ticket before sending a request: None while not limited (send at once),
        else the ticket to wait for with ``wait_s``."""
        if self.limit_per_s is None:
            self.sent += 1
            return None
        with self._lock:
            if self.limit_per_s is None:
                self.sent += 1
                return None
            self._accrue(clock())
            ticket = self.sent
            self.sent += 1
            return ticket

    def wait_s(self, ticket: int, clock: Callable[[], float]) -> float:
        """Seconds until ``ticket`` may be sent at the current rate (0: now)."""
        with self._lock:
            limit = self.limit_per_s
            if limit is None:
                return 0.0
            now = clock()
            issued = min(self._issued + limit * (now - self._issued_t), self.sent + BURST)
            wait_s = (ticket + 1 - issued) / limit
            return wait_s if wait_s > _EPSILON_S else 0.0  # (a rounding error is no reason to wait)

    def throttled(self, sent_at: float | None, clock: Callable[[], float]) -> RateNotice | None:
        """A request sent at ``sent_at`` (None: sent while not limited) was answered with
        throttling."""
        with self._lock:
            now = clock()
            if self.limit_per_s is None:
                return self._start(now)
            if sent_at is None or sent_at <= self._cut[0]:
                return None  # sent before the last cut: it says nothing about the lower rate
            before = basis = self.limit_per_s
            if now - self._cut[0] >= MIN_WINDOW_S:  # long enough to tell what the process sends
                basis = min(basis, self._rate_since(self._cut, now))
            self._set_limit(now, max(MIN_RATE_PER_S, basis * DECREASE_FACTOR))
            self._cut = (now, self.sent)
            self._credited_t = now
            if now < self._next_warning:
                return None
            self._next_warning = now + WARN_EVERY_S
            return RateNotice("lowered", self.limit_per_s, before, now - self._since)

    def succeeded(self, clock: Callable[[], float]) -> RateNotice | None:
        """A request was answered (anything but throttling, a server error or a timeout)."""
        if self.limit_per_s is None:
            return None
        with self._lock:
            if self.limit_per_s is None:
                return None
            now = clock()
            grown = self.limit_per_s + self._step_per_s * min(max(0.0, now - self._credited_t), MAX_CREDIT_S)
            self._credited_t = now
            if grown < self._ceiling:
                self._set_limit(now, grown)
                return None
            return self._end(now)

    # -- figures ---------------------------------------------------------------------

    def current_per_s(self) -> float:
        """The allowed request rate (inf while not limited)."""
        limit = self.limit_per_s
        return math.inf if limit is None else limit

    def limited_s(self, clock: Callable[[], float]) -> float:
        """Seconds during which requests were limited, the current spell included."""
        with self._lock:
            return self._past_s + (clock() - self._since if self.limit_per_s is not None else 0.0)

    # -- under the lock ----------------------------------------------------------------

    def _start(self, now: float) -> RateNotice | None:
        measured = self._rate_since(self._mark, now)
        self._ceiling = max(measured, 2 * MIN_RATE_PER_S)
        self._step_per_s = self._ceiling / RECOVERY_S
        self._issued, self._issued_t = self.sent + BURST, now  # no queue yet: the next request may go
        self.limit_per_s = max(MIN_RATE_PER_S, measured * DECREASE_FACTOR)
        self._cut = (now, self.sent)
        self._credited_t = self._since = now
        self._warned = now >= self._next_warning
        if not self._warned:
            return None
        self._next_warning = now + WARN_EVERY_S
        return RateNotice("started", self.limit_per_s, measured, 0.0)

    def _end(self, now: float) -> RateNotice | None:
        before = self.limit_per_s
        assert before is not None
        self.limit_per_s = None
        self._mark = (now, self.sent)
        spell_s = now - self._since
        self._past_s += spell_s
        return RateNotice("ended", math.inf, before, spell_s) if self._warned else None

    def _set_limit(self, now: float, limit: float) -> None:
        self._accrue(now)  # the tokens so far were issued at the old rate
        self.limit_per_s = limit

    def _accrue(self, now: float) -> None:
        assert self.limit_per_s is not None
        self._issued = min(self._issued + self.limit_per_s * (now - self._issued_t), self.sent + BURST)
        self._issued_t = now

    def _rate_since(self, mark: tuple[float, int], now: float) -> float:
        """Requests per second reserved since ``mark``, over at least ``MIN_WINDOW_S``."""
        since_t, since_sent = mark
        return (self.sent - since_sent) / max(now - since_t, MIN_WINDOW_S)
