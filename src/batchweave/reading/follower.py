"""Following the log as a reader: proven versions in order, and pauses while none is new.

``ProvenLog`` is what a rank's consumer and a node's shared follower (``node``) run: it
reads versions ahead (``LogReadAhead``), proves each batch of them with one request (I10)
while reading the next, and paces its probes at the head (``HeadPolling``). It yields
either a non-empty list of proven versions, in order, or a pause in seconds (nothing new:
the caller may do other work, then sleeps that long before iterating again). A damaged
version comes after every version before it, as the error its read raised.

``early=True`` hands a batch out as soon as its proof has started, as ``Unproven``: the
versions and the proof's future. A rank's pipeline schedules the batch's range reads at
once and delivers its steps only once the proof is done (reading bytes is not acting on the
log; delivering is), so the proof's round trip overlaps the reads instead of preceding
them. A version read while a proof is in flight is handed out at once too, with the future
of the proof queued behind it, which covers every version read until it starts (one proof
per round trip, as without ``early``; a start's second version no longer waits for the
first one's proof before its step is read). Every batch handed out has its proof running
or queued on the proofs' thread, so waiting for it never depends on the follower going on.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import NamedTuple, Union

from batchweave import keys
from batchweave.errors import CorruptDataError, DataReclaimedError
from batchweave.journal import Journal
from batchweave.log import LogVersion, ReadVersion
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import FIRST_WINDOW, LogReadAhead

__all__ = ["ANCHOR_SPREAD", "PROOF_BATCH_VERSIONS", "FollowItem", "ProvenLog", "Unproven", "log_reader"]

# I10: log versions are used only once proven genuine, one proof (a GET of the anchor) per
# batch of versions: those read without waiting, or while the previous batch's proof was in
# flight, at most this many.
PROOF_BATCH_VERSIONS = 128
# A large job's followers at the head draw each anchor from this many of the newest
# versions (``journal.proof``): 1,250 node followers proving 3 versions a second put about
# 15 GETs a second on each key rather than 1,250 on one within a second.
ANCHOR_SPREAD = 256


def log_reader(
    journal: Journal[LogVersion], first: int, depth: int, polling: HeadPolling, stop: threading.Event | None
) -> LogReadAhead:
    """The read-ahead of a follower paced by ``polling``: at the head of a large job, its
    probes spread over the versions' copies and its proofs over recent anchors."""
    if polling.copies:
        journal.spread_anchors(ANCHOR_SPREAD)
    return LogReadAhead(journal, first, depth, stop=stop, copies=polling.copies)


class Unproven(NamedTuple):
    """Versions read, handed out while their proof runs (``early``): act on them (deliver
    a step) only once ``proof.result()`` returns; it raises what the proof found."""

    versions: list[ReadVersion]
    proof: Future[None]


FollowItem = Union[list[ReadVersion], Unproven, float]  # noqa: UP007 (a runtime alias)


class _QueuedProof:
    """The proof queued behind the one in flight (``early``): the versions read until it
    starts join it; ``future`` is its outcome, or the failure of a proof before it."""

    __slots__ = ("_lock", "future", "started", "versions")

    def __init__(self) -> None:
        self.versions: list[ReadVersion] = []
        self.started = False
        self._lock = threading.Lock()
        self.future: Future[None] = Future()  # replaced by the queued task's own

    def join(self, read: ReadVersion) -> bool:
        """Add ``read`` unless the proof has started or is full."""
        with self._lock:
            if self.started or len(self.versions) >= PROOF_BATCH_VERSIONS:
                return False
            self.versions.append(read)
            return True

    def start(self) -> list[ReadVersion]:
        """The versions it proves: no more join."""
        with self._lock:
            self.started = True
            return list(self.versions)


class ProvenLog:
    """Proven log versions from ``reader``'s next version on (see the module doc).

    Args:
        journal: the reader's journal (read-only), anchored where the reader starts if
            it can be.
        reader: reads the versions ahead.
        polling: the pauses at the head, and how often an idle follower re-proves.
        next_step: the first step the follower's user still needs (for the message of a
            DataReclaimedError when GC overtook it).
        url: the namespace, for messages.
        present_through: versions up to this one exist (the cursor's version): missing,
            one is damage, not a version not committed yet.
        early: hand batches out as ``Unproven`` once their proof has started.
    """

    def __init__(
        self,
        journal: Journal[LogVersion],
        reader: LogReadAhead,
        polling: HeadPolling,
        next_step: Callable[[], int],
        url: str,
        present_through: int = 0,
        *,
        early: bool = False,
    ) -> None:
        self._journal = journal
        self._reader = reader
        self._polling = polling
        self._next_step = next_step
        self._url = url
        self._present_through = present_through
        self._last_proof = -math.inf  # when the view was last proven; never yet
        self._early = early
        self._queued: _QueuedProof | None = None  # early: the proof behind the one in flight
        self._started = False  # whether a batch was handed out yet

    def __iter__(self) -> Iterator[FollowItem]:
        reader = self._reader
        batch: list[ReadVersion] = []
        proving: tuple[Future[None], list[ReadVersion]] | None = None
        while True:
            if proving is not None and proving[0].done():
                yield from self._done(proving)
                proving = None
            version = reader.next_version
            try:
                read = reader.next()
            except CorruptDataError:
                # A damaged version: every version before it first, and a reader GC
                # overtook hears that instead (the damage may lie in the reclaimed region).
                if proving is not None:
                    yield from self._done(proving)
                self.prove(batch[0].delta.version if batch else version, batch[-1] if batch else None)
                if batch:
                    yield batch
                raise
            if read is not None:
                self._polling.found(read.delta.committed_at)
                if self._early and proving is not None:
                    # Handed out at once, delivered once the proof queued behind the one in
                    # flight is done: its step's read need not wait for that proof first.
                    queued = self._queue_behind(proving[0], read)
                    proving = (queued, [])
                    yield Unproven([read], queued)
                    continue
                batch.append(read)
                if len(batch) < PROOF_BATCH_VERSIONS and (
                    reader.ready() or proving is not None or self._first_wave(batch)
                ):
                    continue  # read on: while the last batch's proof is in flight too
                if proving is not None:
                    yield from self._done(proving)  # one proof at a time: each moves the anchor
                proof = reader.beside(self.prove, batch[0].delta.version, batch[-1])
                proving, batch = (proof, batch), []
                self._started = True
                yield Unproven(proving[1], proof) if self._early else 0.0
                continue
            # A miss (the read a finished future promised can be one): what was read is
            # proven and handed out before the follower pauses.
            if proving is not None:
                yield from self._done(proving)
                proving = None
            if batch and self._early:  # at the head: the new steps are read while it is proven
                proof = reader.beside(self.prove, batch[0].delta.version, batch[-1])
                proving, batch = (proof, batch), []
                self._started = True
                yield Unproven(proving[1], proof)
            elif batch:
                self.prove(batch[0].delta.version, batch[-1])
                yield batch
                batch = []
            elif time.monotonic() - self._last_proof >= self._polling.idle_proof_s:
                self.prove(version, None)  # a miss may be a version GC deleted: were we overtaken?
            if version <= self._present_through:
                raise CorruptDataError(keys.version_key(version), "the cursor's log version is missing")
            yield self._polling.missed()

    def _first_wave(self, batch: list[ReadVersion]) -> bool:
        """A start's first proof waits for the versions read together with its first one
        (they arrive within a few ms of each other): proven apart, the second would wait
        for the first one's proof, a round trip more before its step is handed out."""
        return not self._started and len(batch) < FIRST_WINDOW and self._reader.pending()

    def _queue_behind(self, in_flight: Future[None], read: ReadVersion) -> Future[None]:
        """The future of the proof that covers ``read``: the one queued behind ``in_flight``
        if it has not started yet, else a new one queued behind ``in_flight``."""
        queued = self._queued
        if queued is None or not queued.join(read):
            queued = self._queued = _QueuedProof()
            queued.join(read)
            queued.future = self._reader.beside(self._prove_queued, queued, in_flight)
        return queued.future

    def _prove_queued(self, queued: _QueuedProof, before: Future[None]) -> None:
        """On the proofs' thread, after ``before``: prove what joined ``queued`` (a failed
        proof before it fails it too: its versions come after those)."""
        versions = queued.start()
        failed = before.exception()  # done: the proofs run one at a time, in order
        if failed is not None:
            raise failed
        self.prove(versions[0].delta.version, versions[-1])

    def _done(self, proving: tuple[Future[None], list[ReadVersion]]) -> Iterator[list[ReadVersion]]:
        """Wait for a proof in flight (raising what it found); its batch, unless handed
        out already (``early``)."""
        batch = _proven(proving)
        if not self._early:
            yield batch

    def prove(self, lowest: int, newest: ReadVersion | None) -> None:
        """Go on only with a proven view (I10): every version read since the last proof,
        from ``lowest`` on, is genuine. Otherwise GC overtook this follower
        (DataReclaimedError) or a version vanished that nothing reclaimed (CorruptDataError)."""
        self._last_proof = time.monotonic()
        anchor = self._journal.anchor_version
        if self._journal.prove_reads(lowest, newest):
            return
        reclaimed = self._journal.load_state().reclaimed
        below = anchor if anchor is not None and 0 < anchor <= lowest else lowest
        if reclaimed.versions > below:
            raise DataReclaimedError(self._url, self._next_step(), reclaimed.steps)
        raise CorruptDataError(
            keys.version_key(below), "this log version vanished although no garbage collection reclaimed it"
        )


def _proven(proving: tuple[Future[None], list[ReadVersion]]) -> list[ReadVersion]:
    """A batch once its proof is done (which raises if the view could not be proven)."""
    proof, batch = proving
    proof.result()
    return batch
