"""The fetch window: one rank's steps fetched ahead of the one it is handed, in order.

A step's fetch starts once fewer than ``depth`` steps before it are still to be handed
to the consumer, and, with a byte budget, once its bytes fit in the budget beside those of
the steps before it that are not handed out yet (the first step not handed out always
fits, however large). The window slides with every step handed out, so at most ``depth``
steps and ``budget_bytes`` bytes (or one step) are fetched or in flight beyond it: the
reader's memory bound, whatever sizes later steps have. The steps are queued, in order, as
soon as the log shows them, and each waits for its turn on the fetch thread that will read
it, not on the thread that reads the log: that one goes on reading and proving the log
while the window is full, and a step handed out starts the next fetch at once instead of
at the log's next event (at a start, that left half the window idle for a round trip).

``WindowRoom`` is the rule alone (pure); ``FetchWindow`` the threads' side of it.
"""

from __future__ import annotations

import threading
from collections import deque

__all__ = ["FetchWindow", "WindowRoom"]


class WindowRoom:
    """Which queued steps may be fetched: at most ``depth`` steps and ``budget_bytes``
    bytes (None: no byte bound) from the first step not handed out, which always may.
    Turns open in queue order; ``opened`` is the first turn that may not be fetched yet."""

    def __init__(self, depth: int, budget_bytes: int | None = None) -> None:
        self.depth = depth
        self.budget_bytes = budget_bytes
        self.handed = 0  # steps handed to the consumer
        self.opened = 0  # turns below this may be fetched
        self.open_bytes = 0  # bytes of the turns handed..opened-1
        self._sizes: deque[int] = deque()  # bytes of each turn from ``handed`` on

    @property
    def queued(self) -> int:
        return self.handed + len(self._sizes)

    def queue(self, nbytes: int) -> range:
        """One more step of ``nbytes``; the turns this opens."""
        self._sizes.append(nbytes)
        return self._open()

    def hand(self) -> range:
        """The first step not handed out was handed out; the turns this opens."""
        self.open_bytes -= self._sizes.popleft()
        self.handed += 1
        return self._open()

    def _open(self) -> range:
        first = self.opened
        while self.opened < self.queued and self._fits(self._sizes[self.opened - self.handed]):
            self.open_bytes += self._sizes[self.opened - self.handed]
            self.opened += 1
        return range(first, self.opened)

    def _fits(self, nbytes: int) -> bool:
        if self.opened - self.handed >= self.depth:
            return False
        if self.opened == self.handed or self.budget_bytes is None:
            return True
        return self.open_bytes + nbytes <= self.budget_bytes


class FetchWindow:
    """Turns for the fetches ahead of the step being handed out, in queue order, as
    ``WindowRoom`` allows (``depth`` steps; ``budget_bytes`` bytes, None: no byte bound)."""

    def __init__(self, depth: int, stop: threading.Event, budget_bytes: int | None = None) -> None:
        self.depth = depth
        self._stop = stop
        self._changed = threading.Condition()  # guards the room; the log reader waits on it for room
        self._room = WindowRoom(depth, budget_bytes)
        # Fetch threads waiting for their turn, by turn: a step handed out wakes the threads
        # whose turns it opens, not every waiting one.
        self._turns: dict[int, threading.Event] = {}

    @property
    def waiting(self) -> int:
        """Steps queued and not handed out yet (fetched, in flight, or waiting their turn)."""
        with self._changed:
            return self._room.queued - self._room.handed

    def queue(self, nbytes: int = 0) -> int:
        """The turn of the next step queued, of ``nbytes`` (steps are queued in step order)."""
        with self._changed:
            self._room.queue(nbytes)  # opens no turn a thread waits for: none waits for this one yet
            return self._room.queued - 1

    def wait_turn(self, turn: int) -> bool:
        """Wait until step ``turn`` may be fetched; False if the reader is closing."""
        with self._changed:
            if turn < self._room.opened or self._stop.is_set():
                return not self._stop.is_set()
            opened = self._turns[turn] = threading.Event()
        opened.wait()  # set by the step handed out that opens this turn, or by close()
        return not self._stop.is_set()

    def wait_room(self, most: int) -> bool:
        """Wait until at most ``most`` steps are queued and not handed out; False if closing."""
        with self._changed:
            self._changed.wait_for(lambda: self._room.queued - self._room.handed <= most or self._stop.is_set())
            return not self._stop.is_set()

    def handed(self) -> None:
        """One more step was handed to the consumer: the turns that now fit may fetch."""
        with self._changed:
            opened = [event for turn in self._room.hand() if (event := self._turns.pop(turn, None)) is not None]
            self._changed.notify_all()  # the log reader, if it waits for room
        for event in opened:
            event.set()

    def close(self) -> None:
        """Wake every waiter (the reader's ``stop`` is set): they return False."""
        with self._changed:
            waiting, self._turns = list(self._turns.values()), {}
            self._changed.notify_all()
        for opened in waiting:
            opened.set()
