"""Unit tests for the DAC commit policy: the paper's closed forms (section 5.2), exactly."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchweave.commit.group import GroupCommit
from batchweave.commit.policies import (
    AIMD,
    DAC,
    INCR,
    POLICY_NAMES,
    CommitPolicy,
    Fixed,
    Manual,
    Naive,
    RecentCommitters,
    resolve_policy,
)
from batchweave.errors import ConfigError


class StubRng:
    """A ``random.Random`` stand-in that returns fixed draws in order."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)
        self.calls = 0

    def random(self) -> float:
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return value


def expected_t_conf(tau: float, n: int, eps: float) -> float:
    # Equation 8, written out independently of the implementation.
    return max(0.0, (n - 1) * tau / (-math.log(1 - eps)) - tau)


def expected_t_cost(tau: float, delta: float) -> float:
    # Equation 9.
    return (1 - delta) / delta * tau


def p_conflict(t: float, tau: float, n: int) -> float:
    # Equation 5.
    return 1 - math.exp(-(n - 1) * tau / (t + tau))


def duty(t: float, tau: float) -> float:
    # Equation 6.
    return tau / (t + tau)


TAUS = [0.01, 0.05, 0.1, 0.3, 0.5, 1.0]
NS = [1, 2, 8, 32, 128]


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("tau", TAUS)
def test_first_gap_is_max_of_closed_forms(tau, n):
    eps, delta = 0.05, 0.1
    policy = DAC(epsilon=eps, delta=delta, alpha=1.0, rho=0.0, rng=random.Random(0))
    gap = policy.next_gap(tau, n, True)
    want = max(expected_t_conf(tau, n, eps), expected_t_cost(tau, delta))
    assert gap == pytest.approx(want, rel=1e-12, abs=0)
    assert policy.gap_s == gap
    assert policy.producers == n
    assert policy.fragile_window_ema_s == tau


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("tau", TAUS)
def test_t_conf_and_t_cost_helpers(tau, n):
    policy = DAC(epsilon=0.05, delta=0.1)
    assert policy.t_conf(tau, n) == pytest.approx(expected_t_conf(tau, n, 0.05), rel=1e-12, abs=1e-15)
    assert policy.t_cost(tau) == pytest.approx(expected_t_cost(tau, 0.1), rel=1e-12)


def test_which_budget_binds():
    eps, delta, tau = 0.05, 0.01, 0.2
    policy = DAC(epsilon=eps, delta=delta, alpha=1.0, rho=0.0)
    # Two producers: T_conf = tau/0.0513 - tau ~ 18.5 tau < T_cost = 99 tau, so the duty budget binds.
    assert policy.next_gap(tau, 2, True) == pytest.approx(99 * tau, rel=1e-12)
    # Many producers: the conflict budget binds and grows linearly in N-1.
    g128 = policy.next_gap(tau, 128, True)
    assert g128 == pytest.approx(127 * tau / -math.log(0.95) - tau, rel=1e-12)
    assert g128 > 99 * tau


def test_n_equals_one_has_no_conflict_term():
    policy = DAC(epsilon=0.05, delta=0.5, alpha=1.0, rho=0.0)
    for tau in TAUS:
        assert policy.t_conf(tau, 1) == 0.0
        assert policy.next_gap(tau, 1, True) == pytest.approx(tau, rel=1e-12)  # (1-0.5)/0.5 = 1


def test_zero_producers_counts_as_one():
    policy = DAC(epsilon=0.05, delta=0.5, alpha=1.0, rho=0.0)
    assert policy.next_gap(0.2, 0, True) == pytest.approx(0.2, rel=1e-12)
    assert policy.producers == 1


@pytest.mark.parametrize("eps", [0.01, 0.05, 0.2, 0.5])
@pytest.mark.parametrize("n", [2, 8, 32, 128])
@pytest.mark.parametrize("tau", [0.01, 0.25, 1.0])
def test_t_conf_meets_the_conflict_budget_exactly(eps, n, tau):
    policy = DAC(epsilon=eps, delta=0.1)
    t = policy.t_conf(tau, n)
    if t > 0:
        assert p_conflict(t, tau, n) == pytest.approx(eps, rel=1e-9)
        # Any shorter gap breaks the budget.
        assert p_conflict(t * 0.99, tau, n) > eps
    else:
        assert p_conflict(0.0, tau, n) <= eps + 1e-12


@pytest.mark.parametrize("delta", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("tau", [0.01, 0.25, 1.0])
def test_t_cost_meets_the_duty_budget_exactly(delta, tau):
    policy = DAC(epsilon=0.05, delta=delta)
    t = policy.t_cost(tau)
    assert duty(t, tau) == pytest.approx(delta, rel=1e-12)


def test_gap_satisfies_both_budgets():
    eps, delta = 0.05, 0.1
    for n in NS:
        for tau in TAUS:
            gap = DAC(epsilon=eps, delta=delta, alpha=1.0, rho=0.0).next_gap(tau, n, False)
            assert p_conflict(gap, tau, n) <= eps * (1 + 1e-9)
            assert duty(gap, tau) <= delta * (1 + 1e-9)


def test_ema_sequence_matches_hand_computation():
    alpha, eps, delta = 0.3, 0.05, 0.1
    policy = DAC(epsilon=eps, delta=delta, alpha=alpha, rho=0.0)
    observations = [(0.5, 4, True), (1.0, 4, False), (0.2, 8, True), (0.2, 8, True), (2.0, 1, False)]
    # The EMA from 0 (0.15, 0.405, 0.3435, 0.30045, 0.810315) over its weight 1 - 0.7**k
    # (0.3, 0.51, 0.657, 0.7599, 0.83193).
    want_ema = [0.5, 0.405 / 0.51, 0.3435 / 0.657, 0.30045 / 0.7599, 0.810315 / 0.83193]
    for (tau_obs, n, ok), ema in zip(observations, want_ema, strict=True):
        gap = policy.next_gap(tau_obs, n, ok)
        assert policy.fragile_window_ema_s == pytest.approx(ema, rel=1e-12)
        want_gap = max(expected_t_conf(ema, n, eps), expected_t_cost(ema, delta))
        assert gap == pytest.approx(want_gap, rel=1e-12)


def test_ema_updates_on_failure_too():
    a = DAC(alpha=0.5, rho=0.0)
    b = DAC(alpha=0.5, rho=0.0)
    assert a.next_gap(0.4, 3, True) == b.next_gap(0.4, 3, False)
    assert a.fragile_window_ema_s == b.fragile_window_ema_s == pytest.approx(0.4)
    assert a.next_gap(0.1, 3, False) == b.next_gap(0.1, 3, True)
    assert a.fragile_window_ema_s == b.fragile_window_ema_s == pytest.approx((0.5 * 0.4 + 0.1) / 1.5)


# -- the fragile-window estimate: no bias from the EMA's start at 0 ------------------------


def test_a_steady_window_is_estimated_exactly_from_the_first_sample():
    # Algorithm 1's EMA from 0 gives 0.2, 0.36, 0.488, ... of the window: with gaps of a
    # minute a producer stays in that range for its whole run, and eq. 8 with it.
    policy = DAC(epsilon=0.05, delta=0.1, alpha=0.2, rho=0.0)
    for _ in range(6):
        gap = policy.next_gap(0.08, 32, True)
        assert policy.fragile_window_ema_s == pytest.approx(0.08, rel=1e-12)
        assert gap == pytest.approx(expected_t_conf(0.08, 32, 0.05), rel=1e-12)  # 48.3 s, not 9.7 s first
    assert gap == pytest.approx(31 * 0.08 / -math.log(0.95) - 0.08, rel=1e-12)


@pytest.mark.parametrize("alpha", [0.05, 0.2, 0.5, 1.0])
def test_the_estimate_is_the_ema_divided_by_its_weight(alpha):
    windows = [0.05, 0.09, 0.07, 0.12, 0.06, 0.30, 0.08]
    policy = DAC(alpha=alpha, rho=0.0)
    for k, window in enumerate(windows, start=1):
        policy.next_gap(window, 8, True)
        weights = [(1 - alpha) ** (k - 1 - i) for i in range(k)]  # sample i's share of the EMA
        want = sum(w * x for w, x in zip(weights, windows[:k], strict=True)) / sum(weights)
        assert policy.fragile_window_ema_s == pytest.approx(want, rel=1e-12)


def test_gap_after_the_claim_and_one_commit_at_128_producers():
    # Measured at 128 producers: the epoch claim's window (a producer's first observation)
    # 53 ms, its first commit's 76 ms. Algorithm 1's EMA from 0 made that 23.7 ms and the
    # gap 58.6 s, a third of eq. 8's at the windows seen.
    policy = DAC(epsilon=0.05, delta=0.1, alpha=0.2, rho=0.0)
    policy.observe(0.053, 64, True)  # the claim
    assert policy.fragile_window_ema_s == pytest.approx(0.053, rel=1e-12)
    policy.observe(0.076, 128, False)
    tau = (0.8 * 0.2 * 0.053 + 0.2 * 0.076) / 0.36
    assert policy.fragile_window_ema_s == pytest.approx(tau, rel=1e-12)  # 65.8 ms
    assert policy.gap_s == pytest.approx(127 * tau / -math.log(0.95) - tau, rel=1e-12)
    assert policy.gap_s == pytest.approx(162.8, abs=0.1)


def test_observe_updates_gap():
    policy = DAC(alpha=1.0, rho=0.0, epsilon=0.05, delta=0.25)
    policy.observe(0.4, 1, True)
    assert policy.gap_s == pytest.approx(3 * 0.4, rel=1e-12)


# -- jitter ----------------------------------------------------------------------------


def test_jitter_lower_bound_with_stub_rng():
    rng = StubRng(0.0)
    policy = DAC(epsilon=0.05, delta=0.1, alpha=1.0, rho=0.5, rng=rng)
    t_star = max(expected_t_conf(0.3, 16, 0.05), expected_t_cost(0.3, 0.1))
    assert policy.next_gap(0.3, 16, True) == pytest.approx(t_star, rel=1e-12)
    assert rng.calls == 1


def test_jitter_upper_bound_with_stub_rng():
    u = 0.9999999
    policy = DAC(epsilon=0.05, delta=0.1, alpha=1.0, rho=0.5, rng=StubRng(u))
    t_star = max(expected_t_conf(0.3, 16, 0.05), expected_t_cost(0.3, 0.1))
    gap = policy.next_gap(0.3, 16, True)
    assert gap == pytest.approx(t_star * (1 + 0.5 * u), rel=1e-12)
    assert gap < t_star * 1.5
    assert gap == pytest.approx(t_star * 1.5, rel=1e-6)


def test_jitter_is_linear_in_the_draw():
    policy = DAC(epsilon=0.05, delta=0.1, alpha=1.0, rho=0.25, rng=StubRng(0.4))
    t_star = expected_t_cost(0.1, 0.1)
    assert policy.next_gap(0.1, 1, True) == pytest.approx(t_star * (1 + 0.25 * 0.4), rel=1e-12)


def test_jitter_within_bounds_with_seeded_random():
    rho = 0.5
    policy = DAC(epsilon=0.05, delta=0.1, alpha=1.0, rho=rho, rng=random.Random(1234))
    gaps = []
    for i in range(300):
        tau = 0.01 + (i % 10) * 0.1
        n = NS[i % len(NS)]
        t_star = max(expected_t_conf(tau, n, 0.05), expected_t_cost(tau, 0.1))
        gap = policy.next_gap(tau, n, True)
        assert t_star * (1 - 1e-12) <= gap <= t_star * (1 + rho) * (1 + 1e-12)
        gaps.append(gap / t_star - 1)
    # The draws spread over the whole [0, rho) band.
    assert min(gaps) < 0.05 * rho
    assert max(gaps) > 0.95 * rho


def test_same_seed_same_gaps():
    a = DAC(rng=random.Random(7))
    b = DAC(rng=random.Random(7))
    seq = [(0.1, 4), (0.3, 4), (0.2, 9)]
    assert [a.next_gap(t, n, True) for t, n in seq] == [b.next_gap(t, n, True) for t, n in seq]


# -- wait_s ----------------------------------------------------------------------------


def test_wait_nothing_pending_is_infinite():
    policy = DAC()
    assert policy.wait_s(0, 0.0) == math.inf
    policy.next_gap(0.5, 4, True)
    assert policy.wait_s(0, 1e9) == math.inf


def test_wait_before_any_attempt_is_zero():
    assert DAC().wait_s(1, 0.0) == 0.0


def test_wait_counts_down_from_the_gap():
    policy = DAC(epsilon=0.05, delta=0.2, alpha=1.0, rho=0.0)
    gap = policy.next_gap(0.5, 1, True)
    assert gap == pytest.approx(2.0, rel=1e-12)  # (1-0.2)/0.2 * 0.5
    assert policy.wait_s(3, 0.0) == pytest.approx(2.0)
    assert policy.wait_s(3, 0.5) == pytest.approx(1.5)
    assert policy.wait_s(1, 1.99) == pytest.approx(0.01)
    assert policy.wait_s(1, 2.0) == 0.0
    assert policy.wait_s(1, 100.0) == 0.0


# -- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"epsilon": 0.0},
        {"epsilon": 1.0},
        {"epsilon": -0.1},
        {"epsilon": math.nan},
        {"delta": 0.0},
        {"delta": 1.5},
        {"delta": -1.0},
        {"alpha": 0.0},
        {"alpha": 1.01},
        {"rho": -0.01},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_bad_parameters(kwargs):
    with pytest.raises(ConfigError) as info:
        DAC(**kwargs)
    name = next(iter(kwargs))
    assert name in str(info.value)


def test_nan_rho_rejected():
    with pytest.raises(ConfigError):
        DAC(rho=math.nan)


def test_boundary_parameters_are_valid():
    DAC(delta=1.0, alpha=1.0, rho=0.0)  # delta=1 means no duty budget: T_cost = 0
    assert DAC(delta=1.0, alpha=1.0, rho=0.0).next_gap(0.3, 1, True) == 0.0


def test_resolve_policy():
    assert isinstance(resolve_policy("dac"), DAC)
    assert isinstance(resolve_policy("DAC"), DAC)
    default = resolve_policy(None, background_commit=False)  # commits in its own thread: DAC
    assert isinstance(default, DAC)
    assert (default.epsilon, default.delta) == (DAC().epsilon, DAC().delta)
    assert isinstance(resolve_policy(None), GroupCommit)  # with a commit thread: group commit
    mine = DAC(epsilon=0.2)
    assert resolve_policy(mine) is mine
    assert isinstance(mine, CommitPolicy)


def test_resolve_policy_custom_object():
    class Fixed:
        name = "fixed"

        def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
            return 0.0

        def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
            pass

    policy = Fixed()
    assert resolve_policy(policy) is policy


@pytest.mark.parametrize("bad", ["nope", "", "fixed-interval"])
def test_resolve_policy_unknown_name(bad):
    with pytest.raises(ConfigError) as info:
        resolve_policy(bad)
    assert "dac" in str(info.value)


@pytest.mark.parametrize("bad", [object(), 42, {"name": "dac"}])
def test_resolve_policy_not_a_policy(bad):
    with pytest.raises(ConfigError):
        resolve_policy(bad)


def test_resolve_policy_rejects_a_class():
    with pytest.raises(ConfigError):
        resolve_policy(DAC)


# -- the paper's baselines (section 7.1) ------------------------------------------------


def test_every_named_policy_resolves_to_a_fresh_instance():
    assert POLICY_NAMES == ("dac", "naive", "fixed10", "fixed100", "incr", "aimd")
    for name in POLICY_NAMES:
        first, second = resolve_policy(name), resolve_policy(name.upper())
        assert first.name == name and first is not second


@pytest.mark.parametrize("every", [1, 10, 100])
def test_fixed_commits_once_every_n_tgbs(every):
    policy = Fixed(every)
    assert [policy.wait_s(n, 0.0) == 0.0 for n in range(every + 2)] == [n >= every for n in range(every + 2)]
    policy.observe(0.1, 32, False)  # a conflict changes nothing: it retries at once
    assert policy.wait_s(every, 0.0) == 0.0 and policy.wait_s(0, 5.0) == math.inf


def test_naive_commits_every_tgb():
    assert Naive().wait_s(1, 0.0) == 0.0 and Naive().wait_s(0, 0.0) == math.inf and Naive().name == "naive"


def test_incr_starts_at_ten_and_adds_one_per_conflict():
    policy = INCR()
    outcomes = [False, True, False, False, True]
    expected = [10]
    for success in outcomes:
        policy.observe(0.05, 8, success)
        expected.append(expected[-1] + (0 if success else 1))
    assert policy.every == expected[-1] == 13
    assert policy.wait_s(12, 0.0) == math.inf and policy.wait_s(13, 0.0) == 0.0


def test_aimd_doubles_the_interval_on_a_conflict_and_takes_one_tgb_off_on_a_success():
    # The paper's AIMD (section 7.1) is TCP's rule: back off multiplicatively on a
    # conflict, probe additively on a success; from INCR's start of 10 TGBs.
    policy = AIMD()
    outcomes = [False, True, True, False, *[True] * 40]
    expected = [10.0, 20.0, 19.0, 18.0, 36.0, *[max(1.0, 36.0 - k) for k in range(1, 41)]]
    assert policy.interval == expected[0]
    for success, interval in zip(outcomes, expected[1:], strict=True):
        policy.observe(0.05, 8, success)
        assert policy.interval == interval
    assert policy.interval == 1.0  # never below one TGB per commit
    assert policy.wait_s(1, 0.0) == 0.0 and policy.wait_s(0, 0.0) == math.inf


def test_aimd_commits_less_often_after_a_conflict():
    # The literal reading of the paper's sentence (halve the interval on a conflict)
    # committed more often after every conflict and reached 7.4% success.
    policy = AIMD(start=10)
    assert policy.wait_s(10, 0.0) == 0.0
    policy.observe(0.05, 32, False)
    assert policy.wait_s(19, 0.0) == math.inf and policy.wait_s(20, 0.0) == 0.0
    policy.observe(0.05, 32, True)
    assert policy.wait_s(18, 0.0) == math.inf and policy.wait_s(19, 0.0) == 0.0


@given(st.lists(st.booleans(), max_size=60), st.floats(1, 50), st.floats(0.1, 5), st.floats(1.01, 4))
def test_aimd_moves_the_interval_only_in_the_rules_directions(outcomes, start, step, backoff):
    policy = AIMD(start=start, step=step, backoff=backoff)
    for success in outcomes:
        before = policy.interval
        policy.observe(0.05, 8, success)
        want = max(1.0, before - step) if success else before * backoff
        assert policy.interval == want and policy.interval >= 1.0


@pytest.mark.parametrize(
    "kwargs",
    [{"start": 0.5}, {"step": 0}, {"backoff": 1}, {"backoff": 0.5}, {"start": math.inf}, {"backoff": math.nan}],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_aimd_refuses_parameters_that_never_back_off_or_never_commit(kwargs):
    with pytest.raises(ConfigError, match=r"AIMD needs finite start>=1 TGB, step>0 TGBs, backoff>1; got start="):
        AIMD(**kwargs)
    with pytest.raises(ConfigError):
        Fixed(0)


def test_manual_commits_only_on_flush():
    policy = resolve_policy("manual")
    assert isinstance(policy, Manual) and policy.name == "manual"
    assert all(policy.wait_s(n, t) == math.inf for n in (0, 1, 10_000) for t in (0.0, 1e9))


# -- RecentCommitters: the producer count -----------------------------------------------


def test_recent_committers_count_everyone_first_then_only_who_keeps_committing():
    committers = RecentCommitters(window_gaps=4.0, min_window_s=10.0)
    assert committers.count(now=0.0, gap_s=1.0) == 1  # nobody seen: the asking producer itself
    committers.update({"a": 1, "b": 2, "c": 3}, now=0.0)
    assert committers.count(now=0.0, gap_s=1.0) == 3  # first sight counts, whatever the version
    committers.update({"a": 1, "b": 2, "c": 7}, now=6.0)  # only c committed since
    assert committers.count(now=10.0, gap_s=1.0) == 3  # the 10 s floor
    assert committers.count(now=10.5, gap_s=1.0) == 1  # a and b last seen 10.5 s ago
    assert committers.count(now=10.5, gap_s=5.0) == 3  # 4 gaps of 5 s: still within
    assert committers.count(now=20.5, gap_s=5.0) == 1


def test_recent_committers_see_a_new_producer_and_a_return_at_once():
    committers = RecentCommitters(min_window_s=1.0)
    committers.update({"a": 1}, now=0.0)
    committers.update({"a": 1, "b": 9}, now=100.0)
    assert committers.count(now=100.0, gap_s=0.0) == 1  # a aged out, b new
    committers.update({"a": 10, "b": 9}, now=100.5)
    assert committers.count(now=100.5, gap_s=0.0) == 2


@given(
    st.lists(st.tuples(st.sampled_from("abcdef"), st.floats(0, 50)), max_size=40),
    st.floats(0, 60),
    st.floats(0, 10),
)
def test_recent_committers_count_is_between_one_and_the_ids_seen(commits, now, gap_s):
    committers = RecentCommitters()
    versions: dict[str, int] = {}
    last_commit_at: dict[str, float] = {}
    for version, (producer_id, at) in enumerate(sorted(commits, key=lambda c: c[1]), start=1):
        versions[producer_id] = version
        last_commit_at[producer_id] = at
        committers.update(dict(versions), now=at)
    asked_at = max((at for _, at in commits), default=0.0) + now
    window = max(10.0, 4 * gap_s)
    expected = sum(1 for at in last_commit_at.values() if asked_at - at <= window)
    assert committers.count(now=asked_at, gap_s=gap_s) == max(1, expected)


def test_recent_committers_refuse_bad_windows():
    with pytest.raises(ConfigError, match="window_gaps"):
        RecentCommitters(window_gaps=0)
