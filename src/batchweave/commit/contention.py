"""How many producers contend for the log: the N a commit policy is given
(``CommitPolicy.observe``) and ``Producer.metrics`` shows as ``producers_active``.

Those seen committing lately (``policies.RecentCommitters``, over the window the policy's
gap sets), or, when more, as many as the versions others committed between two of this
producer's attempts imply (``SharedState.between_looks``: a commit that jumps to the head
reads only the head's committer). ``Contention`` is given the state the producer shares
with its commit thread, its policy and the ``RecentCommitters`` it counts with.
"""

from __future__ import annotations

import math
import time

from batchweave.commit.policies import CommitPolicy, RecentCommitters
from batchweave.commit.shared import SharedState

__all__ = ["Contention"]


class Contention:
    """One producer's count of the producers contending for the log (module doc)."""

    def __init__(self, shared: SharedState, policy: CommitPolicy, committers: RecentCommitters) -> None:
        self._shared = shared
        self._policy = policy
        self._committers = committers

    def active(self) -> int:
        """Producers contending now, after noting who committed in the newest state we
        read (under ``shared.cond``, or before the commit thread starts)."""
        now = time.monotonic()
        recorded = self._shared.state.producers.items()
        # A producer's record that it left is no commit of its own: it stops counting.
        self._committers.update({pid: p.last_version for pid, p in recorded if not p.left}, now)
        return self.seen()

    def seen(self) -> int:
        """Producers contending as last noted (``active``), for the metrics. The versions
        between two looks count producers only up to the ids the log records (not left):
        one producer may commit several versions while this one waits out its gap."""
        recorded = sum(1 for p in self._shared.state.producers.values() if not p.left)
        between = min(self._shared.between_looks.count(), max(1, recorded))
        return max(self._committers.count(time.monotonic(), self._gap_s()), between)

    def _gap_s(self) -> float:
        gap = getattr(self._policy, "gap_s", 0.0)  # DAC's; policies that ignore N have none
        return gap if isinstance(gap, float | int) and math.isfinite(gap) else 0.0
