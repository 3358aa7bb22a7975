"""What the actors of one run share: the scheduler, the store, the model, the choices,
and the bookkeeping a real deployment keeps outside the store (saved cursors, which
incarnation of each producer is the newest)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchweave.testing.simulation.choices import Choices
from batchweave.testing.simulation.model import Model
from batchweave.testing.simulation.scheduler import Actor, Scheduler
from batchweave.testing.simulation.store import SimStore

__all__ = ["SHAPES", "Config", "World", "role"]


@dataclass(frozen=True)
class Config:
    """The shape of a run. Each seed explores one schedule of it."""

    direct_producers: int = 2  # Producer(background_commit=False), Manual or DAC
    group_producers: int = 2  # commit_policy="group", stepped by GroupProducerDriver
    collectors: int = 2
    trainers: int = 1  # a checkpointing job of ``dp`` consumers (one per rank)
    lagging_readers: int = 1  # a slow reader that no checkpoint protects
    resumers: int = 1  # readers that start from a cursor a trainer saved
    damage: bool = True  # a damager actor (hint, segment, intent, watermark, stale re-creation)
    dp: int = 2
    snapshot_every: int = 3  # small, so that collections delete versions early and often
    actions: int = 24  # script length of one producer incarnation
    pause_weight: int = 3  # of a producer's actions, pauses weigh this (appends weigh 10)
    max_incarnations: int = 3  # per producer id (restarts and crash restarts)
    crash_odds: int = 4  # one crashable actor (process) in this many is killed at some store operation
    crash_budget: int = 3
    ambiguous_odds: int = 0  # one producer incarnation in this many sees one commit time out (0: none)
    max_skew_s: float = 900.0
    end_after_s: float = 3000.0  # the stream ends once producers are done, or after this
    drain_s: float = 3600.0  # after the end, how long consumers get to reach it
    max_ops: int = 30_000
    node_sharing: bool = False  # a trainer's ranks share one node follower, and so do the lagging readers
    hub_faults: bool = False  # with node_sharing: each rank reaches it through a HubChannel (hubchannel.FAULTS)
    head_copies: int = 0  # copies every committer writes of its version; node followers read them at the head
    old_job: bool = False  # with head_copies: an old job's late copy puts, of a namespace once at this URL (oldjob)


def role(actor: str) -> str:
    """``g0.2`` -> ``g``, ``lag0`` -> ``lag``: what the actor is, not which one."""
    return actor.rstrip("0123456789.").rstrip("0123456789")


ALIGNED = -1.0  # a pause option: until the next multiple of ALIGN_S
ALIGN_S = 900.0

# Named shapes of a run: the CLI's --shape, and what the tests pin regressions to.
SHAPES = {
    "mixed": Config(),
    "group": Config(direct_producers=1, group_producers=3, lagging_readers=1, resumers=0, pause_weight=8),
    "direct": Config(direct_producers=3, group_producers=0, lagging_readers=2),
    "ambiguous": Config(ambiguous_odds=2),  # mixed, and half the producers see a commit's answer lost
    "node": Config(node_sharing=True, lagging_readers=2),  # readers through shared node followers
    "hub": Config(node_sharing=True, lagging_readers=2, hub_faults=True),  # node, over faulty hub channels
    # node, with head copies (journal.headcopies) written by every committer and read by the node followers
    "copies": Config(node_sharing=True, lagging_readers=2, head_copies=2),
    # copies, and the late copy puts of the job of a namespace deleted and created again at this URL
    "recreated": Config(node_sharing=True, lagging_readers=2, head_copies=2, old_job=True),
}


@dataclass
class World:
    config: Config
    choices: Choices
    scheduler: Scheduler
    store: SimStore
    model: Model
    producers: dict[Actor, Any] = field(default_factory=dict)  # live Producer objects, for check (b)
    generations: dict[str, int] = field(default_factory=dict)  # producer id -> newest incarnation
    checkpoints: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)  # live, oldest first
    cursors: list[dict[str, Any]] = field(default_factory=list)  # every cursor a trainer saved
    ended_at: float | None = None
    lagging_node: Any = None  # the node follower the lagging readers share (node_sharing)

    def choose(self, n: int) -> int:
        return self.choices.choose(n)

    def action(self, weights: dict[str, int]) -> str:
        """One of ``weights``' names, in proportion to its weight (the first is the calm one)."""
        value = self.choices.choose(sum(weights.values()))
        for name, weight in weights.items():
            if value < weight:
                return name
            value -= weight
        raise AssertionError("unreachable")

    def pause(self, options: tuple[float, ...] = (0.05, 0.5, 5.0, 30.0, 120.0, 600.0, ALIGNED)) -> None:
        """Sleep a chosen while: from a hiccup to a process paused across collections.
        ``ALIGNED`` sleeps until the next multiple of ``ALIGN_S`` virtual seconds: the
        actors paused that way all wake together, so stale views meet (as processes of
        one host do when it resumes from a freeze)."""
        seconds = self.choices.pick(options)
        if seconds == ALIGNED:
            elapsed = self.scheduler.clock.elapsed
            seconds = (elapsed // ALIGN_S + 1) * ALIGN_S - elapsed
        self.scheduler.sleep(seconds)

    def skew(self) -> float:
        """A host clock off by up to ``max_skew_s`` either way (0 most of the time)."""
        m = self.config.max_skew_s
        return self.choices.pick((0.0, 0.0, m / 30, -m / 30, m, -m))

    def check(self) -> None:
        """After every step: (b) for every live producer incarnation."""
        for actor, producer in self.producers.items():
            if actor.alive:  # a crashed process believes nothing anybody could act on
                self.model.believed(actor.name, producer.producer_id, producer.resume_offset)

    def producers_running(self) -> bool:
        return any(a.alive and a.kind in ("producer", "group") for a in self.scheduler.actors)
