"""Scheduling steps: which step this rank reads next, and what, from the proven log. Pure.

``StepPlan`` takes the log versions a reader has proven (``take``), checks that each
continues the log, and keeps the descriptors of the TGBs no step has read yet. A step is
ready once every TGB it touches is committed (after a DP growth a step reads several);
``next_read`` names it and ``advance`` moves on. The pipeline (``reading.pipeline``)
decides when to fetch; this module only decides what.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

from batchweave import keys, logrules
from batchweave.errors import CorruptDataError, LayoutError
from batchweave.log import LogVersion, TGBDescriptor
from batchweave.mesh import Mesh
from batchweave.reading.cursor import Cursor
from batchweave.reading.reshard import Reshard, SliceRead

__all__ = ["PlannedStep", "StepPlan"]


class PlannedStep(NamedTuple):
    """One step ready to fetch: ``read`` of ``tgb``; the cursor moves to ``position``."""

    step: int
    tgb: TGBDescriptor
    read: SliceRead
    version: int  # the log version that committed the last TGB the step touches
    position: Fraction | int  # TGBs consumed once the step is delivered
    as_written: bool  # the mesh reads the TGBs as written: one slice of TGB ``step``


class StepPlan:
    """The steps of one rank, in order, from ``start`` TGBs consumed (see the module doc).

    Args:
        mesh, rank, slice_index: the consumer's mesh, its rank and the slice it reads of a
            TGB written for that mesh.
        cursor: where the rank starts.
        url: the namespace, for messages.
    """

    def __init__(self, mesh: Mesh, rank: int, slice_index: int, cursor: Cursor, url: str) -> None:
        self._mesh = mesh
        self._rank = rank
        self._slice = slice_index
        self._start = start = cursor.position
        self._url = url
        self.next_step = cursor.step  # counted on this mesh once the first TGB shows the layout
        self.head_version = cursor.version  # the newest version taken
        self.tgbs_seen = 0  # TGBs the log has shown (the newest version taken ends there)
        self.namespace = cursor.namespace  # learned from version 1 when the cursor is at the start
        self._reshard: Reshard | None = None  # known once the first TGB shows the layout
        self._known: dict[int, tuple[TGBDescriptor, int]] = {}  # TGB index -> (descriptor, version)
        self._forgotten = math.floor(start)  # indices below this were dropped from _known
        self._expected_step: int | None = None  # the first step of the next version
        self._offsets: dict[str, tuple[int, int]] = {}  # producer -> (epoch, next offset), as read

    @property
    def reshard(self) -> Reshard | None:
        """How this mesh reads the TGBs; None until the first TGB showed their layout."""
        return self._reshard

    @property
    def unscheduled(self) -> int:
        """TGBs taken from the log that no scheduled step has read yet."""
        return len(self._known)

    @property
    def first_needed(self) -> int:
        """The first TGB this reader still needs (for DataReclaimedError's message)."""
        start = math.floor(self._start)
        return max(self._expected_step if self._expected_step is not None else start, start)

    def take(self, delta: LogVersion) -> None:
        """Use one proven version: check that it continues the log, remember its TGBs."""
        version = delta.version
        self.head_version = version
        if delta.namespace:  # version 1: a cursor from the start learns its namespace here
            self.namespace = delta.namespace
        if self._expected_step is not None and delta.first_step != self._expected_step:
            raise CorruptDataError(
                keys.version_key(version), f"first step {delta.first_step}, expected {self._expected_step}"
            )
        self._expected_step = self.tgbs_seen = delta.first_step + len(delta.tgbs)
        logrules.check_continuity(self._offsets, delta, keys.version_key(version))
        first_needed = math.floor(self._start)
        for index, tgb in zip(delta.steps(), delta.tgbs, strict=True):
            if index >= first_needed:
                self._check_layout(tgb, version, index)
                self._known[index] = (tgb, version)

    def next_read(self) -> PlannedStep | None:
        """The next step, once every TGB it touches is committed; else None."""
        return self.read_at(self.next_step)

    def read_at(self, step: int) -> PlannedStep | None:
        """Step ``step`` (not before the next one), once every TGB it touches is
        committed; else None. Steps become ready in order: if one is not, no later one is."""
        reshard = self._reshard
        if reshard is None:
            return None
        if reshard.identity:  # the usual case, kept to a dict lookup
            known = self._known.get(step)
            if known is None:
                return None
            return PlannedStep(step, known[0], SliceRead(step, self._slice, 1), known[1], step + 1, True)
        needed = reshard.tgbs(step)
        if needed[-1] not in self._known:
            return None
        read = reshard.read(self._rank, step)
        position = reshard.position(step + 1)
        return PlannedStep(step, self._known[read.tgb][0], read, self._known[needed[-1]][1], position, False)

    def advance(self) -> None:
        """The step ``next_read`` named is scheduled: drop the TGBs no later step touches
        (steps only move forward, so each is dropped once: O(1) per step)."""
        assert self._reshard is not None
        self.next_step += 1
        if self._reshard.identity:
            del self._known[self.next_step - 1]
            self._forgotten = self.next_step
            return
        first_needed = self._reshard.tgbs(self.next_step)[0]
        for index in range(self._forgotten, first_needed):
            self._known.pop(index, None)
        self._forgotten = max(self._forgotten, first_needed)

    def _check_layout(self, tgb: TGBDescriptor, version: int, index: int) -> None:
        if self._reshard is None:
            self._reshard = Reshard(tgb.dp, tgb.cp, self._mesh, tgb.kind)
            self.next_step = self._reshard.step_at(self._start)
        elif (tgb.dp, tgb.cp, tgb.kind) != (self._reshard.layout_dp, self._reshard.layout_cp, self._reshard.kind):
            raise LayoutError(
                f"{self._url}: step {index} (log version {version}) has dp={tgb.dp} cp={tgb.cp} {tgb.kind} slices, "
                f"earlier steps have dp={self._reshard.layout_dp} cp={self._reshard.layout_cp} {self._reshard.kind}"
            )
