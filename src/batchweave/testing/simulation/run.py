"""One simulated run: ``simulate(choices, config) -> Result``."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from batchweave.testing.simulation.actors import spawn_all
from batchweave.testing.simulation.choices import Choices
from batchweave.testing.simulation.determinism import deterministic
from batchweave.testing.simulation.model import Model, Violation
from batchweave.testing.simulation.scheduler import Scheduler, VirtualClock
from batchweave.testing.simulation.store import SimStore
from batchweave.testing.simulation.world import Config, World

__all__ = ["Result", "simulate"]


@dataclass
class Result:
    violations: list[Violation]
    trace: list[tuple[float, str, str, str]]  # (virtual time, actor, operation, key)
    ops: int  # store operations scheduled
    choices: list[int]  # replaying these gives this run again
    virtual_s: float  # virtual seconds the run covered
    wall_s: float  # real seconds it took
    finished: bool  # False when it hit max_ops (then liveness is not judged)
    notes: dict[str, int] = field(default_factory=dict)

    @property
    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}


def simulate(choices: Choices, config: Config | None = None) -> Result:
    """Run every actor of ``config`` under the schedule ``choices`` gives; check the model
    after every step and liveness at the end."""
    config = config or Config()
    started = time.perf_counter()
    noise = random.Random(choices.choose(1 << 32))  # ids, tokens, jitter inside batchweave
    clock = VirtualClock()
    begin = clock.now
    scheduler = Scheduler(choices, clock, config.crash_odds, config.crash_budget, config.ambiguous_odds)
    model = Model(config.dp, lambda: clock.now - begin)
    store = SimStore(scheduler, model, config.head_copies)
    world = World(config, choices, scheduler, store, model)
    finished = False
    with deterministic(scheduler, noise):
        try:
            spawn_all(world)
            scheduler.after_step = world.check

            def deadline() -> float:
                return float("inf") if world.ended_at is None else world.ended_at + config.drain_s

            scheduler.run(
                until=lambda: bool(model.violations) or not any(a.alive for a in scheduler.actors),
                deadline=deadline,
                max_ops=config.max_ops,
            )
            finished = scheduler.ops < config.max_ops
            if not model.violations and finished:
                _judge_the_end(world)
        finally:
            scheduler.kill_all()
    return Result(
        violations=list(model.violations),
        trace=scheduler.trace,
        ops=scheduler.ops,
        choices=list(choices.recorded),
        virtual_s=clock.now - begin,
        wall_s=time.perf_counter() - started,
        finished=finished,
        notes={
            "versions": len(model.genuine_bytes),
            "steps": len(model.steps),
            "recreations": len(model.recreations),
            "crashes": sum(a.state == "crashed" for a in scheduler.actors),
            "packs": _packs(model),
        },
    )


def _packs(model: Model) -> int:
    """Objects of the genuine log that several TGBs share (a producer's packs)."""
    readers: dict[str, int] = {}
    for tgb in model.steps:
        for key in set(tgb.objects):
            readers[key] = readers.get(key, 0) + 1
    return sum(count > 1 for count in readers.values())


def _judge_the_end(world: World) -> None:
    """(e): the stream ended and the actors drained; whoever is still waiting waits forever,
    and an error that escaped an actor's script is a violation."""
    model = world.model
    for actor in world.scheduler.actors:
        if actor.alive and actor.kind in ("trainer", "reader"):  # the others may still be pausing
            what = f" ({actor.waiting_for})" if actor.waiting_for else ""
            model.violation(
                "waits-forever",
                actor.name,
                f"still waiting{what} {world.config.drain_s:.0f} s after the stream ended "
                f"(genuine log: {len(model.steps)} steps, ended={model.ended})",
            )
        elif actor.error is not None:
            model.violation("unexpected-error", actor.name, f"{type(actor.error).__name__}: {actor.error}")
