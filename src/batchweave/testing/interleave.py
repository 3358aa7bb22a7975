"""A store that holds a chosen operation until the test lets it go: interleavings on demand.

    from batchweave.testing import Background, PausingStore

    store = PausingStore(url)
    gate = store.pause("put_if_absent", keys.LOG_PREFIX + r"\\d+\\.json")  # the next commit attempt
    gc = Background(collect_garbage, store)                # runs until it reaches the put
    gate.wait_reached()                                     # ... and is held there
    ...                                                     # anything else happens now
    gate.release(); gc.result()

A gate holds the first matching operation (optionally the n-th), once. The holding
thread waits at most ``HOLD_S`` seconds and then fails loudly, so a test that forgets to
release a gate ends with an error instead of hanging.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from batchweave import keys
from batchweave.errors import TransientStoreError
from batchweave.store import Store

__all__ = ["HOLD_S", "AmbiguousOnceStore", "Background", "Gate", "PausingStore", "wait_for_any"]

HOLD_S = 60.0  # seconds a held operation waits for its release before it fails
# The operations a gate of each kind holds: a "get" any read of the object.
_TAKEN_BY: dict[str, tuple[str, ...]] = {"get": ("get", "get_range")}


class Gate:
    """One pause point: ``wait_reached`` until an operation arrives, ``release`` it."""

    def __init__(self, op: str, key: str, skip: int) -> None:
        self.op = op
        self.pattern = re.compile(key)
        self.skip = skip  # matching operations to let through before holding one
        self.key: str | None = None  # the key of the held operation
        self._reached = threading.Event()
        self._released = threading.Event()

    def matches(self, op: str, key: str) -> bool:
        """Whether this gate takes operation ``op`` on ``key`` (called by the store, under its lock)."""
        if self.key is not None or op not in _TAKEN_BY.get(self.op, (self.op,)) or not self.pattern.fullmatch(key):
            return False
        if self.skip:
            self.skip -= 1
            return False
        self.key = key
        return True

    def hold(self) -> None:
        """Hold the calling thread here until ``release`` (at most ``HOLD_S`` seconds)."""
        self._reached.set()
        if not self._released.wait(HOLD_S):
            raise AssertionError(f"gate on {self.op} {self.key} was never released")

    @property
    def reached_event(self) -> threading.Event:
        """Set once an operation is held here (for :func:`wait_for_any`)."""
        return self._reached

    def wait_reached(self, timeout_s: float = 30.0) -> str:
        """Block until an operation is held here; returns its key."""
        if not self._reached.wait(timeout_s):
            raise AssertionError(f"no {self.op} on {self.pattern.pattern} within {timeout_s} s")
        assert self.key is not None
        return self.key

    @property
    def reached(self) -> bool:
        """Whether an operation is (or was) held here."""
        return self._reached.is_set()

    def release(self) -> None:
        """Let the held operation (or the next one to arrive) go on."""
        self._released.set()


class PausingStore(Store):
    """A real ``Store`` (any URL, options as for ``Store``) whose operations can be held at gates."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self._gates: list[Gate] = []
        self._lock = threading.Lock()

    def pause(self, op: str, key: str, *, skip: int = 0) -> Gate:
        """Hold the next ``op`` ("get", "put_if_absent", "put", "delete", "list", ...) on a key
        matching the regular expression ``key`` (after ``skip`` matching ones pass). "get"
        holds any read of the object, whole or ranged (a writer reads a log version's head
        with a ranged GET), "get_range" only a ranged one."""
        gate = Gate(op, key, skip)
        with self._lock:
            self._gates.append(gate)
        return gate

    def release_all(self) -> None:
        """Release every gate: a test's cleanup, so that no thread stays held."""
        with self._lock:
            for gate in self._gates:
                gate.release()

    def _gated(self, op: str, key: str) -> None:
        with self._lock:
            held = next((g for g in self._gates if g.matches(op, key)), None)
        if held is not None:
            held.hold()

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        self._gated("put_if_absent", key)
        super().put_if_absent(key, data)

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._gated("put", key)
        super().put(key, data)

    def delete(self, key: str) -> None:
        self._gated("delete", key)
        super().delete(key)

    def get(self, key: str) -> memoryview:
        self._gated("get", key)
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        self._gated("get_range", key)
        return super().get_range(key, start, length)

    def list(self, prefix: str = ""):
        self._gated("list", prefix)
        return super().list(prefix)


class AmbiguousOnceStore(Store):
    """A real ``Store`` that, once ``armed``, applies the next log-version put and then
    reports it as a timeout: the ambiguous outcome a writer must survive (its retry finds
    its own version, which may sit in a key garbage collection freed). ``fired`` is the
    key it happened to."""

    armed = False
    fired: str | None = None

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        super().put_if_absent(key, data)
        if self.armed and self.fired is None and key.startswith(keys.LOG_PREFIX + "0"):
            self.fired = key
            raise TransientStoreError(key, "simulated timeout after the write was applied")


class Background:
    """Run ``fn`` on a thread; ``result()`` joins it and returns or re-raises."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._value = fn(*args, **kwargs)
        except BaseException as exc:
            self._error = exc
        finally:
            self.finished.set()

    def result(self, timeout_s: float = 60.0) -> Any:
        """Join the thread (at most ``timeout_s`` seconds) and return ``fn``'s value or raise its error."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"still running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._value


def wait_for_any(*events: threading.Event, timeout_s: float = 30.0) -> None:
    """Block until one of ``events`` is set (a held gate, a finished thread, ...)."""
    deadline = time.monotonic() + timeout_s
    while not any(e.is_set() for e in events):
        if time.monotonic() > deadline:
            raise AssertionError(f"none of {len(events)} events within {timeout_s} s")
        events[0].wait(0.005)  # the first event wakes us at once; the others within 5 ms
