"""The producer: write TGB objects now, make them visible at a later commit.

``append`` encodes and uploads a TGB's objects in the caller's thread (so a slow store
pushes back on preprocessing), or holds a small TGB back to write it with the next ones
as one pack (``batchweave.packing``), and queues the descriptors of what it wrote; a background thread commits
the queue as the next log version whenever the commit policy says so. Exactly-once
(invariant I3) rests on three things: the log records each producer's next offset in
the same version as its TGBs, a new incarnation claims a higher epoch through the log
(fencing any zombie at its next commit), and a rebase drops whatever the log already
holds, so an ambiguous commit outcome neither duplicates nor drops a TGB.

The commit thread's loop is ``batchweave.commit.loop`` (one-producer policies) or
``batchweave.commit.turns`` (group commit); it shares ``batchweave.commit.shared.SharedState``
with the producer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import secrets
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from batchweave import log, logrules
from batchweave import schema as schemas
from batchweave.commit.claims import (
    CLAIM_PREFIX,
    CLAIM_TICKET,
    Ticket,
    build_claims,
    foldable,
    next_epoch,
    parse_claim_key,
)
from batchweave.commit.committer import CommitContext, check_mode, committer_for
from batchweave.commit.loop import without_stall
from batchweave.commit.policies import ClaimBackoff, CommitPolicy, RecentCommitters, resolve_policy
from batchweave.commit.shared import SharedState
from batchweave.errors import (
    ConfigError,
    FlushTimeoutError,
    LayoutError,
    ObjectExistsError,
    ProducerClosedError,
    SchemaError,
    SourceOffsetError,
    StoreError,
    StreamEndedError,
)
from batchweave.journal import DEFAULT_SNAPSHOT_EVERY, Journal
from batchweave.keys import check_producer_id, data_key
from batchweave.layout import DEFAULT_MAX_OBJECT_BYTES, FramedTGB, Piece, encode_pack, frame_tgb
from batchweave.lifecycle.backpressure import MAX_BACKOFF_S, may_upload, own_share, poll_pause_s
from batchweave.lifecycle.watermarks import MarkCache, global_watermark, read_watermarks
from batchweave.log import LogState, ProducerState, TGBDescriptor
from batchweave.mesh import Mesh
from batchweave.packing import DEFAULT_PACK_DELAY_S, Held, PackBuffer, check_pack_options, pack_limit
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.schema import Schema
from batchweave.store import Store, open_store

__all__ = ["Producer", "end_stream"]

_logger = logging.getLogger(__name__)
# A producer held by max_lag this long, by a reclaim point that does not move, says that
# collection is what it waits for.
HELD_WARNING_S = 60.0
_UPLOAD_THREADS = 8  # a TGB's objects uploaded at once (a producer appends one TGB at a time)


class Producer:
    """Publishes TGBs for one ``producer_id`` to the namespace at ``url``.

    Args:
        url: namespace URL (directory, ``file://``, ``s3://``, ``az://``, ``gs://``, ``memory://``).
        producer_id: stable name that survives restarts; its offsets are exactly-once.
        dp, cp: data- and context-parallel sizes; every TGB has ``dp * cp`` slices.
        commit_policy: a policy object or its name; default ``DAC()``. ``"group"``
            (``batchweave.commit.group.GroupCommit``) is group commit: producers take turns to
            commit everybody's TGBs, so visibility does not grow with the pool.
        max_object_bytes: size cap of one TGB object; larger TGBs are split.
        background_commit: commit on a background thread (default), so commit I/O never
            delays ``append``; False commits inside ``append`` when the policy says so,
            the paper's single-loop producer (used by the policy benchmarks).
        publish_metrics: record this producer's counters in the log with every commit,
            so ``batchweave inspect`` shows them (about 200 bytes per commit).
        max_lag: backpressure: ``append`` blocks while the TGBs above ``W_global`` (the
            oldest live checkpoint), committed, only uploaded or held for a pack, would pass this many, so
            storage stays bounded even when checkpoints stall; a pool of producers splits
            the room (``batchweave.lifecycle.backpressure``). Set it above the steps between
            two checkpoints plus the producers, or training waits for data a checkpoint
            would release. None: never block.
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
        commit_policy: CommitPolicy | str | None = None,
        *,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        background_commit: bool = True,
        publish_metrics: bool = False,
        max_lag: int | None = None,
        storage_options: dict[str, Any] | None = None,
        schema: Schema | Mapping[str, tuple[Any, Sequence[int | None]]] | None = None,
        pack_steps: int | None = None,
        pack_delay_s: float = DEFAULT_PACK_DELAY_S,
    ) -> None:
        self.producer_id = check_producer_id(producer_id)
        check_pack_options(pack_steps, pack_delay_s)
        self.pack_steps = pack_steps
        self._pack = PackBuffer(pack_delay_s)
        # Held by append, flush, close and a stalled pack's deadline: one writer of packs
        # at a time, so TGBs reach ``pending`` in offset order.
        self._pack_lock = threading.Lock()
        self._pack_taken = threading.Event()  # set when the pack begun last is written
        self._declared = Schema.declared(schema)
        self.mesh = Mesh(dp=dp, cp=cp)
        if max_object_bytes <= 0:
            raise ConfigError(f"max_object_bytes must be positive, got {max_object_bytes}")
        self.max_object_bytes = max_object_bytes
        self.publish_metrics = publish_metrics
        if max_lag is not None and (not isinstance(max_lag, int) or max_lag < 1):
            raise ConfigError(f"max_lag must be a positive number of steps or None, got {max_lag!r}")
        self.max_lag = max_lag
        self._w_global_steps = 0  # cached; refreshed only while append is held back
        self._marks: MarkCache = {}  # the watermarks read while held: each is read once
        self._reclaim_view: tuple[Journal[Any], LogState] | None = None  # the log as a held producer reads it
        self._share = (-1, 0)  # (log version, this producer's share of max_lag then)
        self.policy = resolve_policy(commit_policy)
        check_mode(self.policy, producer_id, background_commit)
        self._store = open_store(url, storage_options=storage_options)
        self._journal = Journal(self._store, snapshot_every, heads_only=True)
        stalled_before_s = self._store.stalled_s
        state, me, claim_window_s = self._claim_epoch(uuid.uuid4().hex)
        claim_window_s = without_stall(self._store, claim_window_s, stalled_before_s)
        # What this producer and its commit thread share, under shared.cond.
        self._shared = SharedState(self.producer_id, threading.Condition(), threading.Event(), state, me)
        self._shared.schema = self._declared or state.schema
        if max_lag is not None:
            self._shared.committed_spans = []
        # The claim was a commit through the log: it primes the policy with a first
        # fragile-window sample and the producer count, so a pool that starts together
        # spreads its first commits instead of colliding on them.
        self._committers = RecentCommitters()
        self.policy.observe(claim_window_s, self._active_producers(), True)
        # The commit mode (direct, or group commit's turns: ``batchweave.commit.committer``).
        self._committer = committer_for(
            self.policy,
            CommitContext(
                self._shared,
                self._journal,
                self._store,
                self._active_producers,
                self._published_metrics,
                claim_window_s,
            ),
        )
        self._next_offset = me.offset
        self._uploads: ThreadPoolExecutor | None = None  # started by the first TGB of several objects
        self._thread: threading.Thread | None = None
        self._raised: Exception | None = None  # the commit thread's error, once append or flush raised it
        if background_commit:
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

    def append(self, slices: Sequence[Any], source_offset: int | None = None) -> int:
        """Write one TGB's objects now, or hold it for its pack; it becomes visible at a
        later commit.

        ``slices`` has ``dp * cp`` payloads (dicts of arrays, or bytes), slice ``(d, c)``
        at index ``d * cp + c``. ``source_offset``, when given, must be the next offset
        (``resume_offset`` after a restart, then +1 per append): offsets are dense, so a
        skipped or repeated offset is refused rather than silently lost or duplicated.
        Returns the TGB's source offset. A held TGB is a copy: the caller may reuse its
        arrays once this returns.
        """
        if self.max_lag is not None:
            self._wait_for_checkpoints(self.max_lag)
        with self._pack_lock:
            offset = self._next_offset_or_raise(source_offset)
            framed = frame_tgb(slices, self.mesh.dp, self.mesh.cp)
            head = log.TGBHead(
                self.producer_id, self._shared.me.epoch, offset, self.mesh.dp, self.mesh.cp, framed.kind, framed.nbytes
            )
            mismatch = logrules.layout_mismatch(self._shared.state.layout, head)
            if mismatch:  # before uploading anything: every consumer would fail at this step
                raise LayoutError(f"producer {self.producer_id!r}: {mismatch}; nothing was written")
            schema = self._schema_for(framed, offset)
            digest = "" if schema is None else schema.digest
            limit, now = pack_limit(framed, self.pack_steps), time.monotonic()
            self._pack.appended(now)
            if not self._pack.fits(limit):
                self._write_pack()  # the held ones go first, alone: this TGB is not theirs to join
            if limit == 1 and not self._pack:
                self._write([Held(offset, framed, digest)])  # written before append returns: no copy
                self._appended(offset, schema)
            else:
                self._hold(Held(offset, framed.owned(), digest), limit, now, schema)
        if self._thread is None:
            self._committer.commit_inline(self._next_offset, forced=False)
        return offset

    def _next_offset_or_raise(self, source_offset: int | None) -> int:
        with self._shared.cond:
            self._raise_if_unusable()
            offset = self._next_offset if source_offset is None else source_offset
            if not isinstance(offset, int) or isinstance(offset, bool) or offset != self._next_offset:
                raise SourceOffsetError(
                    f"producer {self.producer_id!r}: source_offset {offset!r} is not the next offset "
                    f"{self._next_offset} (offsets are dense: below it is appended or committed already, "
                    "above it would leave a gap)"
                )
            return offset

    def _appended(self, offset: int, schema: Schema | None) -> None:
        """The TGB at ``offset`` is appended (written, or held for its pack)."""
        with self._shared.cond:
            self._shared.schema = self._shared.schema or schema
            self._next_offset = offset + 1

    def _hold(self, held: Held, limit: int, now: float, schema: Schema | None) -> None:
        """Under the pack lock: hold a TGB for its pack, and write the pack if it is due.
        A failed write un-holds this TGB (the caller appends it again; the others stay)."""
        self._pack.hold(held, limit, now)
        if self._pack.due(now):
            try:
                self._write_pack()
            except BaseException:
                self._pack.drop_last()
                raise
        elif len(self._pack) == 1 and self._thread is not None:
            self._watch_deadline()
        self._appended(held.offset, schema)

    def _write_pack(self) -> None:
        """Under the pack lock: write the held TGBs as one pack, then forget them."""
        if self._pack:
            self._write(list(self._pack.held))
            self._pack.take()
            self._pack_taken.set()

    def _write(self, helds: list[Held]) -> None:
        """Upload consecutive TGBs as one pack and queue their descriptors for commit."""
        tgbs: list[FramedTGB] = [held.tgb for held in helds]
        pack = encode_pack(tgbs, self.max_object_bytes)
        token = secrets.token_hex(4)  # a retried write never collides with its own debris
        epoch, first = self._shared.me.epoch, helds[0].offset  # a pack is named by its first TGB
        keys = [data_key(self.producer_id, epoch, first, token, part) for part in range(len(pack.parts))]
        self._put_objects(list(zip(keys, pack.parts, pack.sizes, strict=True)))
        descriptors = [
            TGBDescriptor(
                producer=self.producer_id,
                epoch=epoch,
                source_offset=held.offset,
                dp=self.mesh.dp,
                cp=self.mesh.cp,
                kind=pack.kind,
                objects=keys,
                slices=refs,  # the log's tuples, made once by the layout
                nbytes=nbytes,
                schema=held.schema,
            )
            for held, refs, nbytes in zip(helds, pack.refs, pack.shares, strict=True)
        ]
        with self._shared.cond:
            self._raise_if_unusable()
            before = len(self._shared.pending)
            self._shared.pending.extend(descriptors)
            self._shared.metrics["bytes_written"] += sum(pack.sizes)
            # A commit thread waits for its policy's gap; TGBs queued behind others bring
            # that forward only when the policy counts them (a count it waits for): else
            # waking it on every append cost both threads a hand-off of the interpreter
            # lock a TGB (15 futex calls a TGB at 100 KB, more than the put made).
            policy, after = self.policy, len(self._shared.pending)
            if self._thread is None or before == 0 or policy.wait_s(after, 0.0) < policy.wait_s(before, 0.0):
                self._shared.cond.notify_all()

    def _watch_deadline(self) -> None:
        """Write the pack just begun at its deadline if appends stop coming (a stalled
        producer), on a thread of its own that ends when the pack is written."""
        self._pack_taken = taken = threading.Event()
        generation = self._pack.generation
        threading.Thread(
            target=self._write_at_deadline, args=(generation, taken), name="batchweave-pack", daemon=True
        ).start()

    def _write_at_deadline(self, generation: int, taken: threading.Event) -> None:
        while not taken.wait(max(0.0, self._pack.deadline() - time.monotonic())):
            with self._pack_lock:
                if self._pack.generation != generation or self._shared.closed:
                    return
                if time.monotonic() < self._pack.deadline():
                    continue
                try:
                    self._write_pack()
                except Exception as exc:  # the TGBs stay held: the next append or flush writes them, or raises
                    _logger.warning(
                        "producer %r: writing a pack of %d held TGB(s) at its deadline failed; the next append "
                        "or flush tries again: %s",
                        self.producer_id,
                        len(self._pack),
                        exc,
                    )
                return

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until everything appended so far is committed (ignores the policy's gap),
        the TGBs held for a pack included. Past ``timeout_s`` it raises ``FlushTimeoutError``
        (a ``TimeoutError``); the TGBs stay pending for the next flush or ``close()``."""
        with self._pack_lock:
            self._write_pack()
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
                self._raised = self._shared.error
                raise self._shared.error

    def close(self, flush: bool = True) -> None:
        """Flush (unless ``flush=False``) and stop the commit thread. Idempotent.

        If the commit thread stopped with an error that no ``append`` or ``flush`` has raised
        yet while TGBs were still uncommitted (a ``SchemaError`` found at commit, a
        ``ProducerFencedError``), ``close()`` raises it after stopping: those TGBs were not
        committed, and a close that returned would say they were."""
        lost: Exception | None = None
        try:
            if flush and not self._shared.closed:
                with self._shared.cond:
                    error = self._shared.error
                    # (an inline commit raises its errors in append and flush themselves)
                    untold = error is not None and error is not self._raised and self._thread is not None
                    lost = error if untold and (self._shared.pending or self._pack) else None
                if error is None:
                    self.flush()
        finally:
            with self._pack_lock:  # held TGBs not written by a flush are dropped, as pending ones are
                self._pack.take()
                self._pack_taken.set()
            with self._shared.cond:
                self._shared.closed = True
                self._shared.abandon = self._shared.abandon or not flush
                if self._shared.abandon:
                    self._shared.abandoned.set()  # what is not committed is dropped: do not wait out a storm for it
                self._shared.cond.notify_all()
            if self._thread is not None:
                self._thread.join()
            if self._uploads is not None:
                self._uploads.shutdown(wait=True)
            self._committer.close()
            self._store.release()
        if lost is not None:
            raise lost

    def _published_metrics(self, committing: int) -> dict[str, float] | None:
        """The counters as they stand once the version carrying them lands with
        ``committing`` of our TGBs: a published figure is never one commit behind.
        None unless ``publish_metrics``."""
        if not self.publish_metrics:
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
            out["held_tgbs"] = len(self._pack)  # appended, waiting for the rest of their pack
            out["producers_seen"] = len(self._shared.state.producers)
            out["producers_active"] = self._committers.count(time.monotonic(), self._policy_gap_s())
            out["log_version"] = self._shared.state.version
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

    def _active_producers(self) -> int:
        """Producers contending for the log now: those seen committing lately (``RecentCommitters``)."""
        now = time.monotonic()
        self._committers.update({pid: p.last_version for pid, p in self._shared.state.producers.items()}, now)
        return self._committers.count(now, self._policy_gap_s())

    def _policy_gap_s(self) -> float:
        gap = getattr(self.policy, "gap_s", 0.0)  # DAC's; policies that ignore N have none
        return gap if isinstance(gap, float | int) and math.isfinite(gap) else 0.0

    def _raise_if_unusable(self) -> None:
        if self._shared.error is not None:
            self._raised = self._shared.error  # told once: close() does not raise it again
            raise self._shared.error
        if self._shared.closed:
            raise ProducerClosedError(self.producer_id)
        if self._shared.state.end_of_stream:
            raise StreamEndedError(
                f"namespace {self._store.url} was ended at log version {self._shared.state.version}; no TGB is accepted"
            )

    def _schema_for(self, encoded: FramedTGB, offset: int) -> Schema | None:
        """The schema a TGB's arrays fit, or SchemaError before anything is uploaded: the
        namespace's (as of the newest log version we read), else ours (declared, or fixed
        by our first TGB), else the first slice's exact one. None for bytes."""
        with self._shared.cond:
            namespace, own = self._shared.state.schema, self._shared.schema
        where = f"{self._store.url}: TGB {self.producer_id}@{offset}"
        if encoded.kind == "bytes":
            if own is not None:
                raise SchemaError(
                    f"{where}: slices are bytes, but this producer's schema is of arrays ({own.describe()}); "
                    "nothing was written. Give dicts of arrays, or write bytes to a namespace of bytes"
                )
            return None
        if namespace is not None and own is not None and namespace != own:
            problem = schemas.difference(namespace, own)
            raise SchemaError(f"{where}: {problem}; nothing was written. {_SCHEMA_FIX}")
        expected, whose = schemas.held_to(namespace, own, self._declared, encoded.array_layouts[0])
        for arrays in encoded.array_layouts:
            problem = schemas.mismatch(expected, arrays, whose)
            if problem:
                raise SchemaError(f"{where}: {problem}; nothing was written. {_SCHEMA_FIX}")
        return expected

    def _check_declared(self, state: LogState) -> None:
        """A declared schema must be the namespace's (when it has one), and not for bytes."""
        declared = self._declared
        if declared is None:
            return
        layout = state.layout
        if layout is not None and layout.kind == "bytes":
            raise SchemaError(
                f"{self._store.url}: producer {self.producer_id!r} declares a schema of arrays "
                f"({declared.describe()}), but the namespace holds bytes; drop schema=, or use a new namespace"
            )
        if state.schema is not None and state.schema != declared:
            raise SchemaError(
                f"{self._store.url}: producer {self.producer_id!r} declares another schema than the namespace's "
                f"(log version {state.version}): {schemas.difference(state.schema, declared, 'the namespace')}; "
                "declare the namespace's schema (batchweave.read_schema), or use a new namespace"
            )

    def _claim_epoch(self, incarnation: str) -> tuple[LogState, ProducerState, float]:
        """Commit a version that gives this incarnation the next epoch of producer_id: by a
        ticket that whoever claims next folds (``commit.claims``), or by a claim of its
        own when its ticket cannot be folded (another incarnation's ticket for the same
        epoch, or the epoch passed).

        Returns the new state, this incarnation's producer state, and the fragile window
        (seconds) of the last attempt. Refuses a namespace of another layout (I9).
        """
        layout = log.Layout(self.mesh.dp, self.mesh.cp)
        began = time.monotonic()
        state = self._journal.load_state()
        self._check_declared(state)  # before claiming: a doomed incarnation must not fence a working one
        ticket = self._write_ticket(state, layout, incarnation)
        try:
            claimed = self._claim_by_ticket(ticket, state, layout, incarnation, time.monotonic() - began)
            self._check_declared(claimed[0])  # another schema may have landed meanwhile
            return claimed
        finally:
            # Folded or passed: dead either way; and a start that failed must not have its
            # ticket folded later for an incarnation that never ran. One that may not delete
            # (or a failing delete) leaves it to the collector.
            with contextlib.suppress(StoreError):
                self._store.delete_if_allowed(ticket.key)

    def _claim_by_ticket(
        self, ticket: Ticket, state: LogState, layout: log.Layout, incarnation: str, start_s: float
    ) -> tuple[LogState, ProducerState, float]:
        fresh = self._give_the_first_ticket_its_turn(state, ticket, layout, start_s)

        def claim(state: LogState) -> log.LogVersion | None:
            nonlocal fresh  # the listing just made serves the first attempt
            mine = state.producers.get(self.producer_id)
            if mine is not None and mine.incarnation == incarnation:
                return None  # our ticket was folded, or our claim landed although the store reported a conflict
            if state.end_of_stream:
                raise StreamEndedError(
                    f"namespace {self._store.url} was ended at log version {state.version}; "
                    f"producer {self.producer_id!r} cannot start (use a fresh namespace)"
                )
            if ticket.epoch == next_epoch(state, self.producer_id):
                tickets, fresh = fresh or self._tickets_with(ticket), None
                version = build_claims(state, tickets, time.time(), layout)
                if version is not None and self.producer_id in version.producers:
                    return version
            return logrules.build_claim(state, self.producer_id, incarnation, time.time(), layout)

        # A lost race is most likely another claim of a pool starting together, which
        # folded our ticket: back off, then look, instead of racing every rival at once.
        backoff = ClaimBackoff()
        result = self._journal.commit(
            state, claim, after_conflict=lambda window_s: time.sleep(backoff.pause_s(window_s))
        )
        return result.state, result.state.producers[self.producer_id], result.fragile_window_s

    def _give_the_first_ticket_its_turn(
        self, state: LogState, ticket: Ticket, layout: log.Layout, attempt_s: float
    ) -> list[Ticket] | None:
        """A pool that starts together: the holder of the first foldable ticket (in key
        order) claims for everybody, and the others let it. Each waits twice its own
        start's time (the first's claim is about that much) plus a random part of the
        pool's budget on the head key, ``rivals / HEAD_BUDGET_PER_S``, and then looks: no
        PUT of theirs races the first's, and their reads of its version stay within the
        budget. If the first died, the wait is all it costs: they then claim themselves.
        Returns the tickets listed when there was no wait (still fresh), else None."""
        listed = self._tickets_with(ticket)
        rivals = foldable(state, listed, layout)
        if len(rivals) < 2 or min(rivals, key=lambda t: t.key) == ticket:
            return listed
        time.sleep(2 * attempt_s + random.uniform(0, len(rivals) / HEAD_BUDGET_PER_S))
        return None

    def _tickets_with(self, ticket: Ticket) -> list[Ticket]:
        """Every ticket listed under ``_claims/``, and ours (a listing may lag our put)."""
        listed = (parse_claim_key(info.key) for info in self._store.list(CLAIM_PREFIX))
        return [t for t in listed if t is not None and t != ticket] + [ticket]

    def _write_ticket(self, state: LogState, layout: log.Layout, incarnation: str) -> Ticket:
        """Our ticket for the epoch after ``state``'s (its key names our incarnation:
        nobody else writes it)."""
        ticket = Ticket(self.producer_id, next_epoch(state, self.producer_id), layout, incarnation)
        try:
            self._store.put_if_absent(ticket.key, CLAIM_TICKET)
        except ObjectExistsError:
            pass  # an attempt whose answer was lost landed: the key is ours alone
        return ticket

    def _wait_for_checkpoints(self, max_lag: int) -> None:
        """Backpressure: hold ``append`` while this producer's share of ``max_lag`` is
        taken by its own TGBs at or past ``W_global``, committed or only uploaded, or the
        committed steps it sees leave no room (``lifecycle.backpressure``). Woken by our own
        commits; W_global is read again with backoff, within the pool's budget
        (``backpressure.poll_pause_s``), and only while held (``_read_w_global``)."""
        pause = 0.05
        # The cached W_global goes first: no request while there is room. Then a first look
        # at a random moment within the pool's budget: a pool is often held all at once.
        held_since, warned = time.monotonic(), False
        poll_at = held_since + random.uniform(0, self._known_producers() / HEAD_BUDGET_PER_S)
        while True:
            with self._shared.cond:
                self._raise_if_unusable()
                if self._may_upload(max_lag):
                    return
                self._shared.cond.wait(max(0.0, poll_at - time.monotonic()))
                if self._may_upload(max_lag):
                    return
            if time.monotonic() >= poll_at:
                self._w_global_steps, collected = self._read_w_global()
                poll_at = time.monotonic() + poll_pause_s(pause, self._known_producers(), random.random())
                pause = min(MAX_BACKOFF_S, pause * 2)
                if collected and not warned and time.monotonic() - held_since > HELD_WARNING_S:
                    warned = True
                    _logger.warning(
                        "producer %r: held by max_lag=%d for %.0f s; the last garbage collection reclaimed the "
                        "steps below %d, and the TGBs stored above it fill max_lag. Run `batchweave gc` (or "
                        "collect_garbage) after each checkpoint to make room",
                        self.producer_id,
                        max_lag,
                        time.monotonic() - held_since,
                        self._w_global_steps,
                    )

    def _known_producers(self) -> int:
        """Every producer the log knows, in the newest state we hold: any may be held and
        looking alike (a held producer commits nothing, so "active lately" would leave
        the held ones out)."""
        with self._shared.cond:
            known = len(self._shared.state.producers)
        if self._reclaim_view is not None:
            known = max(known, len(self._reclaim_view[1].producers))
        return max(1, known)

    def _read_w_global(self) -> tuple[int, bool]:
        """W_global in steps, as a held producer reads it, and whether it came from a
        collection. Once the namespace has been collected, it is the log's reclaim point:
        a probe of the head (on a read-only journal of our own: the commit thread owns
        the other), however many ranks marked, and proven like every view of the log.
        What is stored is what collection has not reclaimed, so that is what ``max_lag``
        bounds; reading every watermark instead cost each held producer one GET per mark
        and checkpoint (1,250 marks x 1,000 producers: 1.25 million GETs a checkpoint).
        Before any collection: the watermarks (a listing, and each new mark once)."""
        if self._reclaim_view is None:
            journal = Journal(self._store, heads_only=True, read_only=True)
            self._reclaim_view = (journal, journal.load_state())
        journal, state = self._reclaim_view
        state, _ = journal.catch_up(state)
        self._reclaim_view = (journal, state)
        if state.reclaimed.steps > 0:
            # The reclaim point alone: it only moves up, where a W_global read from the
            # marks before may have been above it (a checkpoint marked lower since).
            return state.reclaimed.steps, True
        live = global_watermark(read_watermarks(self._store, self._marks))
        return (0 if live is None else int(live.position)), False

    def _may_upload(self, max_lag: int) -> bool:
        """Under ``shared.cond``. On every append: the share (O(producers) to work out) is
        kept per log version, and spans are pruned only when W_global moved."""
        shared = self._shared
        if self._share[0] != shared.state.version:
            self._share = (shared.state.version, own_share(shared.state, self.producer_id, max_lag))
        w_global = self._w_global_steps
        spans = shared.committed_spans or []
        if spans and spans[0].end <= w_global:
            spans = shared.committed_spans = [s for s in spans if s.end > w_global]
        held = len(shared.pending) + len(self._pack)  # held for a pack: uploaded soon
        return may_upload(shared.state, self._share[1], held, spans, w_global, max_lag)

    def _put_objects(self, uploads: list[tuple[str, list[Piece], int]]) -> None:
        """A TGB's objects, all at once on an object store: a TGB of 1,250 slices is 20
        objects (``layout.MAX_SLICES_PER_OBJECT``), one round trip rather than 20. Every
        upload has ended when this returns or raises (the first failure)."""
        if len(uploads) == 1 or not self._store.remote:
            for key, pieces, size in uploads:
                self._put_object(key, pieces, size)
            return
        if self._uploads is None:
            self._uploads = ThreadPoolExecutor(max_workers=_UPLOAD_THREADS, thread_name_prefix="batchweave-upload")
        running = [self._uploads.submit(self._put_object, *upload) for upload in uploads]
        wait(running)
        for done in running:
            done.result()

    def _put_object(self, key: str, pieces: list[Piece], size: int) -> None:
        try:
            self._store.stage_if_absent(key, pieces, size)  # durable before the commit that names it
        except ObjectExistsError:
            # The key carries a fresh random token, so "exists" can only mean that a retry
            # followed our own write which the store applied before timing out.
            if self._store.size(key) != size:
                raise


_SCHEMA_FIX = (
    "A namespace keeps the schema of its first TGB of arrays (batchweave.read_schema shows it): "
    "convert the arrays to it, or write them to a new namespace"
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
