"""Group-mode producers without their commit thread, stepped through public calls.

Group commit runs on the producer's background thread (``GroupTurns.run`` of
``batchweave.commit.turns``). The simulation builds the producer with that thread inert
(``determinism.InertThread``) and runs the loop's body itself, one pass per ``step()``,
through the committer's public ``GroupTurns.step`` (publish intents, follow the log,
commit at our turn, with the failure bookkeeping; its ``cond.wait`` is a virtual sleep),
reached by ``Producer.committer``. Nothing here touches the producer's privates.
"""

from __future__ import annotations

from typing import Any

from batchweave.commit.group import GroupCommit
from batchweave.commit.turns import GroupTurns
from batchweave.producer import Producer
from batchweave.store import Store

__all__ = ["GroupProducerDriver"]


class GroupProducerDriver:
    """A ``Producer(commit_policy=GroupCommit(...))`` stepped by the caller."""

    def __init__(self, store: Store, producer_id: str, dp: int, snapshot_every: int, policy: GroupCommit) -> None:
        # background_commit=True is what group mode accepts; the thread it starts is inert.
        self.producer = Producer(store, producer_id, dp=dp, commit_policy=policy, snapshot_every=snapshot_every)
        turns = self.producer.committer
        assert isinstance(turns, GroupTurns)
        self._turns = turns

    def append(self, slices: list[Any], source_offset: int) -> int:
        return self.producer.append(slices, source_offset=source_offset)

    @property
    def resume_offset(self) -> int:
        return self.producer.resume_offset

    def step(self) -> None:
        """One pass of ``GroupTurns.run``: publish, follow, commit if our turn came."""
        self._turns.step()

    def flush(self) -> int:
        """Step until everything appended is committed; returns the offset flushed to."""
        self.producer.write_held()  # as Producer.flush: the TGBs held for a pack first
        target = self.producer.next_offset
        with self._turns.flushing():
            while self.producer.resume_offset < target:
                if not self._turns.step():  # nothing pending: would spin without a store operation
                    raise AssertionError(
                        f"flush to {target}: nothing pending, committed only to {self.producer.resume_offset}"
                    )
        return target

    def close(self) -> None:
        """After a flush, or to drop what is pending (a crash-like stop)."""
        self.producer.close(flush=False)
