"""Reading the log ahead: a reader learns where each step lives one log version at a
time, so a backlog committed one TGB per version would cost one round trip per step if
versions were read one after another. ``LogReadAhead`` reads a backlog by segments (32
versions in one object, see ``segment``), several at once, probes version numbers one by
one only where no segment exists (yet), and falls back to a single probe at the head.

Versions are immutable once written, so a version read early is as good as one read
late; only a miss is stale information (the version may be committed a moment later),
so a miss discards every speculative read beyond it and the next call probes again.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, cast

from batchweave import retry
from batchweave.journal import Journal
from batchweave.keys import HEAD_RING
from batchweave.log import LogVersion, ReadVersion
from batchweave.segment import SEGMENT_VERSIONS, segment_last

__all__ = ["DEFAULT_LOG_READ_AHEAD", "LogReadAhead"]

# Versions read ahead at most: two segments, or 64 single probes of 25 ms each, keep
# 2,560 versions a second coming, ahead of what one rank consumes, while a reader at the
# head probes only one.
DEFAULT_LOG_READ_AHEAD = 64
FIRST_WINDOW = 8  # probes at the start (beside the first segment): at most 8 spare requests, once
# Near the head with copies, a follower catches up the few versions committed during its
# pause (about 6 at 1,250 nodes) two at a time: a wider window probed past the head on
# every visit (2.1 requests a version a node instead of about 1.3).
NEAR_HEAD_WINDOW = 2


class LogReadAhead:
    """Hands out log versions in order from ``first_version`` on, reading ahead.

    The window of versions read ahead starts at ``FIRST_WINDOW`` (a reader that starts
    usually starts behind: a backlog is in full flight after two round trips), grows by
    one with every version found (doubling each round trip) up to ``depth``, and drops
    back to one at the first miss; from there it grows again only from the second
    version found in a row, so a reader following the head probes one version at a time.
    While versions keep being found (a backlog), the window is read by segments; single
    probes cover the versions of a segment found missing. At a start the first window is
    probed one by one beside the first segment, whichever answers first (a short log has
    no segment yet), and no probe goes past a miss another probe has already found.
    ``depth`` 1 reads in the caller's thread (a local directory: nothing to overlap), one
    segment or version at a time.

    With ``copies`` (``journal.headcopies``; a follower of a large job, whose head budget
    allows a probe only every few seconds per key), the versions near the head (fewer
    than ``HEAD_RING`` past where the reader last missed) are read one by one, each from
    one of its ``copies + 1`` keys at random (its own, or a copy), never from segments:
    all the job's followers read them within a few seconds, and spread over the keys so.
    Elsewhere (a start, a backlog) only a version's own key and segments are read:
    copies hold only the newest versions.
    """

    def __init__(
        self,
        journal: Journal[LogVersion],
        first_version: int,
        depth: int = DEFAULT_LOG_READ_AHEAD,
        *,
        stop: threading.Event | None = None,
        copies: int = 0,
    ) -> None:
        self._journal = journal
        self._next = first_version
        self._depth = depth
        self._copies = copies
        self._window = min(FIRST_WINDOW, depth)
        self._hits = FIRST_WINDOW  # versions found since the last miss (a start counts as a run)
        self._missed_at: int | None = None  # the version of the last miss: the head then
        self._reads: dict[int, Future[ReadVersion | None]] = {}
        self._segment_reads: dict[int, Future[list[ReadVersion] | None]] = {}  # by the segment's last version
        self._absent_segment = 0  # the last version of the newest segment found missing
        self._found: dict[int, ReadVersion] = {}  # versions a segment gave, not handed out yet
        # Whole segments ahead are worth reading at a start and after a segment was found;
        # a reader that just caught one commit at the head reads one segment at most.
        self._deep = True
        # At a start, whether the first segment exists is not known: its versions are probed
        # one by one at the same time, and whichever answers first is used (a short log has
        # no segment, and waiting for that miss cost a round trip before the first version).
        self._racing = depth > 1
        # Racing, only the first window is probed one by one: the segment, asked for at the
        # same time, usually answers with it, and then holds the rest (probes past the
        # first window were spare requests, a dozen a start).
        self._race_end = first_version + FIRST_WINDOW
        # The lowest version a finished single probe found missing: no probe goes past it
        # (they would all miss; the reader stops there and probes again).
        self._missing_from: int | None = None
        self._misses = threading.Lock()
        self._misses_since = 0  # counts the misses handed out: a probe issued before one is stale
        # ``stop`` set (the reader is closing): reads in flight stop retrying a failing store.
        self._pool = (
            ThreadPoolExecutor(
                max_workers=depth,
                thread_name_prefix="batchweave-log",
                initializer=retry.stop_retrying_when,
                initargs=(stop,),
            )
            if depth > 1
            else None
        )
        # Proofs run apart from the reads: never queued behind them, and never cancelled when
        # the reader closes (a pipeline delivers the steps read beside a proof once it is done).
        self._beside = (
            ThreadPoolExecutor(
                max_workers=1,  # one proof at a time, in the order they were asked for
                thread_name_prefix="batchweave-proof",
                initializer=retry.stop_retrying_when,
                initargs=(stop,),
            )
            if depth > 1
            else None
        )

    @property
    def next_version(self) -> int:
        """The version the next call to ``next()`` returns."""
        return self._next

    def next(self) -> ReadVersion | None:
        """Version ``next_version`` with its bytes, or None when it is not committed yet
        (call again). Not proven: the reader proves a batch before using it (I10)."""
        delta = self._found.pop(self._next, None) or self._from_segment() or self._probe()
        if delta is None:
            self._window = 1
            self._hits = 0
            self._missed_at = self._next
            self._reads.clear()  # misses beyond this one are stale; hits are re-read cheaply
            self._segment_reads.clear()
            self._deep = False
            self._racing = False
            with self._misses:
                self._missing_from = None
                self._misses_since += 1
            return None
        self._next += 1
        self._hits += 1
        if self._hits >= 2:  # two in a row: a backlog, not a reader at the head catching one commit
            # One more per version found: the window doubles once per round trip (a whole
            # window found), as TCP's slow start, so the probes past the head, all misses,
            # stay within what the last round trip found. Doubling per version found had
            # a short log probed 32 versions ahead by its fifth version.
            self._window = min(self._window + 1, self._depth if not self._near_head(self._next) else NEAR_HEAD_WINDOW)
        return delta

    def ready(self) -> bool:
        """Whether ``next()`` would return without waiting for a request: a reader proves
        the versions it holds before it waits for more."""
        if self._next in self._found:
            return True
        pending = self._reads.get(self._next)
        if pending is None and self._in_backlog(self._next):
            pending = self._segment_reads.get(segment_last(self._next))
        return pending is not None and pending.done()

    def pending(self) -> bool:
        """Whether a read that will give ``next()`` its version is in flight already."""
        if self._next in self._found or self._next in self._reads:
            return True
        return self._in_backlog(self._next) and segment_last(self._next) in self._segment_reads

    def beside(self, work: Callable[..., None], *args: Any) -> Future[None]:
        """Run ``work(*args)`` on a thread of its own while reading goes on (a reader's proof
        of what it read, one at a time); in the caller's thread at depth 1. Closing the
        reader waits for it rather than cancelling it."""
        if self._beside is not None:
            return self._beside.submit(work, *args)
        done: Future[None] = Future()
        try:
            work(*args)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)
        return done

    def alongside(self, work: Callable[..., None], *args: Any) -> None:
        """Run ``work(*args)`` on a read thread, best effort (a start's learning of what its
        first proof needs: not queued before that proof, and cancelled by ``close``); in
        the caller's thread at depth 1."""
        if self._pool is not None:
            self._pool.submit(work, *args)
        else:
            work(*args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._beside is not None:
            self._beside.shutdown(wait=True)

    def _in_backlog(self, version: int) -> bool:
        """Read ``version`` by its segment? Only behind the head, and not where the segment
        was found missing (a writer that started mid-segment, or the head is in it)."""
        return self._hits >= 2 and not self._near_head(version) and segment_last(version) > self._absent_segment

    def _near_head(self, version: int) -> bool:
        """Whether ``version`` is read from its copies (see the class doc)."""
        return bool(self._copies) and self._missed_at is not None and version - self._missed_at < HEAD_RING

    def _from_segment(self) -> ReadVersion | None:
        """Version ``next`` from its segment, keeping the segment's later versions."""
        last = segment_last(self._next)
        if not self._in_backlog(self._next):
            return None
        if self._pool is None:
            versions = self._journal.read_segment(last)
        else:
            self._issue()
            pending = self._segment_reads[last]
            single = self._reads.get(self._next)
            if single is not None and not pending.done():
                wait([cast("Future[Any]", pending), single], return_when=FIRST_COMPLETED)
                if not pending.done():
                    return None  # the single probe answered first (``_probe`` takes it)
            versions = self._segment_reads.pop(last).result()
        self._racing = False  # known now: the segments decide from here on
        if versions is None:
            # Usually the head is in it, a few versions on: probe from a narrow window
            # again rather than its whole rest at once (a reader at the end of a stream
            # would waste them all). At a start, and after a backlog read by segments
            # (``_deep``), the versions after the last segment exist up to the head: the
            # first window's worth (a backlog of 80 versions read its last 16 two at a
            # time, four round trips at 25 ms).
            self._absent_segment = last
            self._window = min(self._window, FIRST_WINDOW if self._deep else 2)
            return None
        self._deep = True
        for read in versions:
            if read.delta.version > self._next:
                self._found[read.delta.version] = read
        self._forget_reads_up_to(last)
        return versions[self._next - versions[0].delta.version]

    def _probe(self) -> ReadVersion | None:
        """Version ``next`` read on its own."""
        if self._pool is None:
            return self._read_from(self._next, self._which_key(self._next))
        self._issue()
        return self._reads.pop(self._next).result()

    def _which_key(self, version: int) -> int | None:
        """The copy a single read of ``version`` reads (None: its own key): at random near the head."""
        if self._near_head(version):
            copy = random.randrange(self._copies + 1)
            return copy if copy < self._copies else None
        return None

    def _read_from(self, version: int, copy: int | None) -> ReadVersion | None:
        if copy is None:
            return self._journal.read_version_data(version)
        return self._journal.read_head_copy(version, copy)

    def _issue(self) -> None:
        """Start the reads of the window that are not in flight: segments behind the head,
        single versions elsewhere."""
        assert self._pool is not None
        end = self._next + self._window
        if self._next <= self._absent_segment:
            end = min(end, self._absent_segment + 1)  # the head may be in the missing segment: no further
        with self._misses:
            if self._missing_from is not None and self._missing_from < self._next:
                self._missing_from = None  # passed since (committed after that probe, read from a segment)
            if self._missing_from is not None:
                end = max(self._next + 1, min(end, self._missing_from + 1))
            since = self._misses_since
        for version in range(self._next, end):
            if version in self._found:
                continue
            if self._in_backlog(version):
                self._want_segment(segment_last(version))
                if not self._racing or version >= self._race_end:
                    continue
            if version not in self._reads:
                self._reads[version] = read = self._pool.submit(self._read_from, version, self._which_key(version))
                read.add_done_callback(functools.partial(self._note_miss, since, version))
        if self._deep:
            # Deep in a backlog, segments cover ``depth`` versions ahead whatever the window:
            # a start learns 64 versions in one round trip, and where the backlog ends (a
            # missing segment) while its first segments are still being read.
            last_ahead = segment_last(self._next + self._depth)
            for last in range(segment_last(self._next), last_ahead + 1, SEGMENT_VERSIONS):
                if last > self._absent_segment:
                    self._want_segment(last)

    def _note_miss(self, since: int, version: int, read: Future[ReadVersion | None]) -> None:
        """A single probe finished (on a read thread): remember the lowest miss, unless
        the reader has handed a miss out since the probe was issued (then it is stale)."""
        if not read.cancelled() and read.exception() is None and read.result() is None:
            with self._misses:
                if since != self._misses_since:
                    return
                if self._missing_from is None or version < self._missing_from:
                    self._missing_from = version

    def _want_segment(self, last: int) -> None:
        assert self._pool is not None
        if last not in self._segment_reads:
            self._segment_reads[last] = self._pool.submit(self._journal.read_segment, last)

    def _forget_reads_up_to(self, last: int) -> None:
        """A segment delivered versions up to ``last``: single probes of them are not needed."""
        for version in [v for v in self._reads if v <= last]:
            self._reads.pop(version).cancel()
