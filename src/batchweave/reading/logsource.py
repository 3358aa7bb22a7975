"""Where a rank's log versions come from: its own follower, or its node's. The first
half of the reading pipeline (``reading.pipeline`` schedules and fetches the steps).

``LogSource.versions`` checks the cursor against the namespace, then yields what a
follower yields (``reading.follower.FollowItem``): batches of versions, proven or with
their proof in flight, and pauses. With a node (``reading.node``) it reads through the
node's hub, and on its own while the node cannot serve it: for good once no hub can be
had; until it has caught up with the head when it is far from the node's other ranks,
asking the node again at most every ``REJOIN_S`` seconds (doubling while the node keeps
sending it away, so it never spins).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator

from batchweave import log
from batchweave.journal import Journal
from batchweave.log import ReadVersion
from batchweave.reading.cursor import Cursor, checked_cursor
from batchweave.reading.follower import FollowItem, ProvenLog, log_reader
from batchweave.reading.nodeclient import NodeUnavailableError
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import DEFAULT_LOG_READ_AHEAD
from batchweave.reading.sharedlog import NodeBehind, NodeFollower
from batchweave.store import Store

__all__ = ["REJOIN_S", "LogSource"]

_logger = logging.getLogger("batchweave.consumer")
# A rank its node sent to read alone asks the node again once it is at the head, at most
# this often: from the first second, doubling up to the second while the node keeps
# sending it away (a rank far ahead of the node's follower, say), so it never spins.
REJOIN_S = (1.0, 64.0)


class LogSource:
    """One rank's log versions from ``cursor`` on.

    ``first_needed`` gives the oldest version the rank still needs (its proofs go no
    lower); ``stop`` ends the reading; ``node`` is the node's follower, or None to read
    on its own; ``checked`` is told the cursor once it was checked against the namespace.
    """

    def __init__(
        self,
        store: Store,
        journal: Journal,
        cursor: Cursor,
        node: NodeFollower | None,
        polling: HeadPolling,
        first_needed: Callable[[], int],
        stop: threading.Event,
        rank: int,
        checked: Callable[[Cursor], None] = lambda cursor: None,
    ) -> None:
        self._store = store
        self._journal = journal
        self.cursor = cursor  # where reading starts; checked by ``versions``
        self._node = node
        self._polling = polling
        self._first_needed = first_needed
        self._stop = stop
        self._rank = rank
        self._checked = checked  # told the cursor once it is checked against the namespace
        self._url = store.url

    def versions(self) -> Generator[FollowItem, None, None]:
        """Check the cursor, then yield the follower's items (see the module doc)."""
        self._open()
        if self._node is None:
            yield from self._own_log(max(self.cursor.version, 1))
        else:
            yield from self._shared_log()

    def _open(self) -> None:
        """Check the cursor against the namespace before reading from it (one load).

        A cursor checked already (by ``load_state_dict``) carries its version's digest and
        needs no second load; a cursor from the start has nothing to check, and the first
        proof of what the reader reads (I10) finds a reclaimed start.
        """
        if self.cursor.digest or (self.cursor.version == 0 and self.cursor.position == 0):
            return
        self.cursor = checked_cursor(self.cursor, self._journal, self._url)
        self._checked(self.cursor)
        if self.cursor.digest:
            self._journal.anchor_on(self.cursor.version, self.cursor.digest)

    def _shared_log(self) -> Generator[FollowItem, None, None]:
        """The node's follower; this rank's own from where it stood while the node cannot
        serve it (see the module doc; also when its own check of what the node handed it
        failed)."""
        assert self._node is not None
        version = max(self.cursor.version, 1)
        anchor = (self.cursor.version, self.cursor.digest) if self.cursor.digest else None
        present_through = self.cursor.version
        rejoin_after_s = REJOIN_S[0]
        while True:
            last: ReadVersion | None = None  # the newest version the hub proved for this rank
            caught_up: int | None = None
            try:
                for item in self._node.log(version, anchor, present_through, self._first_needed, self._url, self._stop):
                    if isinstance(item, list):
                        last = item[-1]
                        rejoin_after_s = REJOIN_S[0]  # served again: a later parting starts afresh
                    yield item
                return
            except (NodeUnavailableError, NodeBehind) as exc:  # an unreachable hub is logged by the client
                rejoin = isinstance(exc, NodeBehind)
                if rejoin:
                    _logger.info("%s rank %d: %s; following the log on its own", self._url, self._rank, exc)
                if last is not None:  # proven by the hub: this rank's own proofs go on from there (I10)
                    self._journal.anchor_on(last.delta.version, log.digest(last.data))
                caught_up = yield from self._own_log(
                    exc.next_version, rejoin_after_s=rejoin_after_s if rejoin else None
                )
            if caught_up is None:
                return
            rejoin_after_s = min(2 * rejoin_after_s, REJOIN_S[1])
            version, anchor, present_through = caught_up, None, 0  # the node's again, from the head

    def _own_log(self, first: int, *, rejoin_after_s: float | None = None) -> Generator[FollowItem, None, int | None]:
        """This rank's own follower: reads ahead, proves every batch (I10), paces probes.
        With ``rejoin_after_s``, it stops at the first miss (the head) once that long has
        passed, and returns the next version (the rank asks its node again from there)."""
        depth = DEFAULT_LOG_READ_AHEAD if self._store.remote else 1  # local reads are too quick to overlap
        reader = log_reader(self._journal, first, depth, self._polling, self._stop)
        if first == 1 and depth > 1:
            reader.alongside(self._journal.learn_namespace)  # for the first proof, while reading
        started = time.monotonic()
        try:
            for item in ProvenLog(
                self._journal, reader, self._polling, self._first_needed, self._url, self.cursor.version, early=True
            ):
                at_head = isinstance(item, float) and item > 0
                if at_head and rejoin_after_s is not None and time.monotonic() - started >= rejoin_after_s:
                    return reader.next_version  # what was read is handed out (its proof runs)
                yield item
        finally:
            reader.close()
        return None
