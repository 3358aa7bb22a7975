"""The producer: write TGB objects now, make them visible at a later commit.

``append`` encodes and uploads a TGB's objects in the caller's thread (so a slow store
pushes back on preprocessing) and queues its descriptor; a background thread commits
the queue as the next log version whenever the commit policy says so. Exactly-once
(invariant I3) rests on three things: the log records each producer's next offset in
the same version as its TGBs, a new incarnation claims a higher epoch through the log
(fencing any zombie at its next commit), and a rebase drops whatever the log already
holds, so an ambiguous commit outcome neither duplicates nor drops a TGB.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from batchweave import log, logrules, retry
from batchweave.commit.group import GroupCommit, Intent, build_group_commit, intent_key, turn_rank
from batchweave.commit.intents import IntentBoard
from batchweave.commit.policies import CommitPolicy, RecentCommitters, resolve_policy
from batchweave.errors import (
    ConfigError,
    LayoutError,
    NotDurableError,
    ObjectExistsError,
    SourceOffsetError,
    StoreError,
    StreamEndedError,
    TransientStoreError,
)
from batchweave.journal import DEFAULT_SNAPSHOT_EVERY, Journal
from batchweave.keys import check_producer_id, data_key
from batchweave.layout import DEFAULT_MAX_OBJECT_BYTES, Piece, encode_tgb
from batchweave.lifecycle.watermarks import global_watermark, read_watermarks
from batchweave.log import LogState, ProducerState, TGBDescriptor
from batchweave.mesh import Mesh
from batchweave.store import Store, open_store

__all__ = ["Producer", "end_stream"]

_logger = logging.getLogger(__name__)
# Consecutive failed commit attempts before the producer gives up, for errors the store
# does not retry itself (access denied, a request it refuses): they may be short-lived
# (credentials being rotated), so a few attempts with backoff. A storm of throttling or
# server errors never counts here: the store retries those until its deadline.
_MAX_STORE_FAILURES = 10


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
        max_lag: backpressure: ``append`` blocks while the newest committed step is this
            many steps or more ahead of ``W_global`` (the oldest live checkpoint), so
            storage stays bounded even when checkpoints stall. None: never block.
        storage_options: obstore options for the store (see ``batchweave.store.check_storage_options``):
            config keys such as ``region`` or ``endpoint``, ``client_options``, ``retry_config``;
            for a local directory only ``{"fsync": False}``, which skips the flushes that make
            each put durable (throwaway namespaces).
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
    ) -> None:
        self.producer_id = check_producer_id(producer_id)
        self.mesh = Mesh(dp=dp, cp=cp)
        if max_object_bytes <= 0:
            raise ConfigError(f"max_object_bytes must be positive, got {max_object_bytes}")
        self.max_object_bytes = max_object_bytes
        self.publish_metrics = publish_metrics
        if max_lag is not None and (not isinstance(max_lag, int) or max_lag < 1):
            raise ConfigError(f"max_lag must be a positive number of steps or None, got {max_lag!r}")
        self.max_lag = max_lag
        self._w_global_steps = 0  # cached; refreshed only while append is held back
        self.policy = resolve_policy(commit_policy)
        self._group = self.policy if isinstance(self.policy, GroupCommit) else None
        if self._group is not None and not background_commit:
            raise ConfigError(
                f"producer {producer_id!r}: group commit takes turns on the background commit thread; "
                "use background_commit=True (the default) with commit_policy='group'"
            )
        self._store = open_store(url, storage_options=storage_options)
        self._journal = Journal(self._store, snapshot_every, heads_only=True)
        self._cond = threading.Condition()
        self._pending: list[TGBDescriptor] = []
        self._error: Exception | None = None  # the commit thread's final error, raised to the caller
        self._closed = False
        self._abandon = False  # close(flush=False): drop what is not committed
        self._abandoned = threading.Event()  # set with it: the commit thread stops retrying a failing store
        self._flush_waiters = 0
        self._metrics: dict[str, float] = {
            "attempts": 0,
            "conflicts": 0,
            "successes": 0,
            "tgbs_committed": 0,
            "bytes_written": 0,
            "last_fragile_window_s": math.nan,
        }
        self._store_failures = 0
        self._conflict_streak = 0
        stalled_before_s = self._store.stalled_s
        self._state, self._me, claim_window_s = self._claim_epoch(uuid.uuid4().hex)
        claim_window_s = self._without_stall(claim_window_s, stalled_before_s)
        if self._group is not None:
            # The claim's successful attempt was a probe and a put, as a commit's is; it
            # seeds how long a put takes, and how late turns come until the log shows it.
            self._group.observe_commit(claim_window_s)
        # The claim was a commit through the log: it primes the policy with a first
        # fragile-window sample and the producer count, so a pool that starts together
        # spreads its first commits instead of colliding on them.
        self._committers = RecentCommitters()
        self.policy.observe(claim_window_s, self._active_producers(), True)
        self._last_attempt = time.monotonic()
        self._next_offset = self._me.offset
        self._intents = IntentBoard(self._store, self.producer_id)
        self._published_to = self._me.offset  # group commit: intents cover offsets below this
        self._published: list[tuple[str, int]] = []  # this incarnation's intents: (key, end offset)
        self._version_seen = (
            self._state.version,
            time.monotonic(),
        )  # group commit: newest version, when it was committed
        self._seen_committed_at: float | None = None  # group commit: the newest version's build time
        self._noticed_at = time.monotonic()  # group commit: when we first saw the newest version
        self._turn = (-1, 0, 0.0)  # group commit: (version, our rank after it, when our turn comes)
        self._flush_since: float | None = None  # group commit: when the current flush began
        self._published_for = -1  # group commit: the version after which we last wrote an intent
        self._follow_after = 0.0  # group commit: when the loop reads the log again
        self._prefetched_for = -1  # group commit: the version after which we last read intents ahead
        if self._group is not None:
            self._intents.sweep_older_epochs(self._me.epoch)  # a crashed incarnation's, never foldable
        self._thread: threading.Thread | None = None
        if background_commit:
            loop = self._commit_loop if self._group is None else self._group_loop
            self._thread = threading.Thread(target=loop, name=f"batchweave-commit-{producer_id}", daemon=True)
            self._thread.start()

    # -- public API ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """This incarnation's epoch; a newer incarnation of the same id fences it."""
        return self._me.epoch

    @property
    def resume_offset(self) -> int:
        """The next source offset this producer_id must produce: everything before it is committed."""
        with self._cond:
            return self._committed_offset()

    def append(self, slices: Sequence[Any], source_offset: int | None = None) -> int:
        """Write one TGB's objects now; it becomes visible at a later commit.

        ``slices`` has ``dp * cp`` payloads (dicts of arrays, or bytes), slice ``(d, c)``
        at index ``d * cp + c``. ``source_offset``, when given, must be the next offset
        (``resume_offset`` after a restart, then +1 per append): offsets are dense, so a
        skipped or repeated offset is refused rather than silently lost or duplicated.
        Returns the TGB's source offset.
        """
        if self.max_lag is not None:
            self._wait_for_checkpoints(self.max_lag)
        with self._cond:
            self._raise_if_unusable()
            offset = self._next_offset if source_offset is None else source_offset
            if not isinstance(offset, int) or isinstance(offset, bool) or offset != self._next_offset:
                raise SourceOffsetError(
                    f"producer {self.producer_id!r}: source_offset {offset!r} is not the next offset "
                    f"{self._next_offset} (offsets are dense: below it is appended or committed already, "
                    "above it would leave a gap)"
                )
        encoded = encode_tgb(slices, self.mesh.dp, self.mesh.cp, self.max_object_bytes)
        token = secrets.token_hex(4)  # a retried append never collides with its own debris
        keys = [data_key(self.producer_id, self._me.epoch, offset, token, part) for part in range(len(encoded.parts))]
        descriptor = TGBDescriptor(
            producer=self.producer_id,
            epoch=self._me.epoch,
            source_offset=offset,
            dp=self.mesh.dp,
            cp=self.mesh.cp,
            kind=encoded.kind,
            objects=keys,
            slices=[(r.object_index, r.offset, r.length, r.crc32c) for r in encoded.slices],
            nbytes=encoded.nbytes,
        )
        mismatch = logrules.layout_mismatch(self._state.layout, descriptor)
        if mismatch:  # before uploading anything: every consumer would fail at this step
            raise LayoutError(f"producer {self.producer_id!r}: {mismatch}; nothing was written")
        for key, pieces, size in zip(keys, encoded.parts, encoded.sizes, strict=True):
            self._put_object(key, pieces, size)
        with self._cond:
            self._raise_if_unusable()
            if offset != self._next_offset:
                raise SourceOffsetError(f"producer {self.producer_id!r}: offset {offset} was appended concurrently")
            self._pending.append(descriptor)
            self._next_offset = offset + 1
            self._metrics["bytes_written"] += encoded.nbytes
            self._cond.notify_all()
        if self._thread is None:
            self._commit_inline(forced=False)
        return offset

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until everything appended so far is committed (ignores the policy's gap)."""
        if self._thread is None:
            self._commit_inline(forced=True)
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            target = self._next_offset
            self._flush_waiters += 1
            self._cond.notify_all()
            try:
                while self._committed_offset() < target and self._error is None:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"producer {self.producer_id!r}: flush timed out after {timeout_s}s with "
                            f"{len(self._pending)} TGB(s) uncommitted"
                        )
                    self._cond.wait(remaining)
            finally:
                self._flush_waiters -= 1
            if self._error is not None:
                raise self._error

    def close(self, flush: bool = True) -> None:
        """Flush (unless ``flush=False``) and stop the commit thread. Idempotent."""
        try:
            if flush and not self._closed and self._error is None:
                self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._abandon = self._abandon or not flush
                if self._abandon:
                    self._abandoned.set()  # what is not committed is dropped: do not wait out a storm for it
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()
            self._intents.close()
            self._store.release()

    def _published_metrics(self, committing: int) -> dict[str, float]:
        """The counters as they stand once the version carrying them lands with
        ``committing`` of our TGBs: a published figure is never one commit behind."""
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
        with self._cond:
            out: dict[str, float] = dict(self._metrics)
            out["pending_tgbs"] = len(self._pending)
            out["producers_seen"] = len(self._state.producers)
            out["producers_active"] = self._committers.count(time.monotonic(), self._policy_gap_s())
            out["log_version"] = self._state.version
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
        return f"Producer({self._store.url!r}, {self.producer_id!r}, epoch={self._me.epoch})"

    # -- internals -------------------------------------------------------------------

    def _committed_offset(self) -> int:
        return self._state.producers[self.producer_id].offset

    def _active_producers(self) -> int:
        """Producers contending for the log now: those seen committing lately (``RecentCommitters``)."""
        now = time.monotonic()
        self._committers.update({pid: p.last_version for pid, p in self._state.producers.items()}, now)
        return self._committers.count(now, self._policy_gap_s())

    def _policy_gap_s(self) -> float:
        gap = getattr(self.policy, "gap_s", 0.0)  # DAC's; policies that ignore N have none
        return gap if isinstance(gap, float | int) and math.isfinite(gap) else 0.0

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ConfigError(f"producer {self.producer_id!r} is closed")
        if self._state.end_of_stream:
            raise StreamEndedError(
                f"namespace {self._store.url} was ended at log version {self._state.version}; no TGB is accepted"
            )

    def _claim_epoch(self, incarnation: str) -> tuple[LogState, ProducerState, float]:
        """Commit a version that gives this incarnation the next epoch of producer_id.

        Returns the new state, this incarnation's producer state, and the fragile window
        (seconds) of the successful attempt. Refuses a namespace of another layout (I9).
        """
        layout = log.Layout(self.mesh.dp, self.mesh.cp)

        def claim(state: LogState) -> log.LogVersion | None:
            mine = state.producers.get(self.producer_id)
            if mine is not None and mine.incarnation == incarnation:
                return None  # the claim landed although the store reported a conflict
            if state.end_of_stream:
                raise StreamEndedError(
                    f"namespace {self._store.url} was ended at log version {state.version}; "
                    f"producer {self.producer_id!r} cannot start (use a fresh namespace)"
                )
            return logrules.build_claim(state, self.producer_id, incarnation, time.time(), layout)

        result = self._journal.commit(self._journal.load_state(), claim)
        return result.state, result.state.producers[self.producer_id], result.fragile_window_s

    def _commit_loop(self) -> None:
        retry.stop_retrying_when(self._abandoned)
        while True:
            with self._cond:
                batch = self._wait_for_work()
                if batch is None:
                    return
                forced = self._flush_waiters > 0 or self._closed
            if not self._commit_once(batch, forced):
                return

    # -- group commit (see batchweave.commit.group) -----------------------------------------

    def _group_loop(self) -> None:
        """Publish intents, follow the log, and commit when it is this producer's turn."""
        retry.stop_retrying_when(self._abandoned)
        while True:
            with self._cond:
                if self._error is not None or (self._closed and (self._abandon or not self._pending)):
                    return
                if not self._pending:
                    self._cond.wait()
                    continue
                forced = self._flush_waiters > 0 or self._closed
            try:
                self._group_step(forced)
                self._store_failures = 0
            except StoreError as exc:
                if not self._note_store_failure(exc):
                    return
            except Exception as exc:  # fenced, ended, a damaged log, or a bug: all final
                self._fail(exc)
                return

    def _group_step(self, forced: bool) -> None:
        """One pass: publish, look at the log, then commit if the turn has come, else wait."""
        assert self._group is not None
        self._publish_intents(forced)
        now = time.monotonic()
        if forced or now >= self._follow_after:
            # Not on every wake-up: appends wake this loop, and a producer appending
            # hundreds of TGBs a second would read the log as often. A quarter interval
            # keeps the turn clock; a commit reads on to the newest version anyway.
            self._follow_log()
            self._follow_after = now + self._group.interval_s / 4
        due = self._turn_due(forced)
        if time.monotonic() < due:
            self._prefetch_intents()
            # Wake for the turn, to look at the log again, or to publish what lingered.
            poll_s = self._group.interval_s if not forced else self._group.stagger() / 2
            wake = min(due, time.monotonic() + poll_s)
            for moment in (self._publish_from(), self._prefetch_from()):
                if moment > time.monotonic():
                    wake = min(wake, moment)
            with self._cond:
                if self._pending and forced == (self._flush_waiters > 0 or self._closed):
                    self._cond.wait(max(0.0, wake - time.monotonic()))
            return
        if self._group_commit_once(forced) or not forced:
            self._conflict_streak = 0
            return
        # A flush that lost the race backs off with full jitter before it tries again:
        # the winner has most likely folded our intent already.
        self._conflict_streak += 1
        time.sleep(random.uniform(0, min(2.0, self._group.stagger() * 2**self._conflict_streak)))

    def _prefetch_from(self) -> float:
        """When the next committer (rank 0) reads the intents written for its turn (a
        quarter lead after they were due, time for their puts): at the turn it folds these, with no request on its
        critical path but the version's probe and put."""
        assert self._group is not None
        if self._turn[1] != 0 or self._prefetched_for == self._version_seen[0]:
            return math.inf
        return self._publish_from() + self._group.intent_lead_s / 4

    def _prefetch_intents(self) -> None:
        if time.monotonic() >= self._prefetch_from():
            version = self._version_seen[0]
            self._intents.others()
            self._prefetched_for = version

    def _publish_from(self) -> float:
        assert self._group is not None
        return self._version_seen[1] + self._group.publish_after_version_s()

    def _publish_intents(self, forced: bool) -> None:
        """Write the TGBs that have no intent yet as one intent, once per version, shortly
        before the next turn (or at once for a flush): whoever commits then folds them.
        TGBs appended after it wait for the next version's intent."""
        with self._cond:
            version = self._version_seen[0]
            if not forced and (self._published_for == version or time.monotonic() < self._publish_from()):
                return
            batch = [t for t in self._pending if t.source_offset >= self._published_to]
        if not batch:
            return
        end = self._intents.publish(self._me.epoch, batch)
        with self._cond:
            self._published.append((intent_key(self.producer_id, self._me.epoch, batch[0].source_offset), end))
            self._published_to = max(self._published_to, end)
            self._published_for = version

    def _follow_log(self) -> None:
        """Read the versions committed since we last looked (one GET when there are none)."""
        state, read = self._journal.catch_up(self._state)
        if read:
            self._adopt(state, self._journal.newest_committed_at)

    def _adopt(self, state: LogState, committed_at: float | None) -> None:
        """Take ``state`` as the newest: drop committed TGBs and, in group commit, restart
        the turn clock and delete our intents the log now holds (none in other modes)."""
        with self._cond:
            if state.version > self._version_seen[0]:
                self._observe_gap(state.version, committed_at, turn=state.steps > self._state.steps)
                self._version_seen = (state.version, self._committed_when(committed_at))
            before = len(self._pending)
            self._state = state
            offset = self._committed_offset()
            self._pending = [t for t in self._pending if t.source_offset >= offset]
            self._metrics["tgbs_committed"] += before - len(self._pending)
            self._published_to = max(self._published_to, offset)
            self._cond.notify_all()
        if self._published:
            self._published = self._intents.collect(state, self._published)

    def _observe_gap(self, version: int, committed_at: float | None, turn: bool) -> None:
        """Group commit learns how late turns are taken from consecutive versions' build
        times (``GroupCommit.observe_gap``): every producer, from every version it sees
        that carries TGBs (a claim is not a turn). Two versions may come from hosts whose
        clocks disagree: the gap is never taken as longer than we saw pass between them
        on our own clock."""
        previous, self._seen_committed_at = self._seen_committed_at, committed_at
        noticed, self._noticed_at = self._noticed_at, time.monotonic()
        if self._group is None or committed_at is None or previous is None or not turn:
            return
        if version == self._version_seen[0] + 1:  # versions read together: only the newest's time is known
            self._group.observe_gap(min(committed_at - previous, self._noticed_at - noticed))

    def _committed_when(self, committed_at: float | None) -> float:
        """The newest version's commit time on our monotonic clock. Turns count from it,
        not from when each producer happened to notice the version, so every producer's
        clock starts together (hosts' clocks agree to well under a turn; a clock that does
        not cannot push the start later than now or earlier than one interval ago)."""
        now = time.monotonic()
        if committed_at is None or self._group is None:
            return now
        age = min(max(0.0, time.time() - committed_at), self._group.interval_s)
        return now - age

    def _turn_due(self, forced: bool) -> float:
        """When this producer commits if no newer version shows up first.

        A flush (``forced``) keeps the order of turns but not the interval, and steps one
        commit's time per rank: when a whole pool flushes at once (the end of a run), the
        first folds everybody's intents and the others find their TGBs committed instead
        of colliding with it.
        """
        assert self._group is not None
        version, seen = self._version_seen
        if self._turn[0] != version:
            rank = turn_rank(self._state, self.producer_id, self._group.active_versions)
            self._turn = (version, rank, seen + self._group.wait_after_version_s(rank))
        _, rank, due = self._turn
        if not forced:
            self._flush_since = None
            return due
        if self._flush_since is None:
            self._flush_since = time.monotonic()
        return min(due, max(seen, self._flush_since) + rank * self._group.stagger() / 2)

    def _group_commit_once(self, forced: bool = True) -> bool:
        """One attempt: read the others' intents, then fold them with our own pending TGBs.
        False when another writer took the version. Unless ``forced`` (a flush), the
        attempt gives way to a version that landed since the turn began."""
        assert self._group is not None
        stalled_before_s = self._store.stalled_s
        turn_version, rank, _ = self._turn
        intents = self._intents_for_turn(forced, turn_version, rank)
        with self._cond:
            batch = list(self._pending)

        def commit(state: LogState) -> log.LogVersion | None:
            remaining = logrules.pending_after_rebase(state, self.producer_id, self._me, batch)
            if state.end_of_stream:
                return None  # pending_after_rebase raised if any of ours were left
            if not forced and state.version > turn_version:
                # Somebody took this turn while we listed the intents: it folded ours if
                # they were published; the rest waits for the next turn. Racing on for the
                # next version would only cost the pool a conflict or an extra version.
                return None
            self._metrics["attempts"] += 1
            published = self._published_metrics(len(remaining)) if self.publish_metrics else None
            return build_group_commit(state, self.producer_id, self._me, remaining, intents, time.time(), published)

        result = self._journal.commit(self._state, commit, max_attempts=1)
        self._metrics["successes"] += result.outcome == "committed"
        self._metrics["conflicts"] += result.conflicts
        if result.outcome != "nothing":
            self._metrics["last_fragile_window_s"] = result.fragile_window_s
            self._group.observe_commit(self._without_stall(result.fragile_window_s, stalled_before_s))
            if result.outcome == "committed":
                self._group.won_race()
            else:
                self._group.lost_race()
        committed_at = result.delta.committed_at if result.delta is not None else self._journal.newest_committed_at
        self._adopt(result.state, committed_at)
        return result.outcome != "conflict"

    def _intents_for_turn(self, forced: bool, turn_version: int, rank: int) -> list[Intent]:
        """The intents a commit folds. Listing and reading them is most of a commit's time
        on a loaded store, so only the one whose turn it is pays for it, once: rank 0 read
        them ahead (``_prefetch_intents``) and folds what it read then (an intent written
        since waits one turn); a stand-in folds only what it read at an earlier turn and
        commits its own TGBs, so a missing rank 0 costs one stagger, not a pile of
        listings (the next version's rank 0 folds the rest). A flush lists: its producer
        is leaving, and the first to flush folds the others'."""
        if forced or (rank == 0 and self._prefetched_for != turn_version):
            return self._intents.others()
        return self._intents.cached()

    def _note_store_failure(self, exc: StoreError) -> bool:
        """Count a failed commit attempt; False once the producer has failed for good.

        A TransientStoreError that the store retried until its deadline (storage option
        ``retry_deadline_s``) is final at once: minutes of throttling or outage already
        passed, and more attempts would only hide it; so is a NotDurableError, which no
        attempt of this store can cure. Anything shorter (a storm ends
        within the deadline, so the store never raises) never gets here.
        """
        self._store_failures += 1
        _logger.warning(
            "producer %s: commit attempt failed (%d in a row): %s", self.producer_id, self._store_failures, exc
        )
        retried_out = isinstance(exc, TransientStoreError) and exc.retried_s >= self._store.retry_deadline_s
        if retried_out or isinstance(exc, NotDurableError) or self._store_failures >= _MAX_STORE_FAILURES:
            self._fail(exc)
            return False
        time.sleep(min(5.0, 0.1 * 2**self._store_failures) * random.random())
        return True

    def _commit_once(self, batch: list[TGBDescriptor], forced: bool) -> bool:
        """One attempt with its bookkeeping; False once the producer has failed for good."""
        stalled_before_s = self._store.stalled_s
        try:
            success, window_s = self._attempt(batch)
            self._store_failures = 0
        except StoreError as exc:
            return self._note_store_failure(exc)
        except Exception as exc:  # fenced, ended, a damaged log, or a bug: all final
            # Whatever it is, the caller's next append/flush raises it instead of waiting
            # for a commit thread that is gone.
            self._fail(exc)
            return False
        with self._cond:  # metrics() reads the same tracker from the caller's thread
            producers = self._active_producers()
        self.policy.observe(self._without_stall(window_s, stalled_before_s), producers, success)
        self._last_attempt = time.monotonic()
        self._conflict_streak = 0 if success else self._conflict_streak + 1
        if not success and forced:
            # A flush retries without the policy's gap, but with exponential backoff and
            # full jitter, so a pool that flushes at once (end of an epoch, shutdown)
            # thins out instead of colliding again in lockstep.
            time.sleep(random.uniform(0, min(2.0, window_s * 2**self._conflict_streak)))
        return True

    def _without_stall(self, window_s: float, stalled_before_s: float) -> float:
        """``window_s`` less the seconds the store spent retrying since ``stalled_before_s``
        was read. A commit that rode out throttling measured the storm, not the log's
        contention: DAC spaces commits about 9 fragile windows apart, so one 60 s window
        would hold every commit back for minutes after the store recovered."""
        return max(0.0, window_s - (self._store.stalled_s - stalled_before_s))

    def _commit_inline(self, forced: bool) -> None:
        """background_commit=False: commit in the caller's thread (paper, Algorithm 1)."""
        target = self._next_offset
        while self._error is None and self._committed_offset() < target:
            since = time.monotonic() - self._last_attempt
            if not forced and self.policy.wait_s(len(self._pending), since) > 0:
                break
            self._commit_once(list(self._pending), forced)
            if not forced:
                break  # one attempt per append; a flush retries until everything is in
        if self._error is not None:
            raise self._error

    def _wait_for_work(self) -> list[TGBDescriptor] | None:
        """Under the lock: the batch to commit now, or None when the thread should stop."""
        while True:
            if self._error is not None or (self._closed and (self._abandon or not self._pending)):
                return None
            if self._pending:
                forced = self._flush_waiters > 0 or self._closed
                wait = 0.0 if forced else self.policy.wait_s(len(self._pending), time.monotonic() - self._last_attempt)
                if wait <= 0:
                    return list(self._pending)
            else:
                wait = math.inf
            self._cond.wait(None if math.isinf(wait) else wait)

    def _attempt(self, batch: list[TGBDescriptor]) -> tuple[bool, float]:
        """One commit attempt: catch up, rebase, conditional put. Returns (success, fragile window s)."""

        def commit(state: LogState) -> log.LogVersion | None:
            remaining = logrules.pending_after_rebase(state, self.producer_id, self._me, batch)
            if not remaining:
                return None
            self._metrics["attempts"] += 1  # before publishing: the counters include this attempt
            published = self._published_metrics(len(remaining)) if self.publish_metrics else None
            return logrules.build_commit(state, self.producer_id, self._me, remaining, time.time(), published)

        result = self._journal.commit(self._state, commit, max_attempts=1)
        committed = result.outcome == "committed"
        self._metrics["successes"] += committed
        self._metrics["conflicts"] += result.conflicts
        if result.outcome != "nothing":
            self._metrics["last_fragile_window_s"] = result.fragile_window_s
        self._adopt(result.state, None)
        return result.outcome != "conflict", result.fragile_window_s

    def _wait_for_checkpoints(self, max_lag: int) -> None:
        """Backpressure: hold ``append`` while the log is ``max_lag`` steps past ``W_global``."""
        pause = 0.05
        while True:
            with self._cond:
                self._raise_if_unusable()
                steps = self._state.steps
            if steps - self._w_global_steps < max_lag:
                return
            live = global_watermark(read_watermarks(self._store))
            self._w_global_steps = 0 if live is None else int(live.position)
            if steps - self._w_global_steps < max_lag:
                return
            time.sleep(random.uniform(pause / 2, pause))  # a new checkpoint mark releases us
            pause = min(2.0, pause * 2)

    def _put_object(self, key: str, pieces: list[Piece], size: int) -> None:
        try:
            self._store.stage_if_absent(key, pieces)  # durable before the commit that names it
        except ObjectExistsError:
            # The key carries a fresh random token, so "exists" can only mean that a retry
            # followed our own write which the store applied before timing out.
            if self._store.size(key) != size:
                raise

    def _fail(self, exc: Exception) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()


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
