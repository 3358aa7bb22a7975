"""The store's retry loop through throttling and outages, on a fake clock: the deadline,
the backoff's growth and jitter, what is never retried, the short budget of an endpoint
that never answered, the WARNING lines, and the stall figures. No real waiting."""

from __future__ import annotations

import collections
import itertools
import logging
import math
import random
import threading
import time
import uuid

import pytest
from obstore import exceptions as obs_errors
from obstore_errors import obstore_status_message, obstore_transport_message
from worker import Eager

import batchweave as bw
from batchweave import keys, retry
from batchweave.commit.policies import Manual
from batchweave.store import Store
from batchweave.testing import Background

KEY = "_log/00000000000000000007.json"


class FakeClock:
    """``now`` moves only when the code under test sleeps; every pause is recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.pauses.append(seconds)
        self.now += seconds


class ScriptedStore(Store):
    """A memory store whose requests fail as ``fault(request, key)`` says (None: served)."""

    fault = staticmethod(lambda request, key: None)

    def _perform(self, request, nbytes, op):
        exc = self.fault(request, self._current_key)
        if exc is not None:
            raise exc
        return op()

    def _call(self, key, op, request, nbytes=0, *, conditional=False):
        self._current_key = key
        return super()._call(key, op, request, nbytes, conditional=conditional)


def throttled(key: str = KEY) -> Exception:
    return obs_errors.GenericError(obstore_status_message(key, 503, method="GET", code="SlowDown"))


def server_error(key: str = KEY) -> Exception:
    """A transient error that is not throttling: retried alike, but the rate stays unlimited."""
    return obs_errors.GenericError(obstore_status_message(key, 500, method="GET", code="InternalError"))


def refused(key: str = KEY) -> Exception:
    return obs_errors.GenericError(obstore_transport_message(key, "Connect"))


def scripted(clock: FakeClock, draw=lambda: 0.5, **options) -> ScriptedStore:
    store = ScriptedStore(f"memory://retry-{uuid.uuid4().hex}", **options)
    store._retry_clock, store._retry_sleep, store._retry_draw = clock.monotonic, clock.sleep, draw
    store.put_if_absent(KEY, b"{}")  # served: the store has been reached
    return store


def failing(count: int, make=throttled):
    """A fault script: the first ``count`` GETs fail, the rest are served."""
    calls = []

    def fault(request, key):
        calls.append(request)
        return make(key) if request == "get" and len(calls) <= count else None

    return fault, calls


def test_a_throttled_request_is_retried_until_it_succeeds():
    clock = FakeClock()
    store = scripted(clock)
    store.fault, calls = failing(7)
    assert bytes(store.get(KEY)) == b"{}"
    assert len(calls) == 8 and store.retries == 7
    assert store.stalled_s == pytest.approx(sum(clock.pauses))  # backoff, and turns under the rate limit


def test_a_request_that_failed_with_a_server_error_pauses_once_per_retry():
    clock = FakeClock()
    store = scripted(clock)
    store.fault, calls = failing(7, server_error)
    assert bytes(store.get(KEY)) == b"{}"
    assert len(calls) == 8 and store.retries == 7 and len(clock.pauses) == 7
    assert store.stalled_s == pytest.approx(sum(clock.pauses)) and store.rate_limit_per_s == math.inf


def test_the_backoff_doubles_from_50_ms_to_a_10_s_cap():
    clock = FakeClock()
    store = scripted(clock, draw=lambda: 1.0)  # the top of every jitter range
    store.fault, _ = failing(12, server_error)  # (throttling adds the rate limit's waits: see below)
    store.get(KEY)
    assert clock.pauses == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10, 10, 10, 10])


def test_the_jitter_is_full_and_differs_between_processes():
    """Each pause is uniform in [0, bound]: ranks that hit one throttle spread their retries."""
    runs = []
    for seed in (1, 2):
        clock = FakeClock()
        store = scripted(clock, draw=random.Random(seed).random)
        store.fault, _ = failing(40, server_error)
        store.get(KEY)
        bounds = [retry.backoff_bound_s(n) for n in range(1, 41)]
        assert all(0 <= pause <= bound for pause, bound in zip(clock.pauses, bounds))
        late = clock.pauses[10:]  # at the cap: spread over [0, 10 s], not all at its top
        assert min(late) < 3 and max(late) > 7
        runs.append(clock.pauses)
    assert runs[0] != runs[1]


def test_the_deadline_ends_the_retries_exactly():
    clock = FakeClock()
    store = scripted(clock, storage_options={"retry_deadline_s": 120})
    store.fault, calls = failing(10**9)
    with pytest.raises(bw.TransientStoreError, match=r"HTTP 503 SlowDown.*still failing after 120\.0 s") as info:
        store.get(KEY)
    assert clock.now == pytest.approx(120)  # the last pause is cut to end at the deadline
    assert info.value.retried_s == pytest.approx(120) and "retry_deadline_s=120" in str(info.value)
    assert len(calls) == store.retries + 1 and 20 < store.retries < 60  # about 5 s apart at the cap


@pytest.mark.parametrize("status,error", [(403, bw.StorePermissionError), (404, bw.ObjectNotFoundError)])
def test_permanent_errors_are_never_retried(status, error):
    clock = FakeClock()
    store = scripted(clock)
    store.fault, calls = failing(1, lambda key: obs_errors.GenericError(obstore_status_message(key, status)))
    with pytest.raises(error):
        store.get(KEY)
    assert len(calls) == 1 and clock.pauses == [] and store.retries == 0 and store.stalled_s == 0


def test_an_endpoint_never_reached_gives_up_in_seconds():
    """A mistyped endpoint (connection refused, no such host) on a process's first
    request: a clear error after UNREACHABLE_DEADLINE_S, not ten silent minutes."""
    clock = FakeClock()
    store = ScriptedStore(f"memory://retry-{uuid.uuid4().hex}")
    store._retry_clock, store._retry_sleep, store._retry_draw = clock.monotonic, clock.sleep, lambda: 0.5
    store.fault = lambda request, key: refused(key)
    with pytest.raises(bw.TransientStoreError, match="no request of this process ever reached the store"):
        store.get(KEY)
    assert clock.now == pytest.approx(retry.UNREACHABLE_DEADLINE_S)


def test_a_request_that_gave_up_is_not_logged_as_a_recovery(caplog):
    clock = FakeClock()
    store = scripted(clock, storage_options={"retry_deadline_s": 60})
    store.fault, _ = failing(10**9)
    with caplog.at_level(logging.WARNING, logger="batchweave.store"), pytest.raises(bw.TransientStoreError):
        store.get(KEY)
    assert "retrying GET" in caplog.text and "answering again" not in caplog.text


def test_once_reached_a_refused_connection_gets_the_whole_deadline():
    """An endpoint that answered before and now refuses is restarting: ride it out."""
    clock = FakeClock()
    store = scripted(clock, storage_options={"retry_deadline_s": 300})
    store.fault, _ = failing(10**9, refused)
    with pytest.raises(bw.TransientStoreError, match="still failing after 300.0 s"):
        store.get(KEY)
    assert clock.now == pytest.approx(300)


def test_a_throttled_first_request_gets_the_whole_deadline():
    """A 503 is an answer: the endpoint is right, the store is busy."""
    clock = FakeClock()
    store = ScriptedStore(f"memory://retry-{uuid.uuid4().hex}")
    store._retry_clock, store._retry_sleep, store._retry_draw = clock.monotonic, clock.sleep, lambda: 0.5
    store.put_if_absent(KEY, b"{}")
    store._reached = False  # as in a fresh process
    store.fault = lambda request, key: throttled(key) if clock.now < 60 else None
    assert bytes(store.get(KEY)) == b"{}" and clock.now >= 60


def test_a_stall_is_logged_at_the_first_retry_then_every_30_s_then_its_end(caplog):
    clock = FakeClock()
    store = scripted(clock)
    store.fault = lambda request, key: throttled(key) if request == "get" and clock.now < 100 else None
    with caplog.at_level(logging.WARNING, logger="batchweave.store"):
        store.get(KEY)
    lines = [record.getMessage() for record in caplog.records]
    retrying = [line for line in lines if "retrying GET" in line]
    assert len(retrying) == 4  # at 0 s, then at least 30 s apart through 100 s
    assert "store throttled or unavailable: retrying GET _log/00000000000000000007.json for up to 600 s" in retrying[0]
    assert "(attempt 2, stalled 0.0 s so far)" in retrying[0] and "HTTP 503 SlowDown" in retrying[0]
    recovered = [line for line in lines if "store answering again" in line]
    assert recovered == [lines[-1]] and lines[-1].startswith(f"{store.url}: store answering again after 10")
    assert "retries" in lines[-1]


def test_a_stall_that_ends_in_a_permanent_answer_is_a_recovery(caplog):
    clock = FakeClock()
    store = scripted(clock)
    missing = obs_errors.GenericError(obstore_status_message(KEY, 404))
    store.fault = lambda request, key: throttled(key) if clock.now < 5 else missing
    with caplog.at_level(logging.WARNING, logger="batchweave.store"), pytest.raises(bw.ObjectNotFoundError):
        store.get(KEY)
    assert "store answering again after" in caplog.text


def test_no_warning_for_a_request_that_is_not_retried(caplog):
    clock = FakeClock()
    store = scripted(clock)
    with caplog.at_level(logging.WARNING, logger="batchweave.store"):
        store.get(KEY)
    assert caplog.records == []


def test_stalled_seconds_count_overlapping_stalls_once():
    clock = FakeClock()
    meter = retry.StallMeter(clock.monotonic)
    meter.begin()  # at 0
    clock.now = 5
    meter.begin()
    assert meter.retried() and not meter.retried()  # one warning per 30 s, not per thread
    clock.now = 10
    assert meter.end() is None  # the other request is still stalled
    clock.now = 20
    assert meter.end() == 20 and meter.stalled_s == 20 and meter.retries == 2
    assert meter.current_s == 0
    clock.now = 50
    meter.begin()
    clock.now = 53
    assert meter.stalled_s == 23 and meter.current_s == 3  # the open stall counts as it goes
    assert meter.end() is None  # not warned about: no "answering again" line


def test_a_commit_that_failed_through_the_whole_deadline_is_final():
    """The store already retried for retry_deadline_s: the producer fails at once with
    the store's error, instead of more rounds that would hide the outage."""
    store = ScriptedStore(f"memory://retry-{uuid.uuid4().hex}", storage_options={"retry_deadline_s": 0.3})
    producer = bw.Producer(store, "p", dp=1, commit_policy=Manual())
    store.fault = lambda request, key: throttled(key) if key.startswith("_log/") else None
    producer.append([b"x"])
    started = time.monotonic()
    with pytest.raises(bw.TransientStoreError, match="still failing after 0.3 s"):
        producer.flush(timeout_s=30)
    assert time.monotonic() - started < 5 and producer._shared.store_failures == 1
    producer.close(flush=False)


def test_a_consumer_whose_store_gave_up_resumes_after_close_without_a_second_wait():
    store = ScriptedStore(f"memory://retry-{uuid.uuid4().hex}", storage_options={"retry_deadline_s": 0.2})
    with bw.Producer(store, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(4):
            producer.append([f"tgb-{offset}".encode()], source_offset=offset)
        producer.flush()
    requests = []

    def throttle_data(request, key):  # (not throttling: the rate limit's climb back would slow the rest)
        requests.append(request)
        return server_error(key) if key.startswith("data/") else None

    with bw.Consumer(store, dp=1, rank=0, timeout_s=10) as consumer:
        assert bytes(next(consumer).data) == b"tgb-0"
        store.fault = throttle_data
        with pytest.raises(
            bw.TransientStoreError,
            match=r"HTTP 500 InternalError.*still failing after [0-9.]+ s .*retry_deadline_s=0.2",
        ):
            next(consumer)
        assert "head" not in requests  # no size check that would wait out a second deadline
        store.fault = lambda request, key: None
        consumer.close()  # the cursor is where next() left it: iteration resumes there
        assert [bytes(batch.data) for batch in itertools.islice(consumer, 3)] == [b"tgb-1", b"tgb-2", b"tgb-3"]


class RemoteScriptedStore(ScriptedStore):
    """Read as an object store: the consumer follows the log on a background thread."""

    @property
    def remote(self) -> bool:
        return True


def test_a_consumer_that_times_out_during_a_stall_says_the_store_is_the_cause():
    store = RemoteScriptedStore(f"memory://retry-{uuid.uuid4().hex}", storage_options={"retry_deadline_s": 8})
    with bw.Producer(store, "p", dp=1, commit_policy=Manual()) as producer:
        producer.append([b"tgb-0"], source_offset=0)
        producer.flush()
    with bw.Consumer(store, dp=1, rank=0, timeout_s=2, max_poll_interval_s=0.05) as consumer:
        assert bytes(next(consumer).data) == b"tgb-0"
        store.fault = lambda request, key: throttled(key) if key.startswith("_log/") else None
        with pytest.raises(bw.StepTimeoutError, match=r"no step 1 within 2s .* throttled or unavailable for \d s"):
            next(consumer)


def test_closing_a_consumer_during_a_stall_does_not_wait_it_out():
    """What a closing reader fetches is thrown away: its threads stop retrying at once."""
    store = RemoteScriptedStore(f"memory://retry-{uuid.uuid4().hex}")  # the default deadline, 600 s
    with bw.Producer(store, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(3):
            producer.append([f"tgb-{offset}".encode()], source_offset=offset)
        producer.flush()
    stalled = threading.Event()

    def throttle(request, key):
        if store.stalled_now_s > 0:
            stalled.set()
        return throttled(key)

    consumer = bw.Consumer(store, dp=1, rank=0, prefetch=2)
    store.fault = throttle  # the log and every slice: follower and fetches all retry
    iterating = Background(next, consumer)
    assert stalled.wait(30)
    started = time.monotonic()
    consumer.close()
    assert time.monotonic() - started < 5  # not the 600 s deadline
    # Stopped in a retry's backoff, or while waiting for its turn at the throttled store
    # (the log's reads, the proof and the fetches share one request-rate limiter).
    with pytest.raises(bw.TransientStoreError, match="(stopped retrying|stopped waiting to send .*): closing"):
        iterating.result(timeout_s=5)


def test_closing_a_producer_without_a_flush_during_a_stall_does_not_wait_it_out():
    store = ScriptedStore(f"memory://retry-{uuid.uuid4().hex}")  # the default deadline, 600 s
    producer = bw.Producer(store, "p", dp=1, commit_policy=Eager())
    stalled = threading.Event()

    def throttle_log(request, key):
        if store.stalled_now_s > 0:
            stalled.set()
        return throttled(key) if key.startswith("_log/") else None

    store.fault = throttle_log
    producer.append([b"tgb-0"])  # the commit thread tries to commit it at once, and stalls
    assert stalled.wait(30)
    started = time.monotonic()
    producer.close(flush=False)
    assert time.monotonic() - started < 5  # not the 600 s deadline


def test_a_head_copy_the_store_throttles_is_dropped_at_once_not_retried():
    """Found by CI (test_closing_a_consumer_during_a_stall_does_not_wait_it_out failed once):
    a producer's background copy puts retried a throttled store for up to the 600 s deadline,
    taking turns at the process's request-rate limiter from the consumer beside them. Copies
    are best effort: one attempt each, and the reader reads the version's own key."""
    from batchweave.journal import headcopies

    store = RemoteScriptedStore(f"memory://retry-{uuid.uuid4().hex}")  # the default deadline, 600 s
    attempts: collections.Counter[str] = collections.Counter()

    def throttle_copies(request, key):
        if request == "put" and key.startswith(keys.HEAD_PREFIX):
            attempts[key] += 1
            return throttled(key)
        return None

    store.fault = throttle_copies
    with bw.Producer(store, "p", dp=1, commit_policy=Manual()) as producer:
        producer.append([b"tgb-0"], source_offset=0)
        producer.flush()
    deadline = time.monotonic() + 30
    while headcopies._background._in_flight:  # the copy puts still running
        assert time.monotonic() < deadline, "copy puts still retrying after 30 s"
        time.sleep(0.01)
    assert attempts and set(attempts.values()) == {1}, attempts
