"""The one source of randomness of a simulated run: recorded, replayable, shrinkable.

Every decision of a run (which pending store operation goes next, what an actor does,
how long it idles, whether it crashes) is one ``choose(n)``. A seeded source draws the
values and records them; a replayed source hands back a recorded list (values too large
are clamped, an exhausted list answers 0). Every decision is written so that 0 is its
calm answer (the first candidate, no crash, the shortest pause), which is what lets a
shrinker cut and lower the list and still get a meaningful run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["Choices"]


class Choices:
    """``Choices(seed=7)`` draws; ``Choices(replay=[...])`` replays. ``recorded`` is the
    list a replay of this run needs."""

    def __init__(self, seed: int | None = None, replay: Sequence[int] | None = None) -> None:
        self._rng = random.Random(seed) if replay is None else None
        self._replay = list(replay) if replay is not None else None
        self.recorded: list[int] = []

    def choose(self, n: int) -> int:
        """A value in ``range(n)``. ``n <= 1`` is no decision and records nothing."""
        if n <= 1:
            return 0
        if self._replay is not None:
            position = len(self.recorded)
            value = min(self._replay[position], n - 1) if position < len(self._replay) else 0
        else:
            assert self._rng is not None
            value = self._rng.randrange(n)
        self.recorded.append(value)
        return value

    def chance(self, one_in: int) -> bool:
        """True about once in ``one_in`` (the last value, so a lowered value says no)."""
        return self.choose(one_in) == one_in - 1

    def pick(self, options: Sequence[float]) -> float:
        """One of ``options``, the first being the calm one."""
        return options[self.choose(len(options))]
