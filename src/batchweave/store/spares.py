"""Staging files opened ahead, where the next objects will go (local directories).

Creating a file costs the file system an inode, which on some disks takes as long as
writing the object itself: 0.1-0.7 ms of kernel time for an empty file on the machine
``bench overhead`` runs on (it varies with the directory's place on the disk), against
0.02 ms for a link. A producer writes every object of an epoch into one directory, so the
store keeps a few staging files opened ahead there, created one after another on a
background thread while the producer encodes and writes, and each put writes into the
oldest instead of creating one while the producer waits. One ahead is not enough: the
producer would wait for most of a creation on every put, since encoding and writing an
object take less than creating its file here. Any staging file name works for the link
into place (``localfs.write_durably``); those left over when the process ends are empty
staging files, which garbage collection removes like any other.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from batchweave.store.localfs import open_staging

__all__ = ["SPARES_AHEAD", "SpareStaging"]

# Staging files kept opened ahead (measured with `bench overhead`: at one, a producer on a
# local directory waited for its staging file on every put).
SPARES_AHEAD = 4
_SPARE_NAME = ".next"  # the staging files are ``<directory>/.next#<digits>``


class SpareStaging:
    """Up to ``ahead`` staging files opened ahead, in the directory of the last put."""

    def __init__(self, ahead: int = SPARES_AHEAD) -> None:
        self._ahead = ahead
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        self._directory = ""  # where the spares are
        self._spares: collections.deque[Future[tuple[int, str]]] = collections.deque()  # oldest first

    def take(self, directory: str) -> tuple[int, str] | None:
        """The oldest spare staging file if the spares are in ``directory`` (its
        descriptor and path), else None (and the spares elsewhere are removed)."""
        with self._lock:
            if self._pid != os.getpid() or not self._spares:
                return None
            if self._directory != directory:
                stale, self._spares = self._spares, collections.deque()
                opening = None
            else:
                stale, opening = (), self._spares.popleft()
        _discard_all(stale)
        if opening is None:
            return None
        try:
            return opening.result()
        except OSError:
            return None  # the put opens its own, and says what is wrong if it cannot

    def prepare(self, directory: str) -> None:
        """Open staging files in ``directory`` on a background thread until ``ahead``
        are there or on their way, for the next puts."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():  # threads do not survive fork()
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchweave-staging")
                self._pid = os.getpid()
                self._spares = collections.deque()
            stale: collections.abc.Iterable[Future[tuple[int, str]]] = ()
            if self._directory != directory:
                stale, self._spares, self._directory = self._spares, collections.deque(), directory
            path = os.path.join(directory, _SPARE_NAME)
            while len(self._spares) < self._ahead:
                self._spares.append(self._pool.submit(open_staging, path))
        _discard_all(stale)

    def discard(self) -> None:
        """Remove the spares (closing a store that writes no more)."""
        with self._lock:
            stale, self._spares = self._spares, collections.deque()
            if self._pid != os.getpid():
                return  # the parent process's: its own store removes them
        _discard_all(stale)


def _discard_all(spares: collections.abc.Iterable[Future[tuple[int, str]]]) -> None:
    """Close and remove the staging files behind ``spares`` (waiting for those still opening)."""
    for opening in spares:
        try:
            fd, path = opening.result()
        except OSError:
            continue
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
