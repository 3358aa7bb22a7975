"""The wire between a node's hub and its ranks (``node``), over a Unix socket.

A message is ``u32 header length | u32 payload length | JSON header | payload``, never
pickled, with a range's descriptor attached to its reply (SCM_RIGHTS): an anonymous,
sealed shared-memory file (``memfd``) that the rank maps read-only. A store error
travels as a header the rank raises again as the same error; a log reply's payload is
its versions back to back, cut at the header's ``sizes``.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from batchweave.errors import (
    CorruptDataError,
    DataReclaimedError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from batchweave.log import ReadVersion
from batchweave.reading.sharedlog import decode_versions

__all__ = [
    "HubLost",
    "error_reply",
    "log_versions",
    "raise_reply",
    "recv",
    "send",
    "shared_memory",
]

_PREFIX = struct.Struct("<II")  # header length, payload length
_MAX_HEADER = 1 << 20


class HubLost(Exception):
    """The connection to the hub broke (its process died or closed): ask again."""


def send(
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


def recv(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]]:
    """One message; raises HubLost at the end of the stream."""
    prefix, fds, _, _ = socket.recv_fds(sock, _PREFIX.size, 1)
    if not prefix:
        raise HubLost
    prefix += _recv_exactly(sock, _PREFIX.size - len(prefix))
    head_length, payload_length = _PREFIX.unpack(prefix)
    if head_length > _MAX_HEADER:
        raise HubLost  # not our protocol
    header = json.loads(_recv_exactly(sock, head_length))
    return header, _recv_exactly(sock, payload_length), fds


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise HubLost
        got += k
    return bytes(buf)


def error_reply(exc: BaseException) -> dict[str, Any]:
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


def raise_reply(reply: dict[str, Any], url: str, next_step: Callable[[], int]) -> None:
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


def shared_memory(data: memoryview | bytes) -> int:
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


def log_versions(payload: bytes, sizes: list[int], first: int) -> list[ReadVersion]:
    """The versions of a log reply: ``payload`` cut at ``sizes``, numbered from ``first``."""
    view = memoryview(payload)
    ends = list(itertools.accumulate(sizes))
    return decode_versions([view[end - n : end] for end, n in zip(ends, sizes, strict=True)], first)
