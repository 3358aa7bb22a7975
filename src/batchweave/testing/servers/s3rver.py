"""s3rver: an S3 emulator that ignores ``If-None-Match: *`` (``npm install s3rver``), the
stand-in for every store on which BatchWeave must refuse to run."""

from __future__ import annotations

import os
from pathlib import Path

from batchweave.testing.servers.process import STARTUP_TIMEOUT_S, Service, node_binary, on_port, start_with_port_retry
from batchweave.testing.servers.s3 import check_bucket_name, s3_signed_request

__all__ = [
    "S3RVER_ACCESS_KEY",
    "S3RVER_SECRET_KEY",
    "start_s3rver",
]

#: s3rver's one fixed account.
S3RVER_ACCESS_KEY = S3RVER_SECRET_KEY = "S3RVER"


def start_s3rver(
    workdir: Path,
    bucket: str,
    *,
    binary: str | os.PathLike[str] | None = None,
    timeout_s: float = STARTUP_TIMEOUT_S,
    port: int | None = None,
) -> Service:
    """Start s3rver on 127.0.0.1, on ``port`` (None: a free one), with bucket ``bucket``, data and log under
    ``workdir``; its one account has the keys :data:`S3RVER_ACCESS_KEY` and
    :data:`S3RVER_SECRET_KEY`.

    s3rver ignores ``If-None-Match: *``: a second create-only put of a key overwrites it.
    It stands for every store that does not honour conditional puts. ``binary`` is found
    as in :func:`start_azurite` (``npm install s3rver``).
    """
    check_bucket_name(bucket)
    executable = node_binary("s3rver", "s3rver", binary)
    directory = Path(workdir) / "s3rver-data"
    directory.mkdir(parents=True, exist_ok=True)

    def command(port: int) -> list[str]:
        return [
            *(str(executable), "--directory", str(directory), "--address", "127.0.0.1", "--port", str(port)),
            *("--silent", "--configure-bucket", bucket),
        ]

    def ready(endpoint: str) -> bool:
        # A signed HEAD of the bucket: the server answers and the bucket is configured.
        status = s3_signed_request(
            endpoint, "HEAD", f"/{bucket}", access_key=S3RVER_ACCESS_KEY, secret_key=S3RVER_SECRET_KEY, timeout_s=5
        )
        return status == 200

    make = on_port("s3rver S3 emulator", Path(workdir) / "s3rver", command)
    return start_with_port_retry(make, ready, timeout_s, port=port)
