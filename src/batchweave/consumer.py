"""The consumer: one training rank reading exactly its own slice of every step.

A background thread follows the log (only ever probing the next version, backing off
while idle) and schedules one range read per step on a small thread pool, up to
``prefetch`` steps ahead. Iteration hands out steps in order; the cursor in
``state_dict()`` counts what the caller has received, never what was prefetched.

The cursor counts TGBs consumed, not steps, so a checkpoint taken on one mesh resumes
on another: when the consumer's DP/CP sizes differ from the TGBs' layout, ``reshard``
maps each logical step of this mesh onto the slices it must read (paper 4.1).
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import reprlib
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from batchweave import log, retry
from batchweave.errors import (
    ConfigError,
    CorruptDataError,
    DataReclaimedError,
    LayoutError,
    ObjectNotFoundError,
    StepTimeoutError,
    StoreError,
    TransientStoreError,
)
from batchweave.journal import Journal
from batchweave.layout import decode_slice
from batchweave.lifecycle.watermarks import Watermark, check_checkpoint_id, write_watermark
from batchweave.log import LogState, LogVersion, ReadVersion, TGBDescriptor
from batchweave.mesh import Mesh, resolve_rank
from batchweave.metrics import ConsumerMetrics, FetchRecorder, PeriodicLog, describe
from batchweave.reading.follower import FollowItem, ProvenLog
from batchweave.reading.node import NodeClient, NodeUnavailableError, resolve_plan
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import DEFAULT_LOG_READ_AHEAD, LogReadAhead
from batchweave.reading.reshard import Reshard, SliceRead
from batchweave.reading.sharedlog import InlineNode, NodeBehind
from batchweave.store import Store, open_store

__all__ = ["Batch", "Consumer"]

# The cursor of Consumer.state_dict() and TGBDataset.state_dict(): flat, under constant
# keys, ints and strings only, so torch.distributed.checkpoint saves and loads it in place.
# /1 had two shapes (Consumer: "position": [n, d]; TGBDataset: flat, as /2 is); both load.
_logger = logging.getLogger(__name__)
CURSOR_FORMAT = "batchweave.cursor/2"
_CURSOR_FORMATS = (CURSOR_FORMAT, "batchweave.cursor/1")
_CURSOR_FIELDS = ("format", "version", "position_numerator", "position_denominator", "step", "dp", "cp")
_CURSOR_V1_FIELDS = ("format", "version", "position", "step")
# prefetch=None: as many steps ahead as fit in this budget, within these bounds. A
# cloud store answers in about 25 ms whatever the size, so small slices need many
# reads in flight to keep up; large ones are bandwidth-bound with a few.
AUTO_PREFETCH_BYTES = 64 << 20
MIN_AUTO_PREFETCH = 4
MAX_AUTO_PREFETCH = 64
# TGBs read from the log ahead of the fetches scheduled: the log reader learns where the
# coming steps live (and finds the end of a backlog) while the fetch slots are all taken.
# Descriptors only, a few KB each.
LOG_LOOKAHEAD_TGBS = 256


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's data for this rank: ``data`` is a dict of numpy arrays, or bytes."""

    step: int
    data: dict[str, np.ndarray] | bytes
    version: int  # the log version that committed the last TGB this step touches


class _Cursor(NamedTuple):  # a tuple: made once per step, and cheaper to make than a frozen dataclass
    version: int  # log version holding the last TGB the delivered steps touched (0 before any)
    position: Fraction | int  # TGBs consumed, the same on every rank whatever the mesh (an int when whole)
    step: int  # next logical step of this consumer's mesh (for messages; position rules)
    namespace: str = ""  # the namespace's id ("" until the log has been read)
    digest: str = ""  # of ``version``'s bytes, once checked against a proven state (never saved)


_END = object()


class Consumer:
    """Iterates this rank's slice of every committed step, from step 0 or a saved cursor.

    Args:
        url: namespace URL.
        dp, cp, tp, pp: mesh sizes; ``dp*cp*tp*pp`` must equal ``WORLD_SIZE`` when set.
        rank: this rank, default ``RANK`` from the environment (torchrun).
        prefetch: steps fetched ahead, each on its own background thread (so also the
            reads in flight at once). None (default) chooses: on an object store, as many
            of this rank's steps as fit in 64 MiB, from 4 to 64 (deep enough to hide 25 ms
            per request behind small slices, bounded for large ones); on a local directory
            or memory, none: the iterating thread reads each step itself, since a local
            read costs less than handing it between threads. Set it for a network file
            system mounted as a directory.
        timeout_s: raise StepTimeoutError when no step arrives for this long (None: wait).
        max_poll_interval_s: longest pause between log probes while idle.
        sequence_axis: the axis along which slices are joined when CP shrank and split
            when CP grew relative to the TGBs' layout (default: the last axis).
        storage_options: obstore options for the store, as for ``Producer``.
        log_metrics_s: log ``metrics()`` at INFO (logger ``batchweave.consumer``) every
            this many seconds of iteration (None: never).
        local_rank, local_world_size: this rank's place on its node, default
            ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the environment (torchrun), else
            0 of 1.
        node_sharing: the ranks of one node share one log follower and one read per
            slice (``batchweave.reading.node``). None (default): on when the node has more than
            one rank, the store is an object store and the system is Linux.

    Opens the store with ``create=False``: a local directory that does not exist is a
    ConfigError at once (on an object store, a namespace nothing was committed to yet is
    fine: the consumer waits for the first commit).
    """

    def __init__(
        self,
        url: str | Store,
        dp: int,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        rank: int | None = None,
        prefetch: int | None = None,
        *,
        timeout_s: float | None = None,
        max_poll_interval_s: float = 1.0,
        sequence_axis: int = -1,
        storage_options: dict[str, Any] | None = None,
        log_metrics_s: float | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        node_sharing: bool | None = None,
    ) -> None:
        self.mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp)
        self.rank = resolve_rank(rank, self.mesh)
        self.slice_index = self.mesh.slice_index(self.rank)
        self.prefetch = check_prefetch(prefetch)
        self.timeout_s = timeout_s
        self.max_poll_interval_s = max_poll_interval_s
        self.sequence_axis = sequence_axis
        self._store = open_store(url, create=False, storage_options=storage_options)
        self.node = resolve_plan(self._store, self.mesh, self.rank, local_rank, local_world_size, node_sharing)
        self._node_override: Any = None  # a node follower given in-process (the deterministic simulation)
        self._cursor = _Cursor(version=0, position=Fraction(0), step=0)
        self._pipeline: _Pipeline | None = None
        self._fetches = FetchRecorder()  # recorded by the fetching threads
        self._delivered = (0, 0, 0.0)  # steps, bytes, seconds next() waited
        self.log_metrics_s = _check_interval(log_metrics_s)
        self._periodic_log = self._new_periodic_log()

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._pipeline is None:
            self._pipeline = _Pipeline(self, self._cursor)
        started = time.perf_counter()
        batch, position = self._pipeline.next(self.timeout_s)
        steps, nbytes, waited = self._delivered
        self._delivered = (steps + 1, nbytes + _nbytes(batch.data), waited + time.perf_counter() - started)
        self._cursor = _Cursor(batch.version, position, batch.step + 1, self._pipeline.namespace)
        if self._periodic_log is not None:
            self._periodic_log.tick()
        return batch

    @property
    def inflight(self) -> int | None:
        """Steps fetched ahead at most: ``prefetch``, or the depth chosen from the data
        when ``prefetch`` is None (None until iteration has read the first TGB)."""
        if self.prefetch is not None:
            return self.prefetch
        return None if self._pipeline is None else self._pipeline.depth

    def metrics(self) -> ConsumerMetrics:
        """How this consumer's reading went so far: steps and bytes handed out, seconds
        ``next()`` waited for data, how far behind the log it is, per-step fetch latency
        (P50, P95, max over the last 1024 fetches), and the store requests retried and
        seconds stalled on throttling or an outage. Cheap: no I/O."""
        steps, nbytes, waited = self._delivered
        p50, p95, worst = self._fetches.percentiles()
        pipeline = self._pipeline
        head_version = max(self._cursor.version, pipeline.head_version if pipeline else 0)
        seen = pipeline.tgbs_seen if pipeline else 0
        return ConsumerMetrics(
            steps=steps,
            bytes=nbytes,
            wait_s=waited,
            head_version=head_version,
            behind_head_steps=max(0, seen - math.floor(self._cursor.position)),
            fetches=self._fetches.fetches,
            fetch_p50_s=p50,
            fetch_p95_s=p95,
            fetch_max_s=worst,
            store_retries=self._store.retries,
            store_stalled_s=self._store.stalled_s,
            store_rate_limit_per_s=self._store.rate_limit_per_s,
            store_rate_limited_s=self._store.rate_limited_s,
        )

    def mark_checkpoint(self, checkpoint_id: str) -> None:
        """Record this rank's cursor as its watermark for ``checkpoint_id``.

        Call it after the training checkpoint holding ``state_dict()`` is durable. Data a
        live checkpoint's watermark can reach is never garbage-collected; TP/PP ranks of
        one position write the same watermark, so any one of them marking is enough.
        """
        coords = self.mesh.coords(self.rank)
        mark = Watermark(
            checkpoint=check_checkpoint_id(checkpoint_id),
            dp=self.mesh.dp,
            cp=self.mesh.cp,
            d=coords.dp,
            c=coords.cp,
            position=Fraction(self._cursor.position),
            version=self._cursor.version,
        )
        write_watermark(self._store, mark)

    def close(self) -> None:
        """Stop background threads; iteration can start again from the cursor."""
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.close()

    # -- checkpointing (torch.distributed.checkpoint Stateful) -----------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor: resume right after the last step this rank received.

        ``batchweave.cursor/2``: ints and strings under constant keys (``format``,
        ``version``, ``position_numerator``, ``position_denominator``, ``step``, ``dp``,
        ``cp``, ``namespace``), the same as ``TGBDataset.state_dict()``.
        ``position_numerator / position_denominator`` counts the TGBs consumed and is what
        a resume uses; ``step`` is the next step counted on this mesh of ``dp`` x ``cp``.
        """
        return _state_dict(self._cursor, self.mesh)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a cursor saved by ``state_dict()``, on this mesh or another.

        A mesh whose DP/CP sizes differ from the saved one is fine when the saved position
        starts one of its steps; otherwise the first ``next()`` raises LayoutError naming
        the nearest steps that do. Steps are then counted on this mesh (``state_dict()``
        says so at once): DP shrunk 2-fold, step 30 resumes as step 60.

        The cursor is checked against the namespace now (a few reads): one saved from
        another namespace, or one whose version and position do not agree with the log,
        raises ConfigError; one whose data was garbage-collected raises DataReclaimedError.
        """
        cursor = _checked_cursor(_parse_cursor(state, self.mesh), Journal(self._store, read_only=True), self._store.url)
        self.close()
        self._cursor = cursor

    @staticmethod
    def state_on_mesh(state: Any, mesh: Mesh) -> dict[str, Any]:
        """``state`` checked and re-expressed on ``mesh``, as ``load_state_dict`` then
        ``state_dict`` on that mesh would give it; no I/O. Raises ConfigError for anything
        that is not a cursor."""
        return _state_dict(_parse_cursor(state, mesh), mesh)

    # -- pickling (handles that cross processes) -------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # Threads and locks stay behind; the copy reads from the cursor with fresh metrics.
        skip = ("_pipeline", "_fetches", "_delivered", "_periodic_log")
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        state["_pipeline"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fetches = FetchRecorder()
        self._delivered = (0, 0, 0.0)
        self._periodic_log = self._new_periodic_log()

    def _new_periodic_log(self) -> PeriodicLog | None:
        if self.log_metrics_s is None:
            return None
        return PeriodicLog(self.log_metrics_s, self._log_metrics, time.monotonic)

    def _log_metrics(self) -> None:
        _logger.info("%s rank %d: %s", self._store.url, self.rank, describe(self.metrics()))

    def __repr__(self) -> str:
        return f"Consumer({self._store.url!r}, rank={self.rank}, mesh={self.mesh}, next_step={self._cursor.step})"


def _check_interval(seconds: Any) -> float | None:
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0):
        raise ConfigError(f"log_metrics_s must be a positive number of seconds or None, got {seconds!r}")
    return seconds


def check_prefetch(prefetch: Any) -> int | None:
    """``prefetch`` as ``Consumer`` and ``TGBDataset`` take it: steps, or None to choose."""
    if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1):
        raise ConfigError(f"prefetch must be a positive number of steps or None, got {prefetch!r}")
    return prefetch


@dataclass(frozen=True)
class RankReading:
    """A ``Consumer``'s arguments for one rank, checked, kept by a framework's reader
    (``batchweave.torch``, ``.grain``, ``.tf``) until it first reads: those readers take
    the consumer's arguments, check them at once, and make no request before."""

    store: Store
    mesh: Mesh
    rank: int
    prefetch: int | None
    timeout_s: float | None
    sequence_axis: int
    node: dict[str, Any]  # local_rank, local_world_size, node_sharing

    @classmethod
    def checked(
        cls,
        url: str | Store,
        mesh: Mesh,
        rank: int | None,
        prefetch: Any,
        timeout_s: float | None,
        sequence_axis: int,
        storage_options: dict[str, Any] | None,
        **node: Any,
    ) -> RankReading:
        store = open_store(url, create=False, storage_options=storage_options)  # checked now, no I/O
        return cls(store, mesh, resolve_rank(rank, mesh), check_prefetch(prefetch), timeout_s, sequence_axis, node)

    def consumer(self) -> Consumer:
        """A new ``Consumer`` for this rank, from step 0."""
        mesh = self.mesh
        return Consumer(
            self.store,
            dp=mesh.dp,
            cp=mesh.cp,
            tp=mesh.tp,
            pp=mesh.pp,
            rank=self.rank,
            prefetch=self.prefetch,
            timeout_s=self.timeout_s,
            sequence_axis=self.sequence_axis,
            **self.node,
        )


def _parse_cursor(state: Any, mesh: Mesh) -> _Cursor:
    """A saved cursor, its step recounted in ``mesh``'s steps: the one parser of cursors.

    Takes ``batchweave.cursor/2`` (what ``state_dict()`` gives) and both shapes of
    ``batchweave.cursor/1``: a ``Consumer``'s, with ``position: [numerator, denominator]``,
    and a ``TGBDataset``'s, with ``position_numerator`` and ``position_denominator``.
    """
    if not isinstance(state, Mapping) or state.get("format") not in _CURSOR_FORMATS:
        raise ConfigError(f"not a BatchWeave consumer state (expected format {_shown(CURSOR_FORMAT)}): {_shown(state)}")
    fields = _CURSOR_FIELDS if state["format"] == CURSOR_FORMAT or "position" not in state else _CURSOR_V1_FIELDS
    missing = [key for key in fields if key not in state]
    if missing:
        raise ConfigError(f"consumer state ({state['format']}) lacks {missing}: {_shown(dict(state))}")
    version, step = state["version"], state["step"]
    if not all(_natural(v) for v in (version, step)):
        raise ConfigError(
            f"consumer state needs non-negative integer version and step, got {_shown(version)}, {_shown(step)}"
        )
    if "position_numerator" in fields:
        position = (state["position_numerator"], state["position_denominator"])
    else:
        position = state["position"]
        if not (isinstance(position, list | tuple) and len(position) == 2):
            raise ConfigError(f"consumer state needs position [numerator, denominator], got {_shown(position)}")
    if not _natural(position[0]):
        raise ConfigError(
            f"consumer state position numerator must be a non-negative integer, got {_shown(position[0])}"
        )
    if not _natural(position[1]) or position[1] == 0:
        raise ConfigError(f"consumer state position denominator must be a positive integer, got {_shown(position[1])}")
    namespace = state.get("namespace", "")  # absent from cursors saved before namespace ids
    if not isinstance(namespace, str) or len(namespace) > 64:
        raise ConfigError(f"consumer state namespace must be the namespace's id string, got {_shown(namespace)}")
    saved_dp = state.get("dp", mesh.dp)
    if not _natural(saved_dp) or saved_dp == 0:
        raise ConfigError(f"consumer state dp must be a positive integer, got {_shown(saved_dp)}")
    # A TGB spans layout_dp / dp steps of a mesh, so the same position is step * saved_dp / dp
    # here. Rounded down: a position inside a step of this mesh is refused at the first next().
    step = step * saved_dp // mesh.dp
    return _Cursor(version, Fraction(position[0], position[1]), step, namespace)


def _newest_state(journal: Journal[Any]) -> LogState | None:
    """The namespace's newest state (proven), or None when a damaged version lies ahead:
    reading then delivers every step before it and raises CorruptDataError naming it in order."""
    try:
        return journal.load_state()
    except CorruptDataError:
        return None


def _checked_cursor(cursor: _Cursor, journal: Journal[LogVersion], url: str) -> _Cursor:
    """``cursor`` checked against the namespace's newest state (I9 and exact replay): same
    namespace, a version the log has, and that version holding the cursor's last TGB.

    The cursor's version is read *before* the state is loaded, so the proven state also
    proves that read (I10: a version GC had freed would show as reclaimed). Returns the
    cursor with the namespace id and that version's digest, which a reader anchors on."""
    read = journal.read_version_data(cursor.version) if cursor.version else None
    state = _newest_state(journal)
    if state is None:
        return cursor
    if cursor.namespace and state.namespace and cursor.namespace != state.namespace:
        raise ConfigError(
            f"{url}: the consumer state was saved from namespace {cursor.namespace}, this is namespace "
            f"{state.namespace}; load a checkpoint of a run that read this namespace"
        )
    if cursor.version > state.version:
        raise ConfigError(
            f"{url}: the consumer state is at log version {cursor.version}, but the log ends at version "
            f"{state.version}: the state is from another namespace or was edited"
        )
    reclaimed = state.reclaimed
    if cursor.position < reclaimed.steps or (cursor.version and cursor.version < reclaimed.versions):
        raise DataReclaimedError(url, math.floor(cursor.position), reclaimed.steps)
    last_tgb = math.ceil(cursor.position) - 1  # the newest TGB the delivered steps touched
    if cursor.version == 0:
        if last_tgb >= 0:
            raise ConfigError(f"{url}: the consumer state has consumed {cursor.position} TGBs at log version 0")
        return _Cursor(0, cursor.position, cursor.step, state.namespace)
    if read is None:
        raise DataReclaimedError(url, math.floor(cursor.position), reclaimed.steps)
    if last_tgb not in read.delta.steps():
        raise ConfigError(
            f"{url}: the consumer state says log version {cursor.version} holds TGB {last_tgb}, but it holds "
            f"steps {read.delta.first_step}..{read.delta.first_step + len(read.delta.tgbs) - 1}: the state was "
            "edited or is from another namespace"
        )
    return _Cursor(cursor.version, cursor.position, cursor.step, state.namespace, log.digest(read.data))


def _state_dict(cursor: _Cursor, mesh: Mesh) -> dict[str, Any]:
    return {
        "format": CURSOR_FORMAT,
        "version": cursor.version,
        "position_numerator": cursor.position.numerator,
        "position_denominator": cursor.position.denominator,
        "step": cursor.step,
        "dp": mesh.dp,
        "cp": mesh.cp,
        "namespace": cursor.namespace,
    }


def _shown(value: Any) -> str:
    """A short repr, bounded in depth and length: cursors come from files users edit."""
    return reprlib.repr(value)


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Pipeline:
    """Follows the log from a cursor and prefetches this rank's reads in step order.

    ``_follow_log`` is a generator that reads the log, queues the steps it finds and
    yields how long to pause before probing again (0 after progress). On an object store
    a background thread drives it and a thread pool fetches ahead; on a local directory
    or memory, ``next()`` drives it only when no step is queued and reads each step
    itself: no thread at all, since a local read costs less than any hand-off.
    """

    def __init__(self, consumer: Consumer, cursor: _Cursor) -> None:
        self._store: Store = consumer._store
        self._journal = Journal(self._store, read_only=True)
        if cursor.digest:
            self._journal.anchor_on(cursor.version, cursor.digest)
        self._url = self._store.url
        self._mesh = consumer.mesh
        self._rank = consumer.rank
        self._slice = consumer.slice_index
        self._fetches = consumer._fetches
        self.tgbs_seen = 0  # TGBs the log has shown (the newest version read ends there)
        self._axis = consumer.sequence_axis
        plan = consumer.node
        followers = plan.nodes if plan is not None else consumer.mesh.world_size
        self._polling = HeadPolling(followers, max_poll_s=consumer.max_poll_interval_s)
        self._cursor = cursor  # where this pipeline started
        self._next_delivered = cursor.step  # for messages
        self._start = cursor.position
        self._reshard: Reshard | None = None  # known once the first TGB shows the layout
        self._next_step = cursor.step
        self._known: dict[int, tuple[TGBDescriptor, int]] = {}  # TGB index -> (descriptor, version)
        self._forgotten = math.floor(cursor.position)  # indices below this were dropped from _known
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()  # C-implemented: no lock hand-offs
        self.depth = consumer.prefetch  # None: chosen from the first step's bytes
        self._inline = consumer.prefetch is None and not self._store.remote
        self._slots: threading.Semaphore | None = None  # background mode: one per step fetched ahead
        self._stop = threading.Event()
        self.head_version = cursor.version  # the newest log version read
        self._expected_step: int | None = None  # the first step of the next version
        self._offsets: dict[str, tuple[int, int]] = {}  # producer -> (epoch, next offset), as read
        self.namespace = cursor.namespace
        self._broken: BaseException | None = None  # what the log reader or a fetch raised: final
        self._steps = self._follow_log()
        self._node: NodeClient | InlineNode | None = consumer._node_override
        # A slice no other rank of the node reads gains nothing from the hub: read directly.
        self._shares_reads = consumer.node is None or consumer.node.sharers > 1
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        if self._inline:
            self.depth = 1
            return
        self._pool = ThreadPoolExecutor(
            max_workers=consumer.prefetch or MAX_AUTO_PREFETCH,
            thread_name_prefix="batchweave-fetch",
            initializer=retry.stop_retrying_when,  # close() during a storm does not wait it out
            initargs=(self._stop,),
        )
        if plan is not None:
            self._node = NodeClient(plan.address, self._store, self._polling, plan.sharers)
        self._thread = threading.Thread(target=self._follow, name="batchweave-follow", daemon=True)
        self._thread.start()

    def next(self, timeout_s: float | None) -> tuple[Batch, Fraction | int]:
        if self._broken is not None:
            raise self._broken  # never skip past a step that failed
        try:
            item = self._pull(timeout_s) if self._inline else self._ready.get(timeout=timeout_s)
        except queue.Empty:
            raise StepTimeoutError(
                f"{self._url}: no step {self._next_delivered} within {timeout_s}s "
                f"(log seen up to version {self.head_version}); {self._likely_cause()}"
            ) from None
        if item is _END:
            self._ready.put(_END)  # stay exhausted on later calls
            raise StopIteration
        if isinstance(item, BaseException):
            self._broken = item
            raise item
        if self._slots is not None:
            self._slots.release()
        try:
            batch, position = item.result()
        except Exception as exc:  # a failed fetch is final: never skip past a step
            self._broken = exc
            raise
        self._next_delivered = batch.step + 1
        return batch, position

    def _likely_cause(self) -> str:
        stalled_s = self._store.stalled_now_s
        if stalled_s > 0:
            return (
                f"the store has been throttled or unavailable for {stalled_s:.0f} s and is being retried "
                "(WARNING lines of logger batchweave.store)"
            )
        return "are producers running?"

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._steps.close()  # the log reader's threads, if it has any
        if self._node is not None:
            self._node.close()

    def _pull(self, timeout_s: float | None) -> Any:
        """Inline mode: advance the log until a step is queued (or the deadline passes)."""
        try:
            return self._ready.get_nowait()  # usually a version holds several steps
        except queue.Empty:
            pass
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
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

    def _open(self) -> None:
        """Check the cursor against the namespace before reading from it (one load).

        A cursor checked already (by ``load_state_dict``) carries its version's digest and
        needs no second load; a cursor from the start has nothing to check, and the first
        proof of what the reader reads (I10) finds a reclaimed start.
        """
        if self._cursor.digest or (self._cursor.version == 0 and self._cursor.position == 0):
            return
        self._cursor = _checked_cursor(self._cursor, self._journal, self._url)
        self.namespace = self._cursor.namespace or self.namespace
        if self._cursor.digest:
            self._journal.anchor_on(self._cursor.version, self._cursor.digest)

    def _follow_log(self) -> Generator[float, None, None]:
        """Queue every step as the log shows it; yield the pause before the next probe."""
        self._open()
        source = self._own_log(max(self._cursor.version, 1)) if self._node is None else self._shared_log()
        try:
            for item in source:
                if isinstance(item, list):
                    if not self._take_all(item):
                        return
                    continue
                if item == 0.0:  # reading on (a proof is in flight): no pause, nothing to schedule
                    yield 0.0
                    continue
                waiting = self._next_step
                if not self._schedule_ready(block_until=0):  # steps read ahead of the fetches go first
                    return
                # Progress took a while: look at the log again before pausing.
                yield 0.0 if self._next_step != waiting else item
        finally:
            source.close()

    def _shared_log(self) -> Generator[FollowItem, None, None]:
        """The node's follower (``batchweave.reading.node``), or this rank's own from where it
        stood if no hub can be reached or it fell far behind the node's other ranks."""
        assert self._node is not None
        anchor = (self._cursor.version, self._cursor.digest) if self._cursor.digest else None
        last: ReadVersion | None = None  # the newest version the hub proved for this rank
        try:
            for item in self._node.log(
                max(self._cursor.version, 1), anchor, self._cursor.version, self._reclaimed_from, self._url, self._stop
            ):
                if isinstance(item, list):
                    last = item[-1]
                yield item
        except (NodeUnavailableError, NodeBehind) as exc:  # an unreachable hub is logged by the client
            if isinstance(exc, NodeBehind):
                _logger.info("%s rank %d: %s; following the log on its own", self._url, self._rank, exc)
            if last is not None:  # proven by the hub: this rank's own proofs go on from there (I10)
                self._journal.anchor_on(last.delta.version, log.digest(last.data))
            yield from self._own_log(exc.next_version)

    def _own_log(self, first: int) -> Generator[FollowItem, None, None]:
        """This rank's own follower: reads ahead, proves every batch (I10), paces probes."""
        depth = DEFAULT_LOG_READ_AHEAD if self._store.remote else 1  # local reads are too quick to overlap
        reader = LogReadAhead(self._journal, first, depth, stop=self._stop)
        if first == 1 and depth > 1:
            reader.beside(self._journal.learn_namespace)  # for the first proof, while reading
        try:
            yield from ProvenLog(
                self._journal, reader, self._polling, self._reclaimed_from, self._url, self._cursor.version
            )
        finally:
            reader.close()

    def _reclaimed_from(self) -> int:
        """The first step this reader still needs (for DataReclaimedError's message)."""
        next_tgb = self._expected_step if self._expected_step is not None else math.floor(self._start)
        return max(next_tgb, math.floor(self._start))

    def _take_all(self, batch: list[ReadVersion]) -> bool:
        """``_take`` each proven version in order; False as soon as the reader stops."""
        for taken in batch:
            if not self._take(taken.delta):
                return False
        return True

    def _take(self, delta: LogVersion) -> bool:
        """Use one proven version: check it continues the log, queue its steps. False when
        the reader stops (the stream ended, or the consumer is closing)."""
        version = delta.version
        self.head_version = version
        if delta.namespace:  # version 1: a cursor from the start learns its namespace here
            self.namespace = delta.namespace
        if self._expected_step is not None and delta.first_step != self._expected_step:
            raise CorruptDataError(
                log.version_key(version), f"first step {delta.first_step}, expected {self._expected_step}"
            )
        self._expected_step = self.tgbs_seen = delta.first_step + len(delta.tgbs)
        log.check_continuity(self._offsets, delta, log.version_key(version))
        self._remember(delta)
        if not self._schedule_ready(block_until=LOG_LOOKAHEAD_TGBS):
            return False
        if delta.end_of_stream:
            if self._schedule_ready(block_until=0):
                # A last logical step whose TGBs never all arrived (DP grown) is not a step.
                self._ready.put(_END)
            return False
        return True

    def _remember(self, delta: LogVersion) -> None:
        first_needed = math.floor(self._start)
        for index, tgb in zip(delta.steps(), delta.tgbs, strict=True):
            if index >= first_needed:
                self._check_layout(tgb, delta.version, index)
                self._known[index] = (tgb, delta.version)

    def _check_layout(self, tgb: TGBDescriptor, version: int, index: int) -> None:
        if self._reshard is None:
            self._reshard = Reshard(tgb.dp, tgb.cp, self._mesh, tgb.kind)
            self._next_step = self._reshard.step_at(self._start)
        elif (tgb.dp, tgb.cp, tgb.kind) != (self._reshard.layout_dp, self._reshard.layout_cp, self._reshard.kind):
            raise LayoutError(
                f"{self._url}: step {index} (log version {version}) has dp={tgb.dp} cp={tgb.cp} {tgb.kind} slices, "
                f"earlier steps have dp={self._reshard.layout_dp} cp={self._reshard.layout_cp} {self._reshard.kind}"
            )

    def _schedule_ready(self, block_until: int) -> bool:
        """Schedule the logical steps whose TGBs are all committed, as far as fetch slots
        allow; wait for slots only while more than ``block_until`` TGBs read from the log
        are not scheduled yet (so the log is read ahead of the fetches, boundedly). False
        when stopping."""
        if self._reshard is not None and self._reshard.identity:
            return self._schedule_as_written(block_until)
        while self._reshard is not None:
            needed = self._reshard.tgbs(self._next_step)
            if needed[-1] not in self._known:
                return True  # wait for more commits
            read = self._reshard.read(self._rank, self._next_step)
            tgb = self._known[read.tgb][0]
            version = self._known[needed[-1]][1]
            position = self._reshard.position(self._next_step + 1)
            fetch = functools.partial(self._fetch, tgb, read, self._next_step, version, position)
            if not self._enqueue(fetch, tgb, read, block=len(self._known) > block_until):
                return not self._stop.is_set()  # no slot free now: the log is read on meanwhile
            self._next_step += 1
            self._forget_before(self._reshard.tgbs(self._next_step)[0])
        return True

    def _schedule_as_written(self, block_until: int) -> bool:
        """``_schedule_ready`` for a mesh that reads the TGBs as written (the usual case):
        step ``t`` is TGB ``t``, one slice, position ``t + 1``; none of the reshard
        arithmetic, which would cost more per step than a local read."""
        while (known := self._known.get(self._next_step)) is not None:
            tgb, version = known
            fetch = functools.partial(self._fetch_as_written, tgb, self._next_step, version)
            read = SliceRead(self._next_step, self._slice, 1)
            if not self._enqueue(fetch, tgb, read, block=len(self._known) > block_until):
                return not self._stop.is_set()  # no slot free now: the log is read on meanwhile
            del self._known[self._next_step]
            self._next_step += 1
        self._forgotten = self._next_step
        return True

    def _enqueue(
        self, fetch: Callable[[], tuple[Batch, Fraction | int]], tgb: TGBDescriptor, read: SliceRead, block: bool
    ) -> bool:
        """Queue one step's fetch in step order: for ``next()`` to run itself (inline), or
        on the pool once a fetch slot is free. False when no slot was taken."""
        if self._inline:  # next() reads it; the log is advanced only when nothing is queued
            self._ready.put(_Deferred(fetch))
            return True
        if not self._take_slot(tgb, read, block):
            return False
        assert self._pool is not None
        self._ready.put(self._pool.submit(fetch))
        return True

    def _forget_before(self, first_needed: int) -> None:
        """Drop descriptors of TGBs no later step touches (steps only move forward, so
        each index is dropped once: O(1) per step, not a scan of everything known)."""
        for index in range(self._forgotten, first_needed):
            self._known.pop(index, None)
        self._forgotten = max(self._forgotten, first_needed)

    def _take_slot(self, tgb: TGBDescriptor, read: SliceRead, block: bool) -> bool:
        """One of the ``depth`` fetch slots: waiting for it (False only when stopping), or
        not (False when none is free)."""
        if self._slots is None:
            self.depth = self.depth or _auto_depth(_read_bytes(tgb, read))
            self._slots = threading.Semaphore(self.depth)
        if not block:
            return self._slots.acquire(blocking=False)
        while not self._slots.acquire(timeout=0.1):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    # -- fetching ----------------------------------------------------------------------

    def _fetch(
        self, tgb: TGBDescriptor, read: SliceRead, step: int, version: int, position: Fraction
    ) -> tuple[Batch, Fraction]:
        indices = range(read.first_slice, read.first_slice + read.count)
        started = time.perf_counter()
        parts = [self._read_slice_run(tgb, run) for run in _runs_by_object(tgb, indices)]
        self._fetches.record(time.perf_counter() - started)
        decoded = [item for run in parts for item in run]
        if any(isinstance(item, bytes) != (tgb.kind == "bytes") for item in decoded):
            raise CorruptDataError(tgb.objects[0], f"a slice's payload kind is not the log's {tgb.kind!r}")
        data = decoded[0] if len(decoded) == 1 else _concat(decoded, self._axis, tgb.objects[0])
        if read.pieces > 1:
            data = _piece(data, read.piece, read.pieces, self._axis, tgb.objects[tgb.slices[read.first_slice][0]])
        return Batch(step=step, data=data, version=version), position

    def _fetch_as_written(self, tgb: TGBDescriptor, step: int, version: int) -> tuple[Batch, int]:
        """``_fetch`` of this rank's one slice of TGB ``step``."""
        obj, offset, length, crc = tgb.slices[self._slice]
        key = tgb.objects[obj]
        started = time.perf_counter()
        data = decode_slice(self._range(key, offset, length), key, crc)
        self._fetches.record(time.perf_counter() - started)
        if isinstance(data, bytes) != (tgb.kind == "bytes"):
            raise CorruptDataError(key, f"a slice's payload kind is not the log's {tgb.kind!r}")
        return Batch(step=step, data=data, version=version), step + 1

    def _read_slice_run(self, tgb: TGBDescriptor, indices: list[int]) -> list[Any]:
        """Decode slices that sit back to back in one object, with one range read."""
        obj = tgb.slices[indices[0]][0]
        key = tgb.objects[obj]
        start = tgb.slices[indices[0]][1]
        end = max(tgb.slices[i][1] + tgb.slices[i][2] for i in indices)
        buf = self._range(key, start, end - start)
        out = []
        for i in indices:
            _, offset, length, crc = tgb.slices[i]
            out.append(decode_slice(buf[offset - start : offset - start + length], key, crc))
        return out

    def _read(self, key: str, start: int, length: int) -> memoryview:
        """Through the node's hub (one read per slice per node) when another rank of the
        node reads the same slice, else from the store."""
        if self._node is not None and self._shares_reads:
            try:
                return self._node.read(key, start, length)
            except NodeUnavailableError:
                pass  # read on our own
        return self._store.get_range(key, start, length)

    def _range(self, key: str, start: int, length: int) -> memoryview:
        try:
            data = self._read(key, start, length)
        except ObjectNotFoundError:
            reclaimed = self._journal.load_state().reclaimed
            if math.floor(self._start) < reclaimed.steps:
                raise DataReclaimedError(self._url, math.floor(self._start), reclaimed.steps) from None
            raise
        except TransientStoreError:
            raise  # retried until the deadline already: asking for its size would wait as long again
        except StoreError:
            size = self._store.size(key)
            if size is not None and size < start + length:
                raise CorruptDataError(key, f"truncated to {size} bytes; the slice ends at {start + length}") from None
            raise
        if len(data) != length:
            raise CorruptDataError(key, f"truncated: wanted {length} bytes at {start}, got {len(data)}")
        return data


class _Deferred:
    """A fetch the iterating thread performs itself when it reaches the step (``result``
    as for the Future of a background fetch)."""

    __slots__ = ("_fetch",)

    def __init__(self, fetch: Callable[[], tuple[Batch, Fraction | int]]) -> None:
        self._fetch = fetch

    def result(self) -> tuple[Batch, Fraction | int]:
        return self._fetch()


def _nbytes(data: dict[str, np.ndarray] | bytes) -> int:
    return len(data) if isinstance(data, bytes) else sum(array.nbytes for array in data.values())


def _auto_depth(step_bytes: int) -> int:
    """Steps to fetch ahead when ``prefetch`` is None: a 64 MiB budget, 4 to 64 steps."""
    return max(MIN_AUTO_PREFETCH, min(MAX_AUTO_PREFETCH, AUTO_PREFETCH_BYTES // max(step_bytes, 1)))


def _read_bytes(tgb: TGBDescriptor, read: SliceRead) -> int:
    """Bytes of the slices one step's read covers on this rank."""
    return sum(tgb.slices[i][2] for i in range(read.first_slice, read.first_slice + read.count))


def _runs_by_object(tgb: TGBDescriptor, indices: range) -> list[list[int]]:
    """Split consecutive slice indices where they cross into the next object."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and tgb.slices[runs[-1][-1]][0] == tgb.slices[i][0]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _concat(parts: list[Any], axis: int, key: str) -> Any:
    """CP shrank: join adjacent slices along the sequence axis (bytes end to end)."""
    if isinstance(parts[0], bytes):
        return b"".join(parts)
    try:
        return {name: np.concatenate([p[name] for p in parts], axis=axis) for name in parts[0]}
    except (ValueError, np.exceptions.AxisError) as exc:
        raise LayoutError(f"{key}: cannot join CP slices along axis {axis}: {exc}") from exc


def _piece(data: Any, piece: int, pieces: int, axis: int, key: str) -> Any:
    """CP grew: this rank's equal piece of every array along the sequence axis (a view)."""
    out = {}
    for name, array in data.items():
        if array.ndim == 0 or array.shape[axis] % pieces:
            raise LayoutError(
                f"{key}: array {name!r} of shape {array.shape} cannot be split into {pieces} equal pieces "
                f"along axis {axis} for cp growth"
            )
        out[name] = np.split(array, pieces, axis=axis)[piece]
    return out
