"""One rank's side of node sharing (``node``): its connection to the node's hub, through
which it follows the log and reads its slices, starting the hub or taking over when no
hub answers.

The rank trusts a hub only after checking it (``nodetrust``: the same user, by the
kernel's word; the same hub identity, by the handshake) and bounds every wait on it: a
reply not come within ``reply_timeout_s``, a hub lost and not replaced within
``TAKEOVER_S`` (counted from the first loss since the last reply, so a hub that accepts
and drops every connection cannot keep the rank trying), a hub refused, or shared memory
that is not what it should be: the rank reads on its own from then on, with one
WARNING, and never fails for it. A range the hub cannot share (``direct``) is read by
the rank itself, that once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import mmap
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import msgspec

from batchweave.errors import BatchWeaveError
from batchweave.reading.follower import FollowItem
from batchweave.reading.node import HubAddress
from batchweave.reading.nodehub import LOG_WAIT_S, start_hub, use_hub
from batchweave.reading.nodetrust import HubRefused, check_memory, check_peer
from batchweave.reading.nodewire import (
    IO_S,
    PROTOCOL,
    REPLY_LIMITS,
    Hello,
    HubLost,
    LogRequest,
    RangeRequest,
    bound,
    encode_request,
    log_versions,
    raise_reply,
    recv,
    send,
    shut,
)
from batchweave.reading.polling import HeadPolling
from batchweave.reading.sharedlog import NodeBehind, check_first
from batchweave.store import Store

__all__ = ["HUB_REPLY_S", "TAKEOVER_S", "NodeClient", "NodeUnavailableError"]

_logger = logging.getLogger(__name__)
TAKEOVER_S = 10.0  # how long a rank tries to reach or become the hub, after losing one, before reading alone
HUB_REPLY_S = 60.0  # the longest a rank waits for one reply (a range read by the hub, with its retries)

Reply = tuple[dict[str, Any], bytes, list[int]]


class NodeUnavailableError(BatchWeaveError):
    """No trustworthy hub could be reached; ``next_version`` is where the log stood. The
    rank reads on its own."""

    def __init__(self, why: str, next_version: int = 0) -> None:
        super().__init__(f"node hub: {why}; reading without it")
        self.why = why
        self.next_version = next_version


class NodeClient:
    """One rank's connection to its node's hub (starting it, or taking over, as needed).

    Args:
        address: ``node.node_address(...)``.
        store: the rank's store; the hub reads through it if this rank starts the hub.
        polling: the hub's head polling, if this rank starts it (followers = nodes).
        sharers: ranks of this node that read this rank's slice (itself included).
        reply_timeout_s: the longest wait for one reply (then the rank reads alone).
    """

    def __init__(
        self,
        address: HubAddress,
        store: Store,
        polling: HeadPolling,
        sharers: int,
        reply_timeout_s: float = HUB_REPLY_S,
    ) -> None:
        self._address = address
        self._store = store
        self._polling = polling
        self._sharers = sharers
        self._reply_timeout_s = reply_timeout_s
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self._sock: socket.socket | None = None
        self._pending: dict[int, Future[Reply]] = {}
        self._ids = itertools.count()
        self._hosting = False
        self._closed = False
        self._lost_at: float | None = None  # the first loss since the last reply: the takeover deadline's start
        self._unavailable: str | None = None  # why this rank reads on its own from now on
        self._warned_direct = False
        _clients.add(self)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            self._fail_pending()
        if sock is not None:
            shut(sock)
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
        NodeUnavailableError when no hub can be had, NodeBehind when this rank must read
        on its own for a while (the hub said so, or this rank's own check of its cursor's
        version failed), each with the next version."""
        version = first
        while not stop.is_set():
            try:
                reply, payload, _ = self._call(LogRequest(id=0, first=version), LOG_WAIT_S + self._reply_timeout_s)
                if "alone" in reply:
                    raise NodeBehind(version, str(reply["alone"]))
                if not reply["sizes"]:
                    if reply.get("head") and version <= present_through:
                        raise NodeBehind(version, "its cursor's log version is not in the node's view")
                    yield 0.001  # nothing new yet: the hub waited already
                    continue
                batch = log_versions(payload, reply["sizes"], version)
            except NodeUnavailableError as exc:
                raise NodeUnavailableError(exc.why, version) from None
            except (KeyError, TypeError, ValueError, HubLost) as exc:  # a reply not as the protocol says
                raise self._give_up(f"a malformed log reply ({type(exc).__name__}: {exc})", version) from None
            if version == first:
                check_first(batch, anchor)
            version += len(batch)
            yield batch

    def read(self, key: str, start: int, length: int) -> memoryview:
        """``length`` bytes of ``key`` from ``start``, read once for the node and mapped
        read-only here. Store errors are raised as the store would raise them;
        NodeUnavailableError means: read it yourself."""
        request = RangeRequest(id=0, key=key, start=start, length=length, sharers=self._sharers)
        reply, _, fds = self._call(request, self._reply_timeout_s)
        try:
            raise_reply(reply, self._store.url, lambda: 0)  # the store's error, as the store would raise it
            if "direct" in reply:
                self._warn_direct(str(reply["direct"]))
                raise NodeUnavailableError(str(reply["direct"]))
            return self._mapped(reply, fds, length)
        finally:
            for fd in fds:
                os.close(fd)

    def _mapped(self, reply: dict[str, Any], fds: list[int], length: int) -> memoryview:
        """The range's shared memory, mapped read-only once checked (``check_memory``)."""
        try:
            if reply["length"] != length or len(fds) != 1:
                raise HubRefused(f"the hub answered {reply['length']} bytes with {len(fds)} descriptors for {length}")
            if length == 0:
                return memoryview(b"")
            check_memory(fds[0], length)
            return memoryview(mmap.mmap(fds[0], length, prot=mmap.PROT_READ))
        except (HubRefused, KeyError, TypeError, ValueError, OSError) as exc:
            raise self._give_up(f"a reply that cannot be trusted: {exc}") from None

    def _call(self, request: LogRequest | RangeRequest, timeout_s: float) -> Reply:
        """Send ``request`` and wait for its reply, across hub changes (requests are
        idempotent: versions and ranges never change), within the deadlines."""
        while True:
            future: Future[Reply] = Future()
            sock = self._connection()
            try:
                with self._lock:
                    ident = next(self._ids)
                    self._pending[ident] = future
                    send(sock, encode_request(_with_id(request, ident)))
                reply = future.result(timeout_s)
            except FutureTimeout:
                raise self._give_up(f"no reply within {timeout_s:.0f} s (the hub is stalled)") from None
            except (HubLost, OSError):
                self._lost(sock)  # the hub died or closed: reach (or become) the next one
                continue
            if "refused" in reply[0]:
                raise self._give_up(f"the hub refused a request: {reply[0]['refused']}")
            self._lost_at = None  # the hub works: a later loss gets a whole takeover deadline
            return reply

    def _connection(self) -> socket.socket:
        """The live connection, or a new one (to a hub this rank starts if none answers).
        One thread connects at a time: the others then use its connection."""
        with self._connecting:
            with self._lock:
                if self._sock is not None:
                    return self._sock
            sock = self._connect()
            with self._lock:
                self._sock = sock
            threading.Thread(target=self._receive, args=(sock,), name="batchweave-node-recv", daemon=True).start()
            return sock

    def _connect(self) -> socket.socket:
        pause = 0.001
        while True:
            if self._closed or self._unavailable is not None:
                raise NodeUnavailableError(self._unavailable or "closed")
            # Read once: another thread's reply on the old connection clears it at any time
            # (its hub works); this attempt then keeps the deadline it started with.
            lost_at = self._lost_at
            if lost_at is None:
                lost_at = self._lost_at = time.monotonic()  # cleared by the first reply
            try:
                path, _ = self._address.paths()
                sock = self._greet(path)
                if sock is not None:
                    return sock
                if not self._hosting and start_hub(self._address, self._store, self._polling):
                    self._hosting = True
                    use_hub(self._address, +1)
                    continue
            except HubRefused as exc:
                raise self._give_up(str(exc)) from None
            if time.monotonic() - lost_at > TAKEOVER_S:
                raise self._give_up(f"unreachable for {TAKEOVER_S:.0f} s")
            time.sleep(pause)  # a hub takes its lock before it listens: a moment
            pause = min(0.1, pause * 2)

    def _greet(self, path: str) -> socket.socket | None:
        """A connection to the hub at ``path``, checked (its user, then the handshake); None
        when nothing listens there. HubRefused when something does that must not be trusted."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound(sock, IO_S)
        try:
            sock.connect(path)
            check_peer(sock, "node hub")
            send(sock, encode_request(Hello(protocol=PROTOCOL, identity=self._address.identity)))
            head, _, fds = recv(sock, REPLY_LIMITS, idle=lambda: False)
            for fd in fds:
                os.close(fd)
            hello = _json(head)
        except HubRefused:
            sock.close()
            raise
        except ValueError:
            sock.close()
            raise HubRefused("the process serving the hub's socket is not a hub of this job") from None
        except (HubLost, OSError):
            sock.close()
            return None  # nobody listens (yet), or the hub went away: take over or wait
        if hello.get("protocol") != PROTOCOL or hello.get("identity") != self._address.identity:
            sock.close()
            raise HubRefused(f"the hub refused this rank: {hello.get('refused', 'another job or store')}")
        return sock

    def _receive(self, sock: socket.socket) -> None:
        try:
            while True:
                head, payload, fds = recv(sock, REPLY_LIMITS, idle=lambda: not self._closed)
                reply = _json(head)
                with self._lock:
                    future = self._pending.pop(reply.pop("id", -1), None)
                if future is None:
                    for fd in fds:
                        os.close(fd)
                    continue
                future.set_result((reply, payload, fds))
        except (HubLost, OSError, ValueError, AttributeError):
            self._lost(sock)

    def _lost(self, sock: socket.socket | None) -> None:
        with self._lock:
            if sock is not None and self._sock is sock:
                self._sock = None
                self._fail_pending()
        if sock is not None:
            shut(sock)
            sock.close()

    def _give_up(self, why: str, next_version: int = 0) -> NodeUnavailableError:
        """This rank reads on its own from now on: say so once, drop the connection."""
        first = self._unavailable is None
        if first:
            self._unavailable = why
            _logger.warning("node hub %s: %s; this rank reads without it", self._address.identity[:8], why)
        with self._lock:
            sock, self._sock = self._sock, None
            self._fail_pending()
        if sock is not None:
            shut(sock)
            sock.close()
        return NodeUnavailableError(why, next_version)

    def _warn_direct(self, why: str) -> None:
        if not self._warned_direct:
            self._warned_direct = True
            _logger.warning("node hub %s: %s; this rank reads such ranges itself", self._address.identity[:8], why)

    def _fail_pending(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(HubLost())
        self._pending.clear()

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copy of the connection, so the hub sees
        the rank go when the rank's process does."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self._pending = {}
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self._hosting = False


def _with_id(request: LogRequest | RangeRequest, ident: int) -> LogRequest | RangeRequest:
    return msgspec.structs.replace(request, id=ident)


def _json(head: bytes) -> dict[str, Any]:
    value = json.loads(head)
    if not isinstance(value, dict):
        raise ValueError("a reply that is not an object")
    return value


_clients: weakref.WeakSet[NodeClient] = weakref.WeakSet()


def _forget_clients_in_child() -> None:
    for client in list(_clients):
        client.forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_clients_in_child)
