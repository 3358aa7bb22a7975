"""A virtual clock and a seeded scheduler: one greenlet per actor, a switch at every
store operation and every sleep.

Actors are plain synchronous code (the real ``Producer``, ``Consumer``,
``collect_garbage``). When one calls the store or sleeps, it suspends; the scheduler
then picks, by one ``Choices`` decision, which suspended actor goes on: one with a
pending store operation (the operation completes now, then the actor runs until its
next operation or sleep) or the earliest sleeper (the clock jumps to its wake-up time).
So every interleaving of store operations is reachable, time passes only in jumps, and
nothing runs on a real thread.

A crash (SIGKILL) happens at an operation: the operation is applied or not, and the
actor never runs again; its ``finally`` blocks never touch the store, since the store
refuses a dead actor (``Dead`` unwinds it when the run is torn down).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import greenlet

from batchweave import keys
from batchweave.errors import ObjectExistsError, TransientStoreError
from batchweave.testing.simulation.choices import Choices

__all__ = ["OP_LATENCY_S", "Actor", "Dead", "Op", "Scheduler", "VirtualClock"]

# How long a writer waits for an answer that never comes (seconds).
_TIMEOUT_WAITS_S = (0.0, 1.0, 10.0)

OP_LATENCY_S = 0.01  # virtual seconds one store operation takes
START_TIME = 1_700_000_000.0  # a plausible Unix time: committed_at and modified times look real


class Dead(greenlet.GreenletExit):
    """Raised inside an actor that the run has given up on (crashed, or torn down)."""


class VirtualClock:
    """Seconds since the epoch, as the store sees them; actors add their own skew."""

    def __init__(self) -> None:
        self.now = START_TIME

    @property
    def elapsed(self) -> float:
        """Virtual seconds since the run began (what traces show)."""
        return self.now - START_TIME

    def advance_to(self, moment: float) -> None:
        self.now = max(self.now, moment)


@dataclass
class Op:
    """One store operation waiting to be scheduled; ``apply`` performs it."""

    name: str
    key: str
    apply: Callable[[], Any]
    # "applied" or "lost": the caller sees a timeout instead of the answer; "retried": it is
    # applied and the caller sees the key taken, by the store's retry of it
    timeout: str | None = None


@dataclass(eq=False)
class Actor:
    """One simulated process."""

    name: str
    kind: str  # "producer", "group", "collector", "trainer", "reader", "damager", "ender"
    skew_s: float = 0.0  # added to its time.time(): its host's clock is off by this much
    crashable: bool = True
    on_crash: Callable[[Actor], None] | None = None  # e.g. a supervisor that restarts it
    glet: Any = None
    state: str = "sleeping"  # "op", "sleeping", "running", "done", "crashed"
    pending: Op | None = None
    wake_at: float = 0.0
    error: BaseException | None = None
    waiting_for: str = ""  # what it is blocked on, for "waits forever" messages
    crash_at: int = 0  # dies at its crash_at-th store operation (0: never)
    ambiguous_at: int = 0  # its first log-version put from this operation on times out (0: never)
    fail_next_get: bool = False  # its next GET (whole or ranged) fails (the proof of a put that answered)
    ops: int = 0  # store operations it was scheduled for
    notes: dict[str, Any] = field(default_factory=dict)  # what its script wants found (its consumer)

    @property
    def alive(self) -> bool:
        return self.state not in ("done", "crashed")


class Scheduler:
    """Runs actors until none is left or a deadline passes; see the module doc."""

    def __init__(
        self, choices: Choices, clock: VirtualClock, crash_odds: int, crash_budget: int, ambiguous_odds: int = 0
    ) -> None:
        self.choices = choices
        self.clock = clock
        self.ambiguous_odds = ambiguous_odds  # one producer in this many sees a commit time out (0: none)
        self.crash_odds = crash_odds  # one crashable actor in this many dies
        self.crash_span = 200  # ... at one of its first this many store operations
        self.crash_budget = crash_budget  # crashes left in this run
        self.actors: list[Actor] = []
        self.main = greenlet.getcurrent()
        self.current: Actor | None = None
        self.closed = False
        self.ops = 0
        self.trace: list[tuple[float, str, str, str]] = []  # (time, actor, op, key)
        self.after_step: Callable[[], None] = lambda: None

    # -- inside actors ---------------------------------------------------------------

    def spawn(self, name: str, kind: str, body: Callable[[Actor], None], *, delay_s: float = 0.0, **kw: Any) -> Actor:
        actor = Actor(name, kind, **kw)
        actor.wake_at = self.clock.now + delay_s
        if actor.crashable and self.choices.chance(self.crash_odds):
            actor.crash_at = 1 + self.choices.choose(self.crash_span)
        if self.ambiguous_odds and kind in ("producer", "group") and self.choices.chance(self.ambiguous_odds):
            actor.ambiguous_at = 1 + self.choices.choose(self.crash_span)
        actor.glet = greenlet.greenlet(lambda: self._run(actor, body), parent=self.main)
        self.actors.append(actor)
        return actor

    def _run(self, actor: Actor, body: Callable[[Actor], None]) -> None:
        try:
            body(actor)
        except Dead:
            return
        except BaseException as exc:  # recorded; the model judges whether it was allowed
            actor.error = exc
        actor.state = "done"
        self.trace.append((self.clock.elapsed, actor.name, "exit", type(actor.error).__name__ if actor.error else ""))

    def operation(self, op: Op) -> Any:
        """Called by the store in the acting greenlet: wait for our turn, then do it."""
        actor = self._acting()
        actor.pending, actor.state = op, "op"
        self.main.switch()
        actor.pending = None
        if actor.fail_next_get and op.name in ("get", "get_range"):
            actor.fail_next_get = False
            self.sleep(self.choices.pick(_TIMEOUT_WAITS_S))  # others commit meanwhile, as below
            raise TransientStoreError(op.key, "simulated failure of the read after a put that landed")
        if op.timeout is None:
            return op.apply()
        if op.timeout in ("applied", "retried"):
            try:
                op.apply()
            except Exception:
                pass  # its answer is lost with the rest of the response
        # A timeout takes its time: others may commit before the writer learns of it, so
        # its retry meets versions after its own put, which may have landed (a writer that
        # jumps to the head must read that put first: ``Journal._own_landed``).
        self.sleep(self.choices.pick(_TIMEOUT_WAITS_S))
        if op.timeout == "retried":  # the store's own retry of it found the key taken
            taken = ObjectExistsError(op.key, "already exists, the create-only put lost (simulated, after a retry)")
            taken.after_retry = True
            raise taken
        raise TransientStoreError(op.key, f"simulated timeout, the put was {op.timeout}")

    def _times_out(self, actor: Actor) -> None:
        """Whether the answer to this log-version put is lost (``ambiguous_at``): the store
        applied it or not, and the writer sees a timeout either way (I3's ambiguous commit);
        or it lands, its answer is lost and the store's retry finds the key taken (by it);
        or it lands and says so, and the read after it (the commit's proof) fails: the
        commit raises after its version landed, which the writer knew."""
        op = actor.pending
        assert op is not None
        if actor.ambiguous_at == 0 or actor.ops < actor.ambiguous_at:
            return
        if op.name != "put_if_absent" or not op.key.startswith(keys.LOG_PREFIX + "0"):
            return  # the first log-version put from its ambiguous_at-th operation on
        actor.ambiguous_at = 0
        outcome = ("lost", "applied", "proof-failed", "retried")[self.choices.choose(4)]
        if outcome == "proof-failed":
            actor.fail_next_get = True
        else:
            op.timeout = outcome
        self.trace.append((self.clock.elapsed, actor.name, "TIMEOUT", f"{op.name} {op.key} {outcome}"))

    def sleep(self, seconds: float) -> None:
        actor = self._acting()
        actor.state, actor.wake_at = "sleeping", self.clock.now + max(0.0, seconds)
        self.main.switch()

    def _acting(self) -> Actor:
        actor = self.current
        if self.closed or actor is None or actor.glet is not greenlet.getcurrent():
            raise Dead()  # a torn-down run, or a dead actor's cleanup: it must not touch the store
        return actor

    # -- the loop ----------------------------------------------------------------------

    def run(self, until: Callable[[], bool], deadline: Callable[[], float], max_ops: int) -> None:
        """Schedule until ``until()``, the virtual time ``deadline()``, or ``max_ops`` operations."""
        while not until() and self.ops < max_ops:
            candidates = [a for a in self.actors if a.state == "op"]
            # Past the deadline nobody wakes up any more; operations under way complete. A
            # sleep without end (a wait with no bound) never ends: the run judges it at the end.
            end = deadline()
            sleepers = [a for a in self.actors if a.state == "sleeping" and a.wake_at <= end and a.wake_at != math.inf]
            if sleepers:  # the next to wake, all of them if several wake at the same moment
                first = min(a.wake_at for a in sleepers)
                candidates.extend(a for a in sleepers if a.wake_at == first)
            if not candidates:
                return
            actor = candidates[self.choices.choose(len(candidates))]
            if actor.state == "sleeping":
                self.clock.advance_to(actor.wake_at)
            else:
                assert actor.pending is not None
                self.ops += 1
                self.clock.advance_to(self.clock.now + OP_LATENCY_S)
                self.trace.append((self.clock.elapsed, actor.name, actor.pending.name, actor.pending.key))
                if self._crashes(actor):
                    continue
                self._times_out(actor)
            self._resume(actor)
            self.after_step()

    def _crashes(self, actor: Actor) -> bool:
        """Whether ``actor`` dies at this operation: decided once per actor, when it is
        spawned (``crash_at``), so crashes cost no choice per operation and a shrinker
        lowering the decision to 0 (never) does not shift the other choices."""
        actor.ops += 1
        if actor.crash_at == 0 or actor.ops != actor.crash_at or self.crash_budget <= 0:
            return False
        self.crash_budget -= 1
        op = actor.pending
        assert op is not None
        applied = self.choices.choose(2) == 1
        if applied:
            self.current = None  # the store applies it for the dead actor
            try:
                op.apply()
            except Exception:
                pass  # its answer never reaches anybody
        actor.state, actor.pending = "crashed", None
        self.trace.append(
            (self.clock.elapsed, actor.name, "CRASH", f"{op.name} {op.key} {'applied' if applied else 'lost'}")
        )
        if actor.on_crash is not None:
            actor.on_crash(actor)
        return True

    def _resume(self, actor: Actor) -> None:
        self.current = actor
        actor.state = "running"
        actor.glet.switch()
        self.current = None

    def kill_all(self) -> None:
        """Unwind every unfinished actor without letting it touch the store."""
        self.closed = True
        for actor in self.actors:
            if actor.glet:  # started and not finished (a greenlet never started just goes)
                self.current = actor
                try:
                    actor.glet.throw(Dead())
                except Dead:
                    pass
                self.current = None
