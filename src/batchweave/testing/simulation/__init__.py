"""Deterministic simulation of the whole protocol (FoundationDB's simulation testing,
TigerBeetle's VOPR): the real producers, consumers and collectors in one process, on a
simulated store and a virtual clock, every store operation a scheduling point chosen by
one seeded, recorded choice source; the invariants checked after every step against a
plain model; a failing schedule replays exactly and shrinks.

    from batchweave.testing.simulation import Choices, Config, simulate
    result = simulate(Choices(seed=7), Config())
    result.violations            # [] or what broke, where, and what the model says
    simulate(Choices(replay=result.choices), Config())   # the same run again

``python -m batchweave.testing.simulation --help`` runs seeds, replays and shrinks.
See docs/testing.md.
"""

from __future__ import annotations

from batchweave.testing.simulation.choices import Choices
from batchweave.testing.simulation.model import Violation
from batchweave.testing.simulation.run import Result, simulate
from batchweave.testing.simulation.world import SHAPES, Config

__all__ = ["SHAPES", "Choices", "Config", "Result", "Violation", "simulate"]
