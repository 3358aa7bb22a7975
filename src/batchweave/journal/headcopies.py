"""Copies of the newest log versions, so a large job's followers at the head spread
their probes and reads over several keys instead of one.

**Why.** Every follower of a job that waits at the head probes the same key: the next
version's. One key takes about 70 requests a second within budget (``reading.polling``),
so 1,250 node followers (10,000 ranks) could each probe only every 18 s, and every
version then reached 1,250 hubs as 1,250 reads of one key. With ``copies`` copies of
each version beside its own key, followers spread their probes (the read of a version
found is its probe) over ``copies + 1`` keys, each within the budget, so each follower
probes about ``copies + 1`` times as often: every 2 s at 1,250 nodes with 10 copies.

**Who writes them.** The committer of a version, once its verify proved that its put
created the version (``Journal.commit``): producers, claims, the end of the stream and
garbage collection alike. Best effort, in the background on an object store (the
commit does not wait), inline elsewhere. A copy never written (a committer that died
after its put, a store refusing the put) costs time, never a step: followers also probe
the version's own key, as often as they would without copies.

**Why a copy is as good as the version's key (I10).** A copy of version ``v`` of this
namespace holds the bytes that ``v``'s committer put and proved, or bytes a writer wrote
after it re-created ``v`` in a key that garbage collection had freed. In the second case
``v`` was deleted before the copy was written, so before any read of it: the reader's
proof rejects that read exactly as it rejects a read of a freed key (the anchor below
``v`` is gone, or the state says ``v`` was reclaimed). So a read of a copy that the proof
accepts holds ``v``'s genuine bytes. Copies live in rings of ``keys.HEAD_RING`` slots,
overwritten as the log grows; a copy counts only for the version number it holds
(another number, a damaged copy or none at all read as "not there": the follower reads
around it). Nothing is left for garbage collection: a ring holds at most ``HEAD_RING``
versions.

**Why a copy of another namespace is never taken.** The argument above holds for copies
of *this* namespace only. A namespace deleted (every key) and created again at the same
URL is another log, whose version numbers start again at 1, and the old job's copy puts
can land after the deletion: they run on a pool after the commit returned (a producer
closed, the prefix deleted, a new producer started, all in one process), or a slow
request lands late. Such a copy holds a version number the new log uses too, and the
proof cannot see it: the new log's anchor is intact, and with no snapshot yet, "none is
listed" proves version 1 (a reader waiting before the new version 1 took the old one,
and then either raised CorruptDataError on a healthy namespace or handed out the old
job's TGBs; issue 43). So each copy names the namespace it belongs to, the random id
that version 1 records (``encode_copy``), and a reader takes a copy's bytes only when
that id is the one of the namespace it reads (``Journal.read_head_copy``): from a state
it proved, from version 1 as it read it, or else looked up once (version 1's own key,
or the snapshots' record of the id once version 1 was collected). A copy of another
namespace reads as "not there". A reader that knows no id yet, or a copy that names
none (written before copies did), reads the version's own key instead: a copy of
version 1 itself is never taken before version 1 is read, since version 1 is what names
the namespace. Every other object a writer puts (versions, snapshots, the hint,
segments, intents, TGB objects) is put before the call that writes it returns, so only
copies land after their writer went on (a request a store applies late could do the same
for any object: delete a namespace once its jobs have stopped).

Cost: ``copies`` PUTs per version on an object store (each about 60 bytes more than the
version: the id); ``BATCHWEAVE_HEAD_COPIES=0`` turns them off (``Store.head_copies``).
Checking the id costs nothing per read; a reader that starts past version 1 (a resumed
rank, a node's follower) looks its id up once, with one GET of version 1.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec

from batchweave import keys, log, retry
from batchweave.decoding import DECODE_ERRORS
from batchweave.errors import CorruptDataError, StoreError
from batchweave.journal.objects import LogObjects
from batchweave.log import ReadVersion
from batchweave.store import Store

__all__ = ["CopyWriter", "encode_copy", "read_copy"]

_logger = logging.getLogger(__name__)
# Copy puts in flight in one process. Past it a store is slow, and copies are skipped
# rather than queued: they matter only while their version is the newest.
_MAX_IN_FLIGHT = 64
_THREADS = 8
# Set from the start: a copy put the store throttles or fails is dropped at once, never
# retried (for up to the store's deadline, 10 minutes by default) beside the requests that
# matter, nor queued at a throttled process's request-rate limiter (readers read the
# version's own key instead). 1,000 producers' copies must not feed a storm.
_NO_RETRIES = threading.Event()
_NO_RETRIES.set()


class _Copy(msgspec.Struct, frozen=True):
    """A copy: the version number it holds, the id of the namespace it belongs to, and the
    version's bytes exactly as put (``data``; empty in a copy written before copies named
    their namespace, which held the version's bytes alone: its other fields are skipped)."""

    version: int
    namespace: str = ""
    data: msgspec.Raw = msgspec.Raw()


_COPY = msgspec.json.Decoder(_Copy)  # built at import (see log._VERSION_DECODER)


def encode_copy(version: int, namespace: str, data: bytes | memoryview) -> bytes:
    """The copy of ``version`` of the namespace ``namespace``, whose bytes are ``data``."""
    return msgspec.json.encode(_Copy(version, namespace, msgspec.Raw(data)))


class CopyWriter:
    """Writes the copies of each version a journal committed (see the module doc)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.copies = store.head_copies

    def write(self, version: int, data: bytes, namespace: str) -> None:
        """Copies of ``version`` of the namespace ``namespace`` (its bytes ``data``, as put):
        best effort, never raises."""
        if not self.copies:
            return
        data = encode_copy(version, namespace, data)
        for copy in range(self.copies):
            key = keys.head_copy_key(version, copy)
            if self._store.remote:
                _background.submit(self._store, key, data)
            else:
                _put(self._store, key, data)


def read_copy(objects: LogObjects, version: int, copy: int, namespace: str | None) -> ReadVersion | bool | None:
    """Copy ``copy`` of ``version``, if it belongs to the namespace of id ``namespace`` (not
    proven: the reader proves it as any version it read).

    None when it is not there yet: no copy, its slot still holds an older version, or it is
    a copy of another namespace once at this URL (an old job's put landing late). True when
    the copy cannot tell and the version's own key must be read: its slot holds a newer
    version (so ``version`` exists), the reader knows no id to check it against
    (``namespace`` None), it names no namespace (written before copies did), or it is
    damaged (logged). See the module doc."""
    key = keys.head_copy_key(version, copy)
    data = objects.get(key)
    if data is None:
        return None
    try:
        held = _COPY.decode(data)
        if held.version != version:
            return None if held.version < version else True
        if namespace is None or not len(held.data):
            return True
        if held.namespace != namespace:
            _logger.debug("read around a copy of log version %d of another namespace (%s)", version, key)
            return None
        inner = memoryview(held.data)
        return ReadVersion(log.decode_version(inner, key, version), inner)
    except (*DECODE_ERRORS, CorruptDataError) as exc:
        _logger.warning("read around a damaged copy of log version %d (%s): %s", version, key, exc)
        return True


def _put(store: Store, key: str, data: bytes) -> None:
    try:
        store.put(key, data)
    except StoreError as exc:  # the follower reads the version's own key instead
        _logger.debug("did not write the head copy %s: %s", key, exc)


class _Background:
    """One process-wide pool for copy puts, started on first use (and again in a forked
    child, whose copy of the parent's threads does not run)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = 0

    def submit(self, store: Store, key: str, data: bytes) -> None:
        with self._lock:
            if self._in_flight >= _MAX_IN_FLIGHT:
                _logger.debug("skipped the head copy %s: %d copy puts in flight", key, self._in_flight)
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=_THREADS,
                    thread_name_prefix="batchweave-head-copy",
                    initializer=retry.stop_retrying_when,
                    initargs=(_NO_RETRIES,),
                )
            self._in_flight += 1
            self._pool.submit(self._run, store, key, data)

    def _run(self, store: Store, key: str, data: bytes) -> None:
        try:
            _put(store, key, data)
        finally:
            with self._lock:
                self._in_flight -= 1

    def forget_in_child(self) -> None:
        self._lock = threading.Lock()
        self._pool = None
        self._in_flight = 0


_background = _Background()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_background.forget_in_child)
