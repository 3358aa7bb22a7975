"""A namespace on an object store: ``Store`` and ``open_store`` (see the package's doc)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlparse

import obstore

from batchweave import retry
from batchweave.errors import (
    BatchWeaveError,
    ConfigError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)
from batchweave.store.backends import build_backend
from batchweave.store.failures import never_reached, throttling, translate_error
from batchweave.store.info import ObjectInfo
from batchweave.store.localfs import (
    PLAIN_KEY,
    STAGING_NAME,
    find_staging,
    read_file,
    write_durably,
)
from batchweave.store.options import RETRY_DEADLINE_OPTION, check_storage_options
from batchweave.store.urls import SCHEME_FAMILY, file_url_path, normalize_url, store_root

__all__ = ["PROBE_PREFIX", "Store", "open_store"]

T = TypeVar("T")
# The package's logger: the stores guide tells operators to watch "batchweave.store".
_logger = logging.getLogger("batchweave.store")


# One request-rate limiter per bucket or container (store root) and process, shared by
# every Store of it: a store throttles the requests of all the process's threads and
# namespaces there together (batchweave.retry.RequestRateLimiter).
_limiters: dict[str, retry.RequestRateLimiter] = {}
_limiters_lock = threading.Lock()
# A request waiting for its turn looks at the rate again this often (it may have grown).
_RATE_RECHECK_S = 0.25

# Store roots (see store_root) whose handling of create-only puts this process checked:
# True if a second create-only put of a key failed as it must, False if it succeeded.
# One probe per process per root, however many namespaces share the bucket.
_create_only_checked: dict[str, bool] = {}
_create_only_lock = threading.Lock()

# Where the create-only probe writes (require_create_only); the garbage collector deletes
# what a writer without delete permission left there.
PROBE_PREFIX = "_probe/"
_CONDITIONAL_STORES = (
    "Use a store (or a newer version of this server) that supports conditional writes: "
    "AWS S3, MinIO, SeaweedFS, GCS or Azure Blob Storage."
)

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


def open_store(
    url: str | os.PathLike[str] | Store, *, create: bool = True, storage_options: dict[str, Any] | None = None
) -> Store:
    """Open the namespace at ``url``; ``storage_options`` pass through to obstore.

    A ``Store`` passes through unchanged (e.g. a ``batchweave.latency.LatencyStore``);
    ``storage_options`` must then be None. ``create=False`` (every reader) refuses a
    local directory that does not exist instead of making it, so a typo is an error
    rather than an empty namespace that is waited on forever. No request is made here.
    """
    if isinstance(url, Store):
        if storage_options:
            raise ConfigError(f"{url.url}: storage_options apply to a URL, not to an open Store; give them to it")
        return url
    return Store(os.fspath(url), create=create, storage_options=storage_options)


class Store:
    """A namespace on an object store. Picklable and fork-safe: it reconnects lazily.

    ``storage_options`` are checked by ``check_storage_options`` (ConfigError for a key
    the store kind does not know); ``create=False`` raises ConfigError at once for a
    local directory that does not exist.

    A request that fails with throttling, a server error, a timeout or a dropped
    connection is retried with capped exponential backoff and full jitter until
    ``retry_deadline_s`` (storage option; 600 s by default, see ``batchweave.retry``),
    then raises TransientStoreError; other errors raise at once. ``max_attempts`` caps
    the attempts as well (None: the deadline alone decides). ``retries`` and
    ``stalled_s`` count what it cost this process. Once the store answers with
    throttling, every request of the process to the same bucket waits for its turn
    under an adaptive request rate (``rate_limit_per_s``), until the rate has climbed
    back.
    """

    def __init__(
        self,
        url: str,
        *,
        create: bool = True,
        max_attempts: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = normalize_url(url)
        self.create = create
        self.storage_options = check_storage_options(self.url, storage_options)
        self.retry_deadline_s: float = self.storage_options.get(RETRY_DEADLINE_OPTION, retry.DEFAULT_RETRY_DEADLINE_S)
        self.max_attempts = max_attempts
        # Whether any request of this Store, in this process, reached the server (even to
        # be refused): until one has, a request that cannot connect gets only
        # UNREACHABLE_DEADLINE_S (a mistyped endpoint, not an outage to ride out).
        self._reached = False
        self._stalls = retry.StallMeter(lambda: self._retry_clock())  # looked up per call: a test may replace it
        self._limiter = _limiter_for(store_root(self.url, self.storage_options) or self.url)
        self._handle: Any = None
        self._pid = -1
        # The directory itself, decoded once from the URL (which is percent-encoded).
        self._local_root = file_url_path(self.url) if self.url.startswith("file:") else None
        self._fsync = bool(self.storage_options.get("fsync", True))
        self._delete_denied = False  # see delete_if_allowed
        if not create and self._local_root is not None and not os.path.isdir(self._local_root):
            raise ConfigError(
                f"no namespace at {self.url}: the directory does not exist (readers never create one; "
                "check the path, or start a producer first)"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "create": self.create,
            "storage_options": self.storage_options,
            "max_attempts": self.max_attempts,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(
            state["url"],
            create=state["create"],
            max_attempts=state["max_attempts"],
            storage_options=state["storage_options"],
        )

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # The clock, the pause and the jitter of the retry loop (a test replaces them on an instance).
    _retry_clock = staticmethod(time.monotonic)
    _retry_sleep = staticmethod(time.sleep)
    _retry_draw = staticmethod(random.random)

    @property
    def retries(self) -> int:
        """Requests this Store retried in this process (one per retry, not per request)."""
        return self._stalls.retries

    @property
    def stalled_s(self) -> float:
        """Seconds during which at least one of this Store's requests was failing and
        being retried (throttling, outages), in this process."""
        return self._stalls.stalled_s

    @property
    def stalled_now_s(self) -> float:
        """Seconds the current stall has lasted (0 when no request is being retried)."""
        return self._stalls.current_s

    @property
    def rate_limit_per_s(self) -> float:
        """Requests per second this process may send to this Store's bucket now: inf
        unless the store has been throttling them (``batchweave.retry.RequestRateLimiter``;
        shared by every Store of the bucket in this process)."""
        return self._limiter.current_per_s()

    @property
    def rate_limited_s(self) -> float:
        """Seconds during which this process's requests to the bucket were rate-limited."""
        return self._limiter.limited_s(self._retry_clock)

    @property
    def object_store(self) -> bool:
        """Whether the URL names an object store (S3, Azure, GCS): a prefix there cannot be
        missing, so readers judge the namespace by what it holds (``require_namespace``)."""
        return urlparse(self.url).scheme in SCHEME_FAMILY

    @property
    def remote(self) -> bool:
        """Whether a request crosses a network (an object store) rather than reading this
        machine's disk or memory: readers keep many requests in flight only when it does."""
        return self.object_store

    @property
    def _store(self) -> Any:
        # A tokio runtime does not survive fork(): rebuild the handle in a child process.
        if self._handle is None or self._pid != os.getpid():
            self._handle = build_backend(self.url, self.storage_options, self.create, self._local_root)
            self._pid = os.getpid()
        return self._handle

    # -- writes ----------------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        """Create ``key`` with ``data``; raise ObjectExistsError if it already exists.

        On a local directory it returns once the object is durable (``localfs.write_durably``).
        """
        path = self._local_file(key)
        if path is not None:
            write = functools.partial(self._write_local, path, data, replace=False)
            self._call(key, write, "put", len(data), conditional=True)
            return
        self._call(key, lambda: obstore.put(self._store, key, data, mode="create"), "put", len(data), conditional=True)

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Overwrite ``key``. Only for advisory hints; every other object is create-only."""
        path = self._local_file(key)
        if path is not None:
            self._call(key, functools.partial(self._write_local, path, data, replace=True), "put", len(data))
            return
        self._call(key, lambda: obstore.put(self._store, key, data), "put", len(data))

    def _write_local(self, path: str, data: bytes | memoryview, *, replace: bool) -> None:
        _ = self._store  # the first request builds the handle, which makes (or checks) the directory
        write_durably(path, data, replace=replace, fsync=self._fsync)

    def staging_files(self) -> list[ObjectInfo]:
        """Files a local put killed mid-write left behind (ours and obstore's), never objects.

        A put writes ``<key>#<digits>`` next to ``key`` and links it into place; a process
        killed in between leaves it. No listing shows them (obstore's hides every
        ``#<digits>`` name), so garbage collection asks here. Empty on every other store.
        """
        root = self._local_root
        if root is None:
            return []
        return self._call("", lambda: list(find_staging(root)), "list")

    def delete_staging(self, key: str) -> None:
        """Delete the staging file ``key`` (from ``staging_files``); a missing one is fine.

        Raises ConfigError for a key that is not a staging file: this never deletes an object.
        """
        parts = key.split("/")
        if self._local_root is None or not STAGING_NAME.fullmatch(parts[-1]) or {"", ".", ".."} & set(parts):
            raise ConfigError(f"{self.url}: {key!r} is not a staging file of a local directory")
        path = os.path.join(self._local_root, key)
        with contextlib.suppress(ObjectNotFoundError):
            self._call(key, lambda: os.unlink(path), "delete")

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing object is not an error (idempotent GC)."""
        try:
            self._call(key, lambda: obstore.delete(self._store, key), "delete")
        except ObjectNotFoundError:
            pass

    def delete_if_allowed(self, key: str) -> bool:
        """Delete ``key`` unless these credentials may not delete; True if it is gone.

        For writers tidying up after themselves (committed intents, the create-only probe):
        a producer may run without delete permission (docs/guides/permissions.md), and what
        it leaves the garbage collector deletes. The first denial is logged once; later
        calls on this handle then skip the request. Other errors propagate.
        """
        if self._delete_denied:
            return False
        try:
            self.delete(key)
        except StorePermissionError as exc:
            self._delete_denied = True
            _logger.warning(
                "%s: these credentials may not delete; leaving what this process would tidy up "
                "(committed intents, probe objects) to the garbage collector: %s",
                self.url,
                exc,
            )
            return False
        return True

    @property
    def deletes_denied(self) -> bool:
        """Whether a delete through this handle was refused for lack of permission."""
        return self._delete_denied

    def require_create_only(self) -> None:
        """Refuse a store that does not honour create-only puts (``If-None-Match: *``).

        Every commit is a create-only put of the next log version, and exactly one of two
        racing writers must lose; on a store that ignores the condition both would win
        and one commit would silently vanish. The check puts a random key under
        ``_probe/`` in this namespace twice with create-only puts, expects the second to
        fail, and deletes the key: three requests, once per process for each store root
        (endpoint and bucket or container), however many namespaces it holds. Local
        directories and memory stores honour create-only puts by construction and are
        not probed. Raises ``ConfigError`` when the store does not honour them.
        """
        root = store_root(self.url, self.storage_options)
        if root is None:
            return
        # Held through the probe, so that threads opening namespaces of one bucket at once
        # probe it once; it is taken at most once per store root per process.
        with _create_only_lock:
            honoured = _create_only_checked.get(root)
            if honoured is None:
                honoured = self._probe_create_only()
                _create_only_checked[root] = honoured
        if not honoured:
            raise ConfigError(
                f"conditional puts (If-None-Match: *) are not honoured by {self.url}: a second "
                "create-only put of the same key succeeded instead of failing. BatchWeave refuses "
                f"such a store because racing commits would both win and one of them would be lost. "
                f"{_CONDITIONAL_STORES}"
            )

    def _probe_create_only(self) -> bool:
        """Whether a second create-only put of one fresh key fails (see require_create_only)."""
        key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            try:
                self.put_if_absent(key, b"1")
            except ObjectExistsError:
                # Our own first attempt landed but its answer was lost, and the retry was
                # refused: that refusal is the behaviour being checked.
                return True
            except (ObjectNotFoundError, StorePermissionError, TransientStoreError):
                raise  # no bucket, no rights, no answer: not a verdict on conditional puts
            except StoreError as exc:
                # A store that rejects the condition header itself (400, 501) cannot do
                # create-only puts either.
                raise ConfigError(
                    f"conditional puts (If-None-Match: *) are not supported by {self.url}: a "
                    f"create-only put failed ({exc.problem}). BatchWeave refuses such a store because "
                    f"racing commits would both win. {_CONDITIONAL_STORES}"
                ) from exc
            try:
                self.put_if_absent(key, b"2")
            except ObjectExistsError:
                return True
            return False
        finally:
            # The verdict stands without the cleanup: a writer without delete rights, or a
            # failing delete, leaves one tiny object under _probe/ (the collector deletes it).
            with contextlib.suppress(StoreError):
                self.delete_if_allowed(key)

    # -- reads -----------------------------------------------------------------------

    def get(self, key: str) -> memoryview:
        """The whole object, without copying out of obstore's buffer."""
        path = self._local_path(key)
        if path is not None:
            return self._read_local(path, key, 0, None)
        return self._call(key, lambda: memoryview(obstore.get(self._store, key).bytes()), "get")

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        """``length`` bytes from ``start``: one ranged GET (fewer if the object is shorter)."""
        if length == 0:
            return memoryview(b"")
        path = self._local_path(key)
        if path is not None:
            return self._read_local(path, key, start, length)
        return self._call(
            key, lambda: memoryview(obstore.get_range(self._store, key, start=start, length=length)), "get"
        )

    def _read_local(self, path: str, key: str, start: int, length: int | None) -> memoryview:
        self._refuse_forked_runtime()  # as every request does: the child's next write would hang
        try:  # straight to the file: the retry loop costs more than the read
            return read_file(path, key, start, length)
        except OSError:  # an I/O error (not a missing file): translated and retried
            return self._call(key, lambda: read_file(path, key, start, length), "get")

    def _refuse_forked_runtime(self) -> None:
        if _runtime_pid is not None and _runtime_pid != os.getpid():
            raise ConfigError(f"{self.url}: {_FORK_MESSAGE}")

    def _local_path(self, key: str) -> str | None:
        """Where a local directory keeps ``key``, for the read fast path; None elsewhere.

        obstore's local reads cost about 56 us each for 100 KB (a blocking task on its
        runtime, open, seek, read, close), a plain ``os.pread`` 17 us: on a local disk
        that difference is most of a reader's time.
        """
        if self._handle is None:
            return None  # (the first request goes through obstore: it checks the directory)
        return self._local_file(key)

    def _local_file(self, key: str) -> str | None:
        """The file of ``key`` on a local directory; None elsewhere, and for a key that does
        not map to a file name unchanged (BatchWeave writes none): those go to obstore."""
        if self._local_root is None or not PLAIN_KEY.fullmatch(key) or ".." in key:
            return None
        return os.path.join(self._local_root, key)

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
        self._refuse_forked_runtime()
        limiter = self._limiter
        began = sent_at = None
        if limiter.limit_per_s is None:  # the common case, kept to a test and a count
            limiter.sent += 1
        else:  # the store has been throttling: wait for this process's turn
            ticket = limiter.reserve(self._retry_clock)
            began = self._retry_clock()
            sent_at = self._wait_turn(ticket, began + self._budget_s()) if ticket is not None else began
            if sent_at is None:
                raise TransientStoreError(key, "stopped waiting to send (the store is throttling): closing")
        try:
            return self._attempt(key, op, request, nbytes, conditional, sent_at)
        except TransientStoreError as error:
            failed = error
        return self._retry(key, op, request, nbytes, conditional, failed, began)

    def _attempt(
        self, key: str, op: Callable[[], T], request: str, nbytes: int, conditional: bool, sent_at: float | None
    ) -> T:
        """One request, its error translated (retried by obstore itself, briefly), its
        answer told to the request-rate limiter (``sent_at``: when, if it took a turn)."""
        global _runtime_pid
        try:
            result = self._perform(request, nbytes, op)
        except BatchWeaveError:
            raise
        except Exception as exc:
            self._reached = self._reached or not never_reached(exc)
            error = translate_error(exc, key, conditional=conditional, request=request, store=self.url)
            if not isinstance(error, TransientStoreError):
                self._answered()  # a 404 or a lost race is an answer too
            elif throttling(exc, key):
                self._say(self._limiter.throttled(sent_at, self._retry_clock))
            raise error from exc
        finally:
            _runtime_pid = os.getpid()
        self._reached = True
        if self._limiter.limit_per_s is not None:  # (nothing to tell it while not limited)
            self._answered()
        return result

    def _answered(self) -> None:
        self._say(self._limiter.succeeded(self._retry_clock))

    def _wait_turn(self, ticket: int, until: float) -> float | None:
        """Wait until the request-rate limiter lets ``ticket`` go, or until ``until`` (the
        request's deadline: its last attempt goes then, as a cut backoff pause does). The
        time it goes; None when this thread was told to stop meanwhile. Waits in short
        steps: the rate may change meanwhile."""
        while True:
            now = self._retry_clock()
            wait_s = min(self._limiter.wait_s(ticket, self._retry_clock), until - now)
            if wait_s <= 0:
                return now
            if not self._pause(min(wait_s, _RATE_RECHECK_S)):
                return None

    def _say(self, notice: retry.RateNotice | None) -> None:
        """Log a change of the request-rate limit (at most every 30 s while throttled)."""
        if notice is None:
            return
        if notice.kind == "started":
            _logger.warning(
                "%s: store throttling: this process now sends at most %.1f requests/s to this bucket (it sent "
                "about %.1f/s); the limit halves while throttling goes on and climbs back as requests succeed",
                self.url, notice.limit_per_s, notice.before_per_s,
            )  # fmt: skip
        elif notice.kind == "lowered":
            _logger.warning(
                "%s: store still throttling after %.0f s: this process now sends at most %.1f requests/s "
                "to this bucket (was %.1f/s)",
                self.url, notice.limited_s, notice.limit_per_s, notice.before_per_s,
            )  # fmt: skip
        else:
            _logger.warning(
                "%s: store throttling over: request rate no longer limited, after %.0f s of limiting",
                self.url, notice.limited_s,
            )  # fmt: skip

    def _retry(
        self,
        key: str,
        op: Callable[[], T],
        request: str,
        nbytes: int,
        conditional: bool,
        error: TransientStoreError,
        began: float | None,
    ) -> T:
        """Retry a request that failed transiently until it succeeds, fails for good, or
        has been failing for the deadline (counted from ``began``, when it started waiting
        for its first turn, if it did); then raise the last error, saying so."""
        started = self._retry_clock() if began is None else began
        self._stalls.begin()
        answered = False
        try:
            for attempt in itertools.count(1):
                stalled_s = self._retry_clock() - started
                budget_s = self._budget_s()
                if stalled_s >= budget_s or (self.max_attempts is not None and attempt >= self.max_attempts):
                    raise self._gave_up(error, attempt, stalled_s, budget_s) from error
                if self._stalls.retried():
                    self._warn_retrying(error, request, attempt + 1, stalled_s, budget_s)
                closing = TransientStoreError(
                    error.key, f"{error.problem}; stopped retrying: closing", retried_s=stalled_s
                )
                if not self._pause(min(budget_s - stalled_s, retry.jittered_pause_s(attempt, self._retry_draw()))):
                    raise closing from error
                sent_at = None
                ticket = self._limiter.reserve(self._retry_clock)  # the backoff, then this process's turn
                if ticket is not None and (sent_at := self._wait_turn(ticket, started + budget_s)) is None:
                    raise closing from error
                try:
                    result = self._attempt(key, op, request, nbytes, conditional, sent_at)
                except TransientStoreError as again:
                    error = again
                    continue
                except StoreError:
                    answered = True  # a 404 or a lost race is an answer: the store is back
                    raise
                answered = True
                return result
            raise AssertionError("unreachable")
        finally:
            recovered_after_s = self._stalls.end()
            if answered and recovered_after_s is not None:  # the end of a stall that was warned about
                _logger.warning(
                    "%s: store answering again after %.1f s stalled (%d retries in this process so far)",
                    self.url, recovered_after_s, self._stalls.retries,
                )  # fmt: skip

    def _warn_retrying(
        self, error: TransientStoreError, request: str, attempt: int, stalled_s: float, budget_s: float
    ) -> None:
        """The line a 3 a.m. reader needs: what is retried, for how long, and why."""
        _logger.warning(
            "%s: store throttled or unavailable: retrying %s %s for up to %g s (attempt %d, stalled %.1f s so far): %s",
            self.url, request.upper(), error.key, budget_s, attempt, stalled_s, _short(error.problem),
        )  # fmt: skip

    def _pause(self, seconds: float) -> bool:
        """Wait before the next attempt; False when this thread was told to stop retrying
        meanwhile (``retry.stop_retrying_when``: its reader or producer is closing)."""
        stop = retry.stop_event()
        if stop is None:
            self._retry_sleep(seconds)
            return True
        return not stop.wait(seconds)

    def _budget_s(self) -> float:
        """How long a failing request is retried: the deadline, or a few seconds while no
        request of this process ever reached the server (a mistyped or dead endpoint
        should say so at once, not after minutes of silence at startup)."""
        if self._reached:
            return self.retry_deadline_s
        return min(self.retry_deadline_s, retry.UNREACHABLE_DEADLINE_S)

    def _gave_up(self, error: TransientStoreError, attempts: int, stalled_s: float, budget_s: float) -> StoreError:
        if not self._reached:
            why = (
                f"; no request of this process ever reached the store (gave up after {stalled_s:.1f} s and "
                f"{attempts} attempts): check the endpoint, the network and the URL"
            )
        elif self.max_attempts is not None and attempts >= self.max_attempts and stalled_s < budget_s:
            why = f"; gave up after {attempts} attempts (max_attempts)"
        else:
            why = (
                f"; still failing after {stalled_s:.1f} s and {attempts} attempts "
                f"(storage option {RETRY_DEADLINE_OPTION}={budget_s:g})"
            )
        return TransientStoreError(error.key, error.problem + why, retried_s=stalled_s)


def _limiter_for(root: str) -> retry.RequestRateLimiter:
    with _limiters_lock:
        limiter = _limiters.get(root)
        if limiter is None:
            limiter = _limiters[root] = retry.RequestRateLimiter(time.monotonic())
        return limiter


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
