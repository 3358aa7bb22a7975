"""What drives a reader's pipeline: the calling thread (inline) or threads of its own.

The pipeline (``reading.pipeline``) turns the log into steps queued in order; a driver
decides who advances the log and who reads each step's slices:

- ``InlineDriver`` (a local directory or memory, ``prefetch=None``): ``next()`` advances
  the log only when no step is queued and reads each step itself. No thread at all: a
  local read costs less than any hand-off.
- ``ThreadedDriver`` (an object store, or a ``prefetch`` given): a background thread
  follows the log, and a pool fetches a window of steps ahead (``reading.window``), the
  pool and the window sized from the first step's bytes unless ``prefetch`` was given.

Both queue *deliveries*: objects whose ``result(deadline)`` is the step, waited for
(together with the proof of the log versions it came from) until a deadline, or ``Late``.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from fractions import Fraction
from typing import Any

from batchweave import retry
from batchweave.reading.fetch import Batch, SliceFetcher, step_bytes
from batchweave.reading.steps import PlannedStep, StepPlan
from batchweave.reading.window import FetchWindow

__all__ = [
    "AUTO_PREFETCH_BYTES",
    "CLOSE_WAIT_S",
    "LOG_LOOKAHEAD_TGBS",
    "MAX_AUTO_PREFETCH",
    "MIN_AUTO_PREFETCH",
    "Delivery",
    "Fetched",
    "InlineDriver",
    "Late",
    "ThreadedDriver",
    "left_s",
]

# prefetch=None: as many steps ahead as fit in this budget, within these bounds. A
# cloud store answers in about 25 ms whatever the size, so small slices need many
# reads in flight to keep up; large ones are bandwidth-bound with a few. Not more than
# 64: each read in flight holds a fetch thread, and 128 of them ran slower than 64 in
# ``bench consumers`` (100 KB slices, 25 ms: 36 against 70 MB/s a rank, raw reads alike),
# the interpreter's lock, not the store, being what they wait for.
AUTO_PREFETCH_BYTES = 64 << 20
MIN_AUTO_PREFETCH = 4
MAX_AUTO_PREFETCH = 64
# TGBs read from the log ahead of the fetches scheduled: the log reader learns where the
# coming steps live (and finds the end of a backlog) while the fetch slots are all taken.
# Descriptors only, a few KB each.
LOG_LOOKAHEAD_TGBS = 256
# Seconds close() waits for the threads: a read hung longer ends on its own (the threads
# stop retrying once the reader is closing), and a consumer may start reading again meanwhile.
CLOSE_WAIT_S = 10.0

Fetched = tuple[Batch, Fraction | int]
Fetch = Callable[..., Fetched]  # a step's read: ``SliceFetcher.fetch`` with its arguments bound
Steps = Generator[float, None, None]  # the pipeline's log follower: yields the pause before the next probe


class InlineDriver:
    """The calling thread drives everything (see the module doc)."""

    depth = 1
    expects_reads = False  # no read ahead, so nothing for the fetcher to join (``reading.runs``)

    def __init__(self, ready: queue.SimpleQueue[Any]) -> None:
        self._ready = ready
        self._steps: Steps | None = None

    def start(self, steps: Steps) -> None:
        self._steps = steps

    def take(self, deadline: float | None) -> Any:
        """Advance the log until a step is queued (queue.Empty once ``deadline`` passes)."""
        try:
            return self._ready.get_nowait()  # usually a version holds several steps
        except queue.Empty:
            pass
        assert self._steps is not None
        while self._ready.empty():
            try:
                pause = next(self._steps)
            except StopIteration:
                break  # it queued the end or an error first
            except Exception as exc:  # of any type: raised in order, like the thread's
                self._ready.put(exc)
                break
            if pause and self._ready.empty():
                if deadline is not None and time.monotonic() + pause > deadline:
                    time.sleep(max(0.0, deadline - time.monotonic()))
                    if self._ready.empty():
                        raise queue.Empty
                time.sleep(pause)
        return self._ready.get_nowait()

    def handed(self, delivery: Any) -> None:
        """A step was taken from the queue: nothing to slide."""

    def expect(self) -> None:
        """Nothing is read ahead, so no read joins another."""

    def submit(
        self, planned: PlannedStep, fetch: Callable[..., Fetched], proof: Future[None] | None, block: bool
    ) -> bool:
        """Queue the step for ``next()`` to read itself; the log is advanced only when
        nothing is queued."""
        self._ready.put(Deferred(fetch, proof))
        return True

    def stop(self) -> None:
        """Nothing runs but the caller."""

    def close(self) -> bool:
        """Close the log follower (the calling thread's); True: release the rest now."""
        if self._steps is not None:
            self._steps.close()
        return True

    def release(self) -> None:
        """No threads to let go."""


class ThreadedDriver:
    """A background thread follows the log and a pool fetches ahead (see the module doc).

    Args:
        ready: the queue of deliveries (and the end, or an error) the pipeline reads.
        plan, fetcher: the pipeline's plan of steps and its slice fetcher.
        prefetch: steps fetched ahead (None: chosen from the first step's bytes).
        stop: set when the reader stops: the threads end.
        on_stopped: what the follow thread calls once it ended because the reader stopped
            (the pipeline's release: nothing else may release while the thread reads).
    """

    expects_reads = True

    def __init__(
        self,
        ready: queue.SimpleQueue[Any],
        plan: StepPlan,
        fetcher: SliceFetcher,
        prefetch: int | None,
        stop: threading.Event,
        on_stopped: Callable[[], None],
    ) -> None:
        self._ready = ready
        self._plan = plan
        self._fetcher = fetcher
        self.depth = prefetch  # None: chosen from the first step's bytes
        self._stop = stop
        self._on_stopped = on_stopped
        self._window: FetchWindow | None = None  # the steps fetched ahead, made with the pool
        self._pool: ThreadPoolExecutor | None = None
        self._fetch_threads: list[threading.Thread] = []  # the pool's, for close() to wait for
        self._expected_until = 0  # the steps before this one were expected (``expect``)
        self._joined: set[int] = set()  # expected steps whose bytes an earlier step's read brings
        self._steps: Steps | None = None
        self._thread: threading.Thread | None = None

    def start(self, steps: Steps) -> None:
        self._steps = steps
        _live.add(self)
        self._thread = threading.Thread(target=self._follow, name="batchweave-follow", daemon=True)
        self._thread.start()

    def take(self, deadline: float | None) -> Any:
        return self._ready.get(timeout=left_s(deadline))

    def handed(self, delivery: Any) -> None:
        """A step was taken from the queue: its turn in the window ends (a joined step
        took none)."""
        if self._window is not None and not isinstance(delivery, Joined):
            self._window.handed()

    def expect(self) -> None:
        """Tell the fetcher every ready step not told yet, before the first of them may be
        fetched: the first read of a pack then covers all of its steps the log has shown,
        not only those queued before a fetch thread took it up (in step order, once each)."""
        step = max(self._expected_until, self._plan.next_step)
        while (planned := self._plan.read_at(step)) is not None:
            if self._fetcher.expect(planned.tgb, planned.read):
                self._joined.add(step)
            step += 1
        self._expected_until = step

    def submit(
        self, planned: PlannedStep, fetch: Callable[..., Fetched], proof: Future[None] | None, block: bool
    ) -> bool:
        """Queue the step's fetch on the pool once a slot of the window is free (waiting
        for one only if ``block``); False when no slot was taken."""
        if planned.step in self._joined:
            # Its bytes come with an earlier step's read (a pack's run, ``reading.runs``),
            # done by the time next() reaches this step: next() takes them itself. No fetch
            # thread waits for that read, and no turn of the window is taken: the window
            # counts reads in flight, and the first step's turn counted the run's bytes.
            self._joined.discard(planned.step)
            # Not timed: the fetch latencies are the reads' (the run's was recorded).
            self._ready.put(Joined(functools.partial(fetch, timed=False), proof))
            return True
        window = self._fetch_window(planned)
        if window.waiting > window.depth + LOG_LOOKAHEAD_TGBS:
            # The log is far ahead of the fetches: keep the rest in the plan, or wait.
            if not block or not window.wait_room(window.depth + LOG_LOOKAHEAD_TGBS):
                return False
        assert self._pool is not None
        turn = window.queue(self._fetcher.read_bytes(planned.tgb, planned.read))
        fetched = self._pool.submit(_fetch_in_turn, window, turn, fetch)
        proven = proof is None or (proof.done() and not proof.exception())
        self._ready.put(Gated(None if proven else proof, fetched))
        return True

    def stop(self) -> None:
        """Stop without waiting: fetch threads waiting for a turn return, reads in flight
        stop retrying, the follow thread stops at its next step."""
        self._stop.set()
        if self._window is not None:
            self._window.close()

    def close(self) -> bool:
        """Wait for the threads, ``CLOSE_WAIT_S`` at most; True if the follow thread has
        ended (the caller releases the rest; else the thread does once its read ends)."""
        _live.discard(self)
        deadline = time.monotonic() + CLOSE_WAIT_S
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)  # it closes the log reader (``_follow``)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            for thread in self._fetch_threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        return self._thread is None or not self._thread.is_alive()

    def release(self) -> None:
        """Let the idle fetch threads end."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _follow(self) -> None:
        """The follow thread: drive the log follower until stopped."""
        assert self._steps is not None
        retry.stop_retrying_when(self._stop)
        try:
            for pause in self._steps:
                if self._stop.wait(pause) if pause else self._stop.is_set():
                    return
        except Exception as exc:  # of any type: next() raises it instead of waiting forever
            self._ready.put(exc)
        finally:
            self._steps.close()  # the log reader's threads, closed by the thread that drives it
            if self._stop.is_set():  # closing, or stopped without close(): nothing else may release them
                self._on_stopped()

    def _fetch_window(self, planned: PlannedStep) -> FetchWindow:
        """The window of fetches ahead, sized from the first step's bytes unless ``prefetch`` was given."""
        if self._window is None:
            first_bytes = step_bytes(planned.tgb, planned.read)
            # prefetch=None bounds the bytes ahead too (later steps may be larger than the
            # first); an explicit prefetch is a number of steps, as documented.
            budget = None if self.depth else auto_budget(first_bytes)
            self.depth = self.depth or auto_depth(first_bytes)
            # One thread per step in the window: the steps queued past it wait in the pool's
            # queue, not on threads of their own.
            self._pool = ThreadPoolExecutor(
                max_workers=self.depth,
                thread_name_prefix="batchweave-fetch",
                initializer=_fetch_thread,  # close() during a storm does not wait it out
                initargs=(self._stop, self._fetch_threads),
            )
            self._window = FetchWindow(self.depth, self._stop, budget)
        return self._window


# -- deliveries ---------------------------------------------------------------------------


class Late(Exception):
    """A step's proof or read was not done by ``next()``'s deadline (says which)."""


class Deferred:
    """A fetch the iterating thread performs itself when it reaches the step, once the
    proof of what it reads is done (``result`` as for ``Gated``)."""

    __slots__ = ("_fetch", "_proof")

    def __init__(self, fetch: Callable[[], Fetched], proof: Future[None] | None) -> None:
        self._fetch = fetch
        self._proof = proof

    def result(self, deadline: float | None) -> Fetched:
        if self._proof is not None:
            _settled(self._proof, deadline, "the proof of its log versions")
        # The deadline does not bound the read itself: the iterating thread makes it, and a
        # local read cannot be interrupted (nor does it hang as a request can).
        return self._fetch()


class Joined(Deferred):
    """A step whose bytes an earlier step's read brought (``reading.runs``): taken in the
    iterating thread once that step was handed out (so its read is done)."""

    __slots__ = ()


class Gated:
    """A step fetched on the pool, delivered once the proof of its log versions is done
    (None: proven when the step was queued), or the proof's error instead."""

    __slots__ = ("_fetched", "_proof")

    def __init__(self, proof: Future[None] | None, fetched: Future[Fetched]) -> None:
        self._proof = proof
        self._fetched = fetched

    def result(self, deadline: float | None) -> Fetched:
        """The step, waiting until ``deadline`` (monotonic seconds; None: no bound) for
        the proof and the fetch; Late if either is not done by then."""
        if self._proof is not None:
            _settled(self._proof, deadline, "the proof of its log versions")
        return _settled(self._fetched, deadline, "the read of its slices")


Delivery = Deferred | Gated


def _settled(future: Future[Any], deadline: float | None, what: str) -> Any:
    """``future``'s result, or Late naming ``what`` if it is not done by ``deadline``.
    (Not ``future.result(timeout)``: its TimeoutError could be the work's own error;
    ``exception`` returns that one, and raises TimeoutError only for its own wait. Not
    ``wait([future])`` either: it builds a waiter per call, on every step's every slice.)"""
    if not future.done():
        try:
            future.exception(left_s(deadline))
        except TimeoutError:
            raise Late(what) from None
    return future.result()


def left_s(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (monotonic), 0 once passed; None: no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _fetch_in_turn(window: FetchWindow, turn: int, fetch: Callable[[], Fetched]) -> Fetched:
    """A pool thread: fetch once the step's turn has come (the window slid to it)."""
    if not window.wait_turn(turn):
        raise CancelledError("the reader is closing")
    return fetch()


def _fetch_thread(stop: threading.Event, threads: list[threading.Thread]) -> None:
    """A fetch thread's start: it stops retrying once the reader is closing, and is
    counted for close() to wait for (the pool's own list is private)."""
    retry.stop_retrying_when(stop)
    threads.append(threading.current_thread())


def auto_depth(step_bytes: int) -> int:
    """Steps to fetch ahead when ``prefetch`` is None: a 64 MiB budget, 4 to 64 steps."""
    return max(MIN_AUTO_PREFETCH, min(MAX_AUTO_PREFETCH, AUTO_PREFETCH_BYTES // max(step_bytes, 1)))


def auto_budget(step_bytes: int) -> int:
    """Bytes fetched ahead at most when ``prefetch`` is None: 64 MiB, or the minimum of
    steps of the first step's size where that is more (steps of 40 MB: 4 of them, 160 MB).
    Fixed at the first step, so larger steps later get fewer in flight, never more memory."""
    return max(AUTO_PREFETCH_BYTES, MIN_AUTO_PREFETCH * step_bytes)


# The threaded drivers not closed yet, stopped before the interpreter's exit joins their
# fetch threads: a fetch thread waiting for a turn that no step will open (the script left
# its loop without close()) would otherwise keep the process alive for ever.
_live: weakref.WeakSet[ThreadedDriver] = weakref.WeakSet()


def _stop_live_drivers() -> None:
    for driver in list(_live):
        driver.stop()


# concurrent.futures joins its pool threads at exit with a hook of this kind, registered
# when ThreadPoolExecutor was imported above; the hooks run in reverse order (CPython's
# threading._shutdown), so this one runs first.
threading._register_atexit(_stop_live_drivers)  # pyright: ignore[reportAttributeAccessIssue]
