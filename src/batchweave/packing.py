"""Packing: which consecutive TGBs a producer writes together as one pack. Pure, no I/O.

A rank reads its slice of a step with one request. At 100 KB a slice and 25 ms a request,
that request, not the bytes, is what a reader pays for: 1,000 requests for 100 MB. A
producer that appends small TGBs therefore holds a few back and writes them as one pack
(``layout.encode_pack``): a rank's slices of all of them are one range, read with one
request. Holding a TGB back delays when it becomes visible, so a pack is written as soon
as any bound is reached:

- **steps**: ``pack_steps`` TGBs, or by default as many as keep a rank's run under
  ``PACK_RUN_BYTES`` (a 1 MiB read costs about what a 100 KB one does at 25 ms a request,
  and much more buys little) and the pack under ``PACK_MAX_BYTES`` (what the producer holds
  in memory), at most ``MAX_PACK_STEPS``;
- **time**: the oldest TGB held would pass ``pack_delay_s`` before the next append is
  expected (so a producer appending slower than that packs nothing and delays nothing).

TGBs of slices of ``PACK_RUN_BYTES`` and more are never held: each is its own pack of one,
laid out byte for byte as an unpacked TGB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchweave.errors import ConfigError
from batchweave.layout import FramedTGB

__all__ = [
    "DEFAULT_PACK_DELAY_S",
    "MAX_PACK_STEPS",
    "PACK_MAX_BYTES",
    "PACK_RUN_BYTES",
    "Held",
    "PackBuffer",
    "pack_limit",
]

PACK_RUN_BYTES = 1 << 20
PACK_MAX_BYTES = 64 << 20
# A pack's TGBs become visible together: 16 bounds how many steps one write holds back.
MAX_PACK_STEPS = 16
DEFAULT_PACK_DELAY_S = 1.0
# How much the newest gap between appends counts in the expected next one.
_GAP_WEIGHT = 0.3


def pack_limit(tgb: FramedTGB, pack_steps: int | None) -> int:
    """How many TGBs like ``tgb`` one pack holds: ``pack_steps`` when given, else by size."""
    if pack_steps is not None:
        return pack_steps
    by_run = PACK_RUN_BYTES // max(1, tgb.largest_slice)
    by_memory = PACK_MAX_BYTES // max(1, tgb.nbytes)
    return max(1, min(MAX_PACK_STEPS, by_run, by_memory))


def check_pack_options(pack_steps: int | None, pack_delay_s: float) -> None:
    if pack_steps is not None and (not isinstance(pack_steps, int) or isinstance(pack_steps, bool) or pack_steps < 1):
        raise ConfigError(f"pack_steps must be a positive number of TGBs or None (by size), got {pack_steps!r}")
    if not pack_delay_s >= 0:
        raise ConfigError(f"pack_delay_s must be zero or more seconds, got {pack_delay_s!r}")


@dataclass(frozen=True, slots=True)
class Held:
    """A TGB appended but not yet written: its source offset, slices and schema digest."""

    offset: int
    tgb: FramedTGB
    schema: str


@dataclass
class PackBuffer:
    """The TGBs a producer holds for its next pack, and when to write them (module doc)."""

    pack_delay_s: float = DEFAULT_PACK_DELAY_S
    held: list[Held] = field(default_factory=list)
    limit: int = 1  # the pack's size, set by its first TGB
    first_at: float = 0.0  # when the oldest held TGB was appended
    last_at: float | None = None  # when the last TGB was appended (held or not)
    gap_s: float = 0.0  # the expected time between appends
    generation: int = 0  # counts packs taken: a deadline set for an older pack is void

    def __len__(self) -> int:
        return len(self.held)

    def fits(self, limit: int) -> bool:
        """Whether one more TGB of pack size ``limit`` may join the held ones."""
        return not self.held or len(self.held) < min(self.limit, limit)

    def appended(self, now: float) -> None:
        """Note an append at ``now`` (held or not): it times the next one."""
        if self.last_at is not None:
            gap = max(0.0, now - self.last_at)
            self.gap_s = gap if self.gap_s == 0.0 else (1 - _GAP_WEIGHT) * self.gap_s + _GAP_WEIGHT * gap
        self.last_at = now

    def hold(self, held: Held, limit: int, now: float) -> None:
        if not self.held:
            self.limit, self.first_at = limit, now
        self.held.append(held)

    def due(self, now: float) -> bool:
        """Write now: the pack is full, or its oldest TGB would wait past the delay for the next."""
        if not self.held:
            return False
        return len(self.held) >= self.limit or now - self.first_at + self.gap_s >= self.pack_delay_s

    def deadline(self) -> float:
        """When the oldest held TGB has waited ``pack_delay_s`` (a stalled producer's bound)."""
        return self.first_at + self.pack_delay_s

    def take(self) -> list[Held]:
        taken, self.held = self.held, []
        self.generation += 1
        return taken

    def drop_last(self) -> None:
        """Un-hold the newest TGB (its append failed: the caller appends it again)."""
        self.held.pop()
