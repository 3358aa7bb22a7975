"""The consumer: one training rank reading exactly its own slice of every step.

``Consumer`` is the public face of the reading side (``batchweave.reading``): it holds the
rank's mesh, its cursor and its metrics, and hands out steps in order from a pipeline
(``reading.pipeline``) that follows the log (only ever probing the next version, backing
off while idle) and schedules one range read per step, up to ``prefetch`` steps ahead. The
cursor in ``state_dict()`` counts what the caller has received, never what was prefetched.

The cursor counts TGBs consumed, not steps, so a checkpoint taken on one mesh resumes
on another: when the consumer's DP/CP sizes differ from the TGBs' layout, ``reshard``
maps each logical step of this mesh onto the slices it must read (paper 4.1). The
pipeline then logs how it reads, once at INFO, and at the end of the stream a WARNING
for the trailing TGBs that make no whole step of this mesh (they are not delivered).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Unpack

from batchweave.journal import Journal
from batchweave.lifecycle.watermarks import Watermark, check_checkpoint_id, write_watermark
from batchweave.mesh import Mesh, resolve_rank
from batchweave.metrics import ConsumerMetrics, FetchRecorder, PeriodicLog, describe
from batchweave.reading.cursor import CURSOR_FORMAT, Cursor, checked_cursor, cursor_state, parse_cursor
from batchweave.reading.fetch import Batch
from batchweave.reading.node import resolve_plan
from batchweave.reading.options import ReadKeywords, ReadOptions
from batchweave.reading.pipeline import Pipeline
from batchweave.reading.sharedlog import NodeFollower
from batchweave.store import Store, open_store

__all__ = ["CURSOR_FORMAT", "Batch", "Consumer", "RankReading"]

_logger = logging.getLogger(__name__)


class Consumer:
    """Iterates this rank's slice of every committed step, from step 0 or a saved cursor.

    Everything after the URL is a keyword. The reading options (from ``prefetch`` on)
    come as keywords or as one ``options=ReadOptions(...)`` (``batchweave.ReadOptions``);
    the framework readers take the same ones.

    Args:
        url: namespace URL.
        dp, cp, tp, pp: mesh sizes; ``dp*cp*tp*pp`` must equal ``WORLD_SIZE`` when set.
        rank: this rank, default ``RANK`` from the environment (torchrun).
        options: all the reading options below as one ``ReadOptions`` (then give none of
            them as keywords).
        prefetch: reads fetched ahead, each on its own background thread (so also the
            reads in flight at once): a step each, or the steps of a pack read together
            (``batchweave.packing``). None (default) chooses: on an object store, as many
            of this rank's steps as fit in 64 MiB, from 4 to 64 (deep enough to hide 25 ms
            per request behind small slices, bounded for large ones), and never more than
            64 MiB of them (or 4 first steps) in flight when later steps are larger; on a local directory
            or memory, none: the iterating thread reads each step itself, since a local
            read costs less than handing it between threads. Set it for a network file
            system mounted as a directory.
        timeout_s: raise StepTimeoutError when one ``next()`` waits this long for its step,
            whatever it waits for: the log, the step's read or the proof of its log versions
            (None: wait). Not final: the next call waits for the same step again.
        max_poll_interval_s: longest pause between log probes while idle.
        sequence_axis: the axis along which slices are joined when CP shrank and split
            when CP grew relative to the TGBs' layout (default: the last axis).
        storage_options: obstore options for the store, as for ``Producer``: a mapping of
            option names to values, such as ``{"region": "eu-west-1"}``.
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
        *,
        dp: int,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        rank: int | None = None,
        options: ReadOptions | None = None,
        **keywords: Unpack[ReadKeywords],
    ) -> None:
        self.options = ReadOptions.build(options, **keywords)
        self.mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp)
        self.rank = resolve_rank(rank, self.mesh)
        self.slice_index = self.mesh.slice_index(self.rank)
        self.prefetch = self.options.prefetch
        self.timeout_s = self.options.timeout_s
        self.max_poll_interval_s = self.options.max_poll_interval_s
        self.sequence_axis = self.options.sequence_axis
        storage_options = None if self.options.storage_options is None else dict(self.options.storage_options)
        self._store = open_store(url, create=False, storage_options=storage_options)
        node = self.options.node
        self.node = resolve_plan(
            self._store, self.mesh, self.rank, node.local_rank, node.local_world_size, node.enabled
        )
        self._attached_node: NodeFollower | None = None  # ``attach_node``
        self._cursor = Cursor(version=0, position=Fraction(0), step=0)
        self._pipeline: Pipeline | None = None
        # close() from another thread while the first next() builds the pipeline must
        # stop that pipeline, not find none and leave it retrying a stalled store.
        self._pipeline_lock = threading.Lock()
        self._fetches = FetchRecorder()  # recorded by the fetching threads
        self._delivered = (0, 0, 0.0)  # steps, bytes, seconds next() waited
        self._closed_log_requests = 0  # made by the readers closed so far (``metrics``)
        self.log_metrics_s = self.options.log_metrics_s
        self._periodic_log = self._new_periodic_log()

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        with self._pipeline_lock:
            if self._pipeline is None:
                self._pipeline = self._new_pipeline()
            pipeline = self._pipeline
        started = time.perf_counter()
        batch, position = pipeline.next(self.timeout_s)
        steps, nbytes, waited = self._delivered
        self._delivered = (steps + 1, nbytes + batch.nbytes, waited + time.perf_counter() - started)
        self._cursor = Cursor(batch.version, position, batch.step + 1, pipeline.namespace)
        if self._periodic_log is not None:
            self._periodic_log.tick()
        return batch

    def _new_pipeline(self) -> Pipeline:
        return Pipeline(
            self._store,
            self.mesh,
            self.rank,
            self._cursor,
            prefetch=self.prefetch,
            sequence_axis=self.sequence_axis,
            max_poll_interval_s=self.max_poll_interval_s,
            node=self.node,
            node_follower=self._attached_node,
            fetches=self._fetches,
        )

    def attach_node(self, node: NodeFollower) -> None:
        """Read the log, and the slices other ranks of the node read too, through
        ``node`` (a ``reading.sharedlog.NodeFollower`` in this process, such as its
        ``InlineNode``) instead of the node's hub over a local socket. For ranks run in
        one process, as the deterministic simulation runs them; ``node_sharing`` is how
        ranks in processes of their own share. Takes effect when reading (re)starts:
        before the first step, or after ``close()``. Not carried by pickling."""
        self._attached_node = node

    @property
    def reading_version(self) -> int | None:
        """The newest log version the running reader has read and proven; None while
        not reading (before the first step, after ``close()``)."""
        pipeline = self._pipeline
        return None if pipeline is None else pipeline.head_version

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
            log_requests=self._closed_log_requests + (pipeline.log_requests if pipeline else 0),
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
        with self._pipeline_lock:
            pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close()
            self._closed_log_requests += pipeline.log_requests

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Stop only: a garbage collection may run this on any thread, even one of the
        # pipeline's own, so it must not wait; the threads wind down on their own.
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.stop()

    # -- checkpointing (torch.distributed.checkpoint Stateful) -----------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor: resume right after the last step this rank received.

        ``batchweave.cursor/2``: ints and strings under constant keys (``format``,
        ``version``, ``position_numerator``, ``position_denominator``, ``step``, ``dp``,
        ``cp``, ``namespace``), the same as ``TGBDataset.state_dict()``.
        ``position_numerator / position_denominator`` counts the TGBs consumed and is what
        a resume uses; ``step`` is the next step counted on this mesh of ``dp`` x ``cp``.
        """
        return cursor_state(self._cursor, self.mesh)

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
        cursor = checked_cursor(parse_cursor(state, self.mesh), Journal(self._store, read_only=True), self._store.url)
        self.close()
        self._cursor = cursor

    @staticmethod
    def state_on_mesh(state: Any, mesh: Mesh) -> dict[str, Any]:
        """``state`` checked and re-expressed on ``mesh``, as ``load_state_dict`` then
        ``state_dict`` on that mesh would give it; no I/O. Raises ConfigError for anything
        that is not a cursor."""
        return cursor_state(parse_cursor(state, mesh), mesh)

    # -- pickling (handles that cross processes) -------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # Threads and locks stay behind; the copy reads from the cursor with fresh metrics.
        # An attached node follower is this process's: the copy reads through its own node.
        skip = ("_pipeline", "_pipeline_lock", "_fetches", "_delivered", "_periodic_log", "_closed_log_requests")
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        state["_pipeline"] = None
        state["_attached_node"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pipeline_lock = threading.Lock()
        self._fetches = FetchRecorder()
        self._delivered = (0, 0, 0.0)
        self._closed_log_requests = 0
        self._periodic_log = self._new_periodic_log()

    def _new_periodic_log(self) -> PeriodicLog | None:
        if self.log_metrics_s is None:
            return None
        return PeriodicLog(self.log_metrics_s, self._log_metrics, time.monotonic)

    def _log_metrics(self) -> None:
        _logger.info("%s rank %d: %s", self._store.url, self.rank, describe(self.metrics()))

    def __repr__(self) -> str:
        return f"Consumer({self._store.url!r}, rank={self.rank}, mesh={self.mesh}, next_step={self._cursor.step})"


@dataclass(frozen=True)
class RankReading:
    """A ``Consumer``'s arguments for one rank, checked, kept by a framework's reader
    (``batchweave.torch``, ``.grain``, ``.tf``) until it first reads: those readers take
    the consumer's arguments, check them at once, and make no request before."""

    store: Store
    mesh: Mesh
    rank: int
    options: ReadOptions

    @classmethod
    def checked(cls, url: str | Store, mesh: Mesh, rank: int | None, options: ReadOptions) -> RankReading:
        storage_options = None if options.storage_options is None else dict(options.storage_options)
        store = open_store(url, create=False, storage_options=storage_options)  # checked now, no I/O
        return cls(store, mesh, resolve_rank(rank, mesh), replace(options, storage_options=None))

    def consumer(self) -> Consumer:
        """A new ``Consumer`` for this rank, from step 0."""
        mesh = self.mesh
        return Consumer(
            self.store, dp=mesh.dp, cp=mesh.cp, tp=mesh.tp, pp=mesh.pp, rank=self.rank, options=self.options
        )
