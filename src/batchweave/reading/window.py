"""The fetch window: one rank's steps fetched ahead of the one it is handed, in order.

A step's fetch starts once fewer than ``depth`` steps before it are still to be handed
to the consumer: the window slides by one with every step handed out, so at most
``depth`` steps are fetched or in flight beyond it (the reader's memory bound). The
steps are queued, in order, as soon as the log shows them, and each waits for its turn
on the fetch thread that will read it, not on the thread that reads the log: that one
goes on reading and proving the log while the window is full, and a step handed out
starts the next fetch at once instead of at the log's next event (at a start, that
left half the window idle for a round trip).
"""

from __future__ import annotations

import threading

__all__ = ["FetchWindow"]


class FetchWindow:
    """Turns for ``depth`` fetches ahead of the step being handed out, in queue order."""

    def __init__(self, depth: int, stop: threading.Event) -> None:
        self.depth = depth
        self._stop = stop
        self._changed = threading.Condition()  # guards the counts; the log reader waits on it for room
        self._queued = 0  # steps queued so far; the next one's turn number
        self._handed = 0  # steps handed to the consumer
        # Fetch threads waiting for their turn, by turn: a step handed out wakes the one
        # thread whose turn it opens, not every waiting one.
        self._turns: dict[int, threading.Event] = {}

    @property
    def waiting(self) -> int:
        """Steps queued and not handed out yet (fetched, in flight, or waiting their turn)."""
        with self._changed:
            return self._queued - self._handed

    def queue(self) -> int:
        """The turn of the next step queued (steps are queued in step order)."""
        with self._changed:
            self._queued += 1
            return self._queued - 1

    def wait_turn(self, turn: int) -> bool:
        """Wait until step ``turn`` may be fetched; False if the reader is closing."""
        with self._changed:
            if turn < self._handed + self.depth or self._stop.is_set():
                return not self._stop.is_set()
            opened = self._turns[turn] = threading.Event()
        opened.wait()  # set by the step handed out that opens this turn, or by close()
        return not self._stop.is_set()

    def wait_room(self, most: int) -> bool:
        """Wait until at most ``most`` steps are queued and not handed out; False if closing."""
        with self._changed:
            self._changed.wait_for(lambda: self._queued - self._handed <= most or self._stop.is_set())
            return not self._stop.is_set()

    def handed(self) -> None:
        """One more step was handed to the consumer: the next turn may fetch."""
        with self._changed:
            self._handed += 1
            opened = self._turns.pop(self._handed + self.depth - 1, None)
            self._changed.notify_all()  # the log reader, if it waits for room
        if opened is not None:
            opened.set()

    def close(self) -> None:
        """Wake every waiter (the reader's ``stop`` is set): they return False."""
        with self._changed:
            waiting, self._turns = list(self._turns.values()), {}
            self._changed.notify_all()
        for opened in waiting:
            opened.set()
