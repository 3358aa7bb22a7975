"""Staging files opened ahead, where the next objects will go (local directories).

Creating a file costs the file system an inode, which on some disks takes as long as
writing the object itself: 0.1-0.7 ms of kernel time for an empty file on the machine
``bench overhead`` runs on (it varies with the directory's place on the disk), against
0.02 ms for a link. A producer writes every object of an epoch into one directory, so the
store keeps a few staging files opened ahead, created one after another on a background
thread while the producer encodes and writes, and each put writes into the oldest instead
of creating one while the producer waits. One ahead is not enough: the producer would
wait for most of a creation on every put, since encoding and writing an object take less
than creating its file here.

The spares sit in the parent of the objects' directory (``data/<producer>/`` for
``data/<producer>/e<epoch>/``): a creation holds its directory's lock for as long as it
takes, and a link into that same directory would wait for it (measured: 0.38 ms a link
beside a busy creator, 0.015 ms a directory away). A link works across directories of
one file system, so any staging file name there works for the link into place
(``localfs.write_durably``); those left over when the process ends are empty staging
files, which garbage collection removes like any other.
"""

from __future__ import annotations

import collections
import collections.abc
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeAlias

from batchweave.store.localfs import open_staging, remove_quietly

__all__ = ["SPARES_AHEAD", "SPARES_BUDGET", "SpareStaging"]

# Staging files kept opened ahead (measured with `bench overhead`: at one, a producer on a
# local directory waited for its staging file on every put).
SPARES_AHEAD = 4
# Open staging files one Store keeps in all: producers sharing a Store (threads of one
# process, as `bench producers` runs them) each write into a directory of their own, and
# each directory keeps its spares, SPARES_AHEAD while the budget allows, at least one.
SPARES_BUDGET = 64
_SPARE_NAME = ".next"  # the staging files are ``<directory>/.next#<digits>``

_Spares: TypeAlias = collections.deque[Future[tuple[int, str]]]


class SpareStaging:
    """Staging files opened ahead for the directories of the last puts, each in its
    parent (or in it, when it is ``root``, the top of the namespace).

    Each directory keeps its own: a Store shared by producers that write into directories
    of their own would otherwise throw every spare away at each put of another producer
    and open them all again (measured in ``bench producers``: five file creations a put
    instead of one, half of a producer's CPU). The directory written longest ago gives
    its spares up first, once there are more directories than ``budget``.
    """

    def __init__(self, root: str, ahead: int = SPARES_AHEAD, budget: int = SPARES_BUDGET) -> None:
        self._root = os.path.normpath(root)
        self._ahead = ahead
        self._budget = budget
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        # Where the spares are -> those spares, oldest first; the directory used last at the end.
        self._spares: collections.OrderedDict[str, _Spares] = collections.OrderedDict()
        self._removing: list[str] = []  # staging names to remove with the next task on the thread
        self._homes: dict[str, str] = {}  # an object's directory -> where its spares are

    def take(self, directory: str) -> tuple[int, str] | None:
        """The oldest spare staging file for an object in ``directory`` (its descriptor
        and path), else None."""
        directory = self._home(directory)
        with self._lock:
            if self._pid != os.getpid():
                return None
            spares = self._spares.get(directory)
            if not spares:
                return None
            opening = spares.popleft()
        try:
            return opening.result()
        except OSError:
            return None  # the put opens its own, and says what is wrong if it cannot

    def prepare(self, directory: str) -> None:
        """Open staging files for ``directory`` on a background thread until ``ahead`` are
        there or on their way (fewer when many directories share the budget), for the
        next puts."""
        directory = self._home(directory)
        stale: list[Future[tuple[int, str]]] = []
        with self._lock:
            if self._pool is None or self._pid != os.getpid():  # threads do not survive fork()
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchweave-staging")
                self._pid = os.getpid()
                self._spares, self._removing = collections.OrderedDict(), []
            spares = self._spares.setdefault(directory, collections.deque())
            self._spares.move_to_end(directory)
            while len(self._spares) > self._budget:
                _, given_up = self._spares.popitem(last=False)
                stale.extend(given_up)
            wanted = max(1, min(self._ahead, self._budget // len(self._spares)))
            path = os.path.join(directory, _SPARE_NAME)
            while len(spares) < wanted:
                removing, self._removing = self._removing, []
                spares.append(self._pool.submit(_open_after_removing, removing, path))
            if self._removing:  # no spare to open: the names go on their own
                removing, self._removing = self._removing, []
                self._pool.submit(_remove_all, removing)
        _discard_all(stale)

    def remove(self, staging: str) -> None:
        """Remove the staging name ``staging`` (its object is linked into place) on the
        background thread, with the task ``prepare`` gives it next, the creation of the spare
        that replaces it: one hand-off to the thread a put, not two (each costs both
        threads a wake-up and the interpreter lock). After the creations queued there:
        removing a name takes its directory's lock, which a creation beside it holds."""
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._removing.append(staging)
                return
        remove_quietly(staging)

    def _home(self, directory: str) -> str:
        """Where the spares for objects in ``directory`` are created: its parent, inside the namespace."""
        home = self._homes.get(directory)
        if home is None:
            normal = os.path.normpath(directory)
            home = normal if normal == self._root else os.path.dirname(normal)
            if len(self._homes) >= 4 * self._budget:  # (a bound: a long-lived store sees many epochs)
                self._homes.clear()
            self._homes[directory] = home
        return home

    def discard(self) -> None:
        """Remove the spares and the staging names still to remove (closing a store
        that writes no more)."""
        with self._lock:
            stale = [opening for spares in self._spares.values() for opening in spares]
            self._spares = collections.OrderedDict()
            if self._pool is None or self._pid != os.getpid():
                return  # none opened, or the parent process's: its own store removes them
            removing, self._removing = self._removing, []
            done = self._pool.submit(_remove_all, removing)  # after every removal queued so far
        _discard_all(stale)
        done.result()


def _open_after_removing(removing: list[str], path: str) -> tuple[int, str]:
    """Remove the staging names ``removing``, then open a new staging file next to ``path``."""
    _remove_all(removing)
    return open_staging(path)


def _remove_all(removing: list[str]) -> None:
    for staging in removing:
        remove_quietly(staging)


def _discard_all(spares: collections.abc.Iterable[Future[tuple[int, str]]]) -> None:
    """Close and remove the staging files behind ``spares`` (waiting for those still opening)."""
    for opening in spares:
        try:
            fd, path = opening.result()
        except OSError:
            continue
        os.close(fd)
        remove_quietly(path)
