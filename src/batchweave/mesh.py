"""Device-mesh arithmetic: which slice a rank reads. Pure.

Rank order is ``pp, dp, cp, tp``, outermost first (Megatron-style), so
``rank = ((p * DP + d) * CP + c) * TP + t``. Only DP and CP change the data a rank
needs; all TP and PP ranks of one ``(d, c)`` read the same slice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from batchweave.errors import ConfigError

__all__ = ["Coords", "Mesh", "resolve_rank"]


@dataclass(frozen=True, slots=True)
class Coords:
    """One rank's position in the mesh."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True, slots=True)
class Mesh:
    """Parallelism degrees of a training job."""

    dp: int
    cp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"mesh size {name}={value!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def slices(self) -> int:
        """Slices per TGB: one per (dp, cp) position."""
        return self.dp * self.cp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the mesh {self} of world size {self.world_size}")
        rank, t = divmod(rank, self.tp)
        rank, c = divmod(rank, self.cp)
        p, d = divmod(rank, self.dp)
        return Coords(pp=p, dp=d, cp=c, tp=t)

    def rank(self, coords: Coords) -> int:
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        for name, size in sizes.items():
            if not 0 <= getattr(coords, name) < size:
                raise ConfigError(f"{coords} is outside the mesh {self}: {name} must be in 0..{size - 1}")
        return ((coords.pp * self.dp + coords.dp) * self.cp + coords.cp) * self.tp + coords.tp

    def slice_index(self, rank: int) -> int:
        """The TGB slice ``(d, c)`` that ``rank`` reads: ``d * cp + c``."""
        coords = self.coords(rank)
        return coords.dp * self.cp + coords.cp


def resolve_rank(rank: int | None, mesh: Mesh, environ: Mapping[str, str] | None = None) -> int:
    """``rank`` or torchrun's ``RANK``; checks ``WORLD_SIZE`` against the mesh when set."""
    environ = os.environ if environ is None else environ
    world = environ.get("WORLD_SIZE")
    if world is not None and world.strip():
        if not world.strip().isdigit() or int(world) != mesh.world_size:
            raise ConfigError(
                f"WORLD_SIZE={world} but dp*cp*tp*pp = {mesh.dp}*{mesh.cp}*{mesh.tp}*{mesh.pp} = {mesh.world_size}"
            )
    if rank is None:
        env_rank = environ.get("RANK")
        if env_rank is None:
            if mesh.world_size == 1:
                return 0
            raise ConfigError(
                f"no rank given and RANK is not set; pass rank= (0..{mesh.world_size - 1}) or run under torchrun"
            )
        if not env_rank.strip().isdigit():
            raise ConfigError(f"RANK={env_rank!r} is not a non-negative integer")
        rank = int(env_rank)
    mesh.coords(rank)  # validates the range
    return rank
