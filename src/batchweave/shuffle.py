"""Seeded shuffles of a source's samples, one per epoch, any position computable alone. Pure, no I/O.

A training order must survive a restart with nothing stored but a producer's source
offset (``batchweave.mixing``), so every shuffle here is a function of (seed, source
name, epoch, position): the sample at position ``q`` of epoch ``e`` is computed from
those alone, in O(1) memory for an indexable source, never by replaying the epoch.

- ``IndexPermutation``: a keyed bijection on ``[0, n)``: a balanced Feistel network on
  the smallest even number of bits that holds ``n - 1``, with cycle walking (a value that
  lands at or above ``n`` is permuted again until it falls inside: at most 4x the domain,
  so under 4 rounds of walking on average). Six rounds of a SplitMix64 finaliser keyed by
  BLAKE2b are plenty to look uniformly random (``bench shuffle-quality``); this is the
  construction of format-preserving encryption (Black and Rogaway, 2002) without the
  cryptographic claim, the same idea as Grain's ``index_shuffle``. Vectorised with numpy.
- ``IndexedSource``: samples addressed by index (anything with ``len()``): epoch ``e``
  is one global permutation of all its indices.
- ``ShardedSource``: samples in shards that can only be read in order (tar files, MDS
  shards, Parquet row groups): epoch ``e`` visits the shards in a shuffled order and each
  shard's samples in a shuffled order of their own, so a reader holds one shard at a time.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from batchweave.errors import ConfigError

__all__ = ["IndexPermutation", "IndexedSource", "ShardedSource", "derive_key"]

_ROUNDS = 6
_MAX_SIZE = 1 << 62  # the Feistel domain (at most 4x the size) must fit 64 bits
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)  # SplitMix64's finaliser constants
_MIX2 = np.uint64(0x94D049BB133111EB)


def derive_key(seed: int, *parts: str | int) -> bytes:
    """32 bytes naming one shuffle: BLAKE2b of the seed and the parts (source, epoch, ...)."""
    text = "\x1f".join(str(part) for part in (seed, *parts))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=32, person=b"bw.shuffle").digest()


def _mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: every output bit depends on every input bit (uint64 wraps)."""
    values = (values ^ (values >> np.uint64(30))) * _MIX1
    values = (values ^ (values >> np.uint64(27))) * _MIX2
    return values ^ (values >> np.uint64(31))


class IndexPermutation:
    """A keyed bijection on ``[0, size)``: ``permutation(positions)`` maps each position to its index.

    O(1) memory; each position is computed alone (see the module doc). ``key`` is any
    bytes (``derive_key``); the same key and size give the same permutation everywhere.
    """

    __slots__ = ("_half_bits", "_keys", "_mask", "size")

    def __init__(self, size: int, key: bytes) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= _MAX_SIZE:
            raise ConfigError(f"a permutation needs a size from 1 to 2**62, got {size!r}")
        self.size = size
        self._half_bits = max(1, (max(size - 1, 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self._half_bits) - 1)
        digest = hashlib.blake2b(key, digest_size=8 * _ROUNDS, person=b"bw.feistel").digest()
        self._keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)

    def __len__(self) -> int:
        return self.size

    def __call__(self, positions: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """The indices at ``positions`` (each in ``[0, size)``), as an int64 array of the same shape."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.size):
            raise ConfigError(f"positions must lie in [0, {self.size}) for this permutation")
        values = positions.astype(np.uint64).ravel()
        outside = np.arange(values.size)
        while outside.size:  # cycle walking: re-permute what fell outside [0, size)
            values[outside] = self._feistel(values[outside])
            outside = outside[values[outside] >= np.uint64(self.size)]
        return values.astype(np.int64).reshape(positions.shape)

    def _feistel(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self._half_bits)
        left, right = values >> shift, values & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._mask)
        return (left << shift) | right


@dataclass(frozen=True, slots=True)
class IndexedSource:
    """A source whose samples are addressed by index ``0 .. size - 1`` (a map-style dataset).

    Epoch ``e`` visits every index once, in the order of one ``IndexPermutation`` keyed
    by (seed, ``name``, ``e``). ``weight``: its share of a ``Mixture`` (any positive number).
    """

    name: str
    size: int
    weight: float = 1.0

    def __post_init__(self) -> None:
        _check_source(self.name, self.weight)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or not 0 < self.size <= _MAX_SIZE:
            raise ConfigError(f"source {self.name!r}: size must be a positive number of samples, got {self.size!r}")

    @property
    def samples(self) -> int:
        """Samples in one epoch."""
        return self.size

    def indices(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The sample indices at ``positions`` of epoch ``epoch``."""
        return IndexPermutation(self.size, derive_key(seed, self.name, epoch))(positions)


@dataclass(frozen=True, slots=True)
class ShardedSource:
    """A source of shards read front to back; ``shard_sizes[s]`` samples in shard ``s``.

    Samples are numbered across shards: shard 0 holds ``0 .. shard_sizes[0] - 1``, and so
    on (``locate`` turns an index back into (shard, offset in the shard)). Epoch ``e``
    visits the shards in a shuffled order, ``shards_in_memory`` at a time, and the samples
    of each such group of shards in a shuffled order of their own; all keyed by (seed,
    ``name``, ``e``). A reader therefore holds one group of shards at a time (two at a
    boundary), and a restart re-reads at most the group it was in. More shards in memory
    mix more: neighbours of a shard spread over the whole group instead of one shard
    (``bench shuffle-quality``). The shard order costs O(shards), once per epoch and source.
    """

    name: str
    shard_sizes: tuple[int, ...]
    weight: float = 1.0
    shards_in_memory: int = 1
    _starts: np.ndarray = field(init=False, repr=False, compare=False)
    # (seed, epoch) -> (shard order, end of each in that order): the newest two epochs
    _epochs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _check_source(self.name, self.weight)
        sizes = tuple(self.shard_sizes)
        if not sizes or any(not isinstance(n, int | np.integer) or n < 0 for n in sizes) or sum(sizes) <= 0:
            raise ConfigError(
                f"source {self.name!r}: shard_sizes must be non-negative sample counts with at least one sample"
            )
        object.__setattr__(self, "shard_sizes", tuple(int(n) for n in sizes))
        group = self.shards_in_memory
        if not isinstance(group, int) or isinstance(group, bool) or group < 1:
            raise ConfigError(f"source {self.name!r}: shards_in_memory must be a positive int, got {group!r}")
        starts = np.concatenate([[0], np.cumsum(self.shard_sizes, dtype=np.int64)])
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_epochs", {})

    @property
    def samples(self) -> int:
        """Samples in one epoch (all shards)."""
        return int(self._starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """The (shard, offset inside it) of sample ``index``."""
        if not 0 <= index < self.samples:
            raise ConfigError(f"source {self.name!r} has samples 0 to {self.samples - 1}, not {index}")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return shard, index - int(self._starts[shard])

    def shard_order(self, seed: int, epoch: int) -> np.ndarray:
        """The shards in the order epoch ``epoch`` reads them."""
        count = len(self.shard_sizes)
        return IndexPermutation(count, derive_key(seed, self.name, epoch, "shards"))(np.arange(count))

    def indices(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The sample indices at ``positions`` of epoch ``epoch``."""
        positions = np.asarray(positions, dtype=np.int64)
        order, sizes, ends = self._epoch(seed, epoch)
        group_ends = ends[
            np.minimum(
                np.arange(self.shards_in_memory, len(ends) + self.shards_in_memory, self.shards_in_memory), len(ends)
            )
            - 1
        ]
        group_starts = np.concatenate([[0], group_ends[:-1]])
        groups = np.searchsorted(group_ends, positions, side="right")  # empty groups are stepped over
        in_epoch = np.empty_like(positions)  # the position's sample, counted in the epoch's shard order
        for group in np.unique(groups):  # a step touches few groups: one permutation each
            chosen = groups == group
            start, size = int(group_starts[group]), int(group_ends[group] - group_starts[group])
            local = IndexPermutation(size, derive_key(seed, self.name, epoch, "group", int(group)))
            in_epoch[chosen] = start + local(positions[chosen] - start)
        slots = np.searchsorted(ends, in_epoch, side="right")
        return self._starts[order[slots]] + in_epoch - (ends[slots] - sizes[slots])

    def _epoch(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shard order of an epoch, the shards' sizes and ends in that order (cached)."""
        cached = self._epochs.get((seed, epoch))
        if cached is None:
            order = self.shard_order(seed, epoch)
            sizes = np.asarray(self.shard_sizes, dtype=np.int64)[order]
            cached = (order, sizes, np.cumsum(sizes))
            if len(self._epochs) >= 2:  # steps move forward: an epoch left behind is not asked again
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[(seed, epoch)] = cached
        return cached


def _check_source(name: object, weight: object) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a source needs a non-empty name (a str), got {name!r}")
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"source {name!r}: weight must be a positive finite number, got {weight!r}")
