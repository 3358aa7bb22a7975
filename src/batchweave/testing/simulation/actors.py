"""The actors of a simulated run: the REAL producers, consumers and collectors, each a
short script whose every decision is a recorded choice.

Every script ends (a bounded number of actions), so a run ends when the stream is
ended and every consumer reached the end; an actor still waiting long after that is a
"waits forever" violation (``run``). Errors are judged where they are raised: a typed
error the situation allows (a zombie fenced, a reader overtaken by collection) ends the
actor; anything else is a violation naming it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import msgspec

from batchweave import keys, log
from batchweave.commit.claims import CLAIM_TICKET, claim_key
from batchweave.commit.group import GroupCommit, build_group_commit
from batchweave.commit.policies import DAC, Manual
from batchweave.consumer import Consumer
from batchweave.errors import (
    BatchWeaveError,
    CorruptDataError,
    DataReclaimedError,
    ProducerFencedError,
    StoreError,
    StreamEndedError,
    TransientStoreError,
)
from batchweave.intent import decode_intent, intent_key
from batchweave.journal import Journal
from batchweave.journal.headcopies import encode_copy
from batchweave.keys import version_key
from batchweave.lifecycle.gc import collect_garbage
from batchweave.lifecycle.gcsummary import summary_key
from batchweave.lifecycle.watermarks import release_checkpoint, released_key
from batchweave.log import Layout, ProducerState
from batchweave.producer import Producer, end_stream
from batchweave.reading.follower import ProvenLog, log_reader
from batchweave.reading.polling import HEAD_BUDGET_PER_S, HeadPolling
from batchweave.reading.sharedlog import InlineNode, SharedLog
from batchweave.segment import segment_key
from batchweave.shardlist import record_key
from batchweave.testing.simulation.group_driver import GroupProducerDriver
from batchweave.testing.simulation.hubchannel import HubChannel
from batchweave.testing.simulation.model import VERSION_KEY, payload
from batchweave.testing.simulation.oldjob import old_job, own_namespace
from batchweave.testing.simulation.scheduler import Actor
from batchweave.testing.simulation.world import ALIGNED, World, role

__all__ = ["spawn_all"]


def spawn_all(world: World) -> None:
    """Every actor of ``world.config``, each starting after a chosen delay, beside a
    namespace inside the run's (``plant_inner_namespace``)."""
    config = world.config
    plant_inner_namespace(world)
    for i in range(config.direct_producers):
        _spawn_producer(world, f"p{i}", "producer", delay_s=world.choose(3) * 5.0)
    for i in range(config.group_producers):
        _spawn_producer(world, f"g{i}", "group", delay_s=world.choose(3) * 5.0)
    for i in range(config.collectors):
        world.scheduler.spawn(f"gc{i}", "collector", lambda a: collector(world, a), skew_s=world.skew(), delay_s=60.0)
    for i in range(config.trainers):
        _spawn_trainer(world, f"train{i}", 1, None, delay_s=world.choose(3) * 5.0)
    for i in range(config.lagging_readers):
        world.scheduler.spawn(
            f"lag{i}", "reader", lambda a: lagging_reader(world, a), delay_s=world.choose(3) * 10.0, crashable=False
        )
    for i in range(config.resumers):
        delay = 200.0 + world.choose(8) * 150.0
        world.scheduler.spawn(f"resume{i}", "reader", lambda a: resumer(world, a), delay_s=delay, crashable=False)
    if config.damage:
        world.scheduler.spawn("damage", "damager", lambda a: damager(world, a), delay_s=100.0, crashable=False)
        world.store.before_get = stale_writer_racing_reads(world)
    if config.old_job and config.head_copies:
        world.scheduler.spawn("oldjob", "damager", lambda a: old_job(world, a), delay_s=30.0, crashable=False)
    world.scheduler.spawn("ender", "ender", lambda a: ender(world, a), crashable=False)


# -- the namespace inside the run's ----------------------------------------------------------

INNER_ROOT = keys.DATA_PREFIX  # the run's namespace at <root>, another at <root>/data (issue 43)
_DAY_S = 86_400.0


def plant_inner_namespace(world: World) -> None:
    """A namespace at ``<root>/data``, inside the run's, with one key of every kind of the
    layout (two producers, one named like an epoch), a day old: past every grace. A
    producer of today refuses to create either of them (``journal.overlap``); one of an
    older release, or two creations at the same moment, did not. No actor of the run may
    delete or rewrite one of its keys (the model's check (g), I13). Planted before the
    actors start, outside the schedule, so it costs no choice, no operation and no noise."""
    layout = Layout(world.config.dp, 1)
    version = b"inner log version"  # (not built by logrules: a new namespace's id would draw on the run's noise)
    objects = {
        keys.version_key(1): version,
        keys.snapshot_key(1): b"inner snapshot",
        keys.HINT_KEY: b"inner hint",
        segment_key(1): b"inner segment",
        keys.head_copy_key(1, 0): version,
        keys.data_key("p0", 1, 0, "0badc0de", 0): b"inner TGB",
        keys.data_key("e000001", 1, 0, "0badc0de", 0): b"inner TGB of a producer named like an epoch",
        intent_key("p0", 1, 1): b"inner intent",
        claim_key("p0", 2, layout, "0badc0de"): CLAIM_TICKET,
        f"{keys.CHECKPOINT_PREFIX}ck/0-0.json": b"inner watermark",
        released_key("ck"): b"{}",
        f"{keys.PROBE_PREFIX}{'0' * 32}": b"1",
        summary_key(1): b"inner summary",
        record_key("pool", 0): b"inner shard list",
    }
    world.store.plant_foreign(
        {INNER_ROOT + key: body for key, body in objects.items()}, world.scheduler.clock.now - _DAY_S
    )


# -- producers ---------------------------------------------------------------------------


def _spawn_producer(world: World, pid: str, kind: str, delay_s: float) -> None:
    generation = world.generations.get(pid, 0) + 1
    if generation > world.config.max_incarnations:
        return
    world.generations[pid] = generation
    script = direct_producer if kind == "producer" else group_producer
    world.scheduler.spawn(
        f"{pid}.{generation}",
        kind,
        lambda a: _producer_life(world, a, pid, script),
        skew_s=world.skew(),
        delay_s=delay_s,
        on_crash=lambda a: _restart_after(world, pid, kind),
    )


def _restart_after(world: World, pid: str, kind: str) -> None:
    """A supervisor restarts a dead producer a little later (a new incarnation)."""
    world.producers = {a: p for a, p in world.producers.items() if a.alive}
    _spawn_producer(world, pid, kind, delay_s=world.choices.pick((1.0, 30.0, 300.0)))


def _producer_life(world: World, actor: Actor, pid: str, script) -> None:
    try:
        script(world, actor, pid)
    except (ProducerFencedError, StreamEndedError) as exc:
        producer = world.producers.get(actor)
        newer = producer is not None and world.model.epochs.get(pid, 0) > producer.epoch
        if isinstance(exc, ProducerFencedError) and not newer:
            world.model.violation("unexpected-error", actor.name, f"fenced with no newer incarnation: {exc}")
        elif isinstance(exc, StreamEndedError) and not world.model.ended:
            world.model.violation("unexpected-error", actor.name, f"told the stream ended, it has not: {exc}")
    except TransientStoreError:
        # Told its claim or an append failed (a lost answer): it stops, and is restarted.
        world.producers.pop(actor, None)
        _spawn_producer(world, pid, actor.kind, delay_s=world.choices.pick((1.0, 60.0)))
    except BatchWeaveError as exc:
        if not world.model.stale_error(actor.name, exc):
            world.model.violation("unexpected-error", actor.name, f"{type(exc).__name__}: {exc}")
    finally:
        world.producers.pop(actor, None)


def _restart(world: World, actor: Actor, pid: str) -> None:
    """A new incarnation claims while this one is delayed, then this one goes on: a zombie."""
    _spawn_producer(world, pid, actor.kind, delay_s=0.0)
    world.pause((30.0, 120.0, 600.0))


_DIRECT_ACTIONS = {"append": 10, "flush": 4, "pause": 3, "restart": 1, "stop": 1}
_GROUP_ACTIONS = {"append": 10, "step": 5, "flush": 2, "pause": 3, "restart": 1, "stop": 1}


def _policy(world: World):
    return Manual() if world.choose(2) == 0 else DAC(rng=random.Random(world.choose(1 << 16)))


def direct_producer(world: World, actor: Actor, pid: str) -> None:
    """``Producer(background_commit=False)``: commits in append (DAC) or flush (both)."""
    config = world.config
    producer = Producer(
        world.store,
        pid,
        dp=config.dp,
        commit_policy=_policy(world),
        snapshot_every=config.snapshot_every,
        background_commit=False,
    )
    world.producers[actor] = producer
    offset = producer.resume_offset
    for _ in range(config.actions):
        action = world.action(_DIRECT_ACTIONS | {"pause": config.pause_weight})
        if action == "append":
            producer.append([payload(pid, offset, i) for i in range(config.dp)], source_offset=offset)
            offset += 1
        elif action == "flush":
            producer.flush()
            world.model.flushed(actor.name, pid, offset)
        elif action == "pause":
            world.pause()
        elif action == "restart":
            _restart(world, actor, pid)
        else:
            producer.close(flush=False)  # stops, dropping what is pending; a restart resumes
            _spawn_producer(world, pid, actor.kind, delay_s=world.choices.pick((1.0, 60.0)))
            return
    producer.flush()
    world.model.flushed(actor.name, pid, offset)
    producer.close()


def group_producer(world: World, actor: Actor, pid: str) -> None:
    """Group commit, stepped in the actor (``GroupProducerDriver``)."""
    config = world.config
    policy = GroupCommit(interval_s=world.choices.pick((0.4, 2.0)), rng=random.Random(world.choose(1 << 16)))
    driver = GroupProducerDriver(world.store, pid, config.dp, config.snapshot_every, policy)
    world.producers[actor] = driver.producer
    offset = driver.resume_offset
    for _ in range(config.actions):
        action = world.action(_GROUP_ACTIONS | {"pause": config.pause_weight})
        if action == "append":
            driver.append([payload(pid, offset, i) for i in range(config.dp)], source_offset=offset)
            offset += 1
            for _ in range(world.choose(4)):
                driver.step()
        elif action == "step":
            for _ in range(1 + world.choose(6)):
                driver.step()
        elif action == "flush":
            world.model.flushed(actor.name, pid, driver.flush())
        elif action == "pause":
            world.pause((5.0, 30.0, ALIGNED, ALIGNED))  # paused with TGBs pending, intents published
        elif action == "restart":
            _restart(world, actor, pid)
        else:
            driver.close()
            _spawn_producer(world, pid, actor.kind, delay_s=world.choices.pick((1.0, 60.0)))
            return
    world.model.flushed(actor.name, pid, driver.flush())
    driver.close()


# -- consumers ---------------------------------------------------------------------------


def _consumer(world: World, rank: int, node: InlineNode | None = None) -> Consumer:
    # prefetch=None on a store that is not remote: the pipeline runs inline, no thread.
    consumer = Consumer(world.store, dp=world.config.dp, rank=rank, max_poll_interval_s=5.0)
    # The follower of its node, as the hub's would be; with hub faults, through its own
    # channel to the hub (a connection that may be forged, stall, drop or be poisoned).
    channel = HubChannel(node, world, f"rank {rank}") if node is not None and world.config.hub_faults else None
    node_follower = channel or node
    if node_follower is not None:
        consumer.attach_node(node_follower)
    return consumer


def _node(world: World) -> InlineNode | None:
    """A node follower for readers to share (``node_sharing`` shapes): the hub's follower
    and shared log, run inline by whichever reader asks first."""
    if not world.config.node_sharing:
        return None

    def start_follower(first: int) -> Any:
        journal = Journal(world.store, read_only=True)  # the node's own view: no rank's anchor
        # With head copies, a budget as a large job's would be: the floor binds, so the
        # probes at the head spread over the copies and the proofs over recent anchors.
        budget = 0.1 if world.store.head_copies else HEAD_BUDGET_PER_S
        polling = HeadPolling(1, budget_per_s=budget, max_poll_s=5.0, copies=world.store.head_copies)
        reader = log_reader(journal, first, 1, polling, None)
        return iter(ProvenLog(journal, reader, polling, lambda: 0, world.store.url))

    # Small budgets, so that within a short run ranks fall far behind (and follow on their
    # own) and are let go when the kept versions outgrow the budget.
    return InlineNode(start_follower, world.store.get_range, SharedLog(retain_bytes=4_000, restart_window=3))


def _spawn_trainer(world: World, name: str, generation: int, start: list[dict[str, Any]] | None, delay_s: float):
    world.scheduler.spawn(
        f"{name}.{generation}",
        "trainer",
        lambda a: trainer(world, a, name, generation, start),
        skew_s=world.skew(),
        delay_s=delay_s,
        on_crash=lambda a: _restart_trainer(world, name, generation),
    )


def _restart_trainer(world: World, name: str, generation: int) -> None:
    """A crashed job restarts from its newest durable checkpoint (or the start)."""
    start = world.checkpoints[-1][1] if world.checkpoints else None
    _spawn_trainer(world, name, generation + 1, start, delay_s=world.choices.pick((5.0, 60.0, 600.0)))


def trainer(world: World, actor: Actor, name: str, generation: int, start: list[dict[str, Any]] | None) -> None:
    """A training job: ``dp`` ranks read in lockstep and mark checkpoints, releasing the
    older ones once a newer is complete; no error is allowed (its checkpoints protect it)."""
    node = _node(world)
    ranks = [_consumer(world, rank, node) for rank in range(world.config.dp)]
    if start is not None:
        for consumer, cursor in zip(ranks, start, strict=True):
            consumer.load_state_dict(cursor)
    marked = 0
    try:
        while True:
            for rank, consumer in enumerate(ranks):
                if not _read_one(world, actor, consumer, rank):
                    return
            if world.choose(4) == 3:
                marked += 1
                _checkpoint(world, f"{name}-{generation}-{marked}", ranks)
            if world.ended_at is None and world.choose(3) == 2:  # once the stream ended, drain
                world.pause((0.5, 5.0, 60.0))
    except DataReclaimedError as exc:  # its durable checkpoint reaches these steps: I4
        world.model.violation("deleted-reachable", actor.name, f"a checkpointed reader was told: {exc}")
    except BatchWeaveError as exc:
        if not world.model.stale_error(actor.name, exc):
            world.model.violation(
                "unexpected-error", actor.name, f"a checkpointed reader raised {type(exc).__name__}: {exc}"
            )


def _checkpoint(world: World, checkpoint: str, ranks: list[Consumer]) -> None:
    """As training does: the checkpoint (with the cursors) is durable first, then every
    rank marks it, then the older ones are released. A crash in between leaves a durable
    checkpoint that may lack marks: a restart resumes from it all the same."""
    cursors = [consumer.state_dict() for consumer in ranks]
    world.cursors.append(cursors[0] | {"rank": 0})
    old = [c for c, _ in world.checkpoints]
    world.checkpoints.append((checkpoint, cursors))
    for consumer in ranks:
        consumer.mark_checkpoint(checkpoint)
    for previous in old:
        # A crash cut the marking of ``previous`` short, maybe before any rank marked it:
        # then there is nothing to release.
        release_checkpoint(world.store, previous, missing_ok=True)
        world.checkpoints = [c for c in world.checkpoints if c[0] != previous]


def _read_one(world: World, actor: Actor, consumer: Consumer, rank: int) -> bool:
    """One step from ``consumer``, checked against the genuine log (a, f); False at the end."""
    expected = consumer.state_dict()["step"]
    actor.waiting_for = f"rank {rank}: step {expected}"
    try:
        batch = next(consumer)
    except StopIteration:
        actor.waiting_for = ""
        if expected < len(world.model.steps) and world.model.ended:
            world.model.violation(
                "early-end",
                actor.name,
                f"rank {rank} ended at step {expected}, the genuine log has {len(world.model.steps)}",
            )
        return False
    actor.waiting_for = ""
    if batch.step != expected:
        world.model.violation(
            "resume-mismatch", actor.name, f"rank {rank} delivered step {batch.step}, its cursor said {expected}"
        )
    world.model.delivered(actor.name, rank, batch.step, batch.data)
    return True


def lagging_reader(world: World, actor: Actor) -> None:
    """An evaluation reader from step 0 that no checkpoint protects, pausing for long
    whiles: collection may overtake it (DataReclaimedError), never mislead it."""
    # Some start late, from step 0 beside collection: version 1's proof (read again after
    # the reads) is what tells them the versions after it came from freed keys.
    world.pause((0.0, 0.0, 300.0, ALIGNED))
    if world.lagging_node is None:
        world.lagging_node = _node(world)
    consumer = actor.notes["consumer"] = _consumer(world, world.choose(world.config.dp), world.lagging_node)
    _read_unprotected(world, actor, consumer)


def resumer(world: World, actor: Actor) -> None:
    """A reader resumed from a cursor a trainer saved (maybe of a released checkpoint)."""
    if not world.cursors:
        return
    cursor = dict(world.cursors[world.choose(len(world.cursors))])
    rank = cursor.pop("rank")
    consumer = actor.notes["consumer"] = _consumer(world, rank)
    try:
        consumer.load_state_dict(cursor)
    except DataReclaimedError:
        return
    _read_unprotected(world, actor, consumer)


def _read_unprotected(world: World, actor: Actor, consumer: Consumer) -> None:
    try:
        while _read_one(world, actor, consumer, consumer.rank):
            if world.ended_at is None and world.choose(3) == 2:  # once the stream ended, drain
                # aligned: it wakes with the stale writers paused that way (the damager's)
                world.pause((1.0, 30.0, 300.0, 900.0, ALIGNED))
    except DataReclaimedError:
        pass  # collection overtook it: the typed answer
    except BatchWeaveError as exc:
        if not world.model.stale_error(actor.name, exc):
            world.model.violation("unexpected-error", actor.name, f"{type(exc).__name__}: {exc}")


# -- collection, damage, the end -----------------------------------------------------------


def collector(world: World, actor: Actor) -> None:
    """Several collections, with a grace period that may be shorter than the clock skew;
    half the collectors keep the watermarks they read from one collection to the next, as
    the service (``batchweave.lifecycle.collector``) does."""
    marks: dict | None = {} if world.choose(2) else None
    for _ in range(6):
        world.pause((30.0, 5.0, 120.0, 300.0))
        try:
            collect_garbage(world.store, grace_s=world.choices.pick((600.0, 0.0, 60.0)), marks=marks)
        except CorruptDataError as exc:
            if not exc.key.startswith(keys.CHECKPOINT_PREFIX):  # a damaged watermark is refused by name
                world.model.violation("unexpected-error", actor.name, f"CorruptDataError: {exc}")
        except StoreError:
            pass  # the log kept moving under it (several collectors): typed, and it tries again
        except BatchWeaveError as exc:
            if not world.model.stale_error(actor.name, exc):
                world.model.violation("unexpected-error", actor.name, f"{type(exc).__name__}: {exc}")


def damager(world: World, actor: Actor) -> None:
    """Damages what readers and collectors must survive, and re-creates freed log versions
    as a stale writer would (then deletes them again, as its anchor check makes it do)."""
    store = world.store
    for _ in range(8):
        world.pause((60.0, 10.0, 200.0, ALIGNED))  # aligned: as paused writers wake up
        kinds = 8 if world.store.head_copies else 7
        what = world.choose(kinds + 3)  # re-creations weigh 4: the proofs' faults (see _recreate_freed_version)
        if what >= kinds:
            _recreate_freed_version(world)
        elif what == 7:
            _damage_one(world, keys.HEAD_PREFIX, b'{"version": 3, "tgbs": [')
        elif what == 6:
            _stale_ticket(world)
        elif what == 5:
            _forge_summary(world)
        elif what == 0:
            store.put(keys.HINT_KEY, b'{"version": [')
        elif what == 1:
            _damage_one(world, keys.SEGMENT_PREFIX, b"\x78\x9c garbage")
        elif what == 2:
            _damage_one(world, keys.INTENT_PREFIX, b'{"format": "batchweave.intent/1", "tgbs": [')
        elif what == 3:
            key, original = _damage_one(world, keys.CHECKPOINT_PREFIX, b'{"format": 7}', suffix=".json")
            if key is not None and original is not None:
                world.pause((30.0, 300.0))
                store.put(key, original)  # restored: collection may go on
        else:
            _recreate_freed_version(world)


def _damage_one(world: World, prefix: str, garbage: bytes, suffix: str = "") -> tuple[str | None, bytes | None]:
    found = [info.key for info in world.store.list(prefix) if info.key.endswith(suffix)]
    if not found:
        return None, None
    key = found[world.choose(len(found))]
    original = world.store.peek(key)
    world.store.put(key, garbage)
    return key, original


def _stale_ticket(world: World) -> None:
    """An epoch-claim ticket the log has passed (a crashed start's, or one that lost its
    epoch to a claim of its own), and a stray key beside the tickets. Folded, the stale
    one would give a live producer's epoch to an incarnation that never ran."""
    epochs = world.model.epochs
    if not epochs:
        return
    producer = sorted(epochs)[world.choose(len(epochs))]
    layout = Layout(world.config.dp, 1)
    world.store.put(claim_key(producer, epochs[producer], layout, f"{world.choose(1 << 16):x}"), CLAIM_TICKET)
    world.store.put(f"{keys.CLAIM_PREFIX}{producer}/not-a-ticket", b"")


def _forge_summary(world: World) -> None:
    """A collection summary that decodes and lies: it names no TGB at all, under its old
    digest line. Believed, it would make every stored TGB an orphan; the next collection
    must see that the digest does not match, read the log instead, and delete nothing
    the log references."""
    summaries = [info.key for info in world.store.list(keys.GC_PREFIX)]
    if not summaries:
        return
    key = summaries[world.choose(len(summaries))]
    original = world.store.peek(key)
    if original is None:
        return
    body, _, check = bytes(original).rpartition(b"\n")
    forged = json.loads(body)
    forged["tgbs"] = []
    world.store.put(key, json.dumps(forged).encode() + b"\n" + check)


def _recreate_freed_version(world: World) -> None:
    """Re-create a freed version ``n`` with what a writer whose view stopped at ``n-1``
    commits there: a group commit folding every intent that state accepts, or else the
    newest genuine version's TGBs from ``n``'s first step. Stale writers are most often at
    the view of another stale actor (they paused together), so the versions right after
    live actors' views are taken when there are any."""
    freed = [v for v in world.model.genuine_bytes if v > 1 and world.store.peek(version_key(v)) is None]
    if not freed:
        return
    views = set(_views(world))
    after_views = {v + 1 for v in views} & set(freed)
    deep = sorted(v for v in after_views if v + 1 in freed)  # a view two or more versions inside the freed region
    candidates = deep or sorted(after_views) or freed
    version = candidates[world.choose(len(candidates))]
    stale_versions = [version]
    if version - 1 in views and version - 1 in freed and world.choose(3) == 0:
        # The view's own version too: an actor's anchor re-created with other bytes (I8, I10),
        # the one case the anchor's digest is checked for.
        stale_versions.insert(0, version - 1)
    put = [v for v in stale_versions if _put_stale(world, v)]
    # The stale writers' anchor checks fail and they delete their puts; a slow one holds its
    # put for as long as a reader that no checkpoint protects may pause.
    world.pause((5.0, 60.0, 600.0))
    for stale_version in put:
        world.store.delete(version_key(stale_version))


_READERS = ("lag", "resume", "train")


def stale_writer_racing_reads(world: World) -> Callable[[str, str], None]:
    """A reader's read of a freed version, and a stale writer's put there landing just
    before it (one time in four): garbage collection passed the reader between two of its
    requests, and what the reader reads next is not genuine. Its proof must say so, whether
    it anchors on a version it read or, from step 0, on version 1 (the proofs' faults)."""

    def before_get(actor: str, key: str) -> None:
        match = VERSION_KEY.fullmatch(key)
        if match is None or role(actor) not in _READERS:
            return
        version = int(match[1])
        if version <= 1 or version not in world.model.genuine_bytes or world.store.peek(key) is not None:
            return
        if world.choose(4) == 0:
            world.store.plant(key, log.encode(_stale_version(world, version)), "stale")

    return before_get


def _stale_version(world: World, version: int) -> log.LogVersion:
    stale = _stale_fold(world, version) if world.choose(2) == 0 else None
    return _stale_copy(world, version) if stale is None else stale


def _put_stale(world: World, version: int) -> bool:
    """A stale writer's put of ``version`` (freed) with other bytes; False if it lost the race."""
    stale = _stale_version(world, version)
    try:
        world.store.put_if_absent(version_key(version), log.encode(stale))
    except StoreError:
        return False
    copy_data = encode_copy(version, own_namespace(world), log.encode(stale))
    for copy in range(world.store.head_copies):  # as a writer that copied before its anchor check would
        world.store.put(keys.head_copy_key(version, copy), copy_data)
    return True


def _views(world: World) -> list[int]:
    """The log versions live producers and readers last read (peeked, not scheduled)."""
    views = [producer.log_version for producer in world.producers.values()]
    for actor in world.scheduler.actors:
        consumer = actor.notes.get("consumer")
        if actor.alive and consumer is not None and consumer.reading_version is not None:
            views.append(consumer.reading_version)
    return views


def _stale_fold(world: World, version: int) -> log.LogVersion | None:
    """A group commit after the genuine state at ``version - 1``, of the intents now listed."""
    state = world.model.states.get(version - 1)
    if state is None:
        return None
    intents = []
    for key, (body, _) in sorted(world.store.objects.items()):
        if key.startswith(keys.INTENT_PREFIX):
            try:
                intents.append(decode_intent(body, key))
            except CorruptDataError:
                continue
    me = ProducerState(0, 0, "stale")
    return build_group_commit(state, "stale-writer", me, [], intents, world.scheduler.clock.now)


def _stale_copy(world: World, version: int) -> log.LogVersion:
    """The newest genuine version's TGBs, renumbered to start at ``version``'s first step."""
    model = world.model
    original = log.decode_version(model.genuine_bytes[version], version_key(version), version)
    newest = max(model.genuine_bytes)
    donor = log.decode_version(model.genuine_bytes[newest], version_key(newest), newest)
    return msgspec.structs.replace(
        donor, version=version, first_step=original.first_step, namespace="", layout=None, committed_at=0.5
    )


def ender(world: World, actor: Actor) -> None:
    """Ends the stream once every producer is done (or after ``end_after_s``)."""
    waited = 0.0
    while world.producers_running() and waited < world.config.end_after_s:
        world.scheduler.sleep(30.0)
        waited += 30.0
    end_stream(world.store)
    world.ended_at = world.scheduler.clock.now
