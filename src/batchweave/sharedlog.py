"""One follower's proven log versions, kept for the ranks of a node, each at its own place.

A node's hub (``node``) runs one ``follower.ProvenLog`` for all its ranks. ``SharedLog``
is what the hub keeps between that follower and the ranks: the versions proven so far
(as bytes, as read), where each rank asks from, and when the follower must start again
lower (a rank asks for a version the hub has forgotten or never had). Every version it
hands out was proven by the follower (I10); a rank never gets a version from a follower
started after the one that proved it was replaced, since a restart keeps only versions
proven before (they stay genuine: a version, once proven, is the log's forever).

No threads and no I/O: the hub calls it under its lock, and the deterministic
simulation drives it inline (``InlineNode``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from batchweave import log
from batchweave.errors import DataReclaimedError
from batchweave.log import ReadVersion
from batchweave.polling import MIN_PAUSE_S

__all__ = ["RETAIN_BYTES", "InlineNode", "SharedLog"]

RETAIN_BYTES = 64 << 20  # proven versions the hub keeps ahead of its slowest rank


class SharedLog:
    """The proven versions of a node's follower (see the module doc)."""

    def __init__(self, retain_bytes: int = RETAIN_BYTES) -> None:
        self.retain_bytes = retain_bytes
        self.generation = 0  # of the follower; ``ask`` starts the next one
        self._versions: dict[int, bytes] = {}
        self._retained = 0  # their bytes
        self._base: int | None = None  # the lowest version that can still be handed out
        self._failure: Any = None  # what the follower raised: final for this generation
        self._positions: dict[object, int] = {}  # rank -> the version it asked for last

    def ask(self, rank: object, first: int) -> bool:
        """``rank`` wants versions from ``first`` on. True when the follower must start
        (again) at ``first``: nothing is followed yet, or ``first`` is below what is kept."""
        restart = self._base is None or first < self._base
        if restart:
            self.generation += 1
            self._base = first
            self._failure = None
        self._positions[rank] = first
        self._prune()
        return restart

    def leave(self, rank: object) -> None:
        self._positions.pop(rank, None)
        self._prune()

    def versions_from(self, first: int, max_bytes: int) -> list[bytes] | None:
        """Kept versions from ``first`` on, in order (about ``max_bytes`` at most; at
        least one), or None when ``first`` is not proven yet."""
        out: list[bytes] = []
        size = 0
        version = first
        while version in self._versions and (not out or size < max_bytes):
            out.append(self._versions[version])
            size += len(out[-1])
            version += 1
        return out or None

    @property
    def failure(self) -> Any:
        """What the follower raised (None if nothing): for a rank that has every version
        proven before it (``versions_from`` gave None)."""
        return self._failure

    def publish(self, generation: int, batch: list[ReadVersion]) -> bool:
        """Keep a proven batch of follower ``generation``; False if that follower was
        replaced (it must stop)."""
        if generation != self.generation:
            return False
        for read in batch:
            if read.delta.version not in self._versions:
                self._versions[read.delta.version] = bytes(read.data)
                self._retained += len(read.data)
        return True

    def fail(self, generation: int, error: Any) -> None:
        """Follower ``generation`` raised ``error`` after the versions it published."""
        if generation == self.generation:
            self._failure = error

    def full(self) -> bool:
        """Over the budget with nothing to forget: the follower waits for the slowest rank."""
        return self._retained > self.retain_bytes and not self._prune()

    def _prune(self) -> bool:
        """Forget versions every rank is past; True when any was forgotten."""
        if not self._positions or self._base is None:
            return False
        slowest = min(self._positions.values())
        forgotten = False
        while self._base < slowest and self._base in self._versions:
            self._retained -= len(self._versions.pop(self._base))
            self._base += 1
            forgotten = True
        return forgotten


def decode_versions(parts: list[bytes] | list[memoryview], first: int) -> list[ReadVersion]:
    """Versions ``first``, ``first + 1``, ... from their bytes as the follower read them."""
    return [
        ReadVersion(log.decode_version(data, log.version_key(first + i), first + i), data)
        for i, data in enumerate(parts)
    ]


class InlineNode:
    """Node sharing without threads or sockets: the ranks of one process share one
    ``SharedLog`` and drive its follower themselves when they ask for a version not
    proven yet. For the deterministic simulation, where every actor runs inline; the
    same interface as ``node.NodeClient``.

    Args:
        start_follower: ``(first, anchor, present_through) -> ProvenLog`` iterator.
        read_range: the store's ``get_range``.
    """

    def __init__(
        self,
        start_follower: Callable[[int, tuple[int, str] | None, int], Iterator[Any]],
        read_range: Callable[[str, int, int], memoryview],
    ) -> None:
        self._start_follower = start_follower
        self._read_range = read_range
        self._shared = SharedLog()
        self._follower: Iterator[Any] | None = None
        self._advancing = False  # a rank is inside the follower (it waits on the store)

    def log(
        self,
        first: int,
        anchor: tuple[int, str] | None,
        present_through: int,
        next_step: Callable[[], int],
        url: str,
        stop: Any,
    ) -> Iterator[Any]:
        rank = object()
        version = first
        try:
            while not stop.is_set():
                if self._shared.ask(rank, version) or self._follower is None:
                    self._follower = self._start_follower(version, anchor, present_through)
                parts = self._shared.versions_from(version, 8 << 20)
                failure = self._shared.failure
                if parts is None and isinstance(failure, DataReclaimedError):  # said with this rank's step
                    raise DataReclaimedError(url, next_step(), failure.oldest)
                if parts is None and failure is not None:
                    raise failure
                if parts is None and self._advancing:
                    yield MIN_PAUSE_S  # another rank of the node is reading the log for both
                    continue
                if parts is None:
                    pause = self._advance()
                    if pause is not None:
                        yield pause
                    continue
                batch = decode_versions(parts, version)
                version += len(batch)
                yield batch
        finally:
            self._shared.leave(rank)

    def _advance(self) -> float | None:
        """One step of the shared follower: None after a batch was kept, else its pause."""
        assert self._follower is not None
        generation = self._shared.generation
        self._advancing = True
        try:
            item = next(self._follower)
        except Exception as exc:
            self._shared.fail(generation, exc)
            self._follower = None
            return None
        finally:
            self._advancing = False
        if isinstance(item, list):
            self._shared.publish(generation, item)
            return None
        return item

    def read(self, key: str, start: int, length: int) -> memoryview:
        return self._read_range(key, start, length)

    def close(self) -> None:
        """Nothing: the node's follower lives as long as its ranks (one rank closing
        leaves it to the others)."""
