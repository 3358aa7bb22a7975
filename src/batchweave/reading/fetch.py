"""Fetching one rank's bytes of a step: one range read of its slices, checked and decoded.

A step's slices are read by ``SliceFetcher`` from the store, or through the node's hub
(``reading.node``) when another rank of the node reads the same bytes; ``decode_slice``
checks each slice's CRC32C and returns arrays that view the read buffer. After a change of
mesh (``reading.reshard``) a step may read several adjacent slices and join them, or one
piece of a slice. Where the ranges of consecutive steps lie back to back in one object
(a producer's pack of TGBs), the fetcher reads them with one request (``reading.runs``),
once the pipeline said which ranges are coming (``expect``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

import numpy as np

from batchweave.errors import (
    CorruptDataError,
    DataReclaimedError,
    LayoutError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from batchweave.journal import Journal
from batchweave.layout import decode_slice
from batchweave.log import LogVersion, TGBDescriptor
from batchweave.metrics import FetchRecorder
from batchweave.reading.nodeclient import NodeUnavailableError
from batchweave.reading.reshard import SliceRead
from batchweave.reading.runs import RangeRuns
from batchweave.store import Store

__all__ = ["Batch", "NodeReads", "SliceFetcher", "step_bytes"]


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's data for this rank: ``data`` is a dict of numpy arrays, or bytes."""

    step: int
    data: dict[str, np.ndarray] | bytes
    version: int  # the log version that committed the last TGB this step touches

    @property
    def nbytes(self) -> int:
        """The payload's bytes."""
        data = self.data
        return len(data) if isinstance(data, bytes) else sum(array.nbytes for array in data.values())


class NodeReads(Protocol):
    """What the fetcher asks of a node's hub: one read per slice for the whole node."""

    def read(self, key: str, start: int, length: int) -> memoryview: ...


class SliceFetcher:
    """Reads and decodes this rank's slices of the steps it is given (see the module doc).

    Args:
        store: the namespace's store.
        journal: the reader's journal: a slice gone from the store is looked up in the
            newest state (was it garbage-collected under a slow reader?).
        slice_index: the slice this rank reads of a TGB written for its own mesh.
        sequence_axis: the axis slices are joined along (CP shrank) or split along (grew).
        fetches: where each fetch's latency is recorded.
        start: the cursor's position, for the message of a DataReclaimedError.
        node: the node's hub, when another rank of the node reads the same slices.
        runs: where the reads of expected back-to-back ranges are joined (None: every
            range is read on its own).
    """

    def __init__(
        self,
        store: Store,
        journal: Journal[LogVersion],
        *,
        slice_index: int,
        sequence_axis: int,
        fetches: FetchRecorder,
        start: Fraction | int,
        node: NodeReads | None = None,
        runs: RangeRuns | None = None,
    ) -> None:
        self._store = store
        self._journal = journal
        self._slice = slice_index
        self._axis = sequence_axis
        self._fetches = fetches
        self._start = start
        self._node = node
        self._runs = runs

    def expect(self, tgb: TGBDescriptor, read: SliceRead) -> bool:
        """A step that will be fetched (steps are expected in step order, before their
        fetch starts): its ranges may join those of the steps before it in one read.
        True when the step's one range joined the run of an earlier step's: that step's
        read brings this one's bytes, and this step's fetch only takes them."""
        if self._runs is None:
            return False
        groups = _back_to_back(tgb, range(read.first_slice, read.first_slice + read.count))
        joined = [self._runs.expect(*_span(tgb, group)) for group in groups]
        return joined == [True]

    def read_bytes(self, tgb: TGBDescriptor, read: SliceRead) -> int:
        """The bytes a step's fetch reads: with runs, all of its run's (the steps that
        joined it take theirs from that read)."""
        groups = _back_to_back(tgb, range(read.first_slice, read.first_slice + read.count))
        if self._runs is None:
            return sum(_span(tgb, group)[2] for group in groups)
        return sum(self._runs.span(*_span(tgb, group)) for group in groups)

    def close(self) -> None:
        """No more steps will be fetched: forget the ranges expected and not read."""
        if self._runs is not None:
            self._runs.close()

    def fetch(
        self,
        tgb: TGBDescriptor,
        read: SliceRead,
        step: int,
        version: int,
        position: Fraction | int,
        *,
        timed: bool = True,
    ) -> tuple[Batch, Fraction | int]:
        """Step ``step``: the slices ``read`` names, joined or cut to this rank's mesh.
        ``timed=False``: its latency is not a fetch's (a step that takes its bytes from
        an earlier step's read of a pack, which recorded that read's)."""
        indices = range(read.first_slice, read.first_slice + read.count)
        started = time.perf_counter()
        parts = [self._read_adjacent(tgb, group) for group in _back_to_back(tgb, indices)]
        if timed:
            self._fetches.record(time.perf_counter() - started)
        decoded = [item for run in parts for item in run]
        if any(isinstance(item, bytes) != (tgb.kind == "bytes") for item in decoded):
            raise CorruptDataError(tgb.objects[0], f"a slice's payload kind is not the log's {tgb.kind!r}")
        data = decoded[0] if len(decoded) == 1 else _concat(decoded, self._axis, tgb.objects[0])
        if read.pieces > 1:
            data = _piece(data, read.piece, read.pieces, self._axis, tgb.objects[tgb.slices[read.first_slice][0]])
        return Batch(step=step, data=data, version=version), position

    def fetch_as_written(self, tgb: TGBDescriptor, step: int, version: int, *, timed: bool = True) -> tuple[Batch, int]:
        """``fetch`` of this rank's one slice of TGB ``step`` (the mesh the TGBs were
        written for: none of the reshard arithmetic, which costs more than a local read)."""
        obj, offset, length, crc = tgb.slices[self._slice]
        key = tgb.objects[obj]
        started = time.perf_counter()
        data = decode_slice(self._range(key, offset, length), key, crc)
        if timed:
            self._fetches.record(time.perf_counter() - started)
        if isinstance(data, bytes) != (tgb.kind == "bytes"):
            raise CorruptDataError(key, f"a slice's payload kind is not the log's {tgb.kind!r}")
        return Batch(step=step, data=data, version=version), step + 1

    def _read_adjacent(self, tgb: TGBDescriptor, indices: list[int]) -> list[Any]:
        """Decode slices that sit back to back in one object, with one range read."""
        key, start, length = _span(tgb, indices)
        buf = self._range(key, start, length)
        out = []
        for i in indices:
            _, offset, length, crc = tgb.slices[i]
            out.append(decode_slice(buf[offset - start : offset - start + length], key, crc))
        return out

    def _read(self, key: str, start: int, length: int) -> memoryview:
        """A piece of its run's read if the range was expected, else a read of its own."""
        if self._runs is None:
            return self._read_through(key, start, length)
        return self._runs.read(key, start, length, self._read_through)

    def _read_through(self, key: str, start: int, length: int) -> memoryview:
        """Through the node's hub (one read per range per node), else from the store."""
        if self._node is not None:
            try:
                return self._node.read(key, start, length)
            except NodeUnavailableError:
                pass  # read on our own
        return self._store.get_range(key, start, length)

    def _range(self, key: str, start: int, length: int) -> memoryview:
        try:
            data = self._read(key, start, length)
        except ObjectNotFoundError:
            reclaimed = self._journal.load_state().reclaimed
            if math.floor(self._start) < reclaimed.steps:
                raise DataReclaimedError(self._store.url, math.floor(self._start), reclaimed.steps) from None
            raise
        except TransientStoreError:
            raise  # retried until the deadline already: asking for its size would wait as long again
        except StoreError:
            size = self._store.size(key)
            if size is not None and size < start + length:
                raise CorruptDataError(key, f"truncated to {size} bytes; the slice ends at {start + length}") from None
            raise
        if len(data) != length:
            raise CorruptDataError(key, f"truncated: wanted {length} bytes at {start}, got {len(data)}")
        return data


def step_bytes(tgb: TGBDescriptor, read: SliceRead) -> int:
    """Bytes of the slices one step's read covers on this rank."""
    return sum(tgb.slices[i][2] for i in range(read.first_slice, read.first_slice + read.count))


def _back_to_back(tgb: TGBDescriptor, indices: range) -> list[list[int]]:
    """Split consecutive slice indices where the next slice does not start, in the same
    object, where the one before it ends (the next object; or, in a pack of TGBs, the
    same slice of the next TGB lies between them)."""
    groups: list[list[int]] = []
    for i in indices:
        if groups and _follows(tgb.slices[groups[-1][-1]], tgb.slices[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _follows(before: tuple[int, int, int, int], after: tuple[int, int, int, int]) -> bool:
    return before[0] == after[0] and before[1] + before[2] == after[1]


def _span(tgb: TGBDescriptor, indices: list[int]) -> tuple[str, int, int]:
    """The object key, start and length of back-to-back slices."""
    obj, start, _, _ = tgb.slices[indices[0]]
    _, last, length, _ = tgb.slices[indices[-1]]
    return tgb.objects[obj], start, last + length - start


def _concat(parts: list[Any], axis: int, key: str) -> Any:
    """CP shrank: join adjacent slices along the sequence axis (bytes end to end)."""
    if isinstance(parts[0], bytes):
        return b"".join(parts)
    try:
        return {name: np.concatenate([p[name] for p in parts], axis=axis) for name in parts[0]}
    except (ValueError, np.exceptions.AxisError) as exc:
        raise LayoutError(f"{key}: cannot join CP slices along axis {axis}: {exc}") from exc


def _piece(data: Any, piece: int, pieces: int, axis: int, key: str) -> Any:
    """CP grew: this rank's equal piece of every array along the sequence axis (a view)."""
    out = {}
    for name, array in data.items():
        if array.ndim == 0 or array.shape[axis] % pieces:
            raise LayoutError(
                f"{key}: array {name!r} of shape {array.shape} cannot be split into {pieces} equal pieces "
                f"along axis {axis} for cp growth"
            )
        out[name] = np.split(array, pieces, axis=axis)[piece]
    return out
