"""Garbage collection as a service: ``collect_garbage`` every few seconds until stopped.

``Collector(url, every_s)`` runs one collection (``batchweave.lifecycle.gc``), reports it
(one log line, and ``on_run`` for the ``--json`` line of ``batchweave gc --every``), waits
until ``every_s`` seconds after that run began, and starts the next, until ``stop()``.

Why it may run beside anything: a collection commits what it reclaims through the log
before it deletes, replans when another writer moved the log, and deletes idempotently;
so two services on one namespace, a cron job beside one, or a service killed half-way
are all safe (``collect_garbage``'s doc). Stopping never needs to finish a run either:
one abandoned half-way is finished by the next collection, whoever runs it.

Errors: a ``TransientStoreError`` (the store kept failing with throttling, server errors
or timeouts past its retry deadline, or other writers kept the log moving) ends that run
only; it is logged and the next run comes at the usual time. Every other
``BatchWeaveError`` will not go away by waiting (a missing bucket, access denied, a URL
where no namespace is, a damaged object): ``run_forever`` raises it, and the command
exits non-zero with its message.

What a service keeps between runs: the open store (its connections and request-rate
state) and the checkpoint watermarks already read (create-only objects, so a later run
GETs only the marks written since: at 1,250 positions and a few live checkpoints that is
thousands of GETs a run saved).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchweave import retry
from batchweave.errors import BatchWeaveError, ConfigError, TransientStoreError
from batchweave.lifecycle.gc import GCReport, collect_garbage
from batchweave.lifecycle.watermarks import MarkCache
from batchweave.store import Store, open_store

__all__ = ["CollectionRun", "Collector", "check_period_s", "describe_run"]

_logger = logging.getLogger(__name__)

_ABANDONED = "abandoned: stopped while the store was failing (safe: the next collection finishes it)"


def check_period_s(value: float, name: str) -> float:
    """``value`` if it is a finite number of seconds above 0; ConfigError naming ``name``
    (the argument or flag it came from) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ConfigError(
            f"{name}={value!r}: the time between collections must be a number of seconds above 0 "
            "(for example 60); to collect once, run without it"
        )
    return float(value)


@dataclass(frozen=True, slots=True)
class CollectionRun:
    """One collection of a ``Collector``: what it did, or why it failed (transiently)."""

    number: int  # 1 for the first run of this collector
    started_at: float  # Unix seconds
    duration_s: float
    report: GCReport | None  # None when the run failed
    error: str | None = None  # the transient error that ended the run

    @property
    def ok(self) -> bool:
        return self.report is not None


def describe_run(run: CollectionRun) -> str:
    """The run's log line: what it reclaimed and deleted, how long it took, or its error."""
    if run.report is None:
        return f"collection {run.number} failed after {run.duration_s:.2f} s: {run.error}"
    report = run.report
    w_global = "none (no live checkpoint)" if report.w_global_step is None else f"step {report.w_global_step}"
    return f"collection {run.number} took {run.duration_s:.2f} s: W_global {w_global}, {report.describe()}"


class Collector:
    """Collect garbage in ``url`` every ``every_s`` seconds until ``stop()``.

    ``grace_s`` and ``dry_run`` are ``collect_garbage``'s. ``on_run`` is called with each
    ``CollectionRun`` as it ends (``batchweave gc --every --json`` prints it). Runs start
    ``every_s`` seconds apart, or back to back when one takes longer. ``storage_options``
    are the store's, as for every function that takes a URL.

    ``run_forever()`` runs in the calling thread; ``stop()``, from any other thread, ends
    it: at once if it is waiting, else after the collection in progress, whose store
    retries end early (a run cut short that way is abandoned, which is safe: the next
    collection finishes it). Do not call ``stop()`` from a signal handler of the thread
    that runs ``run_forever``: ``batchweave gc --every`` runs it in a thread of its own
    for that reason.
    """

    def __init__(
        self,
        url: str | Store,
        every_s: float,
        *,
        grace_s: float = 3600.0,
        dry_run: bool = False,
        on_run: Callable[[CollectionRun], None] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.every_s = check_period_s(every_s, "every_s")
        self.grace_s = grace_s
        self.dry_run = dry_run
        self._store = open_store(url, create=False, storage_options=storage_options)
        self._on_run = on_run
        self._marks: MarkCache = {}
        self._stop = threading.Event()
        self.runs = 0  # collections started

    @property
    def url(self) -> str:
        return self._store.url

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """End ``run_forever``: now if it waits, after the collection in progress if not."""
        self._stop.set()

    def run_once(self) -> CollectionRun:
        """One collection, reported (log line, ``on_run``). A transient failure is in the
        returned run; any other BatchWeaveError is raised."""
        self.runs += 1
        started_at, began = time.time(), time.monotonic()
        try:
            report = collect_garbage(self._store, self.grace_s, dry_run=self.dry_run, marks=self._marks)
        except TransientStoreError as exc:
            if self._stop.is_set():  # stop() ended the store's retries: abandoned, not failed
                run = CollectionRun(self.runs, started_at, time.monotonic() - began, None, _ABANDONED)
                _logger.info("%s", describe_run(run))
            else:
                run = CollectionRun(self.runs, started_at, time.monotonic() - began, None, str(exc))
                _logger.warning("%s; the next one in %g s", describe_run(run), self.every_s)
        else:
            run = CollectionRun(self.runs, started_at, time.monotonic() - began, report)
            _logger.info("%s", describe_run(run))
        if self._on_run is not None:
            self._on_run(run)
        return run

    def run_forever(self) -> None:
        """Collect every ``every_s`` seconds until ``stop()``; raises the first error that
        is not transient (see the module doc)."""
        previous = retry.stop_event()
        retry.stop_retrying_when(self._stop)  # a stop ends this thread's store retries at once
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    self.run_once()
                except BatchWeaveError:
                    if self._stop.is_set():
                        break  # cut short by stop(): abandoned, not failed
                    raise
                self._stop.wait(max(0.0, began + self.every_s - time.monotonic()))
        finally:
            retry.stop_retrying_when(previous)
        _logger.info("garbage collection of %s stopped after %d collections", self.url, self.runs)
