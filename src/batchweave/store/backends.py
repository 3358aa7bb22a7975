"""obstore's store behind a namespace URL, built on a Store's first request and again in a
forked child: a local directory (made durably), an in-process memory store shared by
name, or an object store with obstore's own brief retries and, for S3, the AWS
credential chain."""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from obstore.store import LocalStore, MemoryStore, from_url

from batchweave.errors import ConfigError
from batchweave.store.credentials import s3_credentials
from batchweave.store.failures import translate_open_error
from batchweave.store.localfs import fsync_directory, make_dirs
from batchweave.store.options import obstore_options
from batchweave.store.urls import SCHEME_FAMILY

__all__ = ["build_backend"]

# obstore retries 5xx, dropped connections and timeouts of safe requests itself, briefly
# (a blip costs no more than a second); Store._call retries what is left, with its own
# backoff, until the retry deadline (batchweave.retry), including what obstore does not
# retry (throttling on writes, errors surfaced as generic ones).
_OBSTORE_RETRY = {
    "max_retries": 4,
    "retry_timeout": timedelta(seconds=30),
    "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=2), "base": 2},
}
# memory://NAME: one store per name in a process, so that every Store of it sees the same objects.
_memory_stores: dict[str, MemoryStore] = {}
_memory_lock = threading.Lock()


def build_backend(url: str, options: dict[str, Any], create: bool, local_root: str | None) -> Any:
    """obstore's store for the namespace ``url`` (normalized) with its checked ``options``;
    ``local_root``: the directory of a local one. Makes the directory (when ``create``) or
    refuses a missing one; ConfigError for a store obstore cannot build."""
    scheme = urlparse(url).scheme
    if local_root is not None:
        if not create and not os.path.isdir(local_root):
            raise ConfigError(f"no namespace at {url}: the directory does not exist")
        if create and options.get("fsync", True):
            # Made here, and durably (its parents fsynced), so that the first put's object
            # cannot vanish with the directory.
            for made in make_dirs(local_root):
                fsync_directory(os.path.dirname(made))
        return LocalStore(prefix=local_root, mkdir=create)
    if scheme == "memory":
        with _memory_lock:
            return _memory_stores.setdefault(url, MemoryStore())
    options = obstore_options(options)
    if SCHEME_FAMILY.get(scheme) == "s3":
        options = s3_credentials(url, options)
    options = {"retry_config": _OBSTORE_RETRY, **options}
    try:
        return from_url(url, **options)
    except Exception as exc:
        raise translate_open_error(exc, url, options) from None  # not chained: see translate_open_error
