"""The consumer: one training rank reading exactly its own slice of every step.

A background thread follows the log (only ever probing the next version, backing off
while idle) and schedules one range read per step on a small thread pool, up to
``prefetch`` steps ahead. Iteration hands out steps in order; the cursor in
``state_dict()`` counts what the caller has received, never what was prefetched.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchweave import log
from batchweave.errors import (
    BatchWeaveError,
    ConfigError,
    CorruptDataError,
    LayoutError,
    StepTimeoutError,
    StoreError,
)
from batchweave.journal import Journal
from batchweave.layout import decode_slice
from batchweave.log import LogVersion, TGBDescriptor
from batchweave.mesh import Mesh, resolve_rank
from batchweave.store import Store, open_store

__all__ = ["Batch", "Consumer"]

CURSOR_FORMAT = "batchweave.cursor/1"


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's data for this rank: ``data`` is a dict of numpy arrays, or bytes."""

    step: int
    data: dict[str, np.ndarray] | bytes
    version: int  # the log version that committed this step


@dataclass(frozen=True, slots=True)
class _Cursor:
    version: int  # log version holding the last delivered step (0 before any)
    step: int  # next step to deliver


_END = object()


class Consumer:
    """Iterates this rank's slice of every committed step, from step 0 or a saved cursor.

    Args:
        url: namespace URL.
        dp, cp, tp, pp: mesh sizes; ``dp*cp*tp*pp`` must equal ``WORLD_SIZE`` when set.
        rank: this rank, default ``RANK`` from the environment (torchrun).
        prefetch: steps fetched ahead on background threads.
        timeout_s: raise StepTimeoutError when no step arrives for this long (None: wait).
        max_poll_interval_s: longest pause between log probes while idle.
        store_options: passed through to obstore.
    """

    def __init__(
        self,
        url: str | Store,
        dp: int,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        rank: int | None = None,
        prefetch: int = 4,
        *,
        timeout_s: float | None = None,
        max_poll_interval_s: float = 1.0,
        **store_options: Any,
    ) -> None:
        self.mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp)
        self.rank = resolve_rank(rank, self.mesh)
        self.slice_index = self.mesh.slice_index(self.rank)
        if prefetch < 1:
            raise ConfigError(f"prefetch must be >= 1, got {prefetch}")
        self.prefetch = prefetch
        self.timeout_s = timeout_s
        self.max_poll_interval_s = max_poll_interval_s
        self._store = open_store(url, **store_options)
        self._cursor = _Cursor(version=0, step=0)
        self._pipeline: _Pipeline | None = None

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._pipeline is None:
            self._pipeline = _Pipeline(self, self._cursor)
        batch = self._pipeline.next(self.timeout_s)
        self._cursor = _Cursor(version=batch.version, step=batch.step + 1)
        return batch

    def close(self) -> None:
        """Stop background threads; iteration can start again from the cursor."""
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.close()

    # -- checkpointing (torch.distributed.checkpoint Stateful) -----------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor: resume right after the last step this rank received."""
        return {
            "format": CURSOR_FORMAT,
            "version": self._cursor.version,
            "step": self._cursor.step,
            "dp": self.mesh.dp,
            "cp": self.mesh.cp,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a cursor saved by ``state_dict()``."""
        cursor = _parse_cursor(state, self.mesh)
        self.close()
        self._cursor = cursor

    # -- pickling (handles that cross processes) -------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k != "_pipeline"}
        state["_pipeline"] = None
        return state

    def __repr__(self) -> str:
        return f"Consumer({self._store.url!r}, rank={self.rank}, mesh={self.mesh}, next_step={self._cursor.step})"


def _parse_cursor(state: Any, mesh: Mesh) -> _Cursor:
    if not isinstance(state, dict) or state.get("format") != CURSOR_FORMAT:
        raise ConfigError(f"not a BatchWeave consumer state (expected format {CURSOR_FORMAT!r}): {state!r:.200}")
    version, step = state.get("version"), state.get("step")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (version, step)):
        raise ConfigError(f"consumer state needs non-negative integer version and step, got {version!r}, {step!r}")
    if (state.get("dp"), state.get("cp")) != (mesh.dp, mesh.cp):
        raise LayoutError(
            f"consumer state was saved at dp={state.get('dp')} cp={state.get('cp')}, "
            f"this consumer has dp={mesh.dp} cp={mesh.cp}"
        )
    return _Cursor(version=version, step=step)


class _Pipeline:
    """Follows the log from a cursor and prefetches this rank's slices in step order."""

    def __init__(self, consumer: Consumer, cursor: _Cursor) -> None:
        self._store: Store = consumer._store
        self._journal = Journal(self._store)
        self._url = self._store.url
        self._mesh = consumer.mesh
        self._slice = consumer.slice_index
        self._max_poll_s = consumer.max_poll_interval_s
        self._cursor = cursor
        self._ready: queue.Queue[Any] = queue.Queue()
        self._slots = threading.Semaphore(consumer.prefetch)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=consumer.prefetch, thread_name_prefix="batchweave-fetch")
        self._known_version = cursor.version
        self._broken: BatchWeaveError | None = None
        self._thread = threading.Thread(target=self._follow, name="batchweave-follow", daemon=True)
        self._thread.start()

    def next(self, timeout_s: float | None) -> Batch:
        if self._broken is not None:
            raise self._broken  # never skip past a step that failed
        try:
            item = self._ready.get(timeout=timeout_s)
        except queue.Empty:
            raise StepTimeoutError(
                f"{self._url}: no step {self._cursor.step} within {timeout_s}s "
                f"(log seen up to version {self._known_version}); are producers running?"
            ) from None
        if item is _END:
            self._ready.put(_END)  # stay exhausted on later calls
            raise StopIteration
        if isinstance(item, BaseException):
            self._broken = item
            raise item
        self._slots.release()
        try:
            batch = item.result()
        except BatchWeaveError as exc:
            self._broken = exc
            raise
        self._cursor = _Cursor(batch.version, batch.step + 1)
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- background ------------------------------------------------------------------

    def _follow(self) -> None:
        try:
            self._follow_log()
        except BatchWeaveError as exc:
            self._ready.put(exc)

    def _follow_log(self) -> None:
        version = max(self._cursor.version, 1)
        expected_step = None
        pause = 0.0
        while not self._stop.is_set():
            delta = self._journal.read_version(version)
            if delta is None:
                if version <= self._cursor.version:
                    raise CorruptDataError(log.version_key(version), "the cursor's log version is missing")
                pause = min(self._max_poll_s, max(0.01, pause * 2))
                self._stop.wait(random.uniform(pause / 2, pause))  # jitter spreads 128 ranks' probes
                continue
            pause = 0.0
            self._known_version = version
            if expected_step is not None and delta.first_step != expected_step:
                raise CorruptDataError(
                    log.version_key(version), f"first step {delta.first_step}, expected {expected_step}"
                )
            expected_step = delta.first_step + len(delta.tgbs)
            if not self._schedule(delta):
                return
            if delta.end_of_stream:
                self._ready.put(_END)
                return
            version += 1

    def _schedule(self, delta: LogVersion) -> bool:
        for step, tgb in zip(delta.steps(), delta.tgbs, strict=True):
            if step < self._cursor.step:
                continue
            self._check_layout(tgb, delta.version, step)
            while not self._slots.acquire(timeout=0.1):
                if self._stop.is_set():
                    return False
            if self._stop.is_set():
                return False
            self._ready.put(self._pool.submit(self._fetch, tgb, step, delta.version))
        return True

    def _check_layout(self, tgb: TGBDescriptor, version: int, step: int) -> None:
        if (tgb.dp, tgb.cp) != (self._mesh.dp, self._mesh.cp):
            raise LayoutError(
                f"{self._url}: step {step} (log version {version}) has dp={tgb.dp} cp={tgb.cp} slices, "
                f"this consumer reads dp={self._mesh.dp} cp={self._mesh.cp}"
            )

    def _fetch(self, tgb: TGBDescriptor, step: int, version: int) -> Batch:
        obj, offset, length, crc = tgb.slices[self._slice]
        key = tgb.objects[obj]
        try:
            data = self._store.get_range(key, offset, length)
        except StoreError:
            size = self._store.size(key)
            if size is not None and size < offset + length:
                raise CorruptDataError(
                    key, f"truncated to {size} bytes; slice {self._slice} ends at {offset + length}"
                ) from None
            raise
        if len(data) != length:
            raise CorruptDataError(
                key, f"truncated: slice {self._slice} wants {length} bytes at {offset}, got {len(data)}"
            )
        return Batch(step=step, data=decode_slice(data, key, crc), version=version)
