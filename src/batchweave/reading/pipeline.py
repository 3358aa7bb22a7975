"""The reading pipeline: follows the log from a cursor and prefetches one rank's steps in order.

It joins the reading side's parts: the log source (``reading.logsource``: the rank's own
follower, proven versions paced at the head, or the node's), the plan of steps
(``reading.steps``) and the fetcher (``reading.fetch``). ``follow_log`` is a generator
that reads the log, queues the steps it finds and yields how long to pause before probing
again (0 after progress). On an object store a background thread drives it and a thread
pool fetches ahead; on a local directory or memory, ``next()`` drives it only when no step
is queued and reads each step itself: no thread at all, since a local read costs less than
any hand-off.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from fractions import Fraction
from typing import Any

from batchweave import retry
from batchweave.errors import StepTimeoutError
from batchweave.journal import Journal
from batchweave.log import LogVersion, ReadVersion
from batchweave.mesh import Mesh
from batchweave.metrics import FetchRecorder
from batchweave.reading.cursor import Cursor
from batchweave.reading.fetch import Batch, SliceFetcher, step_bytes
from batchweave.reading.follower import Unproven
from batchweave.reading.logsource import LogSource
from batchweave.reading.node import NodePlan
from batchweave.reading.nodeclient import NodeClient
from batchweave.reading.polling import HeadPolling
from batchweave.reading.runs import RangeRuns
from batchweave.reading.sharedlog import InlineNode
from batchweave.reading.steps import PlannedStep, StepPlan
from batchweave.reading.window import FetchWindow
from batchweave.store import Store

__all__ = [
    "AUTO_PREFETCH_BYTES",
    "LOG_LOOKAHEAD_TGBS",
    "MAX_AUTO_PREFETCH",
    "MIN_AUTO_PREFETCH",
    "Pipeline",
]

_logger = logging.getLogger("batchweave.consumer")
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

_END = object()
Fetched = tuple[Batch, Fraction | int]


class Pipeline:
    """One rank's steps from ``cursor`` on (see the module doc).

    Args:
        store: the namespace's store.
        mesh, rank: the consumer's mesh and rank.
        cursor: where to start.
        prefetch: steps fetched ahead (None: chosen from the first step's bytes on an
            object store, none on a local one).
        sequence_axis: as for ``Consumer``.
        max_poll_interval_s: the longest pause between probes of an idle log.
        node: the rank's node plan (a hub shares the log and the reads), or None.
        node_follower: a node follower given in-process (the deterministic simulation).
        fetches: where fetch latencies are recorded.
    """

    def __init__(
        self,
        store: Store,
        mesh: Mesh,
        rank: int,
        cursor: Cursor,
        *,
        prefetch: int | None,
        sequence_axis: int,
        max_poll_interval_s: float,
        node: NodePlan | None,
        node_follower: InlineNode | None,
        fetches: FetchRecorder,
    ) -> None:
        self._store = store
        self._journal = Journal(store, read_only=True)
        if cursor.digest:
            self._journal.anchor_on(cursor.version, cursor.digest)
        self._url = store.url
        self._rank = rank
        self._next_delivered = cursor.step  # for messages
        self._plan = StepPlan(mesh, rank, mesh.slice_index(rank), cursor, store.url)
        followers = node.nodes if node is not None else mesh.world_size
        self._polling = HeadPolling(followers, max_poll_s=max_poll_interval_s, copies=store.head_copies, url=self._url)
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()  # C-implemented: no lock hand-offs
        # The step taken from the queue whose proof or fetch was not done when next() timed
        # out: the next call waits for it again (a timeout never skips nor repeats a step).
        self._late: _Gated | _Deferred | None = None
        self.depth = prefetch  # None: chosen from the first step's bytes
        self._inline = prefetch is None and not store.remote
        self._window: FetchWindow | None = None  # background mode: the steps fetched ahead
        self._stop = threading.Event()
        self._broken: BaseException | None = None  # what the log reader or a fetch raised: final
        # The proof of the newest versions taken, while it may still run: the steps scheduled
        # meanwhile are delivered once it is done (I10), their reads made beside it.
        self._gate: Future[None] | None = None
        self._node: NodeClient | InlineNode | None = node_follower
        if node is not None and not self._inline:
            self._node = NodeClient(node.address, store, self._polling, node.sharers)
        # A slice no other rank of the node reads gains nothing from the hub: read directly.
        shares_reads = self._node is not None and (node is None or node.sharers > 1)
        self._source = LogSource(
            store,
            self._journal,
            cursor,
            self._node,
            self._polling,
            self._first_needed,
            self._stop,
            rank,
            checked=self._cursor_checked,
        )
        self._expected_until = 0  # the steps before this one were expected (``_expect_ready``)
        self._joined: set[int] = set()  # expected steps whose bytes an earlier step's read brings
        self._fetcher = SliceFetcher(
            store,
            self._journal,
            slice_index=mesh.slice_index(rank),
            sequence_axis=sequence_axis,
            fetches=fetches,
            start=cursor.position,
            node=self._node if shares_reads else None,
            # Inline mode reads without runs (``reading.runs``): a local read costs less
            # than their bookkeeping, and there is no request's round trip to save.
            runs=None if self._inline else RangeRuns(),
        )
        self._steps = self._follow_log()
        self._pool: ThreadPoolExecutor | None = None  # the fetch threads, made with the window
        self._fetch_threads: list[threading.Thread] = []  # the pool's, for close() to wait for
        self._thread: threading.Thread | None = None
        if self._inline:
            self.depth = 1
            return
        _live.add(self)
        self._thread = threading.Thread(target=self._follow, name="batchweave-follow", daemon=True)
        self._thread.start()

    @property
    def head_version(self) -> int:
        """The newest log version read and proven."""
        return self._plan.head_version

    @property
    def tgbs_seen(self) -> int:
        """TGBs the log has shown (the newest version read ends there)."""
        return self._plan.tgbs_seen

    @property
    def namespace(self) -> str:
        """The namespace's id, once known."""
        return self._plan.namespace

    def next(self, timeout_s: float | None) -> Fetched:
        """The next step and the position after it; StepTimeoutError once the call has
        waited ``timeout_s`` in all (for the log, the step's proof and its read). A timeout
        is not final: the next call waits for the same step."""
        if self._broken is not None:
            raise self._broken  # never skip past a step that failed
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        item = self._late if self._late is not None else self._take(deadline, timeout_s)
        self._late = None
        try:
            batch, position = item.result(deadline)
        except _Late as late:
            self._late = item
            raise StepTimeoutError(
                f"{self._url}: step {self._next_delivered} not delivered within {timeout_s}s: {late} "
                f"is still in flight (log seen up to version {self.head_version}); "
                f"{self._likely_cause('the store is slow to answer or does not answer')}"
            ) from None
        except Exception as exc:  # a failed fetch or proof is final: never skip past a step
            self._broken = exc
            raise
        self._next_delivered = batch.step + 1
        return batch, position

    def stop(self) -> None:
        """Stop without waiting: fetch threads waiting for a turn return, reads in flight
        stop retrying, the log reader stops at its next step. Never blocks: it is what a
        consumer garbage collected and the interpreter's exit do."""
        self._stop.set()
        if self._window is not None:
            self._window.close()

    def close(self) -> None:
        """Stop the threads and the log reader's; wait for them at most ``CLOSE_WAIT_S``."""
        self.stop()
        _live.discard(self)
        deadline = time.monotonic() + CLOSE_WAIT_S
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)  # it closes the log reader and releases the rest (``_follow``)
        else:
            self._steps.close()  # inline: the log reader is the iterating thread's
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            for thread in self._fetch_threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread is None or not self._thread.is_alive():
            self._release()  # else the follow thread does once its read ends (not both at once)

    def _release(self) -> None:
        """Let the idle fetch threads end and the node's hub go, and forget the ranges
        expected and not read (again: no harm)."""
        self._fetcher.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._node is not None:
            self._node.close()

    def _take(self, deadline: float | None, timeout_s: float | None) -> _Gated | _Deferred:
        """The next step from the queue, waiting until ``deadline``; StopIteration at the end."""
        try:
            item = self._pull(deadline) if self._inline else self._ready.get(timeout=_left_s(deadline))
        except queue.Empty:
            seen = f"log seen up to version {self.head_version}" if self.head_version else "nothing committed yet"
            raise StepTimeoutError(
                f"{self._url}: no step {self._next_delivered} within {timeout_s}s ({seen}); {self._likely_cause()}"
            ) from None
        if item is _END:
            self._ready.put(_END)  # stay exhausted on later calls
            raise StopIteration
        if isinstance(item, BaseException):
            self._broken = item
            raise item
        if self._window is not None and not isinstance(item, _Joined):
            self._window.handed()
        return item

    def _likely_cause(self, otherwise: str = "") -> str:
        stalled_s = self._store.stalled_now_s
        if stalled_s > 0:
            return (
                f"the store has been throttled or unavailable for {stalled_s:.0f} s and is being retried "
                "(WARNING lines of logger batchweave.store)"
            )
        if otherwise:
            return otherwise
        if not self.head_version:
            return "check that this is the producers' URL (prefix included) and that they are running"
        return "are producers running?"

    def _pull(self, deadline: float | None) -> Any:
        """Inline mode: advance the log until a step is queued (or ``deadline`` passes)."""
        try:
            return self._ready.get_nowait()  # usually a version holds several steps
        except queue.Empty:
            pass
        while self._ready.empty():
            try:
                pause = next(self._steps)
            except StopIteration:
                break  # it queued _END or an error first
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

    # -- following the log -----------------------------------------------------------------

    def _follow(self) -> None:
        """Background mode: drive the log follower until stopped."""
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
                self._release()

    def _follow_log(self) -> Generator[float, None, None]:
        """Queue every step as the log shows it; yield the pause before the next probe."""
        source = self._source.versions()
        try:
            for item in source:
                if isinstance(item, Unproven):
                    if not self._take_all(item.versions, item.proof):
                        return
                    yield 0.0  # reading on
                    continue
                if isinstance(item, list):
                    if not self._take_all(item):
                        return
                    continue
                if item == 0.0:  # reading on (a proof is in flight): no pause, nothing to schedule
                    yield 0.0
                    continue
                waiting = self._plan.next_step
                if not self._schedule_ready(block_until=0):  # steps read ahead of the fetches go first
                    return
                # Progress took a while: look at the log again before pausing.
                yield 0.0 if self._plan.next_step != waiting else item
        finally:
            source.close()

    def _first_needed(self) -> int:
        return self._plan.first_needed

    def _cursor_checked(self, cursor: Cursor) -> None:
        self._plan.namespace = cursor.namespace or self._plan.namespace

    def _take_all(self, batch: list[ReadVersion], proof: Future[None] | None = None) -> bool:
        """Take each version in order and queue its steps, delivered once ``proof`` is done
        (None: proven already); False as soon as the reader stops (the stream ended, or the
        consumer is closing)."""
        self._gate = proof
        for read in batch:
            delta: LogVersion = read.delta
            try:
                self._plan.take(delta)
            except Exception:
                if proof is not None:
                    proof.result()  # a view the proof rejects says so first: the damage may be GC's doing
                raise
            if not self._schedule_ready(block_until=LOG_LOOKAHEAD_TGBS):
                return False
            if delta.end_of_stream:
                if proof is not None:
                    # Ending the stream acts on the log as delivering does: only on a proven
                    # view (I10). An end read from a freed key re-created by a stale writer
                    # would otherwise end a reader that GC overtook, not tell it so.
                    proof.result()
                if self._schedule_ready(block_until=0):
                    # A last logical step whose TGBs never all arrived (DP grown) is not a step.
                    self._ready.put(_END)
                return False
        return True

    # -- scheduling the fetches -------------------------------------------------------------

    def _schedule_ready(self, block_until: int) -> bool:
        """Schedule the steps whose TGBs are all committed, as far as fetch slots allow;
        wait for slots only while more than ``block_until`` TGBs read from the log are not
        scheduled yet (so the log is read ahead of the fetches, boundedly). False when
        stopping."""
        plan = self._plan
        self._expect_ready()
        while (planned := plan.next_read()) is not None:
            if not self._enqueue(planned, block=plan.unscheduled > block_until):
                return not self._stop.is_set()  # no slot free now: the log is read on meanwhile
            plan.advance()
        return True

    def _expect_ready(self) -> None:
        """Tell the fetcher every ready step not told yet, before the first of them may be
        fetched: the first read of a pack then covers all of its steps the log has shown,
        not only those queued before a fetch thread took it up (in step order, once each)."""
        if self._inline:
            return
        step = max(self._expected_until, self._plan.next_step)
        while (planned := self._plan.read_at(step)) is not None:
            if self._fetcher.expect(planned.tgb, planned.read):
                self._joined.add(step)
            step += 1
        self._expected_until = step

    def _enqueue(self, planned: PlannedStep, block: bool) -> bool:
        """Queue one step's fetch in step order: for ``next()`` to run itself (inline), or
        on the pool once a fetch slot is free. False when no slot was taken."""
        fetcher = self._fetcher
        if planned.as_written:
            fetch: Callable[[], Fetched] = functools.partial(
                fetcher.fetch_as_written, planned.tgb, planned.step, planned.version
            )
        else:
            fetch = functools.partial(
                fetcher.fetch, planned.tgb, planned.read, planned.step, planned.version, planned.position
            )
        gate = self._gate
        if self._inline:  # next() reads it; the log is advanced only when nothing is queued
            self._ready.put(_Deferred(fetch, gate))
            return True
        if planned.step in self._joined:
            # Its bytes come with an earlier step's read (a pack's run, ``reading.runs``),
            # done by the time next() reaches this step: next() takes them itself. No fetch
            # thread waits for that read, and no turn of the window is taken: the window
            # counts reads in flight, and the first step's turn counted the run's bytes.
            self._joined.discard(planned.step)
            # Not timed: the fetch latencies are the reads' (the run's was recorded).
            self._ready.put(_Joined(functools.partial(fetch, timed=False), gate))
            return True
        window = self._fetch_window(planned)
        if window.waiting > window.depth + LOG_LOOKAHEAD_TGBS:
            # The log is far ahead of the fetches: keep the rest in the plan, or wait.
            if not block or not window.wait_room(window.depth + LOG_LOOKAHEAD_TGBS):
                return False
        assert self._pool is not None
        turn = window.queue(self._fetcher.read_bytes(planned.tgb, planned.read))
        fetched = self._pool.submit(self._fetch_in_turn, window, turn, fetch)
        proven = gate is None or (gate.done() and not gate.exception())
        self._ready.put(_Gated(None if proven else gate, fetched))
        return True

    def _fetch_window(self, planned: PlannedStep) -> FetchWindow:
        """The window of fetches ahead, sized from the first step's bytes unless ``prefetch`` was given."""
        if self._window is None:
            first_bytes = step_bytes(planned.tgb, planned.read)
            # prefetch=None bounds the bytes ahead too (later steps may be larger than the
            # first); an explicit prefetch is a number of steps, as documented.
            budget = None if self.depth else _auto_budget(first_bytes)
            self.depth = self.depth or _auto_depth(first_bytes)
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

    @staticmethod
    def _fetch_in_turn(window: FetchWindow, turn: int, fetch: Callable[[], Fetched]) -> Fetched:
        """A pool thread: fetch once the step's turn has come (the window slid to it)."""
        if not window.wait_turn(turn):
            raise CancelledError("the reader is closing")
        return fetch()


class _Late(Exception):
    """A step's proof or read was not done by ``next()``'s deadline (says which)."""


class _Deferred:
    """A fetch the iterating thread performs itself when it reaches the step, once the
    proof of what it reads is done (``result`` as for ``_Gated``)."""

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


class _Joined(_Deferred):
    """A step whose bytes an earlier step's read brought (``reading.runs``): taken in the
    iterating thread once that step was handed out (so its read is done)."""

    __slots__ = ()


class _Gated:
    """A step fetched on the pool, delivered once the proof of its log versions is done
    (None: proven when the step was queued), or the proof's error instead."""

    __slots__ = ("_fetched", "_proof")

    def __init__(self, proof: Future[None] | None, fetched: Future[Fetched]) -> None:
        self._proof = proof
        self._fetched = fetched

    def result(self, deadline: float | None) -> Fetched:
        """The step, waiting until ``deadline`` (monotonic seconds; None: no bound) for
        the proof and the fetch; _Late if either is not done by then."""
        if self._proof is not None:
            _settled(self._proof, deadline, "the proof of its log versions")
        return _settled(self._fetched, deadline, "the read of its slices")


def _settled(future: Future[Any], deadline: float | None, what: str) -> Any:
    """``future``'s result, or _Late naming ``what`` if it is not done by ``deadline``.
    (Not ``future.result(timeout)``: its TimeoutError could be the work's own error;
    ``exception`` returns that one, and raises TimeoutError only for its own wait. Not
    ``wait([future])`` either: it builds a waiter per call, on every step's every slice.)"""
    if not future.done():
        try:
            future.exception(_left_s(deadline))
        except TimeoutError:
            raise _Late(what) from None
    return future.result()


def _left_s(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _fetch_thread(stop: threading.Event, threads: list[threading.Thread]) -> None:
    """A fetch thread's start: it stops retrying once the reader is closing, and is
    counted for close() to wait for (the pool's own list is private)."""
    retry.stop_retrying_when(stop)
    threads.append(threading.current_thread())


# The pipelines not closed yet, stopped before the interpreter's exit joins their fetch
# threads: a fetch thread waiting for a turn that no step will open (the script left its
# loop without close()) would otherwise keep the process alive for ever.
_live: weakref.WeakSet[Pipeline] = weakref.WeakSet()


def _stop_live_pipelines() -> None:
    for pipeline in list(_live):
        pipeline.stop()


# concurrent.futures joins its pool threads at exit with a hook of this kind, registered
# when ThreadPoolExecutor was imported above; the hooks run in reverse order (CPython's
# threading._shutdown), so this one runs first.
threading._register_atexit(_stop_live_pipelines)  # pyright: ignore[reportAttributeAccessIssue]


def _auto_depth(step_bytes: int) -> int:
    """Steps to fetch ahead when ``prefetch`` is None: a 64 MiB budget, 4 to 64 steps."""
    return max(MIN_AUTO_PREFETCH, min(MAX_AUTO_PREFETCH, AUTO_PREFETCH_BYTES // max(step_bytes, 1)))


def _auto_budget(step_bytes: int) -> int:
    """Bytes fetched ahead at most when ``prefetch`` is None: 64 MiB, or the minimum of
    steps of the first step's size where that is more (steps of 40 MB: 4 of them, 160 MB).
    Fixed at the first step, so larger steps later get fewer in flight, never more memory."""
    return max(AUTO_PREFETCH_BYTES, MIN_AUTO_PREFETCH * step_bytes)
