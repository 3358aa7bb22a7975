"""Azurite: Microsoft's Azure blob emulator (``npm install azurite``), and a container on
it created with a Shared Key signed ``urllib`` request (no Azure client library needed)."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import os
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
    http_answers,
    node_binary,
    on_port,
    served,
    start_with_port_retry,
)

__all__ = [
    "AZURE_ENV_UNSET",
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "azure_env",
    "azurite_blob",
    "create_container",
    "start_azurite",
]


#: Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

#: Variables that would override the emulator settings of :func:`azure_env` if inherited.
AZURE_ENV_UNSET = (
    "AZURE_STORAGE_ENDPOINT",
    "AZURE_ENDPOINT",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_CLIENT_ID",
)


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


def start_azurite(
    workdir: Path,
    *,
    binary: str | os.PathLike[str] | None = None,
    timeout_s: float = STARTUP_TIMEOUT_S,
    port: int | None = None,
) -> Service:
    """Start Azurite's blob service on 127.0.0.1, on ``port`` (None: a free one), data and
    log under ``workdir``.

    ``binary`` is the ``azurite-blob`` executable; by default the one ``npm install azurite``
    put in ``node_modules/.bin`` of the current directory or a parent, or else on PATH.
    """
    executable = node_binary("azurite-blob", "azurite", binary)
    location = Path(workdir) / "azurite-data"
    location.mkdir(parents=True, exist_ok=True)

    def command(port: int) -> list[str]:
        return [
            *(str(executable), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(location)),
            *("--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry"),
        ]

    make = on_port("Azurite blob emulator", Path(workdir) / "azurite", command)
    # GET on the account root answers (with an auth error) once the server is up.
    return start_with_port_retry(make, lambda ep: http_answers(f"{ep}/{AZURITE_ACCOUNT}"), timeout_s, port=port)


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
    container: str = "batchweave",
    *,
    binary: str | os.PathLike[str] | None = None,
    timeout_s: float = STARTUP_TIMEOUT_S,
    port: int | None = None,
) -> Iterator[str]:
    """Start Azurite on 127.0.0.1 (on ``port``; None: a free one) with container
    ``container``, point the AZURE_* variables at it and yield ``az://CONTAINER``; on exit
    restore the environment, stop Azurite and remove its data."""
    with served(
        "azurite", lambda workdir: start_azurite(workdir, binary=binary, timeout_s=timeout_s, port=port)
    ) as service:
        create_container(service.endpoint, container)
        with environment(azure_env(service.endpoint), AZURE_ENV_UNSET):
            yield f"az://{container}"
