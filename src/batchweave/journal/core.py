"""Reading and writing the log on a store: the thin driver around ``log``.

Opening a namespace costs O(1) requests plus the tail: read the snapshot hint, the
snapshot it names, probe forward for newer snapshots, then read the versions after it.

Every write to the log goes through ``Journal.commit``: catch up, build the next
version from the newest state, validate it, put it create-only, verify, retry. That
one loop is where invariant I8 (a version number is never used twice) is enforced:

- Garbage collection deletes log versions only in ascending order, one at a time
  (``gc``), so while version ``b`` is present no version above ``b`` has ever
  been deleted.
- Each journal holds an *anchor*: a version it knows to be genuine, with a digest of
  its bytes (a snapshot records the digest of its own version; a verified commit
  becomes the new anchor). A version re-created in a freed key has other bytes.
- After every successful create-only put, the journal re-reads its anchor. Same bytes:
  nothing at or above the anchor had been deleted when the put landed, so every version
  read since and the one just written are first creations. Otherwise the put may have
  landed in a key that garbage collection freed: the journal reloads the newest state
  and builds again; builds are idempotent (they drop what the log already records), so
  a put that did land legitimately is not repeated, and one that landed in the
  reclaimed region, where no reader looks, is deleted again.
- With no snapshot at all (anchor version 0), "no version was ever deleted" is checked
  by listing snapshots: collection deletes versions only below an existing snapshot and
  never deletes the newest one.

Every state a journal returns is proven, and what it *reads* is proven by the same
anchor before anyone acts on it (invariant I10): ``proof`` holds the anchor and that
argument, ``snapshots``, ``segments`` and ``headcopies`` what is written beside the log.

See docs/invariants.md for the whole argument.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, cast, overload

from batchweave import keys, log, logrules
from batchweave.errors import ConfigError, CorruptDataError, StoreError
from batchweave.journal.headcopies import CopyWriter, read_copy
from batchweave.journal.objects import LogObjects
from batchweave.journal.proof import Proof
from batchweave.journal.segments import RecentVersions, read_segment
from batchweave.journal.snapshots import Snapshots
from batchweave.log import LogState, LogVersion, LogVersionHead, ReadVersion
from batchweave.segment import SEGMENT_MAX_BYTES, SEGMENT_VERSIONS
from batchweave.store import Store

__all__ = ["DEFAULT_SNAPSHOT_EVERY", "Committed", "Journal"]

_logger = logging.getLogger(__name__)
DEFAULT_SNAPSHOT_EVERY = 100
_LOAD_ATTEMPTS = 8  # reloads when garbage collection keeps deleting the snapshot we found

Build = Callable[[LogState], LogVersion | None]
# What a journal reads versions as: whole ``LogVersion``s (readers, collection) or a
# writer's ``LogVersionHead``s (``Journal(store, heads_only=True)``).
VersionT = TypeVar("VersionT", LogVersion, LogVersionHead)


@dataclass(frozen=True, slots=True)
class Committed:
    """What one ``Journal.commit`` call did.

    ``outcome``: "committed" (``delta`` is the version written), "nothing" (the build
    found nothing left to do on the newest state), or "conflict" (another writer took
    the version and ``max_attempts`` ran out). ``state`` is the newest state known.
    """

    outcome: Literal["committed", "nothing", "conflict"]
    state: LogState
    delta: LogVersion | None
    fragile_window_s: float
    conflicts: int


class Journal(Generic[VersionT]):
    """The log of one namespace: versions, snapshots and the snapshot hint.

    ``Journal(store)`` is a ``Journal[LogVersion]``; ``Journal(store, heads_only=True)``
    a ``Journal[LogVersionHead]``, whose versions carry no object keys or slices.
    """

    @overload
    def __init__(
        self: Journal[LogVersion],
        store: Store,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        *,
        heads_only: Literal[False] = False,
        read_only: bool = False,
    ) -> None: ...
    @overload
    def __init__(
        self: Journal[LogVersionHead],
        store: Store,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        *,
        heads_only: Literal[True],
        read_only: bool = False,
    ) -> None: ...
    def __init__(
        self,
        store: Store,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        *,
        heads_only: bool = False,
        read_only: bool = False,
    ) -> None:
        self.store = store
        # A reader's journal (consumers, inspect, watch) refuses to commit; no load writes
        # anything either (a missing snapshot is healed at the next commit), so readers need
        # only read permission.
        self.read_only = read_only
        # A writer's journal (heads_only) reads versions as ``LogVersionHead``: it needs the
        # state, never other producers' object keys (see ``log.TGBHead``). The cast is the
        # overloads' promise: heads_only=True is the one way to a Journal[LogVersionHead].
        decode = log.decode_version_head if heads_only else log.decode_version
        self._decode = cast("Callable[[bytes | memoryview, str, int], VersionT]", decode)
        self._heads_only = heads_only
        self._bytes_decoded = 0
        self._objects = LogObjects(store)
        self._snapshots = Snapshots(self._objects, snapshot_every)
        self._proof = Proof(self._objects, self._snapshots)
        # When the newest probe began: a commit's fragile window opens at the read that
        # found no newer version (paper 5.2), not at the catch-up reads before it.
        self.last_probe_started = time.monotonic()
        self._store_checked = False
        self._snapshot_missing = False  # the last load read a long tail: write a snapshot at the next commit
        # The committer's clock reading in the newest version read (its ``committed_at``):
        # group commit takes turns counted from it, so every producer counts alike.
        self.newest_committed_at: float | None = None
        # The newest versions' bytes this writer read or wrote: the committer of a segment's
        # last version writes the segment from them.
        self._recent = RecentVersions()
        self._copies = CopyWriter(store)  # of each version it commits (``headcopies``)
        # Our puts that landed or may have, by version (the digest of our bytes), until a
        # view through them: a put that raised, or one that landed and whose commit then
        # raised (its proof's read failed). A jump must not step over one of them that
        # landed (``_own_landed``).
        self._ambiguous: dict[int, str] = {}

    @property
    def requests(self) -> int:
        """Log requests made, for cost tests and metrics."""
        return self._objects.requests

    @property
    def bytes_read(self) -> int:
        """Bytes of the log's objects read (versions, snapshots, the hint), for cost tests."""
        return self._objects.bytes_read

    @property
    def bytes_decoded(self) -> int:
        """Bytes of log versions this writer decoded while following the log (a writer's
        journal decodes only their heads: ``log.head_size``), for cost tests."""
        return self._bytes_decoded

    @property
    def snapshot_every(self) -> int:
        """K: a snapshot is written after every K-th version."""
        return self._snapshots.every

    # -- versions --------------------------------------------------------------------

    def read_version(self, version: int) -> VersionT | None:
        """Version ``version``, or None if it is not committed (yet). Not proven (I10): for
        display, or for a reader that proves what it read before acting on it. Safe to call
        from several threads at once (readers read ahead this way)."""
        data = self._objects.get(keys.version_key(version))
        return None if data is None else self._decode(data, keys.version_key(version), version)

    def read_version_data(self, version: int) -> ReadVersion | None:
        """``read_version`` with the version's bytes, which ``prove_reads`` anchors on."""
        data = self._objects.get(keys.version_key(version))
        if data is None:
            return None
        delta = cast(LogVersion, self._decode(data, keys.version_key(version), version))
        self._proof.saw(version, data)
        return ReadVersion(delta, data)

    def read_head_copy(self, version: int, copy: int) -> ReadVersion | None:
        """``read_version_data`` from copy ``copy`` of ``version`` (``headcopies``), or from
        the version's own key when the copy cannot tell; None also when the copy is not
        written yet, or is another namespace's (one deleted at this URL, whose copy puts
        landed late). Proven like a read of the version's own key."""
        read = read_copy(self._objects, version, copy, self._proof.copy_namespace(version))
        if read is True:
            return self.read_version_data(version)
        if isinstance(read, ReadVersion):
            self._proof.saw(version, read.data)
            return read
        return None

    def _read(self, version: int) -> tuple[VersionT, str] | None:
        """The version and its digest (writers anchor on it; readers skip the hashing)."""
        key = keys.version_key(version)
        if self._heads_only:
            read = self._objects.get_head(key)
            if read is None:
                return None
            data, whole = read
        else:
            data, whole = self._objects.get(key), True
            if data is None:
                return None
        decoded = self._decode(data, key, version)
        self._bytes_decoded += log.head_size(data) if self._heads_only else len(data)
        self._recent.keep(version, data, whole)
        return decoded, log.digest(data)

    def read_segment(self, last: int) -> list[ReadVersion] | None:
        """The versions of the segment ending at ``last`` (``segment``), or None when
        there is none: not written (yet), or damaged, which is logged and read around."""
        versions = read_segment(self._objects, last)
        if versions is not None:
            self._proof.saw(versions[0].delta.version, versions[0].data)
        return versions

    def versions_after(self, version: int) -> Iterator[VersionT]:
        """Committed versions ``version+1, version+2, ...`` up to the newest one. Not
        proven (I10): for tools and tests that inspect a log nobody collects meanwhile."""
        for delta, _ in self._read_after(version):
            yield delta

    def _read_after(self, version: int) -> Iterator[tuple[VersionT, str]]:
        while True:
            self.last_probe_started = time.monotonic()
            read = self._read(version + 1)
            if read is None:
                return
            yield read
            version += 1

    def catch_up(self, state: LogState) -> tuple[LogState, int]:
        """``state`` advanced to the newest version, proven (I10); also how many versions
        were read. A view garbage collection overtook is reloaded: then the state may not
        follow ``state`` at all (and ``read`` is at least 1)."""
        state, read = self._read_on(state)
        state, stale = self._proven(state)
        return state, max(read, 1) if stale else read

    def _read_on(self, state: LogState, *, jump: bool = False) -> tuple[LogState, int]:
        """``state`` advanced through the versions committed since, not proven yet (with
        ``jump``, straight to the head when it can: ``_jump``). A version that does not
        follow is damage only if the anchor is intact; otherwise it was re-created in a
        freed key and the view is reloaded (proven)."""
        anchor = self._proof.anchor
        if anchor is not None and state.version < anchor[0]:
            # The caller holds a state older than this journal's anchor (a commit that raised
            # after a reload moved the anchor): the anchor proves nothing below itself, so
            # neither reads nor a put from that state could be proven. Start from the newest.
            return self._recover_from_stale_view(), 1
        try:
            jumps = jump and self.store.lists_from_a_key
            advanced = (self._jump(state) if jumps else None) or self._apply_newer(state)
        except CorruptDataError:
            if self.verify():
                raise  # the log itself is damaged
            return self._recover_from_stale_view(), 1
        self._forget_ambiguous(advanced[0].version)
        return advanced

    def _jump(self, state: LogState) -> tuple[LogState, int] | None:
        """``state`` advanced to the head reading only the head (unproven), and how many
        versions were read; None when the head cannot tell the state (then every version
        since is read, as always). A writer's per-attempt cost whatever the number of
        producers: one LIST of the log's keys after ``state``'s (on a local directory, a few
        stats: ``LogObjects.newest_version_after``), one GET of the newest, and one GET of
        each of our own puts between whose outcome we never learned.

        Why a skipped version cannot break I8 or I10: nothing acts on what was not read.
        The put that follows creates version h+1 after h was read, so h was the head when
        it landed, unless h was re-created in a freed key; and every read above the anchor
        (the listing, h, our own versions) is proven by the same re-read of the anchor as
        always (after the put, or by ``_proven`` before acting on "nothing to do"):
        collection deletes versions in ascending order, so an intact anchor means nothing
        above it, skipped or read, had been deleted. What a skipped version could change
        that a commit needs (a claim fencing us, the end of stream, a reclaim, the
        namespace's layout, payload kind or schema) is exactly what its ``changed_at``
        records, and ``logrules.jump_to`` refuses the jump over it (I3, I9). Our own
        commits are the only other change to our state (direct mode: nobody folds our
        TGBs), and one that may have landed unseen is read here (``_own_landed``), so the
        rebase drops what it committed (I3)."""
        self.last_probe_started = time.monotonic()
        head = self._objects.newest_version_after(state.version)
        if head is None:
            return state, 0  # nothing newer, as a probe's miss would say
        read = self._read(head)
        if read is None:
            return None  # deleted since the listing: read on as always, which tells why
        delta, digest = read
        if head == state.version + 1:
            advanced: LogState | None = logrules.apply_version(state, delta, keys.version_key(head), digest)
            own: list[VersionT] | None = []
        else:
            own = self._own_landed(state.version, head)
            advanced = None if own is None else logrules.jump_to(state, delta, digest, own)
        if advanced is None:
            return None
        self.newest_committed_at = delta.committed_at
        self._proof.unproven = True
        return advanced, 1 + len(own or ())

    def _own_landed(self, after: int, head: int) -> list[VersionT] | None:
        """Our puts above ``after`` and below ``head`` whose outcome we never learned and
        that did land (the version holds our bytes), oldest first; None when one of those
        versions is missing (read every version instead: that tells why)."""
        landed: list[VersionT] = []
        for version, ours in sorted(self._ambiguous.items()):
            if not after < version < head:
                continue
            data = self._objects.get(keys.version_key(version))
            if data is None:
                return None
            if log.digest(data) == ours:
                self._recent.keep(version, data)
                landed.append(self._decode(data, keys.version_key(version), version))
        return landed

    def _forget_ambiguous(self, through: int) -> None:
        """A view through version ``through`` knows how every put at or below it went."""
        for version in [v for v in self._ambiguous if v <= through]:
            del self._ambiguous[version]

    def _apply_newer(self, state: LogState) -> tuple[LogState, int]:
        """``state`` advanced through every version committed since (unproven), and how many."""
        read = 0
        for delta, digest in self._read_after(state.version):
            state = logrules.apply_version(state, delta, keys.version_key(delta.version), digest)
            self.newest_committed_at = delta.committed_at
            self._proof.unproven = True
            read += 1
        return state, read

    # -- the one commit loop ---------------------------------------------------------

    def commit(
        self,
        state: LogState,
        build: Build,
        *,
        max_attempts: int | None = None,
        after_conflict: Callable[[float], None] | None = None,
        jump: bool = False,
        probed: bool = False,
    ) -> Committed:
        """Commit ``build(newest state)`` as the next version; see the module doc.

        ``build`` is called with the newest state before every attempt and must be
        idempotent: it returns None when the state already holds what it would commit
        (an ambiguous earlier attempt that landed), and may raise to give up (fenced,
        ended, wrong layout). The version is validated against the state before it is
        put, so nothing the log would reject is ever written. On a lost race the loop
        catches up and builds again, at most ``max_attempts`` times (None: until done),
        after calling ``after_conflict`` (if given) with the lost attempt's fragile window
        (seconds): a writer racing many rivals backs off there rather than at once.

        ``jump``: learn the head by reading only the head where it can tell the state
        (``_jump``), for a producer committing its own TGBs: its cost per attempt is then
        flat in the number of producers (on a store that lists from a key:
        ``Store.lists_from_a_key``; elsewhere every version is read, as without it). The
        states it returns may then be behind on other producers' offsets and metrics
        (``LogState.skipped_through``).

        ``probed``: ``state`` is the head as the caller has just read it (``load_state``,
        ``catch_up``), so the first attempt builds on it without probing the head key
        again. The probe only spares a put that would lose: the put is create-only, so
        a version that landed meanwhile costs that attempt a conflict, never a wrong
        version, and every later attempt probes as always.
        """
        if self.read_only:
            raise ConfigError(f"{self.store.url}: this journal only reads the log (a reader's); it cannot commit")
        self._check_store()
        self.store.wait_staged()  # the objects it names are durable before the window opens
        if self._proof.anchor is None:
            state = self.load_state()
        conflicts = 0
        skip_probe = probed and self._proof.anchor is not None and state.version >= self._proof.anchor[0]
        while True:
            if not skip_probe:
                state, _ = self._read_on(state, jump=jump)
            skip_probe = False
            delta = build(state)
            if delta is None:
                # Acting on "nothing to do" (dropping pending TGBs, deleting intents) needs
                # the view proven: what we read or saw land may sit in a freed key.
                state, stale = self._proven(state)
                if stale:
                    conflicts = 0
                    continue
                return Committed("nothing", state, None, self._window_s(), conflicts)
            key = keys.version_key(delta.version)
            data = log.encode(delta)
            after = logrules.apply_version(state, delta, key, log.digest(data))  # validate before writing
            self._proof.unverified.add(delta.version)  # also if the put's outcome is ambiguous (it raises)
            self._ambiguous[delta.version] = log.digest(data)  # until a view through it
            outcome = self._objects.put_if_absent(key, data)
            if outcome == "taken":
                del self._ambiguous[delta.version]  # another writer's version is there
            if outcome != "landed":
                conflicts += 1
                window_s = self._window_s()
                if max_attempts is not None and conflicts >= max_attempts:
                    state, _ = self._proven(state)  # the caller adopts it: never an unproven view
                    return Committed("conflict", state, None, window_s, conflicts)
                if after_conflict is not None:
                    after_conflict(window_s)
                continue
            window_s = self._window_s()
            self._recent.keep(delta.version, data)
            if self.verify():
                witness = self._proof.anchor  # genuine, and at or below all that was read
                self._proof.advance(after)
                # Only now: a proven put's bytes, naming the namespace (headcopies).
                self._copies.write(delta.version, data, after.namespace)
                if after.version % SEGMENT_VERSIONS == 0:
                    self._fill_segment(after.version, witness)
                after = self.after_commit(after)
                return Committed("committed", after, delta, window_s, conflicts)
            state = self._recover_from_stale_view()

    def _proven(self, state: LogState) -> tuple[LogState, bool]:
        """``state`` if what was read and put since the last check is proven (one GET of the
        anchor, none when nothing is unproven); else the reloaded newest state and True."""
        if not self._proof.pending:
            return state, False
        if self.verify():
            self._proof.advance(state)
            return state, False
        return self._recover_from_stale_view(), True

    def _window_s(self) -> float:
        return time.monotonic() - self.last_probe_started

    def _check_store(self) -> None:
        """I8 also needs a store that honours create-only puts: refuse one that does not."""
        if not self._store_checked:
            self.store.require_create_only()
            self._store_checked = True

    def _recover_from_stale_view(self) -> LogState:
        """Our anchor vanished: garbage collection overtook our view, and what we read or
        wrote since may sit in keys it freed. Reload the newest state; versions we wrote
        below what collection reclaimed are in a region no reader looks at, and deleting
        them keeps it empty (any left over, collection deletes)."""
        anchor = self._proof.anchor
        if anchor is None:
            # Never loaded: a caller caught up from an empty state. Nothing was overtaken.
            _logger.info("this journal had not loaded the log before reading it; loading")
        elif anchor[0] == 0:
            # Opened on an empty log, which then grew its first snapshot: expected once.
            _logger.info("the log grew its first snapshot before this writer's first commit; reloading")
        else:
            _logger.warning("garbage collection overtook this writer's view of the log; reloading")
        self._recent.clear()  # what we read may come from freed keys: never copy it into a segment
        our_puts = sorted(self._proof.unverified)
        state = self.load_state(trust_hint=False)
        for version in our_puts:
            if version < state.reclaimed.versions:
                self._delete_stale_put(keys.version_key(version))
        return state

    def _delete_stale_put(self, key: str) -> None:
        """A writer without delete permission leaves it to the collector, which deletes
        every version below the reclaim."""
        try:
            self.store.delete_if_allowed(key)
        except StoreError as exc:
            _logger.warning("left a version put into the reclaimed region for garbage collection: %s", exc)

    def verify(self) -> bool:
        """True when this journal's view is still anchored: nothing it read or wrote since
        its anchor was set can have come from a key that garbage collection freed (P1 in
        ``proof``). One GET (a LIST on a log with no snapshot)."""
        return self._proof.verify()

    # -- readers' proofs (I10, ``proof``) ----------------------------------------------

    @property
    def anchor_version(self) -> int | None:
        """The version this journal's proofs re-read (None before the first load or proof)."""
        anchor = self._proof.anchor
        return None if anchor is None else anchor[0]

    def anchor_on(self, version: int, digest: str) -> None:
        """Take version ``version`` with bytes of ``digest`` as proven (a reader resuming from
        a cursor that was checked against a proven state: ``consumer._checked_cursor``)."""
        self._proof.anchor = (version, digest)

    def prove_reads(self, lowest: int, newest: ReadVersion | None = None) -> bool:
        """Whether every version this reader read since its last proof (each numbered
        ``lowest`` or above) was genuine, and every miss a version not committed yet
        rather than one GC deleted. True moves the anchor to ``newest`` (the newest
        version read, if any); False means the reader's view cannot be proven: GC
        overtook it (see ``reclaimed``). Costs one GET of the anchor; a reader without an
        anchor at or below ``lowest`` (a start) proves by the snapshots instead."""
        return self._proof.prove_reads(lowest, newest, self.load_state)

    def spread_anchors(self, versions: int) -> None:
        """Draw each next anchor from the last ``versions`` proven versions (a follower of a
        large job at the head: its proofs then spread over that many keys; ``proof``)."""
        self._proof.spread = versions

    def learn_namespace(self) -> None:
        """Read the namespace's id from the newest snapshot, ahead of a start's first proof
        (a reader from step 0 runs it beside its first reads): that proof then costs one
        GET instead of a listing and a snapshot lookup. Best effort."""
        self._proof.learn_namespace()

    # -- state and snapshots ---------------------------------------------------------

    def load_state(self, *, trust_hint: bool = True) -> LogState:
        """The newest state: hint, snapshot, forward probe, then the tail of versions.

        Raises CorruptDataError naming the key when the snapshot the state depends on is
        damaged: never an older state. ``trust_hint=False`` lists snapshots instead.
        """
        for attempt in range(_LOAD_ATTEMPTS):
            state = self._snapshots.newest(trust_hint=trust_hint and attempt == 0)
            anchor = self._anchor_of(state)
            if anchor is None:
                continue  # collection deleted that snapshot's version meanwhile: find a newer one
            if state.version == 0:
                state, anchor = self._first_version(state)
                if anchor is None:
                    continue  # a snapshot appeared meanwhile: load from it
                if anchor[0] == 0:
                    # No version 1, and no snapshot listed after that miss: an empty log,
                    # proven as a verify would prove it (reading on and listing again
                    # would only repeat both requests).
                    self._proof.anchor = anchor
                    self._proof.advance(state)
                    self._snapshot_missing = False
                    return state
            self._proof.anchor = anchor
            try:
                state, read = self._apply_newer(state)
            except CorruptDataError:
                if self.verify():
                    raise
                continue
            if not self.verify():
                continue  # a collector overtook the load: what the tail read may be re-created
            self._proof.advance(state)
            # A snapshot went missing (a committer crashed before writing it). This journal's
            # next verified commit heals it, so the next reader does not pay for this long tail
            # again; a load never writes, so readers need no write permission.
            self._snapshot_missing = read >= 2 * self.snapshot_every
            return state
        raise StoreError(keys.SNAPSHOT_PREFIX, f"the newest snapshot kept changing over {_LOAD_ATTEMPTS} reloads")

    def _first_version(self, empty: LogState) -> tuple[LogState, tuple[int, str] | None]:
        """With no snapshot, anchor on version 1: read it, then list snapshots. None seen
        after the read means no version had ever been deleted (collection deletes only
        below a snapshot, and never the newest), so the version 1 read is genuine. A
        namespace with no version yet keeps the anchor "no snapshot exists"."""
        first = self._read(1)
        if self._snapshots.listed_version() != 0:
            return empty, None
        if first is None:
            return empty, (0, "")
        delta, digest = first
        return logrules.apply_version(empty, delta, keys.version_key(1), digest), (1, digest)

    def _anchor_of(self, state: LogState) -> tuple[int, str] | None:
        """The anchor a load from ``state`` starts with; None if its version is gone."""
        if state.version == 0 or state.digest:
            return state.version, state.digest
        # A snapshot from before digests: take its version's bytes as they are now.
        data = self._objects.get(keys.version_key(state.version))
        return None if data is None else (state.version, log.digest(data))

    def after_commit(self, state: LogState) -> LogState:
        """Called by the committer of ``state.version`` once its view is verified: writes a
        snapshot every K versions (or now, when its load found one missing) and a segment
        every ``SEGMENT_VERSIONS``. Returns the state to go on from: ``state``, or its
        exact twin when it had skipped versions and a snapshot was due (``_exact_twin``)."""
        snapshot_due = state.version % self.snapshot_every == 0 or self._snapshot_missing
        if snapshot_due and state.skipped_through:
            # A jumped state is behind on other producers: never a snapshot of it.
            state = self._exact_twin(state) or state
        if state.version % SEGMENT_VERSIONS == 0:
            self.write_segment(state.version)
        if snapshot_due:
            if not state.skipped_through:
                self.write_snapshot(state)
            self._snapshot_missing = False
        return state

    def _fill_segment(self, last: int, witness: tuple[int, str] | None) -> None:
        """Read whole the versions of the segment ending at ``last`` (ours, just verified)
        that this writer skipped (a jump) or read the head of only (``LogObjects.get_head``),
        so that ``after_commit`` can write the segment; best effort. Proven as any read (P1,
        ``proof``): a version known genuine at or below every one of them, re-read after
        them with the same bytes, means none had been deleted. That version is one this
        writer read or wrote (its digest is that of its head), or ``witness``, the anchor
        its commit was verified by; a version whose head it read must have that head
        still. By the committer of a segment's last version only, and only up to a
        segment's bytes: about one GET per version of the log, whatever the producers."""
        wanted = range(last - SEGMENT_VERSIONS + 1, last)
        missing = [v for v in wanted if self._recent.get(v) is None]
        if not missing:
            return
        known = [(v, d) for v in wanted if v <= missing[0] and (d := self._recent.digest(v)) is not None]
        known += [witness] if witness is not None and 0 < witness[0] <= missing[0] else []
        if not known:
            return  # nothing to prove them by: readers read these versions one by one
        proof_version, proof_digest = max(known)
        try:
            held = sum(len(data) for v in range(wanted.start, last + 1) if (data := self._recent.get(v)) is not None)
            read = self._read_whole(missing, SEGMENT_MAX_BYTES - held)
            again = None if read is None else self._objects.get_head(keys.version_key(proof_version))
        except StoreError as exc:
            _logger.info("no segment ending at version %d from this writer: %s", last, exc)
            return
        if read is None or again is None or log.digest(again[0]) != proof_digest:
            return
        for version, data in read:
            self._recent.keep(version, data)

    def _read_whole(self, versions: list[int], budget: int) -> list[tuple[int, memoryview]] | None:
        """``versions`` read whole, for a segment; None when one is missing, is not the
        version whose head this writer read, or they make more than ``budget`` bytes."""
        read: list[tuple[int, memoryview]] = []
        total = 0
        for version in versions:
            data = self._objects.get(keys.version_key(version))
            head = self._recent.digest(version)
            if data is None or (head is not None and log.digest(data) != head):
                return None
            total += len(data)
            if total > budget:
                return None  # too big for a segment: readers read these one by one
            read.append((version, data))
        return read

    def _exact_twin(self, state: LogState) -> LogState | None:
        """``state`` (proven, with skipped versions) as a full read would have it: the
        previous snapshot and every version since applied to it, or None when that cannot
        be had (no snapshot there, a version missing: the snapshot is then left to the next
        committer). The reads are proven like a load's: the snapshot records its version's
        digest, re-read after them (P1, ``proof``); and the result must end at ``state``'s
        own digest. About K GETs, once every K versions in the whole log, by the committer
        of a snapshot's version only: O(1) per version, and the producers table it gives
        back is exact again."""
        base_version = (state.version - 1) // self.snapshot_every * self.snapshot_every
        try:
            base = self._snapshots.read(base_version)
            if base is None or not base.digest:
                return None
            exact = base
            for version in range(base_version + 1, state.version + 1):
                read = self._read(version)
                if read is None:
                    return None
                exact = logrules.apply_version(exact, read[0], keys.version_key(version), read[1])
            anchor = self._objects.get(keys.version_key(base_version))
        except (CorruptDataError, StoreError) as exc:
            _logger.info("no snapshot of version %d from this writer: %s", state.version, exc)
            return None
        if anchor is None or log.digest(anchor) != base.digest:
            return None
        return exact if exact.digest == state.digest else None

    def write_segment(self, last: int) -> bool:
        """Best effort, like snapshots: the segment ending at version ``last`` from the
        versions' bytes this journal read or wrote, if it holds them all. True if written
        (or somebody wrote it already)."""
        return self._recent.write_segment(self.store, last)

    def write_snapshot(self, state: LogState) -> None:
        """Best effort: a missing snapshot costs readers time, never correctness."""
        self._snapshots.write(state)

    def newest_snapshot_version(self) -> int:
        """The version of the newest snapshot (0 if there is none)."""
        return self._snapshots.newest(trust_hint=True).version
