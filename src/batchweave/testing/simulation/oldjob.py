"""The old job of a namespace deleted and created again at the same URL (issue 43).

The run's namespace is the new one. Its URL held another namespace before, whose job
wrote head copies (``journal.headcopies``) in the background after each commit; some of
those puts land now, long after every key of the old namespace was deleted. Each holds a
version number the new log uses too, with the old job's bytes: its version 1 (another
namespace id, the same layout), or a version with TGBs at the steps the new log's
version of that number has or will have. A reader that takes one hands out a step the
genuine log does not hold (``wrong-step``) or fails on a healthy namespace
(``unexpected-error``): copies name their namespace, and a reader takes only its own.
"""

from __future__ import annotations

import msgspec

from batchweave import keys, log
from batchweave.journal.headcopies import encode_copy
from batchweave.testing.simulation.scheduler import Actor
from batchweave.testing.simulation.world import ALIGNED, World

__all__ = ["old_job", "own_namespace"]


def old_job(world: World, actor: Actor) -> None:
    """Now and then, the old job's copies of one version land: version 1, the head, or
    the version after it (the slots a follower at the head reads next)."""
    old_id = f"{world.choose(1 << 30):08x}"  # the old namespace's id: another random one
    for _ in range(10):
        world.pause((5.0, 30.0, 120.0, ALIGNED))
        head = len(world.model.genuine_bytes)
        if head == 0:
            continue
        version = (1, head, head + 1, head + 1)[world.choose(4)]
        old = _old_version(world, version, old_id)
        if old is None:
            continue
        data = encode_copy(version, old_id, log.encode(old))
        for copy in range(world.store.head_copies):
            world.store.put(keys.head_copy_key(version, copy), data)


def own_namespace(world: World) -> str:
    """The run's namespace id (its genuine version 1's), as its committers' copies name it."""
    first = world.model.genuine_bytes.get(1)
    return "" if first is None else log.decode_version(first, keys.version_key(1), 1).namespace


def _old_version(world: World, version: int, old_id: str) -> log.LogVersion | None:
    """What the old job committed as ``version``: its version 1 names another namespace;
    a later one holds TGBs of the genuine log's newest TGB-bearing version (their objects
    exist, so a reader that took it would deliver their bytes), at the steps the genuine
    log's ``version`` starts at."""
    model = world.model
    first = log.decode_version(model.genuine_bytes[1], keys.version_key(1), 1)
    if version == 1:
        return msgspec.structs.replace(first, namespace=old_id, committed_at=0.25)
    donor = _newest_with_tgbs(world)
    before = model.states.get(version - 1)
    if donor is None or before is None:
        return None
    return msgspec.structs.replace(
        donor, version=version, first_step=before.steps, namespace="", layout=None, committed_at=0.25
    )


def _newest_with_tgbs(world: World) -> log.LogVersion | None:
    genuine = world.model.genuine_bytes
    for number in sorted(genuine, reverse=True)[:8]:
        version = log.decode_version(genuine[number], keys.version_key(number), number)
        if version.tgbs:
            return version
    return None
