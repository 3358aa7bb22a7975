"""The versioned log as values: versions, state, apply and rebase. Pure, no I/O.

Each log version is a *delta*: the TGBs it makes visible (with every slice's offset, so
readers never touch a footer) and the producer states it changes. Applying deltas in
order gives a ``LogState`` whose size depends on the number of producers, never on the
number of TGBs, so a full-state snapshot every K versions stays small and a commit
costs O(its TGBs + versions since the producer last looked). See DESIGN.md, cost model.
Where each version and snapshot is stored: ``keys``.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Sequence
from typing import Generic, NamedTuple, TypeVar

import msgspec

from batchweave import keys
from batchweave.errors import CorruptDataError, LayoutError, ProducerFencedError, StreamEndedError
from batchweave.layout import Kind

__all__ = [
    "LOG_FORMAT",
    "SNAPSHOT_FORMAT",
    "Layout",
    "LogState",
    "LogVersion",
    "LogVersionHead",
    "ProducerState",
    "ReadVersion",
    "Reclaim",
    "TGBDescriptor",
    "TGBHead",
    "apply_version",
    "build_claim",
    "build_commit",
    "build_end_of_stream",
    "build_reclaim",
    "check_continuity",
    "check_descriptors",
    "decode_hint",
    "decode_snapshot",
    "decode_version",
    "decode_version_head",
    "digest",
    "encode",
    "next_version",
    "pending_after_rebase",
]

LOG_FORMAT = "batchweave.log/1"
SNAPSHOT_FORMAT = "batchweave.snapshot/1"


class ProducerState(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What the log remembers of one producer_id.

    ``offset`` is the next source offset it must produce; ``epoch`` fences older
    incarnations; ``incarnation`` tells an ambiguous-but-applied claim from a rival's.
    ``metrics`` are the counters a producer chose to publish with its last commit.
    ``last_version`` is the version that last recorded it (its newest commit or claim);
    ``apply_version`` stamps it, so log versions never carry it, only snapshots.
    """

    offset: int
    epoch: int
    incarnation: str
    metrics: dict[str, float] | None = None
    last_version: int = 0


class Layout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What every TGB of a namespace shares (invariant I9): ``dp * cp`` slices of one
    payload kind. ``kind`` is None until the first TGB is committed."""

    dp: int
    cp: int
    kind: Kind | None = None

    def describe(self) -> str:
        return f"dp={self.dp} cp={self.cp}" + (f" {self.kind}" if self.kind else "")


class _TGBFields(msgspec.Struct, frozen=True):
    """Whose a TGB is and its layout: the first fields of ``TGBDescriptor`` and ``TGBHead``."""

    producer: str
    epoch: int
    source_offset: int
    dp: int
    cp: int
    kind: Kind


class TGBDescriptor(_TGBFields, frozen=True, forbid_unknown_fields=True):
    """One TGB as the log records it. ``slices[i]`` = [object index, offset, length, crc32c]."""

    objects: list[str]
    slices: list[tuple[int, int, int, int]]
    nbytes: int  # after objects and slices, where the log has always written it


class TGBHead(_TGBFields, frozen=True):
    """What a writer needs of a committed TGB: whose it is and what it counts. Decoding
    only this (objects and slices are skipped, not built) makes following the log about
    7x cheaper for producers, which never read other producers' objects."""

    nbytes: int


class Reclaim(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What garbage collection has taken so far (cumulative): steps below ``steps`` and log
    versions below ``versions`` are gone, ``bytes`` of TGB objects with them."""

    steps: int
    versions: int
    bytes: int


_TGB = TypeVar("_TGB", TGBDescriptor, TGBHead)


class _VersionFields(msgspec.Struct, Generic[_TGB], frozen=True, forbid_unknown_fields=True, omit_defaults=True):
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


class LogState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
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
    try:
        version = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptDataError(key, f"damaged log version: {exc}") from exc
    if version.format != LOG_FORMAT:
        raise CorruptDataError(key, f"unsupported log format {version.format!r} (this reader knows {LOG_FORMAT})")
    if version.version != expected_version:
        raise CorruptDataError(key, f"log version says it is {version.version}, its name says {expected_version}")
    return version


class _Hint(msgspec.Struct, frozen=True):
    version: int


# Built here, once, by the importing thread: msgspec 0.22 prepares a type's decoding
# information on its first use, and threads that first-decode the same type at once can
# crash the interpreter (a producer pool's claims do exactly that).
_VERSION_DECODER = msgspec.json.Decoder(LogVersion)
_HEAD_DECODER = msgspec.json.Decoder(LogVersionHead)
_HINT_DECODER = msgspec.json.Decoder(_Hint)
_STATE_DECODER = msgspec.json.Decoder(LogState)


def decode_hint(data: bytes | memoryview, key: str = keys.HINT_KEY) -> int:
    """The snapshot version the hint names; CorruptDataError if it is not a hint."""
    try:
        version = _HINT_DECODER.decode(data).version
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptDataError(key, f"damaged snapshot hint: {exc}") from exc
    if version < 0:
        raise CorruptDataError(key, f"snapshot hint names version {version}")
    return version


def decode_snapshot(data: bytes | memoryview, key: str) -> LogState:
    try:
        state = _STATE_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptDataError(key, f"damaged snapshot: {exc}") from exc
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


# -- applying --------------------------------------------------------------------------


def apply_version(state: LogState, delta: LogVersion | LogVersionHead, key: str, digest: str = "") -> LogState:
    """The state after ``delta`` (whose bytes have ``digest``); raises CorruptDataError if
    ``delta`` breaks the log's rules."""
    if delta.version != state.version + 1:
        raise CorruptDataError(key, f"version {delta.version} does not follow {state.version}")
    if delta.first_step != state.steps:
        raise CorruptDataError(key, f"first step {delta.first_step}, but {state.steps} steps are committed")
    if state.end_of_stream and delta.tgbs:
        raise CorruptDataError(key, "commits TGBs after the end-of-stream marker")
    if delta.namespace and state.version != 0:
        raise CorruptDataError(key, f"names namespace {delta.namespace!r}, but only version 1 may")
    layout = _next_layout(state.layout, delta, key)
    producers = dict(state.producers)
    for producer_id, new in delta.producers.items():
        old = producers.get(producer_id)
        if old is not None and (new.epoch < old.epoch or new.offset < old.offset):
            raise CorruptDataError(key, f"producer {producer_id!r} goes back from {old} to {new}")
    _check_offsets(state, delta, key)
    producers.update(
        {pid: msgspec.structs.replace(new, last_version=delta.version) for pid, new in delta.producers.items()}
    )
    reclaimed = state.reclaimed
    if delta.reclaim is not None:
        if delta.reclaim.steps > state.steps or any(
            new < old
            for new, old in zip(msgspec.structs.astuple(delta.reclaim), msgspec.structs.astuple(reclaimed), strict=True)
        ):
            raise CorruptDataError(key, f"reclaim {delta.reclaim} goes back from {reclaimed} or past the log")
        reclaimed = delta.reclaim
    return LogState(
        version=delta.version,
        steps=state.steps + len(delta.tgbs),
        producers=producers,
        end_of_stream=state.end_of_stream or delta.end_of_stream,
        bytes=state.bytes + sum(t.nbytes for t in delta.tgbs),
        reclaimed=reclaimed,
        namespace=delta.namespace or state.namespace,
        layout=layout,
        digest=digest,
        ended_at=state.ended_at or (delta.version if delta.end_of_stream else 0),
    )


def _next_layout(layout: Layout | None, delta: LogVersion | LogVersionHead, key: str) -> Layout | None:
    """I9: the layout is set once (by a claim, or by the first TGB of a log older than
    layouts); every TGB must fit it, and the first TGB fixes the payload kind."""
    if delta.layout is not None:
        if layout is not None and (layout.dp, layout.cp) != (delta.layout.dp, delta.layout.cp):
            raise CorruptDataError(key, f"sets layout {delta.layout.describe()}, the namespace has {layout.describe()}")
        layout = layout or Layout(delta.layout.dp, delta.layout.cp)
    for tgb in delta.tgbs:
        layout = layout or Layout(tgb.dp, tgb.cp)
        problem = layout_mismatch(layout, tgb)
        if problem:
            raise CorruptDataError(key, problem)
        if layout.kind is None:
            layout = Layout(layout.dp, layout.cp, tgb.kind)
    return layout


def layout_mismatch(layout: Layout | None, tgb: TGBDescriptor | TGBHead) -> str:
    """Why ``tgb`` does not fit ``layout`` ("" when it does)."""
    if layout is None or (
        (tgb.dp, tgb.cp) == (layout.dp, layout.cp) and (layout.kind is None or tgb.kind == layout.kind)
    ):
        return ""
    return (
        f"TGB {tgb.producer}@{tgb.source_offset} has layout dp={tgb.dp} cp={tgb.cp} {tgb.kind}, "
        f"the namespace has {layout.describe()}"
    )


def _check_offsets(state: LogState, delta: LogVersion | LogVersionHead, key: str) -> None:
    """Invariant I3 as the log sees it: offsets only move forward, under the right epoch."""
    next_offset = {pid: ps.offset for pid, ps in state.producers.items()}
    for tgb in delta.tgbs:
        owner = delta.producers.get(tgb.producer)
        if owner is None or owner.epoch != tgb.epoch:
            raise CorruptDataError(key, f"TGB of {tgb.producer!r} epoch {tgb.epoch} without that producer's state")
        expected = next_offset.get(tgb.producer, 0)
        if tgb.source_offset < expected:
            raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset} repeats an offset already committed")
        if tgb.source_offset > expected:
            raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset} skips offsets from {expected}")
        next_offset[tgb.producer] = tgb.source_offset + 1
    for pid in {t.producer for t in delta.tgbs}:
        if delta.producers[pid].offset != next_offset[pid]:
            raise CorruptDataError(
                key,
                f"producer {pid!r} records offset {delta.producers[pid].offset}, its TGBs end at {next_offset[pid]}",
            )


def check_continuity(seen: dict[str, tuple[int, int]], delta: LogVersion, key: str) -> None:
    """I3 as a reader that starts mid-log sees it: ``seen`` maps each producer met so far to
    (epoch, next offset); every later TGB of it must continue exactly there. Updated in place.

    A reader that did not replay the whole log cannot check a producer's first TGB, only
    every one after it: a store that let two racing commits both "win" shows up here.
    """
    for tgb in delta.tgbs:
        known = seen.get(tgb.producer)
        if known is not None and (tgb.epoch < known[0] or tgb.source_offset != known[1]):
            raise CorruptDataError(
                key,
                f"TGB {tgb.producer}@{tgb.source_offset} (epoch {tgb.epoch}) does not continue that producer's "
                f"offsets at {known[1]} (epoch {known[0]}): the log was forked; does the store honour "
                "conditional puts?",
            )
        seen[tgb.producer] = (tgb.epoch, tgb.source_offset + 1)


# -- building commits (pure) -----------------------------------------------------------


def next_version(
    state: LogState,
    committed_at: float,
    *,
    tgbs: Sequence[TGBDescriptor] = (),
    producers: dict[str, ProducerState] | None = None,
    end_of_stream: bool = False,
    reclaim: Reclaim | None = None,
    layout: Layout | None = None,
) -> LogVersion:
    """The version after ``state``, changing only what the arguments say."""
    return LogVersion(
        format=LOG_FORMAT,
        version=state.version + 1,
        first_step=state.steps,
        tgbs=list(tgbs),
        producers=producers or {},
        end_of_stream=end_of_stream,
        committed_at=committed_at,
        reclaim=reclaim,
        # Whoever writes version 1 creates the namespace and gives it its id (I9).
        namespace=uuid.uuid4().hex if state.version == 0 else "",
        layout=layout,
    )


def build_commit(
    state: LogState,
    producer_id: str,
    me: ProducerState,
    pending: Sequence[TGBDescriptor],
    committed_at: float,
    metrics: dict[str, float] | None = None,
) -> LogVersion:
    """The next version: ``pending`` TGBs appended at the end of the step sequence."""
    next_offset = pending[-1].source_offset + 1 if pending else me.offset
    mine = ProducerState(next_offset, me.epoch, me.incarnation, metrics)
    return next_version(state, committed_at, tgbs=pending, producers={producer_id: mine})


def build_claim(
    state: LogState, producer_id: str, incarnation: str, committed_at: float, layout: Layout | None = None
) -> LogVersion:
    """A version that gives ``producer_id`` a new epoch, fencing every older incarnation.

    ``layout`` (dp, cp) must be the namespace's; the first claim of a namespace sets it.
    """
    if layout is not None and state.layout is not None and (layout.dp, layout.cp) != (state.layout.dp, state.layout.cp):
        raise LayoutError(
            f"producer {producer_id!r} has layout {layout.describe()}, but the namespace was created with "
            f"{state.layout.describe()} (log version {state.version}); "
            "use the namespace's dp and cp, or a new namespace"
        )
    old = state.producers.get(producer_id)
    claimed = ProducerState(offset=old.offset if old else 0, epoch=old.epoch + 1 if old else 1, incarnation=incarnation)
    new_layout = Layout(layout.dp, layout.cp) if layout is not None and state.layout is None else None
    return next_version(state, committed_at, producers={producer_id: claimed}, layout=new_layout)


def build_end_of_stream(state: LogState, committed_at: float) -> LogVersion:
    return next_version(state, committed_at, end_of_stream=True)


def build_reclaim(state: LogState, reclaim: Reclaim, committed_at: float) -> LogVersion:
    """A version that records what garbage collection is about to delete."""
    return next_version(state, committed_at, reclaim=reclaim)


def pending_after_rebase(
    state: LogState, producer_id: str, me: ProducerState, pending: Iterable[TGBDescriptor]
) -> list[TGBDescriptor]:
    """Rebase onto ``state``: drop what the log already holds, refuse if fenced or ended.

    An ambiguous commit (a timeout after the store applied the write) shows up here as
    our own incarnation's offset already past some pending TGBs; those are dropped, so
    nothing is committed twice and nothing is lost.
    """
    recorded = state.producers.get(producer_id)
    if recorded is not None and recorded.incarnation != me.incarnation and recorded.epoch >= me.epoch:
        raise ProducerFencedError(
            f"producer {producer_id!r} epoch {me.epoch} was fenced by a newer incarnation "
            f"(epoch {recorded.epoch}) at log version {state.version}; this process must stop"
        )
    committed_up_to = recorded.offset if recorded is not None else 0
    remaining = [t for t in pending if t.source_offset >= committed_up_to]
    for tgb in remaining:
        problem = layout_mismatch(state.layout, tgb)
        if problem:
            raise LayoutError(f"producer {producer_id!r} cannot commit: {problem} (log version {state.version})")
    if remaining and state.end_of_stream:
        raise StreamEndedError(
            f"the stream was ended at or before log version {state.version}; "
            f"{len(remaining)} TGB(s) of producer {producer_id!r} from offset {remaining[0].source_offset} "
            "were not committed"
        )
    return remaining
