"""Checkpoint-aligned lifecycle: watermarks, the global watermark and garbage collection.

After a training checkpoint is durable, every rank records its cursor as a watermark
for that checkpoint (``Consumer.mark_checkpoint``); deleting the checkpoint releases it
(``release_checkpoint``). ``W_global`` is the smallest watermark over the live
checkpoints that *every* position has marked: a checkpoint that only some ranks marked
(a crash between two ranks' marks) is not a restore point, so it protects nothing and
holds nothing back. Everything below ``W_global`` is unreachable by any live checkpoint.

    _checkpoints/<id>/<d>-<c>.json     the watermark of position (d, c) (create-only)
    _checkpoints/<id>/_released        the checkpoint was deleted (create-only)

``collect_garbage`` is safe to run from any process, at any time, repeatedly: it first
commits a log version recording what it reclaims (so a consumer asked for a reclaimed
step gets ``DataReclaimedError``, not a missing object), then deletes TGB objects below
``W_global``, log versions and snapshots no live cursor or producer recovery reads, and
orphans (objects no committed version references and no live producer still holds)
older than the grace period. Deletes are idempotent, so a crash half-way is harmless.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

from batchweave import log
from batchweave.errors import ConfigError, CorruptDataError, ObjectExistsError
from batchweave.journal import Journal
from batchweave.log import LogState, Reclaim
from batchweave.store import ObjectInfo, Store, open_store

__all__ = [
    "GCReport",
    "Watermark",
    "collect_garbage",
    "global_watermark",
    "read_watermarks",
    "release_checkpoint",
    "write_watermark",
]

CHECKPOINT_PREFIX = "_checkpoints/"
WATERMARK_FORMAT = "batchweave.watermark/1"
_RELEASED = "_released"
_DATA_KEY = re.compile(r"data/(?P<producer>[^/]+)/e(?P<epoch>\d+)/(?P<offset>\d+)-[0-9a-f]+\.\d+\.bwb")


@dataclass(frozen=True, slots=True)
class Watermark:
    """One position's cursor for one checkpoint."""

    checkpoint: str
    dp: int  # the marking mesh: dp * cp positions must mark before the checkpoint counts
    cp: int
    d: int
    c: int
    position: Fraction  # TGBs consumed when the checkpoint was taken
    version: int  # the cursor's log version (a resume reads from it)

    def to_json(self) -> bytes:
        body = {
            "format": WATERMARK_FORMAT,
            "checkpoint": self.checkpoint,
            "dp": self.dp,
            "cp": self.cp,
            "d": self.d,
            "c": self.c,
            "position": [self.position.numerator, self.position.denominator],
            "version": self.version,
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | memoryview, key: str) -> Watermark:
        try:
            body = json.loads(bytes(data))
            if body.get("format") != WATERMARK_FORMAT:
                raise ValueError(f"format {body.get('format')!r}")
            num, den = body["position"]
            return cls(
                body["checkpoint"], body["dp"], body["cp"], body["d"], body["c"], Fraction(num, den), body["version"]
            )
        except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            raise CorruptDataError(key, f"damaged watermark: {exc}") from exc


def check_checkpoint_id(checkpoint_id: str) -> str:
    return log.check_name(checkpoint_id, "checkpoint_id")


def write_watermark(store: Store, mark: Watermark) -> None:
    """Record ``mark`` once; marking the same position again with the same cursor is a no-op."""
    key = f"{CHECKPOINT_PREFIX}{mark.checkpoint}/{mark.d}-{mark.c}.json"
    try:
        store.put_if_absent(key, mark.to_json())
    except ObjectExistsError:
        existing = Watermark.from_json(store.get(key), key)
        if (existing.position, existing.dp, existing.cp) != (mark.position, mark.dp, mark.cp):
            raise ConfigError(
                f"checkpoint {mark.checkpoint!r} position ({mark.d}, {mark.c}) was already marked at TGB position "
                f"{existing.position} (dp={existing.dp} cp={existing.cp}); checkpoint ids must not be reused"
            ) from None


def release_checkpoint(url: str | Store, checkpoint_id: str, **store_options: Any) -> None:
    """The checkpoint was deleted: its watermarks no longer hold data back. Idempotent."""
    store = open_store(url, **store_options)
    key = f"{CHECKPOINT_PREFIX}{check_checkpoint_id(checkpoint_id)}/{_RELEASED}"
    try:
        store.put_if_absent(key, b"{}")
    except ObjectExistsError:
        pass


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What the store says about one checkpoint id."""

    checkpoint: str
    marks: tuple[Watermark, ...]
    released: bool

    @property
    def complete(self) -> bool:
        """Every position of the marking mesh has marked, all under the same mesh."""
        if not self.marks:
            return False
        dp, cp = self.marks[0].dp, self.marks[0].cp
        if any((m.dp, m.cp) != (dp, cp) for m in self.marks):
            return False
        return {(m.d, m.c) for m in self.marks} == {(d, c) for d in range(dp) for c in range(cp)}

    @property
    def live(self) -> bool:
        return self.complete and not self.released

    @property
    def position(self) -> Fraction:
        return min(m.position for m in self.marks)

    @property
    def version(self) -> int:
        return min(m.version for m in self.marks)


def read_watermarks(store: Store) -> list[Checkpoint]:
    """Every checkpoint recorded in the namespace (one listing plus one read per watermark)."""
    marks: dict[str, list[Watermark]] = {}
    released: set[str] = set()
    for info in store.list(CHECKPOINT_PREFIX):
        checkpoint, _, name = info.key[len(CHECKPOINT_PREFIX) :].partition("/")
        if name == _RELEASED:
            released.add(checkpoint)
        elif name.endswith(".json"):
            marks.setdefault(checkpoint, []).append(Watermark.from_json(store.get(info.key), info.key))
    ids = sorted(marks.keys() | released)
    return [Checkpoint(i, tuple(marks.get(i, ())), i in released) for i in ids]


def global_watermark(checkpoints: Iterable[Checkpoint]) -> Checkpoint | None:
    """The live checkpoint with the smallest watermark: ``W_global``. None if there is none."""
    live = [c for c in checkpoints if c.live]
    return min(live, key=lambda c: c.position) if live else None


# -- garbage collection ----------------------------------------------------------------


@dataclass(slots=True)
class GCReport:
    """What one collection found and did."""

    w_global_step: int | None  # TGBs below this index are unreachable (None: no live checkpoint)
    reclaimed_steps: int = 0  # steps below this are reclaimed after this run
    deleted_objects: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    deleted_versions: int = 0
    deleted_snapshots: int = 0
    orphans: list[str] = field(default_factory=list)
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def collect_garbage(
    url: str | Store, grace_s: float = 3600.0, *, dry_run: bool = False, now: float | None = None, **store_options: Any
) -> GCReport:
    """Delete what no live checkpoint and no producer recovery can reach; see the module doc.

    ``grace_s`` protects objects not (yet) referenced by the log: a producer may have
    written them and not committed yet. ``now`` (Unix seconds) is for tests.
    """
    store = open_store(url, create=False, **store_options)
    journal = Journal(store)
    # List the data first, read the log after: every object in the listing was written by
    # an incarnation whose claim is already in the log, so a producer that started while
    # we listed is known below and its uncommitted objects are not mistaken for orphans.
    listed = list(store.list(log.DATA_PREFIX))
    state = journal.load_state()
    w_global = global_watermark(read_watermarks(store))
    report = GCReport(w_global_step=None if w_global is None else int(w_global.position), dry_run=dry_run)
    target = _plan_reclaim(journal, state, w_global)
    doomed, kept_keys = _scan_versions(journal, state, target)
    target = Reclaim(target.steps, target.versions, state.reclaimed.bytes + sum(size for _, size in doomed))
    orphans = _orphans(listed, state, kept_keys | {k for k, _ in doomed}, grace_s, time.time() if now is None else now)
    report.orphans = sorted(orphans)
    report.reclaimed_steps = target.steps
    if dry_run:
        report.deleted_objects = sorted({k for k, _ in doomed} | orphans)
        return report
    if target != state.reclaimed:
        state = _commit_reclaim(journal, state, target)
    for key, size in doomed:
        store.delete(key)
        report.deleted_objects.append(key)
        report.deleted_bytes += size
    for key in sorted(orphans):
        store.delete(key)
        report.deleted_objects.append(key)
    report.deleted_versions = _delete_old_versions(store, state.reclaimed.versions)
    report.deleted_snapshots = _delete_old_snapshots(store, journal, state.reclaimed.versions)
    return report


def _plan_reclaim(journal: Journal, state: LogState, w_global: Checkpoint | None) -> Reclaim:
    """Steps below ``W_global`` go; log versions below every live cursor and below the
    newest snapshot (which producer recovery starts from) go with them."""
    if w_global is None:
        return state.reclaimed
    steps = max(state.reclaimed.steps, min(int(w_global.position), state.steps))
    snapshot = journal.newest_snapshot_version()
    versions = max(state.reclaimed.versions, min(w_global.version, snapshot))
    return Reclaim(steps=steps, versions=versions, bytes=state.reclaimed.bytes)


def _scan_versions(journal: Journal, state: LogState, target: Reclaim) -> tuple[list[tuple[str, int]], set[str]]:
    """Objects of steps below ``target.steps`` (with sizes), and the keys still referenced."""
    doomed: list[tuple[str, int]] = []
    kept: set[str] = set()
    for version in range(max(1, state.reclaimed.versions), state.version + 1):
        delta = journal.read_version(version)
        if delta is None:
            continue  # deleted by an earlier collection that stopped half-way
        for step, tgb in zip(delta.steps(), delta.tgbs, strict=True):
            if state.reclaimed.steps <= step < target.steps:
                share = tgb.nbytes // len(tgb.objects)
                doomed.extend((key, share) for key in tgb.objects)
            elif step >= target.steps:
                kept.update(tgb.objects)
    return doomed, kept


def _orphans(listed: list[ObjectInfo], state: LogState, referenced: set[str], grace_s: float, now: float) -> set[str]:
    """Data objects no version references, that no live producer may still commit, past the grace."""
    orphans = set()
    for info in listed:
        if info.key in referenced or now - info.modified_s < grace_s:
            continue
        match = _DATA_KEY.fullmatch(info.key)
        if match is not None:
            owner = state.producers.get(match["producer"])
            if owner is not None and int(match["epoch"]) == owner.epoch and int(match["offset"]) >= owner.offset:
                continue  # appended by the live incarnation and maybe still to be committed
        orphans.add(info.key)
    return orphans


def _commit_reclaim(journal: Journal, state: LogState, target: Reclaim) -> LogState:
    """Record the reclaim in the log before deleting anything (create-only, rebase on conflict)."""
    while True:
        delta = log.build_reclaim(state, target, time.time())
        if journal.try_commit(delta):
            state = log.apply_version(state, delta, log.version_key(delta.version))
            journal.after_commit(state)
            return state
        state, _ = journal.catch_up(state)
        if state.reclaimed.steps >= target.steps and state.reclaimed.versions >= target.versions:
            return state  # another collector got there first


def _delete_old_versions(store: Store, below: int) -> int:
    deleted = 0
    for info in store.list(log.LOG_PREFIX):
        name = info.key[len(log.LOG_PREFIX) :]
        if "/" not in name and name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) < below:
            store.delete(info.key)
            deleted += 1
    return deleted


def _delete_old_snapshots(store: Store, journal: Journal, below: int) -> int:
    newest = journal.newest_snapshot_version()
    deleted = 0
    for info in store.list(log.SNAPSHOT_PREFIX):
        name = info.key[len(log.SNAPSHOT_PREFIX) :]
        if name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) < min(below, newest):
            store.delete(info.key)
            deleted += 1
    return deleted
