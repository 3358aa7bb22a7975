"""A hub connection's outbox (``reading.nodeoutbox``): replies go out at once when the
socket takes them, in order through the writer when it does not, and each reply's
``done`` runs exactly once, sent or released; a failed send breaks the connection."""

from __future__ import annotations

import json
import socket
import threading

from batchweave.reading.nodeoutbox import Outbox, Reply
from batchweave.reading.nodewire import REPLY_LIMITS, bound, recv


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
