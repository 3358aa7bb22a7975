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

**Who is the hub.** Ranks meet on a Unix socket in a directory only their user can
enter, named after a digest of the job, the store identity (endpoint, account, bucket,
path, credentials), the mesh and the node's first global rank (``HubAddress``): two
"nodes" on one machine (two torchrun agents), two jobs and two stores stay apart, and
no other user can reach or squat the name (``nodetrust``: the trust model). The rank
that takes the name's lock first runs the hub in background threads; the others
connect. When the hub's process dies or closes, its lock and connections go with it;
every rank then tries to take the lock, one wins and serves, the rest connect to it
and repeat their request (every request is idempotent: versions and ranges are
immutable). A rank that can reach no trustworthy hub within ``nodeclient.TAKEOVER_S``
of losing one reads on its own, with one WARNING.

This module plans who shares what. The rest: ``nodetrust`` (who trusts whom, and the
checks), ``nodewire`` (the messages, never pickled, within limits, and the descriptors
they carry), ``nodehub`` (the hub) and ``nodeclient`` (a rank's side, ``NodeClient``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from batchweave.errors import ConfigError
from batchweave.mesh import Mesh
from batchweave.reading.nodetrust import hub_directory, hub_identity, job_identity
from batchweave.store import Store

__all__ = [
    "HubAddress",
    "NodePlan",
    "node_address",
    "plan_node",
    "resolve_plan",
    "sharing_supported",
]


def sharing_supported() -> bool:
    """Peer credentials (SO_PEERCRED), sealed memfds: Linux."""
    return sys.platform == "linux" and hasattr(os, "memfd_create")


@dataclass(frozen=True, slots=True)
class HubAddress:
    """Where the ranks of one node, job and store meet: ``identity`` is the digest both
    ends check in their handshake, and names the socket and its election lock."""

    identity: str

    def paths(self) -> tuple[str, str]:
        """The socket's and the lock's paths, in this user's private directory (made if
        need be); ``nodetrust.HubRefused`` when that directory cannot be trusted."""
        base = os.path.join(hub_directory(), self.identity)
        return base + ".sock", base + ".lock"


def node_address(store: Store, mesh: Mesh, first_rank: int) -> HubAddress:
    """The hub of the node whose first global rank is ``first_rank``, for this job."""
    shape = f"dp{mesh.dp}.cp{mesh.cp}.tp{mesh.tp}.pp{mesh.pp}"
    return HubAddress(hub_identity(store.identity, job_identity(), shape, first_rank))


@dataclass(frozen=True, slots=True)
class NodePlan:
    """How one rank shares with the other ranks of its node."""

    address: HubAddress  # the node's hub
    sharers: int  # ranks of the node reading this rank's slice, itself included
    nodes: int  # followers of the job: one per node


def plan_node(store: Store, mesh: Mesh, rank: int, local_rank: int, local_world_size: int) -> NodePlan:
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
    return NodePlan(node_address(store, mesh, first), sharers, nodes)


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
        raise ConfigError("node_sharing=True needs Linux (peer credentials and sealed memfds)")
    return plan_node(store, mesh, rank, _local_setting(local_rank, "LOCAL_RANK", 0), size)


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
