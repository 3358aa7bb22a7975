"""Objects written now and made durable before anything names them (local directories).

A producer's TGB objects are named by a later commit, and only that commit has to wait
for them to be durable: the fsyncs of their bytes run on a background thread while the
producer encodes and writes the next TGBs, instead of one after another on ``append``'s
path, and the fsyncs of the directories that name them run once per commit rather than
once per object (every object of a producer's epoch sits in one directory). The store
waits for all of it ahead of a durable put (a log version, an intent), so a durable object
never names one that is not (``Store.stage_if_absent``).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from batchweave.errors import NotDurableError
from batchweave.store.localfs import fsync_directory, fsync_file

__all__ = ["SYNC_THREADS", "PendingSyncs"]

# fsyncs of objects' bytes in flight at once. More threads finish a backlog sooner but
# slow the writes they overlap (measured on ext4 with `bench overhead`): one is enough to
# keep up with a producer, whose commit waits only for what it names.
SYNC_THREADS = 1


class PendingSyncs:
    """fsyncs of written files, in the background; ``wait`` for those started so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards what is pending
        self._waiting = threading.Lock()  # held by the one waiter
        self._pending: list[tuple[str, Future[None]]] = []
        self._directories: dict[str, str] = {}  # directory to fsync -> an object it names
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        # A failed fsync is final: the kernel may have dropped the pages it could not write
        # and call them clean, so a second fsync would succeed on bytes that are not on disk.
        self._failed: NotDurableError | None = None

    def start(self, key: str, path: str, directories: list[str]) -> None:
        """Make object ``key`` (the file ``path``, named in ``directories``) durable soon."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():  # threads do not survive fork()
                self._pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="batchweave-fsync")
                self._pid = os.getpid()
                self._pending, self._directories = [], {}
            self._pending.append((key, self._pool.submit(fsync_file, path)))
            for directory in directories:
                self._directories.setdefault(directory, key)

    def wait(self) -> None:
        """Return once every object staged before this call is durable. A failed fsync
        raises NotDurableError naming its object, now and at every later call: nothing
        durable may name an object that may not survive a power loss, and this store
        cannot tell which later puts would."""
        # One waiter at a time: a second one must not find the fsyncs taken by the first
        # and go ahead while they still run.
        with self._waiting:
            with self._lock:
                if self._pid != os.getpid():
                    return  # staged by the parent process: its own puts wait for them
                pending, self._pending = self._pending, []
                directories, self._directories = self._directories, {}
            for key, done in pending:
                self._check(key, done.result)
            for directory, key in directories.items():
                self._check(key, functools.partial(fsync_directory, directory))
            if self._failed is not None:
                raise self._failed

    def _check(self, key: str, sync: Callable[[], object]) -> None:
        try:
            sync()
        except OSError as exc:
            self._failed = self._failed or NotDurableError(
                key,
                f"could not make the object durable (fsync): {exc}; no later write of this store is "
                "trusted to be durable: restart the producer (it writes its uncommitted TGBs again)",
            )
