"""Node-level sharing: the ranks of one host share one log follower and one read per slice.

Without sharing, every rank follows the log itself and reads its own slice: 8 ranks on a
node send 8 times the log requests, and the TP and PP ranks of one (d, c) position read
the same bytes TP x PP times. With sharing, one *hub* per node does both for all of them:

- **One follower.** The hub runs the reader's proven log (``follower.ProvenLog``: read
  ahead, prove every batch, I10) once, and hands each rank the proven versions it asks
  for. A rank uses them exactly as it would its own (continuity, resharding, cursors
  are the rank's, unchanged): the hub only saves requests.
- **One read per slice.** A rank asks the hub for a byte range; the first request for a
  range reads it from the store into an anonymous shared-memory file (``memfd``) and
  every rank asking for the same range gets that file's descriptor over the socket. The
  rank maps it read-only: its arrays are views of the node's one copy, and its CRC check
  runs as before. The hub drops a range once every rank sharing that slice took it (or,
  past ``nodehub.CACHE_BYTES``, the oldest first). Nothing is ever named in
  ``/dev/shm``: the memory is freed when the last mapping goes, crash or not.

**Who is the hub.** Ranks meet on an abstract Unix socket (no file: the name vanishes
with the process holding it) named after the namespace and the node's first global
rank, so two "nodes" on one machine (two torchrun agents) stay apart. The first rank
to bind it runs the hub in background threads; the others connect. When the hub's
process dies or closes, its connections break; every rank then tries to bind the name,
one wins and serves, the rest connect to it and repeat their request (every request
is idempotent: versions and ranges are immutable). A rank that can reach no hub within
``nodeclient.TAKEOVER_S`` reads on its own.

This module plans who shares what. The rest: ``nodewire`` (the messages, never pickled,
and the descriptors they carry), ``nodehub`` (the hub) and ``nodeclient`` (a rank's side,
``NodeClient``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass

from batchweave.errors import ConfigError
from batchweave.mesh import Mesh
from batchweave.store import Store

__all__ = [
    "NodePlan",
    "node_address",
    "plan_node",
    "resolve_plan",
    "sharing_supported",
]


def sharing_supported() -> bool:
    """Abstract Unix sockets and memfd: Linux."""
    return sys.platform == "linux" and hasattr(os, "memfd_create")


def node_address(url: str, first_rank: int) -> str:
    """The abstract socket name of the node whose first global rank is ``first_rank``."""
    digest = hashlib.blake2b(f"{url}\n{first_rank}".encode(), digest_size=16).hexdigest()
    return f"\0batchweave-node-{digest}"


@dataclass(frozen=True, slots=True)
class NodePlan:
    """How one rank shares with the other ranks of its node."""

    address: str  # the node's hub socket
    sharers: int  # ranks of the node reading this rank's slice, itself included
    nodes: int  # followers of the job: one per node


def plan_node(url: str, mesh: Mesh, rank: int, local_rank: int, local_world_size: int) -> NodePlan:
    """The plan of ``rank``, ``local_rank`` of ``local_world_size`` ranks on its node
    (torchrun numbers a node's ranks consecutively: the node holds global ranks
    ``rank - local_rank`` to ``rank - local_rank + local_world_size - 1``)."""
    if not 0 <= local_rank < local_world_size:
        raise ConfigError(f"local rank {local_rank} is outside the node's {local_world_size} ranks")
    first = rank - local_rank
    if first < 0 or first + local_world_size > mesh.world_size:
        raise ConfigError(
            f"rank {rank} as local rank {local_rank} of {local_world_size} puts the node's ranks outside the "
            f"mesh's 0..{mesh.world_size - 1}: check LOCAL_RANK and LOCAL_WORLD_SIZE"
        )
    mine = mesh.coords(rank)
    same = [mesh.coords(r) for r in range(first, first + local_world_size)]
    sharers = sum(1 for c in same if (c.dp, c.cp) == (mine.dp, mine.cp))
    nodes = -(-mesh.world_size // local_world_size)
    return NodePlan(node_address(url, first), sharers, nodes)


def resolve_plan(
    store: Store, mesh: Mesh, rank: int, local_rank: int | None, local_world_size: int | None, sharing: bool | None
) -> NodePlan | None:
    """How ``rank`` shares with its node (None: it reads on its own), from the settings
    of ``Consumer`` and torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``."""
    if sharing is not None and not isinstance(sharing, bool):
        raise ConfigError(f"node_sharing must be True, False or None, got {sharing!r}")
    size = _local_setting(local_world_size, "LOCAL_WORLD_SIZE", 1)
    if sharing is False or (sharing is None and (size < 2 or not store.remote or not sharing_supported())):
        return None
    if not sharing_supported():
        raise ConfigError("node_sharing=True needs Linux (abstract Unix sockets and memfd)")
    return plan_node(store.url, mesh, rank, _local_setting(local_rank, "LOCAL_RANK", 0), size)


def _local_setting(value: int | None, variable: str, default: int) -> int:
    if value is None:
        text = os.environ.get(variable, "").strip()
        if not text:
            return default
        if not text.isdigit():
            raise ConfigError(f"{variable}={text!r} is not a non-negative integer")
        return int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{variable.lower()} must be a non-negative integer, got {value!r}")
    return value
