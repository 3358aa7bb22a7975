"""The head-polling budget (``batchweave.reading.polling``): pure, on chosen times and a seeded rng."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchweave.errors import ConfigError
from batchweave.reading.polling import IDLE_PROOF_S, MIN_PAUSE_S, HeadPolling


def mean_idle_pause(polling: HeadPolling, probes: int = 2000) -> float:
    pauses = [polling.missed() for _ in range(probes)]
    return sum(pauses[20:]) / len(pauses[20:])  # past the doubling


def test_few_followers_keep_todays_backoff():
    polling = HeadPolling(1, max_poll_s=1.0, rng=random.Random(1))
    first = polling.missed()
    assert MIN_PAUSE_S / 2 <= first <= MIN_PAUSE_S * 1.5
    assert mean_idle_pause(polling) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("followers", [1_250, 10_000])
def test_the_job_stays_within_the_budget_on_the_head_key(followers):
    polling = HeadPolling(followers, budget_per_s=100, rng=random.Random(2))
    job_rate = followers / mean_idle_pause(polling)
    assert job_rate == pytest.approx(100, rel=0.05)


@pytest.mark.parametrize("followers", [1_250, 10_000])
def test_with_copies_each_key_keeps_room_for_reads_and_each_follower_probes_about_copies_plus_one_times_as_often(
    followers,
):
    alone = HeadPolling(followers, budget_per_s=100, rng=random.Random(2))
    spread = HeadPolling(followers, budget_per_s=100, rng=random.Random(2), copies=8)
    assert spread.copies == 8
    # Each probe picks one of 9 keys; a fifth of each key's budget is left for the reads.
    assert mean_idle_pause(alone) / mean_idle_pause(spread) == pytest.approx(9 / 1.2, rel=0.05)
    per_key = followers / mean_idle_pause(spread) / (spread.copies + 1)
    assert per_key == pytest.approx(100 / 1.2, rel=0.05)
    assert spread.idle_proof_s == alone.idle_proof_s  # the anchors' keys are not copied
    assert spread.start_pause_s() <= alone.floor_s  # nor the keys a start reads


def test_copies_are_not_read_where_the_budget_does_not_bind():
    assert HeadPolling(70, copies=8).copies == 0  # one probe a second each keeps the key within budget
    assert HeadPolling(71, copies=8).copies == 8


def test_the_first_probe_after_a_version_waits_a_quarter_of_the_commit_interval():
    polling = HeadPolling(1, rng=random.Random(3), max_poll_s=5.0)
    for t in (100.0, 102.0, 104.0, 106.0):
        polling.found(t)
    assert polling.commit_interval_s == pytest.approx(2.0)
    pauses = [polling.missed() for _ in range(3)]
    assert 0.25 <= pauses[0] <= 0.75  # 0.5 +- 50%
    assert 0.5 <= pauses[1] <= 1.5 and 1.0 <= pauses[2] <= 3.0  # then doubling


def test_versions_without_commit_times_and_clock_skew_leave_the_cadence_unknown():
    polling = HeadPolling(1, rng=random.Random(4))
    polling.found(0.0)
    polling.found(50.0)
    polling.found(40.0)  # another producer's clock behind: not a negative interval
    assert polling.commit_interval_s is None
    polling.found(60.0)
    assert polling.commit_interval_s == pytest.approx(10.0)


def test_the_idle_re_proof_is_spread_by_the_same_budget():
    assert HeadPolling(8).idle_proof_s == IDLE_PROOF_S
    assert HeadPolling(5_000, budget_per_s=100).idle_proof_s == pytest.approx(50.0)


@pytest.mark.parametrize("bad", [dict(followers=0), dict(followers=1, budget_per_s=0), dict(followers=1, max_poll_s=0)])
def test_nonsense_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        HeadPolling(**bad)


@given(
    followers=st.integers(1, 20_000),
    intervals=st.lists(st.floats(0.01, 30.0), max_size=10),
    misses=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_a_pause_is_never_shorter_than_half_the_floor_nor_longer_than_one_and_a_half_times_the_cap(
    followers, intervals, misses, seed
):
    polling = HeadPolling(followers, max_poll_s=1.0, rng=random.Random(seed))
    t = 1000.0
    for interval in intervals:
        t += interval
        polling.found(t)
    for _ in range(misses):
        pause = polling.missed()
        assert pause >= max(MIN_PAUSE_S, polling.floor_s) / 2
        assert pause <= max(1.0, polling.floor_s) * 1.5


@pytest.mark.parametrize("followers", [8, 1_250])
def test_followers_starting_together_spread_their_first_requests_within_the_budget(followers):
    """1,250 node followers starting within a second each read the snapshot hint and the
    first versions: 1,250 GETs on each of those keys in that second, with no spread."""
    rng = random.Random(5)
    starts = sorted(rng.random() + HeadPolling(followers, rng=rng).start_pause_s() for _ in range(followers))
    busiest = max(sum(1 for t in starts if s <= t < s + 1) for s in starts)
    assert busiest <= 100  # the start-up target on any one key
    assert starts[-1] <= 1 + (followers / 70 if followers > 70 else 0)  # a small job starts at once
