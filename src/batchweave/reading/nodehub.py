"""A node's hub (``node``): one log follower and one read per byte range for the ranks of
one job on one host, served from the process of the rank that took the node's lock first.

The hub runs ``follower.ProvenLog`` once and keeps its proven versions in a
``sharedlog.SharedLog`` for every rank, each at its own place. The first request for a
range reads it into shared memory (``nodewire.shared_memory``); every rank asking for the
same range gets that file's descriptor. A range is dropped once every rank sharing its
slice took it, or, past ``CACHE_BYTES`` or ``fd_budget()`` descriptors, the oldest first.
A process keeps one hub per address, closed when the last of its ranks using it closes.

Every peer is a stranger until checked (``nodetrust``: same user, same hub identity),
and then still costs the hub only what it bounds:

- **connections**: at most ``MAX_PEERS`` greeted (``2 * MAX_PEERS`` accepted), each
  with two threads, one that reads its requests and its outbox's writer
  (``nodeoutbox``): a reply goes out at once from the thread that has it when the
  kernel says the socket has room, else through the connection's own writer, the only
  thread that ever waits for that peer, so a peer that stops reading holds no thread of
  the hub's readers or followers; once a send of its writer has not moved for
  ``nodewire.IO_S`` the connection is dropped. What a peer's replies hold meanwhile is
  bounded: at most ``MAX_OUTSTANDING`` replies queued (headers of a few hundred bytes,
  each range's descriptor kept open) and one log reply (about ``LOG_REPLY_BYTES``), besides
  what its socket's kernel buffer holds. A range whose descriptor the kernel refuses
  (the user's descriptors in flight at ``RLIMIT_NOFILE``) is answered ``direct``;
- **requests**: validated before anything acts on them (``nodewire.parse_request``); at
  most ``MAX_OUTSTANDING`` unanswered per connection (then the hub stops reading it until
  replies are taken), and one log request at a time;
- **memory and descriptors**: a request is a header of at most 4 KiB; ranges kept take
  at most ``CACHE_BYTES`` and ``fd_budget()`` descriptors (past those, a range is read
  by its rank itself: ``direct``);
- **the shared follower**: no request can restart it lower, fail it or stall it for
  others (``sharedlog``); a failure of it sends its ranks to read on their own, never an
  error; a connection's place in it goes with the connection.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import random
import resource
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from batchweave import keys, retry
from batchweave.errors import CorruptDataError, StoreError
from batchweave.journal import Journal
from batchweave.log import ReadVersion
from batchweave.reading.follower import ProvenLog, Unproven, log_reader
from batchweave.reading.node import HubAddress
from batchweave.reading.nodeoutbox import Outbox, Reply
from batchweave.reading.nodetrust import HubRefused, check_peer
from batchweave.reading.nodewire import (
    IO_S,
    PROTOCOL,
    REQUEST_LIMITS,
    BadRequest,
    Hello,
    HubLost,
    LogRequest,
    RangeRequest,
    bound,
    error_reply,
    parse_request,
    recv,
    shared_memory,
    shut,
)
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import DEFAULT_LOG_READ_AHEAD
from batchweave.reading.sharedlog import ALONE, NODE_READ_AHEAD, RESTART, SharedLog
from batchweave.store import Store

__all__ = [
    "CACHE_BYTES",
    "LOG_REPLY_BYTES",
    "LOG_WAIT_S",
    "MAX_OUTSTANDING",
    "MAX_PEERS",
    "fd_budget",
    "start_hub",
    "use_hub",
]

_logger = logging.getLogger(__name__)
LOG_WAIT_S = 0.5  # a log request waits this long for a new version before the reply says "none yet"
LOG_REPLY_BYTES = 8 << 20  # versions in one reply at most (a backlog comes in several)
CACHE_BYTES = 512 << 20  # ranges kept for ranks that have not taken them yet (shared memory)
MAX_PEERS = 64  # connections served at once: a node's ranks, each with a consumer or two
MAX_OUTSTANDING = 256  # unanswered requests per connection (a rank fetches up to 64 steps ahead): also
# the replies a peer that stops reading can have queued in its outbox
_READ_THREADS = 128  # range reads in flight for the whole node
_FDS_IN_FLIGHT = (
    "the kernel refused the hub's shared memory: this user's descriptors sent and not yet received reached"
    " its limit (RLIMIT_NOFILE; a process of the user leaves replies unread)"
)


def fd_budget() -> int:
    """Shared-memory descriptors a hub keeps open at most: a quarter of the process's
    limit (the rank whose process serves the hub needs the rest), 16 to 1,024."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(1024, soft // 4)) if soft != resource.RLIM_INFINITY else 1024


@dataclass(eq=False)
class _Peer:
    """One connection: its requests are read on one thread, its replies sent by the
    thread that has one, or by its writer (``nodeoutbox``)."""

    sock: socket.socket
    ident: int  # never reused, unlike id(): a new peer must not inherit a dead one's place
    pid: int
    outbox: Outbox
    # Its own condition, not the hub's: a reply sent must not wake every thread waiting
    # on the hub (the follower, log requests waiting for a version).
    room: threading.Condition = field(default_factory=threading.Condition)
    outstanding: int = 0  # requests not answered yet (guarded by ``room``)
    log_busy: bool = False  # a log request is being answered (guarded by ``room``)
    closed: bool = False  # no more requests: its place in the shared log is gone

    def close(self) -> None:
        """No more requests from it: the reader stops waiting for room."""
        with self.room:
            self.closed = True
            self.room.notify_all()

    def reply(
        self,
        ident: int,
        header: dict[str, Any],
        payload: bytes = b"",
        fds: Sequence[int] = (),
        done: Callable[[], None] | None = None,
        instead: dict[str, Any] | None = None,
    ) -> None:
        """Send one reply, or queue it (never waits for the peer); ``done`` runs once it
        was sent or dropped; ``instead`` goes in its place if the kernel refuses ``fds``."""
        header["id"] = ident
        if instead is not None:
            instead["id"] = ident
        self.outbox.put(header, payload, fds, done, instead)


@dataclass(eq=False)
class _Range:
    """One byte range being read, or read, for the ranks that share it."""

    key: tuple[str, int, int]  # object, start, length
    sharers: int  # ranks of this node that read it
    done: bool = False  # read (or failed): replies go out at once
    waiters: list[tuple[_Peer, int]] = field(default_factory=list)
    fd: int = -1
    length: int = 0
    error: dict[str, Any] | None = None  # a store error, or {"direct": why}: the rank reads it itself
    handed: int = 0  # replies sent
    in_flight: int = 0  # replies queued or being sent (the descriptor must stay open)


class _Hub:
    """The node's follower and range reader, serving the ranks connected to ``listener``."""

    def __init__(
        self, listener: socket.socket, lock_fd: int, path: str, address: HubAddress, store: Store, polling: HeadPolling
    ) -> None:
        self._listener = listener
        self._lock_fd = lock_fd  # held while this hub serves: the node's election
        self._path = path
        self._identity = address.identity
        self._store = store
        self._polling = polling
        self._stop = threading.Event()
        self._reads = self._pool(_READ_THREADS, "batchweave-node")
        self._logs = self._pool(MAX_PEERS, "batchweave-node-log")  # one log request per peer at a time
        self._cond = threading.Condition()
        self._log = SharedLog(read_ahead=random.randint(*NODE_READ_AHEAD))  # guarded by _cond
        self._ranges: OrderedDict[tuple[str, int, int], _Range] = OrderedDict()
        self._range_bytes = 0
        self._memfds = 0  # open shared-memory descriptors
        self._fd_budget = fd_budget()
        self._peers: set[_Peer] = set()  # greeted
        self._connections = 0  # accepted and not closed yet, greeted or not
        self._idents = itertools.count(1)
        self.users = 0  # this process's ranks using it
        self._warned: set[str] = set()
        threading.Thread(target=self._accept, name="batchweave-node-accept", daemon=True).start()

    def _pool(self, threads: int, name: str) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            threads,
            thread_name_prefix=name,
            initializer=retry.stop_retrying_when,  # closing does not wait out a storm
            initargs=(self._stop,),
        )

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)  # before the lock goes: a new hub's socket is never ours to remove
        os.close(self._lock_fd)
        with self._cond:
            peers = list(self._peers)
            self._cond.notify_all()
        for peer in peers:
            shut(peer.sock)
            peer.close()
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._logs.shutdown(wait=False, cancel_futures=True)
        with self._cond:
            for shared in list(self._ranges.values()):
                self._drop(shared)  # those being sent are closed by their last reply

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the hub's descriptors, so the
        hub's name, lock and connections go when the parent does (the child serves nothing)."""
        for closing in (self._listener, *(peer.sock for peer in self._peers)):
            with contextlib.suppress(OSError):
                closing.close()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            _logger.warning(message, *args)

    # -- connections ---------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                pid = check_peer(conn, "process connecting to the node hub")
            except (HubRefused, OSError) as exc:
                self._warn_once("peer", "node hub %s: %s", self._identity[:8], exc)
                conn.close()
                continue
            with self._cond:
                crowded = self._connections >= 2 * MAX_PEERS  # greeted or still greeting
                self._connections += 0 if crowded else 1
            if crowded:
                conn.close()
                continue
            bound(conn, IO_S)
            peer = self._peer(conn, pid)
            threading.Thread(target=self._serve, args=(peer,), name="batchweave-node-conn", daemon=True).start()

    def _peer(self, conn: socket.socket, pid: int) -> _Peer:
        def sent(reply: Reply) -> None:
            self._answered(peer, reply.header, reply.done)

        def broken() -> None:
            peer.close()
            shut(conn)  # the reader sees it too and cleans up

        peer = _Peer(conn, next(self._idents), pid, Outbox(conn, sent, broken))
        return peer

    def _serve(self, peer: _Peer) -> None:
        """One peer's requests, read once it proved itself, as fast as its replies are
        taken: ranges are answered from here (a range read already, or being read, needs
        no thread of its own), log requests on the log pool (they wait)."""
        writer = threading.Thread(target=peer.outbox.run, name="batchweave-node-send", daemon=True)
        writer.start()
        try:
            if self._greet(peer):
                while self._dispatch(peer, self._next_request(peer)):
                    pass
        except (HubLost, OSError, RuntimeError):
            pass  # the rank closed or died (RuntimeError: a pool is shutting down)
        except BadRequest as exc:
            self._warn_once("request", "node hub %s: process %d: %s; dropped", self._identity[:8], peer.pid, exc)
            peer.reply(exc.ident, {"refused": str(exc)})
        finally:
            with self._cond:  # closed under the hub's lock too: a log request checks it there
                peer.close()
                self._peers.discard(peer)
                self._connections -= 1
                self._log.leave(peer.ident)
                self._cond.notify_all()
            peer.outbox.end()  # the writer sends what is owed (if it can), then closes

    def _greet(self, peer: _Peer) -> bool:
        """The handshake: the same protocol and hub identity, and room for one more."""
        head, _, fds = recv(peer.sock, REQUEST_LIMITS, idle=lambda: False)  # within IO_S of connecting
        _close_all(fds)
        hello = parse_request(head)
        refused = ""
        if not isinstance(hello, Hello) or hello.protocol != PROTOCOL or hello.identity != self._identity:
            refused = "another protocol, job or store: this hub serves none of them"
        with self._cond:
            if not refused and len(self._peers) >= MAX_PEERS:
                refused = f"this hub serves {MAX_PEERS} connections already"
            if not refused:
                self._peers.add(peer)
        if refused:
            peer.reply(-1, {"refused": refused})
            return False
        peer.reply(-1, {"op": "hello", "protocol": PROTOCOL, "identity": self._identity})
        return True

    def _serving(self) -> bool:
        return not self._stop.is_set()

    def _next_request(self, peer: _Peer) -> LogRequest | RangeRequest:
        head, _, fds = recv(peer.sock, REQUEST_LIMITS, idle=lambda: self._serving() and not peer.closed)
        _close_all(fds)  # a request carries no descriptor
        request = parse_request(head)
        if isinstance(request, Hello):
            raise BadRequest("a second handshake")
        return request

    def _dispatch(self, peer: _Peer, request: LogRequest | RangeRequest) -> bool:
        """Answer ``request`` once the peer has fewer than MAX_OUTSTANDING unanswered (the
        one request read meanwhile is all it can cost); False when the hub or the
        connection is closing. One acquisition of the peer's lock per request."""
        with peer.room:
            peer.room.wait_for(lambda: peer.outstanding < MAX_OUTSTANDING or not self._serving() or peer.closed)
            if not self._serving() or peer.closed:
                return False
            peer.outstanding += 1  # answered from here on, if only by a refusal
            if isinstance(request, LogRequest) and peer.log_busy:
                raise BadRequest("a log request while another is being answered", request.id)
            if isinstance(request, LogRequest):
                peer.log_busy = True
        if isinstance(request, LogRequest):
            self._logs.submit(self._answer_log, peer, request)
        else:
            self._ask_range(peer, request)
        return True

    def _answered(self, peer: _Peer, header: dict[str, Any], done: Callable[[], None] | None) -> None:
        if done is not None:
            done()
        if header.get("id", -1) >= 0:
            with peer.room:
                peer.outstanding -= 1
                if peer.outstanding == MAX_OUTSTANDING - 1:  # only then may its reader wait
                    peer.room.notify_all()

    # -- the log -------------------------------------------------------------------------

    def _answer_log(self, peer: _Peer, request: LogRequest) -> None:
        try:
            reply, payload = self._log_reply(peer, request.first)
        except Exception as exc:  # of any type: this rank reads on its own, the others go on
            reply, payload = {"alone": f"the node hub failed: {type(exc).__name__}: {exc}"}, b""
        with peer.room:
            peer.log_busy = False
        peer.reply(request.id, reply, payload)

    def _log_reply(self, peer: _Peer, first: int) -> tuple[dict[str, Any], bytes]:
        with self._cond:
            if peer.closed:
                return {"alone": "closed"}, b""  # asked, then gone: it must leave no place behind
            answer = self._log.ask(peer.ident, first)
            if answer == ALONE:
                return {"alone": "far from the node's follower"}, b""
            if answer == RESTART:
                self._start_follower(first)
            self._cond.notify_all()  # the follower may read on: this rank moved
            deadline = time.monotonic() + LOG_WAIT_S
            while (parts := self._log.versions_from(first, LOG_REPLY_BYTES)) is None:
                if self._log.failed:
                    return {"alone": "the node's follower failed"}, b""
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set() or peer.closed:
                    return {"sizes": [], "head": self._log.at_head}, b""
                self._cond.wait(remaining)
        return {"sizes": [len(p) for p in parts]}, b"".join(parts)

    def _start_follower(self, first: int) -> None:
        """Follow from ``first``: the node's own follower, proving its own view (no rank's
        anchor or claims: nothing a request says can make it fail)."""
        args = (self._log.generation, first)
        threading.Thread(target=self._follow, args=args, name="batchweave-node-follow", daemon=True).start()

    def _follow(self, generation: int, first: int) -> None:
        retry.stop_retrying_when(self._stop)
        if generation == 1 and self._stop.wait(self._polling.start_pause_s()):
            return  # the node's first follower starts with the job's others: spread their first requests
        if generation != self._log.generation:
            return  # replaced while it paused (a rank asked from lower down): not one request
        journal = Journal(self._store, read_only=True)
        reader = log_reader(journal, first, DEFAULT_LOG_READ_AHEAD, self._polling, self._stop)
        if first == 1:
            reader.beside(journal.learn_namespace)
        proven = ProvenLog(journal, reader, self._polling, lambda: 0, self._store.url)
        try:
            for item in proven:
                if generation != self._log.generation:
                    return  # replaced by a follower started elsewhere: not one more request
                assert not isinstance(item, Unproven)  # early=False: proven versions only, in lists
                if isinstance(item, list):
                    if not self._publish(generation, item):
                        return
                    continue
                if item:
                    with self._cond:
                        self._log.missed(generation)
                        self._cond.notify_all()
                if self._stop.wait(item) if item else self._stop.is_set():
                    return
        except Exception as exc:  # of any type: its ranks read on their own, and find out themselves
            _logger.info("node hub %s: the log follower from version %d stopped: %s", self._identity[:8], first, exc)
            with self._cond:
                self._log.fail(generation, exc)
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

    def _ask_range(self, peer: _Peer, request: RangeRequest) -> None:
        """Answer with the range's shared memory: at once when it was read already, else
        once the one read of it for the node (started by the first rank asking) is done."""
        try:
            keys.check_data_key(request.key, "node hub request")
        except CorruptDataError as exc:
            raise BadRequest(str(exc), request.id) from None
        key = (request.key, request.start, request.length)
        with self._cond:
            shared = self._ranges.get(key)
            fetch = shared is None
            if shared is None:
                shared = self._ranges[key] = _Range(key, sharers=request.sharers)
            shared.in_flight += 1  # its descriptor stays open until this reply is sent
            ready = shared.done
            if not ready:
                shared.waiters.append((peer, request.id))
        if fetch:
            self._reads.submit(self._fill, shared)
        if ready:
            self._hand(shared, peer, request.id)

    def _fill(self, shared: _Range) -> None:
        """Read the range once, into shared memory, and answer every rank waiting for it."""
        try:
            data = self._store.get_range(*shared.key)
        except StoreError as exc:
            shared.error = error_reply(exc)  # the rank raises it as it would reading itself
        except Exception as exc:  # the hub's own failure: the rank reads it itself
            shared.error = {"direct": f"the hub's read failed: {type(exc).__name__}: {exc}"}
        else:
            self._share(shared, data)
        with self._cond:
            if shared.error is None:
                self._range_bytes += shared.length
            elif self._ranges.get(shared.key) is shared:
                del self._ranges[shared.key]  # a later request reads again
            shared.done = True
            waiters, shared.waiters = shared.waiters, []
        for peer, ident in waiters:
            self._hand(shared, peer, ident)

    def _share(self, shared: _Range, data: memoryview) -> None:
        """Put a range read into shared memory, within the descriptor budget; past it (or
        when the kernel refuses), its ranks read it themselves."""
        with self._cond:
            self._evict(lambda: self._memfds >= self._fd_budget)
            over = self._memfds >= self._fd_budget
            if not over:
                self._memfds += 1  # taken now: two fills never both take the last one
        if over:
            shared.error = {"direct": f"the hub's {self._fd_budget} shared-memory descriptors are in use"}
            self._warn_once(
                "fds", "node hub %s: %s; ranks read such ranges themselves", self._identity[:8], shared.error["direct"]
            )
            return
        try:
            shared.fd, shared.length = shared_memory(data), len(data)
        except OSError as exc:
            with self._cond:
                self._memfds -= 1
            shared.error = {"direct": f"no shared memory: {exc}"}
            self._warn_once("memfd", "node hub %s: %s; ranks read such ranges themselves", self._identity[:8], exc)

    def _hand(self, shared: _Range, peer: _Peer, ident: int) -> None:
        def done() -> None:
            self._handed(shared)

        if shared.error is not None:
            peer.reply(ident, dict(shared.error), done=done)
        else:
            instead = {"direct": _FDS_IN_FLIGHT}  # the rank reads it itself: its connection lives on
            peer.reply(ident, {"length": shared.length}, fds=[shared.fd], done=done, instead=instead)

    def _handed(self, shared: _Range) -> None:
        """One more reply sent (or dropped): drop the range once every sharer has it, or
        old ones past the cache's size. A descriptor is closed only when no reply is
        being sent with it."""
        with self._cond:
            shared.in_flight -= 1
            shared.handed += 1
            if shared.handed >= shared.sharers or self._stop.is_set():
                self._drop(shared)
            self._evict(lambda: self._range_bytes > CACHE_BYTES)
            if self._ranges.get(shared.key) is not shared and shared.in_flight == 0:
                self._close_fd(shared)  # dropped while this reply was on its way

    def _evict(self, over: Callable[[], bool]) -> None:
        """Drop the oldest ranges read while ``over()`` (a rank that asks later reads again)."""
        if not over():
            return  # the usual case, on every reply: no copy of the cache's index
        for oldest in list(self._ranges.values()):
            if not over():
                return
            if oldest.done:
                self._drop(oldest)

    def _drop(self, shared: _Range) -> None:
        """Out of the cache now; its descriptor closed once no reply uses it."""
        if self._ranges.get(shared.key) is shared:
            del self._ranges[shared.key]
            self._range_bytes -= shared.length
        if shared.in_flight == 0:
            self._close_fd(shared)

    def _close_fd(self, shared: _Range) -> None:
        if shared.fd >= 0:
            os.close(shared.fd)
            shared.fd = -1
            self._memfds -= 1


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# -- hubs of this process ------------------------------------------------------------------

_hubs: dict[str, _Hub] = {}
_hubs_lock = threading.Lock()


def start_hub(address: HubAddress, store: Store, polling: HeadPolling) -> bool:
    """Serve ``address`` from this process if no process does; True when this one does.
    The hub is whoever holds the lock beside the socket: the kernel releases it when
    its process dies, whatever was left behind. HubRefused when the directory cannot be
    trusted."""
    path, lock_path = address.paths()
    with _hubs_lock:
        if address.identity in _hubs:
            return True
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            return False  # another process serves it (or is about to)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead hub's socket
            listener.bind(path)
            listener.listen(MAX_PEERS)
        except OSError:
            listener.close()
            os.close(lock_fd)
            raise
        _hubs[address.identity] = _Hub(listener, lock_fd, path, address, store, polling)
        _logger.info("serving node hub %s from process %d", address.identity[:8], os.getpid())
        return True


def use_hub(address: HubAddress, delta: int) -> None:
    """Count this process's ranks using its hub; the last one out closes it (the others
    on the node take over)."""
    with _hubs_lock:
        hub = _hubs.get(address.identity)
        if hub is None:
            return
        hub.users += delta
        if hub.users <= 0:
            del _hubs[address.identity]
            hub.close()


def _forget_hubs_in_child() -> None:
    """A forked child (a DataLoader worker) holds none of its parent's hubs."""
    global _hubs_lock
    _hubs_lock = threading.Lock()  # another thread may have held it at the fork
    for hub in _hubs.values():
        hub.forget_in_child()
    _hubs.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_hubs_in_child)
