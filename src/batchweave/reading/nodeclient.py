"""One rank's side of node sharing (``node``): its connection to the node's hub, through
which it follows the log and reads its slices, starting the hub or taking over when no
hub answers. A rank that can reach no hub within ``TAKEOVER_S`` reads on its own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from batchweave import log
from batchweave.errors import BatchWeaveError
from batchweave.reading.follower import FollowItem
from batchweave.reading.nodehub import start_hub, use_hub
from batchweave.reading.nodewire import HubLost, log_versions, raise_reply, recv, send
from batchweave.reading.polling import HeadPolling
from batchweave.reading.sharedlog import NodeBehind
from batchweave.store import Store

__all__ = ["TAKEOVER_S", "NodeClient", "NodeUnavailableError"]

_logger = logging.getLogger(__name__)
TAKEOVER_S = 10.0  # how long a rank tries to reach or become the hub before reading alone


class NodeUnavailableError(BatchWeaveError):
    """No hub could be reached or started; ``next_version`` is where the log stood."""

    def __init__(self, address: str, next_version: int = 0) -> None:
        super().__init__(f"node hub {address!r}: unreachable for {TAKEOVER_S:.0f} s; reading without it")
        self.next_version = next_version


class NodeClient:
    """One rank's connection to its node's hub (starting it, or taking over, as needed).

    Args:
        address: ``node.node_address(...)``.
        store: the rank's store; the hub reads through it if this rank starts the hub.
        polling: the hub's head polling, if this rank starts it (followers = nodes).
        sharers: ranks of this node that read this rank's slice (itself included).
    """

    def __init__(self, address: str, store: Store, polling: HeadPolling, sharers: int) -> None:
        self._address = address
        self._store = store
        self._polling = polling
        self._sharers = sharers
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self._sock: socket.socket | None = None
        self._pending: dict[int, Future[tuple[dict[str, Any], bytes, list[int]]]] = {}
        self._ids = itertools.count()
        self._hosting = False
        self._closed = False
        self._unreachable = False  # no hub within TAKEOVER_S once: this rank reads on its own from then on

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            self._fail_pending()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self._hosting:
            self._hosting = False
            use_hub(self._address, -1)

    # -- requests --------------------------------------------------------------------------

    def log(
        self,
        first: int,
        anchor: tuple[int, str] | None,
        present_through: int,
        next_step: Callable[[], int],
        url: str,
        stop: threading.Event,
    ) -> Iterator[FollowItem]:
        """Proven versions from ``first`` on, as ``ProvenLog`` yields them (the hub proved
        them); a short pause when none arrived within ``LOG_WAIT_S``. Raises
        NodeUnavailableError (with the next version) when no hub can be had."""
        version = first
        while not stop.is_set():
            request = {"op": "log", "from": version, "present_through": present_through}
            if anchor is not None and anchor[0] <= version:
                request["anchor"] = list(anchor)
            try:
                reply, payload, _ = self._call(request)
            except NodeUnavailableError:
                raise NodeUnavailableError(self._address, version) from None
            raise_reply(reply, url, next_step)
            if reply.get("behind"):
                raise NodeBehind(version)
            if not reply["sizes"]:
                yield 0.001  # nothing new yet: the hub waited already
                continue
            batch = log_versions(payload, reply["sizes"], version)
            version += len(batch)
            anchor = (batch[-1].delta.version, log.digest(batch[-1].data))
            yield batch

    def read(self, key: str, start: int, length: int) -> memoryview:
        """``length`` bytes of ``key`` from ``start``, read once for the node and mapped
        read-only here. Store errors are raised as the store would raise them."""
        reply, _, fds = self._call(
            {"op": "range", "key": key, "start": start, "length": length, "sharers": self._sharers}
        )
        try:
            raise_reply(reply, self._store.url, lambda: 0)
            if reply["length"] == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(fds[0], reply["length"], prot=mmap.PROT_READ))
        finally:
            for fd in fds:
                os.close(fd)

    def _call(self, request: dict[str, Any]) -> tuple[dict[str, Any], bytes, list[int]]:
        """Send ``request`` and wait for its reply, across hub changes (requests are
        idempotent: versions and ranges never change)."""
        deadline = time.monotonic() + TAKEOVER_S
        while True:
            future: Future[tuple[dict[str, Any], bytes, list[int]]] = Future()
            sock = self._connection(deadline)
            try:
                with self._lock:
                    request["id"] = ident = next(self._ids)
                    self._pending[ident] = future
                    send(sock, request)
                return future.result()
            except (HubLost, OSError):
                self._lost(sock)  # the hub died or closed: reach (or become) the next one
                deadline = time.monotonic() + TAKEOVER_S

    def _connection(self, deadline: float) -> socket.socket:
        """The live connection, or a new one (to a hub this rank starts if none answers).
        One thread connects at a time: the others then use its connection."""
        with self._connecting:
            with self._lock:
                if self._sock is not None:
                    return self._sock
            sock = self._connect(deadline)
            with self._lock:
                self._sock = sock
            threading.Thread(target=self._receive, args=(sock,), name="batchweave-node-recv", daemon=True).start()
            return sock

    def _connect(self, deadline: float) -> socket.socket:
        pause = 0.001
        while True:
            if self._closed or self._unreachable:
                raise NodeUnavailableError(self._address)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self._address)
                return sock
            except OSError:
                sock.close()
            if not self._hosting and start_hub(self._address, self._store, self._polling):
                self._hosting = True
                use_hub(self._address, +1)
                continue
            if time.monotonic() > deadline:
                self._unreachable = True
                _logger.warning("%s", NodeUnavailableError(self._address))
                raise NodeUnavailableError(self._address) from None
            time.sleep(pause)  # a hub binds before it listens: a moment
            pause = min(0.1, pause * 2)

    def _receive(self, sock: socket.socket) -> None:
        try:
            while True:
                reply, payload, fds = recv(sock)
                with self._lock:
                    future = self._pending.pop(reply.pop("id"), None)
                if future is None:
                    for fd in fds:
                        os.close(fd)
                    continue
                future.set_result((reply, payload, fds))
        except (HubLost, OSError, ValueError):
            self._lost(sock)

    def _lost(self, sock: socket.socket | None) -> None:
        with self._lock:
            if sock is not None and self._sock is sock:
                self._sock = None
                self._fail_pending()
        if sock is not None:
            sock.close()

    def _fail_pending(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(HubLost())
        self._pending.clear()
