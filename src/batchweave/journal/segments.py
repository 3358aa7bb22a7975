"""Log segments on the store: the committer of a segment's last version writes it from
the versions' bytes it read or wrote; readers read it instead of its versions one by one.

Best effort on both sides (``segment`` holds the format and why): a segment
that is missing, damaged or never written costs readers per-version reads, never a step.
"""

from __future__ import annotations

import logging

from batchweave import log
from batchweave.errors import CorruptDataError, ObjectExistsError, StoreError
from batchweave.journal.objects import LogObjects
from batchweave.log import ReadVersion
from batchweave.segment import SEGMENT_MAX_BYTES, SEGMENT_VERSIONS, decode_segment, encode_segment, segment_key
from batchweave.store import Store

__all__ = ["RecentVersions", "read_segment"]

_logger = logging.getLogger(__name__)


def read_segment(objects: LogObjects, last: int) -> list[ReadVersion] | None:
    """The versions of the segment ending at ``last``, or None when there is none: not
    written (yet), or damaged, which is logged and read around."""
    try:
        data = objects.get(segment_key(last))
        return None if data is None else decode_segment(data, last)
    except CorruptDataError as exc:
        _logger.warning("reading log versions one by one instead of a damaged segment: %s", exc)
        return None


class RecentVersions:
    """The bytes of the newest versions a writer read or wrote (at most one segment's
    worth), from which the committer of a segment's last version writes the segment. Of a
    version a writer read only the head of (``LogObjects.get_head``), the head: its
    digest, not a segment's bytes."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[int, tuple[bytes | memoryview, bool]] = {}  # version -> (bytes, whole)

    def keep(self, version: int, data: bytes | memoryview, whole: bool = True) -> None:
        self._data[version] = (data, whole)
        self._data.pop(version - SEGMENT_VERSIONS, None)
        if len(self._data) > 2 * SEGMENT_VERSIONS:  # reloads skipped ahead: drop what they left behind
            self._data = {v: d for v, d in self._data.items() if v > version - SEGMENT_VERSIONS}

    def clear(self) -> None:
        self._data.clear()

    def get(self, version: int) -> bytes | memoryview | None:
        """The whole bytes of ``version``; None when not held, or only its head."""
        data, whole = self._data.get(version, (None, False))
        return data if whole else None

    def digest(self, version: int) -> str | None:
        """The digest of ``version`` as read or written (of its head, or of all of it)."""
        held = self._data.get(version)
        return None if held is None else log.digest(held[0])

    def write_segment(self, store: Store, last: int) -> bool:
        """The segment ending at version ``last``, if this writer holds all its versions.
        True if written (or somebody wrote it already)."""
        wanted = range(last - SEGMENT_VERSIONS + 1, last + 1)
        versions = [data for v in wanted if (data := self.get(v)) is not None]
        if len(versions) < len(wanted) or sum(len(v) for v in versions) > SEGMENT_MAX_BYTES:
            return False  # a writer that loaded mid-segment; readers read those versions one by one
        try:
            store.put_if_absent(segment_key(last), encode_segment(last, versions))
        except ObjectExistsError:
            pass  # the same versions' copy, by another writer of the same version number
        except StoreError as exc:
            _logger.warning("could not write the log segment ending at version %d: %s", last, exc)
            return False
        return True
