"""The log's objects as a journal reaches them: each request counted."""

from __future__ import annotations

from batchweave.errors import ObjectExistsError, ObjectNotFoundError
from batchweave.store import Store

__all__ = ["LogObjects"]


class LogObjects:
    """``store`` for a journal's reads of the log and its create-only puts of log versions.

    A missing object reads as None and a lost create-only race as False; ``requests``
    counts every call (``Journal.requests``, for cost tests and metrics). What is written
    best effort beside the log (snapshots, the hint, segments) goes to ``store`` directly.
    """

    __slots__ = ("requests", "store")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.requests = 0

    def get(self, key: str) -> memoryview | None:
        self.requests += 1
        try:
            return self.store.get(key)
        except ObjectNotFoundError:
            return None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """False when the object exists already (another writer took that key)."""
        self.requests += 1
        try:
            self.store.put_if_absent(key, data)
        except ObjectExistsError:
            return False
        return True

    def list_keys(self, prefix: str) -> list[str]:
        self.requests += 1
        return [info.key for info in self.store.list(prefix)]
