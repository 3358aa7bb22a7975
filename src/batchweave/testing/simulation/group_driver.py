"""Group-mode producers without their commit thread: the one white-box adapter.

Group commit runs on the producer's background thread today (``GroupTurns.run`` of
``batchweave.commit.turns``). The simulation builds the producer with that thread inert
(``determinism.InertThread``) and runs the loop's body itself, one pass per ``step()``,
through the producer's private ``_turns.take_a_pass`` (publish intents, follow the log,
commit at our turn, with the failure bookkeeping; its ``cond.wait`` is a virtual sleep).
Everything private the simulation touches is in this class, so a public inline group
mode can replace it in one place.
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

    def append(self, slices: list[Any], source_offset: int) -> int:
        return self.producer.append(slices, source_offset=source_offset)

    @property
    def resume_offset(self) -> int:
        return self.producer.resume_offset

    def step(self) -> None:
        """One pass of ``GroupTurns.run``: publish, follow, commit if our turn came."""
        shared, turns = self.producer._shared, self.producer._committer
        assert isinstance(turns, GroupTurns)
        if shared.error is not None:
            raise shared.error
        if not shared.pending:
            return  # the loop would wait for an append; so does the caller
        turns.take_a_pass(shared.forced)  # a final error (fenced, ended, a damaged log) is kept
        if shared.error is not None:
            raise shared.error

    def flush(self) -> int:
        """Step until everything appended is committed; returns the offset flushed to."""
        p, shared = self.producer, self.producer._shared
        with p._pack_lock:
            p._write_pack()  # as Producer.flush: the TGBs held for a pack first
        target = p._next_offset
        shared.flush_waiters += 1
        try:
            while p.resume_offset < target:
                if not shared.pending and shared.error is None:  # would spin without a store operation
                    raise AssertionError(f"flush to {target}: nothing pending, committed only to {p.resume_offset}")
                self.step()
        finally:
            shared.flush_waiters -= 1
        return target

    def close(self) -> None:
        """After a flush, or to drop what is pending (a crash-like stop)."""
        self.producer.close(flush=False)
