"""The adaptive request-rate limiter (``batchweave.retry.RequestRateLimiter``) on a fake
clock: unlimited until throttled, one cut per round of requests, never below the floor,
the climb back and the lift, the token bucket's spacing, the WARNING cadence; then a
simulated process of many requesters through a storm, with and without the limiter, and
the Store's use of it. No real waiting (the real storm is in test_storm.py)."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from obstore import exceptions as obs_errors
from obstore_errors import obstore_status_message, obstore_transport_message
from test_retry import KEY, FakeClock, ScriptedStore, scripted, throttled

import batchweave as bw
from batchweave import retry
from batchweave.commit.policies import Manual
from batchweave.metrics import describe, register_prometheus
from batchweave.retry import MIN_RATE_PER_S, RECOVERY_S, RequestRateLimiter
from batchweave.store import Store


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def limiter_sending(rate_per_s: float, seconds: float, clock: Clock) -> RequestRateLimiter:
    """A limiter whose process sent ``rate_per_s`` requests a second for ``seconds``, unthrottled."""
    limiter = RequestRateLimiter(clock.now)
    for _ in range(round(rate_per_s * seconds)):
        assert limiter.reserve(clock) is None
        assert limiter.succeeded(clock) is None
    clock.now += seconds
    return limiter


def test_requests_are_not_limited_until_the_store_throttles():
    clock = Clock()
    limiter = limiter_sending(500, 10, clock)
    assert limiter.limit_per_s is None and limiter.current_per_s() == math.inf and limiter.limited_s(clock) == 0


def test_the_first_throttle_halves_the_rate_the_process_had():
    clock = Clock()
    limiter = limiter_sending(100, 10, clock)
    notice = limiter.throttled(None, clock)
    assert notice == retry.RateNotice("started", 50.0, 100.0, 0.0)
    assert limiter.limit_per_s == 50


def test_a_burst_of_throttled_answers_cuts_the_rate_once():
    """64 requests in flight when the storm began all come back throttled: one cut, not 64
    (they were sent before the first cut, so they say nothing about the new rate)."""
    clock = Clock()
    limiter = limiter_sending(200, 10, clock)
    in_flight = [limiter.reserve(clock) for _ in range(64)]
    for ticket in in_flight:
        limiter.throttled(ticket, clock)
    assert limiter.limit_per_s == pytest.approx((2000 + 64) / 10 / 2)  # the rate sent, halved, once
    sent = []
    for _ in range(64):  # retried at the new rate over 2 s: all sent before the first answer comes back
        limiter.reserve(clock)
        clock.now += 2 / 64
        sent.append(clock.now)
    for sent_at in sent:
        limiter.throttled(sent_at, clock)
    assert limiter.limit_per_s == pytest.approx(64 / 2 / 2)  # once more: half the 32/s they were sent at


def test_a_cut_goes_below_what_the_process_really_sends():
    """A limit above what the process sends would not slow it: the cut halves the lower."""
    clock = Clock()
    limiter = limiter_sending(1000, 10, clock)
    limiter.throttled(None, clock)  # 500/s allowed
    clock.now += 2
    for _ in range(20):  # 10/s sent
        limiter.reserve(clock)
    limiter.throttled(clock.now, clock)
    assert limiter.limit_per_s == pytest.approx(5)


def test_the_rate_never_goes_below_the_floor():
    clock = Clock()
    limiter = limiter_sending(100, 1, clock)
    for _ in range(30):
        clock.now += 1
        limiter.reserve(clock)
        limiter.throttled(clock.now, clock)
    assert limiter.limit_per_s == MIN_RATE_PER_S


def test_tickets_are_spaced_at_the_allowed_rate_and_a_higher_rate_shortens_the_wait():
    clock = Clock()
    limiter = limiter_sending(20, 10, clock)
    limiter.throttled(None, clock)  # 10/s
    tickets = [limiter.reserve(clock) for _ in range(5)]
    assert [limiter.wait_s(t, clock) for t in tickets] == pytest.approx([0, 0.1, 0.2, 0.3, 0.4])
    clock.now += 0.1
    assert limiter.wait_s(tickets[1], clock) == 0
    assert limiter.wait_s(tickets[4], clock) == pytest.approx(0.3)
    limiter.succeeded(clock)  # 0.1 s of successes: +0.1 s x 20/s / RECOVERY_S
    assert limiter.limit_per_s == pytest.approx(10 + 0.1 * 20 / RECOVERY_S)
    assert limiter.wait_s(tickets[4], clock) == pytest.approx(3 / limiter.limit_per_s)


def test_an_idle_limited_process_banks_one_request_not_a_burst():
    clock = Clock()
    limiter = limiter_sending(20, 10, clock)
    limiter.throttled(None, clock)  # 10/s
    clock.now += 60
    tickets = [limiter.reserve(clock) for _ in range(3)]
    assert [limiter.wait_s(t, clock) for t in tickets] == pytest.approx([0, 0.1, 0.2])


def test_successes_raise_the_rate_linearly_then_lift_the_limit():
    clock = Clock()
    limiter = limiter_sending(40, 10, clock)
    limiter.throttled(None, clock)
    for _ in range(10):
        clock.now += 1
        limiter.reserve(clock)
        limiter.throttled(clock.now, clock)
    assert limiter.limit_per_s == MIN_RATE_PER_S
    notices, limits = [], []
    while limiter.limit_per_s is not None:  # one success a second: each credits a second of growth
        clock.now += 1
        notices.append(limiter.succeeded(clock))
        limits.append(limiter.current_per_s())
    steps = [b - a for a, b in itertools.pairwise(limits[:-1])]
    assert steps == pytest.approx([40 / RECOVERY_S] * len(steps))  # additive: the same step every second
    assert len(limits) == math.ceil((40 - 1) / (40 / RECOVERY_S))  # back at the pre-throttle rate: lifted
    assert notices[-1] is not None and notices[-1].kind == "ended" and notices[-1].limited_s == 10 + len(limits)
    assert limiter.limited_s(clock) == 10 + len(limits)


def test_a_success_after_a_long_idle_spell_credits_one_second():
    clock = Clock()
    limiter = limiter_sending(40, 10, clock)
    limiter.throttled(None, clock)  # 20/s
    clock.now += 3600
    limiter.succeeded(clock)
    assert limiter.limit_per_s == pytest.approx(20 + 40 / RECOVERY_S)


def test_warnings_say_the_start_then_at_most_every_30_s_then_the_end():
    clock = Clock()
    limiter = limiter_sending(1000, 10, clock)
    kinds = []
    for second in range(95):  # throttled for 95 s
        clock.now += 1
        notice = limiter.throttled(clock.now - 0.5 if second else None, clock)
        kinds.append((second, notice.kind) if notice else None)
    assert [k for k in kinds if k] == [(0, "started"), (30, "lowered"), (60, "lowered"), (90, "lowered")]
    while (notice := limiter.succeeded(clock)) is None:
        clock.now += 1
    assert notice.kind == "ended"


def test_a_flapping_store_is_not_announced_more_than_every_30_s():
    """Throttled, lifted at once (a process that sends little), throttled again: one line."""
    clock = Clock()
    limiter = limiter_sending(0.1, 100, clock)  # lifted as soon as it reaches 2/s
    said, began = [], clock.now
    for _ in range(20):
        said.append(limiter.throttled(None, clock))
        while limiter.limit_per_s is not None:
            clock.now += 1
            said.append(limiter.succeeded(clock))
    kinds = [n.kind for n in said if n]
    assert kinds == ["started", "ended"] * (len(kinds) // 2)  # an end is said only after its start
    assert 2 <= len(kinds) // 2 <= (clock.now - began) / retry.WARN_EVERY_S + 1 < 20


@settings(max_examples=150, deadline=None)
@given(
    sent_per_s=st.floats(0, 5000),
    events=st.lists(
        st.tuples(st.sampled_from(["send", "throttle", "throttle-old", "succeed"]), st.floats(0, 5)), max_size=200
    ),
)
def test_the_limit_stays_between_the_floor_and_the_pre_throttle_rate(sent_per_s, events):
    clock = Clock()
    limiter = limiter_sending(sent_per_s, 2, clock)
    sent: list[float | None] = [None]
    ceiling = max(sent_per_s, 2 * MIN_RATE_PER_S)
    for kind, advance_s in events:
        clock.now += advance_s
        if kind == "send":
            ticket = limiter.reserve(clock)
            wait_s = 0.0 if ticket is None else limiter.wait_s(ticket, clock)
            assert wait_s <= (ticket or 0) + 1 / MIN_RATE_PER_S
            sent.append(None if ticket is None else clock.now + wait_s)
        elif kind == "throttle":
            limiter.throttled(sent[-1], clock)
        elif kind == "throttle-old":
            limiter.throttled(sent[0], clock)
        else:
            limiter.succeeded(clock)
        limit = limiter.limit_per_s
        assert limit is None or MIN_RATE_PER_S <= limit < ceiling * 1.01
        assert limiter.limited_s(clock) >= 0


@settings(max_examples=50, deadline=None)
@given(sent_per_s=st.floats(1, 2000), storm_s=st.floats(1, 120), seed=st.integers(0, 2**32 - 1))
def test_after_any_storm_the_limit_is_lifted_within_the_recovery_time(sent_per_s, storm_s, seed):
    """One requester sends as fast as it may: throttled answers for ``storm_s`` (after a
    random round trip and backoff), then successes. The limit stays at or above the floor
    and is lifted at most RECOVERY_S (plus a second) after the storm."""
    rng = random.Random(seed)
    clock = Clock()
    limiter = limiter_sending(sent_per_s, 10, clock)
    limiter.throttled(None, clock)
    storm_over = clock.now + storm_s

    def send() -> float:
        ticket = limiter.reserve(clock)
        if ticket is not None:
            clock.now += limiter.wait_s(ticket, clock)
        sent_at = clock.now
        clock.now += rng.uniform(0.001, 0.2)  # the round trip
        return sent_at

    while clock.now < storm_over:
        limiter.throttled(send(), clock)
        assert limiter.limit_per_s is not None and limiter.limit_per_s >= MIN_RATE_PER_S
        clock.now += retry.jittered_pause_s(1, rng.random())
    storm_over = clock.now
    while limiter.limit_per_s is not None:
        send()
        limiter.succeeded(clock)
    assert clock.now - storm_over <= RECOVERY_S + 1


# -- a process of many requesters through a storm, simulated ------------------------------


@dataclass
class Simulation:
    """``requesters`` threads each sending requests back to back (a request takes
    ``round_trip_s``) to a store that throttles every request in [``storm_from``,
    ``storm_until``); a throttled request is retried after the store's jittered backoff.
    With ``limited``, every send first waits for its turn as ``Store`` does."""

    limited: bool
    requesters: int = 64
    round_trip_s: float = 0.02
    storm_from: float = 10.0
    storm_until: float = 40.0
    seed: int = 7
    sends: list[tuple[float, bool]] = field(default_factory=list)  # (when, throttled)
    done_by: float = 0.0  # when the last requester had 20 successes after the storm

    def run(self, until: float = 120.0) -> Simulation:
        rng = random.Random(self.seed)
        clock = Clock(0.0)
        limiter = RequestRateLimiter(0.0)
        # (when, order, what, who, ticket or sending time, retry number)
        events: list[tuple[float, int, str, int, float | None, int]] = []
        order = itertools.count()
        successes_after = [0] * self.requesters

        def later(delay_s: float, what: str, who: int, value: float | None = None, retry_no: int = 0) -> None:
            heapq.heappush(events, (clock.now + delay_s, next(order), what, who, value, retry_no))

        for who in range(self.requesters):
            later(0.0, "want", who)
        while events:
            clock.now, _, what, who, value, retry_no = heapq.heappop(events)
            if clock.now > until:
                break
            if what == "want":  # take a ticket (or go at once)
                value = limiter.reserve(clock) if self.limited else None
                what = "turn"
            if what == "turn":  # wait for the turn in steps, as Store._wait_turn does
                wait = limiter.wait_s(int(value), clock) if value is not None else 0.0
                if wait > 0:
                    later(min(wait, 0.25), "turn", who, value, retry_no)
                    continue
                self.sends.append((clock.now, self.storm_from <= clock.now < self.storm_until))
                later(self.round_trip_s, "answer", who, None if value is None else clock.now, retry_no)
                continue
            if self.sends and self.storm_from <= clock.now - self.round_trip_s < self.storm_until:
                if self.limited:
                    limiter.throttled(value, clock)
                later(retry.jittered_pause_s(retry_no + 1, rng.random()), "want", who, None, retry_no + 1)
                continue
            if self.limited:
                limiter.succeeded(clock)
            if clock.now >= self.storm_until:
                successes_after[who] += 1
                if successes_after[who] == 20:
                    self.done_by = max(self.done_by, clock.now)
                    continue  # this requester is done
            later(0.0, "want", who)
        return self

    def throttled_per_s(self, start: float, end: float) -> float:
        return sum(start <= t < end and throttled for t, throttled in self.sends) / (end - start)


def test_simulated_storm_the_limiter_sends_far_fewer_requests_and_recovers():
    plain, limited = Simulation(limited=False).run(), Simulation(limited=True).run()
    first, rest = (10, 15), (15, 40)
    print(
        f"throttled requests/s, first 5 s / last 25 s of a 30 s storm: without limiter "
        f"{plain.throttled_per_s(*first):.0f} / {plain.throttled_per_s(*rest):.1f}, with "
        f"{limited.throttled_per_s(*first):.0f} / {limited.throttled_per_s(*rest):.1f}; every requester done "
        f"{plain.done_by - 40:.1f} s / {limited.done_by - 40:.1f} s after the storm"
    )
    assert limited.throttled_per_s(*rest) <= 2 * MIN_RATE_PER_S
    assert limited.throttled_per_s(*rest) < plain.throttled_per_s(*rest) / 5
    assert limited.throttled_per_s(*first) < plain.throttled_per_s(*first)
    assert 40 < plain.done_by and 40 < limited.done_by < 40 + RECOVERY_S + 15


# -- the Store's use of it -----------------------------------------------------------------


def test_store_requests_take_turns_once_throttled_and_the_limit_is_in_the_figures(caplog):
    clock = FakeClock()
    store = scripted(clock)
    other = Store(store.url)  # another handle on the same bucket: the same limiter
    assert store.rate_limit_per_s == math.inf and store.rate_limited_s == 0
    storm_until = 30.0
    store.fault = lambda request, key: throttled(key) if clock.now < storm_until else None
    with caplog.at_level(logging.WARNING, logger="batchweave.store"):
        store.get(KEY)
        assert MIN_RATE_PER_S <= store.rate_limit_per_s < math.inf
        assert other.rate_limit_per_s == store.rate_limit_per_s
        sent_at = []

        def timed(request, key):
            sent_at.append(clock.now)

        store.fault = timed
        for _ in range(5):
            store.get(KEY)
    gaps = [b - a for a, b in itertools.pairwise(sent_at)]
    assert all(gap >= 1 / store.rate_limit_per_s - 1e-9 for gap in gaps)  # spaced at the limit
    lines = [record.getMessage() for record in caplog.records]
    assert "store throttling: this process now sends at most" in lines[0]
    assert "requests/s to this bucket" in lines[0]
    assert store.rate_limited_s > storm_until - 1


@pytest.mark.parametrize(
    "status,code,limits",
    [
        (503, "SlowDown", True),  # S3
        (503, "ServerBusy", True),  # Azure
        (429, "TooManyRequests", True),  # GCS
        (500, "InternalError", False),
        (502, "BadGateway", False),
        (504, "GatewayTimeout", False),
    ],
)
def test_throttling_limits_the_rate_and_a_server_error_does_not(status, code, limits):
    clock = FakeClock()
    store = scripted(clock)
    failure = obs_errors.GenericError(obstore_status_message(KEY, status, method="GET", code=code))
    store.fault = lambda request, key: failure if clock.now < 5 else None
    store.get(KEY)
    assert store.retries > 0 and (store.rate_limit_per_s < math.inf) == limits


def test_a_timeout_does_not_limit_the_rate():
    clock = FakeClock()
    store = scripted(clock)
    timeout = obs_errors.GenericError(obstore_transport_message(KEY, "Timeout"))
    store.fault = lambda request, key: timeout if clock.now < 5 else None
    store.get(KEY)
    assert store.retries > 0 and store.rate_limit_per_s == math.inf


def test_a_waiting_turn_is_cut_at_the_retry_deadline():
    """Many requests queued at the floor: a retry still ends at its deadline exactly."""
    clock = FakeClock()
    store = scripted(clock, storage_options={"retry_deadline_s": 20})
    store.fault = lambda request, key: throttled(key)
    limiter = store._limiter
    limiter.throttled(None, clock.monotonic)
    for _ in range(100):  # other threads' turns, 1 s apart at the floor
        limiter.reserve(clock.monotonic)
    started = clock.now
    with pytest.raises(Exception, match=r"still failing after 20\.0 s"):
        store.get(KEY)
    assert clock.now - started == pytest.approx(20)


def test_handles_of_different_buckets_have_their_own_limiters():
    one = ScriptedStore(f"memory://rate-{uuid.uuid4().hex}")
    two = ScriptedStore(f"memory://rate-{uuid.uuid4().hex}")
    assert one._limiter is not two._limiter and Store(one.url)._limiter is one._limiter
    s3 = Store("s3://bucket-a/run-1", storage_options={"endpoint": "http://127.0.0.1:9"})
    same = Store("s3://bucket-a/run-2", storage_options={"endpoint": "http://127.0.0.1:9"})
    elsewhere = Store("s3://bucket-b/run-1", storage_options={"endpoint": "http://127.0.0.1:9"})
    assert s3._limiter is same._limiter and s3._limiter is not elsewhere._limiter


def test_consumer_and_producer_metrics_show_the_limit_and_prometheus_exposes_it():
    prometheus_client = pytest.importorskip("prometheus_client")
    url = f"memory://rate-{uuid.uuid4().hex}"
    registry = prometheus_client.CollectorRegistry()
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        producer.append([b"tgb-0"], source_offset=0)
        producer.flush()
        with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as consumer:
            assert bytes(next(consumer).data) == b"tgb-0"
            register_prometheus(consumer, registry, rank="0")
            before = consumer.metrics()
            assert before.store_rate_limit_per_s == math.inf and before.store_rate_limited_s == 0
            assert "limited" not in describe(before)
            assert 'batchweave_consumer_store_rate_limit_per_s{rank="0"} +Inf' in scrape(prometheus_client, registry)
            Store(url)._limiter.throttled(None, time.monotonic)  # as a 503 SlowDown answer would
            during = consumer.metrics()
            assert MIN_RATE_PER_S <= during.store_rate_limit_per_s < math.inf
            assert f"requests limited to {during.store_rate_limit_per_s:.1f}/s (store throttling)" in describe(during)
            assert producer.metrics()["store_rate_limit_per_s"] == during.store_rate_limit_per_s
            limit = f'batchweave_consumer_store_rate_limit_per_s{{rank="0"}} {during.store_rate_limit_per_s}'
            assert limit in scrape(prometheus_client, registry)


def scrape(prometheus_client, registry) -> str:
    return prometheus_client.generate_latest(registry).decode()
