"""A hub connection's outbox (``reading.nodeoutbox``): replies go out at once when the
socket has room, in order through the writer when it has not, and each reply's ``done``
runs exactly once, sent or released; a failed send breaks the connection, a refused
descriptor sends the reply's ``instead``."""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time

from batchweave.reading import nodeoutbox
from batchweave.reading.nodeoutbox import Outbox, Reply
from batchweave.reading.nodewire import REPLY_LIMITS, bound, recv, shared_memory


class Recorder:
    def __init__(self) -> None:
        self.sent: list[int] = []
        self.broken = threading.Event()
        self.lock = threading.Lock()

    def on_sent(self, reply: Reply) -> None:
        with self.lock:
            self.sent.append(reply.header["n"])

    def on_broken(self) -> None:
        self.broken.set()


def pair(send_buffer: int | None = None):
    hub, rank = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if send_buffer is not None:
        hub.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    bound(hub, 5.0)
    bound(rank, 5.0)
    return hub, rank


def received(rank: socket.socket, count: int) -> list[int]:
    return [json.loads(recv(rank, REPLY_LIMITS)[0])["n"] for _ in range(count)]


def test_a_reply_the_socket_takes_goes_out_at_once_without_the_writer():
    hub, rank = pair()
    record = Recorder()
    outbox = Outbox(hub, record.on_sent, record.on_broken)  # no writer thread started
    for n in range(5):
        outbox.put({"n": n})
    assert record.sent == [0, 1, 2, 3, 4]  # done at once, by the putting thread
    assert received(rank, 5) == [0, 1, 2, 3, 4]
    hub.close()
    rank.close()


def test_replies_the_socket_cannot_take_wait_for_the_writer_in_order():
    hub, rank = pair(send_buffer=4096)
    record = Recorder()
    outbox = Outbox(hub, record.on_sent, record.on_broken)
    writer = threading.Thread(target=outbox.run, daemon=True)
    writer.start()
    count = 2_000  # far more than a 4 KiB buffer holds while nobody reads
    for n in range(count):
        outbox.put({"n": n, "pad": "x" * 64})
    assert len(record.sent) < count  # some waited for the writer
    assert received(rank, count) == list(range(count))
    outbox.end()
    writer.join(10)
    assert not writer.is_alive()
    assert sorted(record.sent) == list(range(count)) and not record.broken.is_set()
    rank.close()


def test_a_send_that_fails_breaks_the_connection_and_releases_every_reply_once():
    hub, rank = pair()
    rank.close()  # the peer is gone: the next send fails
    record = Recorder()
    outbox = Outbox(hub, record.on_sent, record.on_broken)
    writer = threading.Thread(target=outbox.run, daemon=True)
    writer.start()
    for n in range(3):
        outbox.put({"n": n})
    assert record.broken.is_set() and outbox.broken
    outbox.end()
    writer.join(10)
    assert sorted(record.sent) == [0, 1, 2]  # released unsent, each once


def fill(sock: socket.socket) -> int:
    """Bytes sent until ``sock`` takes no more (nobody reads the other end)."""
    filled = 0
    while True:
        try:
            filled += sock.send(b"x" * 512, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return filled


def take_raw(sock: socket.socket, count: int) -> None:
    while count:
        count -= len(sock.recv(min(count, 1 << 16)))


def test_a_descriptor_for_a_full_socket_never_holds_up_the_thread_that_has_it():
    """Regression (issue 43): on this kernel a descriptor sent to a full Unix socket waits
    out the socket's bound even with MSG_DONTWAIT. Sent at once, under the outbox's lock,
    it held the hub's thread for that bound (5 s here) and every other thread with a
    reply for that peer behind it. It waits for the writer instead."""
    hub, rank = pair(send_buffer=8192)
    record = Recorder()
    outbox = Outbox(hub, record.on_sent, record.on_broken)
    filled = fill(hub)
    memory = shared_memory(b"slice")
    try:
        began = time.monotonic()
        outbox.put({"n": 1, "length": 5}, fds=[memory])
        assert time.monotonic() - began < 1.0  # not the socket's 5 s
        assert record.sent == []  # queued: the writer owes it
        writer = threading.Thread(target=outbox.run, daemon=True)
        writer.start()
        take_raw(rank, filled)  # the peer reads again
        head, _, fds = recv(rank, REPLY_LIMITS)
        assert json.loads(head)["n"] == 1 and len(fds) == 1 and os.pread(fds[0], 5, 0) == b"slice"
        os.close(fds[0])
        outbox.end()
        writer.join(10)
        assert record.sent == [1] and not record.broken.is_set()
    finally:
        os.close(memory)
        rank.close()


def test_descriptors_the_kernel_refuses_send_the_replys_instead_and_the_connection_lives(monkeypatch):
    """The user's descriptors in flight at RLIMIT_NOFILE (peers that leave replies unread
    hold theirs): every descriptor sent fails with ETOOMANYREFS. The rank gets the reply's
    ``instead`` (read it yourself), at once or through the writer, and keeps its
    connection."""

    def refused(*args, **kwargs):
        raise OSError(errno.ETOOMANYREFS, "Too many references")

    monkeypatch.setattr(nodeoutbox.socket, "send_fds", refused)
    hub, rank = pair(send_buffer=8192)
    record = Recorder()
    outbox = Outbox(hub, record.on_sent, record.on_broken)
    outbox.put({"n": 1, "length": 5}, fds=[0], instead={"n": 1, "direct": "refused"})  # at once
    filled = fill(hub)
    outbox.put({"n": 2, "length": 5}, fds=[0], instead={"n": 2, "direct": "refused"})  # through the writer
    writer = threading.Thread(target=outbox.run, daemon=True)
    writer.start()
    first = recv(rank, REPLY_LIMITS)
    take_raw(rank, filled)
    second = recv(rank, REPLY_LIMITS)
    assert [json.loads(head) for head, _, _ in (first, second)] == [
        {"n": 1, "direct": "refused"},
        {"n": 2, "direct": "refused"},
    ]
    assert first[2] == second[2] == []
    outbox.end()
    writer.join(10)
    assert record.sent == [1, 2] and not record.broken.is_set()
    rank.close()
