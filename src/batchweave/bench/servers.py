"""A real S3 server on loopback for benchmarks: moto (with atomic create-only puts, see
``batchweave.bench.moto_server``), started and stopped here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from batchweave.errors import ConfigError

__all__ = ["moto_s3"]

_BUCKET = "batchweave-bench"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def moto_s3(timeout_s: float = 30.0) -> Iterator[str]:
    """Start ``moto.server`` on 127.0.0.1, create a bucket, set AWS_* and yield ``s3://bucket``."""
    try:
        import moto  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--store s3 needs moto: pip install 'batchweave[dev]'") from exc
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchweave.bench.moto_server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    saved = {k: os.environ.get(k) for k in _env(endpoint)}
    try:
        _wait_ready(endpoint, proc, timeout_s)
        os.environ.update(_env(endpoint))
        request = urllib.request.Request(f"{endpoint}/{_BUCKET}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()
        yield f"s3://{_BUCKET}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
    }


def _wait_ready(endpoint: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"moto server exited with code {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise ConfigError(f"moto server at {endpoint} not ready after {timeout_s}s")
