"""Issue 18 item 8: a throttling storm must not kill a training rank; and a process
under throttling sends fewer requests (the adaptive request-rate limiter).

A proxy in front of a real S3 server (moto) answers every request with S3's
``503 SlowDown`` for 24 s, more than twice the backoff's cap. A producer in a child
process and a consumer in this one read and write through it the whole time; both must
slow down during the storm (the request rate falls as their backoff grows: no tight
loop), carry on in the same process once it is over, and deliver every TGB exactly once
and in order, with the stall in metrics().

Run as a script, this file is the producer: ``python test_storm.py URL STOP OUT``
appends TGB ``i`` holding ``b"tgb-<i>"`` until the file STOP exists, closes, ends the
stream and writes its metrics to OUT.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import S3_BUCKET

import batchweave as bw
from batchweave import retry
from batchweave.store import Store
from batchweave.store import requests as store_requests

STORM_S = 2.4 * retry.MAX_BACKOFF_S  # long enough for the backoff to reach its cap and stay there
EARLY_S = STORM_S / 6  # the storm's first seconds, when the backoff is short
BEFORE_STORM_STEPS = 5  # delivered before the storm starts
AFTER_STORM_STEPS = 5  # delivered after the first step that follows the storm
APPEND_EVERY_S = 0.05  # the producer's pace: a steady stream, as a data loader makes


def payload(offset: int) -> bytes:
    return f"tgb-{offset}".encode()


def produce_until_stopped(url: str, stop: Path, out: Path) -> None:
    with bw.Producer(url, "storm", dp=1) as producer:
        offset = 0
        while not stop.exists():
            producer.append([payload(offset)], source_offset=offset)
            offset += 1
            time.sleep(APPEND_EVERY_S)
        producer.flush()
        report = {"appended": offset, "epoch": producer.epoch, "metrics": producer.metrics()}
    bw.end_stream(url)
    out.write_text(json.dumps(report))


@pytest.fixture
def storm_proxy(moto_server, monkeypatch):
    """A proxy in front of moto; this process and its children reach S3 only through it."""
    from batchweave.testing import servers
    from batchweave.testing.proxy import LatencyProxy

    with LatencyProxy(moto_server) as proxy:
        for var in servers.S3_ENV_UNSET:
            monkeypatch.delenv(var, raising=False)
        for var, value in servers.s3_env(proxy.endpoint).items():
            monkeypatch.setenv(var, value)
        yield proxy


def rate(arrivals: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in arrivals) / (end - start)


@pytest.mark.s3
@pytest.mark.timeout(180)
def test_a_throttling_storm_slows_producer_and_consumer_and_loses_nothing(storm_proxy, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="batchweave.store")
    url = f"s3://{S3_BUCKET}/storm-{uuid.uuid4().hex[:12]}"
    stop, out, log = tmp_path / "stop", tmp_path / "producer.json", tmp_path / "producer.log"
    with open(log, "w") as stderr:  # its WARNING lines about the storm, for a failure's message
        child = subprocess.Popen([sys.executable, __file__, url, str(stop), str(out)], stderr=stderr)
    try:
        got: list[bytes] = []
        with bw.Consumer(url, dp=1, rank=0, prefetch=4, timeout_s=STORM_S + 30) as consumer:
            while len(got) < BEFORE_STORM_STEPS:
                got.append(bytes(next(consumer).data))
            storm_began = time.monotonic()
            storm_over = storm_proxy.storm(STORM_S)
            while time.monotonic() < storm_over:  # the steps prefetched, then one the storm held back
                got.append(bytes(next(consumer).data))
            after_storm = len(got)
            while len(got) < after_storm + AFTER_STORM_STEPS:  # appended and committed after the storm
                got.append(bytes(next(consumer).data))
            stop.touch()
            got.extend(bytes(batch.data) for batch in consumer)  # until the producer ends the stream
            metrics = consumer.metrics()
        child.wait(timeout=60)
    finally:
        stop.touch()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, log.read_text()[-3000:]
    report = json.loads(out.read_text())

    # Exactly once and in order, from the one incarnation that lived through the storm.
    assert report["epoch"] == 1
    assert got == [payload(offset) for offset in range(report["appended"])]
    assert after_storm > BEFORE_STORM_STEPS and len(got) > after_storm + AFTER_STORM_STEPS

    # Both processes stalled through the storm, counted it, and said so in their logs.
    for said in (caplog.text, log.read_text()):
        assert "store throttled or unavailable: retrying" in said and "store answering again after" in said
    # (stalled from the first request the storm refused: at most one pause at the head after it began)
    assert metrics.store_retries > 0 and metrics.store_stalled_s > STORM_S - 2 * EARLY_S
    produced = report["metrics"]
    assert produced["store_retries"] > 0 and produced["store_stalled_s"] > STORM_S - 2 * EARLY_S

    # Backoff: the storm saw a falling request rate, not a tight loop.
    arrivals = storm_proxy.storm_arrivals()
    early = rate(arrivals, storm_began, storm_began + EARLY_S)
    late = rate(arrivals, storm_over - STORM_S / 2, storm_over)
    print(
        f"storm: {len(arrivals)} requests answered 503, {early:.1f}/s in the first {EARLY_S:g} s, {late:.1f}/s in "
        f"the last {STORM_S / 2:g} s; consumer {metrics.store_retries} retries, {metrics.store_stalled_s:.1f} s "
        f"stalled; producer {produced['store_retries']} retries, {produced['store_stalled_s']:.1f} s stalled; "
        f"{len(got)} TGBs"
    )
    assert early > 0 and late < early / 2, (
        f"requests/s in the storm: first {EARLY_S:g} s {early:.1f}, last {STORM_S / 2:g} s {late:.1f}"
    )


class NoLimit:
    """A request-rate limiter that never limits: the retry loop as it was before the limiter."""

    limit_per_s = None
    sent = 0

    def reserve(self, clock):
        return None

    def throttled(self, sent_at, clock):
        return None

    def succeeded(self, clock):
        return None

    def current_per_s(self):
        return math.inf

    def limited_s(self, clock):
        return 0.0


REQUESTERS = 32  # threads in this process, over 4 Store handles on the bucket
SHORT_STORM_S = 3.0
WARM_UP_S = 0.5  # unthrottled requests first: what the limiter measures the process's rate on
AFTER_SHORT_STORM = 1  # round trips each requester completes after the storm (its own in the storm)


def requesters_through_a_storm(proxy, limited: bool) -> dict:
    """REQUESTERS threads each put an object of their own and read it back, over and over,
    through a SHORT_STORM_S storm, until each has done AFTER_SHORT_STORM round trips after
    it. Returns the storm's arrivals, every object written and what was read back."""
    run = f"s3://{S3_BUCKET}/rate-{uuid.uuid4().hex[:12]}"
    stores = [Store(f"{run}/{index}") for index in range(4)]
    if limited:  # a fresh limiter for the bucket (the registry's: shared by all four handles)
        with store_requests._limiters_lock:
            store_requests._limiters.clear()
        stores = [Store(store.url) for store in stores]
        assert all(store._limiter is stores[0]._limiter for store in stores)
    else:
        for store in stores:
            store._limiter = NoLimit()
    written: dict[str, bytes] = {}
    read: dict[str, bytes] = {}
    errors: list[BaseException] = []
    storm_over = [math.inf]
    lock = threading.Lock()

    def requester(who: int) -> None:
        store = stores[who % len(stores)]
        after = 0
        try:
            for n in itertools.count():
                key, body = f"r{who}/{n:06d}", f"{who}-{n}-{limited}".encode()
                store.put_if_absent(key, body)
                got = bytes(store.get(key))
                with lock:
                    written[f"{store.url}/{key}"], read[f"{store.url}/{key}"] = body, got
                if time.monotonic() >= storm_over[0]:
                    after += 1
                    if after >= AFTER_SHORT_STORM:
                        return
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=requester, args=(who,), daemon=True) for who in range(REQUESTERS)]
    for thread in threads:
        thread.start()
    time.sleep(WARM_UP_S)  # (a pace, not a wait for a condition: the requesters run meanwhile)
    began = time.monotonic()
    arrivals_before = len(proxy.storm_arrivals())
    storm_over[0] = proxy.storm(SHORT_STORM_S)
    for thread in threads:
        thread.join(60)
    arrivals = proxy.storm_arrivals()[arrivals_before:]
    return {
        "began": began,
        "over": storm_over[0],
        "arrivals": arrivals,
        "written": written,
        "read": read,
        "errors": errors,
        "alive": sum(thread.is_alive() for thread in threads),
        "done_s": time.monotonic() - storm_over[0],
        "limit": stores[0].rate_limit_per_s,
        "limited_s": stores[0].rate_limited_s,
    }


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_requesters_of_one_process_send_far_fewer_requests_into_a_storm_with_the_rate_limiter(storm_proxy, caplog):
    caplog.set_level(logging.WARNING, logger="batchweave.store")
    plain = requesters_through_a_storm(storm_proxy, limited=False)
    limited = requesters_through_a_storm(storm_proxy, limited=True)

    for run in (plain, limited):  # every request succeeded once the storm was over, nothing lost
        assert run["errors"] == [] and run["alive"] == 0
        assert run["read"] == run["written"] and len(run["written"]) >= REQUESTERS * AFTER_SHORT_STORM

    def per_second(run: dict) -> list[int]:
        counts = collections.Counter(int(t - run["began"]) for t in run["arrivals"])
        return [counts.get(second, 0) for second in range(math.ceil(SHORT_STORM_S))]

    def late_rate(run: dict) -> float:  # after the first second: the burst in flight is answered
        return rate(run["arrivals"], run["began"] + 1, run["over"])

    print(
        f"requests answered 503 per second of a {SHORT_STORM_S:g} s storm, {REQUESTERS} requesters in one "
        f"process: without the limiter {per_second(plain)} ({late_rate(plain):.1f}/s after the first second), "
        f"with it {per_second(limited)} ({late_rate(limited):.1f}/s); all done {plain['done_s']:.1f} s / "
        f"{limited['done_s']:.1f} s after the storm; limited for {limited['limited_s']:.1f} s"
    )
    # The limiter cuts the rate once per round of answers: by the storm's last second the
    # process sends a small fraction of what backoff alone would.
    assert per_second(limited)[-1] < per_second(plain)[-1] / 4
    assert late_rate(limited) < late_rate(plain) / 2
    assert "store throttling: this process now sends at most" in caplog.text


if __name__ == "__main__":
    produce_until_stopped(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
