"""Reading and writing the log on a store: the thin driver around ``log``.

Opening a namespace costs O(1) requests plus the tail: read the snapshot hint, the
snapshot it names, probe forward for newer snapshots, then read the versions after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from batchweave import log
from batchweave.errors import CorruptDataError, ObjectExistsError, ObjectNotFoundError, StoreError
from batchweave.log import LogState, LogVersion
from batchweave.store import Store

__all__ = ["DEFAULT_SNAPSHOT_EVERY", "Journal"]

_logger = logging.getLogger(__name__)
DEFAULT_SNAPSHOT_EVERY = 100


class Journal:
    """The log of one namespace: versions, snapshots and the snapshot hint."""

    def __init__(self, store: Store, snapshot_every: int = DEFAULT_SNAPSHOT_EVERY) -> None:
        self.store = store
        self.snapshot_every = snapshot_every
        self.requests = 0  # log requests made, for cost tests and metrics
        # When the newest probe began: a commit's fragile window opens at the read that
        # found no newer version (paper 5.2), not at the catch-up reads before it.
        self.last_probe_started = time.monotonic()

    # -- versions --------------------------------------------------------------------

    def read_version(self, version: int) -> LogVersion | None:
        """Version ``version``, or None if it is not committed (yet)."""
        key = log.version_key(version)
        self.requests += 1
        try:
            data = self.store.get(key)
        except ObjectNotFoundError:
            return None
        return log.decode_version(data, key, version)

    def versions_after(self, version: int) -> Iterator[LogVersion]:
        """Committed versions ``version+1, version+2, ...`` up to the newest one."""
        while True:
            self.last_probe_started = time.monotonic()
            delta = self.read_version(version + 1)
            if delta is None:
                return
            yield delta
            version += 1

    def catch_up(self, state: LogState) -> tuple[LogState, int]:
        """``state`` advanced to the newest version; also how many versions were read."""
        read = 0
        for delta in self.versions_after(state.version):
            state = log.apply_version(state, delta, log.version_key(delta.version))
            read += 1
        return state, read

    def try_commit(self, delta: LogVersion) -> bool:
        """Create-only put of ``delta``. False when another writer took that version."""
        self.requests += 1
        try:
            self.store.put_if_absent(log.version_key(delta.version), log.encode(delta))
        except ObjectExistsError:
            return False
        return True

    # -- state and snapshots ---------------------------------------------------------

    def load_state(self) -> LogState:
        """The newest state: hint, snapshot, forward probe, then the tail of versions."""
        state = self._newest_snapshot()
        state, read = self.catch_up(state)
        if read >= 2 * self.snapshot_every:
            # A snapshot went missing (a committer crashed before writing it): heal it so
            # the next reader does not pay for this long tail again.
            self.write_snapshot(state)
        return state

    def after_commit(self, state: LogState) -> None:
        """Called by the committer of ``state.version``; writes a snapshot every K versions."""
        if state.version % self.snapshot_every == 0:
            self.write_snapshot(state)

    def write_snapshot(self, state: LogState) -> None:
        """Best effort: a missing snapshot costs readers time, never correctness."""
        try:
            try:
                self.store.put_if_absent(log.snapshot_key(state.version), log.encode(state))
            except ObjectExistsError:
                pass  # somebody else wrote the same (deterministic) snapshot
            self.store.put(log.HINT_KEY, b'{"version": %d}' % state.version)
        except StoreError as exc:
            _logger.warning("could not write snapshot at version %d: %s", state.version, exc)

    def newest_snapshot_version(self) -> int:
        """The version of the newest snapshot (0 if there is none)."""
        return self._newest_snapshot().version

    def _newest_snapshot(self) -> LogState:
        state = self._read_snapshot(self._hinted_version())
        if state is None:
            # No hint, or it names a snapshot that is gone (garbage collection keeps only
            # the newest): one listing finds the newest instead of replaying from version 1.
            state = self._read_snapshot(self._listed_snapshot_version()) or LogState()
        while True:
            # Snapshots sit at multiples of K; a stale hint only costs these probes.
            probe = (state.version // self.snapshot_every + 1) * self.snapshot_every
            newer = self._read_snapshot(probe)
            if newer is None:
                return state
            state = newer

    def _listed_snapshot_version(self) -> int:
        self.requests += 1
        versions = [
            int(name[:-5])
            for info in self.store.list(log.SNAPSHOT_PREFIX)
            if (name := info.key[len(log.SNAPSHOT_PREFIX) :]).endswith(".json") and name[:-5].isdigit()
        ]
        return max(versions, default=0)

    def _hinted_version(self) -> int:
        self.requests += 1
        try:
            data = bytes(self.store.get(log.HINT_KEY))
        except ObjectNotFoundError:
            return 0
        try:
            return log.decode_hint(data)
        except CorruptDataError as exc:
            _logger.warning("ignoring a damaged snapshot hint: %s", exc)
            return 0

    def _read_snapshot(self, version: int) -> LogState | None:
        if version <= 0:
            return None
        key = log.snapshot_key(version)
        self.requests += 1
        try:
            data = self.store.get(key)
        except ObjectNotFoundError:
            return None
        try:
            state = log.decode_snapshot(data, key)
        except CorruptDataError as exc:
            _logger.warning("ignoring a damaged snapshot: %s", exc)
            return None
        return state if state.version == version else None
