"""The producer: write TGB objects now, make them visible at a later commit.

``append`` encodes and uploads a TGB's objects in the caller's thread (so a slow store
pushes back on preprocessing), or holds a small TGB back to write it with the next ones
as one pack (``batchweave.packing``), and queues the descriptors of what it wrote; a
background thread commits the queue as the next log version whenever the commit policy
says so. Exactly-once (invariant I3) rests on three things: the log records each
producer's next offset in the same version as its TGBs, a new incarnation claims a higher
epoch through the log (fencing any zombie at its next commit), and a rebase drops whatever
the log already holds, so an ambiguous commit outcome neither duplicates nor drops a TGB.

``Producer`` is a thin class over its parts, each given what it needs rather than the
producer: the epoch claim (``batchweave.commit.claiming``), the schema checks
(``batchweave.writing.schemas``), the pack writer (``batchweave.writing.packs``),
``max_lag`` backpressure (``batchweave.lifecycle.maxlag``), the count of contending
producers (``batchweave.commit.contention``) and the committer of its commit mode
(``batchweave.commit.committer``); they share ``batchweave.commit.shared.SharedState``
with it. Its options are one value, ``batchweave.writing.options.ProducerOptions``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Unpack

from batchweave import log, logrules
from batchweave.commit.backlog import CommitBacklog
from batchweave.commit.claiming import EpochClaim
from batchweave.commit.committer import CommitContext, Committer, check_mode, committer_for
from batchweave.commit.contention import Contention
from batchweave.commit.loop import without_stall
from batchweave.commit.policies import RecentCommitters, resolve_policy
from batchweave.commit.shared import SharedState
from batchweave.errors import FlushTimeoutError, LayoutError, SourceOffsetError
from batchweave.journal import Journal
from batchweave.keys import check_producer_id
from batchweave.layout import FramedTGB, frame_tgb
from batchweave.lifecycle.maxlag import MaxLag
from batchweave.log import LogState
from batchweave.mesh import Mesh
from batchweave.schema import Schema
from batchweave.store import Store, open_store
from batchweave.writing.options import ProducerKeywords, ProducerOptions
from batchweave.writing.packs import PackWriter
from batchweave.writing.schemas import check_declared, schema_for

__all__ = ["Producer", "ProducerOptions", "end_stream"]

_logger = logging.getLogger(__name__)


class Producer:
    """Publishes TGBs for one ``producer_id`` to the namespace at ``url``.

    Args:
        url: namespace URL (directory, ``file://``, ``s3://``, ``az://``, ``gs://``, ``memory://``).
        producer_id: stable name that survives restarts; its offsets are exactly-once.
        dp, cp: data- and context-parallel sizes; every TGB has ``dp * cp`` slices.
        options: every option below as one ``ProducerOptions`` value, instead of keywords
            (giving both is a ``ConfigError``); the producer keeps them as ``.options``.
            A misspelt keyword is a ``TypeError`` that lists the options.

    Keyword Args:
        commit_policy: a policy object or its name. The default is group commit
            (``"group"``, ``batchweave.commit.group.GroupCommit``): producers take turns to
            commit everybody's TGBs, so visibility does not grow with the pool; with
            ``background_commit=False`` it is ``DAC()``, each producer committing its own
            (``batchweave.commit.policies.resolve_policy`` says why).
        max_object_bytes: size cap of one TGB object; larger TGBs are split.
        background_commit: commit on a background thread (default), so commit I/O never
            delays ``append``; False commits inside ``append`` when the policy says so,
            the paper's single-loop producer (used by the policy benchmarks).
        publish_metrics: record this producer's counters in the log with every commit,
            so ``batchweave inspect`` shows them (about 200 bytes per commit).
        max_lag: backpressure: ``append`` blocks while the TGBs above ``W_global`` (the
            oldest live checkpoint), committed, only uploaded or held for a pack, would pass this many, so
            storage stays bounded even when checkpoints stall; a pool of producers splits
            the room (``batchweave.lifecycle.backpressure``): each active producer takes an
            equal share, at least one TGB (below one per producer, the bound becomes one per
            producer, with a WARNING), and a closed producer gives its share back at once.
            Set it above the steps between two checkpoints plus the producers, or training
            waits for data a checkpoint would release. Held longer than a minute, ``append``
            logs a WARNING naming what holds it. None: never block.
        storage_options: obstore options for the store (see ``batchweave.store.check_storage_options``):
            config keys such as ``region`` or ``endpoint``, ``client_options``, ``retry_config``;
            for a local directory only ``{"fsync": False}``, which skips the flushes that make
            each put durable (throwaway namespaces).
        pack_steps: how many consecutive TGBs are written together as one pack, so that a
            rank reads its slices of all of them with one request (``batchweave.packing``).
            None (default): by size, up to 16 while a rank's run stays under 1 MiB (TGBs
            with slices of 1 MiB or more are never held back); 1: every TGB written at once,
            on its own. A held TGB becomes visible with its pack.
        pack_delay_s: the longest a TGB is held back for its pack while appends keep coming
            (default 1 s); a producer appending slower than this packs nothing.
        schema: the arrays every slice holds, as a ``Schema`` or ``{name: (dtype, shape)}``,
            with ``None`` as a shape's first size where it varies from slice to slice (packed
            sequences, variable-length audio): ``{"tokens": ("int32", (None, 2048))}``. A
            namespace's first TGB of arrays fixes its schema: without a declaration, that
            TGB's exact shapes. Refused with ``SchemaError`` here if the namespace already has
            another schema (or holds bytes); ``append`` refuses slices that do not fit.
    """

    def __init__(
        self,
        url: str | Store,
        producer_id: str,
        dp: int,
        cp: int = 1,
        *,
        options: ProducerOptions | None = None,
        **keywords: Unpack[ProducerKeywords],
    ) -> None:
        self.producer_id = check_producer_id(producer_id)
        self.options = options = ProducerOptions.build(options, **keywords)
        self._declared = options.declared_schema
        self.mesh = Mesh(dp=dp, cp=cp)
        self.policy = resolve_policy(options.commit_policy, background_commit=options.background_commit)
        check_mode(self.policy, producer_id, options.background_commit)
        self._store = open_store(url, storage_options=_plain(options.storage_options))
        self._journal = Journal(self._store, options.snapshot_every, heads_only=True)
        stalled_before_s = self._store.stalled_s
        layout = log.Layout(self.mesh.dp, self.mesh.cp)
        claimed = EpochClaim(self._store, self._journal, self.producer_id, layout, self._check_declared).claim(
            uuid.uuid4().hex
        )
        claim_window_s = without_stall(self._store, claimed.window_s, stalled_before_s)
        # What this producer and its parts share, under shared.cond.
        shared = SharedState(self.producer_id, threading.Condition(), threading.Event(), claimed.state, claimed.me)
        self._shared = shared
        shared.schema = self._declared or claimed.state.schema
        self._packs = packs = PackWriter(self._store, shared, self.mesh, options, self.policy)
        self._max_lag = None
        if options.max_lag is not None:  # it counts the TGBs held for a pack: they are uploaded soon
            self._max_lag = MaxLag(options.max_lag, self._store, shared, lambda: packs.held)
        # The claim was a commit through the log: it primes the policy with a first
        # fragile-window sample and the producer count, so a pool that starts together
        # spreads its first commits instead of colliding on them.
        self._contention = Contention(shared, self.policy, RecentCommitters())
        self.policy.observe(claim_window_s, self._contention.active(), True)
        # The commit mode (direct, or group commit's turns: ``batchweave.commit.committer``).
        self._committer = committer_for(
            self.policy,
            CommitContext(
                shared, self._journal, self._store, self._contention.active, self._published_metrics, claim_window_s
            ),
        )
        self._next_offset = claimed.me.offset
        self._thread: threading.Thread | None = None
        self._backlog = CommitBacklog(shared, self._store.url, self.policy)
        if options.background_commit:
            run = self._committer.run
            self._thread = threading.Thread(target=run, name=f"batchweave-commit-{producer_id}", daemon=True)
            self._thread.start()

    # -- public API ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """This incarnation's epoch; a newer incarnation of the same id fences it."""
        return self._shared.me.epoch

    @property
    def schema(self) -> Schema | None:
        """The schema this producer's TGBs of arrays fit: declared, the namespace's, or fixed
        by its first TGB; None before that (and for bytes)."""
        with self._shared.cond:
            return self._shared.state.schema or self._shared.schema

    @property
    def resume_offset(self) -> int:
        """The next source offset this producer_id must produce: everything before it is committed."""
        with self._shared.cond:
            return self._shared.committed_offset()

    @property
    def next_offset(self) -> int:
        """The source offset the next ``append`` takes (``resume_offset`` plus the TGBs
        appended since, committed or not)."""
        with self._shared.cond:
            return self._next_offset

    @property
    def committer(self) -> Committer:
        """This producer's commit mode (``batchweave.commit.committer.Committer``), which its
        commit thread runs. Public for drivers that run the commit thread's passes
        themselves (the deterministic simulation, whose threads never start, calls group
        commit's ``step``), not for applications."""
        return self._committer

    @property
    def log_version(self) -> int:
        """The newest log version this producer has read (its view of the log)."""
        with self._shared.cond:
            return self._shared.state.version

    @property
    def log_requests(self) -> int:
        """Store requests this producer's log has made so far (its claim, catch-ups and
        commits; ``Journal.requests``): what tests count a commit's cost by."""
        return self._journal.requests

    @property
    def log_bytes_read(self) -> int:
        """Bytes of log objects this producer has read so far (``Journal.bytes_read``)."""
        return self._journal.bytes_read

    def append(self, slices: Sequence[Any], source_offset: int | None = None) -> int:
        """Write one TGB's objects now, or hold it for its pack; it becomes visible at a
        later commit.

        ``slices`` has ``dp * cp`` payloads (dicts of arrays, or bytes), slice ``(d, c)``
        at index ``d * cp + c``. ``source_offset``, when given, must be the next offset
        (``resume_offset`` after a restart, then +1 per append): offsets are dense, so a
        skipped or repeated offset is refused rather than silently lost or duplicated.
        Returns the TGB's source offset. A held TGB is a copy: the caller may reuse its
        arrays once this returns.

        With a commit thread, ``append`` waits while commits are behind what this producer
        appends: while the oldest TGB it queued has waited for a commit longer than four of
        its policy's gaps (at least 2 s; ``batchweave.commit.backlog``), so a pool whose
        commits fall behind spends its cores on committing, not on growing the queue. A
        policy that commits only when flushed or given more TGBs (``Manual``, ``Fixed``)
        never holds it.
        """
        if self._max_lag is not None:
            self._max_lag.wait()
        if self._thread is not None:
            self._backlog.wait()
        with self._packs.lock:
            offset = self._next_offset_or_raise(source_offset)
            framed = frame_tgb(slices, self.mesh.dp, self.mesh.cp)
            head = log.TGBHead(
                self.producer_id, self._shared.me.epoch, offset, self.mesh.dp, self.mesh.cp, framed.kind, framed.nbytes
            )
            mismatch = logrules.layout_mismatch(self._shared.state.layout, head)
            if mismatch:  # before uploading anything: every consumer would fail at this step
                raise LayoutError(f"producer {self.producer_id!r}: {mismatch}; nothing was written")
            schema = self._schema_for(framed, offset)
            self._packs.add(offset, framed, "" if schema is None else schema.digest)
            with self._shared.cond:  # appended: written, or held for its pack
                self._shared.schema = self._shared.schema or schema
                self._next_offset = offset + 1
        if self._thread is None:
            self._committer.commit_inline(self._next_offset, forced=False)
        return offset

    def write_held(self) -> None:
        """Write the TGBs held back for a pack now, without waiting for their commit
        (``flush`` does this first)."""
        self._packs.write_held()

    def _next_offset_or_raise(self, source_offset: int | None) -> int:
        with self._shared.cond:
            self._shared.raise_if_unusable(self._store.url)
            offset = self._next_offset if source_offset is None else source_offset
            if not isinstance(offset, int) or isinstance(offset, bool) or offset != self._next_offset:
                raise SourceOffsetError(
                    f"producer {self.producer_id!r}: source_offset {offset!r} is not the next offset "
                    f"{self._next_offset} (offsets are dense: below it is appended or committed already, "
                    "above it would leave a gap)"
                )
            return offset

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until everything appended so far is committed (ignores the policy's gap),
        the TGBs held for a pack included. Past ``timeout_s`` it raises ``FlushTimeoutError``
        (a ``TimeoutError``); the TGBs stay pending for the next flush or ``close()``."""
        self._packs.write_held()
        if self._thread is None:
            self._committer.commit_inline(self._next_offset, forced=True)
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._shared.cond:
            target = self._next_offset
            self._shared.flush_waiters += 1
            self._shared.cond.notify_all()
            try:
                while self._shared.committed_offset() < target and self._shared.error is None:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if timeout_s is not None and remaining is not None and remaining <= 0:
                        raise FlushTimeoutError(self.producer_id, timeout_s, len(self._shared.pending))
                    self._shared.cond.wait(remaining)
            finally:
                self._shared.flush_waiters -= 1
            if self._shared.error is not None:
                self._shared.told = self._shared.error
                raise self._shared.error

    def close(self, flush: bool = True) -> None:
        """Flush (unless ``flush=False``) and stop the commit thread. Idempotent.

        If the commit thread stopped with an error that no ``append`` or ``flush`` has raised
        yet while TGBs were still uncommitted (a ``SchemaError`` found at commit, a
        ``ProducerFencedError``), ``close()`` raises it after stopping: those TGBs were not
        committed, and a close that returned would say they were.

        Appended TGBs left uncommitted (``flush=False``, an exception in the ``with`` block,
        Ctrl-C, a failed commit) are logged at WARNING with their offsets: a restart redoes
        them from ``resume_offset``. With ``max_lag``, the close's last log version records
        that this producer left, so the others' shares of ``max_lag`` stop counting it at once."""
        lost: Exception | None = None
        first, clean = not self._shared.closed, False
        try:
            if flush and first:
                with self._shared.cond:
                    error = self._shared.error
                    # (an inline commit raises its errors in append and flush themselves)
                    untold = error is not None and error is not self._shared.told and self._thread is not None
                    lost = error if untold and (self._shared.pending or self._packs.held) else None
                if error is None:
                    self.flush()
                    clean = True
        finally:
            self._packs.drop_held()  # held TGBs not written by a flush are dropped, as pending ones are
            with self._shared.cond:
                self._shared.closed = True
                self._shared.abandon = self._shared.abandon or not flush
                if self._shared.abandon:
                    self._shared.abandoned.set()  # what is not committed is dropped: do not wait out a storm for it
                self._shared.cond.notify_all()
            if self._thread is not None:
                self._thread.join()
            self._packs.close()
            self._committer.close()
            if first:
                self._tell_uncommitted()
                if self._max_lag is not None:
                    self._max_lag.leave(self._journal, patient=clean)
            self._store.release()
        if lost is not None:
            raise lost

    def _tell_uncommitted(self) -> None:
        """After the commit thread stopped: the appended TGBs it did not commit, if any."""
        with self._shared.cond:
            message = uncommitted_message(self.producer_id, self._shared.committed_offset(), self._next_offset)
        if message:
            _logger.warning("%s", message)

    def _published_metrics(self, committing: int) -> dict[str, float] | None:
        """The counters as they stand once the version carrying them lands with
        ``committing`` of our TGBs: a published figure is never one commit behind.
        None unless ``publish_metrics``."""
        if not self.options.publish_metrics:
            return None
        keys = ("attempts", "conflicts", "successes", "tgbs_committed", "fragile_window_ema_s", "gap_s")
        current = self.metrics()
        current["successes"] += 1
        current["tgbs_committed"] += committing
        return {k: float(current[k]) for k in keys if not math.isnan(current[k])}

    def metrics(self) -> dict[str, float]:
        """Counters for dashboards and benchmarks; a plain dict, safe to log as JSON.

        ``store_retries`` and ``store_stalled_s`` count the store requests this producer
        retried and the seconds it spent stalled on throttling or an outage (its uploads
        and its commit thread alike; see ``Store.retries``, ``Store.stalled_s``).
        """
        with self._shared.cond:
            out: dict[str, float] = dict(self._shared.metrics)
            out["pending_tgbs"] = len(self._shared.pending)
            out["held_tgbs"] = self._packs.held  # appended, waiting for the rest of their pack
            out["producers_seen"] = len(self._shared.state.producers)
            out["producers_active"] = self._contention.seen()
            out["log_version"] = self._shared.state.version
            now = time.monotonic()
            out["commit_backlog_s"] = self._shared.backlog_s(now)  # the oldest queued TGB's wait
            out["held_by_commits_s"] = self._backlog.held_s(now)  # append's waits for commits to catch up
        out["fragile_window_ema_s"] = getattr(self.policy, "fragile_window_ema_s", math.nan)
        out["gap_s"] = getattr(self.policy, "gap_s", math.nan)
        out["store_retries"] = self._store.retries
        out["store_stalled_s"] = self._store.stalled_s
        out["store_rate_limit_per_s"] = self._store.rate_limit_per_s  # inf unless throttled (Store.rate_limit_per_s)
        out["store_rate_limited_s"] = self._store.rate_limited_s
        return out

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # On an exception, uncommitted TGBs are dropped: a restart resumes at resume_offset.
        self.close(flush=exc_type is None)

    def __repr__(self) -> str:
        return f"Producer({self._store.url!r}, {self.producer_id!r}, epoch={self._shared.me.epoch})"

    # -- internals -------------------------------------------------------------------

    def _schema_for(self, framed: FramedTGB, offset: int) -> Schema | None:
        """The schema a TGB's arrays fit (``writing.schemas.schema_for``), or SchemaError
        before anything is uploaded."""
        with self._shared.cond:
            namespace, own = self._shared.state.schema, self._shared.schema
        where = f"{self._store.url}: TGB {self.producer_id}@{offset}"
        return schema_for(framed, namespace, own, self._declared, where)

    def _check_declared(self, state: LogState) -> None:
        check_declared(self._declared, state, self._store.url, self.producer_id)


def _plain(options: Any) -> dict[str, Any] | None:
    """Storage options as the dict the store takes (``ProducerOptions`` holds any mapping)."""
    return None if options is None else dict(options)


def uncommitted_message(producer_id: str, committed: int, appended: int) -> str:
    """What a producer closed with TGBs appended (offsets below ``appended``) but
    committed only below ``committed`` says; "" when every one was committed."""
    count = appended - committed
    if count <= 0:
        return ""
    if count == 1:
        return (
            f"producer {producer_id!r}: 1 appended TGB (offset {committed}) was not committed; "
            f"a restart redoes it from offset {committed}"
        )
    return (
        f"producer {producer_id!r}: {count} appended TGBs (offsets {committed}-{appended - 1}) were not committed; "
        f"a restart redoes them from offset {committed}"
    )


def end_stream(url: str | Store, *, create: bool = True, storage_options: dict[str, Any] | None = None) -> int:
    """Commit the end-of-stream marker; returns its log version. Idempotent.

    ``create=False`` refuses a local namespace directory that does not exist yet.
    """
    journal = Journal(open_store(url, create=create, storage_options=storage_options), heads_only=True)
    result = journal.commit(
        journal.load_state(),
        lambda state: None if state.end_of_stream else logrules.build_end_of_stream(state, time.time()),
    )
    return result.state.ended_at or result.state.version  # (a log from before ended_at was recorded)
