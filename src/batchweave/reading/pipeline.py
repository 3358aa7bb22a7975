"""The reading pipeline: follows the log from a cursor and queues one rank's steps in order.

It joins the reading side's parts: the log source (``reading.logsource``: the rank's own
follower, proven versions paced at the head, or the node's), the plan of steps
(``reading.steps``), the fetcher (``reading.fetch``) and the driver (``reading.driver``:
the calling thread on a local store, a follow thread and a pool of fetches on an object
store). ``_follow_log`` is a generator that reads the log, queues the steps it finds and
yields how long to pause before probing again (0 after progress); the driver runs it.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any

from batchweave.errors import StepTimeoutError
from batchweave.journal import Journal
from batchweave.log import LogVersion, ReadVersion
from batchweave.mesh import Mesh
from batchweave.metrics import FetchRecorder
from batchweave.reading.cursor import Cursor
from batchweave.reading.driver import LOG_LOOKAHEAD_TGBS, Delivery, Fetched, InlineDriver, Late, ThreadedDriver
from batchweave.reading.fetch import SliceFetcher
from batchweave.reading.follower import Unproven
from batchweave.reading.logsource import LogSource
from batchweave.reading.node import NodePlan
from batchweave.reading.nodeclient import NodeClient
from batchweave.reading.polling import HeadPolling
from batchweave.reading.runs import RangeRuns
from batchweave.reading.sharedlog import NodeFollower
from batchweave.reading.steps import PlannedStep, StepPlan
from batchweave.store import Store

__all__ = ["Pipeline"]

_END = object()

_logger = logging.getLogger(__name__)


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
        node_follower: a node follower in this process (``Consumer.attach_node``).
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
        node_follower: NodeFollower | None,
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
        self._late: Delivery | None = None
        inline = prefetch is None and not store.remote
        self._stop = threading.Event()
        self._broken: BaseException | None = None  # what the log reader or a fetch raised: final
        # The proof of the newest versions taken, while it may still run: the steps scheduled
        # meanwhile are delivered once it is done (I10), their reads made beside it.
        self._gate: Future[None] | None = None
        self._node: NodeFollower | None = node_follower
        if node is not None and not inline:
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
            runs=None if inline else RangeRuns(),
        )
        self._driver: InlineDriver | ThreadedDriver = (
            InlineDriver(self._ready)
            if inline
            else ThreadedDriver(self._ready, self._plan, self._fetcher, prefetch, self._stop, self._release)
        )
        self._driver.start(self._follow_log())

    @property
    def depth(self) -> int | None:
        """Steps fetched ahead at most (None until the first step's bytes chose it)."""
        return self._driver.depth

    @property
    def head_version(self) -> int:
        """The newest log version read and proven."""
        return self._plan.head_version

    @property
    def log_requests(self) -> int:
        """Requests this reader's own journal made to the log (probes, reads, proofs)."""
        return self._journal.requests

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
        except Late as late:
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
        self._driver.stop()

    def close(self) -> None:
        """Stop the threads and the log reader's; wait for them at most ``CLOSE_WAIT_S``
        (``reading.driver``)."""
        self.stop()
        if self._driver.close():
            self._release()  # else the follow thread does once its read ends (not both at once)

    def _release(self) -> None:
        """Let the idle fetch threads end and the node's hub go, and forget the ranges
        expected and not read (again: no harm)."""
        self._fetcher.close()
        self._driver.release()
        if self._node is not None:
            self._node.close()

    def _take(self, deadline: float | None, timeout_s: float | None) -> Delivery:
        """The next delivery from the queue, waiting until ``deadline``; StopIteration at the end."""
        try:
            item = self._driver.take(deadline)
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
        self._driver.handed(item)
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

    # -- following the log -----------------------------------------------------------------

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
            had_layout = self._plan.reshard is not None
            try:
                self._plan.take(delta)
            except Exception:
                if proof is not None:
                    proof.result()  # a view the proof rejects says so first: the damage may be GC's doing
                raise
            if not had_layout:
                self._tell_reshard()
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
                    self._warn_leftover()
                    self._ready.put(_END)
                return False
        return True

    def _tell_reshard(self) -> None:
        """Once the first TGB showed the layout: say how a mesh other than it reads (once
        per reading start, at INFO: a change of mesh is a choice, but it changes the
        global batch and the step numbers)."""
        reshard = self._plan.reshard
        if reshard is not None and not reshard.identity:
            _logger.info("%s rank %d: %s", self._url, self._rank, reshard.describe())

    def _warn_leftover(self) -> None:
        """At the end of the stream: the trailing TGBs that make no whole step of this mesh
        are never delivered; say so, with their count."""
        reshard = self._plan.reshard
        text = "" if reshard is None else reshard.describe_leftover(self._plan.tgbs_seen)
        if text:
            _logger.warning("%s rank %d: the stream ended: %s", self._url, self._rank, text)

    # -- scheduling the fetches -------------------------------------------------------------

    def _schedule_ready(self, block_until: int) -> bool:
        """Schedule the steps whose TGBs are all committed, as far as fetch slots allow;
        wait for slots only while more than ``block_until`` TGBs read from the log are not
        scheduled yet (so the log is read ahead of the fetches, boundedly). False when
        stopping."""
        plan = self._plan
        self._driver.expect()
        while (planned := plan.next_read()) is not None:
            if not self._enqueue(planned, block=plan.unscheduled > block_until):
                return not self._stop.is_set()  # no slot free now: the log is read on meanwhile
            plan.advance()
        return True

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
        return self._driver.submit(planned, fetch, self._gate, block)
