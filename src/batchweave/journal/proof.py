"""What proves a journal's view of the log genuine: its anchor (invariants I8 and I10).

A journal holds an *anchor*: a version it knows to be genuine, with a digest of its
bytes. Re-reading it proves what was read and put since (see ``core`` for the writers'
side); this module is that check and the one for what a journal *reads* (I10): no actor
acts on log content (drops pending TGBs, deletes intents or objects, delivers a step,
writes a segment, plans a collection) unless the versions it read are proven genuine. A
read of version ``v`` is genuine when ``v`` had not been deleted before the read (a key GC
freed may hold a version a stale writer re-created there); two facts prove it after the
fact:

- P1, the anchor: the anchor ``b <= v`` is still present with its bytes, read *after*
  ``v`` (ascending deletes: nothing above ``b`` had been deleted);
- P2/P3, the state: no snapshot exists (nothing was ever deleted), or a proven state
  loaded after the read says ``reclaimed.versions <= v`` (GC records a reclaim in the log
  before it deletes anything).

Writers' reads are proven by the check after their put, or, when they only follow the
log (``catch_up``) or find nothing to commit, by one check of the anchor; every state a
journal returns is proven. Readers prove a batch of versions with one check before they
use it (``prove_reads``): one small request per batch, nothing per step. An unprovable
view means reload (writers) or ``DataReclaimedError`` (readers), never a guess.

P1 holds for *any* proven anchor at or below what was read, not only the newest. A
large job's followers at the head all prove after each version they read: anchored on
the newest, 1,250 node followers would re-read one key within a second. With
``spread`` (set by such a follower), each proof moves the anchor to one of the last
``spread`` proven versions at random, so their proofs spread over that many keys. An
anchor that old may be reclaimed while what was read since is not: then the state,
loaded after the reads, proves them (P3) when it shows the reclaim past the anchor
and not past the reads.

See docs/invariants.md for the whole argument.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable

from batchweave import keys, log
from batchweave.errors import CorruptDataError, StoreError
from batchweave.journal.objects import LogObjects
from batchweave.journal.snapshots import Snapshots
from batchweave.log import LogState, ReadVersion

__all__ = ["Proof"]


class Proof:
    """The anchor of one journal's view, and what was read or put since it was checked."""

    def __init__(self, objects: LogObjects, snapshots: Snapshots) -> None:
        self._objects = objects
        self._snapshots = snapshots
        self.anchor: tuple[int, str] | None = None  # (version, digest) known genuine; None: not loaded
        self.unverified: set[int] = set()  # versions we put (or may have put) since the last verified commit
        self.unproven = False  # versions read since the anchor was last checked (I10)
        self._version_one: bytes | None = None  # version 1's bytes as a reader first read them
        self._snapshot_namespace: str | None = None  # the id a snapshot records (learn_namespace)
        self._learned = False  # learn_namespace ran to the end (found an id or not)
        self._learning = threading.Lock()  # a start's proof waits for the learning beside its reads
        self._proven: deque[tuple[int, str]] = deque(maxlen=1)  # the newest proven reads: anchors to draw from
        # The namespace's id, the one a head copy must name to be taken (``copy_namespace``).
        self._namespace: str | None = None
        self._namespace_looked_up = False  # looked up on the store once (found or not)
        self._naming = threading.Lock()

    @property
    def spread(self) -> int:
        """How many of the newest proven versions a reader's next anchor is drawn from."""
        return self._proven.maxlen or 1

    @spread.setter
    def spread(self, versions: int) -> None:
        self._proven = deque(self._proven, maxlen=max(1, versions))

    @property
    def pending(self) -> bool:
        """Whether anything was read or put since the anchor was last checked."""
        return self.unproven or bool(self.unverified)

    def verify(self) -> bool:
        """True when the view is still anchored: nothing read or written since the anchor
        was set can have come from a key that garbage collection freed (P1 in the module
        doc). One GET (a LIST on a log with no snapshot)."""
        if self.anchor is None:
            return False
        version, expected = self.anchor
        if version == 0:
            return self._snapshots.listed_version() == 0
        read = self._objects.get_head(keys.version_key(version))  # the digest is the head's
        return read is not None and log.digest(read[0]) == expected

    def advance(self, state: LogState) -> None:
        """Just verified: every version up to ``state.version`` is genuine, our puts too."""
        if state.digest:
            self.anchor = (state.version, state.digest)
        if state.version:
            self._namespace = state.namespace  # proven: the id version 1 recorded
        self.unverified.clear()
        self.unproven = False

    # -- readers' proofs -------------------------------------------------------------

    def copy_namespace(self, version: int) -> str | None:
        """The id a head copy of ``version`` must name to be taken for its bytes
        (``headcopies``: never another namespace's, once at the same URL), or None when
        this reader cannot check a copy yet and reads the version's own key instead.

        Known from a state this journal proved, or from version 1 as this reader read it;
        otherwise looked up once, for a copy of a version above 1: from version 1's own key
        (one GET), or, when collection deleted it, from the snapshots' record of the id (one
        GET of the hint). Version 1 is what names the namespace, so no copy of it is taken
        before it was read. The id only ever rejects copies: it comes from the log itself,
        never from a copy, and a version 1 a stale writer re-created names an id of its own
        (a random one), which only sends this reader to the versions' own keys."""
        if self._namespace is None:
            first = self._version_one
            if first is not None:
                self._namespace = _namespace_of(first)
            elif version > 1 and not self._namespace_looked_up:
                with self._naming:
                    if self._namespace is None and not self._namespace_looked_up:
                        self._look_up_namespace()
        return self._namespace

    def _look_up_namespace(self) -> None:
        """``copy_namespace``'s lookup (holding ``_naming``): once, unless the store failed."""
        try:
            first = self._objects.get(keys.version_key(1))
            namespace = self._snapshots.namespace() if first is None else _namespace_of(first)
        except CorruptDataError:
            namespace = None  # a damaged version 1 or snapshot: the own keys, as without copies
        except StoreError:
            return  # looked up again at the next copy
        self._namespace_looked_up = True
        if namespace is not None and self._namespace is None:
            self._namespace = namespace

    def saw(self, version: int, data: bytes | memoryview) -> None:
        """A reader read version ``version`` with bytes ``data``: a start's proof needs version 1's."""
        if version == 1:
            self._version_one = bytes(data)

    def prove_reads(self, lowest: int, newest: ReadVersion | None, load_state: Callable[[], LogState]) -> bool:
        """``Journal.prove_reads``; ``load_state`` loads the newest proven state (P3)."""
        anchor = self.anchor
        if anchor is not None and 0 < anchor[0] <= lowest:
            proven = self.verify() or (self.spread > 1 and self._reclaimed_between(anchor[0], lowest, load_state))
        else:
            proven = self._proven_without_anchor(lowest, load_state)
        if proven and newest is not None:
            self._proven.append((newest.delta.version, log.digest(newest.data)))
            drawn = random.randrange(len(self._proven)) if len(self._proven) > 1 else 0
            self.anchor = self._proven[drawn]
        return proven

    @staticmethod
    def _reclaimed_between(anchor: int, lowest: int, load_state: Callable[[], LogState]) -> bool:
        """P3 for a spread anchor GC passed: the state, loaded now, shows the reclaim past
        the anchor (its absence explained) and not past the reads."""
        return anchor < load_state().reclaimed.versions <= lowest

    def learn_namespace(self) -> None:
        """``Journal.learn_namespace``: best effort, once. The hint repeats the id every
        snapshot records (one GET; two for a hint written before it did). A proof that
        comes while it is in flight waits for it rather than reading the same objects
        again, unless a listing can prove without it (``_proven_without_anchor``)."""
        with self._learning:
            self._learn()

    def _learn(self) -> None:
        """Learn the id unless learned already (holding ``_learning``). Found or not, once:
        with no snapshot there is no id to find, and a start's proof lists instead."""
        if self._learned:
            return
        try:
            self._snapshot_namespace = self._snapshots.namespace() or None
        except StoreError:  # CorruptDataError included: the proof looks again, and says so
            return
        self._learned = True

    def _proven_without_anchor(self, lowest: int, load_state: Callable[[], LogState]) -> bool:
        """P2, version 1 certified by a snapshot's id, or P3 (module doc), checked now,
        after the reads."""
        namespace = None
        listed: int | None = None
        if lowest == 1 and self._version_one is not None:
            if not self._learning.acquire(blocking=False):
                # Being learned beside the first reads: a log with no snapshot needs no id
                # (P2), and the listing that says so runs now, not after the learning.
                listed = self._snapshots.listed_version()
                if listed == 0:
                    return True
                self._learning.acquire()
            try:
                self._learn()  # learned beside the first reads (no request), else now
                namespace = self._snapshot_namespace
            finally:
                self._learning.release()
            if namespace is not None and self._version_one_is_genuine(namespace):
                return True
        if namespace is None and (self._snapshots.listed_version() if listed is None else listed) == 0:
            return True  # no snapshot: no version was ever deleted
        return load_state().reclaimed.versions <= lowest

    def _version_one_is_genuine(self, namespace: str) -> bool:
        """Version 1 names the namespace with a random id that every snapshot repeats (any
        snapshot, read at any time: the id never changes), so a version 1 re-created in a
        freed key cannot match it. Matching, and present now with the bytes read before:
        nothing above it had been deleted when the reads happened."""
        assert self._version_one is not None
        first = _namespace_of(self._version_one)
        if not first or first != namespace:
            return False
        now = self._objects.get(keys.version_key(1))
        return now is not None and bytes(now) == self._version_one


def _namespace_of(version_one: bytes | memoryview) -> str:
    """The namespace's id that version 1's bytes record ("" in a log older than ids)."""
    return log.decode_version_head(version_one, keys.version_key(1), 1).namespace
