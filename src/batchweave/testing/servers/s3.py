"""What every S3 test server shares: the credentials, the environment that points obstore
at a server, and AWS Signature V4 signed requests with plain ``urllib`` (to create and
probe buckets on servers that check signatures: SeaweedFS, s3rver)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass

from batchweave.errors import ConfigError

__all__ = [
    "S3_ACCESS_KEY",
    "S3_ENV_UNSET",
    "S3_SECRET_KEY",
    "S3Identity",
    "check_bucket_name",
    "s3_env",
    "s3_signed_request",
]


#: Keys the S3 servers accept: moto takes any; SeaweedFS gets exactly this identity.
S3_ACCESS_KEY = S3_SECRET_KEY = "testing"

# S3's rule for a bucket's name (general purpose buckets), which SeaweedFS and s3rver enforce.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def check_bucket_name(bucket: str) -> str:
    """``bucket``, or ConfigError when S3 would refuse it as a bucket's name. A server that
    creates its bucket at startup (SeaweedFS, s3rver) would otherwise refuse it there and
    be waited for until its startup timed out."""
    if not _BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(
            f"{bucket!r} is not an S3 bucket name: 3 to 63 characters, lowercase letters, digits, "
            "dots and hyphens, beginning and ending with a letter or a digit"
        )
    return bucket


#: Variables that could redirect or break the S3 credentials of :func:`s3_env` if inherited.
S3_ENV_UNSET = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")


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
    canonical_path = urllib.parse.quote(path, safe="/-_.~")
    amz_date = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    host = urllib.parse.urlsplit(endpoint).netloc
    request = urllib.request.Request(
        endpoint + canonical_path,
        method=method,
        data=body if method in ("PUT", "POST") else None,
        headers=_sigv4_headers(method, host, canonical_path, body, amz_date, access_key, secret_key, region),
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.status


def _sigv4_headers(
    method: str,
    host: str,
    canonical_path: str,
    body: bytes,
    amz_date: str,
    access_key: str,
    secret_key: str,
    region: str,
) -> dict[str, str]:
    """The headers that sign one request with AWS Signature V4 (no query string; the
    signed headers are host, x-amz-content-sha256 and x-amz-date)."""
    day = amz_date[:8]
    payload_hash = hashlib.sha256(body).hexdigest()
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
    return {
        "x-amz-date": amz_date,
        "x-amz-content-sha256": payload_hash,
        "Authorization": (
            f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed_headers}, Signature={signature}"
        ),
    }
