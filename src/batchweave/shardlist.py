"""A producer pool's shard list as a fingerprint: encoding, prefix digests, record, verdict. Pure, no I/O.

Producer ``i`` of a pool owns list positions ``i, i + N, ...`` and the log records how
many of them it committed, not which shards they were. A pool restarted over another
list would therefore repeat some shards and skip others without noticing. So a pool
records a fingerprint of its list the first time it starts, and every restart compares:

- the same list: resume;
- the recorded list with shards appended at the end: allowed (every existing position
  keeps its shard and its owner), and the longer list is recorded, so that a later run
  cannot append *other* shards over positions already produced;
- anything else (a shard changed, inserted, removed or moved, a shorter list, another
  dataset under the same pool name): refused with ``ConfigError`` before any producer
  starts, naming the first shard index that differs (or the count that shrank).

The fingerprint does not grow with the list: the shard count and the digests of the
first ``1, 2, 4, ..., 2**k`` shards and of the whole list (about 60 digests for a
billion shards). The whole-list digest decides; the power-of-two prefixes only narrow
down where the first difference is, for the message. Comparing costs one pass over the
new list on this machine and, on the store, one LIST and one GET (``batchweave.pool``).

Records, relative to the namespace root, each written once with a create-only put:
    _pools/<pool name>/00000000000000000000.json   the list at the pool's first start
    _pools/<pool name>/00000000000000000001.json   the list after its first extension, ...
The newest record holds; record ``v + 1`` is only written by a driver that read ``v``
as the newest and checked that its list extends it, so racing drivers are ordered by
the create-only put exactly like commits of the log.

Canonical encoding of a shard (format ``batchweave.pool-shards/1``), self-delimiting so
that the concatenation of a list's shards is unambiguous:

    None -> b"N"                 True / False -> b"T" / b"F"
    int -> b"i" <decimal> b";"   float -> b"f" <float.hex()> b";"
    str -> b"s" <n> b":" <n bytes of UTF-8, lone surrogates kept (surrogatepass)>
    bytes, bytearray -> b"b" <n> b":" <n bytes>
    list, tuple -> b"l" <count> b":" <each item>
    dict with str keys -> b"d" <count> b":" <key, value for each key in sorted order>

where ``<n>`` and ``<count>`` are decimal. A ``pathlib`` path is encoded as its ``str``,
any integral number (``numpy.int64``) as an int, and a list and a tuple of the same items
are the same shard. Any other type (a set, an object, an array) has no stable canonical
form and is refused with ``ConfigError``: shards are never pickled to be fingerprinted.
A list's digest at length ``k`` is BLAKE2b-128 of ``b"batchweave.pool-shards/1\\n"``
followed by the encodings of its first ``k`` shards.
"""

from __future__ import annotations

import hashlib
import numbers
import pathlib
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from batchweave.decoding import decoding
from batchweave.errors import ConfigError, CorruptDataError
from batchweave.keys import POOL_PREFIX

__all__ = [
    "POOL_PREFIX",
    "SHARDS_FORMAT",
    "ShardListRecord",
    "ShardListVerdict",
    "checkpoint_lengths",
    "compare",
    "decode_record",
    "encode_record",
    "encode_shard",
    "newest_record_key",
    "prefix_digests",
    "record_key",
]

SHARDS_FORMAT = "batchweave.pool-shards/1"
_MAX_DEPTH = 16  # nesting of lists and dicts inside one shard; deeper is a mistake (or a cycle)
_DIGEST = re.compile(r"[0-9a-f]{32}")  # BLAKE2b with 16-byte digests, in hex
_RECORD_NAME = re.compile(r"^(\d{20})\.json$")
_SUPPORTED = (
    "a shard must be a str, bytes, int, float, bool, None or pathlib path, or a list, tuple or "
    "str-keyed dict of those (docs/pools.md, 'Changing the shard list')"
)


def encode_shard(shard: Any) -> bytes:
    """The canonical bytes of one shard (see the module doc); ConfigError for a type without one."""
    try:
        return _shard_bytes(shard)
    except _Unsupported as exc:
        raise ConfigError(f"a shard that {exc} has no stable fingerprint; {_SUPPORTED}") from None


def _shard_bytes(shard: Any) -> bytes:
    parts: list[bytes] = []
    _encode(shard, parts, 0)
    return b"".join(parts)


def _encode(value: Any, parts: list[bytes], depth: int) -> None:
    # Exact types first: a million shards are encoded on every pool start, and the
    # isinstance chain below (an ABC check for numbers) costs several times more.
    kind = type(value)
    if kind is str:
        _encode_bytes(b"s", value.encode("utf-8", "surrogatepass"), parts)
    elif kind is int:
        parts.append(b"i%d;" % value)
    elif kind is tuple or kind is list:
        _encode_items(value, parts, depth)
    else:
        _encode_other(value, parts, depth)


def _encode_items(items: list[Any] | tuple[Any, ...], parts: list[bytes], depth: int) -> None:
    if depth >= _MAX_DEPTH:
        raise _Unsupported(f"is nested more than {_MAX_DEPTH} lists or dicts deep")
    parts.append(b"l%d:" % len(items))
    for item in items:
        _encode(item, parts, depth + 1)


def _encode_other(value: Any, parts: list[bytes], depth: int) -> None:
    if value is None:
        parts.append(b"N")
    elif isinstance(value, bool):  # before int: bool is an int
        parts.append(b"T" if value else b"F")
    elif isinstance(value, numbers.Integral):
        parts.append(b"i%d;" % int(value))
    elif isinstance(value, float):
        parts.append(b"f" + value.hex().encode() + b";")
    elif isinstance(value, (str, pathlib.PurePath)):
        _encode_bytes(b"s", str(value).encode("utf-8", "surrogatepass"), parts)
    elif isinstance(value, (bytes, bytearray)):
        _encode_bytes(b"b", bytes(value), parts)
    elif isinstance(value, (list, tuple)):
        _encode_items(value, parts, depth)
    elif isinstance(value, dict):
        _encode_dict(value, parts, depth)
    else:
        raise _Unsupported(f"holds a {type(value).__module__}.{type(value).__qualname__}")


def _encode_bytes(tag: bytes, data: bytes, parts: list[bytes]) -> None:
    parts.append(tag + b"%d:" % len(data))
    parts.append(data)


def _encode_dict(value: dict[Any, Any], parts: list[bytes], depth: int) -> None:
    if depth >= _MAX_DEPTH:
        raise _Unsupported(f"is nested more than {_MAX_DEPTH} lists or dicts deep")
    if not all(isinstance(key, str) for key in value):
        raise _Unsupported("holds a dict whose keys are not all str")
    parts.append(b"d%d:" % len(value))
    for key in sorted(value):
        _encode(key, parts, depth + 1)
        _encode(value[key], parts, depth + 1)


class _Unsupported(Exception):
    """A shard without a canonical encoding; turned into a ConfigError naming pool and index."""


def checkpoint_lengths(count: int) -> list[int]:
    """The prefix lengths a fingerprint of ``count`` shards records: 1, 2, 4, ... and ``count``."""
    lengths = []
    length = 1
    while length < count:
        lengths.append(length)
        length *= 2
    lengths.append(count)
    return lengths


def prefix_digests(pool: str, shards: Sequence[Any], lengths: Collection[int]) -> dict[int, str]:
    """The digest of the first ``k`` shards for every ``k`` in ``lengths``: one pass over the list.

    Raises ConfigError naming the pool and the shard index for a shard without a
    canonical encoding (every shard is checked, not only those before the last length).
    """
    lengths = set(lengths)
    running = hashlib.blake2b(SHARDS_FORMAT.encode() + b"\n", digest_size=16)
    digests = {0: running.hexdigest()} if 0 in lengths else {}
    for index, shard in enumerate(shards):
        try:
            running.update(_shard_bytes(shard))
        except _Unsupported as exc:
            raise ConfigError(
                f"pool {pool!r}: shard {index} {exc}, which has no stable fingerprint; {_SUPPORTED}"
            ) from None
        if index + 1 in lengths:
            digests[index + 1] = running.hexdigest()
    return digests


class ShardListRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One recorded shard list of a pool: ``prefixes`` holds (length, digest of the first
    ``length`` shards) for every ``checkpoint_lengths(shards)``, ascending."""

    format: str
    pool: str
    version: int  # the record's number: 0 at the first start, +1 for each extension
    shards: int
    prefixes: list[tuple[int, str]]

    @classmethod
    def of(cls, pool: str, version: int, shards: int, digests: Mapping[int, str]) -> ShardListRecord:
        prefixes = [(length, digests[length]) for length in checkpoint_lengths(shards)]
        return cls(SHARDS_FORMAT, pool, version, shards, prefixes)

    @property
    def digest(self) -> str:
        """The digest of the whole list."""
        return self.prefixes[-1][1]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(ShardListRecord)


def record_key(pool: str, version: int) -> str:
    return f"{POOL_PREFIX}{pool}/{version:020d}.json"


def newest_record_key(pool: str, keys: Iterable[str]) -> str | None:
    """The key of the highest-numbered record among listed ``keys`` (others are ignored)."""
    prefix = f"{POOL_PREFIX}{pool}/"
    versions = [int(m[1]) for key in keys if key.startswith(prefix) and (m := _RECORD_NAME.match(key[len(prefix) :]))]
    return record_key(pool, max(versions)) if versions else None


def encode_record(record: ShardListRecord) -> bytes:
    return _ENCODER.encode(record)


def decode_record(data: bytes | memoryview, key: str, pool: str) -> ShardListRecord:
    """Parse and validate the record read from ``key``; CorruptDataError naming it if damaged."""
    with decoding(key, "damaged pool shard-list record"):
        record = _DECODER.decode(data)
    if record.format != SHARDS_FORMAT:
        raise CorruptDataError(key, f"unsupported pool shard-list format {record.format!r}")
    if record.pool != pool or key != record_key(pool, record.version):
        raise CorruptDataError(key, f"holds record {record.version} of pool {record.pool!r}, not this key's")
    lengths = [length for length, _ in record.prefixes]
    if record.shards < 0 or lengths != checkpoint_lengths(record.shards):
        raise CorruptDataError(key, f"prefix lengths {lengths} do not fit {record.shards} shards")
    if not all(_DIGEST.fullmatch(digest) for _, digest in record.prefixes):
        raise CorruptDataError(key, "a prefix digest is not 32 hex digits")
    return record


@dataclass(frozen=True, slots=True)
class ShardListVerdict:
    """How a pool's list compares with its newest record.

    ``kind``: "same", "appended" (the record's list plus shards at the end), "shrunk"
    (fewer shards than recorded) or "changed". For "changed", ``first_differing`` holds
    the lowest and the highest index the first differing shard can have: the recorded
    power-of-two prefixes pin it down to ``[2**j, 2**(j+1))`` (exactly, for index 0 and 1).
    """

    kind: Literal["same", "appended", "shrunk", "changed"]
    recorded: int  # shards in the record
    given: int  # shards in the list given now
    first_differing: tuple[int, int] = (0, 0)

    @property
    def refused(self) -> bool:
        return self.kind in ("shrunk", "changed")

    def message(self, pool: str, key: str) -> str:
        """Why a refused list is refused and what to do, for a ConfigError."""
        if self.kind == "shrunk":
            problem = (
                f"was recorded with {self.recorded} shards ({key}), now given {self.given}: shards can only "
                "be appended to a pool's list, never removed, because its producers' committed offsets "
                "count positions in the longer list"
            )
        else:
            problem = (
                f"recorded another shard list ({key}, {self.recorded} shards): {self._where()} "
                "(changed, inserted, removed or moved); its producers resume by list position, so this "
                "list would repeat some shards and skip others"
            )
        return (
            f"pool {pool!r} {problem}. Restart it with the recorded list (new shards may be appended at "
            "the end), or run this list under another pool name (in a new namespace if it repeats shards "
            "of this pool)"
        )

    def _where(self) -> str:
        low, high = self.first_differing
        same = {0: "", 1: "shard 0 is the same and "}.get(low, f"the first {low} shards are the same and ")
        if low == high:
            return f"{same}shard {low} differs"
        return f"{same}the first shard that differs is one of shards {low} to {high}"


def compare(record: ShardListRecord, given: int, digests: Mapping[int, str]) -> ShardListVerdict:
    """Judge a list of ``given`` shards whose prefix ``digests`` cover ``record``'s lengths."""
    if given < record.shards:
        return ShardListVerdict("shrunk", record.shards, given)
    if digests[record.shards] == record.digest:
        return ShardListVerdict("same" if given == record.shards else "appended", record.shards, given)
    same_upto = 0  # the longest recorded prefix that still matches
    for length, digest in record.prefixes:
        if digests[length] != digest:
            return ShardListVerdict("changed", record.shards, given, (same_upto, length - 1))
        same_upto = length
    raise AssertionError("unreachable: the last prefix is the whole recorded list")
