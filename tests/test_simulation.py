"""Deterministic simulation of the whole protocol (issue 18; ``batchweave.testing.simulation``).

The real producers (direct and group commit), consumers (checkpointed training ranks,
a lagging evaluation reader, readers resumed from saved cursors), collectors and a
damager run as greenlets on a simulated store and a virtual clock; a seeded scheduler
picks which pending store operation completes next, and the model of the genuine log
is checked after every step (docs/invariants.md, I1-I13). Here:

- a bounded exploration of fixed seeds for every shape (``make soak``: BATCHWEAVE_SOAK
  times as many), which fails on any violation;
- replay is exact, in this process and in another with another hash seed;
- every check can fail: each sabotage of the real code below is reported as its kind,
  on a seed where the unsabotaged run does not report it, and shrinks;
- a namespace lies inside the run's, at ``<root>/data`` (``actors.plant_inner_namespace``):
  no actor deletes or rewrites one of its keys (I13; the issue-43 collector did);
- one regression per violation found while it was built (the I10 bugs of issue 18, all
  fixed), its shrunk schedule pinned in tests/simulation/ or its seed named. A pinned
  schedule replays the same interleaving only while the code issues the same store
  operations; each still failed on the code before the fixes, and the exploration guards
  the rest.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from soak import FACTOR

import batchweave.commit.claims
import batchweave.lifecycle.gc
import batchweave.log
import batchweave.logrules
import batchweave.reading.fetch
import batchweave.reading.follower
from batchweave import keys
from batchweave.commit.shared import SharedState
from batchweave.journal.headcopies import encode_copy
from batchweave.journal.objects import LogObjects
from batchweave.lifecycle.gcsummary import GCSummary
from batchweave.reading import nodeclient, nodetrust, nodewire
from batchweave.reading.sharedlog import SharedLog
from batchweave.testing.simulation import SHAPES, Choices, simulate
from batchweave.testing.simulation.pins import Point, reached
from batchweave.testing.simulation.shrink import format_trace, shrink
from batchweave.testing.simulation.store import SimStore

SCHEDULES = Path(__file__).parent / "simulation"
# 40 seeds of each shape: 3-6 s of one free core per shape. 80 took about 70 s of CPU
# in all, a fifth of what the suite's own processes spend; `make soak` runs ten times as many.
SEEDS_PER_SHAPE = 40
# The hub sabotages are looked for in the first 80 hub seeds: each search stops at its
# first hit (the comment above HUB_SABOTAGES), so the wider bound costs nothing.
HUB_SABOTAGE_SEEDS = 80


def _explain(result, seed, shape) -> str:
    first = result.violations[0]
    return (
        f"{first}\nreplay: python -m batchweave.testing.simulation --shape {shape} --replay {seed} "
        f"--shrink --story\n{format_trace(result, 40, story=True)}"
    )


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fixed_seeds_find_no_violation(shape):
    ops = 0
    for seed in range(SEEDS_PER_SHAPE * FACTOR):
        result = simulate(Choices(seed=seed), SHAPES[shape])
        ops += result.ops
        assert not result.violations, _explain(result, seed, shape)
    assert ops > 100 * SEEDS_PER_SHAPE  # the runs did something


def test_producers_write_packs_in_the_simulation():
    """Packs (several TGBs sharing objects) are part of the runs, so collection and readers
    meet shared objects under every schedule (the sabotage of ``doomed_objects`` below
    shows a collector that deletes one too early is caught)."""
    packs = [simulate(Choices(seed=seed)).notes["packs"] for seed in range(6)]
    assert sum(packs) > 0 and sum(count > 0 for count in packs) >= 3, packs


def test_a_seed_replays_exactly_from_its_choices():
    first = simulate(Choices(seed=3))
    again = simulate(Choices(replay=first.choices))
    assert again.trace == first.trace and again.violations == first.violations
    assert first.ops > 200 and first.notes["steps"] > 0


def test_a_seed_replays_exactly_in_another_process():
    """No set order, id() or wall clock leaks into a run: another hash seed, the same run."""
    code = (
        "from batchweave.testing.simulation import Choices, simulate; import hashlib; "
        "print(hashlib.sha256(repr(simulate(Choices(seed=3)).trace).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    import hashlib

    assert out.stdout.strip() == hashlib.sha256(repr(simulate(Choices(seed=3)).trace).encode()).hexdigest()


# -- every check can fail --------------------------------------------------------------


def _wrong_bytes(decode):
    def decode_slice(*args, **kwargs):
        data = decode(*args, **kwargs)
        return data + b"!" if isinstance(data, bytes) else data

    return decode_slice


def _one_step_too_far(plan):
    def plan_reclaim(journal, state, w_global):
        target = plan(journal, state, w_global)
        return batchweave.log.Reclaim(min(target.steps + 1, state.steps), target.versions, target.bytes)

    return plan_reclaim


def _pack_deleted_with_its_first_tgb(doomed_objects):
    def doomed_ignoring_later_readers(tgbs, below):  # as if each TGB had objects of its own
        return doomed_objects({step: tgb for step, tgb in tgbs.items() if step < below}, below)

    return doomed_ignoring_later_readers


def _every_unreferenced_key_an_orphan(orphans):
    def orphans_whoever_wrote_them(listed, state, referenced, grace_s, now):  # the collector before I13
        mine, foreign = orphans(listed, state, referenced, grace_s, now)
        sizes = {info.key: info.size for info in listed}
        return {**mine, **{key: sizes[key] for key in foreign}}, set()

    return orphans_whoever_wrote_them


def _no_end_marker(build):
    return lambda state, committed_at: batchweave.logrules.next_version(state, committed_at)


def _takes_one_more(take):
    def take_one_more(self, state):
        mine = state.producers.get(self.producer_id)
        if mine is not None:
            producers = {**state.producers, self.producer_id: msgspec.structs.replace(mine, offset=mine.offset + 1)}
            state = msgspec.structs.replace(state, producers=producers)
        return take(self, state)

    return take_one_more


def _unchecked_summary(decode):
    def decode_summary(data, key):  # the digest line ignored
        return msgspec.json.decode(bytes(data).rpartition(b"\n")[0], type=GCSummary)

    return decode_summary


def _any_ticket(foldable):
    def folds_every_ticket(state, tickets, layout):
        return list({t.producer: t for t in sorted(tickets, key=lambda t: t.key, reverse=True)}.values())

    return folds_every_ticket


def _jumps_over_claims(jump_to):
    def jump_over_anything(state, head, digest, own=()):  # as if nothing had changed since the view
        if head.changed_at is not None and state.changed_at is not None:
            head = msgspec.structs.replace(head, changed_at=min(head.changed_at, state.version))
        return jump_to(state, head, digest, own)

    return jump_over_anything


SABOTAGES = {
    # (module, attribute, wrapper, the kind the model must report)
    "a consumer hands out other bytes": (batchweave.reading.fetch, "decode_slice", _wrong_bytes, "wrong-step"),
    "collection reclaims past W_global": (
        batchweave.lifecycle.gc,
        "_plan_reclaim",
        _one_step_too_far,
        "deleted-reachable",
    ),
    "collection believes a summary whose digest does not match": (
        batchweave.lifecycle.gc,
        "decode_summary",
        _unchecked_summary,
        "deleted-reachable",
    ),
    "collection deletes a pack a later step still reads": (
        batchweave.lifecycle.gc,
        "doomed_objects",
        _pack_deleted_with_its_first_tgb,
        "deleted-reachable",
    ),
    "collection takes the keys of the namespace inside its own for orphans": (
        batchweave.lifecycle.gc,
        "_orphans",
        _every_unreferenced_key_an_orphan,
        "deleted-foreign",
    ),
    "end_stream writes no marker": (batchweave.logrules, "build_end_of_stream", _no_end_marker, "waits-forever"),
    "a producer counts one TGB too many": (SharedState, "take", _takes_one_more, "producer-ahead"),
    "a producer jumps to the head over a claim": (
        batchweave.logrules,
        "jump_to",
        _jumps_over_claims,
        "unexpected-error",
    ),
    "a claim folds a ticket whose epoch the log has passed": (
        batchweave.commit.claims,
        "foldable",
        _any_ticket,
        "unexpected-error",
    ),
}


@pytest.mark.parametrize("sabotage", sorted(SABOTAGES))
def test_every_check_reports_a_sabotage_and_shrinks_it(sabotage, monkeypatch):
    owner, name, wrap, kind = SABOTAGES[sabotage]
    failing = None
    # The first seed that is clean of this kind and reports it once sabotaged (not every
    # schedule reaches the sabotaged code where it matters).
    for seed in range(40):
        if kind in simulate(Choices(seed=seed)).kinds:
            continue
        with monkeypatch.context() as sabotaged:
            sabotaged.setattr(owner, name, wrap(getattr(owner, name)))
            result = simulate(Choices(seed=seed))
        if kind in result.kinds:
            failing = result
            break
    assert failing is not None, f"{sabotage}: not reported on any of seeds 0-39"
    monkeypatch.setattr(owner, name, wrap(getattr(owner, name)))  # for the shrinking
    shrunk = shrink(failing, SHAPES["mixed"], kind, budget_s=None, budget_runs=30)  # work, not seconds
    assert kind in shrunk.kinds and len(shrunk.choices) <= len(failing.choices)


def test_the_shrinker_shortens_a_failing_schedule_within_a_budget_of_runs(monkeypatch):
    """Shrinking makes progress within a budget counted in runs (the same on a loaded
    machine): a schedule in which end_stream writes no marker, to a much shorter one."""
    owner, name, wrap, kind = SABOTAGES["end_stream writes no marker"]
    monkeypatch.setattr(owner, name, wrap(getattr(owner, name)))
    failing = next(r for r in (simulate(Choices(seed=seed)) for seed in range(40)) if kind in r.kinds)
    shrunk = shrink(failing, SHAPES["mixed"], kind, budget_s=None, budget_runs=30)
    assert kind in shrunk.kinds and len(shrunk.choices) < len(failing.choices) * 2 // 3


def test_a_node_follower_that_skips_its_proofs_is_caught(monkeypatch):
    """The node shape's readers get their versions through a shared node follower: one
    that used what it read unproven is reported (as the rank's own follower would be)."""
    monkeypatch.setattr(batchweave.reading.follower.ProvenLog, "prove", lambda self, lowest, newest: None)
    kinds = set()
    # Seeds 0-299 find both since ranks hand batches out as soon as their proof starts
    # (reads beside proofs): seed 299 shows the wrong step; 0-61 did before.
    for seed in range(600):
        kinds |= simulate(Choices(seed=seed), SHAPES["node"]).kinds
        if {"wrong-step", "waits-forever"} <= kinds:
            break
    assert {"wrong-step", "waits-forever"} <= kinds


def test_head_copies_written_before_the_put_is_known_to_have_won_are_caught(monkeypatch):
    """The copies shape's committers write head copies (``journal.headcopies``) and its node
    followers read them at the head. A committer that copied its version before its
    create-only put won hands the followers versions that lost their race."""
    reads = collections.Counter()
    original_get = SimStore.get

    def counting_get(self, key):
        reads[key.startswith(keys.HEAD_PREFIX)] += 1
        return original_get(self, key)

    monkeypatch.setattr(SimStore, "get", counting_get)
    assert not simulate(Choices(seed=0), SHAPES["copies"]).violations
    assert reads[True] > 0  # the followers read copies

    original_put = LogObjects.put_if_absent
    namespaces: dict[int, str] = {}  # the id of each run's namespace (by its store), once version 1 won

    def copy_first(self, key, data):
        if (match := re.fullmatch(r"_log/(\d{20})\.json", key)) is None:
            return original_put(self, key, data)
        version = int(match[1])
        namespace = (
            batchweave.log.decode_version(data, key, 1).namespace
            if version == 1
            else namespaces.get(id(self.store), "")
        )
        for copy in range(self.store.head_copies):  # as the committer's own copies name its namespace
            self.store.put(keys.head_copy_key(version, copy), encode_copy(version, namespace, data))
        won = original_put(self, key, data)
        if won and version == 1:
            namespaces[id(self.store)] = namespace
        return won

    monkeypatch.setattr(LogObjects, "put_if_absent", copy_first)
    # Seeds 0-79 catch it in 58 (seed 0 first).
    assert any("wrong-step" in simulate(Choices(seed=seed), SHAPES["copies"]).kinds for seed in range(20))


def _trusts_any_user(check_uid):
    return lambda pid, uid, what: None


def _waits_forever(bound_s):
    return math.inf


def _drops_a_replys_first_version(log_versions):
    """The wire cuts a reply of several versions one version late: the rank is handed the
    versions after the first, numbered from the first."""
    return lambda payload, sizes, first: (
        log_versions(payload[sizes[0] :], sizes[1:], first) if len(sizes) > 1 else log_versions(payload, sizes, first)
    )


def _old_ask(ask):
    """The node's follower before I11: a lower ask restarts it (for everyone), and a rank
    with nothing proven left hears the follower's failure as its own error."""

    def restart_lower_and_relay(self, rank, first):
        if self._failure is not None:
            raise self._failure
        if self._base is not None and first < self._base:
            return self._restart(rank, first)
        return ask(self, rank, first)

    return restart_lower_and_relay


HUB_SABOTAGES = {
    # (module, attribute, wrapper, the kind the model must report): the guard of each fault
    # of the hub shape's channels (hubchannel.FAULTS). Found on hub seeds 0-79 by, first:
    # forge 4 (17 seeds), stall 1 (23), drop 2 (14), poison 14 (5: 14, 31, 36, 53, 75).
    "forge: a hub of another user is trusted": (nodetrust, "check_uid", _trusts_any_user, "wrong-step"),
    "stall: a silent hub is waited for without bound": (nodeclient, "HUB_REPLY_S", _waits_forever, "waits-forever"),
    "drop: a lost hub is waited for without bound": (nodeclient, "TAKEOVER_S", _waits_forever, "waits-forever"),
    "wire: a log reply is cut wrong (every reply goes through nodewire's codec)": (
        nodewire,
        "log_versions",
        _drops_a_replys_first_version,
        "unexpected-error",
    ),
    "poison: a nonsense request pulls the node's follower back and fails its ranks": (
        SharedLog,
        "ask",
        _old_ask,
        "deleted-reachable",
    ),
}


@pytest.mark.parametrize("sabotage", sorted(HUB_SABOTAGES))
def test_every_fault_of_a_hub_channel_is_caught_once_its_guard_is_sabotaged(sabotage, monkeypatch):
    """The hub shape's ranks reach their node's follower over channels that may be forged
    (another user's process), stall, drop or carry another requester's nonsense (I11). Each
    guard, sabotaged in the real code, is reported on some seed the exploration runs clean."""
    owner, name, wrap, kind = HUB_SABOTAGES[sabotage]
    monkeypatch.setattr(owner, name, wrap(getattr(owner, name)))
    assert any(kind in simulate(Choices(seed=seed), SHAPES["hub"]).kinds for seed in range(HUB_SABOTAGE_SEEDS)), (
        f"{sabotage}: not reported on any of hub seeds 0-{HUB_SABOTAGE_SEEDS - 1}"
    )


# -- the violations found, pinned -----------------------------------------------------


def _replay_pinned(name: str) -> None:
    """The protocol holds on the pinned schedule (it fails with the violation while the bug
    is there: ``python -m batchweave.testing.simulation --choices tests/simulation/NAME.json
    --story --trace 0`` shows what happens)."""
    pinned = json.loads((SCHEDULES / f"{name}.json").read_text())
    result = simulate(Choices(replay=pinned["choices"]), SHAPES[pinned["shape"]])
    assert not result.violations, _explain(result, pinned["seed"], pinned["shape"])
    point = Point(**pinned["point"])
    # A replay follows its choices only while the code makes the same calls: one that no
    # longer reaches its point would pass without testing anything.
    assert reached(result.trace, point), (
        f"tests/simulation/{name}.json no longer reaches its point ({point.describe()}): the actors make "
        f"other calls now. Pin it anew: python -m batchweave.testing.simulation --repin tests/simulation/{name}.json"
    )


def test_idle_group_producer_never_adopts_a_stale_fold_from_a_freed_key():
    """g0 and g1 pause at the same version; collection frees the versions after it; g0 wakes
    and folds g1's intent into a freed key; g1 wakes, follows the log, reads that fold,
    drops its pending TGB and deletes its intent: the TGB is lost."""
    _replay_pinned("producer-ahead")


def test_commit_retried_after_a_timeout_never_lands_in_a_freed_key():
    """Found here, and on main at d280ab3 too (ambiguous seed 1512 there). A direct producer
    paused at version v wakes after collection freed v+1..: it puts v+1 (a freed key), its
    anchor is gone, it reloads (the journal's anchor moves to a recent snapshot) and deletes
    its put; its next put times out (lost). Its retry starts again from the producer's own
    state, still v: v+1 is missing, so it puts v+1 once more, and the anchor check passes,
    since the anchor is newer than the put and was never deleted. flush() returns; the
    TGBs sit in a version no reader reads. Fixed: a journal handed a state older than its
    anchor reloads first (tests/test_proven_views.py has the same with a forced timeout)."""
    _replay_pinned("flush-lost")


def test_a_commit_whose_proof_failed_after_its_put_landed_is_never_committed_again():
    """Found by tests/test_latency.py's chaos run, then here (ambiguous seed 794, shrunk):
    direct producer p0.2's put of version 8 lands and says so, the read of its anchor that
    proves it fails, so the commit raises; g0.1 commits version 9; p0.2's retry jumps from
    version 7 to the head, 9, and commits its TGBs of version 8 again in version 10 (I3).
    Fixed: a journal keeps its own put as possibly landed until a view through it, not
    only while the put has not answered (``Journal._own_landed``)."""
    _replay_pinned("own-put-after-failed-proof")


def test_a_put_the_store_retried_into_its_own_landed_version_is_never_committed_again():
    """Found by the same chaos run once the one above was fixed, then here (ambiguous seed
    12, shrunk): p1.1's put of version 4 lands, its answer is lost, and the store's retry
    finds the key taken, by that put; p1.1 sees a lost race, g0.1 commits version 5, and
    p1.1 jumps from version 3 to 5 and commits its TGBs again in version 6 (I3). Fixed: a
    lost race after a retry is "maybe ours" (``ObjectExistsError.after_retry``), and the
    jump reads that version first."""
    _replay_pinned("own-put-retried-by-the-store")


def test_lagging_reader_never_delivers_a_version_re_created_in_a_freed_key():
    """A reader no checkpoint protects pauses; collection deletes the versions after its
    cursor; a stale writer re-creates one of those keys (the damager, as a stale producer
    would); the reader delivers it as its next step."""
    _replay_pinned("wrong-step")


def test_lagging_reader_never_delivers_a_stale_group_commit():
    """The same with a real stale writer (unshrunk: mixed seed 152): group producer g0.2,
    paused across a collection, commits into a freed key; the lagging reader delivers it."""
    _replay_pinned("stale-group-commit")


def test_reader_never_ends_early_at_a_re_created_end_marker():
    """Unshrunk (mixed seed 1833): a resumed reader polls a version collection deleted; a
    stale writer re-creates it with an end-of-stream marker; the reader stops 16 steps early."""
    _replay_pinned("early-end")


def test_reader_overtaken_by_collection_raises_instead_of_waiting_forever():
    """A lagging reader's next version is deleted by collection: it polls it as if it were
    the head, forever, instead of raising DataReclaimedError."""
    _replay_pinned("waits-forever")


def test_group_producer_reading_a_re_created_version_reloads_instead_of_failing():
    """A paused group producer wakes and follows the log into a version a stale writer
    re-created in a freed key, and fails with CorruptDataError ("skips offsets"): the log is
    fine; its view is stale, and it should reload."""
    _replay_pinned("stale-read-producer")


def test_resumed_reader_reading_a_re_created_version_raises_data_reclaimed():
    """A reader resumed from an old cursor polls a version collection deleted; a stale
    writer re-creates it; the reader raises CorruptDataError ("the log was forked") instead
    of DataReclaimedError."""
    _replay_pinned("stale-read-reader")


def test_a_run_uses_its_own_intent_readers_whatever_the_process_made_before():
    """The process's shared intent-reader pool, made by an earlier group producer of this
    process, is not the simulation's: a run reads intents inline, as a fresh process does,
    and leaves the process's pool as it found it."""
    import hashlib

    import batchweave.commit.intents

    real = batchweave.commit.intents.IntentBoard._reader(None)  # what a group producer here made
    code = (
        "from batchweave.testing.simulation import Choices, SHAPES, simulate; import hashlib; "
        "print(hashlib.sha256(repr(simulate(Choices(seed=5), SHAPES['group']).trace).encode()).hexdigest())"
    )
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    here = simulate(Choices(seed=5), SHAPES["group"])
    assert batchweave.commit.intents._shared is real
    assert hashlib.sha256(repr(here.trace).encode()).hexdigest() == fresh


# -- the simulation's clock and dice reach every actor's code ---------------------------

# The packages whose code the simulation's actors run (producers, group committers,
# readers, node followers, collectors, over the simulated store).
SIMULATED = (
    "batchweave.producer",
    "batchweave.consumer",
    "batchweave.logrules",
    "batchweave.commit",
    "batchweave.journal",
    "batchweave.reading",
    "batchweave.lifecycle",
    "batchweave.store",
)
NONDETERMINISTIC = ("time", "random", "uuid", "secrets")
# Modules of those packages that use one of them although no simulated actor runs them.
NOT_RUN_BY_ACTORS = {
    "batchweave.reading.nodeclient": "ranks share a node through InlineNode (behind a HubChannel), not a socket",
    "batchweave.reading.nodehub": "likewise: the hub is a real server, tested with real processes in test_node",
    "batchweave.store.backends": "the simulated store never builds an obstore backend",
    "batchweave.store.credentials": "nor resolves credentials",
    "batchweave.store.localfs": "nor writes a local directory",
    # Its loop, clock and thread are a service's; the collectors run collect_garbage with
    # the watermark cache it keeps between runs (actors.collector).
    "batchweave.lifecycle.collector": "collectors call collect_garbage as its loop does",
}


def _modules_using_nondeterminism() -> dict[str, set[str]]:
    import ast
    import importlib
    import pkgutil

    found: dict[str, set[str]] = {}
    for top in SIMULATED:
        module = importlib.import_module(top)
        names = [top]
        if hasattr(module, "__path__"):
            names += [f"{top}.{info.name}" for info in pkgutil.iter_modules(module.__path__)]
        for name in names:
            tree = ast.parse(Path(importlib.import_module(name).__file__).read_text())
            imported = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
            used = imported & set(NONDETERMINISTIC)
            if used:
                found[name] = used
    return found


def test_every_module_an_actor_runs_gets_the_simulated_clock_and_dice():
    """Code moved to a new module keeps the simulation deterministic only if the new module
    is patched too (a miss shows as a flaky run, or a hang on a real sleep)."""
    import importlib
    import random
    import secrets
    import time
    import uuid

    from batchweave.testing.simulation.determinism import deterministic
    from batchweave.testing.simulation.scheduler import Scheduler, VirtualClock

    real = {"time": time, "random": random, "uuid": uuid, "secrets": secrets}
    users = _modules_using_nondeterminism()
    assert "batchweave.producer" in users and len(users) > 10  # the scan found them
    unpatched = []
    with deterministic(Scheduler(Choices(seed=0), VirtualClock(), 0, 0), random.Random(0)):
        for name, used in sorted(users.items()):
            module = importlib.import_module(name)
            for what in sorted(used):
                if getattr(module, what) is real[what] and name not in NOT_RUN_BY_ACTORS:
                    unpatched.append(f"{name}.{what}")
    assert unpatched == [], "patch these in testing/simulation/determinism.py (or say why no actor runs them)"


def test_the_retry_loop_of_a_store_draws_from_the_simulated_clock_and_dice():
    """Regression: the retry loop's clock, pause and jitter were bound to the real ones
    when the class was made, out of reach of the module patches: a simulated store that
    failed transiently would have replayed differently each time."""
    import random

    from batchweave.store import Store
    from batchweave.testing.simulation.determinism import deterministic
    from batchweave.testing.simulation.scheduler import Scheduler, VirtualClock

    clock = VirtualClock()
    store = Store("memory://retry-draws")
    with deterministic(Scheduler(Choices(seed=0), clock, 0, 0), random.Random(7)):
        draws = [store._retry_draw() for _ in range(3)]
        now = store._retry_clock()
    expected = random.Random(7)
    assert draws == [expected.random() for _ in range(3)]
    assert now == clock.now - 1_600_000_000.0  # the simulated monotonic clock


@pytest.mark.parametrize(("shape", "seed"), [("node", 10080), ("hub", 10065), ("hub", 10140)])
def test_ranks_of_a_node_whose_follower_fails_at_a_reclaimed_start_read_alone_instead_of_spinning(shape, seed):
    """The node's follower, started at a version GC had reclaimed, failed; the rank that
    asked restarted it at the same place at once, for ever (the run hit max_ops without a
    pause). The rank now reads alone and hears its own error."""
    result = simulate(Choices(seed=seed), SHAPES[shape])
    assert result.finished and not result.violations, _explain(result, seed, shape)


def test_a_pinned_point_is_reached_only_in_the_order_it_names():
    """What ``_replay_pinned`` checks, on hand-made traces: a replay that drifted (no
    re-creation, or the read before it, or another actor reading) does not reach it."""
    key = "_log/00000000000000000007.json"
    deleted, put, read = (1.0, "gc0", "delete", key), (2.0, "damage", "put_if_absent", key), (3.0, "lag0", "get", key)
    re_created = Point("reads-re-created", "lag")
    assert reached([deleted, put, read], re_created)
    assert not reached([deleted, read, put], re_created)  # read while freed: the other point
    assert reached([deleted, read, put], Point("reads-freed", "lag"))
    assert not reached([put, read], re_created)  # never freed: an ordinary put and read
    assert not reached([deleted, put, (3.0, "train0.1", "get", key)], re_created)
    assert not reached([deleted, put, (2.5, "gc1", "delete", key), read], re_created)
    assert reached([deleted, (2.0, "p1.2", "put_if_absent", key)], Point("puts-freed", "p"))
    with pytest.raises(ValueError, match="unknown pinned point"):
        Point("reads-anything", "lag")
