"""The channel between one rank and its node's hub, as an actor of the simulation: what
``nodeclient.NodeClient`` meets over the hub's Unix socket, each connection's fault a
recorded choice of the world.

A rank of the ``hub`` shape reaches its node's ``InlineNode`` (the shared follower and
its ``SharedLog``) through a ``HubChannel``, with the same interface, instead of
directly. Each connection it makes (the first on first use, the next after a loss) is
one of ``FAULTS``:

- ``genuine``: the hub, passing everything through;
- ``forge``: a process of another user answers on the hub's socket (a squatter that
  bound its name, a forger): its credentials are drawn, and the channel applies the
  real rule, ``nodetrust.check_uid``, before using it; refused, the rank reads on its
  own (``NodeUnavailableError``), as ``NodeClient`` gives up. Were it let through, it
  hands out genuine versions whose every TGB points at the slices of the TGB before
  (CRCs and all): a rank would deliver the step before, which the model reports;
- ``stall``: after some replies none comes: the rank waits out the real client's bound
  (``nodeclient.HUB_REPLY_S``, after the hub's ``LOG_WAIT_S`` for a log request) in
  virtual time, then reads on its own;
- ``drop``: after some replies the connection breaks: the rank reaches the next hub
  (a new connection, its own fault drawn) after a while, or reads on its own from the
  version it needs next once ``nodeclient.TAKEOVER_S`` passed since the first loss
  after the last reply;
- ``poison``: the hub is genuine, but before some of this rank's log requests another
  requester of the node (a careless or stale peer of the same user) asks the shared
  follower nonsense: version 1 of a log collection has reclaimed, a place below the
  others, or one far beyond the head. Whatever it is told is its own: the ranks of the
  node must never see another's error nor lose a step (I11).

Every log request and reply goes through the real wire format (``nodewire``): the
request is encoded and parsed as the hub parses it, the reply framed as the hub sends it
and cut into versions as ``NodeClient`` cuts it. Every wait is a virtual sleep and every
decision a ``world`` choice (0, the first, is the calm one): a run replays exactly and
shrinks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from batchweave import log
from batchweave.log import ReadVersion, TGBDescriptor
from batchweave.reading import nodeclient, nodetrust, nodewire
from batchweave.reading.nodeclient import NodeUnavailableError
from batchweave.reading.nodehub import LOG_WAIT_S
from batchweave.reading.sharedlog import InlineNode, NodeBehind, check_first

if TYPE_CHECKING:
    from batchweave.testing.simulation.world import World

__all__ = ["FAULTS", "HubChannel"]

# A connection's behaviour, by weight (the first is the calm one): a rank makes one or two
# connections a run, so most runs see a fault on some rank of some node.
FAULTS = {"genuine": 10, "forge": 1, "stall": 1, "drop": 2, "poison": 2}
_STRIKE = 12  # a stall or a drop strikes before one of the connection's first this many requests
_POKES = 4  # nonsense requests on a poisoned connection, at most
_TAKEOVER = (0.01, 1.0, 5.0, math.inf)  # when the next hub answers after a loss (inf: none does)
_FAR = 10**12  # a place far beyond any head


@dataclass
class _Connection:
    """One connection to whatever answers on the hub's socket."""

    fault: str
    pid: int
    uid: int
    strike: int  # requests answered before a stall or a drop strikes
    replies: int = 0
    pokes: int = 0
    previous: TGBDescriptor | None = None  # a forger's: the TGB it handed out last

    def forged(self, batch: list[ReadVersion]) -> list[ReadVersion]:
        """The batch with each TGB's objects and slices those of the TGB handed out before
        it: every check of the slices passes, and the data is another step's."""
        out = []
        for read in batch:
            tgbs = []
            for tgb in read.delta.tgbs:
                shown = tgb
                if self.previous is not None:
                    before = self.previous
                    shown = msgspec.structs.replace(
                        tgb, objects=before.objects, slices=before.slices, nbytes=before.nbytes
                    )
                self.previous = tgb
                tgbs.append(shown)
            if tgbs == read.delta.tgbs:
                out.append(read)
                continue
            delta = msgspec.structs.replace(read.delta, tgbs=tgbs)
            out.append(ReadVersion(delta, log.encode(delta)))
        return out


def _over_the_wire(batch: list[ReadVersion], first: int) -> list[ReadVersion]:
    """``batch`` as a rank gets it over the socket: the log request for ``first`` encoded
    and parsed strictly (as the hub parses it), the reply framed with its sizes (as the hub
    sends it), then cut into versions (as ``NodeClient`` does)."""
    request = nodewire.parse_request(nodewire.encode_request(nodewire.LogRequest(id=0, first=first)))
    assert isinstance(request, nodewire.LogRequest)
    payload = b"".join(bytes(read.data) for read in batch)
    message = nodewire.frame({"sizes": [len(read.data) for read in batch]}, len(payload)) + payload
    header, body = nodewire.unframe(message, nodewire.REPLY_LIMITS)
    return nodewire.log_versions(body, json.loads(header)["sizes"], request.first)


class HubChannel:
    """One rank's connection to its node's hub (see the module doc): the interface of
    ``InlineNode`` and ``nodeclient.NodeClient``, the faults of a real socket.

    Args:
        node: the node's follower, shared with the node's other ranks.
        world: the run (its choices, its scheduler).
        label: how the trace names this rank (``rank 1``).
    """

    def __init__(self, node: InlineNode, world: World, label: str) -> None:
        self._node = node
        self._world = world
        self._label = label
        self._connection: _Connection | None = None
        self._connections = 0
        self._lost_at: float | None = None  # the first loss since the last reply: the takeover deadline's start
        self._unavailable: str | None = None  # why this rank reads on its own from now on

    def log(
        self,
        first: int,
        anchor: tuple[int, str] | None,
        present_through: int,
        next_step: Callable[[], int],
        url: str,
        stop: Any,
    ) -> Iterator[Any]:
        """``InlineNode.log`` through the channel: one request a reply, each reply what the
        node yields (a batch or a pause); NodeUnavailableError with the next version when
        the channel fails, NodeBehind as the node says it."""
        version = first
        relayed: Generator[Any, None, None] | None = None
        relayed_on: _Connection | None = None
        try:
            while not stop.is_set():
                connection = self._request(version, LOG_WAIT_S + nodeclient.HUB_REPLY_S)
                if connection.fault == "poison":
                    self._poison(connection, version, next_step, url, stop)
                if relayed is None or relayed_on is not connection:  # a new hub: ask it from here
                    if relayed is not None:
                        relayed.close()
                    start_anchor = anchor if version == first else None
                    relayed = self._node.log(version, start_anchor, present_through, next_step, url, stop)
                    relayed_on = connection
                try:
                    item = next(relayed)
                except StopIteration:
                    return
                except NodeBehind:
                    self._answered(connection)
                    raise
                if isinstance(item, list):
                    if connection.fault == "forge":
                        item = connection.forged(item)
                    item = _over_the_wire(item, version)
                    if version == first:
                        check_first(item, anchor)  # the rank's own check, of what it was handed
                    version += len(item)
                self._answered(connection)
                yield item
        finally:
            if relayed is not None:
                relayed.close()

    def read(self, key: str, start: int, length: int) -> memoryview:
        """``length`` bytes of ``key`` from ``start``, as the node reads them;
        NodeUnavailableError means: read it yourself."""
        connection = self._request(0, nodeclient.HUB_REPLY_S)
        data = self._node.read(key, start, length)
        self._answered(connection)
        return data

    def close(self) -> None:
        """Hang up; a later use is a new client (as a new pipeline makes one)."""
        self._connection = None
        self._connections = 0
        self._lost_at = None
        self._unavailable = None

    # -- the faults --------------------------------------------------------------------------

    def _request(self, next_version: int, bound_s: float) -> _Connection:
        """The connection a request goes out on, once its fault struck if it does: a stall
        waits out ``bound_s`` and gives up; a drop loses the connection (the next hub, or
        none: ``_connect``)."""
        while True:
            connection = self._connection or self._connect(next_version)
            if connection.fault not in ("stall", "drop") or connection.replies < connection.strike:
                return connection
            if connection.fault == "stall":
                self._note(f"no reply ({connection.replies} answered), waits {bound_s:.1f} s")
                self._world.scheduler.sleep(bound_s)
                raise self._give_up(f"no reply within {bound_s:.0f} s (the hub is stalled)", next_version)
            self._note(f"connection dropped after {connection.replies} replies")
            self._connection = None

    def _connect(self, next_version: int) -> _Connection:
        """A new connection (after a loss: to the next hub, if one answers before the
        takeover deadline), checked as the real client checks its peer."""
        if self._unavailable is not None:
            raise NodeUnavailableError(self._unavailable, next_version)
        world = self._world
        now = world.scheduler.clock.now
        if self._lost_at is None:
            self._lost_at = now  # cleared by the first reply
        if self._connections:  # a loss: another rank takes over as the hub, or nobody does in time
            after = world.choices.pick(_TAKEOVER)
            waited = now - self._lost_at
            if waited + after > nodeclient.TAKEOVER_S:
                world.scheduler.sleep(max(0.0, nodeclient.TAKEOVER_S - waited))
                raise self._give_up(f"unreachable for {nodeclient.TAKEOVER_S:.0f} s", next_version)
            world.scheduler.sleep(after)
        self._connections += 1
        fault = world.action(FAULTS)
        pid = 1000 + world.choose(1 << 15)
        uid = os.getuid() + 1 + world.choose(1 << 15) if fault == "forge" else os.getuid()
        strike = world.choose(_STRIKE) if fault in ("stall", "drop") else 0
        user = "this user" if uid == os.getuid() else "another user"
        self._note(f"connection {self._connections}: {fault} (process {pid}, {user})")
        try:
            nodetrust.check_uid(pid, uid, "node hub")  # looked up here: a test may sabotage the rule
        except nodetrust.HubRefused as exc:
            raise self._give_up(str(exc), next_version) from None
        self._connection = _Connection(fault, pid, uid, strike)
        return self._connection

    def _poison(self, connection: _Connection, version: int, next_step: Callable[[], int], url: str, stop: Any) -> None:
        """Sometimes, another requester of the node asks nonsense first, and goes."""
        world = self._world
        if connection.pokes >= _POKES or not world.choices.chance(3):
            return
        connection.pokes += 1
        place = world.choose(3)
        first = 1 if place == 0 else max(1, version // 2) if place == 1 else version + _FAR
        self._note(f"another requester asks version {first}")
        requests = self._node.log(first, None, 0, next_step, url, stop)
        try:
            next(requests, None)
        except Exception:  # what the nonsense asker is told is its own
            pass
        finally:
            requests.close()  # it goes: its place is forgotten

    def _answered(self, connection: _Connection) -> None:
        connection.replies += 1
        self._lost_at = None  # the hub works: a later loss gets a whole takeover deadline

    def _give_up(self, why: str, next_version: int) -> NodeUnavailableError:
        """This rank reads on its own from now on."""
        if self._unavailable is None:
            self._unavailable = why
            self._note(f"reads on its own: {why}")
        self._connection = None
        return NodeUnavailableError(why, next_version)

    def _note(self, what: str) -> None:
        """A line of the trace (``HUB``), for ``--story``."""
        scheduler = self._world.scheduler
        actor = scheduler.current.name if scheduler.current is not None else "?"
        scheduler.trace.append((scheduler.clock.elapsed, actor, "HUB", f"{self._label}: {what}"))
