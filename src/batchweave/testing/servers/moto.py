"""moto: an S3 server in Python, with create-only puts made atomic (see
``batchweave.testing.moto_server``). It accepts any keys and unsigned requests, until
:func:`enforce_moto_iam` makes it check every request against IAM users' policies."""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchweave.errors import ConfigError
from batchweave.testing.servers.process import (
    STARTUP_TIMEOUT_S,
    Service,
    environment,
    http_answers,
    on_port,
    served,
    start_with_port_retry,
)
from batchweave.testing.servers.s3 import S3_ACCESS_KEY, S3_ENV_UNSET, S3_SECRET_KEY, S3Identity, s3_env

__all__ = [
    "create_bucket",
    "enforce_moto_iam",
    "moto_s3",
    "start_moto",
]

_MOTO_MISSING = (
    "moto is not installed: pip install 'moto[server]' (in the testing extra: pip install 'batchweave[testing]')"
)


def start_moto(workdir: Path, timeout_s: float = STARTUP_TIMEOUT_S, *, port: int | None = None) -> Service:
    """Start a moto S3 server (create-only puts made atomic: ``batchweave.testing.moto_server``)
    on 127.0.0.1, on ``port`` (None: a free one), its log under ``workdir``. Needs ``moto[server]``."""
    if importlib.util.find_spec("moto") is None:
        raise ConfigError(_MOTO_MISSING)

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "batchweave.testing.moto_server", "-H", "127.0.0.1", "-p", str(port)]

    make = on_port("moto S3 server", Path(workdir) / "moto", command)
    return start_with_port_retry(make, lambda ep: http_answers(ep + "/"), timeout_s, port=port)


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
def moto_s3(
    bucket: str = "batchweave", timeout_s: float = STARTUP_TIMEOUT_S, *, port: int | None = None
) -> Iterator[str]:
    """Start moto on 127.0.0.1 (on ``port``; None: a free one) with bucket ``bucket``, point
    the AWS_* variables at it and yield ``s3://BUCKET``; on exit restore the environment,
    stop moto, remove its files."""
    with served("moto", lambda workdir: start_moto(workdir, timeout_s, port=port)) as service:
        create_bucket(service.endpoint, bucket)
        with environment(s3_env(service.endpoint), S3_ENV_UNSET):
            yield f"s3://{bucket}"
