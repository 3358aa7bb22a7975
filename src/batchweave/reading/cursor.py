"""The reader's cursor: where a rank stands in the log, as saved with a checkpoint.

A cursor counts TGBs consumed (an exact fraction when a shrunk DP stops part-way through a
TGB), not steps, so a checkpoint taken on one mesh resumes on another. ``parse_cursor`` is
the one parser of saved cursors (every format ever written), ``checked_cursor`` checks one
against the namespace before a reader trusts it, and ``cursor_state`` is what
``Consumer.state_dict()`` saves. Pure, but for ``checked_cursor``'s reads through the
journal.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, NamedTuple

from batchweave import keys, log
from batchweave.errors import ConfigError, CorruptDataError, DataReclaimedError
from batchweave.journal import Journal
from batchweave.log import LogState, LogVersion
from batchweave.mesh import Mesh

__all__ = ["CURSOR_FORMAT", "Cursor", "checked_cursor", "cursor_state", "parse_cursor"]

# The cursor of Consumer.state_dict() and TGBDataset.state_dict(): flat, under constant
# keys, ints and strings only, so torch.distributed.checkpoint saves and loads it in place.
# /1 had two shapes (Consumer: "position": [n, d]; TGBDataset: flat, as /2 is); both load.
CURSOR_FORMAT = "batchweave.cursor/2"
_CURSOR_FORMATS = (CURSOR_FORMAT, "batchweave.cursor/1")
_CURSOR_FIELDS = ("format", "version", "position_numerator", "position_denominator", "step", "dp", "cp")
_CURSOR_V1_FIELDS = ("format", "version", "position", "step")


class Cursor(NamedTuple):  # a tuple: made once per step, and cheaper to make than a frozen dataclass
    version: int  # log version holding the last TGB the delivered steps touched (0 before any)
    position: Fraction | int  # TGBs consumed, the same on every rank whatever the mesh (an int when whole)
    step: int  # next logical step of this consumer's mesh (for messages; position rules)
    namespace: str = ""  # the namespace's id ("" until the log has been read)
    digest: str = ""  # of ``version``'s bytes, once checked against a proven state (never saved)


def parse_cursor(state: Any, mesh: Mesh) -> Cursor:
    """A saved cursor, its step recounted in ``mesh``'s steps: the one parser of cursors.

    Takes ``batchweave.cursor/2`` (what ``state_dict()`` gives) and both shapes of
    ``batchweave.cursor/1``: a ``Consumer``'s, with ``position: [numerator, denominator]``,
    and a ``TGBDataset``'s, with ``position_numerator`` and ``position_denominator``.
    """
    if not isinstance(state, Mapping) or state.get("format") not in _CURSOR_FORMATS:
        raise ConfigError(f"not a BatchWeave consumer state (expected format {_shown(CURSOR_FORMAT)}): {_shown(state)}")
    fields = _CURSOR_FIELDS if state["format"] == CURSOR_FORMAT or "position" not in state else _CURSOR_V1_FIELDS
    missing = [key for key in fields if key not in state]
    if missing:
        raise ConfigError(f"consumer state ({state['format']}) lacks {missing}: {_shown(dict(state))}")
    version, step = state["version"], state["step"]
    if not all(_natural(v) for v in (version, step)):
        raise ConfigError(
            f"consumer state needs non-negative integer version and step, got {_shown(version)}, {_shown(step)}"
        )
    if "position_numerator" in fields:
        position = (state["position_numerator"], state["position_denominator"])
    else:
        position = state["position"]
        if not (isinstance(position, list | tuple) and len(position) == 2):
            raise ConfigError(f"consumer state needs position [numerator, denominator], got {_shown(position)}")
    if not _natural(position[0]):
        raise ConfigError(
            f"consumer state position numerator must be a non-negative integer, got {_shown(position[0])}"
        )
    if not _natural(position[1]) or position[1] == 0:
        raise ConfigError(f"consumer state position denominator must be a positive integer, got {_shown(position[1])}")
    namespace = state.get("namespace", "")  # absent from cursors saved before namespace ids
    if not isinstance(namespace, str) or len(namespace) > 64:
        raise ConfigError(f"consumer state namespace must be the namespace's id string, got {_shown(namespace)}")
    saved_dp = state.get("dp", mesh.dp)
    if not _natural(saved_dp) or saved_dp == 0:
        raise ConfigError(f"consumer state dp must be a positive integer, got {_shown(saved_dp)}")
    # A TGB spans layout_dp / dp steps of a mesh, so the same position is step * saved_dp / dp
    # here. Rounded down: a position inside a step of this mesh is refused at the first next().
    step = step * saved_dp // mesh.dp
    return Cursor(version, Fraction(position[0], position[1]), step, namespace)


def _newest_state(journal: Journal[Any]) -> LogState | None:
    """The namespace's newest state (proven), or None when a damaged version lies ahead:
    reading then delivers every step before it and raises CorruptDataError naming it in order."""
    try:
        return journal.load_state()
    except CorruptDataError:
        return None


def checked_cursor(cursor: Cursor, journal: Journal[LogVersion], url: str) -> Cursor:
    """``cursor`` checked against the namespace's newest state (I9 and exact replay): same
    namespace, a version the log has, and that version holding the cursor's last TGB.

    The cursor's version is read *before* the state is loaded, so the proven state also
    proves that read (I10: a version GC had freed would show as reclaimed). Returns the
    cursor with the namespace id and that version's digest, which a reader anchors on."""
    read = journal.read_version_data(cursor.version) if cursor.version else None
    state = _newest_state(journal)
    if state is None:
        return cursor
    if cursor.namespace and state.namespace and cursor.namespace != state.namespace:
        raise ConfigError(
            f"{url}: the consumer state was saved from namespace {cursor.namespace}, this is namespace "
            f"{state.namespace}; load a checkpoint of a run that read this namespace"
        )
    if cursor.version > state.version:
        raise ConfigError(
            f"{url}: the consumer state is at log version {cursor.version}, but the log ends at version "
            f"{state.version}: the state is from another namespace or was edited"
        )
    reclaimed = state.reclaimed
    if cursor.position < reclaimed.steps or (cursor.version and cursor.version < reclaimed.versions):
        raise DataReclaimedError(url, math.floor(cursor.position), reclaimed.steps)
    last_tgb = math.ceil(cursor.position) - 1  # the newest TGB the delivered steps touched
    if cursor.version == 0:
        if last_tgb >= 0:
            raise ConfigError(f"{url}: the consumer state has consumed {cursor.position} TGBs at log version 0")
        return Cursor(0, cursor.position, cursor.step, state.namespace)
    if read is None:
        # Read before the state, which shows no reclaim of it: not GC's doing (it records a
        # reclaim before it deletes), so damage, named as the follower names it.
        vanished = "the cursor's log version vanished although no garbage collection reclaimed it"
        raise CorruptDataError(keys.version_key(cursor.version), vanished)
    if last_tgb not in read.delta.steps():
        raise ConfigError(
            f"{url}: the consumer state says log version {cursor.version} holds TGB {last_tgb}, but it holds "
            f"steps {read.delta.first_step}..{read.delta.first_step + len(read.delta.tgbs) - 1}: the state was "
            "edited or is from another namespace"
        )
    return Cursor(cursor.version, cursor.position, cursor.step, state.namespace, log.digest(read.data))


def cursor_state(cursor: Cursor, mesh: Mesh) -> dict[str, Any]:
    return {
        "format": CURSOR_FORMAT,
        "version": cursor.version,
        "position_numerator": cursor.position.numerator,
        "position_denominator": cursor.position.denominator,
        "step": cursor.step,
        "dp": mesh.dp,
        "cp": mesh.cp,
        "namespace": cursor.namespace,
    }


def _shown(value: Any) -> str:
    """A short repr, bounded in depth and length: cursors come from files users edit."""
    return reprlib.repr(value)


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
