"""Group-mode producers without their commit thread: the one white-box adapter.

Group commit runs on the producer's background thread today (``Producer._group_loop``).
The simulation builds the producer with that thread inert (``determinism.InertThread``)
and runs the loop's body itself, one pass per ``step()``, through the producer's private
``_group_step`` (publish intents, follow the log, commit at our turn; its ``_cond.wait``
is a virtual sleep) and its failure bookkeeping. Everything private the simulation
touches is in this class, so a public inline group mode can replace it in one place.
"""

from __future__ import annotations

from typing import Any

from batchweave.commit.group import GroupCommit
from batchweave.errors import StoreError
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
        """One pass of ``Producer._group_loop``: publish, follow, commit if our turn came."""
        p = self.producer
        if p._error is not None:
            raise p._error
        if not p._pending:
            return  # the loop would wait for an append; so does the caller
        forced = p._flush_waiters > 0 or p._closed
        try:
            p._group_step(forced)
            p._store_failures = 0
        except StoreError as exc:
            p._note_store_failure(exc)
        except Exception as exc:  # fenced, ended, a damaged log: final, as in the loop
            p._fail(exc)
        if p._error is not None:
            raise p._error

    def flush(self) -> int:
        """Step until everything appended is committed; returns the offset flushed to."""
        p = self.producer
        target = p._next_offset
        p._flush_waiters += 1
        try:
            while p.resume_offset < target:
                if not p._pending and p._error is None:  # would spin without a store operation
                    raise AssertionError(f"flush to {target}: nothing pending, committed only to {p.resume_offset}")
                self.step()
        finally:
            p._flush_waiters -= 1
        return target

    def close(self) -> None:
        """After a flush, or to drop what is pending (a crash-like stop)."""
        self.producer.close(flush=False)
