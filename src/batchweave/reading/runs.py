"""Runs: one read for a rank's ranges of consecutive steps that lie back to back in one object.

A producer may write k consecutive TGBs as one object, slice-major (slice 0 of each TGB,
then slice 1 of each, ...), so a rank's ranges of steps t..t+k-1 follow one another in
one key. Reading each with its own request costs a round trip (about 25 ms on a cloud
store) per step; ``RangeRuns`` reads such a chain with one request instead.

The pipeline tells it, in step order, every range the rank will read (``expect``); a
range that starts in the same object exactly where the last range of an open run ends
joins that run, within ``MAX_RUN_BYTES``. The first member of a run to be read
(``read``) makes the run's one read of everything the run holds at that moment, and
the others take their piece of its buffer: they wait for that read, not for one of
their own. A run takes no new member once its read has started.

The tables hold only what is still to come: runs open to new members, and ranges
expected but not read. A run is dropped from them once its read starts and once its
last member took its piece, and ``close`` forgets everything (a reader that closes
mid-run); a read that was never expected is made on its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["MAX_RUN_BYTES", "RangeRuns"]

# The most bytes one run reads. A request's fixed cost (about 25 ms on a cloud store)
# is already small beside the transfer of a few MiB (one connection streams about
# 100 MB/s: 4 MiB take about 40 ms), so larger runs save few requests, while they cost
# memory and latency: a run's buffer lives as long as any step decoded from it (its
# arrays are views), the reads ahead may overshoot the fetch window's byte budget by
# up to one run, and the run's first step waits for the whole run.
MAX_RUN_BYTES = 4 << 20

Read = Callable[[str, int, int], memoryview]  # (key, start, length) -> bytes read


class _Run:
    """Adjacent ranges of one object, read together: ``key``'s bytes ``start``..``end``."""

    __slots__ = ("end", "key", "members", "read", "start")

    def __init__(self, key: str, start: int) -> None:
        self.key = key
        self.start = start
        self.end = start
        self.members = 0  # expected ranges of the run not read yet
        self.read: Future[memoryview] | None = None  # set once a member starts the run's read


class RangeRuns:
    """Coalesces the expected reads of back-to-back ranges (see the module doc).

    Args:
        max_run_bytes: the most bytes one read covers (a range longer than this is read
            alone).
    """

    def __init__(self, max_run_bytes: int = MAX_RUN_BYTES) -> None:
        self._max = max_run_bytes
        self._lock = threading.Lock()
        # Runs not read yet, by (key, end): the range that starts there may join.
        self._open: dict[tuple[str, int], _Run] = {}
        # Each range expected and not read yet, with its run (a list: a log may name
        # one range twice), in the order expected.
        self._expected: dict[tuple[str, int, int], deque[_Run]] = {}

    @property
    def pending(self) -> int:
        """Ranges expected and not read yet (0 once every one was read, or after ``close``)."""
        with self._lock:
            return sum(len(runs) for runs in self._expected.values())

    @property
    def open_runs(self) -> int:
        """Runs that may still take members (their read has not started)."""
        with self._lock:
            return len(self._open)

    def expect(self, key: str, offset: int, length: int) -> bool:
        """A range the reader will read (ranges of later steps come later). True when it
        joined the run of a range expected before it: the read of that range (made
        first, since ranges are read in the order expected) brings this one's bytes."""
        with self._lock:
            run = self._open.pop((key, offset), None)
            joined = run is not None and offset + length - run.start <= self._max
            if run is None or not joined:
                run = _Run(key, offset)
            run.end = offset + length
            run.members += 1
            self._open[(key, run.end)] = run
            self._expected.setdefault((key, offset, length), deque()).append(run)
            return joined

    def span(self, key: str, offset: int, length: int) -> int:
        """The bytes the read of this expected range brings: its run's, so far (``length``
        when it is not expected)."""
        with self._lock:
            runs = self._expected.get((key, offset, length))
            return runs[0].end - runs[0].start if runs else length

    def read(self, key: str, offset: int, length: int, get: Read) -> memoryview:
        """``length`` bytes of ``key`` from ``offset``: a piece of its run's one read
        (``get(key, start, length)``, made by whichever member comes first), or a read
        of its own if it was not expected. Raises what the run's read raised. The piece
        is short if the object is (the caller checks the length, as for any read)."""
        fill: Future[memoryview] | None = None
        with self._lock:
            run = self._take(key, offset, length)
            if run is not None and run.read is None:  # the first member: it reads for the run
                if self._open.get((key, run.end)) is run:
                    del self._open[(key, run.end)]  # no member joins a run being read
                if run.members:  # else the run is this range alone: no hand-off to pay for
                    fill = run.read = Future()
        if run is None or run.read is None:  # never expected (or forgotten by ``close``), or alone
            return get(key, offset, length)
        if fill is not None:
            _fill(fill, get, run)
        data = run.read.result()  # bounded: the read is the store's (or hub's), with their deadlines
        return data[offset - run.start : offset - run.start + length]

    def close(self) -> None:
        """Forget every expected range and open run (the reader stops: no more reads).
        Reads in flight end as they would; their members that still come read alone."""
        with self._lock:
            self._open.clear()
            self._expected.clear()

    def _take(self, key: str, offset: int, length: int) -> _Run | None:
        """The run of the first expectation of this range, which is consumed."""
        runs = self._expected.get((key, offset, length))
        if not runs:
            return None
        run = runs.popleft()
        run.members -= 1
        if not runs:
            del self._expected[(key, offset, length)]
        return run


def _fill(read: Future[memoryview], get: Read, run: _Run) -> None:
    """Make the run's read; its result or error is every member's."""
    try:
        data = get(run.key, run.start, run.end - run.start)
    except BaseException as exc:  # even an interrupt: the members waiting must wake
        read.set_exception(exc)
    else:
        read.set_result(data)
