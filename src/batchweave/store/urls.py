"""Namespace URLs: the one URL of a namespace (a local directory as a percent-encoded
``file://`` URL), the directory a file URL names, the kind of store a URL names, the
store root behind it (the bucket or container and the server that answers for it), and
the URLs above and below a namespace's (where another namespace must not be: I13)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote_to_bytes, urlparse

from batchweave.errors import ConfigError

__all__ = ["SCHEME_FAMILY", "child_url", "file_url_path", "normalize_url", "parent_urls", "store_root"]

# The kind of object store each scheme names (obstore's S3, Azure or GCS store).
SCHEME_FAMILY = {
    "s3": "s3",
    "s3a": "s3",
    "az": "az",
    "azure": "az",
    "abfs": "az",
    "abfss": "az",
    "adl": "az",
    "gs": "gs",
}

# A URL's scheme, the colon and slashes after it, and the rest: for spotting mistyped URLs.
_URL_PARTS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)(?P<colon>:?)(?P<slashes>/*)(?P<rest>.*)", re.DOTALL)

# What starts a URL: a scheme and its colon (RFC 3986). A path without one is a path.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def normalize_url(url: str) -> str:
    """The one URL of ``url``'s namespace: a local directory, whether given as a plain
    path or a file URL, becomes the percent-encoded ``file://`` URL of its resolved path."""
    if not url:
        raise ConfigError("empty namespace URL: give a directory, file://, s3://, az://, gs:// or memory:// URL")
    _refuse_mistyped(url)
    found = _SCHEME.match(url)
    scheme = found.group(1).lower() if found else ""
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):
        return _file_url(url)  # a plain path, taken literally: '#' and '?' are characters of a name
    if scheme == "file":
        return _file_url(file_url_path(url))
    if scheme == "memory" or scheme in SCHEME_FAMILY:
        return url.rstrip("/")
    raise ConfigError(f"unsupported namespace URL {url!r}: use a directory, file://, s3://, az://, gs:// or memory://")


def _file_url(path: str) -> str:
    """``file://`` and the resolved ``path``, percent-encoded (as ``Path.as_uri`` does), so
    that every directory has one URL and ``file_url_path`` gives the path back."""
    return Path(path).expanduser().resolve().as_uri()


def file_url_path(url: str) -> str:
    """The path a ``file:`` URL names (``file:/p``, ``file:///p``, ``file://localhost/p``;
    ``_refuse_mistyped`` refuses other hosts), percent-decoded. Everything after the host
    is path: a '#' or '?' typed into a file URL is part of a name, not a fragment or query."""
    rest = url[len("file:") :]
    if rest[:12].lower() == "//localhost/":
        rest = rest[len("//localhost") :]
    elif rest.startswith("//"):
        rest = rest[2:]
    return os.fsdecode(unquote_to_bytes(rest))


def _refuse_mistyped(url: str) -> None:
    """ConfigError for a URL that names a known scheme but is not well formed.

    ``s3//bucket/run`` (no colon) would otherwise be the local directory ``./s3/bucket/run``
    and ``s3:/bucket/run`` a store without a bucket. Well formed: ``SCHEME://name/...``
    for object stores, also ``memory:///name``; ``file:///path``, ``file:/path`` and
    ``file://localhost/path``. A relative path whose first part is ``s3`` (``s3/run``)
    stays a directory.
    """
    parts = _URL_PARTS.fullmatch(url)
    if parts is None:
        return
    scheme, colon, slashes, rest = parts["scheme"].lower(), parts["colon"], parts["slashes"], parts["rest"]
    if scheme not in SCHEME_FAMILY and scheme not in ("memory", "file"):
        return
    if not colon and len(slashes) < 2:
        return  # a relative directory such as s3/run or memory
    if scheme == "file":
        if colon and (len(slashes) in (1, 3) or (len(slashes) == 2 and rest.startswith("localhost/"))):
            return
        fix = f"file:///{rest}"
    else:
        if colon and rest and (slashes == "//" or (scheme == "memory" and slashes == "///")):
            return
        fix = f"{scheme}://{rest}" if rest else f"{scheme}://bucket/prefix"
    raise ConfigError(f"mistyped namespace URL {url!r}: did you mean {fix!r}?")


# The settings that choose which server and account answer a URL; obstore takes them as
# options or, upper-cased, from the environment. With the bucket or container they name
# one store root: a server honours create-only puts for all of it or for none.
_ROOT_SETTINGS = {
    "s3": ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint"),
    "az": (
        "azure_storage_endpoint",
        "azure_endpoint",
        "endpoint",
        "azure_storage_account_name",
        "account_name",
        "azure_storage_use_emulator",
        "use_emulator",
        "azurite_blob_storage_url",
    ),
    # GCS has no "endpoint": its server is the base URL (an emulator's, or a private
    # endpoint's); a service account file can also carry one (gcs_base_url), unseen here.
    "gs": ("google_base_url", "base_url"),
}


def store_root(url: str, options: dict[str, Any]) -> str | None:
    """The bucket or container behind ``url`` and the server that answers for it, or None
    for a local directory or memory store (which need no probe)."""
    parsed = urlparse(url)
    family = SCHEME_FAMILY.get(parsed.scheme)
    if family is None:
        return None
    given = {name.lower(): value for name, value in os.environ.items()}
    given.update((name.lower(), value) for name, value in options.items())
    settings = [f"{name}={given[name]}" for name in _ROOT_SETTINGS[family] if name in given]
    return f"{family}://{parsed.netloc}?{'&'.join(settings)}"


def parent_urls(url: str) -> list[str]:
    """The URLs of the prefixes above the namespace ``url`` (normalized), outermost first:
    up to the bucket or container of an object store, up to the file system's root for a
    local directory. None for a memory store: each of its URLs is a store of its own."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        parents = Path(file_url_path(url)).parents
        return [parent.as_uri() for parent in reversed(parents)]
    if parsed.scheme not in SCHEME_FAMILY:
        return []
    parts = [part for part in parsed.path.split("/") if part]
    base = f"{parsed.scheme}://{parsed.netloc}"
    return [base + "".join(f"/{part}" for part in parts[:depth]) for depth in range(len(parts))]


def child_url(url: str, relative: str) -> str:
    """The URL of the prefix ``relative`` (a key prefix, "a/b/") below the namespace ``url``."""
    relative = relative.strip("/")
    if urlparse(url).scheme == "file":
        relative = quote(relative)  # as Path.as_uri encodes a path
    return f"{url.rstrip('/')}/{relative}"
