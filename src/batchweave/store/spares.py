"""A staging file opened ahead, where the next object will go (local directories).

Creating a file costs a round trip to the file system's journal, which on some disks
(virtual ones, network-backed ones) takes as long as writing the object itself: 0.5 ms
for an empty file on the machine ``bench overhead`` runs on. A producer writes every
object of an epoch into one directory, so after each staged object the store creates
the next staging file there on a background thread, and the next put writes into it
instead of creating one while the producer waits. Any staging file name works for the
link into place (``localfs.write_durably``); one left over when the process ends is an
empty staging file, which garbage collection removes like any other.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from batchweave.store.localfs import open_staging

__all__ = ["SpareStaging"]

_SPARE_NAME = ".next"  # the staging file is ``<directory>/.next#<digits>``


class SpareStaging:
    """At most one staging file opened ahead, in the directory of the last put."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        self._spare: tuple[str, Future[tuple[int, str]]] | None = None  # (directory, opening)

    def take(self, directory: str) -> tuple[int, str] | None:
        """The spare staging file if it is in ``directory`` (its descriptor and path),
        else None; either way, there is none after this."""
        with self._lock:
            spare, self._spare = self._spare, None
            if spare is None or self._pid != os.getpid():
                return None
        where, opening = spare
        try:
            opened = opening.result()
        except OSError:
            return None  # the put opens its own, and says what is wrong if it cannot
        if where == directory:
            return opened
        _discard(opened)
        return None

    def prepare(self, directory: str) -> None:
        """Open a staging file in ``directory`` on a background thread, for the next put."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():  # threads do not survive fork()
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchweave-staging")
                self._pid = os.getpid()
                self._spare = None
            if self._spare is not None:
                return
            opening = self._pool.submit(open_staging, os.path.join(directory, _SPARE_NAME))
            self._spare = (directory, opening)

    def discard(self) -> None:
        """Remove the spare (closing a store that writes no more)."""
        self.take("")  # no put goes to "": the spare, if any, is closed and removed


def _discard(opened: tuple[int, str]) -> None:
    fd, path = opened
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)
