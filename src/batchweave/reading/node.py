"""Node-level sharing: the ranks of one host share one log follower and one read per slice.

Without sharing, every rank follows the log itself and reads its own slice: 8 ranks on a
node send 8 times the log requests, and the TP and PP ranks of one (d, c) position read
the same bytes TP x PP times. With sharing, one *hub* per node does both for all of them:

- **One follower.** The hub runs the reader's proven log (``follower.ProvenLog``: read
  ahead, prove every batch, I10) once, and hands each rank the proven versions it asks
  for. A rank uses them exactly as it would its own (continuity, resharding, cursors
  are the rank's, unchanged): the hub only saves requests.
- **One read per slice.** A rank asks the hub for a byte range; the first request for a
  range reads it from the store into an anonymous shared-memory file (``memfd``) and
  every rank asking for the same range gets that file's descriptor over the socket. The
  rank maps it read-only: its arrays are views of the node's one copy, and its CRC check
  runs as before. The hub drops a range once every rank sharing that slice took it (or,
  past ``nodehub.CACHE_BYTES``, the oldest first). Nothing is ever named in
  ``/dev/shm``: the memory is freed when the last mapping goes, crash or not.

**Who is the hub.** Ranks meet on an abstract Unix socket (no file: the name vanishes
with the process holding it) named after the namespace and the node's first global
rank, so two "nodes" on one machine (two torchrun agents) stay apart. The first rank
to bind it runs the hub in background threads; the others connect. When the hub's
process dies or closes, its connections break; every rank then tries to bind the name,
one wins and serves, the rest connect to it and repeat their request (every request
is idempotent: versions and ranges are immutable). A rank that can reach no hub within
``TAKEOVER_S`` reads on its own.

The wire, never pickled: ``nodewire`` (the messages and the descriptors they carry).
The hub: ``nodehub``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from batchweave import log
from batchweave.errors import BatchWeaveError, ConfigError
from batchweave.mesh import Mesh
from batchweave.reading.follower import FollowItem
from batchweave.reading.nodehub import start_hub, use_hub
from batchweave.reading.nodewire import HubLost, log_versions, raise_reply, recv, send
from batchweave.reading.polling import HeadPolling
from batchweave.reading.sharedlog import NodeBehind
from batchweave.store import Store

__all__ = [
    "NodeClient",
    "NodePlan",
    "NodeUnavailableError",
    "node_address",
    "plan_node",
    "resolve_plan",
    "sharing_supported",
]

_logger = logging.getLogger(__name__)
TAKEOVER_S = 10.0  # how long a rank tries to reach or become the hub before reading alone


class NodeUnavailableError(BatchWeaveError):
    """No hub could be reached or started; ``next_version`` is where the log stood."""

    def __init__(self, address: str, next_version: int = 0) -> None:
        super().__init__(f"node hub {address!r}: unreachable for {TAKEOVER_S:.0f} s; reading without it")
        self.next_version = next_version


def sharing_supported() -> bool:
    """Abstract Unix sockets and memfd: Linux."""
    return sys.platform == "linux" and hasattr(os, "memfd_create")


def node_address(url: str, first_rank: int) -> str:
    """The abstract socket name of the node whose first global rank is ``first_rank``."""
    digest = hashlib.blake2b(f"{url}\n{first_rank}".encode(), digest_size=16).hexdigest()
    return f"\0batchweave-node-{digest}"


@dataclass(frozen=True, slots=True)
class NodePlan:
    """How one rank shares with the other ranks of its node."""

    address: str  # the node's hub socket
    sharers: int  # ranks of the node reading this rank's slice, itself included
    nodes: int  # followers of the job: one per node


def plan_node(url: str, mesh: Mesh, rank: int, local_rank: int, local_world_size: int) -> NodePlan:
    """The plan of ``rank``, ``local_rank`` of ``local_world_size`` ranks on its node
    (torchrun numbers a node's ranks consecutively: the node holds global ranks
    ``rank - local_rank`` to ``rank - local_rank + local_world_size - 1``)."""
    if not 0 <= local_rank < local_world_size:
        raise ConfigError(f"local rank {local_rank} is outside the node's {local_world_size} ranks")
    first = rank - local_rank
    if first < 0 or first + local_world_size > mesh.world_size:
        raise ConfigError(
            f"rank {rank} as local rank {local_rank} of {local_world_size} puts the node's ranks outside the "
            f"mesh's 0..{mesh.world_size - 1}: check LOCAL_RANK and LOCAL_WORLD_SIZE"
        )
    mine = mesh.coords(rank)
    same = [mesh.coords(r) for r in range(first, first + local_world_size)]
    sharers = sum(1 for c in same if (c.dp, c.cp) == (mine.dp, mine.cp))
    nodes = -(-mesh.world_size // local_world_size)
    return NodePlan(node_address(url, first), sharers, nodes)


def resolve_plan(
    store: Store, mesh: Mesh, rank: int, local_rank: int | None, local_world_size: int | None, sharing: bool | None
) -> NodePlan | None:
    """How ``rank`` shares with its node (None: it reads on its own), from the settings
    of ``Consumer`` and torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``."""
    if sharing is not None and not isinstance(sharing, bool):
        raise ConfigError(f"node_sharing must be True, False or None, got {sharing!r}")
    size = _local_setting(local_world_size, "LOCAL_WORLD_SIZE", 1)
    if sharing is False or (sharing is None and (size < 2 or not store.remote or not sharing_supported())):
        return None
    if not sharing_supported():
        raise ConfigError("node_sharing=True needs Linux (abstract Unix sockets and memfd)")
    return plan_node(store.url, mesh, rank, _local_setting(local_rank, "LOCAL_RANK", 0), size)


def _local_setting(value: int | None, variable: str, default: int) -> int:
    if value is None:
        text = os.environ.get(variable, "").strip()
        if not text:
            return default
        if not text.isdigit():
            raise ConfigError(f"{variable}={text!r} is not a non-negative integer")
        return int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{variable.lower()} must be a non-negative integer, got {value!r}")
    return value


# -- a rank's side -------------------------------------------------------------------------


class NodeClient:
    """One rank's connection to its node's hub (starting it, or taking over, as needed).

    Args:
        address: ``node_address(...)``.
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
