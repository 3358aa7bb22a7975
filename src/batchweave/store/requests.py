"""The path every request of a Store takes (``Requester``, which ``Store`` extends).

In order: a forked child of a process whose obstore runtime had started is refused (the
runtime does not survive fork()); once the store has throttled, the request waits for
this process's turn under the bucket's request-rate limiter (``batchweave.retry``); one
attempt, its error translated (``store.failures``); and, for a transient failure,
retries with capped exponential backoff and full jitter until the retry deadline.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from batchweave import retry
from batchweave.errors import BatchWeaveError, ConfigError, ObjectExistsError, StoreError, TransientStoreError
from batchweave.store.failures import never_reached, throttling, translate_error
from batchweave.store.options import RETRY_DEADLINE_OPTION

__all__ = ["Requester"]

T = TypeVar("T")
# The package's logger: the stores guide tells operators to watch "batchweave.store".
_logger = logging.getLogger("batchweave.store")

# One request-rate limiter per bucket or container (store root) and process, shared by
# every Store of it: a store throttles the requests of all the process's threads and
# namespaces there together (batchweave.retry.RequestRateLimiter).
_limiters: dict[str, retry.RequestRateLimiter] = {}
_limiters_lock = threading.Lock()
# A request waiting for its turn looks at the rate again this often (it may have grown).
_RATE_RECHECK_S = 0.25

# obstore runs its I/O on a tokio runtime that starts at the first request and does not
# survive fork(): a child that inherits a started runtime hangs on its first request.
# We remember which process started it, so a forked child fails fast instead.
_runtime_pid: int | None = None
_FORK_MESSAGE = (
    "this process was forked after its parent had used an object store, and obstore's I/O "
    "runtime does not survive fork(); start workers with the 'spawn' or 'forkserver' method "
    "(multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context='spawn')), "
    "or fork before the parent's first store request"
)


class Requester:
    """The request path of a ``Store``: ``_call`` runs one request through it.

    A subclass sets ``url`` (named in messages and warnings) and calls ``__init__`` with
    the request settings: ``retry_deadline_s`` (how long a failing request is retried),
    ``max_attempts`` (None: the deadline alone decides) and ``root`` (the store root whose
    request-rate limiter this process's requests share).
    """

    url: str

    def __init__(self, *, retry_deadline_s: float, max_attempts: int | None, root: str) -> None:
        self.retry_deadline_s = retry_deadline_s
        self.max_attempts = max_attempts
        # Whether any request of this Store, in this process, reached the server (even to
        # be refused): until one has, a request that cannot connect gets only
        # UNREACHABLE_DEADLINE_S (a mistyped endpoint, not an outage to ride out).
        self._reached = False
        self._stalls = retry.StallMeter(lambda: self._retry_clock())  # looked up per call: a test may replace it
        self._limiter = _limiter_for(root)

    # The clock, the pause and the jitter of the retry loop. A test replaces them on an
    # instance; the simulation replaces this module's `time` and `random`, which are looked
    # up at each call (bound once, at class creation, they would stay the real ones).
    def _retry_clock(self) -> float:
        return time.monotonic()

    def _retry_sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def _retry_draw(self) -> float:
        return random.random()

    @property
    def retries(self) -> int:
        """Requests this Store retried in this process (one per retry, not per request)."""
        return self._stalls.retries

    @property
    def stalled_s(self) -> float:
        """Seconds during which at least one of this Store's requests was failing and
        being retried (throttling, outages), in this process."""
        return self._stalls.stalled_s

    @property
    def stalled_now_s(self) -> float:
        """Seconds the current stall has lasted (0 when no request is being retried)."""
        return self._stalls.current_s

    @property
    def rate_limit_per_s(self) -> float:
        """Requests per second this process may send to this Store's bucket now: inf
        unless the store has been throttling them (``batchweave.retry.RequestRateLimiter``;
        shared by every Store of the bucket in this process)."""
        return self._limiter.current_per_s()

    @property
    def rate_limited_s(self) -> float:
        """Seconds during which this process's requests to the bucket were rate-limited."""
        return self._limiter.limited_s(self._retry_clock)

    def _refuse_forked_runtime(self) -> None:
        if _runtime_pid is not None and _runtime_pid != os.getpid():
            raise ConfigError(f"{self.url}: {_FORK_MESSAGE}")

    def _perform(self, request: str, nbytes: int, op: Callable[[], T]) -> T:
        """Run one request. The hook where a simulated store adds latency and faults."""
        del request, nbytes
        return op()

    def _call(self, key: str, op: Callable[[], T], request: str, nbytes: int = 0, *, conditional: bool = False) -> T:
        self._refuse_forked_runtime()
        limiter = self._limiter
        began = sent_at = None
        if limiter.limit_per_s is None:  # the common case, kept to a test and a count
            limiter.sent += 1
        else:  # the store has been throttling: wait for this process's turn
            ticket = limiter.reserve(self._retry_clock)
            began = self._retry_clock()
            sent_at = self._wait_turn(ticket, began + self._budget_s()) if ticket is not None else began
            if sent_at is None:
                raise TransientStoreError(key, "stopped waiting to send (the store is throttling): closing")
        try:
            return self._attempt(key, op, request, nbytes, conditional, sent_at)
        except TransientStoreError as error:
            failed = error
        return self._retry(key, op, request, nbytes, conditional, failed, began)

    def _attempt(
        self, key: str, op: Callable[[], T], request: str, nbytes: int, conditional: bool, sent_at: float | None
    ) -> T:
        """One request, its error translated (retried by obstore itself, briefly), its
        answer told to the request-rate limiter (``sent_at``: when, if it took a turn)."""
        global _runtime_pid
        try:
            result = self._perform(request, nbytes, op)
        except BatchWeaveError:
            raise
        except Exception as exc:
            self._reached = self._reached or not never_reached(exc)
            error = translate_error(exc, key, conditional=conditional, request=request, store=self.url)
            if not isinstance(error, TransientStoreError):
                self._answered()  # a 404 or a lost race is an answer too
            elif throttling(exc, key):
                self._say(self._limiter.throttled(sent_at, self._retry_clock))
            raise error from exc
        finally:
            _runtime_pid = os.getpid()
        self._reached = True
        if self._limiter.limit_per_s is not None:  # (nothing to tell it while not limited)
            self._answered()
        return result

    def _answered(self) -> None:
        self._say(self._limiter.succeeded(self._retry_clock))

    def _wait_turn(self, ticket: int, until: float) -> float | None:
        """Wait until the request-rate limiter lets ``ticket`` go, or until ``until`` (the
        request's deadline: its last attempt goes then, as a cut backoff pause does). The
        time it goes; None when this thread was told to stop meanwhile. Waits in short
        steps: the rate may change meanwhile."""
        while True:
            now = self._retry_clock()
            wait_s = min(self._limiter.wait_s(ticket, self._retry_clock), until - now)
            if wait_s <= 0:
                return now
            if not self._pause(min(wait_s, _RATE_RECHECK_S)):
                return None

    def _say(self, notice: retry.RateNotice | None) -> None:
        """Log a change of the request-rate limit (at most every 30 s while throttled)."""
        if notice is None:
            return
        if notice.kind == "started":
            _logger.warning(
                "%s: store throttling: this process now sends at most %.1f requests/s to this bucket (it sent "
                "about %.1f/s); the limit halves while throttling goes on and climbs back as requests succeed",
                self.url, notice.limit_per_s, notice.before_per_s,
            )  # fmt: skip
        elif notice.kind == "lowered":
            _logger.warning(
                "%s: store still throttling after %.0f s: this process now sends at most %.1f requests/s "
                "to this bucket (was %.1f/s)",
                self.url, notice.limited_s, notice.limit_per_s, notice.before_per_s,
            )  # fmt: skip
        else:
            _logger.warning(
                "%s: store throttling over: request rate no longer limited, after %.0f s of limiting",
                self.url, notice.limited_s,
            )  # fmt: skip

    def _retry(
        self,
        key: str,
        op: Callable[[], T],
        request: str,
        nbytes: int,
        conditional: bool,
        error: TransientStoreError,
        began: float | None,
    ) -> T:
        """Retry a request that failed transiently until it succeeds, fails for good, or
        has been failing for the deadline (counted from ``began``, when it started waiting
        for its first turn, if it did); then raise the last error, saying so."""
        started = self._retry_clock() if began is None else began
        self._stalls.begin()
        answered = False
        try:
            for attempt in itertools.count(1):
                stalled_s = self._retry_clock() - started
                budget_s = self._budget_s()
                if stalled_s >= budget_s or (self.max_attempts is not None and attempt >= self.max_attempts):
                    raise self._gave_up(error, attempt, stalled_s, budget_s) from error
                if self._stalls.retried():
                    self._warn_retrying(error, request, attempt + 1, stalled_s, budget_s)
                closing = TransientStoreError(
                    error.key, f"{error.problem}; stopped retrying: closing", retried_s=stalled_s
                )
                if not self._pause(min(budget_s - stalled_s, retry.jittered_pause_s(attempt, self._retry_draw()))):
                    raise closing from error
                sent_at = None
                ticket = self._limiter.reserve(self._retry_clock)  # the backoff, then this process's turn
                if ticket is not None and (sent_at := self._wait_turn(ticket, started + budget_s)) is None:
                    raise closing from error
                try:
                    result = self._attempt(key, op, request, nbytes, conditional, sent_at)
                except TransientStoreError as again:
                    error = again
                    continue
                except ObjectExistsError as exc:
                    answered = True
                    # An earlier attempt may have landed before its answer was lost: the
                    # key may hold our own bytes (a log writer then reads them).
                    exc.after_retry = True
                    raise
                except StoreError:
                    answered = True  # a 404 or a lost race is an answer: the store is back
                    raise
                answered = True
                return result
            raise AssertionError("unreachable")
        finally:
            recovered_after_s = self._stalls.end()
            if answered and recovered_after_s is not None:  # the end of a stall that was warned about
                _logger.warning(
                    "%s: store answering again after %.1f s stalled (%d retries in this process so far)",
                    self.url, recovered_after_s, self._stalls.retries,
                )  # fmt: skip

    def _warn_retrying(
        self, error: TransientStoreError, request: str, attempt: int, stalled_s: float, budget_s: float
    ) -> None:
        """The line a 3 a.m. reader needs: what is retried, for how long, and why."""
        _logger.warning(
            "%s: store throttled or unavailable: retrying %s %s for up to %g s (attempt %d, stalled %.1f s so far): %s",
            self.url, request.upper(), error.key, budget_s, attempt, stalled_s, _short(error.problem),
        )  # fmt: skip

    def _pause(self, seconds: float) -> bool:
        """Wait before the next attempt; False when this thread was told to stop retrying
        meanwhile (``retry.stop_retrying_when``: its reader or producer is closing)."""
        stop = retry.stop_event()
        if stop is None:
            self._retry_sleep(seconds)
            return True
        return not stop.wait(seconds)

    def _budget_s(self) -> float:
        """How long a failing request is retried: the deadline, or a few seconds while no
        request of this process ever reached the server (a mistyped or dead endpoint
        should say so at once, not after minutes of silence at startup)."""
        if self._reached:
            return self.retry_deadline_s
        return min(self.retry_deadline_s, retry.UNREACHABLE_DEADLINE_S)

    def _gave_up(self, error: TransientStoreError, attempts: int, stalled_s: float, budget_s: float) -> StoreError:
        if not self._reached:
            why = (
                f"; no request of this process ever reached the store (gave up after {stalled_s:.1f} s and "
                f"{attempts} attempts): check the endpoint, the network and the URL"
            )
        elif self.max_attempts is not None and attempts >= self.max_attempts and stalled_s < budget_s:
            why = f"; gave up after {attempts} attempts (max_attempts)"
        else:
            why = (
                f"; still failing after {stalled_s:.1f} s and {attempts} attempts "
                f"(storage option {RETRY_DEADLINE_OPTION}={budget_s:g})"
            )
        return TransientStoreError(error.key, error.problem + why, retried_s=stalled_s)


def _limiter_for(root: str) -> retry.RequestRateLimiter:
    with _limiters_lock:
        limiter = _limiters.get(root)
        if limiter is None:
            limiter = _limiters[root] = retry.RequestRateLimiter(time.monotonic())
        return limiter


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
