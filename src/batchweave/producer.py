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
from typing import Any, NamedTuple

from batchweave import log, logrules, retry
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
    BatchWeaveError,
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
from batchweave.journal.overlap import refuse_overlap
from batchweave.keys import check_producer_id, data_key
from batchweave.layout import DEFAULT_MAX_OBJECT_BYTES, FramedTGB, Piece, encode_pack, frame_tgb
from batchweave.lifecycle.backpressure import (
    ACTIVE_VERSIONS,
    MAX_BACKOFF_S,
    Hold,
    Shares,
    adjusted_message,
    held_message,
    listed_checkpoints,
    measure,
    pinned_by_checkpoint,
    pinned_by_reclaim,
    poll_pause_s,
    shares,
)
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, MarkCache, global_watermark, read_watermarks
from batchweave.log import LogState, ProducerState, TGBDescriptor
from batchweave.mesh import Mesh
from batchweave.packing import DEFAULT_PACK_DELAY_S, Held, PackBuffer, check_pack_options, pack_limit
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.schema import Schema
from batchweave.store import Store, open_store

__all__ = ["Producer", "end_stream"]

_logger = logging.getLogger(__name__)
# A producer held by max_lag this long says what holds it, once per hold: its share or the
# pool's bound, and the checkpoint or the collection that W_global waits for.
HELD_WARNING_S = 60.0
# Set: the store's retries of a producer's last record end at once (``Producer._leave``).
_NO_RETRIES = threading.Event()
_NO_RETRIES.set()
_UPLOAD_THREADS = 8  # a TGB's objects uploaded at once (a producer appends one TGB at a time)


class Producer:
    """Publishes TGBs for one ``producer_id`` to the namespace at ``url``.

    Args:
        url: namespace URL (directory, ``file://``, ``s3://``, ``az://``, ``gs://``, ``memory://``).
        producer_id: stable name that survives restarts; its offsets are exactly-once.
        dp, cp: data- and context-parallel sizes; every TGB has ``dp * cp`` slices.
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
        self._pool: Shares | None = None  # this producer's share of max_lag, as of log version _pool_version
        self._pool_version = -1
        self._warn_above = max_lag or 0  # a pool bound above this gets a WARNING (``_pool_shares``)
        self.policy = resolve_policy(commit_policy, background_commit=background_commit)
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
            with self._shared.cond:  # at start: says so if max_lag is below the producers sharing it
                self._pool_shares(max_lag)
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
                    untold = error is not None and error is not self._raised and self._thread is not None
                    lost = error if untold and (self._shared.pending or self._pack) else None
                if error is None:
                    self.flush()
                    clean = True
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
            if first:
                self._tell_uncommitted()
                if self.max_lag is not None:
                    self._leave(patient=clean)
            self._store.release()
        if lost is not None:
            raise lost

    def _tell_uncommitted(self) -> None:
        """After the commit thread stopped: the appended TGBs it did not commit, if any."""
        with self._shared.cond:
            message = uncommitted_message(self.producer_id, self._shared.committed_offset(), self._next_offset)
        if message:
            _logger.warning("%s", message)

    def _leave(self, patient: bool) -> None:
        """Record in the log that this incarnation closed (``logrules.build_leave``), so the
        others' shares of ``max_lag`` stop counting it at once: one log version per close,
        paid by producers with ``max_lag`` only. Those share it, as the pool's producers
        all do where it is used; one without it holds to no share, and a version per close
        everywhere (a pool of 1,000 ending) would buy nothing where nobody uses it. Such a
        producer, closed, counts in a max_lag producer's shares for ``ACTIVE_VERSIONS``
        versions, as a crashed one does: a smaller share, never none.

        After a clean close it waits its turn as a claim does; otherwise (closed without a
        flush, or failing) it makes a few attempts without the store's retries: a producer
        stopped by Ctrl-C must not wait out a storm for it."""
        with self._shared.cond:
            state, me = self._shared.state, self._shared.me
        if state.end_of_stream:
            return  # nobody appends any more: nothing to give back
        backoff = ClaimBackoff()
        previous = retry.stop_event()
        if not patient:
            retry.stop_retrying_when(_NO_RETRIES)
        try:
            result = self._journal.commit(
                state,
                lambda newest: logrules.build_leave(newest, self.producer_id, me, time.time()),
                max_attempts=None if patient else 3,
                after_conflict=lambda window_s: time.sleep(backoff.pause_s(window_s)),
            )
        except BatchWeaveError as exc:
            outcome = f"failed: {exc}"
        else:
            with self._shared.cond:
                self._shared.state = result.state
            outcome = "" if result.outcome != "conflict" else "lost every race for the next log version"
        finally:
            retry.stop_retrying_when(previous)
        if outcome:
            _logger.info(
                "producer %r: recording in the log that it closed %s; the others count it for at most %d more "
                "log versions",
                self.producer_id,
                outcome,
                ACTIVE_VERSIONS,
            )

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
            out["producers_active"] = max(
                self._committers.count(time.monotonic(), self._policy_gap_s()), self._shared.between_looks.count()
            )
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
        """Producers contending for the log now: those seen committing lately
        (``RecentCommitters``), or, when more, as many as the versions others committed
        between two of our attempts imply (``SharedState.between_looks``: a commit that
        jumps to the head reads only the head's committer)."""
        now = time.monotonic()
        recorded = self._shared.state.producers.items()
        # A producer's record that it left is no commit of its own: it stops counting.
        self._committers.update({pid: p.last_version for pid, p in recorded if not p.left}, now)
        return max(self._committers.count(now, self._policy_gap_s()), self._shared.between_looks.count())

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
        refuse_overlap(self._store, state)  # a namespace being created: none around it, none inside (I13)
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
        (``backpressure.poll_pause_s``), and only while held (``_read_w_global``). Held past
        ``HELD_WARNING_S``, it says once what holds it (``_warn_held``)."""
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
                look = self._read_w_global()
                self._w_global_steps = look.steps
                poll_at = time.monotonic() + poll_pause_s(pause, self._known_producers(), random.random())
                pause = min(MAX_BACKOFF_S, pause * 2)
                if not warned and time.monotonic() - held_since > HELD_WARNING_S:
                    warned = self._warn_held(max_lag, time.monotonic() - held_since, look)

    def _warn_held(self, max_lag: int, held_s: float, look: _Look) -> bool:
        """Log what holds this producer (``backpressure.held_message``), from what its look
        read; False when that look gave it room (nothing to tell). Once the namespace was
        collected, the look read only the log's reclaim point: one listing of
        ``_checkpoints/`` (once per hold, never per look) says whether a checkpoint was
        released since, that is whether a collection is what it waits for."""
        with self._shared.cond:
            hold = self._room(max_lag)
        if hold.room:
            return False
        if look.collected:
            pinned = pinned_by_reclaim(look.steps, self._listed_checkpoints(), self._store.url)
        else:
            pinned = pinned_by_checkpoint(look.checkpoint, look.steps)
        _logger.warning("%s", held_message(self.producer_id, held_s, hold, pinned))
        return True

    def _listed_checkpoints(self) -> tuple[list[str], list[str]] | None:
        """The checkpoints one listing shows (``backpressure.listed_checkpoints``); None if
        the store failed (the warning then says less)."""
        try:
            return listed_checkpoints(info.key for info in self._store.list(CHECKPOINT_PREFIX))
        except StoreError:
            return None

    def _known_producers(self) -> int:
        """Every producer the log knows, in the newest state we hold: any may be held and
        looking alike (a held producer commits nothing, so "active lately" would leave
        the held ones out)."""
        with self._shared.cond:
            known = len(self._shared.state.producers)
        if self._reclaim_view is not None:
            known = max(known, len(self._reclaim_view[1].producers))
        return max(1, known)

    def _read_w_global(self) -> _Look:
        """W_global in steps, as a held producer reads it, and whether it came from a
        collection. Once the namespace has been collected, it is the log's reclaim point:
        a probe of the head (on a read-only journal of our own: the commit thread owns
        the other), however many ranks marked, and proven like every view of the log.
        What is stored is what collection has not reclaimed, so that is what ``max_lag``
        bounds; reading every watermark instead cost each held producer one GET per mark
        and checkpoint (1,250 marks x 1,000 producers: 1.25 million GETs a checkpoint).
        Before any collection: the watermarks (a listing, and each new mark once), and the
        name of the checkpoint that pins W_global with them."""
        if self._reclaim_view is None:
            journal = Journal(self._store, heads_only=True, read_only=True)
            self._reclaim_view = (journal, journal.load_state())
        journal, state = self._reclaim_view
        state, _ = journal.catch_up(state)
        self._reclaim_view = (journal, state)
        if state.reclaimed.steps > 0:
            # The reclaim point alone: it only moves up, where a W_global read from the
            # marks before may have been above it (a checkpoint marked lower since).
            return _Look(state.reclaimed.steps, True, None)
        live = global_watermark(read_watermarks(self._store, self._marks))
        return _Look(0, False, None) if live is None else _Look(int(live.position), False, live.checkpoint)

    def _may_upload(self, max_lag: int) -> bool:
        """Under ``shared.cond``, on every append (``_room``)."""
        return self._room(max_lag).room

    def _room(self, max_lag: int) -> Hold:
        """Under ``shared.cond``: this producer's room under ``max_lag``. The share
        (O(producers) to work out) is kept per log version, and spans are pruned only
        when W_global moved."""
        shared = self._shared
        pool = self._pool_shares(max_lag)
        w_global = self._w_global_steps
        spans = shared.committed_spans or []
        if spans and spans[0].end <= w_global:
            spans = shared.committed_spans = [s for s in spans if s.end > w_global]
        held = len(shared.pending) + len(self._pack)  # held for a pack: uploaded soon
        return measure(shared.state, pool, held, spans, w_global)

    def _pool_shares(self, max_lag: int) -> Shares:
        """Under ``shared.cond``: this producer's share among the producers active in the
        newest state, worked out once per log version. Logs a WARNING when ``max_lag`` is
        below the producers sharing it (each then takes one TGB), and again each time the
        pool it sees has doubled since: a pool of 1,000 that starts one by one with too
        small a max_lag logs about 10 lines per producer, not one per producer joining."""
        state = self._shared.state
        if self._pool is None or self._pool_version != state.version:
            self._pool, self._pool_version = shares(state, self.producer_id, max_lag), state.version
            if self._pool.bound > self._warn_above:
                self._warn_above = 2 * self._pool.bound - 1
                _logger.warning("%s", adjusted_message(self.producer_id, self._pool))
        return self._pool

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


class _Look(NamedTuple):
    """What a held producer's look at W_global found: the step, whether it is the log's
    reclaim point (the namespace was collected), and else the name of the oldest live
    checkpoint, which pins it (None: no checkpoint is live)."""

    steps: int
    collected: bool
    checkpoint: str | None


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
