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
  past ``CACHE_BYTES``, the oldest first). Nothing is ever named in ``/dev/shm``: the
  memory is freed when the last mapping goes, crash or not.

**Who is the hub.** Ranks meet on an abstract Unix socket (no file: the name vanishes
with the process holding it) named after the namespace and the node's first global
rank, so two "nodes" on one machine (two torchrun agents) stay apart. The first rank
to bind it runs the hub in background threads; the others connect. When the hub's
process dies or closes, its connections break; every rank then tries to bind the name,
one wins and serves, the rest connect to it and repeat their request (every request
is idempotent: versions and ranges are immutable). A rank that can reach no hub within
``TAKEOVER_S`` reads on its own.

Wire format (never pickled): ``u32 header length | u32 payload length | JSON header |
payload``, with a range's descriptor attached to its reply (SCM_RIGHTS).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import mmap
import os
import random
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from batchweave import log, retry
from batchweave.errors import (
    BatchWeaveError,
    ConfigError,
    CorruptDataError,
    DataReclaimedError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from batchweave.journal import Journal
from batchweave.log import ReadVersion
from batchweave.mesh import Mesh
from batchweave.reading.follower import FollowItem, ProvenLog
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import DEFAULT_LOG_READ_AHEAD, LogReadAhead
from batchweave.reading.sharedlog import BEHIND, NODE_READ_AHEAD, RESTART, NodeBehind, SharedLog, decode_versions
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
_PREFIX = struct.Struct("<II")  # header length, payload length
_MAX_HEADER = 1 << 20
LOG_WAIT_S = 0.5  # a log request waits this long for a new version before the reply says "none yet"
LOG_REPLY_BYTES = 8 << 20  # versions in one reply at most (a backlog comes in several)
CACHE_BYTES = 512 << 20  # ranges kept for ranks that have not taken them yet (shared memory)
TAKEOVER_S = 10.0  # how long a rank tries to reach or become the hub before reading alone
_HUB_THREADS = 128  # reads in flight for the whole node (each rank fetches up to 64 steps ahead)


class NodeUnavailableError(BatchWeaveError):
    """No hub could be reached or started; ``next_version`` is where the log stood."""

    def __init__(self, address: str, next_version: int = 0) -> None:
        super().__init__(f"node hub {address!r}: unreachable for {TAKEOVER_S:.0f} s; reading without it")
        self.next_version = next_version


class _HubLost(Exception):
    """The connection to the hub broke (its process died or closed): ask again."""


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


# -- the wire ----------------------------------------------------------------------------


def _send(
    sock: socket.socket,
    header: dict[str, Any],
    payload: bytes | memoryview = b"",
    fds: Sequence[int] = (),
) -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    first = _PREFIX.pack(len(head), len(payload)) + head
    sent = socket.send_fds(sock, [first], list(fds)) if fds else sock.send(first)
    if sent < len(first):
        sock.sendall(first[sent:])
    if payload:
        sock.sendall(payload)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]]:
    """One message; raises _HubLost at the end of the stream."""
    prefix, fds, _, _ = socket.recv_fds(sock, _PREFIX.size, 1)
    if not prefix:
        raise _HubLost
    prefix += _recv_exactly(sock, _PREFIX.size - len(prefix))
    head_length, payload_length = _PREFIX.unpack(prefix)
    if head_length > _MAX_HEADER:
        raise _HubLost  # not our protocol
    header = json.loads(_recv_exactly(sock, head_length))
    return header, _recv_exactly(sock, payload_length), fds


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise _HubLost
        got += k
    return bytes(buf)


def _error_reply(exc: BaseException) -> dict[str, Any]:
    """What a rank needs to raise the same error itself."""
    if isinstance(exc, DataReclaimedError):
        return {"error": "reclaimed", "oldest": exc.oldest}
    if isinstance(exc, CorruptDataError):
        return {"error": "corrupt", "key": exc.key, "problem": exc.problem}
    if isinstance(exc, ObjectNotFoundError):
        return {"error": "missing", "key": exc.key, "problem": exc.problem}
    if isinstance(exc, TransientStoreError):
        return {"error": "transient", "key": exc.key, "problem": exc.problem}
    if isinstance(exc, StoreError):
        return {"error": "store", "key": exc.key, "problem": exc.problem}
    return {"error": "store", "key": "(node hub)", "problem": f"{type(exc).__name__}: {exc}"}


def _raise_reply(reply: dict[str, Any], url: str, next_step: Callable[[], int]) -> None:
    kind = reply.get("error")
    if kind is None:
        return
    if kind == "reclaimed":
        raise DataReclaimedError(url, next_step(), reply["oldest"])
    if kind == "corrupt":
        raise CorruptDataError(reply["key"], reply["problem"])
    if kind == "missing":
        raise ObjectNotFoundError(reply["key"], reply["problem"])
    if kind == "transient":
        raise TransientStoreError(reply["key"], reply["problem"])
    raise StoreError(reply["key"], reply["problem"])


# -- the hub -----------------------------------------------------------------------------


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
                request, _, _ = _recv(conn)
                if request["op"] == "range":
                    self._ask_range(conn, lock, request)
                else:
                    self._pool.submit(self._answer_log, conn, lock, request)
        except (_HubLost, OSError, ValueError, RuntimeError):
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
            reply, payload = _error_reply(exc), b""
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
                if isinstance(item, list):
                    if not self._publish(generation, item):
                        return
                elif self._stop.wait(item) if item else self._stop.is_set():
                    return
        except Exception as exc:  # of any type: every rank hears it, after the versions before it
            with self._cond:
                self._log.fail(generation, _error_reply(exc))
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
            shared.fd, shared.length = _shared_memory(data), len(data)
        except Exception as exc:
            shared.error = _error_reply(exc)
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
            _send(conn, reply, payload, fds)
    except OSError:
        pass  # the rank went away; its connection thread cleans up


def _shared_memory(data: memoryview | bytes) -> int:
    """An anonymous, sealed (read-only for good) shared-memory file holding ``data``."""
    fd = os.memfd_create("batchweave-slice", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        import fcntl  # Linux only, like memfd

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _close_fd(shared: _Range) -> None:
    if shared.fd >= 0:
        os.close(shared.fd)
        shared.fd = -1


# -- hubs of this process ------------------------------------------------------------------

_hubs: dict[str, _Hub] = {}
_hubs_lock = threading.Lock()


def _start_hub(address: str, store: Store, polling: HeadPolling) -> bool:
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


def _use_hub(address: str, delta: int) -> None:
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
            _use_hub(self._address, -1)

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
            _raise_reply(reply, url, next_step)
            if reply.get("behind"):
                raise NodeBehind(version)
            if not reply["sizes"]:
                yield 0.001  # nothing new yet: the hub waited already
                continue
            batch = _versions(payload, reply["sizes"], version)
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
            _raise_reply(reply, self._store.url, lambda: 0)
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
                    _send(sock, request)
                return future.result()
            except (_HubLost, OSError):
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
            if not self._hosting and _start_hub(self._address, self._store, self._polling):
                self._hosting = True
                _use_hub(self._address, +1)
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
                reply, payload, fds = _recv(sock)
                with self._lock:
                    future = self._pending.pop(reply.pop("id"), None)
                if future is None:
                    for fd in fds:
                        os.close(fd)
                    continue
                future.set_result((reply, payload, fds))
        except (_HubLost, OSError, ValueError):
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
                future.set_exception(_HubLost())
        self._pending.clear()


def _versions(payload: bytes, sizes: list[int], first: int) -> list[ReadVersion]:
    view = memoryview(payload)
    ends = list(itertools.accumulate(sizes))
    return decode_versions([view[end - n : end] for end, n in zip(ends, sizes, strict=True)], first)
