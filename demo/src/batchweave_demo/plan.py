"""The demo's plan: the run's shape and where every event of the story happens, fixed
before any process starts (so every run shows the same events), and the names the
processes go by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchweave.errors import ConfigError
from batchweave_demo.workload import IMAGES_PER_SLICE

DEFAULT_STEPS = 200
COMMIT_EVERY = 4  # TGBs a producer uploads before each flush()
MIN_STEPS = 40


def producer_id(index: int) -> str:
    return f"prep-{index}"


def checkpoint_id(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """The run's shape and the points at which the story's events happen."""

    steps: int
    producers: int
    dp: int
    cp: int
    images: int
    shares: tuple[int, ...]  # TGBs each producer makes (its offsets are 0..share-1)
    checkpoint_every: int  # steps between checkpoints; even, so a 2x DP mesh can resume at one
    victim_producer: int
    producer_gate: int  # the victim blocks after uploading offsets gate-COMMIT_EVERY .. gate-1
    victim_rank: int
    rank_gate: int  # the victim rank blocks after this many steps, past a checkpoint

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def twin_slot(self) -> int:
        return self.world  # progress slots: the ranks, then the twin

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def _shares(steps: int, producers: int) -> tuple[int, ...]:
    return tuple(steps // producers + (1 if i < steps % producers else 0) for i in range(producers))


def plan_demo(producers: int, steps: int, dp: int, cp: int, images: int = IMAGES_PER_SLICE) -> DemoPlan:
    """The plan for these sizes, or ConfigError naming what is too small or too large."""
    for name, value in (("producers", producers), ("steps", steps), ("dp", dp), ("cp", cp), ("images", images)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"demo: {name} must be an integer >= 1, got {value!r}")
    if producers > 64 or dp * cp > 64:
        raise ConfigError(f"demo: at most 64 producers and 64 ranks (dp*cp) on one machine, got {producers}, {dp * cp}")
    if steps < MIN_STEPS:
        raise ConfigError(
            f"demo: steps must be at least {MIN_STEPS} (kills, checkpoints and GC need room), got {steps}"
        )
    shares = _shares(steps, producers)
    if shares[-1] < 2 * COMMIT_EVERY:
        raise ConfigError(
            f"demo: every producer needs at least {2 * COMMIT_EVERY} steps (a committed group before the kill "
            f"and an uncommitted one at it); {steps} steps over {producers} producers is too few"
        )
    every = max(2, steps // 10 // 2 * 2)
    victim = producers // 2
    committed_groups = max(1, shares[victim] // (4 * COMMIT_EVERY))  # about a quarter of its share
    return DemoPlan(
        steps=steps,
        producers=producers,
        dp=dp,
        cp=cp,
        images=images,
        shares=shares,
        checkpoint_every=every,
        victim_producer=victim,
        producer_gate=(committed_groups + 1) * COMMIT_EVERY,
        victim_rank=dp * cp - 1,
        rank_gate=2 * every + every // 2,
    )
