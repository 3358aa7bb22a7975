"""Pinned schedules that cannot go stale: a schedule kept with the point it reaches.

A schedule that once broke the protocol is kept as a regression test. Its choices replay
the same run only while the code makes the same calls: change what an actor does and the
replay drifts into another run, which passes without reaching the interleaving it pins.
So a pinned schedule names its *point*: which role of actor does what to a log version
garbage collection freed. The replay must reach it, or the test fails and says how to
pin a schedule that does (``find`` searches seeds of the shape; ``python -m
batchweave.testing.simulation --repin FILE`` rewrites the file with one).

The points, as the trace shows them (``delete`` by a collector frees a key; ``put`` or
``put_if_absent`` into a freed key re-creates it):

- ``reads-re-created``: the victim reads a version re-created in a freed key;
- ``reads-freed``: the victim reads a version's key while it is freed;
- ``puts-freed``: the victim puts a version into a freed key;
- ``proof-fails-after-put``: the victim's log-version put lands and says so, and the read
  that proves it fails (``Scheduler._times_out``): its retry must still count that
  version as its own, however many versions others committed after it;
- ``put-retried-into-itself``: the victim's log-version put lands, its answer is lost and
  the store's retry of it finds the key taken, by that put: the same for a lost race.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchweave.testing.simulation.choices import Choices
from batchweave.testing.simulation.model import VERSION_KEY
from batchweave.testing.simulation.run import Result, simulate
from batchweave.testing.simulation.world import Config, role

__all__ = ["EVENTS", "Point", "find", "reached"]

EVENTS = ("reads-re-created", "reads-freed", "puts-freed", "proof-fails-after-put", "put-retried-into-itself")
# The events the trace records as a log-version put's TIMEOUT, by the outcome it names.
_TIMEOUTS = {"proof-fails-after-put": " proof-failed", "put-retried-into-itself": " retried"}
_PUTS = ("put", "put_if_absent")


@dataclass(frozen=True)
class Point:
    """What a pinned schedule must make happen: ``event`` (one of ``EVENTS``) to an actor
    whose role is ``victim`` (``role``: "lag", "resume", "g", "p", ...)."""

    event: str
    victim: str

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"unknown pinned point {self.event!r}; choose from {', '.join(EVENTS)}")

    def describe(self) -> str:
        return f"{self.event} by a {self.victim!r} actor"


def reached(trace: Iterable[tuple[float, str, str, str]], point: Point) -> bool:
    """Whether the trace of a run reaches ``point``."""
    freed: set[str] = set()  # version keys a collector deleted, not put since
    re_created: set[str] = set()  # version keys put again after a delete, not deleted since
    for _, actor, op, key in trace:
        victim = role(actor) == point.victim
        if op == "TIMEOUT" and victim and point.event in _TIMEOUTS and key.endswith(_TIMEOUTS[point.event]):
            return True
        if not VERSION_KEY.fullmatch(key):
            continue
        if op == "delete":
            freed.add(key)
            re_created.discard(key)
        elif op in _PUTS and key in freed:
            if victim and point.event == "puts-freed":
                return True
            freed.discard(key)
            re_created.add(key)
        elif op in ("get", "get_range") and victim:
            if (point.event == "reads-re-created" and key in re_created) or (
                point.event == "reads-freed" and key in freed
            ):
                return True
    return False


def find(point: Point, config: Config, seeds: Iterable[int]) -> tuple[int, Result] | None:
    """The first of ``seeds`` whose run reaches ``point`` and breaks nothing, with its run."""
    for seed in seeds:
        result = simulate(Choices(seed=seed), config)
        if not result.violations and reached(result.trace, point):
            return seed, result
    return None
