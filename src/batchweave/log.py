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
from collections.abc import Iterable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec

from batchweave import keys
from batchweave.decoding import decoding
from batchweave.errors import CorruptDataError
from batchweave.layout import Kind
from batchweave.schema import Schema

__all__ = [
    "LOG_FORMAT",
    "LOG_FORMAT_1",
    "LOG_FORMAT_2",
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
    "head_extent",
    "head_size",
    "runs",
]

# Formats 2 and 3 write a version as ``[<head length>,<head>,<body>]``: the head holds every
# field but the TGBs' object keys and slice tables, which the body holds, bound to the head
# by its digest (``LogVersionHead.body``). A writer decodes only the head, and a version's
# digest (the proof's anchor) is its head's: the part of a version every reader reads.
# Format 3 gives the head a row per *run* of TGBs (one producer's consecutive offsets: group
# commit's version holds one run per producer), where format 2 gave it a row per TGB, so
# what every producer decodes of a version grows with the producers in it, not with their
# TGBs; a TGB's own size moves to its body row. Formats 1 (one JSON object) and 2 are read
# as ever, and written for a version that says it is one.
LOG_FORMAT = "batchweave.log/3"
LOG_FORMAT_2 = "batchweave.log/2"
LOG_FORMAT_1 = "batchweave.log/1"
_FRAMED = (LOG_FORMAT, LOG_FORMAT_2)
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

    @property
    def count(self) -> int:
        """The TGBs this stands for (as ``TGBHead.count``): one."""
        return 1


class TGBHead(_TGBFields, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What a writer needs of committed TGBs: whose they are and what they count; a row of a
    version's head, so a writer reads and decodes no object key or slice. A row stands for
    ``count`` TGBs of one producer and epoch, at ``source_offset`` and the offsets after it,
    in consecutive steps, of ``nbytes`` in all (format 3; one TGB a row in formats 1 and 2)."""

    nbytes: int
    schema: str = ""
    count: int = 1


class _TGBHead1(_TGBFields, frozen=True):
    """``TGBHead`` as a version of format 1 holds it: a field of its descriptor, whose
    object keys and slices are skipped, not built."""

    nbytes: int
    schema: str = ""


class _TGBBody(msgspec.Struct, frozen=True, gc=False, array_like=True, forbid_unknown_fields=True):
    """The rest of a TGB's descriptor, in a version's body: where its slices are, and (format
    3, whose head row may stand for many TGBs) its own size; -1 when decoded from format 2,
    which has none."""

    objects: list[str]
    slices: list[tuple[int, int, int, int]]
    nbytes: int = -1


class Reclaim(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """What garbage collection has taken so far (cumulative): steps below ``steps`` and log
    versions below ``versions`` are gone, ``bytes`` of TGB objects with them."""

    steps: int
    versions: int
    bytes: int


_TGB = TypeVar("_TGB", TGBDescriptor, TGBHead, _TGBHead1)


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
        return range(self.first_step, self.first_step + self.tgb_count())

    def tgb_count(self) -> int:
        """How many TGBs (steps) the version commits."""
        return len(self.tgbs)


class LogVersion(_VersionFields[TGBDescriptor], frozen=True):
    """One immutable log version: the delta it commits."""


class LogVersionHead(_VersionFields[TGBHead], frozen=True):
    """A log version as a writer reads it: every field, its TGBs as ``TGBHead`` rows (a run of
    TGBs each in format 3). ``body``: the digest of the version's body ("" in format 1,
    which has none)."""

    body: str = ""

    def tgb_count(self) -> int:
        return sum(row.count for row in self.tgbs)


class _VersionHead1(_VersionFields[_TGBHead1], frozen=True):
    """``LogVersionHead`` as a version of format 1 is decoded."""


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
_V = TypeVar("_V", "LogVersion", "LogVersionHead", "_VersionHead1")


def encode(value: LogVersion | LogState) -> bytes:
    if isinstance(value, LogVersion) and value.format != LOG_FORMAT_1:
        return _encode_version(value)
    return _encoder.encode(value)


def _encode_version(version: LogVersion) -> bytes:
    """``version`` in format 3 (2 if it says so): ``[<head length>,<head>,<body>]``."""
    if version.format == LOG_FORMAT_2:
        body = _encoder.encode([(t.objects, t.slices) for t in version.tgbs])
        rows = [_row(t) for t in version.tgbs]
    else:
        body = _encoder.encode([_TGBBody(t.objects, t.slices, t.nbytes) for t in version.tgbs])
        rows = runs(version.tgbs)
    fields = _fields(version, LogVersion, ("format", "tgbs"))
    form = LOG_FORMAT_2 if version.format == LOG_FORMAT_2 else LOG_FORMAT
    head = LogVersionHead(**fields, format=form, tgbs=rows, body=_hash(body))
    encoded = _encoder.encode(head if form == LOG_FORMAT else _format_2_head(head))
    return b"".join((b"[", str(len(encoded)).encode(), b",", encoded, b",", body, b"]"))


def _format_2_head(head: LogVersionHead) -> dict[str, Any]:
    """``head`` as format 2 writes it: its rows without the count of TGBs format 3 added."""
    fields = msgspec.to_builtins(head)
    fields["tgbs"] = [row[:-1] for row in fields["tgbs"]]
    return fields


def _row(tgb: TGBDescriptor | _TGBHead1) -> TGBHead:
    """One TGB as a head row of its own."""
    return TGBHead(tgb.producer, tgb.epoch, tgb.source_offset, tgb.dp, tgb.cp, tgb.kind, tgb.nbytes, tgb.schema)


def runs(tgbs: Sequence[TGBDescriptor]) -> list[TGBHead]:
    """``tgbs`` as head rows of format 3: consecutive TGBs of one producer, epoch, layout and
    schema, at consecutive offsets, share one row."""
    rows: list[TGBHead] = []
    start = 0
    for end in range(1, len(tgbs) + 1):
        if end < len(tgbs) and _continues(tgbs[end - 1], tgbs[end]):
            continue
        first = tgbs[start]
        nbytes = sum(t.nbytes for t in tgbs[start:end])
        rows.append(
            TGBHead(
                first.producer,
                first.epoch,
                first.source_offset,
                first.dp,
                first.cp,
                first.kind,
                nbytes,
                first.schema,
                end - start,
            )
        )
        start = end
    return rows


def _continues(before: TGBDescriptor, tgb: TGBDescriptor) -> bool:
    return tgb.source_offset == before.source_offset + 1 and (
        tgb.producer,
        tgb.epoch,
        tgb.dp,
        tgb.cp,
        tgb.kind,
        tgb.schema,
    ) == (before.producer, before.epoch, before.dp, before.cp, before.kind, before.schema)


def _hash(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def digest(data: bytes | memoryview) -> str:
    """A fingerprint of one log version's bytes (two different versions never share it):
    of its head in formats 2 and 3, which binds its body by the body's digest; of all of it in
    format 1. Never raises: bytes that are no version have a fingerprint too."""
    span = _head_span(data)
    return _hash(data if span is None else memoryview(data)[span[0] : span[1]])


def head_size(data: bytes | memoryview) -> int:
    """The bytes of a version a writer decodes: its head's (formats 2 and 3), or all of it."""
    span = _head_span(data)
    return len(data) if span is None else span[1] - span[0]


# A head's length in decimal, bounded so that a damaged prefix is never read far.
_MAX_LENGTH_DIGITS = 12


def _head_span(data: bytes | memoryview) -> tuple[int, int] | None:
    """Where the head of a version of format 2 or 3 lies in its bytes, ``[<length>,<head>,<body>]``,
    or in their first ``head_extent`` bytes, ``[<length>,<head>,`` (what a writer reads:
    ``LogObjects.get_head``); None when they are not laid out so (a version of format 1, or
    damage). A whole version always ends in its body's ``]``, so the two never mix up."""
    data = memoryview(data)
    extent = head_extent(data)
    if extent is None or extent > len(data) or data[extent - 1] != _COMMA:
        return None
    if len(data) != extent and (extent + 1 > len(data) or data[len(data) - 1] != _CLOSE):
        return None
    start = bytes(data[: _MAX_LENGTH_DIGITS + 2]).find(b",") + 1
    return start, extent - 1


def head_extent(prefix: bytes | memoryview) -> int | None:
    """How many bytes from its start hold a version's head (formats 2 and 3) and the comma
    after it, read from its first ``_MAX_LENGTH_DIGITS + 2`` or more bytes; None when they
    do not begin as a version of format 2 or 3 does (format 1, or damage)."""
    lead = bytes(memoryview(prefix)[: _MAX_LENGTH_DIGITS + 2])
    comma = lead.find(b",")
    if not lead.startswith(b"[") or comma < 2 or not lead[1:comma].isdigit():
        return None
    return comma + 1 + int(lead[1:comma]) + 1


_COMMA, _CLOSE = ord(","), ord("]")


def decode_version(data: bytes | memoryview, key: str, expected_version: int | None) -> LogVersion:
    """Parse and validate one log version read from ``key`` (of any number when
    ``expected_version`` is None: the caller checks it)."""
    span = _head_span(data)
    if span is None:
        version = _decode(data, key, expected_version, _VERSION_DECODER, (LOG_FORMAT_1,))
    else:
        version = _joined(data, span, key, expected_version)
    check_descriptors(version.tgbs, key)
    return version


def _joined(data: bytes | memoryview, span: tuple[int, int], key: str, expected_version: int | None) -> LogVersion:
    """A version of format 2 or 3 whole: its head, and the body its head names."""
    view = memoryview(data)
    head = _head(view[span[0] : span[1]], key, expected_version)
    body = view[span[1] + 1 : len(view) - 1]
    if _hash(body) != head.body:
        raise CorruptDataError(key, "damaged log version: its body is not the one its head names")
    with decoding(key, "damaged log version body"):
        rows = _BODY_DECODER.decode(body)
    if len(rows) != head.tgb_count():
        counts = f"{head.tgb_count()} TGBs in its head, {len(rows)} in its body"
        raise CorruptDataError(key, f"damaged log version: {counts}")
    sized = head.format == LOG_FORMAT
    tgbs: list[TGBDescriptor] = []
    for run in head.tgbs:
        mine = rows[len(tgbs) : len(tgbs) + run.count]
        _check_sizes(run, mine, sized, key)
        tgbs.extend(
            TGBDescriptor(
                run.producer,
                run.epoch,
                run.source_offset + i,
                run.dp,
                run.cp,
                run.kind,
                b.objects,
                b.slices,
                b.nbytes if sized else run.nbytes,
                run.schema,
            )
            for i, b in enumerate(mine)
        )
    return LogVersion(**_fields(head, LogVersion, ("tgbs",)), tgbs=tgbs)


def _check_sizes(run: TGBHead, rows: list[_TGBBody], sized: bool, key: str) -> None:
    """A run's TGBs' own sizes (format 3) make its row's; a body row of format 2 has none."""
    where = f"TGBs {run.producer}@{run.source_offset}..{run.source_offset + run.count - 1}"
    if not sized:
        if any(b.nbytes != -1 for b in rows):
            raise CorruptDataError(key, f"damaged log version: {where} have sizes in a body of format 2")
        return
    if any(b.nbytes < 0 for b in rows) or sum(b.nbytes for b in rows) != run.nbytes:
        raise CorruptDataError(
            key,
            f"damaged log version: {where} make {run.nbytes} bytes in its head, not in its body",
        )


def decode_version_head(data: bytes | memoryview, key: str, expected_version: int) -> LogVersionHead:
    """Parse one log version for a writer (``LogVersionHead``). The object keys and slice
    locations are not read (formats 2 and 3: not even parsed); whoever reads data (consumers,
    collection) checks them."""
    span = _head_span(data)
    if span is not None:
        head = _head(memoryview(data)[span[0] : span[1]], key, expected_version)
        if not head.body:
            raise CorruptDataError(key, "damaged log version: its head names no body")
        return head
    old = _decode(data, key, expected_version, _HEAD1_DECODER, (LOG_FORMAT_1,))
    rows = [_row(t) for t in old.tgbs]
    return LogVersionHead(**_fields(old, _VersionHead1, ("tgbs",)), tgbs=rows)


def _head(data: memoryview, key: str, expected_version: int | None) -> LogVersionHead:
    """The head of a version of format 2 or 3, its rows checked: each stands for at least one
    TGB, and for exactly one in format 2."""
    head = _decode(data, key, expected_version, _HEAD_DECODER, _FRAMED)
    most = None if head.format == LOG_FORMAT else 1
    for row in head.tgbs:
        if row.count < 1 or (most is not None and row.count > most):
            raise CorruptDataError(
                key, f"damaged log version: a row of {row.count} TGBs ({row.producer}@{row.source_offset})"
            )
    return head


def _fields(value: msgspec.Struct, kind: type[msgspec.Struct], but: tuple[str, ...]) -> dict[str, Any]:
    """``value``'s fields that ``kind`` has, but those named in ``but``: to build one form
    of a version from another."""
    return {name: getattr(value, name) for name in kind.__struct_fields__ if name not in but}


def _decode(
    data: bytes | memoryview,
    key: str,
    expected_version: int | None,
    decoder: msgspec.json.Decoder[_V],
    forms: tuple[str, ...],
) -> _V:
    with decoding(key, "damaged log version"):
        version = decoder.decode(data)
    if version.format not in forms:
        known = f"{LOG_FORMAT}, {LOG_FORMAT_2} and {LOG_FORMAT_1}"
        raise CorruptDataError(key, f"unsupported log format {version.format!r} (this reader knows {known})")
    if expected_version is not None and version.version != expected_version:
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
_HEAD1_DECODER = msgspec.json.Decoder(_VersionHead1)
_BODY_DECODER = msgspec.json.Decoder(list[_TGBBody])
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
    """Every descriptor read from ``key`` is well formed (CorruptDataError naming it if not).
    The TGBs of a pack name the same objects: each key is checked once."""
    checked: set[str] = set()
    for tgb in tgbs:
        _check_descriptor(tgb, key, checked)


def _check_descriptor(tgb: TGBDescriptor, key: str, checked: set[str]) -> None:
    if tgb.dp < 1 or tgb.cp < 1 or len(tgb.slices) != tgb.dp * tgb.cp:
        raise CorruptDataError(
            key, f"TGB {tgb.producer}@{tgb.source_offset}: {len(tgb.slices)} slices for dp={tgb.dp} cp={tgb.cp}"
        )
    if not tgb.objects:
        raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset} names no objects")
    for object_key in tgb.objects:
        if object_key not in checked:
            checked.add(keys.check_data_key(object_key, key))
    # (A loop over the rows: 3 us for 32 slices, where their columns by zip and min took 5.)
    count = len(tgb.objects)
    for obj, offset, length, _crc in tgb.slices:
        if not 0 <= obj < count or offset < 0 or length < 0:
            raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset}: slice location out of range")
