"""The benchmark proxy counts requests and body bytes by method, frames HTTP/1.1 bodies
both ways (Content-Length, chunked, keep-alive) and adds the latency model's delay."""

from __future__ import annotations

import http.client
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchweave.latency import LatencyModel
from batchweave.testing.proxyprocess import ProxyProcess
from benchmarks.latency_proxy import LatencyProxy

BODY = bytes(range(256)) * 400  # 102,400 bytes


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_GET(self):
        if self.path.endswith("/chunked"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(BODY), 30_000):
                piece = BODY[start : start + 30_000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def do_PUT(self):
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            data = b""
            while size := int(self.rfile.readline().strip(), 16):
                data += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            data = self.rfile.read(int(self.headers["Content-Length"]))
        answer = str(len(data)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _get(conn: http.client.HTTPConnection, path: str) -> bytes:
    conn.request("GET", path)
    return conn.getresponse().read()


def test_counts_bytes_by_method_over_one_kept_alive_connection(upstream):
    with LatencyProxy(upstream) as proxy:
        conn = http.client.HTTPConnection(proxy.endpoint.removeprefix("http://"), timeout=5)
        assert _get(conn, "/bucket/plain") == BODY
        assert _get(conn, "/bucket/chunked") == BODY  # same connection: keep-alive survived chunking
        conn.request("PUT", "/bucket/up", body=iter([b"x" * 1000, b"y" * 500]), encode_chunked=True)
        assert conn.getresponse().read() == b"1500"
        conn.request("PUT", "/bucket/up2", body=b"z" * 300, headers={"Expect": "100-continue"})
        assert conn.getresponse().read() == b"300"
        counted = proxy.counters()
        assert counted.requests == {"GET": 2, "PUT": 2}
        assert counted.get_bytes == 2 * len(BODY)
        assert counted.request_bytes["PUT"] == 1800
        proxy.reset()
        assert proxy.counters().total_requests == 0 and proxy.counters().get_bytes == 0
        conn.close()


def test_delays_by_the_model_and_not_without_it(upstream):
    model = LatencyModel(first_byte_s=0.1, bandwidth_bytes_s=1e6, jitter_sigma=0.0)  # 0.1 s + 0.1024 s
    with LatencyProxy(upstream, model) as slow, LatencyProxy(upstream) as fast:
        for proxy, low, high in ((slow, 0.19, 0.6), (fast, 0.0, 0.1)):
            conn = http.client.HTTPConnection(proxy.endpoint.removeprefix("http://"), timeout=5)
            _get(conn, "/bucket/warm")
            started = time.monotonic()
            assert _get(conn, "/bucket/plain") == BODY
            took = time.monotonic() - started
            assert low <= took <= high, (proxy.model, took)
            conn.close()


def test_the_proxy_process_counts_delays_resets_and_stops(upstream):
    # bench consumers' proxy: the same proxy, in a child process, driven over its pipes.
    model = LatencyModel(first_byte_s=0.1, bandwidth_bytes_s=1e6, jitter_sigma=0.0)
    with ProxyProcess(upstream, model, seed=1) as proxy:
        child = proxy._child
        assert child is not None and child.pid != os.getpid()
        conn = http.client.HTTPConnection(proxy.endpoint.removeprefix("http://"), timeout=5)
        _get(conn, "/bucket/warm")
        started = time.monotonic()
        assert _get(conn, "/bucket/plain") == BODY
        assert 0.19 <= time.monotonic() - started <= 0.6  # the model applies in the child
        counted = proxy.counters()
        assert counted.requests == {"GET": 2} and counted.get_bytes == 2 * len(BODY)
        proxy.reset()
        assert proxy.counters().total_requests == 0
        conn.close()
    assert child.poll() == 0  # closing its stdin stopped it
    with pytest.raises(RuntimeError, match="not running"):
        proxy.counters()
