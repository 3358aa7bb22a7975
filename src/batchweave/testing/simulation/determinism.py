"""What the batchweave modules see of time, randomness and threads during a simulated run.

``deterministic(sim)`` replaces module attributes (``batchweave.producer.time`` and the
like), never the standard library itself, and restores them on exit:

- ``time``: ``time()`` is the virtual clock plus the acting actor's skew, ``monotonic()``
  and ``perf_counter()`` the virtual clock, ``sleep()`` a scheduling point;
- ``random``, ``uuid``, ``secrets``: drawn from one seeded ``random.Random`` (the run's
  *noise*, seeded by the run's first choice), so ids, tokens and jitter replay exactly;
- ``threading`` of ``batchweave.producer`` and of its pack writer
  (``batchweave.writing.packs``): a ``Condition`` whose ``wait`` is a virtual sleep (group
  commit waits for its turn that way) and a ``Thread`` that never starts (group mode needs
  a commit thread; the simulation steps it instead, see ``group_driver.GroupProducerDriver``);
- ``ThreadPoolExecutor`` of ``batchweave.commit.intents``: one that runs each call in the
  caller (the intent board reads intents on 32 threads otherwise).

Consumers need no patch: on a store that is not remote with ``prefetch=None`` the
pipeline runs inline and reads the log with a read-ahead depth of 1, on no thread.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import batchweave.commit.backlog
import batchweave.commit.claiming
import batchweave.commit.contention
import batchweave.commit.group
import batchweave.commit.intents
import batchweave.commit.loop
import batchweave.commit.policies
import batchweave.commit.turns
import batchweave.consumer
import batchweave.journal.core
import batchweave.journal.proof
import batchweave.lifecycle.gc
import batchweave.lifecycle.maxlag
import batchweave.logrules
import batchweave.producer
import batchweave.reading.driver
import batchweave.reading.fetch
import batchweave.reading.follower
import batchweave.reading.logsource
import batchweave.reading.pipeline
import batchweave.reading.polling
import batchweave.reading.readahead
import batchweave.reading.silence
import batchweave.store.core
import batchweave.store.requests
import batchweave.writing.packs

if TYPE_CHECKING:
    from batchweave.testing.simulation.scheduler import Scheduler

__all__ = ["InertThread", "SimCondition", "deterministic"]


class SimCondition:
    """``threading.Condition`` for one greenlet at a time: no lock is ever contended, and
    ``wait(timeout)`` is a virtual sleep (a wait without a timeout would never end in a
    run with no thread to notify it)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def __enter__(self) -> SimCondition:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            raise RuntimeError("a Condition.wait() without timeout would block forever in the simulation")
        self._scheduler.sleep(timeout)
        return False

    def notify_all(self) -> None:
        pass

    notify = notify_all


class InertThread:
    """A commit thread that never runs: the simulation drives its loop step by step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


class InlineExecutor:
    """``ThreadPoolExecutor`` that runs every call in the caller, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        return iter([fn(*args) for args in zip(*iterables, strict=True)])

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def _fake_time(scheduler: Scheduler) -> SimpleNamespace:
    clock = scheduler.clock

    def skewed() -> float:
        actor = scheduler.current
        return clock.now + (actor.skew_s if actor is not None else 0.0)

    def monotonic() -> float:
        return clock.now - 1_600_000_000.0  # any origin will do; not the wall clock

    return SimpleNamespace(time=skewed, monotonic=monotonic, perf_counter=monotonic, sleep=scheduler.sleep)


def _fake_random(noise: random.Random) -> SimpleNamespace:
    return SimpleNamespace(
        random=noise.random,
        uniform=noise.uniform,
        randrange=noise.randrange,
        Random=lambda seed=None: random.Random(noise.getrandbits(64) if seed is None else seed),
    )


def _fake_uuid(noise: random.Random) -> SimpleNamespace:
    return SimpleNamespace(uuid4=lambda: uuid.UUID(int=noise.getrandbits(128), version=4), UUID=uuid.UUID)


def _fake_secrets(noise: random.Random) -> SimpleNamespace:
    return SimpleNamespace(token_hex=lambda n=32: noise.getrandbits(8 * n).to_bytes(n, "big").hex())


@contextlib.contextmanager
def deterministic(scheduler: Scheduler, noise: random.Random) -> Iterator[None]:
    """Patch the batchweave modules for one run (see the module doc); restore on exit."""
    fake_time = _fake_time(scheduler)
    fake_random = _fake_random(noise)
    # Event: the producer's flag that stops its store retries at close; the simulated store
    # never fails transiently, so nothing ever waits on it.
    threading_shim = SimpleNamespace(
        Condition=lambda: SimCondition(scheduler), Thread=InertThread, Event=threading.Event, Lock=threading.Lock
    )
    patches: list[tuple[Any, str, Any]] = [
        (batchweave.producer, "time", fake_time),
        (batchweave.producer, "uuid", _fake_uuid(noise)),
        (batchweave.producer, "threading", threading_shim),
        # The producer's parts: its epoch claim, its pack writer, its max_lag backpressure,
        # its hold while its commits are behind, its count of the producers contending.
        (batchweave.commit.backlog, "time", fake_time),
        (batchweave.commit.contention, "time", fake_time),
        (batchweave.commit.claiming, "time", fake_time),
        (batchweave.commit.claiming, "random", fake_random),
        (batchweave.writing.packs, "time", fake_time),
        (batchweave.writing.packs, "secrets", _fake_secrets(noise)),
        (batchweave.writing.packs, "threading", threading_shim),
        (batchweave.lifecycle.maxlag, "time", fake_time),
        (batchweave.lifecycle.maxlag, "random", fake_random),
        # The producer's commit loops (the condition they wait on is the producer's).
        (batchweave.commit.loop, "time", fake_time),
        (batchweave.commit.loop, "random", fake_random),
        (batchweave.commit.turns, "time", fake_time),
        (batchweave.commit.turns, "random", fake_random),
        (batchweave.consumer, "time", fake_time),
        (batchweave.reading.pipeline, "time", fake_time),
        (batchweave.reading.driver, "time", fake_time),  # an inline reader's pauses
        (batchweave.reading.logsource, "time", fake_time),  # when a rank that left its node asks again
        (batchweave.reading.fetch, "time", fake_time),
        (batchweave.reading.follower, "time", fake_time),
        (batchweave.reading.polling, "random", fake_random),
        (batchweave.reading.silence, "time", fake_time),  # when a silent log is logged
        (batchweave.reading.readahead, "random", fake_random),  # which key a probe at the head reads
        (batchweave.journal.proof, "random", fake_random),  # a spread anchor
        (batchweave.journal.core, "time", fake_time),
        (batchweave.lifecycle.gc, "time", fake_time),
        (batchweave.logrules, "uuid", _fake_uuid(noise)),
        (batchweave.commit.group, "random", fake_random),
        (batchweave.commit.policies, "random", fake_random),
        (batchweave.store.requests, "time", fake_time),
        (batchweave.store.requests, "random", fake_random),
        (batchweave.store.core, "uuid", _fake_uuid(noise)),
        (batchweave.commit.intents, "ThreadPoolExecutor", InlineExecutor),
        # The process's intent readers: a run makes its own (inline) rather than use the
        # real threads an earlier group producer of this process made, and leaves those.
        (batchweave.commit.intents, "_shared", None),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    quiet = logging.getLogger("batchweave")
    level = quiet.level
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        quiet.setLevel(logging.CRITICAL)  # stale views and damaged objects log warnings by design
        yield
    finally:
        quiet.setLevel(level)
        for module, name, value in saved:
            setattr(module, name, value)
