"""Reading the log ahead: a reader learns where each step lives one log version at a
time, so a backlog committed one TGB per version would cost one round trip per step if
versions were read one after another. ``LogReadAhead`` probes several version numbers
at once while they keep existing and falls back to a single probe at the head.

Versions are immutable once written, so a version read early is as good as one read
late; only a miss is stale information (the version may be committed a moment later),
so a miss discards every speculative read beyond it and the next call probes again.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from batchweave.journal import Journal
from batchweave.log import LogVersion

__all__ = ["DEFAULT_LOG_READ_AHEAD", "LogReadAhead"]

# Versions probed at once at most: 64 reads of 25 ms each keep 2,560 versions a second
# coming, ahead of what one rank consumes, while a reader at the head probes only one.
DEFAULT_LOG_READ_AHEAD = 64
FIRST_WINDOW = 8  # probes at the start; at most 7 are wasted, once, by a reader at the head


class LogReadAhead:
    """Hands out log versions in order from ``first_version`` on, reading ahead.

    The window of concurrent reads starts at ``FIRST_WINDOW`` (a reader that starts
    usually starts behind: a backlog is in full flight after two round trips), doubles
    with every version found up to ``depth``, and drops back to one at the first miss;
    from there it doubles again only from the second version found in a row, so a reader
    following the head probes one version at a time.
    """

    def __init__(self, journal: Journal, first_version: int, depth: int = DEFAULT_LOG_READ_AHEAD) -> None:
        self._journal = journal
        self._next = first_version
        self._depth = depth
        self._window = min(FIRST_WINDOW, depth)
        self._hits = FIRST_WINDOW  # versions found since the last miss (a start counts as a run)
        self._reads: dict[int, Future[LogVersion | None]] = {}
        # depth 1 (a local directory) reads in the caller's thread: nothing to overlap
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="batchweave-log") if depth > 1 else None

    @property
    def next_version(self) -> int:
        """The version the next call to ``next()`` returns."""
        return self._next

    def next(self) -> LogVersion | None:
        """Version ``next_version``, or None when it is not committed yet (call again)."""
        if self._pool is None:
            delta = self._journal.read_version(self._next)
            self._next += delta is not None
            return delta
        self._issue()
        delta = self._reads.pop(self._next).result()
        if delta is None:
            self._window = 1
            self._hits = 0
            self._reads.clear()  # misses beyond this one are stale; hits are re-read cheaply
            return None
        self._next += 1
        self._hits += 1
        if self._hits >= 2:  # two in a row: a backlog, not a reader at the head catching one commit
            self._window = min(self._window * 2, self._depth)
        return delta

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _issue(self) -> None:
        assert self._pool is not None
        for version in range(self._next, self._next + self._window):
            if version not in self._reads:
                self._reads[version] = self._pool.submit(self._journal.read_version, version)
