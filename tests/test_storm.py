"""Issue 18 item 8: a throttling storm must not kill a training rank.

A proxy in front of a real S3 server (moto) answers every request with S3's
``503 SlowDown`` for 60 s. A producer in a child process and a consumer in this one read
and write through it the whole time; both must slow down during the storm (the request
rate falls as their backoff grows: no tight loop), carry on in the same process once it
is over, and deliver every TGB exactly once and in order, with the stall in metrics().

Run as a script, this file is the producer: ``python test_storm.py URL STOP OUT``
appends TGB ``i`` holding ``b"tgb-<i>"`` until the file STOP exists, closes, ends the
stream and writes its metrics to OUT.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import S3_BUCKET

import batchweave as bw

STORM_S = 60.0
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
def test_a_60_s_throttling_storm_slows_producer_and_consumer_and_loses_nothing(storm_proxy, tmp_path, caplog):
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
    assert metrics.store_retries > 0 and metrics.store_stalled_s > STORM_S - 10
    produced = report["metrics"]
    assert produced["store_retries"] > 0 and produced["store_stalled_s"] > STORM_S - 10

    # Backoff: the storm saw a falling request rate, not a tight loop.
    arrivals = storm_proxy.storm_arrivals()
    early = rate(arrivals, storm_began, storm_began + 10)
    late = rate(arrivals, storm_began + 30, storm_over)
    print(
        f"storm: {len(arrivals)} requests answered 503, {early:.1f}/s in the first 10 s, {late:.1f}/s in the "
        f"last 30 s; consumer {metrics.store_retries} retries, {metrics.store_stalled_s:.1f} s stalled; producer "
        f"{produced['store_retries']} retries, {produced['store_stalled_s']:.1f} s stalled; {len(got)} TGBs"
    )
    assert early > 0 and late < early / 2, f"requests/s in the storm: first 10 s {early:.1f}, last 30 s {late:.1f}"


if __name__ == "__main__":
    produce_until_stopped(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
