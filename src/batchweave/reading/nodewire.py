"""The wire between a node's hub and its ranks (``node``), over a Unix socket.

A message is ``u32 header length | u32 payload length | JSON header | payload``, never
pickled, with a range's descriptor attached to its reply (SCM_RIGHTS): an anonymous,
sealed shared-memory file (``memfd``) that the rank maps read-only. A store error
travels as a header the rank raises again as the same error; a log reply's payload is
its versions back to back, cut at the header's ``sizes``.

Every message is read within limits the reader sets (``Limits``): a peer announcing a
gigabyte costs nothing until it sends it, and the bytes are taken as they arrive. A
request is parsed strictly (``parse_request``): the hub acts on nothing it did not
validate. Both ends bound every socket to ``IO_S`` (``bound``): a peer may idle between messages for as
long as it likes, but a message started must arrive, and a reply sent must be taken,
within it, or the connection is dropped (its owner's loss alone).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from batchweave.decoding import DECODE_ERRORS
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
    "IO_S",
    "PROTOCOL",
    "REPLY_LIMITS",
    "REQUEST_LIMITS",
    "BadRequest",
    "Hello",
    "HubLost",
    "Limits",
    "LogRequest",
    "RangeRequest",
    "bound",
    "encode_request",
    "error_reply",
    "frame",
    "log_versions",
    "parse_request",
    "raise_reply",
    "recv",
    "send",
    "shared_memory",
    "shut",
    "unframe",
]

PROTOCOL = 2  # a hub and a rank of other protocols refuse each other at the handshake
# A started message must arrive, and a send must move, within this (both ends: ``bound``).
# A rank reads its replies on a thread of its own as they come (``nodeclient``), so a
# reply it has not begun to take for 10 s means a peer that stopped reading (or a process
# stopped): the hub drops it, which frees its writer thread and the replies (with their
# shared memory) queued for it; a rank that resumes reconnects. Long enough that a rank
# busy with the GIL or paging for a few seconds keeps its connection.
IO_S = 10.0
_PREFIX = struct.Struct("<II")  # header length, payload length
_CHUNK = 1 << 20  # a payload is read in pieces of at most this: memory follows the bytes sent


@dataclass(frozen=True, slots=True)
class Limits:
    """The largest message a reader accepts."""

    header: int
    payload: int


REQUEST_LIMITS = Limits(header=4096, payload=0)  # requests are small headers, nothing more
REPLY_LIMITS = Limits(header=1 << 20, payload=256 << 20)  # a log reply: 8 MiB of versions, one may be large


class HubLost(Exception):
    """The connection broke, stalled or spoke another protocol: its owner asks again elsewhere."""


class BadRequest(ValueError):
    """A request the hub refuses to act on; the message says why, ``ident`` which request
    (-1: none could be read)."""

    def __init__(self, problem: str, ident: int = -1) -> None:
        super().__init__(problem)
        self.ident = ident


_Id = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
_Version = Annotated[int, msgspec.Meta(ge=1, le=2**62)]
_Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**40)]


class Hello(msgspec.Struct, tag="hello", tag_field="op", frozen=True, forbid_unknown_fields=True):
    """A connection's first message, both ways: the protocol and the hub identity."""

    protocol: int
    identity: Annotated[str, msgspec.Meta(max_length=64)]


class LogRequest(msgspec.Struct, tag="log", tag_field="op", frozen=True, forbid_unknown_fields=True):
    """Proven log versions from ``first`` on."""

    id: _Id
    first: _Version = msgspec.field(name="from")


class RangeRequest(msgspec.Struct, tag="range", tag_field="op", frozen=True, forbid_unknown_fields=True):
    """``length`` bytes of object ``key`` from ``start``, for ``sharers`` ranks of the node."""

    id: _Id
    key: Annotated[str, msgspec.Meta(max_length=1024)]
    start: _Bytes
    length: _Bytes
    sharers: Annotated[int, msgspec.Meta(ge=1, le=1024)]


_requests = msgspec.json.Decoder(Hello | LogRequest | RangeRequest)


def parse_request(header: bytes) -> Hello | LogRequest | RangeRequest:
    """A request's header, validated; BadRequest for anything else."""
    try:
        return _requests.decode(header)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from None
    except DECODE_ERRORS as exc:  # a peer's bytes: invalid UTF-8 too, not only bad JSON
        raise BadRequest(f"not a request: {exc}") from None


def encode_request(request: Hello | LogRequest | RangeRequest) -> bytes:
    """A request's header, as ``parse_request`` reads it."""
    return msgspec.json.encode(request)


def bound(sock: socket.socket, seconds: float) -> None:
    """Bound every send and receive on ``sock`` to ``seconds``, in the kernel
    (SO_SNDTIMEO, SO_RCVTIMEO): the socket stays blocking, so a message costs no poll
    before each call (Python's own timeouts poll first), and a call that waits longer
    fails with EAGAIN."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def shut(sock: socket.socket) -> None:
    """End both directions of a connection now (its threads see the end), whoever holds it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def send(
    sock: socket.socket,
    header: dict[str, Any] | bytes,
    payload: bytes | memoryview = b"",
    fds: Sequence[int] = (),
) -> None:
    """One message (the socket's bound limits it: ``IO_S``)."""
    first = frame(header, len(payload))
    sent = socket.send_fds(sock, [first], list(fds)) if fds else sock.send(first)
    if sent < len(first):
        sock.sendall(first[sent:])
    if payload:
        sock.sendall(payload)


def frame(header: dict[str, Any] | bytes, payload_length: int) -> bytes:
    """A message's prefix and header, ready to send before its payload."""
    head = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(len(head), payload_length) + head


def unframe(message: bytes, limits: Limits) -> tuple[bytes, bytes]:
    """A whole message's header and payload (``frame`` and its payload, as ``recv`` reads
    them off a socket); HubLost past ``limits`` or when the lengths do not cut it."""
    if len(message) < _PREFIX.size:
        raise HubLost(f"a message of {len(message)} bytes, shorter than its prefix")
    head_length, payload_length = _PREFIX.unpack_from(message)
    if head_length > limits.header or payload_length > limits.payload:
        raise HubLost(f"a message of {head_length} + {payload_length} bytes, over the limit")
    if _PREFIX.size + head_length + payload_length != len(message):
        raise HubLost(f"a message whose lengths ({head_length} + {payload_length}) do not cut its {len(message)} bytes")
    body = message[_PREFIX.size :]
    return body[:head_length], body[head_length:]


def recv(
    sock: socket.socket, limits: Limits, *, idle: Callable[[], bool] = lambda: True
) -> tuple[bytes, bytes, list[int]]:
    """One message's header (raw), payload and descriptors (at most one). Raises HubLost at
    the end of the stream, past ``limits``, or when a started message stalls for the
    socket's timeout; between messages, a timeout waits on while ``idle()`` says so."""
    prefix, fds = _first_bytes(sock, idle)
    try:
        prefix += _recv_exactly(sock, _PREFIX.size - len(prefix))
        head_length, payload_length = _PREFIX.unpack(prefix)
        if head_length > limits.header or payload_length > limits.payload:
            raise HubLost(f"a message of {head_length} + {payload_length} bytes, over the limit")
        return _recv_exactly(sock, head_length), _recv_exactly(sock, payload_length), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # an int: the enum's & costs a microsecond a message


def _first_bytes(sock: socket.socket, idle: Callable[[], bool]) -> tuple[bytes, list[int]]:
    while True:
        try:
            prefix, fds, flags, _ = socket.recv_fds(sock, _PREFIX.size, 1)
        except (TimeoutError, BlockingIOError):  # a timeout: Python's, or the kernel's (``bound``)
            if idle():
                continue
            raise HubLost("closing") from None
        except OSError as exc:
            raise HubLost(str(exc)) from None
        if flags & _MSG_CTRUNC:  # more descriptors than one: the kernel closed the rest
            for fd in fds:
                os.close(fd)
            raise HubLost("a message with more than one descriptor")
        if not prefix:
            for fd in fds:
                os.close(fd)
            raise HubLost("closed")
        return prefix, fds


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, taken as they arrive (never allocated ahead of them)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            part = sock.recv(min(n - got, _CHUNK))
        except OSError as exc:  # timeouts included (BlockingIOError from ``bound``): a started message stalled
            raise HubLost(str(exc) or type(exc).__name__) from None
        if not part:
            raise HubLost("closed mid-message")
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def error_reply(exc: BaseException) -> dict[str, Any]:
    """What a rank needs to raise the same store error itself."""
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
        raise DataReclaimedError(url, next_step(), int(reply["oldest"]))
    if kind == "corrupt":
        raise CorruptDataError(str(reply["key"]), str(reply["problem"]))
    if kind == "missing":
        raise ObjectNotFoundError(str(reply["key"]), str(reply["problem"]))
    if kind == "transient":
        raise TransientStoreError(str(reply["key"]), str(reply["problem"]))
    raise StoreError(str(reply["key"]), str(reply["problem"]))


def shared_memory(data: memoryview | bytes) -> int:
    """An anonymous, sealed (read-only for good) shared-memory file holding ``data``."""
    fd = os.memfd_create("batchweave-slice", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        import fcntl  # Linux only, like memfd

        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def log_versions(payload: bytes, sizes: list[int], first: int) -> list[ReadVersion]:
    """The versions of a log reply: ``payload`` cut at ``sizes``, numbered from ``first``."""
    if any(not isinstance(n, int) or n <= 0 for n in sizes) or sum(sizes) != len(payload):
        raise HubLost(f"a log reply whose sizes do not cut its {len(payload)} bytes")
    view = memoryview(payload)
    ends = list(itertools.accumulate(sizes))
    return decode_versions([view[end - n : end] for end, n in zip(ends, sizes, strict=True)], first)
