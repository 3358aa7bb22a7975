"""``bench scale``'s arithmetic (benchmarks/scale_model.py): limits, prices, the projection
and the discrete-event model of followers at the head. Pure and seeded: no store, no clock."""

from __future__ import annotations

import random

import pytest

from batchweave.keys import HEAD_COPIES
from batchweave.reading.polling import HEAD_BUDGET_PER_S, HeadPolling
from benchmarks.scale_count import LOG_NEXT, LOG_VERSION, SEGMENT, key_class, prefix_of
from benchmarks.scale_model import (
    ANCHOR,
    NEXT,
    READ,
    SEGMENT_READ,
    FollowerRates,
    Load,
    MidpointRng,
    OtherRates,
    Scale,
    TodayPolling,
    catch_up_keys,
    follower_pattern,
    held_polls,
    project,
    simulate,
)


def test_prices_per_hour_follow_the_s3_request_tiers():
    load = Load("x", {("log version", "get"): 1000.0, ("data", "put"): 10.0, ("data", "delete"): 50.0}, 0.0, "")
    # 1,000 GET/s for an hour at $0.0004 per 1,000, 10 PUT/s at $0.005 per 1,000, DELETE free
    assert load.usd_per_hour() == pytest.approx(3600 * (1.0 * 0.0004 + 0.01 * 0.005))


def test_the_busiest_key_is_checked_against_per_key_limits_and_totals_against_account_limits():
    load = Load("x", {("log next (miss)", "get"): 6000.0, ("data", "get"): 30_000.0}, 6000.0, "the next log version")
    ratios = {limit.name: rate / limit.per_s for limit, rate in load.limits(producers=16, steps_per_s=3.0)}
    assert ratios["Azure requests per blob"] == pytest.approx(12.0)
    assert ratios["S3 GET/HEAD per key"] == pytest.approx(6000 / 5500)
    assert ratios["Azure requests per account"] == pytest.approx(36_000 / 20_000)
    # data reads of one second fall on about steps_per_s producers' prefixes
    assert ratios["S3 GET/HEAD per prefix"] == pytest.approx(10_000 / 5500)
    first, _ = load.limits(producers=16, steps_per_s=3.0)[0]
    assert first.name == "Azure requests per blob"


def test_node_sharing_reads_each_slice_once_per_node():
    scale = Scale(ranks=10_000, producers=1024)  # 8 ranks a node, tp 8: one (d, c) per node
    assert (scale.nodes, scale.dp) == (1250, 1250)
    assert scale.data_reads_per_step(shared=False) == 10_000
    assert scale.data_reads_per_step(shared=True) == 1250
    assert Scale(ranks=64, producers=1, tp=4).data_reads_per_step(shared=True) == 16  # 2 slices on each of 8 nodes
    assert Scale(ranks=64, producers=1, tp=16).data_reads_per_step(shared=True) == 8  # a slice over 2 nodes
    assert scale.tgb_parts == 20  # 1,250 slices in parts of at most 64 slices (5 of 256 MiB by size alone)
    assert Scale(ranks=512, producers=1, slice_bytes=8 << 20).tgb_parts == 2  # 64 slices of 8 MiB: by size


def _rates(**overrides) -> FollowerRates:
    values = dict(
        behind_per_step={(SEGMENT, "get"): 1 / 32},
        behind_max_per_key=1.0,
        flowing_per_s={(LOG_NEXT, "get"): 15.0, (LOG_VERSION, "get"): 6.0},
        flowing_per_version_on_one_key=7.0,
        idle_per_s={(LOG_NEXT, "get"): 1.3, (LOG_VERSION, "get"): 0.1},
        idle_next_key_per_s=1.3,
        spread_s=1 / 3,
    )
    return FollowerRates(**{**values, **overrides})


NOTHING = OtherRates(producer_per_tgb={}, watch_per_s={}, gc_per_run={})


def test_projection_multiplies_one_followers_pattern_by_the_followers():
    scale = Scale(ranks=1024, producers=128)
    behind, flowing, idle = project(scale, 1024, _rates(), NOTHING, shared=False)
    assert flowing.rates[LOG_NEXT, "get"] == pytest.approx(1024 * 15.0)
    assert flowing.rates["data", "get"] == pytest.approx(1024 * 3.0)
    # every rank's requests for one version land within the second of its commit
    assert flowing.hot_key_per_s == pytest.approx(1024 * 7.0)
    assert idle.hot_key_per_s == pytest.approx(1024 * 1.3) and idle.total_per_s == pytest.approx(1024 * 1.4)
    # a synchronous job's ranks reach each segment within the same second
    assert behind.hot_key_per_s == pytest.approx(1024) and behind.rates[SEGMENT, "get"] == pytest.approx(96.0)


def test_followers_spread_over_more_than_a_second_divide_the_busiest_key():
    scale = Scale(ranks=10_000, producers=1024)
    rates = _rates(flowing_per_version_on_one_key=1.0, spread_s=12.5)
    _, flowing, _ = project(scale, 1250, rates, NOTHING, shared=True)
    assert flowing.hot_key_per_s == pytest.approx(100.0)
    assert flowing.rates["data", "get"] == pytest.approx(1250 * 3.0)


def test_todays_pauses_double_to_the_longest_with_jitter_below_it():
    polling = TodayPolling(rng=MidpointRng())
    pauses = [polling.missed() for _ in range(10)]
    assert pauses[:3] == pytest.approx([0.0075, 0.015, 0.03])
    assert pauses[-1] == pytest.approx(0.75)
    polling.found(0.0)
    assert polling.missed() == pytest.approx(0.0075)


def test_one_idle_follower_probes_at_the_mean_pause_and_re_proves_every_ten_seconds():
    today = follower_pattern(lambda rng: TodayPolling(rng=rng), 1 / 3, idle=True)
    # uniform(p/2, p) at p = 1 s: a mean pause of 0.75 s, plus each probe's 25 ms
    assert today.per_follower_per_s[NEXT] == pytest.approx(1 / 0.775, rel=0.02)
    assert today.per_follower_per_s[ANCHOR] == pytest.approx(0.1, rel=0.1)
    budget = follower_pattern(lambda rng: HeadPolling(1250, rng=rng), 1 / 3, idle=True)
    assert 1250 * budget.per_follower_per_s[NEXT] == pytest.approx(HEAD_BUDGET_PER_S, rel=0.02)  # the floor binds


def test_the_simulated_busiest_key_of_an_idle_job_is_followers_over_the_mean_pause():
    result = simulate(
        500,
        lambda rng: TodayPolling(rng=rng),
        commit_interval_s=1 / 3,
        flowing_s=3.0,
        idle_s=8.0,
        warmup_s=3.0,
        seed=1,
    )
    assert result.hot_key_kind == NEXT
    assert result.hot_key_mean_per_s == pytest.approx(500 / 0.775, rel=0.05)
    assert result.hot_key_max_per_s >= result.hot_key_mean_per_s


def test_the_budget_holds_the_busiest_key_at_the_budget_whatever_the_followers():
    for followers in (400, 1250):
        result = simulate(
            followers,
            lambda rng, n=followers: HeadPolling(n, rng=rng),
            commit_interval_s=1 / 3,
            flowing_s=2 * followers / HEAD_BUDGET_PER_S + 6.0,
            warmup_s=2 * followers / HEAD_BUDGET_PER_S,
            seed=2,
        )
        assert result.hot_key_mean_per_s == pytest.approx(HEAD_BUDGET_PER_S, rel=0.15), followers
        assert result.hot_key_max_per_s <= 100, followers  # the busiest second too
        # a visit every 5 s (400 followers) to 15.6 s (1,250) reads 15 to 47 versions, whole
        # segments as one request: fewer reads than the 3 versions a second committed
        reads = result.per_follower_per_s[READ] + result.per_follower_per_s.get(SEGMENT_READ, 0.0)
        assert 0.5 < reads < 3.0, followers


def test_with_head_copies_1250_node_followers_read_each_version_within_3_s_and_no_key_takes_100_a_second():
    """Issue 29's freshness target at 10,000 ranks (1,250 nodes), every follower simulated."""
    make = lambda rng: HeadPolling(1250, rng=rng, copies=HEAD_COPIES)  # noqa: E731
    settle = 2 * make(None).floor_s
    with_copies = simulate(1250, make, commit_interval_s=1 / 3, flowing_s=settle + 8, warmup_s=settle, seed=3)
    assert with_copies.delay_percentile(95) <= 3.0
    assert with_copies.hot_key_max_per_s <= 100
    alone = simulate(
        1250,
        lambda rng: HeadPolling(1250, rng=rng),
        commit_interval_s=1 / 3,
        flowing_s=settle + 8,
        warmup_s=settle,
        seed=3,
    )
    assert alone.delay_percentile(95) > 3 * with_copies.delay_percentile(95)  # one key each: a probe every 18 s


def test_a_catch_up_reads_whole_segments_after_two_versions_in_a_row():
    assert catch_up_keys(5, 6) == [5, 6]
    assert catch_up_keys(30, 100) == [30, 31, -32, -64, -96, 97, 98, 99, 100]  # 32 from its segment
    assert catch_up_keys(1, 31) == list(range(1, 32))  # the segment of 1..32 is not written yet


def test_the_model_is_deterministic_for_a_seed():
    def run(seed: int):
        return simulate(50, lambda rng: TodayPolling(rng=rng), commit_interval_s=0.5, flowing_s=6.0, seed=seed)

    assert run(3).windows == run(3).windows
    assert run(3).windows != run(4).windows


def test_keys_are_sorted_into_the_classes_the_projection_needs():
    assert key_class("get", "_log/00000000000000000012.json", found=False) == LOG_NEXT
    assert key_class("get", "_log/00000000000000000012.json", found=True) == LOG_VERSION
    assert key_class("get", "_log/_segments/00000000000000000032.json.z", found=True) == SEGMENT
    assert key_class("list", "_intents/", found=True) == "intents"
    assert key_class("get", "_checkpoints/ck/0-0.json", found=True) == "watermarks"
    assert prefix_of("data/p7/e000001/000000000003-ab.0.bwb") == "data/<producer>/"
    assert prefix_of("_log/_snapshots/00000000000000000100.json") == "_log/"


def test_jitter_draws_stay_in_the_policies_ranges():
    rng = random.Random(0)
    today = TodayPolling(rng=rng)
    for _ in range(20):
        pause = today.missed()
        assert today._pause / 2 <= pause <= today._pause


def test_held_producers_as_independent_processes_keep_the_head_key_within_the_target():
    """The held-and-collected target at 1,000 producers: measured as threads of one process,
    their polls bunch where the interpreter stalls (a busiest second of 251 at a mean of 71);
    with each producer's own timer, as in a real pool, the busiest second stays <= 100."""
    peak, mean = held_polls(1000, window_s=600.0, seed=5)
    assert mean == pytest.approx(HEAD_BUDGET_PER_S, rel=0.05)
    assert peak <= 100
