"""The simulated store: a ``Store`` over a dict, every operation a scheduling point.

Same interface and error types as the real store (``ObjectExistsError`` for a lost
create-only put, ``ObjectNotFoundError`` for a missing object, idempotent deletes,
modified times from the virtual clock). The calling actor suspends at every operation
until the scheduler lets it complete (``Scheduler.operation``); the model is told of
every creation and deletion as it is applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from batchweave.errors import ObjectExistsError, ObjectNotFoundError
from batchweave.store import ObjectInfo, Store
from batchweave.testing.simulation.scheduler import Op, Scheduler

if TYPE_CHECKING:
    from batchweave.testing.simulation.model import Model

__all__ = ["SimStore"]


class SimStore(Store):
    """Objects in ``objects`` (key -> (bytes, modified time)); see the module doc."""

    def __init__(self, scheduler: Scheduler, model: Model, head_copies: int = 0) -> None:
        super().__init__("memory://batchweave-simulation")  # never opened: every method is ours
        self.scheduler = scheduler
        self.model = model
        self.objects: dict[str, tuple[bytes, float]] = {}
        self._head_copies = head_copies
        # Called with (actor, key) as a get is applied, before it reads: a write that lands
        # just before a read (``actors.stale_writer_racing_reads``).
        self.before_get: Callable[[str, str], None] | None = None

    @property
    def head_copies(self) -> int:
        """Copies every committer writes of its version (inline: this store is not remote)."""
        return self._head_copies

    def __reduce__(self):  # a simulated store never leaves its run
        raise TypeError("SimStore is not picklable")

    def _op(self, name: str, key: str, apply):
        return self.scheduler.operation(Op(name, key, apply))

    def _actor_name(self) -> str:
        actor = self.scheduler.current
        return actor.name if actor is not None else "(crashed)"

    # -- writes ------------------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        body = bytes(data)

        def apply() -> None:
            if key in self.objects:
                raise ObjectExistsError(key, "already exists, the create-only put lost")
            self._write(key, body)

        self._op("put_if_absent", key, apply)

    def put(self, key: str, data: bytes | memoryview) -> None:
        body = bytes(data)
        self._op("put", key, lambda: self._write(key, body))

    def _write(self, key: str, body: bytes) -> None:
        self.objects[key] = (body, self.scheduler.clock.now)
        self.model.written(key, body, self._actor_name())

    def delete(self, key: str) -> None:
        def apply() -> None:
            if key in self.objects:
                self.model.deleting(key, self.objects[key][0], self._actor_name())
                del self.objects[key]

        self._op("delete", key, apply)

    # -- reads -------------------------------------------------------------------------

    def _body(self, key: str) -> bytes:
        found = self.objects.get(key)
        if found is None:
            raise ObjectNotFoundError(key, "no such object")
        return found[0]

    def get(self, key: str) -> memoryview:
        return self._op("get", key, lambda: memoryview(self._read(key)))

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        # A writer reads a log version's head so: a part of a re-created version is read too.
        return self._op("get_range", key, lambda: memoryview(self._read(key))[start : start + length])

    def _read(self, key: str) -> bytes:
        if self.before_get is not None:
            self.before_get(self._actor_name(), key)
        body = self._body(key)
        self.model.read(key, body, self._actor_name())
        return body

    def size(self, key: str) -> int | None:
        found = self._op("size", key, lambda: self.objects.get(key))
        return None if found is None else len(found[0])

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        def apply() -> list[ObjectInfo]:
            return [
                ObjectInfo(key, len(body), modified)
                for key, (body, modified) in sorted(self.objects.items())
                if key.startswith(prefix)
            ]

        return iter(self._op("list", prefix, apply))

    def list_keys_after(self, prefix: str, start_after: str, before: str) -> list[str]:
        def apply() -> list[str]:
            return sorted(key for key in self.objects if key.startswith(prefix) and start_after < key < before)

        return self._op("list", prefix, apply)

    def require_create_only(self) -> None:
        pass  # a dict honours create-only puts by construction

    # -- outside the schedule: the model and the damage actor peek without a turn -------

    def plant(self, key: str, body: bytes, actor: str) -> None:
        """``actor``'s write, applied now without a turn of its own (it lands just before
        the operation being applied); traced as a put."""
        self.scheduler.trace.append((self.scheduler.clock.elapsed, actor, "put", key))
        self.objects[key] = (body, self.scheduler.clock.now)
        self.model.written(key, body, actor)

    def plant_foreign(self, objects: dict[str, bytes], modified: float) -> None:
        """Objects of another namespace inside this one, written before the run (at
        ``modified``): in place at once, without a turn, and guarded by the model (no
        actor may delete or rewrite one, check (g))."""
        for key, body in objects.items():
            self.objects[key] = (body, modified)
            self.model.foreign[key] = body

    def peek(self, key: str) -> bytes | None:
        found = self.objects.get(key)
        return None if found is None else found[0]
