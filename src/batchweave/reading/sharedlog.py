"""One follower's proven log versions, kept for the ranks of a node, each at its own place.

A node's hub (``node``) runs one ``follower.ProvenLog`` for all its ranks. ``SharedLog``
is what the hub keeps between that follower and the ranks: the versions proven so far
(as bytes, as read), where each rank asks from, and when the follower must start again.
Every version it hands out was proven by the follower (I10); a rank never gets a version
from a follower started after the one that proved it was replaced.

**No rank can harm another through it (I11).** The follower is the node's, not a
requester's: it is started from a rank's place, but never with a rank's claims (an
anchor, versions said to exist): it proves its own view, so no request can make it
fail. What one rank asks never pulls it back once it serves others: a rank asking below
what is kept (an evaluation reader from step 0 beside training, a rank that came late
after a hub was replaced), or far beyond what is proven, is told to read ALONE: it
follows the log on its own (its reads are still shared) and asks again once it has
caught up with the head. A follower that failed (its start was reclaimed, the store
failed past its retries) tells its ranks ALONE too, never its error: each rank's own
follower then finds out what is true for that rank. The follower starts again only
where that harms nobody: when it serves no other rank, when it failed, or when it has
proven nothing yet (ranks of a node ask from nearby places in any order at a start).

The follower reads at most ``read_ahead`` versions beyond the furthest rank's request
(ranks ask as their own read-ahead needs). Each hub draws that margin at random from
``NODE_READ_AHEAD``: the nodes of a job consume in lockstep, and with one margin they
would all read each log segment in the same second (1,250 nodes: 1,250 requests a
second on one key); with margins spread over 64 to 1,024 versions, each segment's reads
spread over the time the job takes to consume 960 versions. When the kept versions
outgrow ``retain_bytes`` while the slowest rank is more than ``restart_window`` versions
behind the fastest, the slowest is let go (it hears ALONE when it asks next).

No threads and no I/O: the hub calls it under its lock, and the deterministic
simulation drives it inline (``InlineNode``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

from batchweave import keys, log
from batchweave.log import ReadVersion
from batchweave.reading.polling import MIN_PAUSE_S

__all__ = [
    "ALONE",
    "NODE_READ_AHEAD",
    "RESTART",
    "RESTART_WINDOW",
    "RETAIN_BYTES",
    "SERVE",
    "InlineNode",
    "NodeBehind",
    "SharedLog",
    "check_first",
]

RETAIN_BYTES = 64 << 20  # proven versions the hub keeps ahead of its slowest rank
RESTART_WINDOW = 1024  # versions kept behind the slowest rank, and a rank may ask beyond what is proven
NODE_READ_AHEAD = (64, 1024)  # versions a hub's follower reads beyond its furthest rank: drawn per hub
SERVE, RESTART, ALONE = "serve", "restart", "alone"  # what ``ask`` answers


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
        self._published = False  # this generation published a batch
        self.at_head = False  # the follower found no version past the newest published
        self.ended = False  # this generation published the end of the stream: nothing to follow after it

    def ask(self, rank: object, first: int) -> str:
        """``rank`` wants versions from ``first`` on: SERVE (from what is kept or will be),
        RESTART (the follower must start again at ``first``) or ALONE (the rank follows on
        its own until it has caught up with the head)."""
        base = self._base
        kept = base is not None and base <= first < self._head
        ahead = base is not None and self._failure is None and self._head <= first <= self._head + self.restart_window
        if kept or ahead:
            self._positions[rank] = first
            self._prune()
            return SERVE
        others = any(r != rank for r in self._positions)
        if base is None or self._failure is not None or not others or (not self._published and first < base):
            return self._restart(rank, first)  # nothing proven yet: restarting lower costs nobody anything
        self._positions.pop(rank, None)
        return ALONE

    def _restart(self, rank: object, first: int) -> str:
        self.generation += 1
        self._base = self._head = first
        self._versions.clear()
        self._retained = 0
        self._failure = None
        self._published = False
        self.at_head = False
        self.ended = False
        # A place far above the new start would drive the follower ahead of everyone.
        self._positions = {r: p for r, p in self._positions.items() if r != rank and p <= first + self.restart_window}
        self._positions[rank] = first
        return RESTART

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
    def failed(self) -> bool:
        """Whether the follower failed: a rank with every version proven before (``versions_from``
        gave None) reads ALONE."""
        return self._failure is not None

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
        self._published = True
        self.ended = self.ended or any(read.delta.end_of_stream for read in batch)
        self.at_head = self.ended
        return True

    def missed(self, generation: int) -> None:
        """Follower ``generation`` found no version past the newest it published."""
        if generation == self.generation:
            self.at_head = True

    def wants_more(self) -> bool:
        """Whether the follower should read on now: a rank is asking, fewer than
        ``read_ahead`` versions are proven beyond the furthest request, the stream has not
        ended (every rank stops at its end: probing past it until the last rank closes
        would cost requests for nothing), and the kept versions fit the budget (after
        letting a rank far behind go, if need be)."""
        if self.ended or not self._positions or self._head - max(self._positions.values()) >= self.read_ahead:
            return False
        return not self.trim(force=False)

    def fail(self, generation: int, error: Any) -> None:
        """Follower ``generation`` raised ``error`` after the versions it published."""
        if generation == self.generation:
            self._failure = error

    def trim(self, *, force: bool) -> bool:
        """Forget what every rank is past; then, over ``retain_bytes``, let the slowest
        rank go (it hears ALONE when it asks below what is kept) while it is more than
        ``restart_window`` versions behind the fastest, or always with ``force``. True
        when the kept versions are still over the budget (the follower should wait)."""
        self._prune()
        if self._retained > self.retain_bytes:
            self._prune(keep=0)  # the versions kept for late ranks go first
        while self._retained > self.retain_bytes and len(self._positions) > 1:
            slowest = min(self._positions, key=self._positions.__getitem__)
            fastest = max(self._positions.values())
            if not force and fastest - self._positions[slowest] <= self.restart_window:
                return True
            del self._positions[slowest]
            self._prune(keep=0)
        return self._retained > self.retain_bytes

    def _prune(self, keep: int | None = None) -> bool:
        """Forget versions every rank is past by more than ``keep`` (``restart_window``: a
        rank that starts late, as the ranks of a node do in any order, is served from what
        is kept rather than sent to read alone); True when any was forgotten."""
        if not self._positions or self._base is None:
            return False
        floor = min(self._positions.values()) - (self.restart_window if keep is None else keep)
        forgotten = False
        while self._base < floor and self._base in self._versions:
            self._retained -= len(self._versions.pop(self._base))
            self._base += 1
            forgotten = True
        return forgotten


class NodeBehind(Exception):
    """This rank reads on its own from ``next_version`` (the node told it ALONE, or its
    own check of what the node handed it failed); it asks the node again once it has
    caught up with the head."""

    def __init__(self, next_version: int, why: str = "far from the node's follower") -> None:
        super().__init__(f"{why}, at log version {next_version}")
        self.next_version = next_version


def check_first(batch: list[ReadVersion], anchor: tuple[int, str] | None) -> None:
    """A rank's own check of the first versions its node handed it: the version of its
    cursor must have the digest the cursor saved. The node's follower proves the log,
    not the rank's cursor; alone, the rank's follower says what is wrong."""
    if anchor is None or not batch or batch[0].delta.version != anchor[0]:
        return
    if log.digest(batch[0].data) != anchor[1]:
        raise NodeBehind(anchor[0], "its cursor's log version differs from the one the node read")


def decode_versions(parts: list[bytes] | list[memoryview], first: int) -> list[ReadVersion]:
    """Versions ``first``, ``first + 1``, ... from their bytes as the follower read them."""
    return [
        ReadVersion(log.decode_version(data, keys.version_key(first + i), first + i), data)
        for i, data in enumerate(parts)
    ]


class NodeFollower(Protocol):
    """What a rank asks of its node: the log's proven versions from ``first`` (lists of
    ``ReadVersion``, or the pause before asking again; ``NodeBehind`` or
    ``NodeUnavailableError`` when the rank must follow on its own), and one read per slice
    for the node. ``nodeclient.NodeClient`` asks the hub over a socket, ``InlineNode`` in
    this process."""

    def log(
        self,
        first: int,
        anchor: tuple[int, str] | None,
        present_through: int,
        next_step: Callable[[], int],
        url: str,
        stop: Any,
    ) -> Iterator[Any]: ...

    def read(self, key: str, start: int, length: int) -> memoryview: ...

    def close(self) -> None: ...


class InlineNode:
    """Node sharing without threads or sockets: the ranks of one process share one
    ``SharedLog`` and drive its follower themselves when they ask for a version not
    proven yet. For the deterministic simulation, where every actor runs inline; the
    same interface and the same answers as ``nodeclient.NodeClient``.

    Args:
        start_follower: ``first -> ProvenLog`` iterator (the node's: no rank's anchor).
        read_range: the store's ``get_range``.
        shared: the kept versions (a simulation makes the budgets small, so ranks fall
            behind and are let go within a short run).
    """

    def __init__(
        self,
        start_follower: Callable[[int], Iterator[Any]],
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
    ) -> Generator[Any, None, None]:
        rank = object()
        version = first
        try:
            while not stop.is_set():
                answer = self._shared.ask(rank, version)
                if answer == ALONE:
                    raise NodeBehind(version)
                if answer == RESTART or self._follower is None:
                    self._follower = self._start_follower(version)
                parts = self._shared.versions_from(version, 8 << 20)
                if parts is None and self._shared.failed:
                    raise NodeBehind(version, "the node's follower failed")
                if parts is None and self._advancing:
                    yield MIN_PAUSE_S  # another rank of the node is reading the log for both
                    continue
                if parts is None:
                    pause = self._advance()
                    if self._shared.failed:  # what it failed at is this rank's to find out, alone
                        raise NodeBehind(version, "the node's follower failed")
                    if pause and version <= present_through:
                        raise NodeBehind(version, "its cursor's log version is not in the node's view")
                    if pause is not None:
                        yield pause
                    continue
                batch = decode_versions(parts, version)
                if version == first:
                    check_first(batch, anchor)
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
        if item:
            self._shared.missed(generation)
        return item

    def read(self, key: str, start: int, length: int) -> memoryview:
        return self._read_range(key, start, length)

    def close(self) -> None:
        """Nothing: the node's follower lives as long as its ranks (one rank closing
        leaves it to the others)."""
