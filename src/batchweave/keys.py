"""Every object key prefix of a namespace, who writes under each, and the checks of
names and keys. Pure. A new kind of object gets its prefix here, with its writers in
``WRITERS`` (the IAM policies of ``permissions`` are derived from it).

Keys, relative to the namespace root:
    _log/00000000000000000007.json          version 7 (create-only; the commit point)
    _log/_snapshots/00000000000000000100.json   LogState after version 100
    _log/_segments/...                      a backlog of versions in one object (``segment``)
    _log/_last_snapshot.json                advisory hint: newest snapshot version, namespace id
    data/<producer>/e<epoch>/<offset>-<token>.<part>.bwb    TGB objects
    _head/03/0007.json                      copy 3 of the newest versions' ring, slot 7
                                            (``journal.headcopies``: version 7, 71, ...)
    _intents/<producer>/e<epoch>/<offset>.json   group commit's published TGBs (``intent``)
    _claims/...                             epoch-claim tickets (``commit.claims``)
    _pools/<pool>/...                       a producer pool's shard lists (``shardlist``)
    _checkpoints/<checkpoint>/...           training checkpoints' watermarks (``lifecycle.watermarks``)
    _gc/...                                 garbage collection's run summaries (``lifecycle.gcsummary``)
    _probe/...                              the create-only probe of a store (``store``)
The hint is never trusted: readers probe forward from it, so a stale or missing hint
only costs extra reads. The head copies' slots are overwritten as the log grows; a
copy counts only for the version number it holds, and is proven like the version.

Namespaces never overlap (invariant I13): no namespace lies inside another's prefix, and
no actor deletes a key it cannot prove is its own. ``LAYOUT`` is every key a namespace's
writers create, matched in full; a key under one of our prefixes that matches none of
it (``is_own_key``) is another namespace's or a stranger's, and is left alone. Every key
of another namespace below ours starts, after that namespace's root, with one of the
prefixes above, whose first segment (``data`` or ``_...``) is never a name of ours
(``check_name``): so no key of another namespace can match our layout, whatever the
nesting. ``nested_namespace`` tells a key of another namespace's log from the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from batchweave.errors import ConfigError, CorruptDataError

__all__ = [
    "CHECKPOINT_PREFIX",
    "CLAIM_PREFIX",
    "DATA_PREFIX",
    "GC_PREFIX",
    "HEAD_COPIES",
    "HEAD_PREFIX",
    "HEAD_RING",
    "HINT_KEY",
    "INTENT_PREFIX",
    "LAYOUT",
    "LOG_PREFIX",
    "POOL_PREFIX",
    "PROBE_PREFIX",
    "SEGMENT_PREFIX",
    "SNAPSHOT_PREFIX",
    "WRITERS",
    "DataKey",
    "check_data_key",
    "check_name",
    "check_producer_id",
    "data_key",
    "head_copy_key",
    "is_namespace_marker",
    "is_own_key",
    "layout_kind",
    "nested_namespace",
    "numbered_key",
    "parse_data_key",
    "snapshot_key",
    "version_key",
]

LOG_PREFIX = "_log/"
SNAPSHOT_PREFIX = "_log/_snapshots/"
SEGMENT_PREFIX = "_log/_segments/"
HINT_KEY = "_log/_last_snapshot.json"
DATA_PREFIX = "data/"
HEAD_PREFIX = "_head/"
INTENT_PREFIX = "_intents/"
CLAIM_PREFIX = "_claims/"
POOL_PREFIX = "_pools/"
CHECKPOINT_PREFIX = "_checkpoints/"
PROBE_PREFIX = "_probe/"
GC_PREFIX = "_gc/"
# Who creates objects under each top-level prefix: the writing roles of ``permissions``
# (an object store grants puts by prefix). Every prefix above is one of these or under one.
WRITERS: dict[str, tuple[str, ...]] = {
    DATA_PREFIX: ("producer",),
    LOG_PREFIX: ("producer", "collector"),  # versions, snapshots, segments, the hint
    HEAD_PREFIX: ("producer", "collector"),  # copies of each version a commit writes
    INTENT_PREFIX: ("producer",),
    CLAIM_PREFIX: ("producer",),
    POOL_PREFIX: ("producer",),  # written by run_pool's driver, beside its producers
    CHECKPOINT_PREFIX: ("trainer", "collector"),  # marks; the collector's releases of dead ones
    PROBE_PREFIX: ("producer", "collector"),  # every writer of create-only puts probes the store once
    GC_PREFIX: ("collector",),
}
# Slots of each copy's ring: the newest 64 versions (seconds of commits) have copies;
# readers use them only at the head, and the ring bounds what they cost to keep.
HEAD_RING = 64
# Copies of each version near the head on an object store (``journal.headcopies``):
# writers and readers agree on it; ``BATCHWEAVE_HEAD_COPIES`` overrides it for both.
HEAD_COPIES = 10
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"  # a producer, checkpoint or pool id (check_name)
_PRODUCER_ID = re.compile(_NAME)
_DATA_KEY = re.compile(r"^data/[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)+$")
_EPOCH = r"e(?P<epoch>[0-9]{6,})"  # e{epoch:06d}
_NUMBER = r"(?P<number>[0-9]{20})"  # {version:020d}

# Every key a namespace's writers create, by kind, relative to its root: the names above,
# ASCII digits only, matched in full. What a collection may delete is one of these (I13).
LAYOUT: dict[str, re.Pattern[str]] = {
    kind: re.compile(pattern, re.ASCII)
    for kind, pattern in {
        "version": rf"_log/{_NUMBER}\.json",
        "snapshot": rf"_log/_snapshots/{_NUMBER}\.json",
        "segment": rf"_log/_segments/{_NUMBER}\.json\.z",  # named by its last version
        "hint": r"_log/_last_snapshot\.json",
        "head copy": r"_head/[0-9]{2}/[0-9]{4}\.json",
        "tgb": rf"data/(?P<producer>{_NAME})/{_EPOCH}/(?P<offset>[0-9]{{12,}})-[0-9a-f]+\.[0-9]+\.bwb",
        "intent": rf"_intents/(?P<producer>{_NAME})/{_EPOCH}/(?P<offset>[0-9]{{12,}})\.json",
        "claim": rf"_claims/(?P<producer>{_NAME})/{_EPOCH}/(?P<dp>[0-9]+)x(?P<cp>[0-9]+)-(?P<incarnation>[0-9a-f]+)",
        "pool record": rf"_pools/{_NAME}/{_NUMBER}\.json",
        "watermark": rf"_checkpoints/(?P<checkpoint>{_NAME})/(?P<d>[0-9]+)-(?P<c>[0-9]+)\.json",
        "release": rf"_checkpoints/(?P<checkpoint>{_NAME})/_released",
        "probe": r"_probe/[0-9a-f]{32}",
        "gc summary": rf"_gc/{_NUMBER}\.json",
    }.items()
}
# The keys that say a namespace is there (``is_namespace_marker``): what a namespace's log
# always holds from version 1 on (collection keeps the newest snapshot), and the hint.
_MARKERS = ("version", "snapshot", "hint")
# One of those at the root of another namespace below ours: group "root" is that root.
_NESTED_MARKER = re.compile(
    r"(?P<root>.+/)_log/(?:[0-9]{20}\.json|_snapshots/[0-9]{20}\.json|_last_snapshot\.json)", re.ASCII
)


def version_key(version: int) -> str:
    return f"{LOG_PREFIX}{version:020d}.json"


def head_copy_key(version: int, copy: int) -> str:
    """Where copy ``copy`` of version ``version`` is kept while it is near the head."""
    return f"{HEAD_PREFIX}{copy:02d}/{version % HEAD_RING:04d}.json"


def snapshot_key(version: int) -> str:
    return f"{SNAPSHOT_PREFIX}{version:020d}.json"


def check_name(value: str, what: str) -> str:
    """A producer or checkpoint id: safe as one segment of an object key."""
    if not isinstance(value, str) or not _PRODUCER_ID.fullmatch(value):
        raise ConfigError(
            f"{what} {value!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def check_producer_id(producer_id: str) -> str:
    return check_name(producer_id, "producer_id")


def check_data_key(key: str, where: str) -> str:
    """Reject any object key that could leave the namespace's data area."""
    if not isinstance(key, str) or not _DATA_KEY.fullmatch(key) or ".." in key.split("/"):
        raise CorruptDataError(where, f"object key {key!r} is not under the namespace's data/ prefix")
    return key


@dataclass(frozen=True, slots=True)
class DataKey:
    """What a TGB object's key says: the incarnation (producer, epoch) that appended it
    and the source offset of its TGB."""

    producer: str
    epoch: int
    offset: int


def data_key(producer_id: str, epoch: int, offset: int, token: str, part: int) -> str:
    """The key of part ``part`` of the TGB at ``offset``; ``token`` (hex) tells retried appends apart."""
    return f"{DATA_PREFIX}{producer_id}/e{epoch:06d}/{offset:012d}-{token}.{part}.bwb"


def parse_data_key(key: str) -> DataKey | None:
    """The inverse of ``data_key``: None for a key that is not a TGB object's."""
    match = LAYOUT["tgb"].fullmatch(key)
    if match is None:
        return None
    return DataKey(match["producer"], int(match["epoch"]), int(match["offset"]))


def layout_kind(key: str) -> str | None:
    """Which kind of object of this namespace's ``LAYOUT`` ``key`` is; None for a key no
    writer of this namespace creates (another namespace's inside it, or a stranger's)."""
    for kind, pattern in LAYOUT.items():
        if pattern.fullmatch(key):
            return kind
    return None


def is_own_key(key: str) -> bool:
    """Whether ``key`` is of this namespace's layout: the only keys a collection deletes (I13)."""
    return layout_kind(key) is not None


def numbered_key(key: str, kind: str) -> int | None:
    """The number a key of ``kind`` (``version``, ``snapshot``, ``segment``, ``gc summary``)
    carries; None for a key that is not of that kind."""
    match = LAYOUT[kind].fullmatch(key)
    return None if match is None else int(match["number"])


def is_namespace_marker(key: str) -> bool:
    """Whether ``key`` says a namespace is rooted here: a log version, a snapshot or the
    hint (what ``journal.overlap`` looks for above a namespace being created)."""
    return layout_kind(key) in _MARKERS


def nested_namespace(key: str) -> str | None:
    """The root (relative to ours, ending in "/") of the other namespace whose log version,
    snapshot or hint ``key`` is, below ours; None for any other key. Our own layout has no
    such key: no name of ours is ``_log``."""
    match = _NESTED_MARKER.fullmatch(key)
    return None if match is None else match["root"]
