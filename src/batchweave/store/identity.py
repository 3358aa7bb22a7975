"""A namespace's identity: one fingerprint of which objects a Store reaches and as whom,
so that processes share work (the ranks of a node sharing a hub) only when each would
read the same objects with the same rights. Made without a request, from the URL, the
storage options and the environment obstore reads; secrets enter only the hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from batchweave.store.urls import SCHEME_FAMILY

__all__ = ["store_identity"]

# The environment variables obstore reads for each kind of store: it takes every config
# key (endpoint, account, region, keys, tokens, profile...) from its upper-cased name.
# Matching by prefix, not by the known keys, also covers what a newer obstore or boto3
# (the AWS chain: AWS_PROFILE, AWS_CONFIG_FILE...) reads that this list does not name.
_ENV_PREFIXES = {"s3": ("AWS_",), "az": ("AZURE_",), "gs": ("GOOGLE_", "GCS_")}
# Read without a prefix: GCS's service account file (object_store's legacy name).
_ENV_NAMES = {"gs": ("SERVICE_ACCOUNT",)}
# Personalizes the hash: an identity is never a bare hash of a secret, nor equal to a
# hash some other program makes of the same bytes.
_PERSON = b"batchweave-id"
_DIGEST_BYTES = 16  # 32 hex digits


def store_identity(url: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """The identity (hex) of the store at ``url`` (normalized) with its checked
    ``options``, opened in a process whose environment is ``environ``."""
    material = {"url": url, "options": _plain(dict(options)), "environment": _store_environment(url, environ)}
    # Canonical JSON (sorted keys, ASCII): one text for one material, whatever the order
    # in which options were given or the environment was built.
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode("ascii"), digest_size=_DIGEST_BYTES, person=_PERSON).hexdigest()


def _store_environment(url: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that obstore reads for the store at ``url``: none for a
    local directory or memory store, which read no environment."""
    family = SCHEME_FAMILY.get(urlparse(url).scheme)
    if family is None:
        return {}
    prefixes, names = _ENV_PREFIXES[family], _ENV_NAMES.get(family, ())
    return {
        name: value for name, value in environ.items() if name.upper().startswith(prefixes) or name.upper() in names
    }


def _plain(value: Any) -> Any:
    """``value`` as JSON data. What is not plain data (a credential provider) counts by its
    type's qualified name: its state may be unreadable, secret or change as it refreshes."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, timedelta):  # obstore's retry and client timeouts
        return {"timedelta_s": value.total_seconds()}
    kind = type(value)
    return {"type": f"{kind.__module__}.{kind.__qualname__}"}
