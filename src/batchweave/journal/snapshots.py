"""Snapshots and the snapshot hint: where a load of the log starts.

A snapshot is the ``LogState`` after every K-th version, written best effort by that
version's committer; the hint names the newest (and repeats the namespace's id) and is
the one object ever overwritten.
Neither is trusted: a load probes forward from the hint, so a stale or missing hint
only costs extra reads, and a missing snapshot only a longer tail of versions.
"""

from __future__ import annotations

import logging

from batchweave import keys, log
from batchweave.errors import CorruptDataError, ObjectExistsError, StoreError
from batchweave.journal.objects import LogObjects
from batchweave.log import LogState

__all__ = ["Snapshots"]

_logger = logging.getLogger(__name__)


class Snapshots:
    """The snapshots of one namespace's log, one every ``every`` versions, and the hint."""

    def __init__(self, objects: LogObjects, every: int) -> None:
        self._objects = objects
        self.every = every

    def newest(self, *, trust_hint: bool) -> LogState:
        """The newest snapshot: from the hint, probing forward from it, or else a listing.

        A snapshot that is missing was deleted by collection (a newer one exists); one
        that is damaged raises, unless a newer snapshot makes it irrelevant.
        """
        state = None
        if trust_hint:
            state = self._read(self._hinted_version(), newest=False)
        if state is None:
            # No hint, or it names a snapshot that is gone (garbage collection keeps only
            # the newest): one listing finds the newest instead of replaying from version 1.
            # No probe after it: the listing is as recent as a probe would be.
            return self._read(self.listed_version(), newest=True) or LogState()
        while True:
            # Snapshots sit at multiples of K; a stale hint only costs these probes.
            probe = (state.version // self.every + 1) * self.every
            newer = self._read(probe, newest=True)
            if newer is None:
                return state
            state = newer

    def namespace(self) -> str | None:
        """The namespace's id that every snapshot repeats, or None when there is no
        snapshot: from the hint, which repeats it too (one GET), else from a snapshot
        (the hinted one, else the newest listed), without the probes for a newer one."""
        hint = self._hint()
        if hint.namespace:
            return hint.namespace
        found = self._read(hint.version, newest=False) or self._read(self.listed_version(), newest=True)
        return None if found is None else found.namespace

    def listed_version(self) -> int:
        """The version of the newest snapshot a listing finds (0 if there is none)."""
        versions = [
            int(name[:-5])
            for key in self._objects.list_keys(keys.SNAPSHOT_PREFIX)
            if (name := key[len(keys.SNAPSHOT_PREFIX) :]).endswith(".json") and name[:-5].isdigit()
        ]
        return max(versions, default=0)

    def write(self, state: LogState) -> None:
        """Best effort: a missing snapshot costs readers time, never correctness."""
        store = self._objects.store
        try:
            try:
                store.put_if_absent(keys.snapshot_key(state.version), log.encode(state))
            except ObjectExistsError:
                pass  # somebody else wrote the same (deterministic) snapshot
            store.put(keys.HINT_KEY, log.encode_hint(state))
        except StoreError as exc:
            _logger.warning("could not write snapshot at version %d: %s", state.version, exc)

    def _hinted_version(self) -> int:
        return self._hint().version

    def _hint(self) -> log.Hint:
        """The hint, or one naming no snapshot when it is missing or damaged."""
        data = self._objects.get(keys.HINT_KEY)
        if data is None:
            return log.Hint(0)
        try:
            return log.decode_hint(bytes(data))
        except CorruptDataError as exc:
            _logger.warning("ignoring a damaged snapshot hint: %s", exc)
            return log.Hint(0)

    def read(self, version: int) -> LogState | None:
        """The snapshot at ``version``; None if there is none, or it is damaged (logged)."""
        return self._read(version, newest=False)

    def _read(self, version: int, *, newest: bool) -> LogState | None:
        """The snapshot at ``version``; None if there is none. Damage raises when the
        snapshot may be the newest (``newest``), else it is skipped for a listing."""
        if version <= 0:
            return None
        key = keys.snapshot_key(version)
        data = self._objects.get(key)
        if data is None:
            return None
        try:
            state = log.decode_snapshot(data, key)
            if state.version != version:
                raise CorruptDataError(key, f"snapshot says it is of version {state.version}")
        except CorruptDataError as exc:
            if newest:
                raise CorruptDataError(
                    key,
                    f"{exc.problem}; the namespace state depends on it. If the log versions after the "
                    "previous snapshot are intact, deleting this object lets readers rebuild the state",
                ) from exc
            _logger.warning("ignoring a damaged snapshot named by the hint: %s", exc)
            return None
        return state
