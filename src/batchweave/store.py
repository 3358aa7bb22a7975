"""The one storage adapter: a namespace URL in, create-only puts and range reads out.

This is the only module that knows obstore's types and errors. Everything above it
speaks in keys relative to the namespace root and in our own errors.

URLs:
    /abs/path, rel/path, file:///abs/path   local directory (the embedded default)
    memory://name                           in-process store, shared by name (tests)
    s3://bucket/prefix                      AWS_* from the environment; AWS_ENDPOINT_URL
                                            and AWS_ALLOW_HTTP=true for a local server
    az://container/prefix                   AZURE_STORAGE_* from the environment
    gs://bucket/prefix                      GOOGLE_* from the environment
Extra keyword options pass through to obstore's store constructor.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import obstore
from obstore import exceptions as obs_errors
from obstore.store import LocalStore, MemoryStore, from_url

from batchweave.errors import (
    BatchWeaveError,
    ConfigError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)

__all__ = ["ObjectInfo", "Store", "open_store"]

T = TypeVar("T")

_CLOUD_SCHEMES = {"s3", "s3a", "az", "azure", "abfs", "abfss", "adl", "gs"}

# obstore retries 5xx, dropped connections and timeouts of safe requests itself; we keep
# its budget short so a dead endpoint fails within seconds, and add one more layer for
# what it does not retry (throttling on writes, errors surfaced as generic ones).
_OBSTORE_RETRY = {
    "max_retries": 4,
    "retry_timeout": timedelta(seconds=30),
    "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=2), "base": 2},
}
_TRANSIENT_MARKERS = (
    "slowdown",
    "503",
    "500 ",
    "502",
    "504",
    "timed out",
    "timeout",
    "connection reset",
    "connection refused",
    "error sending request",
    "serverbusy",
    "internalerror",
    "throttl",
)
_CONFLICT_MARKERS = ("conditionalrequestconflict", "409", "412", "precondition")

_memory_stores: dict[str, MemoryStore] = {}
_memory_lock = threading.Lock()

# obstore runs its I/O on a tokio runtime that starts at the first request and does not
# survive fork(): a child that inherits a started runtime hangs on its first request.
# We remember which process started it, so a forked child fails fast instead.
_runtime_pid: int | None = None
_FORK_MESSAGE = (
    "this process was forked after its parent had used an object store, and obstore's I/O "
    "runtime does not survive fork(); start workers with the 'spawn' or 'forkserver' method "
    "(multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context='spawn')), "
    "or fork before the parent's first store request"
)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object: key relative to the namespace, size in bytes, last write (Unix s)."""

    key: str
    size: int
    modified_s: float = 0.0


def open_store(url: str | os.PathLike[str] | Store, *, create: bool = True, **options: Any) -> Store:
    """Open the namespace at ``url``; ``options`` pass through to obstore.

    A ``Store`` passes through unchanged (e.g. a ``batchweave.latency.LatencyStore``).
    ``create=False`` refuses a local directory that does not exist instead of making it
    (for read-only tools, so a typo is an error rather than an empty namespace).
    """
    if isinstance(url, Store):
        return url
    return Store(os.fspath(url), create=create, **options)


class Store:
    """A namespace on an object store. Picklable and fork-safe: it reconnects lazily."""

    def __init__(self, url: str, *, create: bool = True, max_attempts: int = 5, **options: Any) -> None:
        self.url = _normalize_url(url)
        self.create = create
        self.options = dict(options)
        self.max_attempts = max_attempts
        self._handle: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "create": self.create, "options": self.options, "max_attempts": self.max_attempts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], create=state["create"], max_attempts=state["max_attempts"], **state["options"])

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @property
    def _store(self) -> Any:
        # A tokio runtime does not survive fork(): rebuild the handle in a child process.
        if self._handle is None or self._pid != os.getpid():
            self._handle = _build(self.url, self.options, self.create)
            self._pid = os.getpid()
        return self._handle

    # -- writes ----------------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        """Create ``key`` with ``data``; raise ObjectExistsError if it already exists."""
        self._call(key, lambda: obstore.put(self._store, key, data, mode="create"), "put", len(data), conditional=True)

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Overwrite ``key``. Only for advisory hints; every other object is create-only."""
        self._call(key, lambda: obstore.put(self._store, key, data), "put", len(data))

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing object is not an error (idempotent GC)."""
        try:
            self._call(key, lambda: obstore.delete(self._store, key), "delete")
        except ObjectNotFoundError:
            pass

    # -- reads -----------------------------------------------------------------------

    def get(self, key: str) -> memoryview:
        """The whole object, without copying out of obstore's buffer."""
        return self._call(key, lambda: memoryview(obstore.get(self._store, key).bytes()), "get")

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        """``length`` bytes from ``start``: one ranged GET."""
        if length == 0:
            return memoryview(b"")
        return self._call(
            key, lambda: memoryview(obstore.get_range(self._store, key, start=start, length=length)), "get"
        )

    def size(self, key: str) -> int | None:
        """Size in bytes, or None when there is no such object."""
        try:
            return int(self._call(key, lambda: obstore.head(self._store, key), "head")["size"])
        except ObjectNotFoundError:
            return None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (relative to the namespace), in no fixed order."""
        listed = self._call(prefix, lambda: obstore.list(self._store, prefix=prefix or None).collect(), "list")
        for meta in listed:
            modified = meta.get("last_modified")
            yield ObjectInfo(
                key=str(meta["path"]), size=int(meta["size"]), modified_s=modified.timestamp() if modified else 0.0
            )

    # -- error mapping and retries ---------------------------------------------------

    def _perform(self, request: str, nbytes: int, op: Callable[[], T]) -> T:
        """Run one request. The hook where a simulated store adds latency and faults."""
        del request, nbytes
        return op()

    def _call(self, key: str, op: Callable[[], T], request: str, nbytes: int = 0, *, conditional: bool = False) -> T:
        global _runtime_pid
        if _runtime_pid is not None and _runtime_pid != os.getpid():
            raise ConfigError(f"{self.url}: {_FORK_MESSAGE}")
        delay = 0.05
        for attempt in range(1, self.max_attempts + 1):
            try:
                return self._perform(request, nbytes, op)
            except BatchWeaveError:
                raise
            except Exception as exc:
                error = translate_error(exc, key, conditional=conditional)
                if not isinstance(error, TransientStoreError) or attempt == self.max_attempts:
                    raise error from exc
            finally:
                _runtime_pid = os.getpid()
            # Full jitter keeps many ranks that hit the same throttle from retrying in step.
            time.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")


def translate_error(exc: BaseException, key: str, *, conditional: bool = False) -> StoreError:
    """Map an obstore exception to ours. The one place that knows obstore's errors."""
    text = f"{type(exc).__name__}: {exc}"
    lowered = text.lower()
    if isinstance(exc, obs_errors.AlreadyExistsError):
        return ObjectExistsError(key, "already exists (create-only put lost)")
    if isinstance(exc, obs_errors.PreconditionError) or (conditional and any(m in lowered for m in _CONFLICT_MARKERS)):
        # S3 answers a racing conditional put with 409 ConditionalRequestConflict or 412.
        return ObjectExistsError(key, f"conditional put conflict ({_first_line(text)})")
    if isinstance(exc, (obs_errors.NotFoundError, FileNotFoundError)):
        return ObjectNotFoundError(key, "no such object")
    if isinstance(exc, (obs_errors.PermissionDeniedError, obs_errors.UnauthenticatedError)):
        return StorePermissionError(key, f"access denied, check credentials ({_first_line(text)})")
    if isinstance(exc, (obs_errors.UnknownConfigurationKeyError, obs_errors.InvalidPathError)):
        return StoreError(key, f"bad store configuration or key ({_first_line(text)})")
    if isinstance(exc, (TimeoutError, ConnectionError)) or any(m in lowered for m in _TRANSIENT_MARKERS):
        return TransientStoreError(key, f"store unavailable after retries ({_first_line(text)})")
    return StoreError(key, _first_line(text))


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line[:300]


def _normalize_url(url: str) -> str:
    if not url:
        raise ConfigError("empty namespace URL: give a directory, file://, s3://, az://, gs:// or memory:// URL")
    scheme = urlparse(url).scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        path = urlparse(url).path if scheme == "file" else url
        return "file://" + str(Path(path).expanduser().resolve())
    if scheme == "memory" or scheme in _CLOUD_SCHEMES:
        return url.rstrip("/")
    raise ConfigError(f"unsupported namespace URL {url!r}: use a directory, file://, s3://, az://, gs:// or memory://")


def _build(url: str, options: dict[str, Any], create: bool) -> Any:
    scheme = urlparse(url).scheme
    if scheme == "file":
        path = urlparse(url).path
        if not create and not os.path.isdir(path):
            raise ConfigError(f"no namespace at {url}: the directory does not exist")
        return LocalStore(prefix=path, mkdir=True, **options)
    if scheme == "memory":
        with _memory_lock:
            return _memory_stores.setdefault(url, MemoryStore())
    options = {"retry_config": _OBSTORE_RETRY, **options}
    try:
        return from_url(url, **options)
    except Exception as exc:
        raise ConfigError(f"cannot open {url!r}: {_first_line(str(exc))}") from exc
