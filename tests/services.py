"""Real object-store servers for the test suite.

Starts a moto S3 server and an Azurite blob emulator as subprocesses on free
127.0.0.1 ports, waits until they answer HTTP, and stops them on teardown.
No third-party client library is needed: buckets and containers are created
with plain ``urllib`` requests (moto does not check signatures; Azurite gets a
Shared Key signed request with its well-known development key).

The environment variables that make ``obstore.store.from_url(url)`` reach each
server (in this process and in any child process) are given by
:func:`s3_env` and :func:`azure_env`.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import email.utils
import hashlib
import hmac
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
AZURITE_BIN = REPO_ROOT / "node_modules" / ".bin" / "azurite-blob"

# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

STARTUP_TIMEOUT = 60.0  # seconds; a cold Azurite on a busy 2-core box takes ~1-2 s


class ServiceError(RuntimeError):
    """A test service could not be started."""


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment that points obstore's S3 store (``s3://...``) at moto."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
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


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Ask Linux to SIGTERM the child if the test process dies (even by SIGKILL)."""
    os.setsid()
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Service:
    """A server subprocess with its log file."""

    name: str
    cmd: list[str]
    endpoint: str
    log_path: Path
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
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
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
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=10)
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
