"""Garbage collection: delete what no live checkpoint and no producer recovery can reach.

``collect_garbage`` is safe to run from any process, at any time, repeatedly: it first
commits a log version recording what it reclaims (so a consumer asked for a reclaimed
step gets ``DataReclaimedError``, not a missing object), then deletes TGB objects below
``W_global`` (the smallest watermark of the live checkpoints: ``batchweave.lifecycle.watermarks``),
log versions and snapshots no live cursor or producer recovery reads, orphans (objects
no committed version references and no live producer still holds) older than the grace
period, and, on a local directory, the staging files of puts killed mid-write
(``Store.staging_files``) older than the grace period. Deletes are idempotent, so a
crash half-way is harmless.

It deletes only keys it can prove are this namespace's (invariant I13): every listed key
must match the namespace's layout in full (``keys.LAYOUT``), and an orphan must be a TGB
object of an incarnation whose claim the log holds. Any other key under its prefixes is
another namespace's inside this one (namespaces must not nest, but one may have been
made before that was checked, or by a racing creation) or a stranger's: it is counted in
``GCReport.foreign_keys`` and left alone.

A collection plans from one state of the log and the data listing, reading only
(``_plan``: the reclaim, the doomed objects, the orphans); ``_settle`` commits the reclaim,
planning again whenever another writer moved the log; ``collect_garbage`` deletes.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from batchweave import keys, log, logrules
from batchweave.commit.claims import dead_tickets
from batchweave.errors import CorruptDataError, ObjectExistsError, ObjectNotFoundError, TransientStoreError
from batchweave.intent import decode_intent, parse_intent_key
from batchweave.journal import Journal
from batchweave.journal.namespace import require_namespace
from batchweave.keys import CLAIM_PREFIX, INTENT_PREFIX, PROBE_PREFIX, parse_data_key
from batchweave.lifecycle.gcsummary import (
    GC_PREFIX,
    SUMMARY_FORMAT,
    GCSummary,
    StepObjects,
    decode_summary,
    encode_summary,
    summary_key,
    summary_version,
)
from batchweave.lifecycle.watermarks import (
    Checkpoint,
    MarkCache,
    global_watermark,
    read_watermarks,
    released_key,
)
from batchweave.log import LogState, LogVersion, Reclaim
from batchweave.segment import SEGMENT_PREFIX
from batchweave.store import ObjectInfo, Store, open_store
from batchweave.store.urls import child_url

__all__ = ["GCReport", "collect_garbage", "dead_intents"]

_logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GCReport:
    """What one collection found and did (with ``dry_run``: what it would do)."""

    w_global_step: int | None  # TGBs below this index are unreachable (None: no live checkpoint)
    reclaimed_steps: int = 0  # steps below this are reclaimed after this run
    # The TGBs' bytes of the steps this run reclaimed, as the log records them (a packed
    # TGB's share of its pack): a pack that a later step still reads stays stored.
    reclaimed_bytes: int = 0
    deleted_objects: list[str] = field(default_factory=list)  # TGB objects, then orphans
    # Bytes of the TGB objects deleted (not the orphans): a pack's, once its last TGB is
    # reclaimed. Sizes as the listing of data/ gave them.
    deleted_bytes: int = 0
    orphan_bytes: int = 0  # bytes of the orphans deleted
    deleted_versions: int = 0
    deleted_snapshots: int = 0
    deleted_segments: int = 0  # log segments whose versions are all reclaimed
    deleted_watermarks: int = 0  # objects of released checkpoints
    deleted_intents: int = 0  # group-commit intents that can never be folded again
    deleted_staging: int = 0  # local directories: files of puts killed mid-write, past the grace
    deleted_staging_bytes: int = 0
    deleted_probes: int = 0  # create-only probe objects that writers without delete permission left
    deleted_tickets: int = 0  # epoch-claim tickets the log folded or passed (``commit.claims``)
    orphans: list[str] = field(default_factory=list)
    # Keys listed under this namespace's prefixes that it cannot prove its own (another
    # namespace's inside it, or a stranger's): left alone (I13).
    foreign_keys: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line of what was reclaimed, deleted (or, in a dry run, would be) and left
        alone. Each count of objects comes with the bytes of those same objects: a pack's
        objects go only with its last TGB, so the TGBs reclaimed are counted apart."""
        verb = "would delete" if self.dry_run else "deleted"
        line = (
            f"reclaimed below step {self.reclaimed_steps} ({self.reclaimed_bytes} bytes of TGBs newly reclaimed); "
            f"{verb} {len(self.deleted_objects) - len(self.orphans)} TGB objects ({self.deleted_bytes} bytes), "
            f"{len(self.orphans)} orphans ({self.orphan_bytes} bytes), {self.deleted_versions} log versions, "
            f"{self.deleted_snapshots} snapshots, {self.deleted_watermarks} watermarks of released checkpoints, "
            f"{self.deleted_staging} staging files of killed puts ({self.deleted_staging_bytes} bytes)"
        )
        if self.foreign_keys:
            line += (
                f"; left alone {self.foreign_keys} keys that are not this namespace's (another namespace inside "
                "it? namespaces must not nest)"
            )
        return line


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one collection will delete, computed from one state of the log."""

    base: Reclaim  # the state's reclaim the plan was computed from
    target: Reclaim
    doomed: list[str]  # TGB objects no unreclaimed step reads (a pack's go with its last TGB)
    reclaimed_bytes: int  # the reclaimed TGBs' bytes (a packed TGB's share of its pack)
    doomed_bytes: int  # the doomed objects' bytes
    orphans: dict[str, int]  # key -> bytes
    foreign: set[str]  # listed under data/, not provably ours: left alone
    summary: GCSummary | None  # what the next collection may start from (None: steps read with gaps)


class _Replan(Exception):
    """Another collector moved the reclaim since we planned: plan again from its state."""


_PLAN_ATTEMPTS = 8


def collect_garbage(
    url: str | Store,
    grace_s: float = 3600.0,
    *,
    dry_run: bool = False,
    now: float | None = None,
    storage_options: dict[str, Any] | None = None,
    marks: MarkCache | None = None,
) -> GCReport:
    """Delete what no live checkpoint and no producer recovery can reach; see the module doc.

    ``grace_s`` protects objects not (yet) referenced by the log: a producer may have
    written them and not committed yet. ``now`` (Unix seconds) is for tests.

    Safe against any interleaving (docs/invariants.md): the reclaim is computed from the
    newest state and validated before it is put, a collector whose view is overtaken
    plans again, and log versions are deleted one at a time in ascending order, which is
    what lets writers prove their view was not cut short (``journal``).
    """
    store = open_store(url, create=False, storage_options=storage_options)
    now = time.time() if now is None else now
    journal = Journal(store)
    # List the data first, read the log after: every object in the listing was written by
    # an incarnation whose claim is already in the log, so a producer that started while
    # we listed is known below and its uncommitted objects are not mistaken for orphans.
    listed = list(store.list(keys.DATA_PREFIX))
    checkpoints = read_watermarks(store, marks)
    w_global = global_watermark(checkpoints)
    report = GCReport(w_global_step=None if w_global is None else int(w_global.position), dry_run=dry_run)
    summaries = _Summaries(store, journal)
    state, plan = _settle(journal, listed, w_global, grace_s, now, dry_run, summaries)
    require_namespace(store, state, has_checkpoints=bool(checkpoints))
    own = _OwnKeys(store, plan.foreign)
    report.reclaimed_steps = plan.target.steps
    report.reclaimed_bytes = plan.reclaimed_bytes
    report.orphans = sorted(plan.orphans)
    report.deleted_bytes, report.orphan_bytes = plan.doomed_bytes, sum(plan.orphans.values())
    released = [c for c in checkpoints if c.released]
    if dry_run:
        report.deleted_objects = sorted(set(plan.doomed) | plan.orphans.keys())
        report.deleted_versions = len(_old_versions(own, plan.target.versions))
        report.deleted_snapshots = len(_old_snapshots(own, journal, plan.target.versions))
        report.deleted_segments = len(_old_segments(own, plan.target.versions))
        report.deleted_watermarks = sum(len(c.marks) + 1 for c in released)
        report.deleted_intents = len(_dead_intents(own, state))
        stale = _stale_staging(own, grace_s, now)
        report.deleted_staging, report.deleted_staging_bytes = len(stale), sum(info.size for info in stale)
        report.deleted_probes = len(_stale_probes(own, grace_s, now))
        report.deleted_tickets = len(_dead_tickets(own, state))
        report.foreign_keys = own.report()
        return report
    for key in plan.doomed:
        store.delete(key)
        report.deleted_objects.append(key)
    for key in sorted(plan.orphans):
        store.delete(key)
        report.deleted_objects.append(key)
    summaries.write(plan.summary)  # after the deletes: it names only objects still stored
    # Ascending and one at a time: while a version is present, none above it is gone.
    # Listed on every run, even when the last one cleared below the reclaim point: a
    # zombie writer may re-create a freed version there at any time, and one that may not
    # delete leaves it to us (test_permissions' zombie test).
    for key in _old_versions(own, state.reclaimed.versions):
        store.delete(key)
        report.deleted_versions += 1
    for key in _old_snapshots(own, journal, state.reclaimed.versions):
        store.delete(key)
        report.deleted_snapshots += 1
    for key in _old_segments(own, state.reclaimed.versions):
        store.delete(key)
        report.deleted_segments += 1
    report.deleted_watermarks = _delete_released(store, released)
    for key in _dead_intents(own, state):
        store.delete(key)
        report.deleted_intents += 1
    for info in _stale_staging(own, grace_s, now):
        store.delete_staging(info.key)
        report.deleted_staging += 1
        report.deleted_staging_bytes += info.size
    for key in _stale_probes(own, grace_s, now):
        store.delete(key)
        report.deleted_probes += 1
    for key in _dead_tickets(own, state):
        store.delete(key)
        report.deleted_tickets += 1
    report.foreign_keys = own.report()
    return report


class _OwnKeys:
    """One collection's listings, keeping only the keys of this namespace's layout
    (``keys.is_own_key``): the others are not its to delete (I13). It counts them, logs
    them at DEBUG, and says at INFO where another namespace lies inside this one."""

    def __init__(self, store: Store, foreign: set[str]) -> None:
        self.store = store
        self.foreign = set(foreign)  # (a set: the log's prefix is listed more than once)

    def list(self, prefix: str) -> list[ObjectInfo]:
        own = []
        for info in self.store.list(prefix):
            if keys.is_own_key(info.key):
                own.append(info)
            else:
                self.foreign.add(info.key)
        return own

    def staging_files(self) -> list[ObjectInfo]:
        """The staging files of puts of keys of this namespace's layout (the key is the
        file's name up to its '#'): on a local directory, a namespace inside this one
        has its own."""
        own = []
        for info in self.store.staging_files():
            if keys.is_own_key(info.key.rpartition("#")[0]):
                own.append(info)
            else:
                self.foreign.add(info.key)
        return own

    def report(self) -> int:
        """How many keys were left alone, once logged."""
        if not self.foreign:
            return 0
        nested = sorted({root for key in self.foreign if (root := keys.nested_namespace(key)) is not None})
        for root in nested:
            _logger.info(
                "%s: another namespace lies inside this one, at %s (namespaces must not nest); "
                "garbage collection leaves its keys alone",
                self.store.url,
                child_url(self.store.url, root),
            )
        shown = sorted(self.foreign)[:_FOREIGN_SHOWN]
        _logger.debug(
            "%s: left %d keys that are not of this namespace's layout, e.g. %s",
            self.store.url,
            len(self.foreign),
            shown,
        )
        return len(self.foreign)


_FOREIGN_SHOWN = 20  # foreign keys named in the DEBUG line


def _stale_staging(own: _OwnKeys, grace_s: float, now: float) -> list[ObjectInfo]:
    """Staging files of local puts older than the grace: their put was killed (a live put
    whose file goes anyway writes it again, see ``store.localfs.write_durably``)."""
    return [info for info in own.staging_files() if now - info.modified_s >= grace_s]


def _dead_tickets(own: _OwnKeys, state: LogState) -> list[str]:
    """Epoch-claim tickets the log has folded or passed: their producers delete them as
    they start, unless they may not delete (the producer role) or crashed first. A
    ticket the log has not passed may still be folded: it stays."""
    return dead_tickets(state, (info.key for info in own.list(CLAIM_PREFIX)))


def _stale_probes(own: _OwnKeys, grace_s: float, now: float) -> list[str]:
    """Objects of the create-only probe (``Store.require_create_only``) older than the
    grace: a probe deletes its key within milliseconds, so these are the ones a writer
    without delete permission (or one that crashed mid-probe) left behind."""
    return [info.key for info in own.list(PROBE_PREFIX) if now - info.modified_s >= grace_s]


def dead_intents(store: Store, state: LogState) -> list[str]:
    """Group-commit intents (``batchweave.commit.group``) that ``state`` has made useless: of an
    epoch the log has fenced, or whose TGBs are all committed. Their producers delete
    them as they go; these are a crashed incarnation's or a deletion that failed.
    Deleting a live intent would be safe too (its producer commits its own TGBs), so a
    state a little old only leaves some for the next collection."""
    return _dead_intents(_OwnKeys(store, set()), state)


def _dead_intents(own: _OwnKeys, state: LogState) -> list[str]:
    store = own.store
    dead = []
    for info in own.list(INTENT_PREFIX):
        parsed = parse_intent_key(info.key)
        recorded = state.producers.get(parsed[0]) if parsed else None
        if parsed is None or recorded is None:
            continue  # not an intent, or of a producer this state does not know yet
        if parsed[1] < recorded.epoch or (
            parsed[1] == recorded.epoch and _intent_end(store, info.key) <= recorded.offset
        ):
            dead.append(info.key)
    return dead


def _intent_end(store: Store, key: str) -> int:
    """One past the intent's last offset; 0 (dead) for an intent that is gone or damaged."""
    try:
        return decode_intent(store.get(key), key).end_offset
    except (ObjectNotFoundError, CorruptDataError):
        return 0


def _settle(
    journal: Journal[LogVersion],
    listed: list[ObjectInfo],
    w_global: Checkpoint | None,
    grace_s: float,
    now: float,
    dry_run: bool,
    summaries: _Summaries,
) -> tuple[LogState, _Plan]:
    """Plan from the newest state and commit the reclaim; replan whenever the log moves
    under us. Returns a state whose view is verified (nothing it read came from a key
    collection had freed) and the plan to carry out."""
    for _ in range(_PLAN_ATTEMPTS):
        state = journal.load_state()
        plan = _plan(journal, state, w_global, listed, grace_s, now, summaries.usable(state))
        if dry_run:
            return state, plan
        # I10: the plan read versions from the reclaim on, below the journal's anchor. They
        # are proven by a proven state, read after them, that still records that reclaim
        # (GC records a reclaim before deleting anything); otherwise plan again.
        state, _ = journal.catch_up(state)
        if state.reclaimed != plan.base:
            continue
        if plan.target == state.reclaimed:
            return state, plan
        try:
            result = journal.commit(state, functools.partial(_reclaim_version, plan))
        except _Replan:
            continue
        return result.state, plan
    # Transient: other writers were busy, and the next collection plans again.
    raise TransientStoreError(
        keys.LOG_PREFIX, f"the log kept moving under garbage collection over {_PLAN_ATTEMPTS} plans"
    )


def _reclaim_version(plan: _Plan, state: LogState) -> log.LogVersion | None:
    """The build of the reclaim version, on the newest state (see ``Journal.commit``)."""
    done = state.reclaimed
    if done.steps >= plan.target.steps and done.versions >= plan.target.versions:
        return None  # this plan, or a larger one, is recorded already
    if done != plan.base:
        raise _Replan  # another collector reclaimed part of it: our byte count is off
    return logrules.build_reclaim(state, plan.target, time.time())


def _plan(
    journal: Journal[LogVersion],
    state: LogState,
    w_global: Checkpoint | None,
    listed: list[ObjectInfo],
    grace_s: float,
    now: float,
    summary: GCSummary | None,
) -> _Plan:
    target = _plan_reclaim(journal, state, w_global)
    tgbs = _unreclaimed_tgbs(journal, state, summary)
    doomed, kept, reclaimed_bytes = doomed_objects(tgbs, target.steps)
    # The log names only keys of TGB objects; one that is not (a descriptor no writer of
    # ours made) is not ours to delete either.
    foreign = {key for key in doomed if parse_data_key(key) is None}
    doomed = [key for key in doomed if key not in foreign]
    target = Reclaim(target.steps, target.versions, state.reclaimed.bytes + reclaimed_bytes)
    orphans, unproven = _orphans(listed, state, kept | set(doomed) | foreign, grace_s, now)
    return _Plan(
        state.reclaimed,
        target,
        doomed,
        reclaimed_bytes,
        _stored_bytes(doomed, listed, tgbs),
        orphans,
        foreign | unproven,
        _next_summary(state, target, tgbs),
    )


def doomed_objects(tgbs: dict[int, StepObjects], below: int) -> tuple[list[str], set[str], int]:
    """The objects to delete when the steps below ``below`` are reclaimed, the objects kept
    (read by a step at or above it), and the reclaimed TGBs' bytes. A pack's objects are
    shared by consecutive TGBs (``batchweave.packing``): they go with the last of them."""
    reclaimed = [tgb for step, tgb in tgbs.items() if step < below]
    kept = {key for step, tgb in tgbs.items() if step >= below for key in tgb.objects}
    doomed = list(dict.fromkeys(key for tgb in reclaimed for key in tgb.objects if key not in kept))
    return doomed, kept, sum(tgb.nbytes for tgb in reclaimed)


def _stored_bytes(objects: list[str], listed: list[ObjectInfo], tgbs: dict[int, StepObjects]) -> int:
    """The bytes ``objects`` take, as the listing of data/ gave their sizes. One that the
    listing did not show (written while it ran) counts by the bytes of the TGBs read
    from it, split evenly over each TGB's objects (a pack's TGBs' bytes add up to its
    objects': ``layout.Pack.tgb_nbytes``)."""
    sizes = {info.key: info.size for info in listed}
    total = sum(sizes[key] for key in objects if key in sizes)
    unlisted = set(objects) - sizes.keys()
    for tgb in tgbs.values() if unlisted else ():
        share = sum(key in unlisted for key in tgb.objects)
        total += tgb.nbytes * share // len(tgb.objects)
    return total


def _plan_reclaim(journal: Journal[LogVersion], state: LogState, w_global: Checkpoint | None) -> Reclaim:
    """Steps below ``W_global`` go; log versions below every live cursor and below the
    newest snapshot (which producer recovery starts from) go with them."""
    if w_global is None:
        return state.reclaimed
    steps = max(state.reclaimed.steps, min(int(w_global.position), state.steps))
    snapshot = journal.newest_snapshot_version()
    versions = max(state.reclaimed.versions, min(w_global.version, snapshot, state.version))
    return Reclaim(steps=steps, versions=versions, bytes=state.reclaimed.bytes)


def _unreclaimed_tgbs(
    journal: Journal[LogVersion], state: LogState, summary: GCSummary | None
) -> dict[int, StepObjects]:
    """The TGB of every step not reclaimed in ``state``, by step: from the last
    collection's summary and the versions committed since, or else from every version
    from the reclaim point on."""
    first = state.reclaimed.steps
    tgbs: dict[int, StepObjects] = {}
    after = max(1, state.reclaimed.versions) - 1
    if summary is not None:
        tgbs = {summary.first_step + i: tgb for i, tgb in enumerate(summary.tgbs) if summary.first_step + i >= first}
        after = summary.version
    for version in range(after + 1, state.version + 1):
        delta = journal.read_version(version)
        if delta is None:
            continue  # deleted by an earlier collection that stopped half-way
        for step, tgb in zip(delta.steps(), delta.tgbs, strict=True):
            if step >= first:
                tgbs[step] = StepObjects(tgb.nbytes, list(tgb.objects))
    return tgbs


def _next_summary(state: LogState, target: Reclaim, tgbs: dict[int, StepObjects]) -> GCSummary | None:
    """What the next collection may start from once this one reclaimed ``target``: the
    TGBs past it, as of ``state``; None when they have gaps (versions another collection
    deleted under us: this plan will not be carried out anyway)."""
    kept = sorted(step for step in tgbs if step >= target.steps)
    if kept != list(range(target.steps, state.steps)):
        return None
    return GCSummary(
        SUMMARY_FORMAT, state.namespace, state.version, state.digest, target.steps, [tgbs[step] for step in kept]
    )


class _Summaries:
    """The summaries under ``_gc/``: the newest one read (one listing, one GET) and
    checked against the log (one GET of the version it names) before a plan uses it."""

    def __init__(self, store: Store, journal: Journal[LogVersion]) -> None:
        self._store = store
        self._journal = journal
        self._keys = sorted(
            (number, info.key) for info in store.list(GC_PREFIX) if (number := summary_version(info.key)) is not None
        )
        self._newest: GCSummary | None = None
        self._checked: dict[int, bool] = {}  # version -> the log still holds it with the summary's digest
        if self._keys:
            key = self._keys[-1][1]
            try:
                self._newest = decode_summary(store.get(key), key)
            except (ObjectNotFoundError, CorruptDataError) as exc:
                _logger.warning("garbage collection: %s; reading the log's versions instead", exc)

    def usable(self, state: LogState) -> GCSummary | None:
        """The newest summary if ``state``'s collection may start from it."""
        summary = self._newest
        if summary is None or summary.namespace != state.namespace:
            return None
        if not state.reclaimed.versions <= summary.version <= state.version:
            return None  # the version it was read through is gone (or from a future we do not see)
        if summary.first_step > state.reclaimed.steps:
            return None  # it starts past steps this state still holds
        if summary.version not in self._checked:
            read = self._journal.read_version_data(summary.version)
            self._checked[summary.version] = read is not None and log.digest(read.data) == summary.digest
        return summary if self._checked[summary.version] else None

    def write(self, summary: GCSummary | None) -> None:
        """Write ``summary`` (create-only) and delete the older ones; nothing for a log
        with no version yet, or when the newest summary is of the same version."""
        if summary is None or summary.version == 0 or (self._keys and self._keys[-1][0] == summary.version):
            return
        try:
            self._store.put_if_absent(summary_key(summary.version), encode_summary(summary))
        except ObjectExistsError:
            pass  # another collection planned from the same version: the same TGBs
        for number, key in self._keys:
            if number < summary.version:
                self._store.delete(key)


def _orphans(
    listed: list[ObjectInfo], state: LogState, referenced: set[str], grace_s: float, now: float
) -> tuple[dict[str, int], set[str]]:
    """Data objects no version references, that no live producer may still commit, past
    the grace (key -> bytes); and the listed keys this namespace cannot prove its own.

    Ours is a TGB object's key (``keys.parse_data_key``) of an incarnation whose claim the
    log holds: the listing was taken before the log was read, and an incarnation writes
    only once its claim is committed. Anything else under data/ (another namespace's keys
    inside this one, a stranger's file, a producer or epoch the log never had) is left
    alone (I13)."""
    orphans: dict[str, int] = {}
    foreign = set()
    for info in listed:
        if info.key in referenced:
            continue
        parsed = parse_data_key(info.key)
        owner = state.producers.get(parsed.producer) if parsed is not None else None
        if parsed is None or owner is None or parsed.epoch > owner.epoch:
            foreign.add(info.key)
        elif now - info.modified_s < grace_s:
            continue
        elif parsed.epoch == owner.epoch and parsed.offset >= owner.offset:
            continue  # appended by the live incarnation and maybe still to be committed
        else:
            orphans[info.key] = info.size
    return orphans, foreign


def _numbered(own: _OwnKeys, prefix: str, kind: str) -> list[tuple[int, str]]:
    """(number, key) of the objects of ``kind`` under ``prefix`` (``keys.numbered_key``), in ascending order."""
    found = []
    for info in own.list(prefix):
        number = keys.numbered_key(info.key, kind)
        if number is not None:
            found.append((number, info.key))
    return sorted(found)


def _old_versions(own: _OwnKeys, below: int) -> list[str]:
    return [key for number, key in _numbered(own, keys.LOG_PREFIX, "version") if number < below]


def _old_snapshots(own: _OwnKeys, journal: Journal[LogVersion], below: int) -> list[str]:
    """Snapshots below ``below``, never the newest (a writer with no snapshot in sight
    proves that no version was ever deleted by finding none: ``Journal.verify``)."""
    newest = journal.newest_snapshot_version()
    return [key for number, key in _numbered(own, keys.SNAPSHOT_PREFIX, "snapshot") if number < min(below, newest)]


def _old_segments(own: _OwnKeys, below: int) -> list[str]:
    """Segments whose versions are all below ``below`` (a segment only copies versions,
    so one that still holds a kept version stays until its last version goes)."""
    return [key for last, key in _numbered(own, SEGMENT_PREFIX, "segment") if last < below]


def _delete_released(store: Store, released: list[Checkpoint]) -> int:
    """Watermarks of released checkpoints, then their release marker (so a crash half-way
    leaves a checkpoint that is still released, never one that looks live again)."""
    deleted = 0
    for checkpoint in released:
        for mark in checkpoint.marks:
            store.delete(mark.key)
            deleted += 1
        store.delete(released_key(checkpoint.checkpoint))
        deleted += 1
    return deleted
