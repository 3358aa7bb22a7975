"""The plain model a simulated run is checked against, and the checks (docs/invariants.md).

The *genuine log* is the chain of first creations of ``_log/<n>.json``: the store tells
the model of every write as it is applied, and any later creation of the same key (after
garbage collection deleted it) is a re-creation by a stale writer, never part of the log.
From the genuine log the model knows, per step, which producer's TGB at which offset it
holds; payloads are a pure function of (producer, offset, slice) (``payload``), so a
delivered step is checked byte for byte. The checks, each reporting which actor did what
and what the model says instead:

- (a) a consumer delivers exactly the genuine log's step (I1, I2, I6, I10);
- (b) a producer never believes more is committed than the genuine log records, and a
  returned ``flush()`` is in the genuine log (I3, I10);
- (c) per producer, the genuine log's offsets are dense and once; versions and steps
  follow each other (I2, I3, I8);
- (d) nothing a live complete checkpoint reaches is deleted: the objects of its steps,
  the versions from its cursor's on (I4);
- (e) at the end every consumer reached the end of the stream or raised a typed error,
  and no actor waits forever;
- (f) a resumed consumer continues exactly at its cursor;
- (g) no actor deletes or rewrites a key of the other namespace that lies inside this
  one (``foreign``: planted before the run, ``actors.plant_inner_namespace``): an actor
  acts only on keys it can prove are its own namespace's (I13).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from batchweave import keys, log, logrules
from batchweave.errors import CorruptDataError
from batchweave.lifecycle.watermarks import Watermark
from batchweave.log import LogState, LogVersion, TGBDescriptor

__all__ = ["Model", "Violation", "payload"]

VERSION_KEY = re.compile(re.escape(keys.LOG_PREFIX) + r"(\d{20})\.json")  # a log version's key; group 1: its number
_MARK_KEY = re.compile(re.escape(keys.CHECKPOINT_PREFIX) + r"([^/]+)/(\d+)-(\d+)\.json")
_RELEASED_KEY = re.compile(re.escape(keys.CHECKPOINT_PREFIX) + r"([^/]+)/_released")


def payload(producer_id: str, offset: int, index: int) -> bytes:
    """Slice ``index`` of the TGB ``producer_id`` produces at ``offset``: the same bytes
    from every incarnation, so a restart re-appends exactly what it lost."""
    return f"{producer_id}@{offset}#{index}".encode()


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str  # a short name: the shrinker keeps a run failing with the same kind
    actor: str
    message: str
    time: float

    def __str__(self) -> str:
        return f"[{self.kind}] {self.actor} at t={self.time:.2f}: {self.message}"


class Model:
    """What the store's history says must be true; see the module doc."""

    def __init__(self, dp: int, now) -> None:
        self.dp = dp
        self._now = now  # the virtual clock, for violation times
        self.genuine_bytes: dict[int, bytes] = {}  # version -> its first creation
        self.steps: list[TGBDescriptor] = []  # the genuine log's TGBs, by step
        self.offsets: dict[str, int] = {}  # producer -> next offset in the genuine log
        self.epochs: dict[str, int] = {}  # producer -> newest epoch the genuine log claimed
        self.ended = False
        self.states: dict[int, LogState] = {0: LogState()}  # genuine state after each version
        self.recreations: list[tuple[int, str]] = []  # (version, by whom)
        self.stale_reads: dict[str, list[int]] = {}  # actor -> re-created versions it read
        self._object_step: dict[str, int] = {}  # data object -> the genuine step it holds
        self._marks: dict[str, dict[tuple[int, int], Watermark]] = {}
        self._released: set[str] = set()
        self.violations: list[Violation] = []
        self._reported: set[tuple[str, str]] = set()
        self.foreign: dict[str, bytes] = {}  # key -> bytes: the namespace inside this one (g)

    def violation(self, kind: str, actor: str, message: str) -> None:
        if (kind, actor) not in self._reported:  # once per actor and kind: no flood of the same
            self._reported.add((kind, actor))
            self.violations.append(Violation(kind, actor, message, self._now()))

    # -- told by the store -------------------------------------------------------------

    def written(self, key: str, body: bytes, actor: str) -> None:
        if key in self.foreign:
            self.violation("foreign-rewritten", actor, f"wrote {key}, a key of the namespace inside this one (I13)")
        if match := VERSION_KEY.fullmatch(key):
            version = int(match[1])
            if version in self.genuine_bytes:
                self.recreations.append((version, actor))
            else:
                self._genuine(version, body, actor)
        elif match := _MARK_KEY.fullmatch(key):
            try:
                mark = Watermark.from_json(body, key)
            except CorruptDataError:
                return  # a damaged mark counts as what it was before
            self._marks.setdefault(match[1], {})[(int(match[2]), int(match[3]))] = mark
        elif match := _RELEASED_KEY.fullmatch(key):
            self._released.add(match[1])

    def _genuine(self, version: int, body: bytes, actor: str) -> None:
        self.genuine_bytes[version] = body
        if version != len(self.genuine_bytes):
            self.violation("log-gap", actor, f"created version {version} first, before version {version - 1} existed")
            return
        try:
            delta = log.decode_version(body, keys.version_key(version), version)
        except CorruptDataError as exc:
            self.violation("damaged-version", actor, f"the first creation of version {version} is damaged: {exc}")
            return
        self._follow(delta, actor)
        try:  # the genuine state after each version: what a stale writer at that view builds on
            self.states[version] = logrules.apply_version(self.states[version - 1], delta, keys.version_key(version))
        except (CorruptDataError, KeyError):
            pass  # reported above in plain terms

    def _follow(self, delta: LogVersion, actor: str) -> None:
        """(c): the genuine log, checked with plain arithmetic rather than ``logrules.apply_version``."""
        where = f"version {delta.version}"
        if delta.first_step != len(self.steps):
            self.violation(
                "steps-not-dense", actor, f"{where} starts at step {delta.first_step}, the log has {len(self.steps)}"
            )
        if self.ended and delta.tgbs:
            self.violation("after-end", actor, f"{where} commits {len(delta.tgbs)} TGB(s) after the end of the stream")
        for tgb in delta.tgbs:
            expected = self.offsets.get(tgb.producer, 0)
            if tgb.source_offset != expected:
                self.violation(
                    "offsets-not-dense",
                    actor,
                    f"{where} commits {tgb.producer}@{tgb.source_offset}, the genuine log's next offset of "
                    f"{tgb.producer} is {expected}",
                )
            self.offsets[tgb.producer] = max(expected, tgb.source_offset + 1)
            for key in tgb.objects:
                self._object_step[key] = len(self.steps)
            self.steps.append(tgb)
        for producer, state in delta.producers.items():
            self.epochs[producer] = max(self.epochs.get(producer, 0), state.epoch)
        self.ended = self.ended or delta.end_of_stream

    def deleting(self, key: str, body: bytes, actor: str) -> None:
        """(d) and (g), as each delete is applied."""
        if key in self.foreign:
            self.violation(
                "deleted-foreign", actor, f"deleted {key}, a key of the namespace inside this one, not its own (I13)"
            )
        live = self._live_checkpoints()
        if not live:
            return
        position = min(min(m.position for m in marks) for marks in live.values())
        version = min(min(m.version for m in marks) for marks in live.values())
        step = self._object_step.get(key)
        if step is not None and step >= position:
            self.violation(
                "deleted-reachable",
                actor,
                f"deleted {key} of step {step}, which a live checkpoint reaches (W_global position {position})",
            )
        if match := VERSION_KEY.fullmatch(key):
            number = int(match[1])
            if number >= max(version, 1) and self.genuine_bytes.get(number) == body:
                self.violation(
                    "deleted-reachable",
                    actor,
                    f"deleted log version {number}, which the cursor of a live checkpoint needs (version {version})",
                )

    def _live_checkpoints(self) -> dict[str, list[Watermark]]:
        live = {}
        for checkpoint, marks in self._marks.items():
            if checkpoint in self._released or not marks:
                continue
            dp, cp = next(iter(marks.values())).dp, next(iter(marks.values())).cp
            if len(marks) == dp * cp:
                live[checkpoint] = list(marks.values())
        return live

    # -- told by the actors ------------------------------------------------------------

    def delivered(self, actor: str, rank: int, step: int, data: object) -> None:
        """(a): a consumer handed out ``data`` as ``step`` for slice ``rank``."""
        if step >= len(self.steps):
            self.violation("wrong-step", actor, f"delivered step {step}, the genuine log has {len(self.steps)} steps")
            return
        tgb = self.steps[step]
        expected = payload(tgb.producer, tgb.source_offset, rank)
        if data != expected:
            self.violation(
                "wrong-step",
                actor,
                f"delivered {data!r} as step {step} (rank {rank}), the genuine log's step {step} is "
                f"{tgb.producer}@{tgb.source_offset}: {expected!r}",
            )

    def believed(self, actor: str, producer_id: str, offset: int) -> None:
        """(b): a producer's view of its own committed offset."""
        genuine = self.offsets.get(producer_id, 0)
        if offset > genuine:
            self.violation(
                "producer-ahead",
                actor,
                f"believes {producer_id} is committed up to offset {offset}, the genuine log records {genuine}: "
                f"offsets {genuine}..{offset - 1} are lost",
            )

    def flushed(self, actor: str, producer_id: str, target: int) -> None:
        """(b): ``flush()`` returned, so every offset below ``target`` is in the genuine log."""
        genuine = self.offsets.get(producer_id, 0)
        if genuine < target:
            self.violation(
                "flush-lost",
                actor,
                f"flush() returned with offsets up to {target - 1} appended, the genuine log holds {producer_id} "
                f"up to {genuine - 1}",
            )

    def read(self, key: str, body: bytes, actor: str) -> None:
        """An actor read ``key``: note it if that was a stale writer's re-created version."""
        if (match := VERSION_KEY.fullmatch(key)) and body != self.genuine_bytes.get(int(match[1])):
            self.stale_reads.setdefault(actor, []).append(int(match[1]))

    def stale_error(self, actor: str, exc: BaseException) -> bool:
        """Report ``exc`` as a stale read if ``actor`` had read a re-created version (I10:
        reload or a typed error that says so, never a verdict on content nobody proved)."""
        versions = self.stale_reads.get(actor)
        if not versions:
            return False
        self.violation(
            "stale-read",
            actor,
            f"read version(s) {sorted(set(versions))} while a stale writer's re-creation sat in the freed key, "
            f"then raised {type(exc).__name__}: {exc}",
        )
        return True

    def position(self, checkpoint: str) -> Fraction | None:
        marks = self._marks.get(checkpoint)
        return min(m.position for m in marks.values()) if marks else None
