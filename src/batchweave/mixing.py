"""A well-mixed, reproducible training order over weighted sources, as steps. Pure, no I/O.

    plan = MixPlan(Mixture([IndexedSource("web", 9_000, weight=3), IndexedSource("code", 1_000)], seed=7),
                   batch_size=256, epochs=2)
    plan[k]  # Step(step=k, epoch=..., samples=(SampleRef("web", 0, 4711), ...)): step k alone

The order is a pure function of (seed, position): step ``k`` holds mixture positions
``[k*B, (k+1)*B)`` and each position is computed from its number alone, so a producer
that restarts at the log's ``resume_offset`` continues the identical order with nothing
stored but that offset (``Producer.append(..., source_offset=k)``, or a ``MixPlan`` given
to ``run_pool`` as its shard list).

- Which source a position takes: a periodic schedule of the sources' integer weights
  (period ``T``, their sum) built once by Tijdeman's rule (``R. Tijdeman, The chairman
  assignment problem, Discrete Mathematics 32, 1980``): over every prefix, each source's
  count stays within ``1 - 1/(2S - 2)`` of its exact share (S sources), so over any window
  of ``W`` positions it is within 2 of ``W * weight / total``. Smooth weighted round-robin
  (nginx's) drifts past 1 with many sources. Position ``p`` is then O(1): its source is
  ``schedule[p % T]`` and that source's own count before ``p`` is ``(p // T) * w + rank``.
- Which sample: source ``s``'s ``j``-th position is position ``j % n`` of its epoch
  ``j // n`` (``n`` its samples), shuffled by ``batchweave.shuffle`` keyed by (seed, ``s``,
  epoch). Sources run through their epochs at their own pace.
- Epochs of the plan count steps: ``epoch_samples // B`` of them (``epoch_samples``: all
  sources' samples together unless given). Positions run on without a gap from one step
  to the next, so every source's own epochs (a ``SampleRef``'s ``epoch``) are exact
  permutations of its samples; with one source whose size ``B`` divides, the plan's
  epochs are that source's epochs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from fractions import Fraction
from functools import cached_property
from itertools import repeat
from typing import NamedTuple, Protocol, overload

import numpy as np

from batchweave.errors import ConfigError

__all__ = ["MAX_PERIOD", "MixPlan", "Mixture", "SampleRef", "Source", "Step", "integer_weights", "schedule"]

# The schedule's period: weights whose exact integer ratio sums to more are rounded to
# this many parts (each share then off by at most 1/65,536). Building it costs up to ~1 s.
MAX_PERIOD = 1 << 16
_SAMPLES_PER_CHUNK = 1 << 16  # what iterating a plan computes at once


class Source(Protocol):
    """What a mixture needs of a source (``batchweave.shuffle.IndexedSource``, ``ShardedSource``)."""

    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def samples(self) -> int: ...
    def indices(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray: ...


class SampleRef(NamedTuple):
    """One sample of a step: its source's name, that source's epoch, and ``sample``, its index
    in the source (``ShardedSource.locate`` turns it into a shard and an offset)."""

    source: str
    epoch: int
    sample: int


class Step(NamedTuple):
    """One step of a plan: its number, the plan's epoch it belongs to, its samples in order.

    Plain tuples of str and int: JSON and msgspec serialise it as nested arrays, and a
    producer pool fingerprints it as a shard (``batchweave.shardlist``).
    """

    step: int
    epoch: int
    samples: tuple[SampleRef, ...]


def integer_weights(weights: Sequence[float]) -> np.ndarray:
    """The smallest integers in the ratio of ``weights`` (floats read as the nearest fraction
    with a denominator up to 10**6: 0.7 and 0.3 give 7 and 3), or the ratio rounded to
    ``MAX_PERIOD`` parts (largest remainders, none below 1) when that sum is larger."""
    fractions = [Fraction(w).limit_denominator(10**6) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    integers = [int(f * scale) for f in fractions]
    divisor = math.gcd(*integers)
    exact = np.array([n // divisor for n in integers], dtype=np.int64)
    if exact.sum() <= MAX_PERIOD:
        return exact
    ideal = np.array([float(f) for f in fractions]) / float(sum(fractions)) * MAX_PERIOD
    rounded = np.maximum(np.floor(ideal).astype(np.int64), 1)
    shortfall = MAX_PERIOD - int(rounded.sum())
    if shortfall > 0:
        rounded[np.argsort(-(ideal - np.floor(ideal)), kind="stable")[:shortfall]] += 1
    return rounded


def schedule(weights: np.ndarray) -> np.ndarray:
    """One period (``weights.sum()`` positions) of source numbers by Tijdeman's rule.

    At each position, among the sources at least ``sigma = 1/(2S - 2)`` behind their share,
    take the one whose next sample is due first (the smallest ``(count + 1 - sigma) / weight``);
    ties go to the lower number. Integer arithmetic (scaled by ``2S - 2``) for the test.
    """
    sources, period = len(weights), int(weights.sum())
    scale = max(2 * sources - 2, 1)
    counts = np.zeros(sources, dtype=np.int64)
    out = np.empty(period, dtype=np.int32)
    for t in range(1, period + 1):
        behind = scale * (t * weights - counts * period) >= period
        due = np.where(behind, (scale * (counts + 1) - 1) / weights, np.inf)
        chosen = int(np.argmin(due))
        counts[chosen] += 1
        out[t - 1] = chosen
    return out


class Mixture:
    """Weighted sources in one shuffled order: position ``p`` -> (source, its epoch, sample index).

    ``sources``: ``IndexedSource`` or ``ShardedSource`` values (or anything with ``name``,
    ``weight``, ``samples`` and ``indices``), names unique. ``seed``: the whole order's seed.
    """

    def __init__(self, sources: Sequence[Source], seed: int) -> None:
        if not sources:
            raise ConfigError("a mixture needs at least one source")
        names = [source.name for source in sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"a mixture's source names must differ, got {names}: name each source once")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"a mixture's seed must be an int, got {seed!r}")
        self.sources = tuple(sources)
        self.seed = seed
        self.weights = integer_weights([source.weight for source in sources])

    def __repr__(self) -> str:
        return f"Mixture({[source.name for source in self.sources]}, seed={self.seed})"

    @property
    def samples(self) -> int:
        """All sources' samples in one epoch, together."""
        return sum(source.samples for source in self.sources)

    @cached_property
    def _period(self) -> tuple[np.ndarray, np.ndarray]:
        """The schedule, and for each of its positions how often its source came before in the period."""
        chosen = schedule(self.weights)
        rank = np.empty(len(chosen), dtype=np.int64)
        for number in range(len(self.sources)):
            mine = chosen == number
            rank[mine] = np.arange(int(mine.sum()))
        return chosen, rank

    def source_positions(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each mixture position: its source's number and that source's own position."""
        chosen, rank = self._period
        periods, within = np.divmod(np.asarray(positions, dtype=np.int64), len(chosen))
        numbers = chosen[within]
        return numbers, periods * self.weights[numbers] + rank[within]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each mixture position: its source's number, that source's epoch, the sample index."""
        numbers, own = self.source_positions(positions)
        samples = np.array([source.samples for source in self.sources], dtype=np.int64)
        epochs, within = np.divmod(own, samples[numbers])
        indices = np.empty_like(own)
        for number, source in enumerate(self.sources):
            mine = numbers == number
            # A step crosses few epochs of a source: one shuffle call each.
            for epoch in np.unique(epochs[mine]).tolist():
                chosen = mine & (epochs == epoch)
                indices[chosen] = source.indices(self.seed, epoch, within[chosen])
        return numbers, epochs, indices


class MixPlan(Sequence[Step]):
    """A mixture cut into steps of ``batch_size`` samples: ``plan[k]`` is step ``k``, alone.

    Exactly one of ``epochs`` (whole epochs of ``epoch_samples`` positions, default the
    mixture's ``samples``) and ``steps`` bounds the plan. A sequence of ``Step`` values:
    give it to ``run_pool`` as its shard list, or loop ``for k in range(producer.resume_offset,
    len(plan))``. A pool fingerprints its whole list on every start
    (``batchweave.shardlist``): about 5 microseconds per sample here, 5 s for a plan of a
    million samples; beyond that, run plain producer loops over ranges of steps.
    """

    def __init__(
        self,
        mixture: Mixture,
        batch_size: int,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        epoch_samples: int | None = None,
    ) -> None:
        self.mixture = mixture
        self.batch_size = _positive(batch_size, "batch_size")
        self.epoch_samples = mixture.samples if epoch_samples is None else _positive(epoch_samples, "epoch_samples")
        self.steps_per_epoch = self.epoch_samples // self.batch_size
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"an epoch of {self.epoch_samples} samples holds no whole step of batch_size {self.batch_size}: "
                "use a smaller batch_size or a larger epoch_samples"
            )
        if (epochs is None) == (steps is None):
            raise ConfigError("give a MixPlan exactly one of epochs= and steps=")
        self._length = (
            _positive(steps, "steps") if epochs is None else _positive(epochs, "epochs") * self.steps_per_epoch
        )

    def __repr__(self) -> str:
        return f"MixPlan({self.mixture!r}, batch_size={self.batch_size}, steps={self._length})"

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, step: int) -> Step: ...
    @overload
    def __getitem__(self, step: slice) -> list[Step]: ...
    def __getitem__(self, step: int | slice) -> Step | list[Step]:
        if isinstance(step, slice):
            return [self[k] for k in range(*step.indices(self._length))]
        if not isinstance(step, int | np.integer) or isinstance(step, bool):
            raise TypeError(f"a plan's steps are numbered by int, not {type(step).__name__}")
        k = int(step) + (self._length if step < 0 else 0)
        if not 0 <= k < self._length:
            raise IndexError(f"step {step} is outside this plan's {self._length} steps")
        return self._steps(k, k + 1)[0]

    def __iter__(self) -> Iterator[Step]:
        # Many steps per call: numpy's cost per call, not per sample, dominates one step
        # (a pool fingerprints every step of its list on each start).
        chunk = max(1, _SAMPLES_PER_CHUNK // self.batch_size)
        for first in range(0, self._length, chunk):
            yield from self._steps(first, min(first + chunk, self._length))

    def _steps(self, first: int, end: int) -> list[Step]:
        """Steps ``first`` to ``end - 1``, computed together."""
        positions = np.arange(first * self.batch_size, end * self.batch_size, dtype=np.int64)
        numbers, epochs, indices = self.mixture.locate(positions)
        names = np.array([source.name for source in self.mixture.sources], dtype=object)
        rows = zip(names[numbers].tolist(), epochs.tolist(), indices.tolist(), strict=True)
        refs = list(map(tuple.__new__, repeat(SampleRef), rows))  # SampleRef(*row), at C speed
        size = self.batch_size
        return [
            Step(k, self.epoch_of(k), tuple(refs[(k - first) * size : (k - first + 1) * size]))
            for k in range(first, end)
        ]

    def epoch_of(self, step: int) -> int:
        """The plan's epoch step ``step`` belongs to."""
        return step // self.steps_per_epoch

    def positions(self, step: int) -> np.ndarray:
        """The mixture positions step ``step`` takes: ``[step * B, (step + 1) * B)``."""
        return np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)


def _positive(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value
