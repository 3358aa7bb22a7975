"""The log's objects as a journal reaches them: each request counted."""

from __future__ import annotations

import re
from typing import Literal

from batchweave import keys, log
from batchweave.errors import ObjectExistsError, ObjectNotFoundError
from batchweave.store import Store

__all__ = ["LogObjects"]

_VERSION_NAME = re.compile(r"\d{20}\.json")
# Every other object under the log's prefix is named from "_" on (the snapshots, the
# segments, the hint), and "_" sorts after every digit: a listing from a version's key
# meets all the versions above it first.
_PAST_THE_VERSIONS = keys.LOG_PREFIX + "_"
# A version's first bytes a writer reads: a head of a few hundred producers fits (about
# 120 bytes each: its run and its state), and a version this small is read whole at once.
_HEAD_GUESS = 64 << 10
_MOST_HEAD_GUESS = 8 << 20  # a head this long is damage, or a log no writer keeps up with


class LogObjects:
    """``store`` for a journal's reads of the log and its create-only puts of log versions.

    A missing object reads as None and a lost create-only race as False; ``requests``
    counts every call and ``bytes_read`` the bytes of what the reads returned
    (``Journal.requests``, ``Journal.bytes_read``, for cost tests and metrics). What is written
    best effort beside the log (snapshots, the hint, segments) goes to ``store`` directly.
    """

    __slots__ = ("bytes_read", "head_guess", "requests", "store")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.requests = 0
        self.head_guess = _HEAD_GUESS  # bytes of a version ``get_head`` asks for first
        self.bytes_read = 0  # of the objects read (every one is decoded, or hashed, or both)

    def get(self, key: str) -> memoryview | None:
        self.requests += 1
        try:
            data = self.store.get(key)
        except ObjectNotFoundError:
            return None
        self.bytes_read += len(data)
        return data

    def get_head(self, key: str) -> tuple[memoryview, bool] | None:
        """What a writer needs of a log version: its bytes up to the end of its head
        (``log.head_extent``), and whether they are all of it. One ranged GET of the first
        ``head_guess`` bytes holds the whole version when it is small, or its head; a second
        fetches the rest of a longer head (``head_guess`` then grows to twice it), and a
        version of format 1 longer than the guess is read whole. A group-commit version
        holds every producer's TGBs, megabytes of slice tables that its hundreds of
        producers need none of: each reads the kilobytes of its head instead."""
        self.requests += 1
        try:
            data = self.store.get_range(key, 0, self.head_guess)
            whole = len(data) < self.head_guess
            extent = None if whole else log.head_extent(data)
            if not whole and extent is None:  # format 1 (or damage): no head apart
                self.requests += 1
                data, whole = self.store.get(key), True
            elif extent is not None and extent > len(data):
                self.requests += 1
                data = memoryview(b"".join((data, self.store.get_range(key, len(data), extent - len(data)))))
                self.head_guess = min(_MOST_HEAD_GUESS, max(self.head_guess, 2 * extent))
            elif extent is not None:
                data = data[:extent]
        except ObjectNotFoundError:
            return None
        self.bytes_read += len(data)
        return data, whole

    def put_if_absent(self, key: str, data: bytes) -> Literal["landed", "taken", "maybe-ours"]:
        """Whether the put landed; "taken" when the object exists already (another writer
        took that key); "maybe-ours" when it exists after the store retried a put whose
        first answer was lost, so it may be that attempt's (``ObjectExistsError.after_retry``)."""
        self.requests += 1
        try:
            self.store.put_if_absent(key, data)
        except ObjectExistsError as exc:
            return "maybe-ours" if exc.after_retry else "taken"
        return "landed"

    def list_keys(self, prefix: str) -> list[str]:
        self.requests += 1
        return [info.key for info in self.store.list(prefix)]

    def newest_version_after(self, version: int) -> int | None:
        """The highest version number the log holds above ``version``, or None when it holds
        none: one LIST that starts after ``version``'s key, keys only. Not proven: the
        caller reads that version and proves it as any read (``Journal``)."""
        self.requests += 1
        if self.store.has_locally(keys.version_key(version + 1)) is not None:
            return self._probed_newest_after(version)
        listed = self.store.list_keys_after(keys.LOG_PREFIX, keys.version_key(version), _PAST_THE_VERSIONS)
        numbers = [int(key[len(keys.LOG_PREFIX) : -len(".json")]) for key in listed if _is_version_key(key)]
        return max(numbers, default=None)

    def _probed_newest_after(self, version: int) -> int | None:
        """``newest_version_after`` on a local directory, by probes for names (stats), none
        a request: forward in doubling steps to a missing version, then halving back.
        About 2 log2(versions since) stats, where a listing would read every name in
        the directory, which grows with the log until collection. Versions above one
        present are dense (collection deletes in ascending order); a hole a collector
        just made only makes this answer lower, and the put after it fails or is
        proven stale, as any probe's."""
        present = version
        step = 1
        while self.store.has_locally(keys.version_key(present + step)):
            present += step
            step *= 2
        missing = present + step
        while missing - present > 1:
            middle = (present + missing) // 2
            if self.store.has_locally(keys.version_key(middle)):
                present = middle
            else:
                missing = middle
        return None if present == version else present


def _is_version_key(key: str) -> bool:
    return key.startswith(keys.LOG_PREFIX) and _VERSION_NAME.fullmatch(key, len(keys.LOG_PREFIX)) is not None
