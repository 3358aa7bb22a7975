"""An HTTP/1.1 reverse proxy on 127.0.0.1 in front of a real object-store server: it
applies ``batchweave.latency.LatencyModel`` at the wire, counts what passes, and can
answer every request with a real S3 error for a while (a throttling storm).

Why a proxy: MosaicML Streaming talks to S3 through boto3 and cannot use the in-process
``LatencyStore``; putting the latency between every client and the S3 server charges
BatchWeave (obstore/reqwest), the raw baselines and Streaming (boto3/urllib3) alike, and
the counters measure every system's requests and bytes fetched the same way (``bench
consumers``). For faults, the same reason: a storm the proxy answers is seen by obstore's
own retries as real HTTP errors, then by BatchWeave's, in every process that talks
through it (a producer in a child process too), which no in-process fake can show.

Per request, as ``LatencyStore`` models it: the fixed time of its kind (GET first byte,
PUT, HEAD, LIST, DELETE) times a log-normal jitter factor before the response head is
passed on, then the response body paced at the model's bandwidth per connection.
``model=None`` passes everything at once and only counts. ``storm(duration_s)`` answers
every request that arrives in the next ``duration_s`` seconds with ``503 SlowDown`` and
S3's XML error body (or another status and code) without forwarding it, and records
when each arrived (``storm_arrivals()``), so a test can see the clients back off.

The proxy understands HTTP/1.1 framing in both directions (Content-Length, chunked,
read-to-close responses, interim 1xx answers) and keeps connections alive: each client
connection gets its own upstream connection, so per-connection bandwidth is per client
connection. ``Expect: 100-continue`` is answered by the proxy itself (SigV4 does not
sign that header), so a client never waits for the server's go-ahead through the delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from batchweave.latency import LatencyModel

__all__ = ["LatencyProxy", "ProxyCounters"]

_CHUNK = 256 * 1024
_HEAD_LIMIT = 64 * 1024
_NO_BODY_STATUS = (204, 304)

#: Seconds to wait after ``n`` more body bytes, so a body flows at the model's bandwidth.
_Pace = Callable[[int], float]
#: Counts ``n`` body bytes as they pass.
_Tally = Callable[[int], None]


@dataclass(slots=True)
class ProxyCounters:
    """Requests and response-body bytes by HTTP method, plus request-body bytes, and the
    GETs of a byte range among the requests (a consumer's slice reads)."""

    requests: dict[str, int] = field(default_factory=dict)
    response_bytes: dict[str, int] = field(default_factory=dict)
    request_bytes: dict[str, int] = field(default_factory=dict)
    range_gets: int = 0

    def copy(self) -> ProxyCounters:
        return ProxyCounters(dict(self.requests), dict(self.response_bytes), dict(self.request_bytes), self.range_gets)

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def get_bytes(self) -> int:
        """Bytes fetched from the store: GET response bodies (the read amplification's numerator)."""
        return self.response_bytes.get("GET", 0)


@dataclass(slots=True)
class _Message:
    """A parsed request or response head; ``raw`` is forwarded as it came (minus Expect)."""

    first_line: str
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def encode(self, drop: tuple[str, ...] = ()) -> bytes:
        kept = [f"{k}: {v}" for k, v in self.headers if k.lower() not in drop]
        return ("\r\n".join([self.first_line, *kept]) + "\r\n\r\n").encode("latin-1")


class LatencyProxy:
    """Start with ``start()`` (or ``with``): serves on a background thread's event loop;
    ``endpoint`` is then ``http://127.0.0.1:PORT``. ``counters()`` and ``reset()`` are
    safe to call from any thread."""

    def __init__(self, upstream: str, model: LatencyModel | None = None, *, seed: int | None = None) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the proxy forwards plain http:// only, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.model = model
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._counters = ProxyCounters()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self.endpoint = ""
        self._storm: _Storm | None = None
        self._storm_arrivals: list[float] = []

    # -- control (any thread) --------------------------------------------------------

    def start(self) -> LatencyProxy:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="latency-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10) or self._server is None:
            raise RuntimeError("latency proxy did not start")
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def counters(self) -> ProxyCounters:
        with self._lock:
            return self._counters.copy()

    def reset(self) -> None:
        with self._lock:
            self._counters = ProxyCounters()

    def storm(
        self,
        duration_s: float,
        *,
        status: int = 503,
        code: str = "SlowDown",
        message: str = "Please reduce your request rate.",
    ) -> float:
        """Answer every request arriving in the next ``duration_s`` seconds with HTTP
        ``status`` and an S3 error body (``<Error><Code>SlowDown</Code>...``) instead of
        forwarding it, as S3 does while it throttles a prefix. Returns when the storm
        ends, on ``time.monotonic()``'s clock."""
        until = time.monotonic() + duration_s
        with self._lock:
            self._storm = _Storm(until, status, code, message)
        return until

    def storm_arrivals(self) -> list[float]:
        """When (``time.monotonic()``) each request a storm answered arrived, in order."""
        with self._lock:
            return list(self._storm_arrivals)

    # -- event loop thread -----------------------------------------------------------

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        self._server = loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0, limit=_HEAD_LIMIT))
        ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            # Collect the cancelled connection tasks, so none reports its cancellation as an error.
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                request = await _read_head(reader)
                if request is None:
                    return  # the client closed its keep-alive connection
                storm = self._storm_now()
                if storm is not None:
                    if not await self._answer_storm(storm, request, reader, writer):
                        return
                    continue
                if upstream is None:
                    upstream = await asyncio.open_connection(*self.upstream, limit=_HEAD_LIMIT)
                keep = await self._exchange(request, reader, writer, *upstream)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return  # a peer went away or spoke something else: drop this connection only
        except asyncio.CancelledError:
            return  # the proxy is stopping (asyncio's server callback would log a raised cancellation)
        finally:
            for w in (writer, upstream[1] if upstream else None):
                if w is not None:
                    w.close()

    async def _exchange(
        self,
        request: _Message,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
    ) -> bool:
        """Forward one request and its response; True when both sides keep the connection."""
        method, target = request.first_line.split(" ", 2)[:2]
        kind = _request_kind(method, target)
        factor = self._jitter()
        started = time.monotonic()
        if (request.header("expect") or "").lower() == "100-continue":
            client_w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await client_w.drain()
        self._count_request(method, ranged=method == "GET" and request.header("range") is not None)
        up_w.write(request.encode(drop=("expect",)))
        sent = await _copy_body(client_r, up_w, _request_framing(request), None, self._tally("request_bytes", method))
        await up_w.drain()
        response = await _read_final_response(up_r, client_w)
        if self.model is not None:  # the request's fixed time, counted from its arrival
            fixed = self.model.base_s(kind, sent if kind == "put" else 0) * factor  # an upload's bytes too
            await asyncio.sleep(max(0.0, started + fixed - time.monotonic()))
        client_w.write(response.encode())
        framing = _response_framing(method, response)
        pace = self._pacer(factor) if self.model is not None else None
        await _copy_body(up_r, client_w, framing, pace, self._tally("response_bytes", method))
        await client_w.drain()
        return framing != "close" and not _closes(request) and not _closes(response)

    def _storm_now(self) -> _Storm | None:
        """The storm a request arriving now is answered by (and its arrival recorded), if any."""
        now = time.monotonic()
        with self._lock:
            if self._storm is None or now >= self._storm.until:
                return None
            self._storm_arrivals.append(now)
            return self._storm

    async def _answer_storm(
        self, storm: _Storm, request: _Message, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> bool:
        """Read the request's body and answer it with the storm's error; True when the
        connection stays open."""
        method = request.first_line.split(" ", 1)[0]
        self._count_request(method)
        if (request.header("expect") or "").lower() == "100-continue":
            client_w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await client_w.drain()
        await _copy_body(client_r, _Discard(), _request_framing(request), None, self._tally("request_bytes", method))
        client_w.write(storm.response(method))
        await client_w.drain()
        return not _closes(request)

    def _jitter(self) -> float:
        if self.model is None or self.model.jitter_sigma == 0:
            return 1.0
        with self._lock:
            return self._rng.lognormvariate(0.0, self.model.jitter_sigma)

    def _pacer(self, factor: float) -> _Pace:
        """Seconds to wait after ``n`` more body bytes so the body flows at the model's
        bandwidth (times the request's jitter factor) on this connection."""
        assert self.model is not None
        seconds_per_byte = factor / self.model.bandwidth_bytes_s
        start = time.monotonic()
        moved = 0

        def wait_after(n: int) -> float:
            nonlocal moved
            moved += n
            return max(0.0, start + moved * seconds_per_byte - time.monotonic())

        return wait_after

    def _count_request(self, method: str, *, ranged: bool = False) -> None:
        with self._lock:
            self._counters.requests[method] = self._counters.requests.get(method, 0) + 1
            self._counters.range_gets += ranged

    def _tally(self, which: str, method: str) -> _Tally:
        """Adds body bytes to counter ``which`` of ``method`` as they pass."""

        def add(n: int) -> None:
            with self._lock:
                counts = getattr(self._counters, which)
                counts[method] = counts.get(method, 0) + n

        return add


@dataclass(frozen=True, slots=True)
class _Storm:
    """Every request until ``until`` (monotonic seconds) gets this S3 error."""

    until: float
    status: int
    code: str
    message: str

    def response(self, method: str) -> bytes:
        request_id = uuid.uuid4().hex[:16].upper()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{self.code}</Code><Message>{self.message}</Message>"
            f"<RequestId>{request_id}</RequestId><HostId>batchweave-proxy</HostId></Error>"
        ).encode()
        reason = "Slow Down" if self.code == "SlowDown" else http.HTTPStatus(self.status).phrase
        head = (
            f"HTTP/1.1 {self.status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: {request_id}\r\n\r\n"
        ).encode("latin-1")
        return head if method == "HEAD" else head + body


class _Sink(Protocol):
    """Where a body is copied to: a client or upstream connection, or ``_Discard``."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class _Discard:
    """A sink that drops what it is given: the body of a request the proxy answers itself."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass


# ---------------------------------------------------------------------- HTTP/1.1 framing


async def _read_head(reader: asyncio.StreamReader) -> _Message | None:
    """The next message head, or None at a clean end of stream before one starts."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise
    except asyncio.LimitOverrunError as exc:
        raise ValueError("HTTP head too large") from exc
    lines = raw[:-4].decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line {line!r}")
        headers.append((name.strip(), value.strip()))
    return _Message(lines[0], headers)


async def _read_final_response(up_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> _Message:
    """The upstream's final response head; interim 1xx answers go straight to the client."""
    while True:
        response = await _read_head(up_r)
        if response is None:
            raise ConnectionError("upstream closed before answering")
        if not 100 <= _status(response) < 200:
            return response
        client_w.write(response.encode())


def _status(response: _Message) -> int:
    return int(response.first_line.split(" ", 2)[1])


def _request_kind(method: str, target: str) -> str:
    """The latency model's request kind: a GET with a list query (or of a bucket) is a LIST."""
    path, _, query = target.partition("?")
    if method == "GET":
        return "list" if "list-type" in query or path.rstrip("/").count("/") <= 1 else "get"
    return {"HEAD": "head", "DELETE": "delete"}.get(method, "put")


def _request_framing(request: _Message) -> str | int:
    if "chunked" in (request.header("transfer-encoding") or "").lower():
        return "chunked"
    return int(request.header("content-length") or 0)


def _response_framing(method: str, response: _Message) -> str | int:
    if method == "HEAD" or _status(response) in _NO_BODY_STATUS:
        return 0
    if "chunked" in (response.header("transfer-encoding") or "").lower():
        return "chunked"
    length = response.header("content-length")
    return int(length) if length is not None else "close"


def _closes(message: _Message) -> bool:
    return (message.header("connection") or "").lower() == "close"


async def _copy_body(
    reader: asyncio.StreamReader, writer: _Sink, framing: str | int, pace: _Pace | None, tally: _Tally
) -> int:
    """Forward one body as framed; return its payload bytes (chunked: the data, not the framing)."""
    if framing == "chunked":
        return await _copy_chunked(reader, writer, pace, tally)
    return await _copy_exact(reader, writer, None if framing == "close" else int(framing), pace, tally)


async def _forward(writer: _Sink, data: bytes, pace: _Pace | None, tally: _Tally) -> None:
    """Pass ``data`` on once the bandwidth allows, counted before the client can have it
    (so counters read after a client's last byte include that byte)."""
    if pace is not None:
        delay = pace(len(data))
        if delay > 0:
            await asyncio.sleep(delay)
    tally(len(data))
    writer.write(data)
    await writer.drain()


async def _copy_exact(
    reader: asyncio.StreamReader, writer: _Sink, length: int | None, pace: _Pace | None, tally: _Tally
) -> int:
    """Forward ``length`` bytes, or everything until the server closes (None)."""
    total = 0
    while length is None or total < length:
        data = await reader.read(_CHUNK if length is None else min(_CHUNK, length - total))
        if not data:
            if length is None:
                break
            raise ConnectionError(f"body ended {length - total} bytes early")
        total += len(data)
        await _forward(writer, data, pace, tally)
    return total


async def _copy_chunked(reader: asyncio.StreamReader, writer: _Sink, pace: _Pace | None, tally: _Tally) -> int:
    total = 0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        writer.write(size_line)
        if size == 0:
            break
        await _copy_exact(reader, writer, size, pace, tally)
        total += size
        writer.write(await reader.readexactly(2))  # the CRLF after the chunk's data
    while True:  # trailers, up to the empty line
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        if line == b"\r\n":
            break
    await writer.drain()
    return total
