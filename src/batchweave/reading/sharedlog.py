"""One follower's proven log versions, kept for the ranks of a node, each at its own place.

A node's hub (``node``) runs one ``follower.ProvenLog`` for all its ranks. ``SharedLog``
is what the hub keeps between that follower and the ranks: the versions proven so far
(as bytes, as read), where each rank asks from, and when the follower must start again
lower (a rank asks for a version the hub has forgotten or never had). Every version it
hands out was proven by the follower (I10); a rank never gets a version from a follower
started after the one that proved it was replaced, since a restart keeps only versions
proven before (they stay genuine: a version, once proven, is the log's forever).

The follower reads at most ``read_ahead`` versions beyond the furthest rank's request
(ranks ask as their own read-ahead needs). Each hub draws that margin at random from
``NODE_READ_AHEAD``: the nodes of a job consume in lockstep, and with one margin they
would all read each log segment in the same second (1,250 nodes: 1,250 requests a
second on one key); with margins spread over 64 to 1,024 versions, each segment's reads
spread over the time the job takes to consume 960 versions.

A rank far behind the others (an evaluation reader from step 0 beside training at the
head) must not hold the follower back, nor pull it back: a rank asking more than
``RESTART_WINDOW`` versions below what is kept is told it is *behind* and follows the
log on its own (its reads are still shared), and when the kept versions outgrow
``retain_bytes`` while the slowest rank is that far behind the fastest, it is let go
the same way (otherwise the follower waits for it). Within the window, the follower
starts again lower: after a hub is replaced, the ranks ask from nearby places in any
order, and re-reading a few versions costs the others a moment.

No threads and no I/O: the hub calls it under its lock, and the deterministic
simulation drives it inline (``InlineNode``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from batchweave import keys, log
from batchweave.errors import DataReclaimedError
from batchweave.log import ReadVersion
from batchweave.reading.polling import MIN_PAUSE_S

__all__ = [
    "BEHIND",
    "NODE_READ_AHEAD",
    "RESTART",
    "RESTART_WINDOW",
    "RETAIN_BYTES",
    "SERVE",
    "InlineNode",
    "NodeBehind",
    "SharedLog",
]

RETAIN_BYTES = 64 << 20  # proven versions the hub keeps ahead of its slowest rank
RESTART_WINDOW = 1024  # versions a rank may ask below what is kept and still be served (by a restart)
NODE_READ_AHEAD = (64, 1024)  # versions a hub's follower reads beyond its furthest rank: drawn per hub
SERVE, RESTART, BEHIND = "serve", "restart", "behind"  # what ``ask`` answers


class SharedLog:
    """The proven versions of a node's follower (see the module doc)."""

    def __init__(
        self,
        retain_bytes: int = RETAIN_BYTES,
        restart_window: int = RESTART_WINDOW,
        read_ahead: int = NODE_READ_AHEAD[1],
    ) -> None:
        self.retain_bytes = retain_bytes
        self.restart_window = restart_window
        self.read_ahead = read_ahead
        self._head = 0  # the version after the newest one published
        self.generation = 0  # of the follower; ``ask`` starts the next one
        self._versions: dict[int, bytes] = {}
        self._retained = 0  # their bytes
        self._base: int | None = None  # the lowest version that can still be handed out
        self._failure: Any = None  # what the follower raised: final for this generation
        self._positions: dict[object, int] = {}  # rank -> the version it asked for last

    def ask(self, rank: object, first: int) -> str:
        """``rank`` wants versions from ``first`` on: SERVE (from what is kept or will be),
        RESTART (the follower must start again at ``first``: nothing is followed yet, or
        ``first`` is a little below what is kept) or BEHIND (far below: the rank follows
        on its own)."""
        if self._base is not None and first < self._base:
            if self._base - first > self.restart_window and any(r != rank for r in self._positions):
                self._positions.pop(rank, None)
                return BEHIND
        if self._base is None or first < self._base:
            self.generation += 1
            self._base = first
            self._failure = None
            self._positions[rank] = first
            return RESTART
        self._positions[rank] = first
        self._prune()
        return SERVE

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
        self._head = max(self._head, batch[-1].delta.version + 1)
        return True

    def wants_more(self) -> bool:
        """Whether the follower should read on now: a rank is asking, fewer than
        ``read_ahead`` versions are proven beyond the furthest request, and the kept
        versions fit the budget (after letting a rank far behind go, if need be)."""
        if not self._positions or self._head - max(self._positions.values()) >= self.read_ahead:
            return False
        return not self.trim(force=False)

    def fail(self, generation: int, error: Any) -> None:
        """Follower ``generation`` raised ``error`` after the versions it published."""
        if generation == self.generation:
            self._failure = error

    def trim(self, *, force: bool) -> bool:
        """Forget what every rank is past; then, over ``retain_bytes``, let the slowest
        rank go (it hears BEHIND when it asks below what is kept) while it is more than
        ``restart_window`` versions behind the fastest, or always with ``force``. True
        when the kept versions are still over the budget (the follower should wait)."""
        self._prune()
        while self._retained > self.retain_bytes and len(self._positions) > 1:
            slowest = min(self._positions, key=self._positions.__getitem__)
            fastest = max(self._positions.values())
            if not force and fastest - self._positions[slowest] <= self.restart_window:
                return True
            del self._positions[slowest]
            self._prune()
        return self._retained > self.retain_bytes

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


class NodeBehind(Exception):
    """This rank asked far below what its node's follower keeps: it follows on its own
    from ``next_version``."""

    def __init__(self, next_version: int) -> None:
        super().__init__(f"far behind the node's follower at version {next_version}")
        self.next_version = next_version


def decode_versions(parts: list[bytes] | list[memoryview], first: int) -> list[ReadVersion]:
    """Versions ``first``, ``first + 1``, ... from their bytes as the follower read them."""
    return [
        ReadVersion(log.decode_version(data, keys.version_key(first + i), first + i), data)
        for i, data in enumerate(parts)
    ]


class InlineNode:
    """Node sharing without threads or sockets: the ranks of one process share one
    ``SharedLog`` and drive its follower themselves when they ask for a version not
    proven yet. For the deterministic simulation, where every actor runs inline; the
    same interface as ``nodeclient.NodeClient``.

    Args:
        start_follower: ``(first, anchor, present_through) -> ProvenLog`` iterator.
        read_range: the store's ``get_range``.
        shared: the kept versions (a simulation makes the budgets small, so ranks fall
            behind and are let go within a short run).
    """

    def __init__(
        self,
        start_follower: Callable[[int, tuple[int, str] | None, int], Iterator[Any]],
        read_range: Callable[[str, int, int], memoryview],
        shared: SharedLog | None = None,
    ) -> None:
        self._start_follower = start_follower
        self._read_range = read_range
        self._shared = shared or SharedLog()
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
                answer = self._shared.ask(rank, version)
                if answer == BEHIND:
                    raise NodeBehind(version)
                if answer == RESTART or self._follower is None:
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
            self._shared.trim(force=True)  # inline, a rank that waited for another could wait forever
            return None
        return item

    def read(self, key: str, start: int, length: int) -> memoryview:
        return self._read_range(key, start, length)

    def close(self) -> None:
        """Nothing: the node's follower lives as long as its ranks (one rank closing
        leaves it to the others)."""
