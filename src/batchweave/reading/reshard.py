"""Resuming on a different mesh: which TGB slice each rank reads. Pure.

TGBs are written for one DP/CP layout ``(D, C)``: TGB ``n`` is committed step ``n``
and holds ``D * C`` slices, slice ``(d, c)`` at index ``d * C + c``. A consumer whose
mesh has ``dp=D'``, ``cp=C'`` remaps locally instead of rewriting data (paper,
"Topology reconfiguration"); a *logical step* is one optimizer step of that mesh.

- TP/PP changes move nothing: ranks recompute ``(d, c)`` through ``Mesh.coords``.
- DP grows k-fold: a logical step reads k consecutive TGBs. When the stream ends after a
  count of TGBs that is not a multiple of k, the last ones make no whole step and are not
  delivered (``leftover``): a step of k TGBs read by only some of the replicas would not
  be one step of the mesh.
- DP shrinks k-fold: one TGB spans k logical steps, each reading a disjoint 1/k of its
  replicas.
- CP shrinks k-fold: a rank reads k adjacent slices (one range read) and concatenates
  them along the sequence axis.
- CP grows k-fold: k ranks share a slice and each keeps one of k equal pieces along the
  sequence axis; raw bytes have no such axis, so that needs array payloads.

Cursor positions count TGBs consumed as exact ``Fraction`` values, because a run with
a shrunk DP can stop part-way through a TGB (at ``n + j/k``); floats would make
``step_at`` guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from batchweave.errors import ConfigError, LayoutError
from batchweave.mesh import Mesh

__all__ = ["PAYLOAD_KINDS", "Reshard", "SliceRead"]

PAYLOAD_KINDS = ("arrays", "bytes")


@dataclass(frozen=True, slots=True)
class SliceRead:
    """What one rank reads at one logical step: one range read of contiguous slices.

    ``first_slice .. first_slice + count - 1`` of TGB ``tgb`` (``count > 1`` only when CP
    shrank; concatenate them along the sequence axis). When CP grew, keep piece ``piece``
    of ``pieces`` equal pieces along the sequence axis; ``pieces == 1`` means the whole
    slice.
    """

    tgb: int
    first_slice: int
    count: int
    piece: int = 0
    pieces: int = 1


@dataclass(frozen=True, slots=True)
class Reshard:
    """Maps a consumer's ``mesh`` onto TGBs written with ``layout_dp`` x ``layout_cp`` slices.

    ``kind`` is the payload kind of the slices, ``"arrays"`` or ``"bytes"``; only arrays
    can be split when CP grows.
    """

    layout_dp: int
    layout_cp: int
    mesh: Mesh
    kind: str = "arrays"

    def __post_init__(self) -> None:
        for name in ("layout_dp", "layout_cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.mesh, Mesh):
            raise ConfigError(f"mesh must be a Mesh, got {type(self.mesh).__name__}")
        if self.kind not in PAYLOAD_KINDS:
            raise ConfigError(f"kind={self.kind!r} must be one of {', '.join(PAYLOAD_KINDS)}")
        for axis, old, new in (("dp", self.layout_dp, self.mesh.dp), ("cp", self.layout_cp, self.mesh.cp)):
            if old % new and new % old:
                raise LayoutError(
                    f"cannot reshard TGBs written with {self._layout_text()} onto {self._mesh_text()}: "
                    f"{axis} must change by an integral factor, and neither of {old} and {new} divides the other"
                )
        if self.mesh.cp > self.layout_cp and self.kind == "bytes":
            raise LayoutError(
                f"cannot grow cp from {self.layout_cp} to {self.mesh.cp}: each rank would need "
                f"1/{self.mesh.cp // self.layout_cp} of a slice along the sequence axis, and raw-bytes payloads "
                f"have none; resume with cp={self.layout_cp} (or a divisor of it), or write array payloads"
            )

    @property
    def identity(self) -> bool:
        """The mesh reads the TGBs as written: step ``t`` is TGB ``t``, one slice per rank."""
        return self.layout_dp == self.mesh.dp and self.layout_cp == self.mesh.cp

    @property
    def dp_grow(self) -> int:
        """TGBs per logical step (1 unless DP grew)."""
        return max(1, self.mesh.dp // self.layout_dp)

    @property
    def dp_shrink(self) -> int:
        """Logical steps per TGB (1 unless DP shrank)."""
        return max(1, self.layout_dp // self.mesh.dp)

    def whole_steps(self, tgbs: int) -> int:
        """Logical steps that the first ``tgbs`` TGBs fill entirely (after DP grew k-fold a
        step needs k TGBs)."""
        return tgbs * self.dp_shrink // self.dp_grow

    def leftover(self, tgbs: int) -> int:
        """TGBs among the first ``tgbs`` that no whole logical step reads: the trailing
        partial step that a stream ended there never delivers (``tgbs mod k`` after DP grew
        k-fold; 0 otherwise, since every other change reads each TGB in whole steps)."""
        return tgbs - int(self.position(self.whole_steps(tgbs)))

    def describe(self) -> str:
        """How this mesh reads the TGBs, in a line (what a consumer logs when reading starts)."""
        parts = []
        if self.dp_grow > 1:
            parts.append(f"{self.dp_grow} TGBs per step")
        if self.dp_shrink > 1:
            parts.append(f"each TGB spans {self.dp_shrink} steps, each of 1/{self.dp_shrink} of its replicas")
        if self.mesh.cp < self.layout_cp:
            parts.append(f"each rank joins {self.layout_cp // self.mesh.cp} adjacent slices along the sequence axis")
        if self.mesh.cp > self.layout_cp:
            k = self.mesh.cp // self.layout_cp
            parts.append(f"each rank keeps 1 of {k} pieces of a slice along the sequence axis")
        how = "; ".join(parts) or "one slice per rank, as written"
        return f"reading TGBs written for {self._layout_text()} as {self._mesh_text()}: {how}"

    def describe_leftover(self, tgbs: int, *, ahead: bool = False) -> str:
        """What ``leftover(tgbs)`` leaves out and why, for a warning at the end of a stream
        (or, ``ahead``, for an error before reading: "would not be read"); "" if nothing."""
        left = self.leftover(tgbs)
        if not left:
            return ""
        steps = self.whole_steps(tgbs)
        which = f"TGB {tgbs - 1}" if left == 1 else f"TGBs {tgbs - left}..{tgbs - 1}"
        after = f"after step {steps - 1}" if steps else "before step 0"
        fate = "would not be read" if ahead else ("is not delivered" if left == 1 else "are not delivered")
        return (
            f"{left} TGB{'s' if left > 1 else ''} {after} ({which}) {fate}: a step of {self._mesh_text()} reads "
            f"{self.dp_grow} TGBs written for {self._layout_text()}, and {tgbs} TGBs make {steps} whole "
            f"step{'s' if steps != 1 else ''}; to read every TGB, read with dp={self.layout_dp} as written (or a dp "
            f"that divides it), or end the stream after a multiple of {self.dp_grow} TGBs"
        )

    def read(self, rank: int, step: int) -> SliceRead:
        """The one range read ``rank`` makes at logical ``step``; ConfigError if ``rank`` is outside the mesh."""
        _check_step(step)
        if self.identity:
            return SliceRead(step, self.mesh.slice_index(rank), 1)
        coords = self.mesh.coords(rank)
        tgb, d = self._dp_source(coords.dp, step)
        c_first, count, piece, pieces = self._cp_source(coords.cp)
        return SliceRead(tgb, d * self.layout_cp + c_first, count, piece, pieces)

    def tgbs(self, step: int) -> range:
        """TGB indices that logical ``step`` touches, over all ranks."""
        _check_step(step)
        first = step * self.dp_grow // self.dp_shrink
        return range(first, first + self.dp_grow)

    def position(self, step: int) -> Fraction:
        """TGBs fully consumed before logical ``step`` starts (fractional when DP shrank)."""
        _check_step(step)
        return Fraction(step * self.dp_grow, self.dp_shrink)

    def step_at(self, position: Fraction | int) -> int:
        """The logical step that starts at ``position`` TGBs consumed; the inverse of ``position``.

        A position inside a logical step (say, a cursor saved by a mesh whose steps
        were finer) cannot be resumed without reading part of a step twice or not at
        all, so it is a LayoutError that names the step boundaries either side.
        """
        if isinstance(position, bool) or not isinstance(position, int | Fraction):
            raise ConfigError(f"position must be an int or Fraction of TGBs, got {position!r}")
        position = Fraction(position)
        if position < 0:
            raise LayoutError(f"TGB position {position} is negative; positions start at 0 (step 0)")
        exact = position * self.dp_shrink / self.dp_grow
        if exact.denominator == 1:
            return int(exact)
        before = exact.numerator // exact.denominator
        raise LayoutError(
            f"TGB position {position} falls inside logical step {before} ({self._span_text(before)}) of "
            f"{self._mesh_text()} over TGBs written with {self._layout_text()}; resume at step {before} "
            f"(position {self.position(before)}) or step {before + 1} (position {self.position(before + 1)})"
        )

    def _dp_source(self, d_new: int, step: int) -> tuple[int, int]:
        """(TGB, replica d within it) that replica ``d_new`` of the mesh reads at ``step``."""
        if self.dp_grow > 1:
            # Replicas fill TGB k*t first, then k*t + 1, ...: d_new // D picks the TGB.
            return step * self.dp_grow + d_new // self.layout_dp, d_new % self.layout_dp
        tgb, sub = divmod(step, self.dp_shrink)
        # Sub-step j takes replicas j*D' .. j*D' + D' - 1, so the k sub-steps tile the TGB.
        return tgb, sub * self.mesh.dp + d_new

    def _cp_source(self, c_new: int) -> tuple[int, int, int, int]:
        """(first c, slice count, piece, pieces) for CP rank ``c_new``."""
        if self.mesh.cp > self.layout_cp:
            k = self.mesh.cp // self.layout_cp
            return c_new // k, 1, c_new % k, k
        k = self.layout_cp // self.mesh.cp
        return c_new * k, k, 0, 1

    def _span_text(self, step: int) -> str:
        tgbs = self.tgbs(step)
        if self.dp_shrink > 1:
            return f"part {step % self.dp_shrink + 1} of {self.dp_shrink} of TGB {tgbs[0]}"
        if len(tgbs) == 1:
            return f"TGB {tgbs[0]}"
        return f"TGBs {tgbs[0]}..{tgbs[-1]}"

    def _mesh_text(self) -> str:
        return f"dp={self.mesh.dp}, cp={self.mesh.cp}"

    def _layout_text(self) -> str:
        return f"dp={self.layout_dp}, cp={self.layout_cp}"


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"logical step {step!r} must be a non-negative integer")
