"""Consumer.metrics(): what a rank can tell about its own reading, without I/O."""

from __future__ import annotations

import logging
import math
import pickle
import uuid

import numpy as np
import pytest

import batchweave as bw
from batchweave import consumer as consumer_module
from batchweave.commit.policies import Manual
from batchweave.latency import LatencyModel, LatencyStore
from batchweave.metrics import FetchRecorder, PeriodicLog, describe, register_prometheus

NO_LATENCY = LatencyModel(put_s=0, first_byte_s=0, head_s=0, list_s=0, delete_s=0, jitter_sigma=0)
# The two ranks' slices differ in length, so the metrics can tell their bytes apart.
RAGGED = {"x": ("int64", (None,))}


def commit(store, steps: int) -> None:
    with bw.Producer(store, "p", dp=2, commit_policy=Manual(), schema=RAGGED) as producer:
        for offset in range(steps):
            producer.append([{"x": np.full(10, offset, np.int64)}, {"x": np.zeros(3, np.int64)}], source_offset=offset)
        producer.flush()


@pytest.mark.parametrize("remote", [False, True])
def test_metrics_count_what_was_handed_out_and_what_is_left(tmp_path, remote):
    store = LatencyStore(f"memory://metrics-{uuid.uuid4().hex}", NO_LATENCY) if remote else str(tmp_path / "ns")
    commit(store, 12)
    with bw.Consumer(store, dp=2, rank=0, timeout_s=30) as consumer:
        before = consumer.metrics()
        assert (before.steps, before.bytes, before.fetches, before.behind_head_steps) == (0, 0, 0, 0)
        assert math.isnan(before.fetch_p50_s)
        for _ in range(5):
            next(consumer)
        after = consumer.metrics()
    assert (after.steps, after.bytes) == (5, 5 * 80)  # ten int64 per step on rank 0
    assert after.behind_head_steps == 12 - 5  # the one version named all twelve
    assert after.head_version == 2  # the claim, then one commit
    # remote: the twelve TGBs are one pack (small slices), read with one request; a local
    # directory reads each step on its own
    assert after.fetches == 1 if remote else after.fetches >= 5
    assert 0 <= after.fetch_p50_s <= after.fetch_p95_s <= after.fetch_max_s
    assert after.wait_s > 0
    assert set(after.to_dict()) >= {"steps", "bytes", "wait_s", "fetch_p95_s"}


def test_percentiles_are_nearest_rank_over_the_recent_window():
    recorder = FetchRecorder(window=100)
    for ms in range(1, 201):  # only 101..200 stay in the window
        recorder.record(ms / 1000)
    assert recorder.percentiles() == (0.150, 0.195, 0.200)
    assert recorder.fetches == 200


def test_a_pickled_consumer_starts_its_metrics_afresh(tmp_path):
    url = str(tmp_path / "ns")
    commit(url, 3)
    consumer = bw.Consumer(url, dp=2, rank=1, timeout_s=10)
    next(consumer)
    copy = pickle.loads(pickle.dumps(consumer))
    consumer.close()
    assert copy.metrics().steps == 0
    assert [next(copy).step for _ in range(2)] == [1, 2]  # on from the cursor it was pickled with
    assert copy.metrics().steps == 2
    copy.close()


def test_the_periodic_log_fires_once_per_interval_of_ticks():
    now = [0.0]
    emitted = []
    periodic = PeriodicLog(10.0, lambda: emitted.append(now[0]), clock=lambda: now[0])
    for t in (1, 5, 9.9, 10, 12, 19.9, 20.5, 21):
        now[0] = t
        periodic.tick()
    assert emitted == [10, 20.5]


def test_describe_says_whether_the_gpu_waited(tmp_path):
    url = str(tmp_path / "ns")
    commit(url, 4)
    with bw.Consumer(url, dp=2, rank=0, timeout_s=10) as consumer:
        for _ in range(4):
            next(consumer)
        line = describe(consumer.metrics())
    assert line.startswith("4 steps, 0.0 MB, waited ") and "0 steps behind log version 2" in line


def test_prometheus_scrapes_consumer_and_producer_metrics(tmp_path):
    prometheus_client = pytest.importorskip("prometheus_client")
    url = str(tmp_path / "ns")
    registry = prometheus_client.CollectorRegistry()
    with bw.Producer(url, "p", dp=2, commit_policy=Manual(), schema=RAGGED) as producer:
        register_prometheus(producer, registry, producer_id="p")
        producer.append([{"x": np.zeros(10, np.int64)}, {"x": np.zeros(3, np.int64)}], source_offset=0)
        producer.flush()
        with bw.Consumer(url, dp=2, rank=1, timeout_s=10) as consumer:
            register_prometheus(consumer, registry, rank="1")
            next(consumer)
            text = prometheus_client.generate_latest(registry).decode()
    assert 'batchweave_consumer_steps{rank="1"} 1.0' in text
    assert 'batchweave_consumer_bytes{rank="1"} 24.0' in text
    assert 'batchweave_producer_tgbs_committed{producer_id="p"} 1.0' in text


def test_a_consumer_logs_its_metrics_at_info_while_iterating(tmp_path, caplog, monkeypatch):
    url = str(tmp_path / "ns")
    commit(url, 6)
    now = [100.0]
    monkeypatch.setattr(consumer_module.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.INFO, logger="batchweave.consumer"):
        with bw.Consumer(url, dp=2, rank=0, timeout_s=10, log_metrics_s=30) as consumer:
            for step in range(6):
                now[0] = 100.0 + 10 * step  # steps at 100..150 s: the one log is due at 130
                next(consumer)
    lines = [r.getMessage() for r in caplog.records if r.name == "batchweave.consumer"]
    assert len(lines) == 1 and "rank 0: 4 steps" in lines[0]


@pytest.mark.parametrize("interval", [0, -1, True, "30"])
def test_a_bad_log_interval_is_refused(tmp_path, interval):
    with pytest.raises(bw.ConfigError, match="log_metrics_s must be a positive number"):
        bw.Consumer(str(tmp_path), dp=1, rank=0, log_metrics_s=interval)


@pytest.mark.parametrize("remote", [False, True])
def test_log_requests_count_the_ranks_own_log_reads_across_restarts(tmp_path, remote):
    store = LatencyStore(f"memory://metrics-{uuid.uuid4().hex}", NO_LATENCY) if remote else str(tmp_path / "ns")
    commit(store, 4)
    consumer = bw.Consumer(store, dp=2, rank=0, timeout_s=30)
    assert consumer.metrics().log_requests == 0  # nothing read before the first step
    next(consumer)
    reading = consumer.metrics().log_requests
    assert reading >= 2  # at least the two versions it read (the claim and the commit)
    consumer.close()
    # A closed reader's requests stay counted: those before, and a poll of the log that
    # was in flight when it closed (a fresh-clone run counted 14 after 13).
    first = consumer.metrics().log_requests
    assert first >= reading and consumer.metrics().log_requests == first
    next(consumer)  # reading again from the cursor: a new reader, counted on top
    assert consumer.metrics().log_requests > first
    consumer.close()


def test_reading_version_is_the_running_readers_proven_view(tmp_path):
    url = str(tmp_path / "ns")
    commit(url, 3)
    consumer = bw.Consumer(url, dp=2, rank=0, timeout_s=10)
    assert consumer.reading_version is None  # not reading yet
    next(consumer)
    assert consumer.reading_version == 2  # the claim, then the commit that named all three
    consumer.close()
    assert consumer.reading_version is None
    assert consumer.metrics().head_version == 2  # the metrics keep what the cursor reached
