"""How a producer's pending TGBs reach the log: each commit mode is a ``Committer``.

A producer builds one for its policy (``committer_for``) once its epoch is claimed, then
only calls it: ``run`` is its commit thread's body, ``commit_inline`` commits in the
caller's thread (``background_commit=False``, the paper's Algorithm 1), ``close`` lets go
of what it holds. Two modes exist:

- direct (``loop.CommitLoop``): the producer commits its own TGBs when its policy says
  so; every one-producer policy (DAC, naive, fixed, INCR, AIMD, manual, or your own);
- group commit (``turns.GroupTurns``): producers publish intents and take turns to fold
  everyone's into one version; chosen by ``GroupCommit``.

A new mode is a new ``Committer`` and one entry in ``_MODES``: nothing in the producer
changes. A policy whose mode needs the commit thread says so with ``background_only``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from batchweave.commit.group import GroupCommit
from batchweave.commit.intents import IntentBoard
from batchweave.commit.loop import CommitLoop, PublishedMetrics
from batchweave.commit.shared import SharedState
from batchweave.commit.turns import GroupTurns
from batchweave.errors import ConfigError
from batchweave.journal import Journal
from batchweave.store import Store

__all__ = ["CommitContext", "Committer", "check_mode", "committer_for"]


class Committer(Protocol):
    """One producer's commit mode."""

    def run(self) -> None:
        """The background commit thread's body: returns once the producer stops or fails."""
        ...

    def commit_inline(self, target: int, forced: bool) -> None:
        """Commit in the caller's thread up to offset ``target`` (all of it when ``forced``)."""
        ...

    def close(self) -> None:
        """Release what the mode holds (threads, caches); after the commit thread stopped."""
        ...


@dataclass(frozen=True, slots=True)
class CommitContext:
    """What a mode is built from: the producer's shared state, log and store, how many
    producers contend for the log (called under the producer's condition), the counters a
    commit publishes, and the fragile window its epoch claim measured."""

    shared: SharedState
    journal: Journal[Any]
    store: Store
    active_producers: Callable[[], int]
    published_metrics: PublishedMetrics
    claim_window_s: float


def _direct(policy: Any, context: CommitContext) -> Committer:
    return CommitLoop(
        context.shared, context.journal, context.store, policy, context.active_producers, context.published_metrics
    )


def _group(policy: GroupCommit, context: CommitContext) -> Committer:
    # The claim's successful attempt was a probe and a put, as a commit's is; it seeds how
    # long a put takes, and how late turns come until the log shows it.
    policy.observe_commit(context.claim_window_s)
    intents = IntentBoard(context.store, context.shared.producer_id)
    if context.shared.me.epoch > 1:  # an incarnation before it may have left intents (epochs count from 1)
        intents.sweep_older_epochs(context.shared.me.epoch)  # a crashed incarnation's, never foldable
    return GroupTurns(context.shared, context.journal, context.store, intents, policy, context.published_metrics)


# Each mode's policy type and how its Committer is built; anything else commits directly.
_MODES: dict[type, Callable[[Any, CommitContext], Committer]] = {GroupCommit: _group}


def check_mode(policy: Any, producer_id: str, background_commit: bool) -> None:
    """Refuse a policy whose mode needs the commit thread without one: before the producer
    claims its epoch (a claim fences the incarnation before it)."""
    if getattr(policy, "background_only", False) and not background_commit:
        name = getattr(policy, "name", type(policy).__name__)
        raise ConfigError(
            f"producer {producer_id!r}: {name} commit takes turns on the background commit thread; "
            f"use background_commit=True (the default) with commit_policy={name!r}"
        )


def committer_for(policy: Any, context: CommitContext) -> Committer:
    """The Committer of ``policy``'s mode."""
    build = next((make for kind, make in _MODES.items() if isinstance(policy, kind)), _direct)
    return build(policy, context)
