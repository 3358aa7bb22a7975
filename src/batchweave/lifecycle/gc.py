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
from batchweave.keys import CLAIM_PREFIX, INTENT_PREFIX, parse_data_key
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
from batchweave.store import PROBE_PREFIX, ObjectInfo, Store, open_store

__all__ = ["GCReport", "collect_garbage", "dead_intents"]

_logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GCReport:
    """What one collection found and did (with ``dry_run``: what it would do)."""

    w_global_step: int | None  # TGBs below this index are unreachable (None: no live checkpoint)
    reclaimed_steps: int = 0  # steps below this are reclaimed after this run
    deleted_objects: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
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
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one collection will delete, computed from one state of the log."""

    base: Reclaim  # the state's reclaim the plan was computed from
    target: Reclaim
    doomed: list[str]  # TGB objects no unreclaimed step reads (a pack's go with its last TGB)
    doomed_bytes: int  # the reclaimed TGBs' bytes (a packed TGB's share of its pack)
    orphans: set[str]
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
    report.reclaimed_steps = plan.target.steps
    report.orphans = sorted(plan.orphans)
    released = [c for c in checkpoints if c.released]
    if dry_run:
        report.deleted_objects = sorted(set(plan.doomed) | plan.orphans)
        report.deleted_bytes = plan.doomed_bytes
        report.deleted_versions = len(_old_versions(store, plan.target.versions))
        report.deleted_snapshots = len(_old_snapshots(store, journal, plan.target.versions))
        report.deleted_segments = len(_old_segments(store, plan.target.versions))
        report.deleted_watermarks = sum(len(c.marks) + 1 for c in released)
        report.deleted_intents = len(dead_intents(store, state))
        stale = _stale_staging(store, grace_s, now)
        report.deleted_staging, report.deleted_staging_bytes = len(stale), sum(info.size for info in stale)
        report.deleted_probes = len(_stale_probes(store, grace_s, now))
        report.deleted_tickets = len(_dead_tickets(store, state))
        return report
    for key in plan.doomed:
        store.delete(key)
        report.deleted_objects.append(key)
    report.deleted_bytes = plan.doomed_bytes
    for key in sorted(plan.orphans):
        store.delete(key)
        report.deleted_objects.append(key)
    summaries.write(plan.summary)  # after the deletes: it names only objects still stored
    # Ascending and one at a time: while a version is present, none above it is gone.
    # Listed on every run, even when the last one cleared below the reclaim point: a
    # zombie writer may re-create a freed version there at any time, and one that may not
    # delete leaves it to us (test_permissions' zombie test).
    for key in _old_versions(store, state.reclaimed.versions):
        store.delete(key)
        report.deleted_versions += 1
    for key in _old_snapshots(store, journal, state.reclaimed.versions):
        store.delete(key)
        report.deleted_snapshots += 1
    for key in _old_segments(store, state.reclaimed.versions):
        store.delete(key)
        report.deleted_segments += 1
    report.deleted_watermarks = _delete_released(store, released)
    for key in dead_intents(store, state):
        store.delete(key)
        report.deleted_intents += 1
    for info in _stale_staging(store, grace_s, now):
        store.delete_staging(info.key)
        report.deleted_staging += 1
        report.deleted_staging_bytes += info.size
    for key in _stale_probes(store, grace_s, now):
        store.delete(key)
        report.deleted_probes += 1
    for key in _dead_tickets(store, state):
        store.delete(key)
        report.deleted_tickets += 1
    return report


def _stale_staging(store: Store, grace_s: float, now: float) -> list[ObjectInfo]:
    """Staging files of local puts older than the grace: their put was killed (a live put
    whose file goes anyway writes it again, see ``store.localfs.write_durably``)."""
    return [info for info in store.staging_files() if now - info.modified_s >= grace_s]


def _dead_tickets(store: Store, state: LogState) -> list[str]:
    """Epoch-claim tickets the log has folded or passed: their producers delete them as
    they start, unless they may not delete (the producer role) or crashed first. A
    ticket the log has not passed may still be folded: it stays."""
    return dead_tickets(state, (info.key for info in store.list(CLAIM_PREFIX)))


def _stale_probes(store: Store, grace_s: float, now: float) -> list[str]:
    """Objects of the create-only probe (``Store.require_create_only``) older than the
    grace: a probe deletes its key within milliseconds, so these are the ones a writer
    without delete permission (or one that crashed mid-probe) left behind."""
    return [info.key for info in store.list(PROBE_PREFIX) if now - info.modified_s >= grace_s]


def dead_intents(store: Store, state: LogState) -> list[str]:
    """Group-commit intents (``batchweave.commit.group``) that ``state`` has made useless: of an
    epoch the log has fenced, or whose TGBs are all committed. Their producers delete
    them as they go; these are a crashed incarnation's or a deletion that failed.
    Deleting a live intent would be safe too (its producer commits its own TGBs), so a
    state a little old only leaves some for the next collection."""
    dead = []
    for info in store.list(INTENT_PREFIX):
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
    doomed, kept, doomed_bytes = doomed_objects(tgbs, target.steps)
    target = Reclaim(target.steps, target.versions, state.reclaimed.bytes + doomed_bytes)
    orphans = _orphans(listed, state, kept | set(doomed), grace_s, now)
    return _Plan(state.reclaimed, target, doomed, doomed_bytes, orphans, _next_summary(state, target, tgbs))


def doomed_objects(tgbs: dict[int, StepObjects], below: int) -> tuple[list[str], set[str], int]:
    """The objects to delete when the steps below ``below`` are reclaimed, the objects kept
    (read by a step at or above it), and the reclaimed TGBs' bytes. A pack's objects are
    shared by consecutive TGBs (``batchweave.packing``): they go with the last of them."""
    reclaimed = [tgb for step, tgb in tgbs.items() if step < below]
    kept = {key for step, tgb in tgbs.items() if step >= below for key in tgb.objects}
    doomed = list(dict.fromkeys(key for tgb in reclaimed for key in tgb.objects if key not in kept))
    return doomed, kept, sum(tgb.nbytes for tgb in reclaimed)


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


def _orphans(listed: list[ObjectInfo], state: LogState, referenced: set[str], grace_s: float, now: float) -> set[str]:
    """Data objects no version references, that no live producer may still commit, past the grace."""
    orphans = set()
    for info in listed:
        if info.key in referenced or now - info.modified_s < grace_s:
            continue
        parsed = parse_data_key(info.key)
        if parsed is not None:
            owner = state.producers.get(parsed.producer)
            if owner is not None and parsed.epoch == owner.epoch and parsed.offset >= owner.offset:
                continue  # appended by the live incarnation and maybe still to be committed
        orphans.add(info.key)
    return orphans


def _numbered(store: Store, prefix: str, suffix: str = ".json") -> list[tuple[int, str]]:
    """(number, key) of the ``<prefix><digits><suffix>`` objects, in ascending order."""
    found = []
    for info in store.list(prefix):
        name = info.key[len(prefix) :]
        number = name.removesuffix(suffix)
        if "/" not in name and name.endswith(suffix) and number.isdigit():
            found.append((int(number), info.key))
    return sorted(found)


def _old_versions(store: Store, below: int) -> list[str]:
    return [key for number, key in _numbered(store, keys.LOG_PREFIX) if number < below]


def _old_snapshots(store: Store, journal: Journal[LogVersion], below: int) -> list[str]:
    """Snapshots below ``below``, never the newest (a writer with no snapshot in sight
    proves that no version was ever deleted by finding none: ``Journal.verify``)."""
    newest = journal.newest_snapshot_version()
    return [key for number, key in _numbered(store, keys.SNAPSHOT_PREFIX) if number < min(below, newest)]


def _old_segments(store: Store, below: int) -> list[str]:
    """Segments whose versions are all below ``below`` (a segment only copies versions,
    so one that still holds a kept version stays until its last version goes)."""
    return [key for last, key in _numbered(store, SEGMENT_PREFIX, ".json.z") if last < below]


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
