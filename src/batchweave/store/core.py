"""A namespace on an object store: ``Store`` and ``open_store`` (see the package's doc)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import obstore

from batchweave import retry
from batchweave.errors import (
    ConfigError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)
from batchweave.keys import HEAD_COPIES, PROBE_PREFIX
from batchweave.store.backends import build_backend
from batchweave.store.identity import store_identity
from batchweave.store.info import ObjectInfo
from batchweave.store.localfs import (
    PLAIN_KEY,
    STAGING_NAME,
    Data,
    find_staging,
    read_file,
    write_durably,
)
from batchweave.store.options import RETRY_DEADLINE_OPTION, check_storage_options
from batchweave.store.requests import Requester
from batchweave.store.spares import SpareStaging
from batchweave.store.syncs import PendingSyncs
from batchweave.store.urls import SCHEME_FAMILY, file_url_path, normalize_url, parent_urls, store_root

__all__ = ["HEAD_COPIES_VARIABLE", "PROBE_PREFIX", "Store", "head_copies_setting", "open_store"]

# The package's logger: the stores guide tells operators to watch "batchweave.store".
_logger = logging.getLogger("batchweave.store")

# Store roots (see store_root) whose handling of create-only puts this process checked:
# True if a second create-only put of a key failed as it must, False if it succeeded.
# One probe per process per root, however many namespaces share the bucket.
_create_only_checked: dict[str, bool] = {}
_create_only_lock = threading.Lock()

# One store client per Store and process: a reader's first fetch threads all ask for it at
# once, and each used to build its own (a tokio runtime and connection pool apiece). New in
# a forked child, where a lock held by a parent thread would never be released.
_handle_lock = threading.Lock()


def _new_handle_lock() -> None:
    global _handle_lock
    _handle_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_handle_lock)

# Where the create-only probe writes (require_create_only); the garbage collector deletes
# what a writer without delete permission left there.
_CONDITIONAL_STORES = (
    "Use a store (or a newer version of this server) that supports conditional writes: "
    "AWS S3, MinIO, SeaweedFS, GCS or Azure Blob Storage."
)


HEAD_COPIES_VARIABLE = "BATCHWEAVE_HEAD_COPIES"
_MAX_HEAD_COPIES = 32


def head_copies_setting(value: str | None, remote: bool) -> int:
    """``Store.head_copies`` from the environment variable's ``value`` (None: unset)."""
    if value is None or not value.strip():
        return HEAD_COPIES if remote else 0
    try:
        copies = int(value)
    except ValueError:
        copies = -1
    if not 0 <= copies <= _MAX_HEAD_COPIES:
        raise ConfigError(f"{HEAD_COPIES_VARIABLE}={value!r}: expected a whole number from 0 to {_MAX_HEAD_COPIES}")
    return copies


def _listing(handle: Any, prefix: str, chunk_size: int = 50) -> Any:
    """obstore's listing of ``prefix`` (all of the store for ""), ``chunk_size`` objects at
    a time (obstore's default: 50)."""
    return obstore.list(handle, prefix=prefix or None, chunk_size=chunk_size)


def _info(meta: Any) -> ObjectInfo:
    """What a listing says of one object (obstore's ObjectMeta)."""
    modified = meta.get("last_modified")
    return ObjectInfo(
        key=str(meta["path"]), size=int(meta["size"]), modified_s=modified.timestamp() if modified else 0.0
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


class Store(Requester):
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
    back (the request path: ``store.requests.Requester``).
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
        super().__init__(
            retry_deadline_s=self.storage_options.get(RETRY_DEADLINE_OPTION, retry.DEFAULT_RETRY_DEADLINE_S),
            max_attempts=max_attempts,
            root=store_root(self.url, self.storage_options) or self.url,
        )
        self._handle: Any = None
        self._pid = -1
        # The directory itself, decoded once from the URL (which is percent-encoded).
        self._local_root = file_url_path(self.url) if self.url.startswith("file:") else None
        self._fsync = bool(self.storage_options.get("fsync", True))
        self._syncs = PendingSyncs()  # of objects staged on a local directory (stage_if_absent)
        self._spare = SpareStaging(self._local_root or "")  # staging files opened ahead for the next staged objects
        self._delete_denied = False  # see delete_if_allowed
        self._identity: tuple[int, str] | None = None  # (process id, identity): see identity
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
    def lists_from_a_key(self) -> bool:
        """Whether a listing starts at a key on the store's side, so ``list_keys_after``
        costs what follows the key only: S3's ``start-after``, GCS's ``startOffset``, a
        memory store, a local directory. Not Azure: its listing starts at the prefix, and
        obstore drops the keys before the offset itself, after listing them."""
        return SCHEME_FAMILY.get(urlparse(self.url).scheme) != "az"

    @property
    def head_copies(self) -> int:
        """Copies of each new log version its writers keep near the head, for a large
        job's followers (``journal.headcopies``): ``keys.HEAD_COPIES`` on an object store,
        none elsewhere (a local follower's probes cost no requests); the environment
        variable ``BATCHWEAVE_HEAD_COPIES`` (0 to 32) sets it for writers and readers."""
        return head_copies_setting(os.environ.get(HEAD_COPIES_VARIABLE), self.remote)

    @property
    def identity(self) -> str:
        """Which objects this Store reaches and as whom, as 32 hex digits (no request).

        Equal for two Stores of one normalized URL, storage options and, for an object
        store, the environment variables obstore reads for its kind: every ``AWS_*`` for
        S3, ``AZURE_*`` for Azure, ``GOOGLE_*``, ``GCS_*`` and ``SERVICE_ACCOUNT`` for GCS
        (endpoints, accounts, regions, keys, tokens, profiles). Any difference there makes
        another identity, even one that changes nothing (an endpoint given as an option
        here, as a variable there): sharing is then lost, never wrong. Local directories
        and memory stores: the URL and options only. Processes share work (a node's hub)
        only between Stores of one identity. What the local user's files hold (``~/.aws``
        under another HOME) is not in it: sharing between users is the sharer's to refuse.

        A blake2b digest personalized for BatchWeave: secrets enter only the hash, never
        a string this returns. An option that is not plain data (a ``credential_provider``)
        counts by its type's qualified name, since the ranks of one job build the same
        provider; two jobs whose providers of one type act as different principals get
        one identity unless their URL or other options tell them apart. Computed once per
        process, from that process's environment (an unpickled or forked Store computes
        it again in its own).
        """
        if self._identity is None or self._identity[0] != os.getpid():
            self._identity = (os.getpid(), store_identity(self.url, self.storage_options, os.environ))
        return self._identity[1]

    @property
    def _store(self) -> Any:
        # A tokio runtime does not survive fork(): rebuild the handle in a child process.
        handle, pid = self._handle, self._pid
        if handle is not None and pid == os.getpid():
            return handle
        with _handle_lock:
            if self._handle is None or self._pid != os.getpid():
                self._handle = build_backend(self.url, self.storage_options, self.create, self._local_root)
                self._pid = os.getpid()
            return self._handle

    # -- writes ----------------------------------------------------------------------

    def wait_staged(self) -> None:
        """Return once every object staged so far (``stage_if_absent``) is durable; at once
        on an object store, where a put is durable when it returns. A commit calls it before
        it reads the log: the fsyncs of the objects its version names are then waited for
        outside its fragile window, which they would otherwise stretch (on a local disk,
        DAC measured 65% commit success and half the throughput with them inside)."""
        if self._local_root is not None:
            self._syncs.wait()

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        """Create ``key`` with ``data``; raise ObjectExistsError if it already exists.

        On a local directory it returns once the object is durable (``localfs.write_durably``),
        and once every object staged before it is (``stage_if_absent``).
        """
        path = self._local_file(key)
        if path is not None:
            self._syncs.wait()
            write = functools.partial(self._write_local, path, data, replace=False)
            self._call(key, write, "put", len(data), conditional=True)
            return
        self._call(key, lambda: obstore.put(self._store, key, data, mode="create"), "put", len(data), conditional=True)

    def stage_if_absent(self, key: str, data: Data, size: int | None = None) -> None:
        """``put_if_absent`` of an object that a later durable put names (a producer's TGB
        objects, named by a commit); ``data`` may be pieces to write back to back, ``size``
        their bytes when the caller knows (else they are counted).

        On a local directory it returns once the object is in place (the pieces written
        with one ``writev``, no copy), its fsyncs run in the background (``store.syncs``),
        and every later ``put_if_absent`` or ``put`` of this Store waits for them first:
        nothing durable ever names an object that is not. Elsewhere a put is durable when
        it returns, and this is a create-only put of the pieces as they are (obstore sends
        them in one request; nothing joins them here).
        """
        # A subclass or test that intercepts put_if_absent sees every put (in one buffer).
        if getattr(self.put_if_absent, "__func__", None) is not Store.put_if_absent:
            self.put_if_absent(key, b"".join(data) if isinstance(data, list) else data)
            return
        self._stage(key, data, size)

    def _stage(self, key: str, data: Data, size: int | None) -> None:
        """``stage_if_absent`` of the pieces as they are, for a subclass that models a
        store's requests around the real ones (``latency.LatencyStore``) and must not pay
        for a join that no real store makes."""
        if size is None:
            size = sum(memoryview(piece).nbytes for piece in data) if isinstance(data, list) else len(data)
        path = self._local_file(key)
        if path is None:
            # One PUT of the pieces, create-only: obstore never splits a conditional put
            # into a multipart upload (said here as well, since a multipart one could not be).
            def put() -> Any:
                return obstore.put(self._store, key, data, mode="create", use_multipart=False)

            self._call(key, put, "put", size, conditional=True)
            return
        write = functools.partial(self._write_local, path, data, replace=False, staged_as=key, size=size)
        self._call(key, write, "put", size, conditional=True)

    def release(self) -> None:
        """Remove the staging file opened ahead for the next staged object, if any (a
        producer that closes writes no more). The store stays usable."""
        self._spare.discard()

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Overwrite ``key``. Only for advisory hints; every other object is create-only."""
        path = self._local_file(key)
        if path is not None:
            self._syncs.wait()
            self._call(key, functools.partial(self._write_local, path, data, replace=True), "put", len(data))
            return
        self._call(key, lambda: obstore.put(self._store, key, data), "put", len(data))

    def _write_local(
        self, path: str, data: Data, *, replace: bool, staged_as: str = "", size: int | None = None
    ) -> None:
        _ = self._store  # the first request builds the handle, which makes (or checks) the directory
        if not staged_as:
            write_durably(path, data, replace=replace, fsync=self._fsync)
            return
        directory = os.path.dirname(path)
        opened = self._spare.take(directory)
        directories = write_durably(
            path, data, replace=False, fsync=False, opened=opened, remove_staging=self._spare.remove, size=size
        )
        self._spare.prepare(directory)  # the next object of this producer's epoch goes there too
        if self._fsync:
            self._syncs.start(staged_as, path, directories)

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

    def has_locally(self, key: str) -> bool | None:
        """On a local directory, whether ``key`` exists: one ``stat``, no request to count
        (a probe there costs microseconds, a listing of a large directory milliseconds).
        None elsewhere: ask the store."""
        if self._local_root is None:
            return None
        path = self._local_file(key)
        return None if path is None else os.path.exists(path)

    def list_keys_after(self, prefix: str, start_after: str, before: str) -> list[str]:
        """The keys under ``prefix`` that sort after ``start_after`` and before ``before``,
        in key order: one LIST request that starts at ``start_after`` and is read only up
        to ``before`` (S3's ``start-after``; the stores list in key order). On a local
        directory, the names of ``prefix``'s own directory (no request to count), so keys
        below it in subdirectories are not listed."""
        if self._local_root is not None:
            return self._local_keys_after(prefix, start_after, before)

        def listed() -> list[str]:
            found: list[str] = []
            listing: Any = obstore  # its list's overloads are typed loosely; chunks of dicts
            for chunk in listing.list(self._store, prefix=prefix or None, offset=start_after, chunk_size=100):
                for meta in chunk:
                    key = str(meta["path"])
                    if key >= before:
                        return found
                    found.append(key)
            return found

        return self._call(prefix, listed, "list")

    def _local_keys_after(self, prefix: str, start_after: str, before: str) -> list[str]:
        assert self._local_root is not None
        directory = os.path.join(self._local_root, prefix)

        def listed() -> list[str]:
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                return []
            return sorted(key for key in (prefix + name for name in names) if start_after < key < before)

        return self._call(prefix, listed, "list")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (relative to the namespace), in no fixed order."""
        listed = self._call(prefix, lambda: _listing(self._store, prefix).collect(), "list")
        for meta in listed:
            yield _info(meta)

    def list_first(self, prefix: str, limit: int) -> tuple[list[ObjectInfo], bool]:
        """Up to ``limit`` objects under ``prefix`` and whether there may be more: one
        listing request per 1,000 objects on an object store (in key order there), which
        stops at ``limit`` instead of listing everything."""

        def first() -> tuple[list[Any], bool]:
            found: list[Any] = []
            for chunk in _listing(self._store, prefix, chunk_size=min(limit, 1000)):
                found.extend(chunk)
                if len(found) >= limit:
                    return found[:limit], True
            return found, False

        listed, more = self._call(prefix, first, "list")
        return [_info(meta) for meta in listed], more

    @property
    def may_nest(self) -> bool:
        """Whether another namespace could lie above or below this one's prefix: on an
        object store or a local directory. A memory store's URL is a store of its own."""
        return self.object_store or self._local_root is not None

    def ancestors(self) -> list[Store]:
        """Stores of the prefixes above this one (``urls.parent_urls``: up to the bucket or
        container, or the file system's root), outermost first, with this store's options
        and credentials; none for a memory store. Opening them makes no request."""
        return [Store(url, create=False, storage_options=self.storage_options) for url in parent_urls(self.url)]
