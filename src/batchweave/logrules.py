"""The log's rules as pure functions of values. No I/O.

``apply_version`` gives the state after a version and refuses a version that breaks the
log's rules (steps dense, offsets forward under the right epoch, one layout and one schema:
I2, I3, I9);
``check_continuity`` is what a reader that starts mid-log can still check. A writer
builds the next version from the state it read (``build_claim``, ``build_commit``,
``build_end_of_stream``, ``build_reclaim``) and, when another writer got there first,
rebases its pending TGBs onto the newer state (``pending_after_rebase``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence

import msgspec

from batchweave import schema as schemas
from batchweave.errors import CorruptDataError, LayoutError, ProducerFencedError, SchemaError, StreamEndedError
from batchweave.log import (
    LOG_FORMAT,
    Layout,
    LogState,
    LogVersion,
    LogVersionHead,
    ProducerState,
    Reclaim,
    TGBDescriptor,
    TGBHead,
)
from batchweave.schema import Schema

__all__ = [
    "apply_version",
    "build_claim",
    "build_commit",
    "build_end_of_stream",
    "build_leave",
    "build_reclaim",
    "changes_more",
    "check_continuity",
    "jump_to",
    "layout_mismatch",
    "next_epoch",
    "next_version",
    "pending_after_rebase",
    "schema_mismatch",
    "schema_to_set",
]


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
    schema = _next_schema(state.schema, layout, delta, key)
    producers = dict(state.producers)
    for producer_id, new in delta.producers.items():
        old = producers.get(producer_id)
        if old is not None and (new.epoch < old.epoch or new.offset < old.offset):
            raise CorruptDataError(key, f"producer {producer_id!r} goes back from {old} to {new}")
        if old is not None and new.epoch == old.epoch and new.incarnation != old.incarnation:
            # An epoch is one incarnation's (I3): giving it to another would let both commit.
            raise CorruptDataError(
                key, f"producer {producer_id!r} epoch {new.epoch} passes from {old.incarnation} to {new.incarnation}"
            )
    _check_offsets(state, delta, key)
    total_bytes = state.bytes + sum(t.nbytes for t in delta.tgbs)
    if delta.bytes is not None and delta.bytes != total_bytes:
        raise CorruptDataError(key, f"says {delta.bytes} bytes are committed, its TGBs make {total_bytes}")
    changed_at = _checked_changed_at(state, delta, key)
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
        steps=state.steps + delta.tgb_count(),
        producers=producers,
        end_of_stream=state.end_of_stream or delta.end_of_stream,
        bytes=total_bytes,
        reclaimed=reclaimed,
        namespace=delta.namespace or state.namespace,
        layout=layout,
        digest=digest,
        ended_at=state.ended_at or (delta.version if delta.end_of_stream else 0),
        schema=schema,
        changed_at=changed_at,
        skipped_through=state.skipped_through,
    )


def changes_more(state: LogState, delta: LogVersion | LogVersionHead) -> bool:
    """Whether ``delta`` changes more than steps, bytes and its committers' offsets and
    metrics: a claim (a new producer, epoch or incarnation), a producer leaving or coming
    back, a reclaim, the end of stream, the namespace's id, layout, payload kind or schema.

    What such a version changes a writer can only learn by reading it; what any other
    version changes, the head alone tells (``jump_to``). Judged on ``state``'s producers'
    epochs, incarnations and ``left``, which a jumped state knows exactly: they change
    only in versions like this one, and a writer never jumps over one.
    """
    if delta.version == 1 or delta.namespace or delta.layout is not None or delta.schema is not None:
        return True
    if delta.reclaim is not None or delta.end_of_stream:
        return True
    if delta.tgbs and (state.layout is None or state.layout.kind is None):
        return True  # the first TGB fixes the payload kind
    for producer_id, new in delta.producers.items():
        old = state.producers.get(producer_id)
        if old is None or (old.epoch, old.incarnation, old.left) != (new.epoch, new.incarnation, new.left):
            return True
    return False


def _next_changed_at(state: LogState, delta: LogVersion | LogVersionHead) -> int:
    """``changed_at`` of the version after ``state``: its own number when it changes more
    (or when ``state`` does not know: a writer that cannot vouch for the past says so)."""
    return delta.version if state.changed_at is None or changes_more(state, delta) else state.changed_at


def _checked_changed_at(state: LogState, delta: LogVersion | LogVersionHead, key: str) -> int | None:
    """The state's ``changed_at`` after ``delta``, refusing a ``delta`` whose own is wrong.
    A state that does not know its own (a reader that started from an old snapshot) takes
    the version's, which its writer knew: at most its own number, its own number if it
    changes more."""
    if delta.changed_at is None:
        return None  # a version older than the field: unknown from here on
    if state.changed_at is None:
        if delta.changed_at > delta.version or (changes_more(state, delta) and delta.changed_at != delta.version):
            raise CorruptDataError(key, f"says it was last changed at version {delta.changed_at}")
        return delta.changed_at
    expected = _next_changed_at(state, delta)
    if delta.changed_at != expected:
        raise CorruptDataError(key, f"says the log last changed at version {delta.changed_at}, it did at {expected}")
    return expected


def jump_to(
    state: LogState,
    head: LogVersion | LogVersionHead,
    digest: str,
    own: Sequence[LogVersion | LogVersionHead] = (),
) -> LogState | None:
    """The state at ``head`` from ``state`` alone, without the versions between; None when
    the head cannot tell it (then the writer reads them all, as ``apply_version`` does).

    It can when ``head`` says the log last changed at or below ``state.version``
    (``changed_at``): every version between only added steps and bytes and moved its
    committers' offsets. ``head`` itself carries the cumulative steps and bytes, and a
    commit's other needs are unchanged: the namespace's id, layout and schema, the end of
    stream, the reclaim, and every producer's epoch and incarnation, ours included (so a
    claim that fenced us is never jumped over: I3). What the state loses is other
    producers' offsets, metrics and ``last_version`` between the two; ``head``'s own
    committers are taken from it. Our own offset moves only by our own commits: ``own``
    are those between whose outcome we had not learned (ambiguous puts) and that landed,
    read by the caller, oldest first; their producer states are taken too.
    """
    if head.changed_at is None or state.changed_at is None or head.changed_at > state.version:
        return None
    if head.version <= state.version or head.first_step < state.steps or changes_more(state, head):
        return None  # (the last two only if the log is damaged: the full read says where)
    if head.bytes is None or head.bytes - sum(t.nbytes for t in head.tgbs) < state.bytes:
        return None
    producers = dict(state.producers)
    for version in [*own, head]:
        producers.update(
            {pid: msgspec.structs.replace(new, last_version=version.version) for pid, new in version.producers.items()}
        )
    return msgspec.structs.replace(
        state,
        version=head.version,
        steps=head.first_step + head.tgb_count(),
        producers=producers,
        bytes=head.bytes,
        digest=digest,
        changed_at=head.changed_at,
        skipped_through=max(state.skipped_through, head.version - 1 if head.version - 1 > state.version else 0),
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


def _next_schema(
    schema: Schema | None, layout: Layout | None, delta: LogVersion | LogVersionHead, key: str
) -> Schema | None:
    """One schema per namespace: set once, by a version whose TGBs are arrays and need it,
    and every TGB of arrays after it carries its digest (``schema_mismatch``)."""
    if delta.schema is not None:
        if schema is not None:
            raise CorruptDataError(key, f"sets a schema, but the namespace has one already ({schema.describe()})")
        problem = schemas.problem(delta.schema)
        if problem:
            raise CorruptDataError(key, f"sets a damaged schema: {problem}")
        if layout is not None and layout.kind == "bytes":
            raise CorruptDataError(key, "sets a schema of arrays, but the namespace holds bytes")
        schema = delta.schema
    for tgb in delta.tgbs:
        problem = schema_mismatch(schema, tgb)
        if problem:
            raise CorruptDataError(key, problem)
    return schema


def schema_mismatch(schema: Schema | None, tgb: TGBDescriptor | TGBHead) -> str:
    """Why ``tgb``'s schema digest does not fit the namespace's ``schema`` ("" when it does).

    A TGB of arrays carries the digest of the namespace's schema, and nothing else does.
    Without a schema, a TGB of arrays without a digest is one of a log older than schemas:
    not checked (its arrays were never described)."""
    expected = schema.digest if schema is not None and tgb.kind == "arrays" else ""
    if tgb.schema == expected:
        return ""
    where = f"TGB {tgb.producer}@{tgb.source_offset}"
    if not expected:
        return f"{where} ({tgb.kind}) names schema {tgb.schema!r}, but the namespace has no schema of arrays"
    described = schema.describe() if schema is not None else ""
    return f"{where} has schema {tgb.schema or 'none'!r}, the namespace's is {expected!r} ({described})"


def schema_to_set(state: LogState, schema: Schema | None, tgbs: Iterable[TGBDescriptor]) -> Schema | None:
    """The schema the next version must carry: the committer's own ``schema`` when the
    namespace has none yet and the version commits TGBs that name it; else None."""
    if state.schema is not None or schema is None:
        return None
    return schema if any(t.schema for t in tgbs) else None


def _check_offsets(state: LogState, delta: LogVersion | LogVersionHead, key: str) -> None:
    """Invariant I3 as the log sees it: offsets only move forward, under the right epoch.
    A head's row stands for ``count`` TGBs at consecutive offsets (``log.TGBHead``)."""
    next_offset: dict[str, int] = {}
    for tgb in delta.tgbs:
        owner = delta.producers.get(tgb.producer)
        if owner is None or owner.epoch != tgb.epoch:
            raise CorruptDataError(key, f"TGB of {tgb.producer!r} epoch {tgb.epoch} without that producer's state")
        expected = next_offset.get(tgb.producer)
        if expected is None:
            recorded = state.producers.get(tgb.producer)
            expected = 0 if recorded is None else recorded.offset
        if tgb.source_offset < expected:
            raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset} repeats an offset already committed")
        if tgb.source_offset > expected and not _may_be_behind(state, tgb.producer, expected):
            raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset} skips offsets from {expected}")
        next_offset[tgb.producer] = tgb.source_offset + tgb.count
    for pid, end in next_offset.items():
        if delta.producers[pid].offset != end:
            raise CorruptDataError(
                key, f"producer {pid!r} records offset {delta.producers[pid].offset}, its TGBs end at {end}"
            )


def _may_be_behind(state: LogState, producer_id: str, expected: int) -> bool:
    """Whether ``state``'s offset of ``producer_id`` may be behind the log's: a jump skipped
    versions that may have recorded it since (``LogState.skipped_through``). Its next TGB
    then continues where the log has it, unseen here; a repeat is still refused."""
    recorded = state.producers.get(producer_id)
    return recorded is not None and recorded.offset == expected and recorded.last_version < state.skipped_through


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
    schema: Schema | None = None,
) -> LogVersion:
    """The version after ``state``, changing only what the arguments say."""
    version = LogVersion(
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
        schema=schema,
    )
    return msgspec.structs.replace(
        version, bytes=state.bytes + sum(t.nbytes for t in tgbs), changed_at=_next_changed_at(state, version)
    )


def build_commit(
    state: LogState,
    producer_id: str,
    me: ProducerState,
    pending: Sequence[TGBDescriptor],
    committed_at: float,
    metrics: dict[str, float] | None = None,
    schema: Schema | None = None,
) -> LogVersion:
    """The next version: ``pending`` TGBs appended at the end of the step sequence. ``schema``
    is the committer's: the version carries it if it is the first to commit TGBs of arrays."""
    next_offset = pending[-1].source_offset + 1 if pending else me.offset
    mine = ProducerState(next_offset, me.epoch, me.incarnation, metrics)
    return next_version(
        state,
        committed_at,
        tgbs=pending,
        producers={producer_id: mine},
        schema=schema_to_set(state, schema, pending),
    )


def next_epoch(state: LogState, producer_id: str) -> int:
    """The epoch ``producer_id``'s next claim takes: one past the log's, 1 for a new id."""
    recorded = state.producers.get(producer_id)
    return recorded.epoch + 1 if recorded else 1


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
    claimed = ProducerState(
        offset=old.offset if old else 0, epoch=next_epoch(state, producer_id), incarnation=incarnation
    )
    new_layout = Layout(layout.dp, layout.cp) if layout is not None and state.layout is None else None
    return next_version(state, committed_at, producers={producer_id: claimed}, layout=new_layout)


def build_leave(state: LogState, producer_id: str, me: ProducerState, committed_at: float) -> LogVersion | None:
    """A version recording that incarnation ``me`` of ``producer_id`` closed, so the
    others stop counting it at once (``lifecycle.backpressure``): its state as the log
    has it, with ``left``. None when there is nothing to record: the log says so already
    (an earlier attempt landed), a newer incarnation claimed the id (it counts, not this
    one), or the stream ended (nobody appends any more)."""
    recorded = state.producers.get(producer_id)
    if recorded is None or recorded.incarnation != me.incarnation or recorded.left or state.end_of_stream:
        return None
    gone = ProducerState(recorded.offset, recorded.epoch, recorded.incarnation, recorded.metrics, left=True)
    return next_version(state, committed_at, producers={producer_id: gone})


def build_end_of_stream(state: LogState, committed_at: float) -> LogVersion:
    return next_version(state, committed_at, end_of_stream=True)


def build_reclaim(state: LogState, reclaim: Reclaim, committed_at: float) -> LogVersion:
    """A version that records what garbage collection is about to delete."""
    return next_version(state, committed_at, reclaim=reclaim)


def pending_after_rebase(
    state: LogState,
    producer_id: str,
    me: ProducerState,
    pending: Iterable[TGBDescriptor],
    schema: Schema | None = None,
    url: str = "",
) -> list[TGBDescriptor]:
    """Rebase onto ``state``: drop what the log already holds, refuse if fenced or ended, or
    if the namespace's schema is not the one our TGBs fit (``schema``, the producer's own;
    ``url`` names the namespace in the error).

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
        _refuse_schema(state, producer_id, tgb, schema, url)
    if remaining and state.end_of_stream:
        raise StreamEndedError(
            f"the stream was ended at or before log version {state.version}; "
            f"{len(remaining)} TGB(s) of producer {producer_id!r} from offset {remaining[0].source_offset} "
            "were not committed"
        )
    return remaining


def _refuse_schema(state: LogState, producer_id: str, tgb: TGBDescriptor, schema: Schema | None, url: str) -> None:
    """SchemaError if ``tgb`` (of ``schema``) cannot join the namespace: most likely another
    producer's first commit set another schema while ours waited to commit."""
    problem = schema_mismatch(state.schema or schema, tgb)
    if not problem:
        return
    namespace_has = state.schema.describe() if state.schema is not None else "no schema of arrays"
    problem = f"its schema (digest {tgb.schema!r}) is not the namespace's ({namespace_has})"
    if state.schema is not None and schema is not None:
        problem = schemas.difference(state.schema, schema) or problem
    raise SchemaError(
        f"{url or 'namespace'}: TGB {tgb.producer}@{tgb.source_offset}: {problem}; producer {producer_id!r} "
        f"cannot commit it (log version {state.version}: another producer's TGBs fixed the namespace's schema "
        "first) and stops. What was committed stays; write these arrays in the namespace's schema, or to a new "
        "namespace"
    )
