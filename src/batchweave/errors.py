"""Every error BatchWeave raises, under one root.

    BatchWeaveError
    ├── ConfigError (ValueError)            bad URL, bad mesh, bad argument
    │   └── NamespaceOverlapError           a new namespace inside another's prefix, or around one
    ├── LayoutError (ValueError)            wrong slice count, mixed layouts, unsupported payload
    │   └── SchemaError                     arrays unlike the namespace's schema (names, dtypes, shapes)
    ├── SourceOffsetError (ValueError)      append() offset that is not the next one
    ├── CorruptDataError (ValueError)       checksum or format damage; names the object key
    ├── ProducerFencedError                 a newer incarnation of this producer_id took over
    ├── ProducerClosedError (ValueError)    a call on a producer after close()
    ├── FlushTimeoutError (TimeoutError)    flush(timeout_s) ran out with TGBs uncommitted
    ├── PoolFailedError                     a pool's producer failed more often than it may restart
    ├── StreamEndedError                    the namespace was closed with end_stream()
    ├── StepTimeoutError (TimeoutError)     a consumer waited longer than its timeout_s
    ├── DataReclaimedError (LookupError)    a resume point whose data garbage collection deleted
    ├── CheckpointNotFoundError (LookupError)  release_checkpoint of a name no rank marked
    └── StoreError                          the object store said no
        ├── ObjectNotFoundError (FileNotFoundError)
        ├── ObjectExistsError (FileExistsError)   a create-only put lost the race
        ├── StorePermissionError (PermissionError)
        ├── TransientStoreError (ConnectionError) still failing at the retry deadline
        └── NotDurableError (OSError)             a local write's fsync failed: final

Each error also subclasses the matching built-in, so ``except FileNotFoundError``
keeps working for callers who do not know our names.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

__all__ = [
    "BatchWeaveError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptDataError",
    "DataReclaimedError",
    "FlushTimeoutError",
    "LayoutError",
    "NamespaceOverlapError",
    "NotDurableError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "PoolFailedError",
    "ProducerClosedError",
    "ProducerFencedError",
    "SchemaError",
    "SourceOffsetError",
    "StepTimeoutError",
    "StoreError",
    "StorePermissionError",
    "StreamEndedError",
    "TransientStoreError",
]


class BatchWeaveError(Exception):
    """Root of every error raised by BatchWeave."""


class ConfigError(BatchWeaveError, ValueError):
    """A URL, mesh size or argument that cannot work."""


class NamespaceOverlapError(ConfigError):
    """A namespace would be created inside another namespace's prefix, or around one
    (invariant I13: namespaces never nest). ``url`` is the one being created, ``other``
    the namespace in the way, ``inside`` whether ``url`` lies inside ``other`` (else
    ``other`` lies inside ``url``). Nothing was written."""

    def __init__(self, url: str, other: str, *, inside: bool) -> None:
        where = (
            f"it would lie inside the namespace at {other}" if inside else f"the namespace at {other} lies inside it"
        )
        super().__init__(
            f"cannot create a namespace at {url}: {where}. Namespaces must not nest: one's prefix inside "
            "another's mixes their objects, which neither's garbage collection could tell apart. Give each "
            "namespace a prefix of its own, side by side (s3://bucket/run-1 and s3://bucket/run-2, not "
            "s3://bucket and s3://bucket/run-1)"
        )
        self.url = url
        self.other = other
        self.inside = inside


class LayoutError(BatchWeaveError, ValueError):
    """A TGB whose slices do not fit the declared layout or payload rules."""


class SchemaError(LayoutError):
    """A TGB whose arrays differ from the namespace's schema (names, dtypes, shapes), or a
    producer whose declared schema does not match it. The message names the namespace's
    URL, the TGB, the array, what it is and what the schema says; nothing of it is written
    (or, when another producer's first commit fixed another schema first, it is not
    committed, and the producer stops)."""


class SourceOffsetError(BatchWeaveError, ValueError):
    """An ``append`` whose source offset is not the producer's next offset."""


class CorruptDataError(BatchWeaveError, ValueError):
    """An object whose bytes fail their checksum or cannot be decoded."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class ProducerFencedError(BatchWeaveError):
    """A newer incarnation of the same producer_id claimed a higher epoch."""


class ProducerClosedError(BatchWeaveError, ValueError):
    """A call on a producer after ``close()`` (a ValueError, as I/O on a closed file is)."""

    def __init__(self, producer_id: str) -> None:
        super().__init__(f"producer {producer_id!r} is closed: open a new Producer with the same id to go on")
        self.producer_id = producer_id


class FlushTimeoutError(BatchWeaveError, TimeoutError):
    """``Producer.flush(timeout_s)`` ran out before every TGB was committed. The TGBs stay
    pending, and a later flush or close commits them: nothing is lost."""

    def __init__(self, producer_id: str, timeout_s: float, uncommitted: int) -> None:
        super().__init__(
            f"producer {producer_id!r}: flush timed out after {timeout_s}s with {uncommitted} TGB(s) uncommitted "
            "(they stay pending: flush again, or close() to commit them)"
        )
        self.producer_id = producer_id
        self.timeout_s = timeout_s
        self.uncommitted = uncommitted


class PoolFailedError(BatchWeaveError):
    """A producer of a pool failed more often than ``max_restarts`` allows.

    ``attempts`` counts its runs; ``cause_type`` and ``cause`` are the last failure's
    exception type and message, as text (they come from another process; "" when the
    process died without saying why, e.g. killed); ``exit_code`` is the last process's
    exit code, where there was a process of ours to exit.
    """

    def __init__(
        self, pool: str, producer: str, attempts: int, cause_type: str, cause: str, *, detail: str = ""
    ) -> None:
        said = f": {cause_type}: {cause}" if cause_type else " (killed?)"
        super().__init__(f"pool {pool!r}: producer {producer} failed {attempts} times{detail}{said}")
        self.pool = pool
        self.producer = producer
        self.attempts = attempts
        self.cause_type = cause_type
        self.cause = cause


class StreamEndedError(BatchWeaveError):
    """The namespace has an end-of-stream marker; no TGB is accepted after it."""


class StepTimeoutError(BatchWeaveError, TimeoutError):
    """A consumer waited longer than its ``timeout_s`` for the next step."""


class DataReclaimedError(BatchWeaveError, LookupError):
    """A step below the oldest one garbage collection kept (no live checkpoint needed it)."""

    def __init__(self, url: str, step: int, oldest: int) -> None:
        super().__init__(
            f"{url}: step {step} was reclaimed by garbage collection (no live checkpoint needed it); "
            f"the oldest step still available is {oldest}: resume from a live checkpoint"
        )
        self.step = step
        self.oldest = oldest


class CheckpointNotFoundError(BatchWeaveError, LookupError):
    """``release_checkpoint`` of a checkpoint id that no rank marked in the namespace (a
    typo, or one released and already reclaimed by garbage collection). The message names
    the id, the namespace and the closest ids there are, or those not released.

    ``known`` holds every checkpoint id the namespace has, ``live`` those not released.
    """

    def __init__(self, url: str, checkpoint: str, known: Sequence[str], live: Sequence[str]) -> None:
        near = difflib.get_close_matches(checkpoint, known, n=3, cutoff=0.6)
        if near:
            hint = f"did you mean {' or '.join(repr(n) for n in near)}?"
        elif live:
            hint = f"its checkpoints not released are {_some(live)}"
        else:
            hint = "it holds no checkpoint that is not released"
        super().__init__(
            f"{url}: no checkpoint {checkpoint!r} to release (no rank marked it); {hint} "
            "(a released checkpoint is forgotten once garbage collection reclaimed it: "
            "pass missing_ok=True, or --missing-ok, to release ids that may be gone)"
        )
        self.url = url
        self.checkpoint = checkpoint
        self.known = tuple(known)
        self.live = tuple(live)


def _some(names: Sequence[str], at_most: int = 10) -> str:
    """``names`` quoted, the first ``at_most`` of them (a namespace may hold thousands)."""
    shown = ", ".join(repr(n) for n in names[:at_most])
    return shown if len(names) <= at_most else f"{shown} and {len(names) - at_most} more"


class StoreError(BatchWeaveError):
    """The object store refused or failed a request."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """No object at that key."""


class ObjectExistsError(StoreError, FileExistsError):
    """A create-only put found the key already taken.

    ``after_retry``: the put was retried after an attempt whose answer was lost (a
    timeout, a dropped connection), so the object may be that attempt's, this writer's
    own (``store.requests``); a writer that must know reads it.
    """

    after_retry: bool = False


class StorePermissionError(StoreError, PermissionError):
    """Credentials missing or not allowed to do this.

    ``action`` is the permission the refused request needs ("s3:PutObject",
    "storage.objects.delete"; "" when unknown); the message names it and the key.
    """

    def __init__(self, key: str, problem: str, *, action: str = "") -> None:
        super().__init__(key, problem)
        self.action = action


class TransientStoreError(StoreError, ConnectionError):
    """A request that kept failing with retryable errors (5xx, throttling, timeouts).

    ``retried_s`` is how long the store retried it before giving up (0 for one failure
    that was not retried).
    """

    def __init__(self, key: str, problem: str, *, retried_s: float = 0.0) -> None:
        super().__init__(key, problem)
        self.retried_s = retried_s


class NotDurableError(StoreError, OSError):
    """A local directory could not make an object durable (its fsync failed).

    Final for the store that wrote it: after a failed fsync the kernel may call the
    unwritten pages clean, so no later write of that store is trusted to survive a power
    loss. A producer stops at once; restart it (it writes its uncommitted TGBs again).
    """
