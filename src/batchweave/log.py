"""The versioned log as values: versions, state and their encoding. Pure, no I/O.

Each log version is a *delta*: the TGBs it makes visible (with every slice's offset, so
readers never touch a footer) and the producer states it changes. Applying deltas in
order gives a ``LogState`` whose size depends on the number of producers, never on the
number of TGBs, so a full-state snapshot every K versions stays small and a commit
costs O(its TGBs + versions since the producer last looked), where the paper's manifest,
holding every TGB in every version, costs O(history): docs/from-the-paper.md.
Applying a version and building the next one: ``logrules``. Where each version and
snapshot is stored: ``keys``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Generic, NamedTuple, TypeVar

import msgspec

from batchweave import keys
from batchweave.decoding import decoding
from batchweave.errors import CorruptDataError
from batchweave.layout import Kind
from batchweave.schema import Schema

__all__ = [
    "LOG_FORMAT",
    "SNAPSHOT_FORMAT",
    "Hint",
    "Layout",
    "LogState",
    "LogVersion",
    "LogVersionHead",
    "ProducerState",
    "ReadVersion",
    "Reclaim",
    "TGBDescriptor",
    "TGBHead",
    "check_descriptors",
    "decode_hint",
    "decode_snapshot",
    "decode_version",
    "decode_version_head",
    "digest",
    "encode",
    "encode_hint",
]

LOG_FORMAT = "batchweave.log/1"
SNAPSHOT_FORMAT = "batchweave.snapshot/1"


# gc=False on the log's values: they hold numbers, strings and containers of those, and are
# never changed after decoding, so no reference cycle can run through them; untracked, the
# thousands of descriptors a producer makes and reads a second are not scanned by every
# collection (the collector took about 8% of a 100 KB producer's CPU, more of its packing).
class ProducerState(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True, omit_defaults=True):
    """What the log remembers of one producer_id.

    ``offset`` is the next source offset it must produce; ``epoch`` fences older
    incarnations; ``incarnation`` tells an ambiguous-but-applied claim from a rival's.
    ``metrics`` are the counters a producer chose to publish with its last commit.
    ``last_version`` is the version that last recorded it (its newest commit or claim);
    ``apply_version`` stamps it, so log versions never carry it, only snapshots.
    ``left`` says this incarnation closed (its last record, written by ``Producer.close``
    with ``max_lag``): it takes no share of ``max_lag`` any more (``lifecycle.backpressure``)
    until a claim of the same id records it again. False in logs written before producers
    recorded leaving.
    """

    offset: int
    epoch: int
    incarnation: str
    metrics: dict[str, float] | None = None
    last_version: int = 0
    left: bool = False


class Layout(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True, omit_defaults=True):
    """What every TGB of a namespace shares (invariant I9): ``dp * cp`` slices of one
    payload kind. ``kind`` is None until the first TGB is committed."""

    dp: int
    cp: int
    kind: Kind | None = None

    def describe(self) -> str:
        return f"dp={self.dp} cp={self.cp}" + (f" {self.kind}" if self.kind else "")


class _TGBFields(msgspec.Struct, frozen=True, gc=False):
    """Whose a TGB is and its layout: the first fields of ``TGBDescriptor`` and ``TGBHead``."""

    producer: str
    epoch: int
    source_offset: int
    dp: int
    cp: int
    kind: Kind


class TGBDescriptor(_TGBFields, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One TGB as the log records it. ``slices[i]`` = [object index, offset, length, crc32c].

    ``schema`` is the digest of the namespace's schema its arrays fit (``Schema.digest``);
    "" for bytes, and in logs written before schemas (whose TGBs nothing checks)."""

    objects: list[str]
    slices: list[tuple[int, int, int, int]]
    nbytes: int  # after objects and slices, where the log has always written it
    schema: str = ""


class TGBHead(_TGBFields, frozen=True):
    """What a writer needs of a committed TGB: whose it is and what it counts. Decoding
    only this (objects and slices are skipped, not built) makes following the log about
    7x cheaper for producers, which never read other producers' objects."""

    nbytes: int
    schema: str = ""


class Reclaim(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """What garbage collection has taken so far (cumulative): steps below ``steps`` and log
    versions below ``versions`` are gone, ``bytes`` of TGB objects with them."""

    steps: int
    versions: int
    bytes: int


_TGB = TypeVar("_TGB", TGBDescriptor, TGBHead)


class _VersionFields(
    msgspec.Struct, Generic[_TGB], frozen=True, gc=False, forbid_unknown_fields=True, omit_defaults=True
):
    """The fields of a log version, its TGBs read as ``_TGB``: ``LogVersion`` and ``LogVersionHead``."""

    format: str
    version: int
    first_step: int
    tgbs: list[_TGB]
    producers: dict[str, ProducerState]
    end_of_stream: bool = False
    committed_at: float = 0.0
    reclaim: Reclaim | None = None  # set by garbage collection before it deletes anything
    namespace: str = ""  # version 1 only: the namespace's id, fixed forever
    layout: Layout | None = None  # set once, by the first producer's claim
    # Set once, by the version that commits the namespace's first TGB of arrays (or, in a log
    # older than schemas, its first TGB of arrays that carries a schema digest). Beside the
    # layout, not in it: a layout is set by a claim, a schema by a commit, and every tool
    # prints the layout's three fields as they are.
    schema: Schema | None = None
    # Cumulative, so that a writer learns from the head alone what it needs to commit
    # (``logrules.jump_to``); None in versions written before they were: such a version
    # is read with every version before it, as always. ``bytes``: TGB bytes committed
    # through this version. ``changed_at``: the newest version, this one or before, that
    # changed what a commit's head alone cannot tell (``logrules.changes_more``: a claim,
    # a producer leaving, a reclaim, the end of stream, the namespace's id, layout, payload
    # kind or schema). ``apply_version`` checks both against the state they follow.
    bytes: int | None = None
    changed_at: int | None = None

    def steps(self) -> range:
        return range(self.first_step, self.first_step + len(self.tgbs))


class LogVersion(_VersionFields[TGBDescriptor], frozen=True):
    """One immutable log version: the delta it commits."""


class LogVersionHead(_VersionFields[TGBHead], frozen=True):
    """A log version as a writer reads it: every field, TGBs as ``TGBHead``."""


class ReadVersion(NamedTuple):
    """A log version as a reader read it: the delta, and its bytes exactly as stored (a
    reader's proof anchors on a version's bytes: see ``journal.Journal.prove_reads``)."""

    delta: LogVersion
    data: bytes | memoryview


class LogState(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """The namespace after ``version``: all a producer or inspector needs, O(producers)."""

    format: str = SNAPSHOT_FORMAT
    version: int = 0
    steps: int = 0
    producers: dict[str, ProducerState] = {}
    end_of_stream: bool = False
    bytes: int = 0  # TGB bytes ever committed
    reclaimed: Reclaim = Reclaim(0, 0, 0)
    namespace: str = ""  # the id version 1 recorded ("" for logs older than ids)
    layout: Layout | None = None
    digest: str = ""  # of version ``version``'s bytes: lets a writer anchor its view (see journal)
    ended_at: int = 0  # the version of the end-of-stream marker (0: not ended)
    schema: Schema | None = None  # the namespace's arrays (None for bytes, and until the first TGB)
    # The newest version through ``version`` that changed more than steps, bytes and its
    # committers' offsets (``LogVersion.changed_at``); None: unknown (a log or snapshot
    # older than the field, or a version of it read since), and then no writer jumps.
    changed_at: int | None = None
    # The newest version a writer's jump skipped (``logrules.jump_to``; 0: none). A
    # producer recorded below it may have committed since without this state knowing:
    # its offset may be behind, and the next TGB of it seen may skip ahead. Never in a
    # snapshot: a state that skipped versions is never written as one (``journal``).
    skipped_through: int = 0


# -- encoding --------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
_V = TypeVar("_V", "LogVersion", "LogVersionHead")


def encode(value: LogVersion | LogState) -> bytes:
    return _encoder.encode(value)


def digest(data: bytes | memoryview) -> str:
    """A fingerprint of one log version's bytes (two different versions never share it)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def decode_version(data: bytes | memoryview, key: str, expected_version: int) -> LogVersion:
    """Parse and validate one log version read from ``key``."""
    version = _decode(data, key, expected_version, _VERSION_DECODER)
    check_descriptors(version.tgbs, key)
    return version


def decode_version_head(data: bytes | memoryview, key: str, expected_version: int) -> LogVersionHead:
    """Parse one log version for a writer (``LogVersionHead``). The object keys and slice
    locations are not read; whoever reads data (consumers, collection) checks them."""
    return _decode(data, key, expected_version, _HEAD_DECODER)


def _decode(data: bytes | memoryview, key: str, expected_version: int, decoder: msgspec.json.Decoder[_V]) -> _V:
    with decoding(key, "damaged log version"):
        version = decoder.decode(data)
    if version.format != LOG_FORMAT:
        raise CorruptDataError(key, f"unsupported log format {version.format!r} (this reader knows {LOG_FORMAT})")
    if version.version != expected_version:
        raise CorruptDataError(key, f"log version says it is {version.version}, its name says {expected_version}")
    return version


class Hint(msgspec.Struct, frozen=True):
    """The snapshot hint: the newest snapshot's version, and the namespace's id that every
    snapshot repeats ("" in hints written before the id was added to them)."""

    version: int
    namespace: str = ""


# Built here, once, by the importing thread: msgspec 0.22 prepares a type's decoding
# information on its first use, and threads that first-decode the same type at once can
# crash the interpreter (a producer pool's claims do exactly that).
_VERSION_DECODER = msgspec.json.Decoder(LogVersion)
_HEAD_DECODER = msgspec.json.Decoder(LogVersionHead)
_HINT_DECODER = msgspec.json.Decoder(Hint)
_STATE_DECODER = msgspec.json.Decoder(LogState)


def encode_hint(state: LogState) -> bytes:
    """The hint naming ``state``'s snapshot."""
    return msgspec.json.encode(Hint(state.version, state.namespace))


def decode_hint(data: bytes | memoryview, key: str = keys.HINT_KEY) -> Hint:
    """The hint; CorruptDataError if it is not one."""
    with decoding(key, "damaged snapshot hint"):
        hint = _HINT_DECODER.decode(data)
    if hint.version < 0:
        raise CorruptDataError(key, f"snapshot hint names version {hint.version}")
    return hint


def decode_snapshot(data: bytes | memoryview, key: str) -> LogState:
    with decoding(key, "damaged snapshot"):
        state = _STATE_DECODER.decode(data)
    if state.format != SNAPSHOT_FORMAT:
        raise CorruptDataError(key, f"unsupported snapshot format {state.format!r}")
    return state


def check_descriptors(tgbs: Iterable[TGBDescriptor], key: str) -> None:
    """Every descriptor read from ``key`` is well formed (CorruptDataError naming it if not)."""
    for tgb in tgbs:
        _check_descriptor(tgb, key)


def _check_descriptor(tgb: TGBDescriptor, key: str) -> None:
    if tgb.dp < 1 or tgb.cp < 1 or len(tgb.slices) != tgb.dp * tgb.cp:
        raise CorruptDataError(
            key, f"TGB {tgb.producer}@{tgb.source_offset}: {len(tgb.slices)} slices for dp={tgb.dp} cp={tgb.cp}"
        )
    if not tgb.objects:
        raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset} names no objects")
    for object_key in tgb.objects:
        keys.check_data_key(object_key, key)
    for obj, offset, length, _crc in tgb.slices:
        if not 0 <= obj < len(tgb.objects) or offset < 0 or length < 0:
            raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset}: slice location out of range")
