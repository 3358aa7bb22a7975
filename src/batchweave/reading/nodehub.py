"""A node's hub (``node``): one log follower and one read per byte range for the ranks of
one host, served from the process of the rank that bound the node's socket first.

The hub runs ``follower.ProvenLog`` once and keeps its proven versions in a
``sharedlog.SharedLog`` for every rank, each at its own place. The first request for a
range reads it into shared memory (``nodewire.shared_memory``); every rank asking for the
same range gets that file's descriptor. A range is dropped once every rank sharing its
slice took it, or, past ``CACHE_BYTES``, the oldest first. A process keeps one hub per
address, closed when the last of its ranks using it closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from batchweave import retry
from batchweave.journal import Journal
from batchweave.log import ReadVersion
from batchweave.reading.follower import ProvenLog, Unproven
from batchweave.reading.nodewire import HubLost, error_reply, recv, send, shared_memory
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import DEFAULT_LOG_READ_AHEAD, LogReadAhead
from batchweave.reading.sharedlog import BEHIND, NODE_READ_AHEAD, RESTART, SharedLog
from batchweave.store import Store

__all__ = ["CACHE_BYTES", "LOG_REPLY_BYTES", "LOG_WAIT_S", "start_hub", "use_hub"]

_logger = logging.getLogger(__name__)
LOG_WAIT_S = 0.5  # a log request waits this long for a new version before the reply says "none yet"
LOG_REPLY_BYTES = 8 << 20  # versions in one reply at most (a backlog comes in several)
CACHE_BYTES = 512 << 20  # ranges kept for ranks that have not taken them yet (shared memory)
_HUB_THREADS = 128  # reads in flight for the whole node (each rank fetches up to 64 steps ahead)


@dataclass(eq=False)
class _Range:
    """One byte range being read, or read, for the ranks that share it."""

    key: tuple[str, int, int]  # object, start, length
    sharers: int  # ranks of this node that read it
    done: bool = False  # read (or failed): replies go out at once
    waiters: list[tuple[socket.socket, threading.Lock, int]] = field(default_factory=list)
    fd: int = -1
    length: int = 0
    error: dict[str, Any] | None = None
    handed: int = 0  # replies sent
    in_flight: int = 0  # replies being prepared or sent (the descriptor must stay open)


class _Hub:
    """The node's follower and range reader, serving the ranks connected to ``listener``."""

    def __init__(self, listener: socket.socket, store: Store, polling: HeadPolling) -> None:
        self._listener = listener
        self._store = store
        self._polling = polling
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(
            _HUB_THREADS,
            thread_name_prefix="batchweave-node",
            initializer=retry.stop_retrying_when,  # closing does not wait out a storm
            initargs=(self._stop,),
        )
        self._cond = threading.Condition()
        self._log = SharedLog(read_ahead=random.randint(*NODE_READ_AHEAD))  # guarded by _cond
        self._ranges: OrderedDict[tuple[str, int, int], _Range] = OrderedDict()
        self._range_bytes = 0
        self._connections: set[socket.socket] = set()
        self.users = 0  # this process's ranks using it
        threading.Thread(target=self._accept, name="batchweave-node-accept", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._cond:
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._cond.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._cond:
            for shared in list(self._ranges.values()):
                self._drop(shared)  # those being sent are closed by their last reply

    # -- connections ---------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._cond:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="batchweave-node-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One rank's requests: ranges are answered from here (a range read already, or
        being read, needs no thread of its own), log requests on the pool (they wait)."""
        lock = threading.Lock()  # one reply at a time on this connection
        try:
            while not self._stop.is_set():
                request, _, _ = recv(conn)
                if request["op"] == "range":
                    self._ask_range(conn, lock, request)
                else:
                    self._pool.submit(self._answer_log, conn, lock, request)
        except (HubLost, OSError, ValueError, RuntimeError):
            pass  # the rank closed or died (RuntimeError: the pool is shutting down)
        finally:
            with self._cond:
                self._connections.discard(conn)
                self._log.leave(id(conn))
                self._cond.notify_all()
            conn.close()

    def _answer_log(self, conn: socket.socket, lock: threading.Lock, request: dict[str, Any]) -> None:
        try:
            reply, payload = self._log_reply(id(conn), request)
        except Exception as exc:  # answered, never dropped: the rank would wait forever
            reply, payload = error_reply(exc), b""
        _reply(conn, lock, request["id"], reply, payload)

    # -- the log -------------------------------------------------------------------------

    def _log_reply(self, conn: int, request: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        first = request["from"]
        with self._cond:
            answer = self._log.ask(conn, first)
            if answer == BEHIND:
                return {"behind": True}, b""
            if answer == RESTART:
                self._start_follower(first, request.get("anchor"), request.get("present_through", 0))
            self._cond.notify_all()  # the follower may read on: this rank moved
            deadline = time.monotonic() + LOG_WAIT_S
            while (parts := self._log.versions_from(first, LOG_REPLY_BYTES)) is None:
                if self._log.failure is not None:
                    return dict(self._log.failure), b""
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return {"sizes": []}, b""
                self._cond.wait(remaining)
        return {"sizes": [len(p) for p in parts]}, b"".join(parts)

    def _start_follower(self, first: int, anchor: list[Any] | None, present_through: int) -> None:
        """Follow from ``first`` (the first rank, or one behind what the hub keeps)."""
        args = (self._log.generation, first, anchor, present_through)
        threading.Thread(target=self._follow, args=args, name="batchweave-node-follow", daemon=True).start()

    def _follow(self, generation: int, first: int, anchor: list[Any] | None, present_through: int) -> None:
        retry.stop_retrying_when(self._stop)
        journal = Journal(self._store, read_only=True)
        if anchor:
            journal.anchor_on(anchor[0], anchor[1])
        reader = LogReadAhead(journal, first, DEFAULT_LOG_READ_AHEAD, stop=self._stop)
        if first == 1:
            reader.beside(journal.learn_namespace)
        proven = ProvenLog(journal, reader, self._polling, lambda: 0, self._store.url, present_through)
        try:
            for item in proven:
                if generation != self._log.generation:
                    return  # replaced by a follower started lower: not one more request
                assert not isinstance(item, Unproven)  # early=False: proven versions only, in lists
                if isinstance(item, list):
                    if not self._publish(generation, item):
                        return
                elif self._stop.wait(item) if item else self._stop.is_set():
                    return
        except Exception as exc:  # of any type: every rank hears it, after the versions before it
            with self._cond:
                self._log.fail(generation, error_reply(exc))
                self._cond.notify_all()
        finally:
            reader.close()

    def _publish(self, generation: int, batch: list[ReadVersion]) -> bool:
        """Hand a proven batch to the ranks; False when this follower was replaced."""
        with self._cond:
            if self._stop.is_set() or not self._log.publish(generation, batch):
                return False
            self._cond.notify_all()
            while not self._log.wants_more() and generation == self._log.generation and not self._stop.is_set():
                self._cond.wait(1.0)  # far enough ahead of the ranks: they ask as they consume
            return generation == self._log.generation and not self._stop.is_set()

    # -- ranges --------------------------------------------------------------------------

    def _ask_range(self, conn: socket.socket, lock: threading.Lock, request: dict[str, Any]) -> None:
        """Answer with the range's shared memory: at once when it was read already, else
        once the one read of it for the node (started by the first rank asking) is done."""
        key = (request["key"], request["start"], request["length"])
        with self._cond:
            shared = self._ranges.get(key)
            fetch = shared is None
            if shared is None:
                shared = self._ranges[key] = _Range(key, sharers=max(1, request["sharers"]))
            shared.in_flight += 1  # its descriptor stays open until this reply is sent
            ready = shared.done
            if not ready:
                shared.waiters.append((conn, lock, request["id"]))
        if fetch:
            self._pool.submit(self._fill, shared)
        if ready:
            self._hand(shared, conn, lock, request["id"])

    def _fill(self, shared: _Range) -> None:
        """Read the range once, into shared memory, and answer every rank waiting for it."""
        try:
            data = self._store.get_range(*shared.key)
            shared.fd, shared.length = shared_memory(data), len(data)
        except Exception as exc:
            shared.error = error_reply(exc)
        with self._cond:
            if shared.error is None:
                self._range_bytes += shared.length
            elif self._ranges.get(shared.key) is shared:
                del self._ranges[shared.key]  # a later request reads again
            shared.done = True
            waiters, shared.waiters = shared.waiters, []
        for conn, lock, ident in waiters:
            self._hand(shared, conn, lock, ident)

    def _hand(self, shared: _Range, conn: socket.socket, lock: threading.Lock, ident: int) -> None:
        try:
            if shared.error is not None:
                _reply(conn, lock, ident, dict(shared.error))
            else:
                _reply(conn, lock, ident, {"length": shared.length}, fds=[shared.fd])
        finally:
            self._handed(shared)

    def _handed(self, shared: _Range) -> None:
        """One more reply sent: drop the range once every sharer has it, or old ones past
        the cache's size (a rank that asks later reads again). A descriptor is closed only
        when no reply is being sent with it."""
        with self._cond:
            shared.in_flight -= 1
            shared.handed += 1
            if shared.handed >= shared.sharers or self._stop.is_set():
                self._drop(shared)
            for oldest in list(self._ranges.values()):
                if self._range_bytes <= CACHE_BYTES:
                    break
                if oldest.done:
                    self._drop(oldest)
            if self._ranges.get(shared.key) is not shared and shared.in_flight == 0:
                _close_fd(shared)  # dropped while this reply was on its way

    def _drop(self, shared: _Range) -> None:
        """Out of the cache now; its descriptor closed once no reply uses it."""
        if self._ranges.get(shared.key) is shared:
            del self._ranges[shared.key]
            self._range_bytes -= shared.length
        if shared.in_flight == 0:
            _close_fd(shared)


def _reply(
    conn: socket.socket,
    lock: threading.Lock,
    ident: int,
    reply: dict[str, Any],
    payload: bytes = b"",
    fds: Sequence[int] = (),
) -> None:
    """Send one reply on a rank's connection (one at a time)."""
    reply["id"] = ident
    try:
        with lock:
            send(conn, reply, payload, fds)
    except OSError:
        pass  # the rank went away; its connection thread cleans up


def _close_fd(shared: _Range) -> None:
    if shared.fd >= 0:
        os.close(shared.fd)
        shared.fd = -1


# -- hubs of this process ------------------------------------------------------------------

_hubs: dict[str, _Hub] = {}
_hubs_lock = threading.Lock()


def start_hub(address: str, store: Store, polling: HeadPolling) -> bool:
    """Serve ``address`` from this process if no process does; True when this one does."""
    with _hubs_lock:
        hub = _hubs.get(address)
        if hub is not None:
            return True
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
        except OSError:
            listener.close()
            return False  # another process serves it (or is about to)
        listener.listen(256)
        _hubs[address] = _Hub(listener, store, polling)
        _logger.info("serving node hub %r from process %d", address[1:], os.getpid())
        return True


def use_hub(address: str, delta: int) -> None:
    """Count this process's ranks using its hub; the last one out closes it (the others
    on the node take over)."""
    with _hubs_lock:
        hub = _hubs.get(address)
        if hub is None:
            return
        hub.users += delta
        if hub.users <= 0:
            del _hubs[address]
            hub.close()
