"""Checkpoint watermarks: what each rank had consumed when a checkpoint was taken.

After a training checkpoint is durable, every rank records its cursor as a watermark
for that checkpoint (``Consumer.mark_checkpoint``); deleting the checkpoint releases it
(``release_checkpoint``, which refuses an id no rank marked). ``W_global`` is the smallest watermark over the live
checkpoints that *every* position has marked: a checkpoint that only some ranks marked
(a crash between two ranks' marks) is not a restore point, so it protects nothing and
holds nothing back. Everything below ``W_global`` is unreachable by any live checkpoint,
which is what garbage collection (``batchweave.lifecycle.gc``) and producer backpressure
(``Producer(max_lag=...)``) read.

    _checkpoints/<id>/<d>-<c>.json     the watermark of position (d, c) (create-only)
    _checkpoints/<id>/_released        the checkpoint was deleted (create-only)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated, Any

import msgspec

from batchweave import keys
from batchweave.decoding import decoding
from batchweave.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptDataError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from batchweave.journal import Journal
from batchweave.journal.namespace import require_namespace
from batchweave.keys import CHECKPOINT_PREFIX
from batchweave.store import ObjectInfo, Store, open_store

__all__ = [
    "CHECKPOINT_PREFIX",
    "WATERMARK_FORMAT",
    "Checkpoint",
    "MarkCache",
    "Watermark",
    "check_checkpoint_id",
    "global_watermark",
    "read_watermarks",
    "release_checkpoint",
    "released_key",
    "write_watermark",
]

WATERMARK_FORMAT = "batchweave.watermark/1"
_RELEASED = "_released"


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

    @property
    def key(self) -> str:
        """The object this watermark is stored in (create-only, one per position)."""
        return f"{CHECKPOINT_PREFIX}{self.checkpoint}/{self.d}-{self.c}.json"

    def to_json(self) -> bytes:
        position = (self.position.numerator, self.position.denominator)
        return _WATERMARK_JSON.encode(
            _WatermarkJSON(WATERMARK_FORMAT, self.checkpoint, self.dp, self.cp, self.d, self.c, position, self.version)
        )

    @classmethod
    def from_json(cls, data: bytes | memoryview, key: str) -> Watermark:
        """Parse the watermark stored at ``key``: a Watermark, or CorruptDataError naming
        ``key`` and the damage. Strict, because GC trusts what it returns: a mark that a
        later step would trip over (a string ``dp``, ``d >= dp``, a mark filed under
        another checkpoint or position) is refused here, in time linear in ``len(data)``."""
        with decoding(key, "damaged watermark"):
            body = _WATERMARK_DECODER.decode(data)
        if body.format != WATERMARK_FORMAT:
            raise CorruptDataError(key, f"watermark format {body.format[:80]!r} is not {WATERMARK_FORMAT}")
        if body.d >= body.dp or body.c >= body.cp:
            raise CorruptDataError(key, f"watermark position ({body.d}, {body.c}) is outside dp={body.dp} cp={body.cp}")
        try:
            check_checkpoint_id(body.checkpoint)  # a name with "/" would not round-trip the listing
        except ConfigError as exc:
            raise CorruptDataError(key, f"damaged watermark: {exc}") from exc
        num, den = body.position
        mark = cls(body.checkpoint, body.dp, body.cp, body.d, body.c, Fraction(num, den), body.version)
        if mark.key != key:  # filed elsewhere, it would count towards another checkpoint or position
            raise CorruptDataError(key, f"holds the watermark that belongs at {mark.key!r}")
        return mark


# The watermark's JSON: the fields and order are the format (batchweave.watermark/1). Every
# integer is a JSON integer (not a bool, not a float) in 0..2**63-1, so nothing a watermark
# feeds (Fractions, GC arithmetic, keys) ever handles a huge or oddly typed number.
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]


class _WatermarkJSON(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    checkpoint: str
    dp: _Size
    cp: _Size
    d: _Count
    c: _Count
    position: tuple[_Count, _Size]  # [numerator, denominator] of TGBs consumed
    version: _Count


_WATERMARK_JSON = msgspec.json.Encoder()
_WATERMARK_DECODER = msgspec.json.Decoder(_WatermarkJSON)


def check_checkpoint_id(checkpoint_id: str) -> str:
    return keys.check_name(checkpoint_id, "checkpoint_id")


def released_key(checkpoint_id: str) -> str:
    """The object whose presence says checkpoint ``checkpoint_id`` was deleted."""
    return f"{CHECKPOINT_PREFIX}{checkpoint_id}/{_RELEASED}"


def write_watermark(store: Store, mark: Watermark) -> None:
    """Record ``mark`` once; marking the same position again with the same cursor is a no-op."""
    key = mark.key
    try:
        store.put_if_absent(key, mark.to_json())
    except ObjectExistsError:
        existing = Watermark.from_json(store.get(key), key)
        if (existing.position, existing.dp, existing.cp) != (mark.position, mark.dp, mark.cp):
            raise ConfigError(
                f"checkpoint {mark.checkpoint!r} position ({mark.d}, {mark.c}) was already marked at TGB position "
                f"{existing.position} (dp={existing.dp} cp={existing.cp}); checkpoint ids must not be reused"
            ) from None


def release_checkpoint(
    url: str | Store, checkpoint_id: str, *, missing_ok: bool = False, storage_options: dict[str, Any] | None = None
) -> bool:
    """The checkpoint was deleted: its watermarks no longer hold data back.

    Releasing a checkpoint that is already released changes nothing. A checkpoint id that
    no rank marked in the namespace (a typo such as ``ckpt-001`` for ``ckpt-0001``, or one
    released long ago that garbage collection has since forgotten) raises
    CheckpointNotFoundError naming the id, the namespace and the closest ids there are,
    and writes nothing: the checkpoint meant keeps pinning its data until it is released
    by its right name. With ``missing_ok=True`` such an id is ignored quietly (scripts that
    release the same ids again); nothing is written for it either, so a checkpoint marked
    later under that id is not born released.

    Returns True once the checkpoint is released (now or before), False for an id that
    ``missing_ok`` let pass. Costs one listing of the checkpoint's own marks and one
    create-only put; an unknown id costs one more listing, of every checkpoint's marks
    (for the message). Raises ConfigError for a namespace that does not exist
    (``require_namespace``), whatever ``missing_ok`` says.
    """
    store = open_store(url, create=False, storage_options=storage_options)
    checkpoint_id = check_checkpoint_id(checkpoint_id)
    if next(iter(store.list(f"{CHECKPOINT_PREFIX}{checkpoint_id}/")), None) is not None:
        try:
            store.put_if_absent(released_key(checkpoint_id), b"{}")
        except ObjectExistsError:
            pass  # released already
        return True
    if missing_ok:
        _require_namespace(store, has_checkpoints=next(iter(store.list(CHECKPOINT_PREFIX)), None) is not None)
        return False
    known, live = _checkpoint_ids(store)
    _require_namespace(store, has_checkpoints=bool(known))
    raise CheckpointNotFoundError(store.url, checkpoint_id, known, live)


def _require_namespace(store: Store, *, has_checkpoints: bool) -> None:
    """A mistyped URL is a ConfigError, not a missing checkpoint (a local directory exists
    or not: ``open_store`` said; on an object store, read the log's state only when no
    checkpoint shows there is a namespace)."""
    if store.object_store and not has_checkpoints:
        require_namespace(store, Journal(store, heads_only=True, read_only=True).load_state(), has_checkpoints=False)


def _checkpoint_ids(store: Store) -> tuple[list[str], list[str]]:
    """Every checkpoint id of the namespace, and those not released, sorted: one listing,
    no reads."""
    ids: set[str] = set()
    released: set[str] = set()
    for info in store.list(CHECKPOINT_PREFIX):
        checkpoint, _, name = info.key[len(CHECKPOINT_PREFIX) :].partition("/")
        ids.add(checkpoint)
        if name == _RELEASED:
            released.add(checkpoint)
    return sorted(ids), sorted(ids - released)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What the store says about one checkpoint id."""

    checkpoint: str
    marks: tuple[Watermark, ...]
    released: bool

    @property
    def complete(self) -> bool:
        """Every position of the marking mesh has marked, all under the same mesh.

        O(marks), whatever the mesh a mark claims: counting the distinct in-range
        positions is enough, and dp * cp (maybe 2**126 in a crafted mark) is only compared.
        """
        if not self.marks:
            return False
        dp, cp = self.marks[0].dp, self.marks[0].cp
        if any((m.dp, m.cp) != (dp, cp) for m in self.marks) or len(self.marks) < dp * cp:
            return False
        return len({(m.d, m.c) for m in self.marks if 0 <= m.d < dp and 0 <= m.c < cp}) == dp * cp

    @property
    def live(self) -> bool:
        return self.complete and not self.released

    @property
    def position(self) -> Fraction:
        return min(m.position for m in self.marks)

    @property
    def version(self) -> int:
        return min(m.version for m in self.marks)


# A watermark already read, by its key: valid while the listing shows the same object
# (size and time), since marks are written create-only and never changed.
MarkCache = dict[str, tuple[tuple[int, float], Watermark]]


def read_watermarks(store: Store, cache: MarkCache | None = None) -> list[Checkpoint]:
    """Every checkpoint recorded in the namespace: one listing plus one read per watermark,
    or, with ``cache`` (kept by the caller between calls, as a producer held by
    ``max_lag`` does), one read per watermark not read before: a poll of a namespace whose
    marks did not change is one listing, however many ranks marked."""
    marks: dict[str, list[Watermark]] = {}
    released: set[str] = set()
    listed: set[str] = set()
    for info in store.list(CHECKPOINT_PREFIX):
        # Only keys of the layout (I13): another namespace's inside this one is not ours.
        if (release := keys.LAYOUT["release"].fullmatch(info.key)) is not None:
            released.add(release["checkpoint"])
        elif (found := keys.LAYOUT["watermark"].fullmatch(info.key)) is not None:
            checkpoint = found["checkpoint"]
            listed.add(info.key)
            mark = _read_mark(store, info, cache)
            if mark is None:
                # Listed, then deleted by a concurrent collector, which deletes the marks of
                # released checkpoints only: this one protects nothing.
                released.add(checkpoint)
                continue
            marks.setdefault(checkpoint, []).append(mark)
    if cache is not None:
        for gone in cache.keys() - listed:
            del cache[gone]  # the cache holds only what the namespace still holds
    ids = sorted(marks.keys() | released)
    return [Checkpoint(i, tuple(marks.get(i, ())), i in released) for i in ids]


def _read_mark(store: Store, info: ObjectInfo, cache: MarkCache | None) -> Watermark | None:
    seen = (info.size, info.modified_s)
    if cache is not None and info.key in cache and cache[info.key][0] == seen:
        return cache[info.key][1]
    try:
        mark = Watermark.from_json(store.get(info.key), info.key)
    except ObjectNotFoundError:
        return None
    if cache is not None:
        cache[info.key] = (seen, mark)
    return mark


def global_watermark(checkpoints: Iterable[Checkpoint]) -> Checkpoint | None:
    """The live checkpoint with the smallest watermark: ``W_global``. None if there is none."""
    live = [c for c in checkpoints if c.live]
    return min(live, key=lambda c: c.position) if live else None
