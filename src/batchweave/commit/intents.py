"""Intents on the store: the I/O half of group commit (``group`` is the pure half).

An ``IntentBoard`` writes one producer's intents, reads everybody else's (each intent
once: they are immutable, so a read is cached until the intent leaves the listing),
and deletes intents that the log has made useless.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from batchweave.commit.group import worth_reading
from batchweave.errors import CorruptDataError, ObjectExistsError, ObjectNotFoundError, StoreError
from batchweave.intent import INTENT_FORMAT, Intent, decode_intent, encode_intent, intent_key, parse_intent_key
from batchweave.keys import INTENT_PREFIX
from batchweave.log import LogState, TGBDescriptor
from batchweave.store import Store

__all__ = ["IntentBoard"]

_logger = logging.getLogger(__name__)
_READERS = 32  # intents read at once: a few round trips for a whole pool's intents
_shared: ThreadPoolExecutor | None = None  # one per process: see IntentBoard._reader
_shared_lock = threading.Lock()


def _forget_readers() -> None:
    """In a forked child: the parent's reader threads do not exist here."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_readers)


class IntentBoard:
    """Intents of one namespace, as seen by producer ``producer_id``."""

    def __init__(self, store: Store, producer_id: str) -> None:
        self.store = store
        self.producer_id = producer_id
        self.requests = 0
        self._cache: dict[str, Intent | None] = {}  # key -> intent (None: damaged or gone)

    def publish(self, epoch: int, tgbs: list[TGBDescriptor]) -> int:
        """Write ``tgbs`` (consecutive, this producer's) as one intent; returns one past
        the last offset the stored intent carries. A retry whose first try landed finds
        the intent there, maybe shorter than this one: its end is what was published."""
        key = intent_key(self.producer_id, epoch, tgbs[0].source_offset)
        self.requests += 1
        try:
            self.store.put_if_absent(key, encode_intent(Intent(INTENT_FORMAT, self.producer_id, epoch, tgbs)))
        except ObjectExistsError:
            self.requests += 1
            return decode_intent(self.store.get(key), key).end_offset
        return tgbs[-1].source_offset + 1

    def others(self, state: LogState | None = None) -> list[Intent]:
        """Every other producer's intent now listed (one LIST, a GET for each new one), but
        those ``state`` shows folded or fenced already (``group.worth_reading``)."""
        self.requests += 1
        listed = [info.key for info in self.store.list(INTENT_PREFIX)]
        parsed = {k: p for k in listed if (p := parse_intent_key(k)) is not None and p[0] != self.producer_id}
        wanted = list(parsed)
        if state is not None:
            worth = worth_reading(state, parsed.values())
            wanted = [k for k in wanted if parsed[k] in worth]
        fresh = [k for k in wanted if k not in self._cache]
        if fresh:
            # In flight together only across a network: from this machine's disk a read is
            # a few microseconds, and 32 threads handing the interpreter lock around made a
            # pool's 128 intents 3 times slower (90-110 ms against 36, measured alone).
            read = self._reader().map(self._read, fresh) if self.store.remote else map(self._read, fresh)
            for key, intent in zip(fresh, read, strict=True):
                self._cache[key] = intent
        keep = set(wanted)
        self._cache = {k: v for k, v in self._cache.items() if k in keep}
        return [intent for intent in self._cache.values() if intent is not None]

    def cached(self) -> list[Intent]:
        """The other producers' intents as last listed, without a request. Some may be
        folded or deleted since: folding leaves out whatever no longer continues its
        producer's offset, so a stale one costs nothing."""
        return [intent for intent in self._cache.values() if intent is not None]

    def _read(self, key: str) -> Intent | None:
        self.requests += 1
        try:
            return decode_intent(self.store.get(key), key)
        except ObjectNotFoundError:
            return None  # its producer saw it committed and deleted it since the listing
        except CorruptDataError as exc:
            # One producer's damaged intent must not stop the others' commits; its own
            # producer commits those TGBs itself (it never folds its own intents).
            _logger.warning("skipping a damaged intent: %s", exc)
            return None

    def collect(self, state: LogState, published: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Delete this producer's intents whose TGBs the log holds; returns those left.
        ``published`` is (key, end offset) of each intent written, oldest first."""
        committed = state.producers[self.producer_id].offset
        left = []
        for key, end in published:
            if end > committed:
                left.append((key, end))
                continue
            try:
                self.requests += not self.store.deletes_denied
                self.store.delete_if_allowed(key)
            except StoreError as exc:  # it is harmless where it is; the next collection retries
                _logger.info("could not delete committed intent %s: %s", key, exc)
                left.append((key, end))
            # Not deleted for lack of permission: forgotten, not retried; the garbage
            # collector deletes it (``gc.dead_intents``).
        return left

    def sweep_older_epochs(self, epoch: int) -> int:
        """Delete this producer's intents from epochs before ``epoch``: they can never be
        folded (the log's epoch moved past them). Called after a claim; returns how many
        were deleted. Without delete permission it deletes none and leaves them to the
        garbage collector (``gc.dead_intents``): they are harmless where they are."""
        self.requests += 1
        doomed = [
            info.key
            for info in self.store.list(f"{INTENT_PREFIX}{self.producer_id}/")
            if (parsed := parse_intent_key(info.key)) is not None and parsed[1] < epoch
        ]
        deleted = 0
        for key in doomed:
            self.requests += 1
            if not self.store.delete_if_allowed(key):
                break  # denied (logged once by the store): the rest would be denied too
            deleted += 1
        return deleted

    def _reader(self) -> ThreadPoolExecutor:
        """The process's intent readers, shared by its producers: only the turn's rank 0
        reads intents, so one process rarely has two readers busy, and a pool each
        (measured: 64 producers to a process, 32 threads each) left thousands of
        threads contending for one interpreter lock."""
        global _shared
        with _shared_lock:
            if _shared is None:
                _shared = ThreadPoolExecutor(_READERS, thread_name_prefix="batchweave-intents")
            return _shared

    def close(self) -> None:
        """Nothing to release: the readers are the process's (idle threads, reused)."""
