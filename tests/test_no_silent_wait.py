"""A consumer waiting on a namespace that shows nothing says so, and stops once it sees a version.

The rhythm is checked on a clock the test moves (``SilenceWatch.due``); the records with
``caplog``; and one real ``Consumer`` on an empty local directory, with the first warning
brought down to a fraction of a second, logs it and then reads the step a producer commits.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import batchweave as bw
from batchweave.reading import silence
from batchweave.reading.polling import HeadPolling
from batchweave.reading.silence import SilenceNotice, SilenceWatch, silence_message

URL = "s3://bucket/mistyped-prefix"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def notices(watch: SilenceWatch, clock: Clock, times: list[float]) -> list[tuple[float, SilenceNotice]]:
    """The notices of a miss at each of ``times`` (seconds after the first miss)."""
    start = clock.now
    got = []
    for at in times:
        clock.now = start + at
        notice = watch.missed()
        if notice is not None:
            got.append((at, notice))
    return got


def test_nothing_committed_warns_after_the_bound_then_with_doubling_capped_pauses():
    clock = Clock()
    watch = SilenceWatch(URL, first_s=30, max_reminder_s=200, clock=clock)
    misses = [0.0, 29.9, 30.0, 31.0, 89.9, 90.0, 209.9, 210.0, 409.9, 410.0, 609.9, 610.0]
    assert notices(watch, clock, misses) == [
        (30.0, SilenceNotice(empty=True, waited_s=30.0, next_in_s=60.0)),
        (90.0, SilenceNotice(empty=True, waited_s=90.0, next_in_s=120.0)),
        (210.0, SilenceNotice(empty=True, waited_s=210.0, next_in_s=200.0)),  # capped
        (410.0, SilenceNotice(empty=True, waited_s=410.0, next_in_s=200.0)),
        (610.0, SilenceNotice(empty=True, waited_s=610.0, next_in_s=200.0)),
    ]


def test_a_version_found_ends_the_empty_warnings_for_good():
    clock = Clock()
    watch = SilenceWatch(URL, first_s=30, clock=clock)
    assert [n.empty for _, n in notices(watch, clock, [0.0, 30.0])] == [True]
    watch.found()
    # The next silence starts afresh at its first miss, and is about producers stalling.
    later = notices(watch, clock, [100.0, 129.9, 130.0, 189.9, 190.0])
    assert later == [
        (130.0, SilenceNotice(empty=False, waited_s=30.0, next_in_s=60.0)),
        (190.0, SilenceNotice(empty=False, waited_s=90.0, next_in_s=120.0)),
    ]
    watch.found()  # each new version restarts the count
    assert notices(watch, clock, [300.0, 329.0]) == []


def test_the_records_name_the_url_and_what_to_check(caplog):
    clock = Clock()
    watch = SilenceWatch(URL, first_s=30, clock=clock)
    with caplog.at_level(logging.INFO, logger="batchweave.consumer"):
        notices(watch, clock, [0.0, 30.0])
        [empty] = caplog.records
        assert empty.levelno == logging.WARNING and empty.name == "batchweave.consumer"
        text = empty.getMessage()
        assert text.startswith(f"no BatchWeave namespace at {URL}: nothing committed yet after waiting 30 s.")
        for advice in ("is the one the producers write to", "producers are running", "endpoint and credentials"):
            assert advice in text
        assert text.endswith("next reminder in 60 s")
        caplog.clear()
        watch.found()
        notices(watch, clock, [40.0, 70.0])
        [stalled] = caplog.records
    assert stalled.levelno == logging.INFO
    assert stalled.getMessage().startswith(f"{URL}: no new log version for 30 s: the producers may have stopped")


def test_the_message_for_a_notice():
    text = silence_message("file:///d", SilenceNotice(empty=True, waited_s=65.4, next_in_s=120))
    assert "nothing committed yet after waiting 65 s" in text and "batchweave inspect URL" in text


def test_head_polling_tells_its_watch_of_each_find_and_miss(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(silence, "time", type("FakeTime", (), {"monotonic": staticmethod(clock)}))
    polling = HeadPolling(1, url=URL)
    assert HeadPolling(1).silence is None  # no URL (tests, the simulation's own models): no records
    assert polling.silence is not None and polling.silence.url == URL
    polling.missed()
    clock.now += silence.FIRST_WARNING_S
    polling.missed()
    assert not polling.silence.seen and polling.silence.due(clock.now + 1e6) is not None
    polling.found(0.0)
    assert polling.silence.seen


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_real_consumer_on_an_empty_directory_warns_then_reads_what_is_committed(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(silence, "FIRST_WARNING_S", 0.2)
    directory = tmp_path / "namespace"
    directory.mkdir()  # exists but empty: what a consumer started before its producers sees
    url = directory.as_uri()
    got: list[object] = []

    def read_one() -> None:
        with bw.Consumer(directory, dp=1, rank=0, timeout_s=60) as consumer:
            try:
                got.append(next(consumer).data["x"].tolist())
            except Exception as exc:  # surfaced by the assertion below
                got.append(exc)

    def warned() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno == logging.WARNING and "nothing committed yet" in r.message]

    with caplog.at_level(logging.WARNING, logger="batchweave.consumer"):
        reader = threading.Thread(target=read_one, daemon=True)
        reader.start()
        _wait_for(lambda: bool(warned()))
        assert warned()[0].getMessage().startswith(f"no BatchWeave namespace at {url}: nothing committed yet")
        with bw.Producer(directory, "prep-0", dp=1) as producer:
            producer.append([{"x": np.arange(3, dtype=np.int32)}], source_offset=0)
        reader.join(60)
    assert not reader.is_alive() and got == [[0, 1, 2]]


@pytest.mark.parametrize("bad", [{"first_s": 0.0}, {"first_s": -1.0}])
def test_a_watch_needs_a_positive_bound(bad):
    with pytest.raises(bw.ConfigError, match="first_s"):
        SilenceWatch(URL, **bad)


def test_a_timeout_on_an_empty_namespace_says_nothing_is_committed_and_what_to_check(tmp_path):
    url = str(tmp_path)
    with bw.Producer(url, "p", dp=1) as producer:
        producer.append([{"x": np.zeros(2, np.int32)}])
    with bw.Consumer(url, dp=1, rank=0, timeout_s=0.3) as consumer:
        next(consumer)
        with pytest.raises(
            bw.StepTimeoutError, match=r"no step 1 within 0.3s \(log seen up to version \d+\); are producers"
        ):
            next(consumer)
    empty = tmp_path / "empty"
    empty.mkdir()
    with bw.Consumer(str(empty), dp=1, rank=0, timeout_s=0.3) as consumer:
        with pytest.raises(
            bw.StepTimeoutError,
            match=r"no step 0 within 0.3s \(nothing committed yet\); check that this is the producers' URL",
        ):
            next(consumer)
