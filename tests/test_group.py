"""Group commit (issue 10): intents, folding, turns, and exactly-once under forced races.

The pure half (``batchweave.commit.group``) is tested with values; the producer's group mode
on real stores (memory and a local directory), with the races forced by
``interleave.PausingStore``.
"""

from __future__ import annotations

import math
import random
import threading
import time

import msgspec
import pytest
from checks import assert_exactly_once
from hypothesis import given, settings
from hypothesis import strategies as st
from worker import origin_of, tgb

import batchweave as bw
from batchweave import intent as intents
from batchweave import keys, logrules
from batchweave.commit import group
from batchweave.commit.group import GroupCommit
from batchweave.errors import ConfigError, CorruptDataError, ProducerFencedError
from batchweave.intent import INTENT_FORMAT, Intent
from batchweave.journal import Journal
from batchweave.log import Layout, LogState, ProducerState, TGBDescriptor
from batchweave.store import open_store
from batchweave.testing.interleave import Background, PausingStore

VERSION_KEY = r"_log/\d{20}\.json"


def desc(producer: str, offset: int, epoch: int = 1, dp: int = 1) -> TGBDescriptor:
    return TGBDescriptor(
        producer=producer,
        epoch=epoch,
        source_offset=offset,
        dp=dp,
        cp=1,
        kind="arrays",
        objects=[f"data/{producer}/e{epoch:06d}/{offset:012d}-t.0.bwb"],
        slices=[(0, 0, 10, 0)] * dp,
        nbytes=10 * dp,
    )


def intent(producer: str, first: int, count: int, epoch: int = 1) -> Intent:
    return Intent(INTENT_FORMAT, producer, epoch, [desc(producer, o, epoch) for o in range(first, first + count)])


def state_with(**producers: tuple[int, int]) -> LogState:
    """A state whose producers have (next offset, epoch); layout dp=1 cp=1."""
    return LogState(
        version=5,
        steps=sum(o for o, _ in producers.values()),
        producers={p: ProducerState(o, e, f"inc-{p}", last_version=5) for p, (o, e) in producers.items()},
        layout=Layout(1, 1),
    )


# -- pure: keys, decoding, folding -----------------------------------------------------


def test_intent_key_round_trips_and_rejects_other_keys():
    key = intents.intent_key("pool.0003-of-0008", 12, 345)
    assert key == "_intents/pool.0003-of-0008/e000012/000000000345.json"
    assert intents.parse_intent_key(key) == ("pool.0003-of-0008", 12, 345)
    for other in (
        "_log/00000000000000000001.json",
        "_intents/p/e1/x.json",
        "_intents/p/000001.json",
        "_intents/p/7/1.json",
    ):
        assert intents.parse_intent_key(other) is None


def test_intent_decodes_back_and_damage_names_the_key():
    it = intent("a", 3, 2)
    key = intents.intent_key("a", 1, 3)
    assert intents.decode_intent(intents.encode_intent(it), key) == it
    with pytest.raises(CorruptDataError, match="e000001/000000000003"):
        intents.decode_intent(b"{not json", key)


@pytest.mark.parametrize(
    "bad, problem",
    [
        (intent("a", 3, 2), "under this key"),  # stored under another producer's key below
        (Intent(INTENT_FORMAT, "b", 1, [desc("b", 0), desc("b", 2)]), "breaks the intent"),  # a gap
        (Intent(INTENT_FORMAT, "b", 1, [desc("b", 0), desc("b", 1, epoch=2)]), "breaks the intent"),
        (Intent(INTENT_FORMAT, "b", 1, []), "no TGB"),
        (Intent("batchweave.intent/99", "b", 1, [desc("b", 0)]), "unsupported intent format"),
    ],
)
def test_malformed_intents_are_refused(bad, problem):
    with pytest.raises(CorruptDataError, match=problem):
        intents.decode_intent(msgspec.json.encode(bad), intents.intent_key("b", 1, 0))


def test_fold_takes_intents_that_continue_each_producer_in_order():
    state = state_with(a=(4, 1), b=(0, 2), c=(7, 1))
    folded = group.fold_intents(
        state,
        [
            intent("a", 6, 2),  # chained after the next one
            intent("a", 4, 2),
            intent("b", 0, 3, epoch=1),  # a fenced epoch: never
            intent("c", 9, 1),  # a gap after offset 7: not yet
            intent("d", 0, 1),  # a producer the state does not know: not caught up
        ],
    )
    assert {p: [t.source_offset for t in ts] for p, ts in folded.items()} == {"a": [4, 5, 6, 7]}


def test_fold_takes_only_the_suffix_a_producer_has_not_committed_itself():
    folded = group.fold_intents(state_with(a=(5, 1)), [intent("a", 3, 4), intent("a", 0, 3)])
    assert [t.source_offset for t in folded["a"]] == [5, 6]


def test_fold_skips_tgbs_of_another_layout():
    state = state_with(a=(0, 1))
    wide = Intent(INTENT_FORMAT, "a", 1, [desc("a", 0, dp=2)])
    assert group.fold_intents(state, [wide]) == {}


def test_group_version_applies_and_records_every_folded_producer():
    state = state_with(a=(4, 1), b=(2, 3), me=(10, 2))
    state = msgspec.structs.replace(
        state, producers={**state.producers, "b": msgspec.structs.replace(state.producers["b"], metrics={"x": 1.0})}
    )
    me = state.producers["me"]
    own = [desc("me", 10, epoch=2), desc("me", 11, epoch=2)]
    intents = [intent("b", 2, 1, epoch=3), intent("a", 4, 2), intent("me", 10, 5, epoch=2)]  # its own: ignored
    version = group.build_group_commit(state, "me", me, own, intents, 123.0, {"attempts": 1.0})
    assert version is not None
    assert all(p.last_version == 0 for p in version.producers.values())  # the log stamps it; versions never carry it
    assert [(t.producer, t.source_offset) for t in version.tgbs] == [
        ("a", 4),
        ("a", 5),
        ("b", 2),
        ("me", 10),
        ("me", 11),
    ]
    after = logrules.apply_version(state, version, keys.version_key(version.version))  # the log's own rules accept it
    assert {p: (s.offset, s.epoch) for p, s in after.producers.items()} == {"a": (6, 1), "b": (3, 3), "me": (12, 2)}
    assert after.producers["b"].metrics == {"x": 1.0}  # another producer's published counters are kept
    assert after.producers["me"].metrics == {"attempts": 1.0}
    assert after.producers["a"].incarnation == "inc-a" and after.steps == state.steps + 5


def test_group_version_with_nothing_to_fold_is_none():
    state = state_with(a=(4, 1), me=(0, 1))
    assert group.build_group_commit(state, "me", state.producers["me"], [], [intent("a", 0, 2)], 1.0) is None


def test_turns_give_rank_zero_to_exactly_one_active_producer_and_rotate():
    state = state_with(**{f"p{i}": (0, 1) for i in range(5)})
    for version in range(5, 12):
        at = msgspec.structs.replace(state, version=version)
        ranks = sorted(group.turn_rank(at, f"p{i}", 8) for i in range(5))
        assert ranks == [0, 1, 2, 3, 4]
    firsts = {
        next(p for p in state.producers if group.turn_rank(msgspec.structs.replace(state, version=v), p, 8) == 0)
        for v in range(5, 10)
    }
    assert len(firsts) == 5  # five versions, five different first committers


def test_idle_producers_leave_the_rotation():
    state = state_with(busy=(3, 1), idle=(1, 1), me=(0, 1))
    producers = dict(state.producers)
    producers = {p: msgspec.structs.replace(s, last_version=19) for p, s in producers.items()}
    producers["idle"] = msgspec.structs.replace(producers["idle"], last_version=1)
    state = msgspec.structs.replace(state, version=20, producers=producers)
    ranks = {p: group.turn_rank(state, p, 8) for p in ("busy", "me")}
    assert sorted(ranks.values()) == [0, 1]  # two in the rotation: the idle one is not waited for
    assert group.turn_rank(state, "idle", 8) == 2  # after every active one
    assert group.turn_rank(state, "newcomer", 8) in (2, 3)  # one not in the log yet, likewise


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(0, 40))
def test_every_version_has_exactly_one_rank_0_and_distinct_ranks(last_versions, version):
    """Whoever the log recorded lately, all producers agree on one order: one rank 0 and
    no two producers at the same rank (at 128 producers after their claims, producers
    outside the recent ones each counted themselves in, and a dozen had rank 0)."""
    producers = {
        f"p{i:03d}": ProducerState(0, 1, f"i{i}", last_version=min(v, version)) for i, v in enumerate(last_versions)
    }
    state = LogState(version=version, steps=0, producers=producers, layout=Layout(1, 1))
    ranks = sorted(group.turn_rank(state, p, 8) for p in producers)
    assert ranks == list(range(len(producers)))


def test_turn_waits_grow_by_one_stagger_per_rank():
    policy = GroupCommit(interval_s=0.5, stagger_s=0.2, rng=random.Random(1))
    waits = [policy.wait_after_version_s(rank) for rank in range(4)]
    for rank, wait in enumerate(waits):
        assert 0.5 + 0.2 * rank <= wait <= (0.5 + 0.2 * rank) * 1.1
    auto = GroupCommit(interval_s=0.5)
    auto.observe_commit(0.3)  # the claim: a put takes 0.3 s, and turns come 0.6 s late until the log says
    assert auto.stagger() == pytest.approx((0.6 + 4 * 0.3) + 0.3)
    auto.observe_commit(0.8)
    put = 0.8 * 0.3 + 0.2 * 0.8
    assert auto.stagger() == pytest.approx((0.6 + 4 * 0.3) + put)
    auto.observe_gap(0.5 + 0.2)  # the log: a version built 0.2 s after its due moment
    dev, mean = 0.3 + 0.25 * (0.4 - 0.3), 0.6 + 0.125 * (0.2 - 0.6)
    assert auto.delay is not None and (auto.delay.mean_s, auto.delay.dev_s) == pytest.approx((mean, dev))
    assert auto.stagger() == pytest.approx(mean + 4 * dev + put)
    assert GroupCommit().stagger() == pytest.approx(0.5 + 4 * 0.25 + 0.25)  # nothing timed yet


def test_turn_delay_follows_the_log_and_backs_off_after_lost_races():
    delay = group.TurnDelay(seed_s=1.0)
    assert delay.estimate_s() == pytest.approx(1.0 + 4 * 0.5)  # wide until the log shows a turn
    for _ in range(40):  # turns about 0.1 s late: the seed (its first sample) fades out
        delay.observe_gap(0.4 + 0.1, interval_s=0.4)
    assert delay.mean_s == pytest.approx(0.1, abs=0.01) and delay.dev_s < 0.01
    mean, dev = delay.mean_s, delay.dev_s
    delay.observe_gap(0.4 + 0.09, interval_s=0.4)  # Jacobson's update: deviation, then mean
    dev = dev + 0.25 * (abs(0.09 - mean) - dev)
    mean = mean + 0.125 * (0.09 - mean)
    assert (delay.mean_s, delay.dev_s) == pytest.approx((mean, dev))
    # A turn a stand-in took is late by a whole stagger: capped at the estimate, it moves
    # the estimate by a step, never by its own size.
    capped = mean + 4 * dev
    delay.observe_gap(60.0, interval_s=0.4)
    assert delay.mean_s == pytest.approx(mean + 0.125 * (capped - mean))
    assert delay.dev_s == pytest.approx(dev + 0.25 * (capped - mean - dev))
    delay.observe_gap(0.1, interval_s=0.4)  # built early (another host's clock): no delay, not a negative one
    assert delay.mean_s > 0 and delay.dev_s > 0
    for _ in range(10):
        delay.lost()
    assert delay.backoff == 8.0  # doubled per lost race, up to the cap
    delay.won()
    delay.won()
    assert delay.backoff == 2.0
    for _ in range(5):
        delay.won()
    assert delay.backoff == 1.0
    policy = GroupCommit(interval_s=0.4)
    policy.observe_commit(0.1)
    before = policy.stagger()
    policy.lost_race()
    assert policy.stagger() == pytest.approx(2 * before)  # the whole stagger, put included
    for _ in range(10):
        policy.lost_race()
        policy.observe_gap(900.0)  # another host's clock, far ahead
    assert policy.stagger() == policy.max_stagger_s == 4.0  # 10 intervals: a dead producer's turn is not parked
    assert GroupCommit(stagger_s=0.3).stagger() == 0.3  # a fixed stagger is never learned


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100), max_size=60), st.lists(st.booleans(), max_size=20))
def test_turn_delay_stays_finite_and_positive(gaps, races):
    delay = group.TurnDelay(seed_s=0.2)
    for gap in gaps:
        before = delay.estimate_s()
        delay.observe_gap(gap, interval_s=0.4)
        assert 0 <= delay.mean_s <= delay.estimate_s() <= 1.875 * before + 1e-9  # one step at a time
    for lost in races:
        delay.lost() if lost else delay.won()
        assert 1.0 <= delay.backoff <= delay.max_backoff


@pytest.mark.parametrize(
    "kwargs", [{"interval_s": 0}, {"stagger_s": -1}, {"active_versions": 0}, {"intent_lead_s": -1}, {"alpha": 0}]
)
def test_group_commit_settings_are_checked(kwargs):
    with pytest.raises(ConfigError, match="GroupCommit"):
        GroupCommit(**kwargs)


def test_group_commit_needs_the_background_thread(tmp_path):
    with pytest.raises(ConfigError, match="background_commit=True"):
        bw.Producer(tmp_path / "ns", "p", dp=1, commit_policy="group", background_commit=False)


# -- producers on real stores -----------------------------------------------------------


@pytest.fixture
def url(fast_url) -> str:
    return fast_url


def quiet(**kwargs) -> GroupCommit:
    """A group policy whose turns never come on their own: commits happen at flush()."""
    return GroupCommit(interval_s=3600.0, intent_lead_s=3600.0, **kwargs)


def intents_of(store, producer: str | None = None) -> list[str]:
    prefix = keys.INTENT_PREFIX + (f"{producer}/" if producer else "")
    return sorted(info.key for info in store.list(prefix))


def bystander(url_or_store) -> None:
    """Claim a producer that appends nothing: the log then records a producer besides
    every one made after it, which therefore publishes intents (a producer alone in the
    log, as it last read it, publishes none: nobody would fold them)."""
    bw.Producer(url_or_store, "bystander", dp=1, commit_policy=quiet()).close()


def wait_for(condition, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


def test_a_pool_in_group_mode_commits_every_tgb_once_in_shared_versions(tmp_path):
    """Six producers with real turns: versions carry several producers' TGBs, every offset
    lands once, and no intent outlives its commit."""
    url = str(tmp_path / "ns")
    producers = [bw.Producer(url, f"p{i}", dp=2, commit_policy=GroupCommit(interval_s=0.05)) for i in range(6)]

    def produce(prod: bw.Producer) -> None:
        for offset in range(30):
            prod.append(tgb(prod.producer_id, offset, 2))
            if offset % 10 == 9:  # let turns come and go between bursts
                wait_for(lambda o=offset: prod.resume_offset > o, "a turn to commit the burst")
        prod.close()

    runs = [Background(produce, p) for p in producers]
    for run in runs:
        run.result()
    tgbs = assert_exactly_once(url, {f"p{i}": 30 for i in range(6)})
    producers_per_version: dict[int, set[str]] = {}
    for _, producer, _, version in tgbs:
        producers_per_version.setdefault(version, set()).add(producer)
    assert max(len(p) for p in producers_per_version.values()) > 1, "no version folded another producer's intent"
    assert intents_of(open_store(url)) == []
    with bw.Consumer(url, dp=2, rank=1, timeout_s=10) as consumer:
        bw.end_stream(url)
        seen = [origin_of(batch.data) for batch in consumer]
    assert sorted(seen) == sorted((p, o) for _, p, o, _ in tgbs)


def test_a_turn_taken_while_a_stand_in_gathers_the_intents_is_not_raced(tmp_path):
    """A stand-in whose turn came gathers the intents to fold; meanwhile another producer
    commits the version. The stand-in gives way: no conflict, no extra version on top (at
    32 producers on a loaded store such stand-ins piled up and lost most races); what it
    had not published waits for the next turn, and a flush commits it once."""
    url = str(tmp_path / "ns")
    owner = bw.Producer(url, "owner", dp=1, commit_policy=quiet())
    stand_in = bw.Producer(url, "stand-in", dp=1, commit_policy=quiet())
    stand_in.append(tgb("stand-in", 0, 1))
    wait_for(lambda: intents_of(open_store(url), "stand-in"), "the stand-in's intent")
    stand_in.append(tgb("stand-in", 1, 1))  # after its intent for this turn: not in it
    gathering, go_on = threading.Event(), threading.Event()
    turns = stand_in.committer
    assert turns is not None
    gather = turns._intents_for_turn

    def held(*args):
        gathering.set()
        assert go_on.wait(30)
        return gather(*args)

    turns._intents_for_turn = held  # only a turn gathers intents: the commit thread waits for 3600 s
    turn = Background(turns._commit_once, False)  # its turn, not a flush
    assert gathering.wait(30)
    owner.append(tgb("owner", 0, 1))
    owner.flush()  # takes the turn, folding stand-in@0 from its intent
    version = Journal(open_store(url)).load_state().version
    go_on.set()
    assert turn.result() is True  # gave way: not a lost race
    assert stand_in.metrics()["conflicts"] == 0 and stand_in.metrics()["attempts"] == 0
    assert Journal(open_store(url)).load_state().version == version  # nothing raced on top
    assert stand_in.resume_offset == 1  # the folded one is in, the other still pending
    stand_in.close()
    owner.close()
    assert_exactly_once(url, {"owner": 1, "stand-in": 2})


def test_only_the_turns_rank_0_lists_the_intents(tmp_path):
    """A stand-in (rank 1) commits its own TGBs without listing the intents (at 32
    producers every stand-in listing and reading them all was most of the store's load);
    the next rank 0 folds what the stand-in left. Rank 0 reads them ahead of its turn,
    and at its turn folds what it read without another request."""
    url = str(tmp_path / "ns")
    bystander(url)
    other = bw.Producer(url, "other", dp=1, commit_policy=quiet())
    me = bw.Producer(url, "me", dp=1, commit_policy=quiet())
    other.append(tgb("other", 0, 1))
    wait_for(lambda: intents_of(open_store(url), "other"), "the other's intent")
    me.append(tgb("me", 0, 1))
    # Its commit thread has written its intent and waits for a turn an hour away: the
    # turns below are taken here, one at a time.
    wait_for(lambda: any(k.endswith("000000000000.json") for k in intents_of(open_store(url), "me")), "my intent")
    version = Journal(open_store(url)).load_state().version
    listings = []
    others = me.committer._intents.others
    me.committer._intents.others = lambda state=None: listings.append(1) or others(state)
    turns = me.committer
    assert turns is not None
    # The turns' due time is never: the commit thread, woken by an append, would take a
    # turn that is due itself and leave this one a conflict (a flake under load).
    turns._turn = (version, 1, math.inf)  # a stand-in's turn
    assert turns._commit_once(False) is True
    assert listings == []  # no listing, no intent read
    state = Journal(open_store(url)).load_state()
    assert state.producers["me"].offset == 1 and state.producers["other"].offset == 0
    me.append(tgb("me", 1, 1))
    wait_for(lambda: any(k.endswith("000000000001.json") for k in intents_of(open_store(url), "me")), "my intent")
    turns._turn = (state.version, 0, math.inf)  # rank 0 of the next turn, not read ahead yet: it lists now
    assert turns._commit_once(False) is True and listings == [1]
    assert Journal(open_store(url)).load_state().producers["other"].offset == 1  # folded
    other.close()
    me.close()
    assert_exactly_once(url, {"other": 1, "me": 2})


def test_committer_losing_to_the_owner_folds_only_what_is_left(url):
    """The owner commits its own TGBs while a committer that read its intent is held at
    its put: the committer's retry must not commit those TGBs again."""
    store = PausingStore(url)
    bystander(store)
    owner = bw.Producer(store, "owner", dp=1, commit_policy=quiet())
    other = bw.Producer(store, "other", dp=1, commit_policy=quiet())
    for offset in range(3):
        owner.append(tgb("owner", offset, 1))
    wait_for(lambda: intents_of(store, "owner"), "the owner's intent")
    other.append(tgb("other", 0, 1))
    held = store.pause("put_if_absent", VERSION_KEY)
    flushing = Background(other.flush)
    held.wait_reached()  # the committer has folded owner@0..2 into the version it is putting
    kept = store.pause("delete", r"_intents/owner/.*")  # the stale intent stays listed for the retry
    owner.append(tgb("owner", 3, 1))
    owner.flush()  # the owner commits 0..3 itself; its intent for 0..2 is now stale
    held.release()
    flushing.result()
    kept.release()
    owner.close()
    other.close()
    assert_exactly_once(url, {"owner": 4, "other": 1})
    assert other.metrics()["conflicts"] >= 1  # the race really happened


def test_intent_of_a_fenced_incarnation_is_never_folded(url):
    """A committer read a crashed incarnation's intent, then the restart claimed a new
    epoch before the committer's put: its retry leaves the old intent out, the restart
    resumes where the log says, and its sweep deletes the old intent."""
    store = PausingStore(url)
    bystander(store)
    crashed = bw.Producer(store, "victim", dp=1, commit_policy=quiet())
    for offset in range(3):
        crashed.append(tgb("victim", offset, 1))
    wait_for(lambda: intents_of(store, "victim"), "the crashed incarnation's intent")
    crashed.close(flush=False)  # it dies with its TGBs uncommitted, its intent on the store
    committer = bw.Producer(store, "committer", dp=1, commit_policy=quiet())
    committer.append(tgb("committer", 0, 1))
    held = store.pause("put_if_absent", VERSION_KEY)
    flushing = Background(committer.flush)
    held.wait_reached()  # it folded victim@0..2 (epoch 1) into the version it is putting
    kept = store.pause("delete", r"_intents/victim/.*")  # the old intent stays listed for the retry
    restarted = Background(bw.Producer, store, "victim", dp=1, commit_policy=quiet())
    kept.wait_reached()  # the restart has claimed epoch 2 and is sweeping
    held.release()
    flushing.result()
    kept.release()
    victim = restarted.result()
    assert victim.epoch == 2 and victim.resume_offset == 0
    assert intents_of(store, "victim") == []  # swept at the restart
    victim.append(tgb("victim", 0, 1))
    victim.close()
    committer.close()
    assert_exactly_once(url, {"victim": 1, "committer": 1})


def test_zombie_committing_in_group_mode_is_fenced(url):
    zombie = bw.Producer(url, "p", dp=1, commit_policy=quiet())
    zombie.append(tgb("p", 0, 1))
    successor = bw.Producer(url, "p", dp=1, commit_policy=quiet())
    with pytest.raises(ProducerFencedError, match="fenced"):
        zombie.flush()
    # Failed for good: its commit thread ends instead of taking turns it can never win.
    wait_for(lambda: not zombie._thread.is_alive(), "the fenced incarnation's commit thread to end")
    successor.append(tgb("p", 0, 1))
    successor.close()
    assert_exactly_once(url, {"p": 1})


def test_a_damaged_intent_stops_nobody(url, caplog):
    """Another producer's damaged intent is skipped with a warning naming it; its owner
    commits its TGBs itself, so nothing is lost."""
    store = open_store(url)
    bystander(store)
    owner = bw.Producer(store, "owner", dp=1, commit_policy=quiet())
    owner.append(tgb("owner", 0, 1))
    key = wait_for(lambda: intents_of(store, "owner"), "the owner's intent")[0]
    store.delete(key)
    store.put_if_absent(key, b'{"format": "batchweave.intent/1", "producer": "owner"')
    other = bw.Producer(store, "other", dp=1, commit_policy=quiet())
    other.append(tgb("other", 0, 1))
    other.flush()
    assert "damaged intent" in caplog.text and key in caplog.text
    assert Journal(store).load_state().producers["owner"].offset == 0  # not folded from the damaged intent
    owner.close()
    other.close()
    assert_exactly_once(url, {"owner": 1, "other": 1})


def test_no_intent_is_folded_after_the_end_of_stream(url):
    store = open_store(url)
    bystander(store)
    late = bw.Producer(store, "late", dp=1, commit_policy=quiet())
    late.append(tgb("late", 0, 1))
    wait_for(lambda: intents_of(store, "late"), "the late producer's intent")
    other = bw.Producer(store, "other", dp=1, commit_policy=quiet())
    bw.end_stream(store)
    other.flush()  # nothing of its own: it must not commit the late producer's intent either
    state = Journal(store).load_state()
    assert state.end_of_stream and state.steps == 0
    with pytest.raises(bw.StreamEndedError):
        late.flush()
    other.close()


def test_garbage_collection_deletes_intents_that_can_never_be_folded(url):
    """A crashed incarnation's intent and a committed one whose deletion failed go; an
    intent still waiting for its turn stays. A dry run counts without deleting."""
    store = PausingStore(url)
    bystander(store)
    crashed = bw.Producer(store, "a", dp=1, commit_policy=quiet())
    crashed.append(tgb("a", 0, 1))
    fenced = wait_for(lambda: intents_of(store, "a"), "the crashed incarnation's intent")[0]
    crashed.close(flush=False)
    never_deleted = store.pause("delete", r"_intents/b/.*")
    b = bw.Producer(store, "b", dp=1, commit_policy=quiet())
    b.append(tgb("b", 0, 1))
    committed = wait_for(lambda: intents_of(store, "b"), "b's intent")[0]
    b.flush()  # committed; its commit thread is now held deleting the intent
    never_deleted.wait_reached()
    restarted = bw.Producer(store, "a", dp=1, commit_policy=quiet())
    assert intents_of(store, "a") == []  # the restart sweeps its own old epochs
    store.put_if_absent(fenced, b"left by a sweep that failed")  # put it back, as if the sweep had failed
    restarted.append(tgb("a", 0, 1))
    live = wait_for(lambda: [k for k in intents_of(store, "a") if "e000002" in k], "the restart's intent")[0]
    assert bw.collect_garbage(url, dry_run=True).deleted_intents == 2
    assert intents_of(store) == sorted([fenced, committed, live])
    assert bw.collect_garbage(url).deleted_intents == 2
    assert intents_of(store) == [live]
    never_deleted.release()
    restarted.close()
    b.close()
    # b's commit folded the crashed incarnation's a@0 (its epoch was current then): the
    # restart resumed after it.
    assert_exactly_once(url, {"a": 2, "b": 1})


# -- model: folding any set of intents onto any state ----------------------------------

_PRODUCERS = ("a", "b", "c")


@st.composite
def states_and_intents(draw):
    recorded = {
        p: (draw(st.integers(0, 6)), draw(st.integers(1, 3))) for p in draw(st.sets(st.sampled_from(_PRODUCERS)))
    }
    intents = [
        intent(p, draw(st.integers(0, 10)), draw(st.integers(1, 4)), epoch=draw(st.integers(1, 3)))
        for p in draw(st.lists(st.sampled_from(_PRODUCERS), max_size=8))
    ]
    return state_with(**recorded), intents


def _covers(intents, producer, epoch, offset):
    return any(i.producer == producer and i.epoch == epoch and i.first_offset <= offset < i.end_offset for i in intents)


@settings(max_examples=300, deadline=None)
@given(states_and_intents())
def test_folding_any_intents_continues_every_producer_exactly_and_as_far_as_it_can(case):
    """Against a plain model: producer p's TGBs in the version are exactly its recorded
    offset onwards under its recorded epoch, as far as the intents cover without a gap;
    the log's own rules accept the version."""
    state, intents = case
    version = group.build_group_commit(state, "zz", ProducerState(0, 1, "me"), [], intents, 1.0)
    folded: dict[str, list[int]] = {}
    for committed in version.tgbs if version else []:
        folded.setdefault(committed.producer, []).append(committed.source_offset)
        assert committed.epoch == state.producers[committed.producer].epoch
    for producer, recorded in state.producers.items():
        expected, offset = [], recorded.offset
        while _covers(intents, producer, recorded.epoch, offset):
            expected.append(offset)
            offset += 1
        assert folded.get(producer, []) == expected
    assert set(folded) <= set(state.producers)
    if version is not None:
        logrules.apply_version(state, version, keys.version_key(version.version))


@given(
    rank=st.integers(0, 2_000),
    producers=st.integers(1, 2_000),
    since_s=st.floats(0.0, 5.0),
    draw=st.floats(0.0, 0.999),
)
def test_producers_far_from_their_turn_follow_within_the_pools_budget(rank, producers, since_s, draw):
    """Every group producer read the log every quarter interval: 1,000 producers probed
    the head key ~5,000 times a second. Far from its turn, a producer now looks within
    the pool's budget, and still comes back half an interval before it stands in."""
    interval = 0.4
    pause = group.follow_pause_s(rank, producers, interval, since_s, draw)
    quick = interval / 4
    assert pause >= quick  # never more often than before
    if rank <= 1:
        assert pause == quick  # the next committer and its stand-in keep the turn clock
        return
    near_turn = (rank - 1.5) * interval - since_s
    assert pause <= max(quick, near_turn) + 1e-9  # back before the turn comes near
    if near_turn >= 1.5 * producers / 70:  # the turn is far: the budget alone decides
        mean = max(quick, producers / 70)
        assert mean / 2 <= pause < mean * 1.5


def test_the_rotation_is_the_producers_recorded_lately():
    producers = {
        name: ProducerState(offset=0, epoch=1, incarnation="i", last_version=v)
        for name, v in {"a": 100, "b": 93, "old": 92}.items()
    }
    state = LogState(version=100, producers=producers)
    assert group.rotation(state, 8) == ["a", "b"]
    assert group.turn_rank(state, "old", 8) == 2  # after every active one


def test_a_producer_alone_publishes_no_intent_and_lists_none_until_another_claims(tmp_path):
    """Nobody can fold a lone producer's intent nor have one to fold: its commits make no
    request on the intents (at a close that was four round trips out of eight). Once it
    has read another producer's claim, its intents go out again for that one to fold."""
    url = str(tmp_path / "ns")
    alone = bw.Producer(url, "alone", dp=1, commit_policy=quiet())
    for offset in range(3):
        alone.append(tgb("alone", offset, 1))
    alone.flush()
    assert alone.committer._intents.requests == 0 and intents_of(open_store(url)) == []
    other = bw.Producer(url, "other", dp=1, commit_policy=quiet())
    alone.append(tgb("alone", 3, 1))
    alone.flush()  # reads the other's claim: from here on it is not alone
    alone.append(tgb("alone", 4, 1))
    # (The flush may return before its commit thread deletes the intent it wrote for offset
    # 3 at that flush: the one awaited is the intent of offset 4.)
    wait_for(
        lambda: any(k.endswith("000000000004.json") for k in intents_of(open_store(url), "alone")),
        "an intent of the producer no longer alone",
    )
    other.append(tgb("other", 0, 1))
    other.flush()  # folds alone@4 from its intent
    assert Journal(open_store(url)).load_state().producers["alone"].offset == 5
    alone.close()
    other.close()
    assert_exactly_once(url, {"alone": 5, "other": 1})


def test_a_lone_producers_flush_is_a_look_a_put_and_the_proof(tmp_path):
    """What a close costs a producer alone (``bench overhead``'s producer: 8 sequential
    requests before, 3 now): the look at the log, the version's put with no second probe,
    the proof's re-read of the anchor; nothing on the intents."""
    producer = bw.Producer(str(tmp_path / "ns"), "alone", dp=1, commit_policy=quiet())
    before = producer.log_requests
    producer.append(tgb("alone", 0, 1))
    # The append woke the commit thread: it looks at the log once, then waits for a turn
    # an hour away.
    wait_for(lambda: producer.log_requests == before + 1, "the commit thread's look after the append")
    looked = producer.log_requests
    producer.flush()
    assert producer.log_requests - looked == 3
    assert producer.committer._intents.requests == 0
    producer.close()
    assert_exactly_once(str(tmp_path / "ns"), {"alone": 1})
