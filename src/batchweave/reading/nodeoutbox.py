"""The replies a node's hub owes one connection (``nodehub``), sent in order without ever
holding up the thread that has one.

A reply goes out at once, from the thread that produced it, when nothing is queued or
being sent before it and the kernel says the socket has room (the usual case: a range's
reply is a small header and a descriptor), so it costs no hand-off between threads.
Otherwise it waits in the connection's queue for the connection's own writer thread,
the one thread that may wait for this peer: a peer that stops reading holds up only its
own writer, and once a send of the writer's has not moved for the socket's bound
(``nodewire.bound``: ``IO_S``) the connection is broken and every reply still owed is
released unsent. Each reply's ``done`` runs exactly once, sent or not (it closes a
range's shared memory in time).

A reply's descriptors may also be refused outright: the kernel counts every descriptor
sent and not yet received against the sending user's ``RLIMIT_NOFILE``, and past it
refuses any more (``ETOOMANYREFS``) on every socket of that user. Descriptors a peer
leaves unread stay in flight until it reads or closes (dropping its connection does not
take them back), so a few peers that stop reading can bring a hub there. Such a reply
goes out as its ``instead`` (the hub's: "read this range yourself"), without
descriptors, and the connection lives on.

Why the kernel is asked first (``POLLOUT``) rather than trusted with ``MSG_DONTWAIT``: a
descriptor sent (``SCM_RIGHTS``) to a Unix socket whose buffer is full waits out the
socket's send timeout on some kernels (6.18 here) even with ``MSG_DONTWAIT``; only a
plain send honours the flag. Sent under this outbox's lock, from a thread that answers
every rank of the node, that wait held the thread for ``IO_S`` and every other thread
with a reply for the same peer behind it (issue 43: the hub's read threads all waited on
one peer that read nothing, and the node's ranks stalled). ``POLLOUT`` is set while the
bytes the peer has not taken are at most a quarter of the socket's buffer, and a send
waits only once they fill all of it; only the thread holding the sending turn sends, so
nothing fills the buffer between the question and the send.
"""

from __future__ import annotations

import errno
import select
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
    """One reply: its framed header (what is left of it to send), payload and descriptors;
    ``instead``: the header to send when the kernel refuses its descriptors."""

    head: bytes
    payload: bytes
    fds: Sequence[int]
    header: dict[str, Any]
    done: Callable[[], None] | None
    instead: dict[str, Any] | None = None


class Outbox:
    """One connection's replies (see the module doc).

    Args:
        sock: the connection, bounded in the kernel (``nodewire.bound``).
        on_sent: runs once per reply, after it was sent or released unsent.
        on_broken: runs once, when a send failed (the peer is gone or stopped reading).
    """

    def __init__(self, sock: socket.socket, on_sent: Callable[[Reply], None], on_broken: Callable[[], None]) -> None:
        self._sock = sock
        self._room = select.poll()  # whether the socket has room (used under ``_cond`` only: one caller at a time)
        self._room.register(sock, select.POLLOUT)
        self._on_sent = on_sent
        self._on_broken = on_broken
        self._cond = threading.Condition()  # guards the fields below
        self._queue: deque[Reply] = deque()
        self._sending = False  # a thread is sending: nobody else may
        self._ending = False  # no more replies will be put: send what is owed, then stop
        self._finished = False  # the writer stopped: a reply put now is released unsent
        self.broken = False

    def put(
        self,
        header: dict[str, Any],
        payload: bytes = b"",
        fds: Sequence[int] = (),
        done: Any = None,
        instead: dict[str, Any] | None = None,
    ) -> None:
        """Send ``header`` (with ``payload`` and ``fds``) now if the socket has room for
        it, else queue it for the writer; never waits for the peer. ``instead`` goes
        out in its place, without descriptors, if the kernel refuses them."""
        reply = Reply(frame(header, len(payload)), payload, fds, header, done, instead)
        with self._cond:
            if self._finished or self.broken:
                outcome = "released"
            elif self._sending or self._queue or payload:  # a payload may be megabytes: the writer's
                self._queue.append(reply)
                self._cond.notify_all()
                return
            else:
                # Under the lock: the send never waits (only with room, and MSG_DONTWAIT),
                # and one acquisition a reply keeps the threads answering ranks from
                # queueing on this one.
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
            sent = _send_without_waiting(self._sock, self._room, reply)
        except OSError as exc:
            fallback = _without_descriptors(reply, exc)
            return "failed" if fallback is None else self._send_now(fallback)
        if sent == len(reply.head):
            return "sent"
        # The rest goes first, by the writer (the descriptors went with a first byte sent).
        rest = reply if not sent else Reply(reply.head[sent:], b"", (), reply.header, reply.done)
        self._queue.appendleft(rest)
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


def _send_without_waiting(sock: socket.socket, room: select.poll, reply: Reply) -> int:
    """Bytes of ``reply.head`` the socket took at once (0: none; its descriptors go with
    the first byte sent). Nothing is sent unless the kernel says there is room: a
    descriptor sent to a full socket waits however it is sent (the module doc)."""
    if not any(events & select.POLLOUT for _, events in room.poll(0)):
        return 0  # full, or broken (POLLHUP, POLLERR): the writer finds out which
    try:
        if reply.fds:
            return socket.send_fds(sock, [reply.head], list(reply.fds), socket.MSG_DONTWAIT)
        return sock.send(reply.head, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0


def _without_descriptors(reply: Reply, exc: OSError) -> Reply | None:
    """What to send instead of ``reply`` when sending it failed with ``exc`` (None: the
    connection is broken): its ``instead`` when the kernel refused its descriptors
    (none of its bytes went, the descriptors going with the first)."""
    if exc.errno != errno.ETOOMANYREFS or not reply.fds or reply.instead is None:
        return None
    return Reply(frame(reply.instead, 0), b"", (), reply.instead, reply.done)


def _send(sock: socket.socket, reply: Reply) -> None:
    """The whole reply (or its ``instead``), waiting for the peer as long as the socket's
    bound allows."""
    try:
        _send_whole(sock, reply)
    except OSError as exc:
        fallback = _without_descriptors(reply, exc)
        if fallback is None:
            raise
        _send_whole(sock, fallback)


def _send_whole(sock: socket.socket, reply: Reply) -> None:
    head = reply.head
    sent = socket.send_fds(sock, [head], list(reply.fds)) if reply.fds else sock.send(head)
    if sent < len(head):
        sock.sendall(head[sent:])
    if reply.payload:
        sock.sendall(reply.payload)
