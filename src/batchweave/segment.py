"""Log segments: a compressed copy of ``SEGMENT_VERSIONS`` consecutive log versions in
one object, so a reader behind the head learns where 32 steps live from one request
instead of 32. Pure, no I/O.

A segment is derived data: its versions are byte-for-byte the versions the log already
holds, copied by the committer of the segment's last version from what it read while
committing (``Journal``). Segments are best effort on both sides: a missing or damaged
segment costs a reader the per-version reads it would have made anyway, never a step.

Keys, relative to the namespace root (named by the last version they hold):
    _log/_segments/00000000000000000032.json.z   versions 1..32
    _log/_segments/00000000000000000064.json.z   versions 33..64
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import msgspec

from batchweave.decoding import decoding
from batchweave.errors import CorruptDataError
from batchweave.keys import SEGMENT_PREFIX
from batchweave.log import ReadVersion, decode_version

__all__ = [
    "SEGMENT_FORMAT",
    "SEGMENT_MAX_BYTES",
    "SEGMENT_PREFIX",
    "SEGMENT_VERSIONS",
    "decode_segment",
    "encode_segment",
    "segment_key",
    "segment_last",
]

SEGMENT_FORMAT = "batchweave.segment/1"
# 32 versions: a reader behind the head makes 1 + 1/32 requests per step with one TGB per
# version, and a writer copies 32 versions' bytes once per 32 commits.
SEGMENT_VERSIONS = 32
# Versions this large already hold many TGBs each (a segment would save little) and
# would cost writers memory to keep: such a run of versions gets no segment.
SEGMENT_MAX_BYTES = 16 << 20
# zlib level 6: slice tables (offsets, lengths, CRCs as decimal text) shrink about 4x,
# which is what keeps a 128-rank reader's log bytes near 1% of its 100 KB slices.
_LEVEL = 6


class _RawSegment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    first: int
    last: int
    versions: list[msgspec.Raw]


_MAX_INFLATED = SEGMENT_MAX_BYTES + (1 << 20)  # the versions plus the segment's own fields
_DECODER = msgspec.json.Decoder(_RawSegment)  # built at import (see log._VERSION_DECODER)
_ENCODER = msgspec.json.Encoder()


def segment_last(version: int) -> int:
    """The last version of the segment that holds ``version``."""
    return -(-version // SEGMENT_VERSIONS) * SEGMENT_VERSIONS


def segment_key(last: int) -> str:
    return f"{SEGMENT_PREFIX}{last:020d}.json.z"


def encode_segment(last: int, versions: Sequence[bytes | memoryview]) -> bytes:
    """The segment ending at ``last`` from its versions' bytes exactly as the log holds them."""
    if last % SEGMENT_VERSIONS or len(versions) != SEGMENT_VERSIONS:
        raise ValueError(f"a segment is versions {last - SEGMENT_VERSIONS + 1}..{last}, got {len(versions)} versions")
    first = last - SEGMENT_VERSIONS + 1
    raw = _RawSegment(SEGMENT_FORMAT, first, last, [msgspec.Raw(v) for v in versions])
    return zlib.compress(_ENCODER.encode(raw), _LEVEL)


def decode_segment(data: bytes | memoryview, last: int) -> list[ReadVersion]:
    """The versions of the segment ending at ``last``, each with its bytes exactly as the
    log holds them (a reader anchors its proof on them); CorruptDataError naming the
    segment's key if it is not exactly those versions, well formed."""
    key = segment_key(last)
    with decoding(key, "damaged log segment", also=(zlib.error,)):
        segment = _DECODER.decode(_inflate(data, key))
        if segment.format != SEGMENT_FORMAT:
            raise CorruptDataError(key, f"unsupported segment format {segment.format!r} (reader: {SEGMENT_FORMAT})")
    # Each version's bytes as a view into the inflated segment: no copy per version. Each is
    # checked as a version read alone is, its number below.
    versions = [ReadVersion(decode_version(view, key, None), view) for view in map(memoryview, segment.versions)]
    first = last - SEGMENT_VERSIONS + 1
    numbers = [v.delta.version for v in versions]
    if (segment.first, segment.last) != (first, last) or numbers != list(range(first, last + 1)):
        raise CorruptDataError(key, f"holds versions {numbers[:1]}..{numbers[-1:]}, its name says {first}..{last}")
    return versions


def _inflate(data: bytes | memoryview, key: str) -> bytes:
    """``data`` decompressed, refusing more than a segment may hold (a damaged or hostile
    object must not decompress into gigabytes)."""
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, _MAX_INFLATED)
    if inflater.unconsumed_tail:
        raise CorruptDataError(key, f"damaged log segment: it inflates beyond {_MAX_INFLATED} bytes")
    if not inflater.eof:
        raise CorruptDataError(key, "damaged log segment: its compressed stream is cut short")
    return out
