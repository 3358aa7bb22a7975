"""Riding out throttling and outages: how long a store request is retried, how long it
pauses between attempts, and what a process records and logs while it is stalled.

Plain logic with the clock given: ``Store._call`` drives it (see ``batchweave.store``).

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
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

__all__ = [
    "DEFAULT_RETRY_DEADLINE_S",
    "FIRST_BACKOFF_S",
    "MAX_BACKOFF_S",
    "UNREACHABLE_DEADLINE_S",
    "WARN_EVERY_S",
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
