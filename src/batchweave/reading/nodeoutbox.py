"""The replies a node's hub owes one connection (``nodehub``), sent in order without ever
holding up the thread that has one.

A reply goes out at once, from the thread that produced it, when nothing is queued or
being sent before it and the socket takes it without waiting (the usual case: a range's
reply is a small header and a descriptor), so it costs no hand-off between threads.
Otherwise it waits in the connection's queue for the connection's own writer thread,
which waits for the peer at most as long as the socket allows (``nodewire.bound``): a
peer that stops reading holds up only its own writer, and once a reply could not be sent
the connection is broken and every reply still owed is released unsent. Each reply's
``done`` runs exactly once, sent or not (it closes a range's shared memory in time).
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchweave.reading.nodewire import frame

__all__ = ["Outbox", "Reply"]


@dataclass(slots=True)
class Reply:
    """One reply: its framed header (what is left of it to send), payload and descriptors."""

    head: bytes
    payload: bytes
    fds: Sequence[int]
    header: dict[str, Any]
    done: Callable[[], None] | None


class Outbox:
    """One connection's replies (see the module doc).

    Args:
        sock: the connection, bounded in the kernel (``nodewire.bound``).
        on_sent: runs once per reply, after it was sent or released unsent.
        on_broken: runs once, when a send failed (the peer is gone or stopped reading).
    """

    def __init__(self, sock: socket.socket, on_sent: Callable[[Reply], None], on_broken: Callable[[], None]) -> None:
        self._sock = sock
        self._on_sent = on_sent
        self._on_broken = on_broken
        self._cond = threading.Condition()  # guards the fields below
        self._queue: deque[Reply] = deque()
        self._sending = False  # a thread is sending: nobody else may
        self._ending = False  # no more replies will be put: send what is owed, then stop
        self._finished = False  # the writer stopped: a reply put now is released unsent
        self.broken = False

    def put(self, header: dict[str, Any], payload: bytes = b"", fds: Sequence[int] = (), done: Any = None) -> None:
        """Send ``header`` (with ``payload`` and ``fds``) now if the socket takes it at
        once, else queue it for the writer; never waits for the peer."""
        reply = Reply(frame(header, len(payload)), payload, fds, header, done)
        with self._cond:
            if self._finished or self.broken:
                outcome = "released"
            elif self._sending or self._queue or payload:  # a payload may be megabytes: the writer's
                self._queue.append(reply)
                self._cond.notify_all()
                return
            else:
                # Under the lock: the send never waits (MSG_DONTWAIT), and one acquisition
                # a reply keeps the threads answering ranks from queueing on this one.
                outcome = self._send_now(reply)
        if outcome == "failed":
            self._break()
        if outcome != "queued":
            self._on_sent(reply)  # sent, or released unsent

    def _send_now(self, reply: Reply) -> str:
        """Under ``_cond``: send what the socket takes at once and queue the rest for the
        writer (only then is the writer woken: a thread woken for nothing costs the
        others the GIL). "sent", "queued" or "failed"."""
        try:
            sent = _send_without_waiting(self._sock, reply)
        except OSError:
            return "failed"
        if sent == len(reply.head):
            return "sent"
        # The rest goes first, by the writer (the descriptors went with a first byte sent).
        self._queue.appendleft(Reply(reply.head[sent:], b"", () if sent else reply.fds, reply.header, reply.done))
        self._cond.notify_all()
        return "queued"

    def end(self) -> None:
        """No more replies will be put: the writer sends what is owed and stops."""
        with self._cond:
            self._ending = True
            self._cond.notify_all()

    def run(self) -> None:
        """The writer thread: send what is queued, in order, until ``end`` and empty;
        then close the socket."""
        while (reply := self._next()) is not None:
            try:
                if not self.broken:
                    _send(self._sock, reply)
            except OSError:
                self._break()
            finally:
                with self._cond:
                    self._sending = False  # the writer is the only thread that waits on the condition
                self._on_sent(reply)
        self._sock.close()

    def _next(self) -> Reply | None:
        with self._cond:
            self._cond.wait_for(lambda: not self._sending and (self._queue or self._ending))
            if not self._queue:
                self._finished = True
                return None
            self._sending = True
            return self._queue.popleft()

    def _break(self) -> None:
        with self._cond:
            first = not self.broken
            self.broken = True
        if first:
            self._on_broken()


def _send_without_waiting(sock: socket.socket, reply: Reply) -> int:
    """Bytes of ``reply.head`` the socket took at once (0: none; its descriptors go with
    the first byte sent)."""
    try:
        if reply.fds:
            return socket.send_fds(sock, [reply.head], list(reply.fds), socket.MSG_DONTWAIT)
        return sock.send(reply.head, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0


def _send(sock: socket.socket, reply: Reply) -> None:
    """The whole reply, waiting for the peer as long as the socket's bound allows."""
    head = reply.head
    sent = socket.send_fds(sock, [head], list(reply.fds)) if reply.fds else sock.send(head)
    if sent < len(head):
        sock.sendall(head[sent:])
    if reply.payload:
        sock.sendall(reply.payload)
