"""The producer benchmarks' counting (benchmarks/ingest.py): the steady counts leave out
each producer's warm-up and are never negative, and a window without attempts reports
no success rate.

The harness counts with two clocks: its sampler closes the window, and each producer's
thread notes when its own warm-up (its first commit attempt) is over. The regression
test holds a producer inside that first attempt (a store gate) while the window closes,
so its warm-up ends after the close; before the fix that gave -1 steady successes and
reported "100% success" for zero attempts.
"""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from batchweave import log
from batchweave.journal import Journal
from batchweave.producer import Producer
from batchweave.store import Store
from batchweave.testing import Background, PausingStore
from benchmarks.ingest import (
    IngestSpec,
    _follow_cpu_s,
    _Share,
    _start_producers,
    commit_fields,
    percent,
    steady_counts,
    success_rate,
)

KEYS = ("tgbs_committed", "attempts", "successes", "conflicts")


def counts(tgbs: int = 0, attempts: int = 0, successes: int = 0, conflicts: int = 0) -> dict[str, int]:
    return dict(zip(KEYS, (tgbs, attempts, successes, conflicts), strict=True))


class ClockHeldUntil:
    """The sampler's clock: time moves only when it sleeps, and no sleep ends before
    ``event`` is set, so the window closes only after what the event marks."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.now_s = 0.0

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float, /) -> None:
        assert self.event.wait(30), "the producer never reached its first commit"
        self.now_s += seconds


def test_a_warm_up_that_ends_after_the_window_closed_leaves_no_negative_count(tmp_path):
    store = PausingStore((tmp_path / "ns").as_uri())
    spec = IngestSpec("naive", producers=1, payload_bytes=4_000, duration_s=1.0, tgb_slices=2, sample_s=1.0)
    producers = _start_producers(spec, store, [0])  # the epoch claim: a log version, not held
    gate = store.pause("put_if_absent", r"_log/\d+\.json")  # the first commit attempt's put
    share = _Share(spec, producers, producers, clock=ClockHeldUntil(gate.reached_event))
    # The window closes with the attempt held; it goes on once the window's counters are taken.
    releaser = Background(lambda: share.stop.wait(30) and gate.release())
    try:
        report = share.run()
    finally:
        store.release_all()
        for producer in producers:
            producer.close(flush=False)
    releaser.result()

    assert report["errors"] == []
    assert report["window"]["p000"] == counts(attempts=1)  # counted, not yet committed, at the close
    assert report["warmup"]["p000"] == counts(tgbs=1, attempts=1, successes=1)  # noted after the close
    fields = commit_fields([report])
    assert (fields["window_attempts"], fields["window_commit_success_rate"]) == (1, 0.0)
    assert (fields["steady_attempts"], fields["steady_successes"]) == (0, 0)
    assert fields["steady_commit_success_rate"] is None  # no attempt after the warm-up: no rate
    assert fields["commit_success_rate"] == 1.0  # the attempt itself succeeded, after the close


def test_steady_counts_subtract_each_producers_own_warm_up():
    window = {"a": counts(30, 12, 10, 2), "b": counts(8, 5, 4, 1)}
    warmup = {"a": counts(10, 1, 1, 0), "b": counts(0, 1, 0, 1)}
    assert steady_counts(window, warmup) == counts(28, 15, 13, 2)


def test_a_producer_whose_warm_up_ended_after_the_close_adds_nothing():
    window = {"late": counts(0, 1, 0, 0), "on_time": counts(5, 4, 3, 1)}
    warmup = {"late": counts(1, 1, 1, 0), "on_time": counts(1, 1, 1, 0)}
    assert steady_counts(window, warmup) == counts(4, 3, 2, 1)


def test_a_producer_without_a_warm_up_adds_nothing():
    assert steady_counts({"idle": counts(), "first_only": counts(0, 1, 0, 0)}, {}) == counts()


# A producer's counters over time: each step adds to some of them (they only grow).
histories = st.lists(st.tuples(*[st.integers(0, 3)] * len(KEYS)), min_size=1, max_size=12)


@given(st.lists(histories, min_size=1, max_size=5), st.data())
def test_steady_counts_are_never_negative_nor_above_the_window(producers, data):
    window, warmup = {}, {}
    for index, steps in enumerate(producers):
        snapshots = [counts()]
        for step in steps:
            snapshots.append({k: snapshots[-1][k] + add for k, add in zip(KEYS, step, strict=True)})
        # The window closes at one moment and the warm-up is noted at another, in either order.
        window[f"p{index}"] = snapshots[data.draw(st.integers(0, len(snapshots) - 1))]
        if data.draw(st.booleans()):
            warmup[f"p{index}"] = snapshots[data.draw(st.integers(0, len(snapshots) - 1))]
    steady = steady_counts(window, warmup)
    for key in KEYS:
        assert 0 <= steady[key] <= sum(w[key] for w in window.values())


def test_no_attempts_means_no_success_rate():
    assert success_rate(counts()) is None
    assert success_rate(counts(3, 4, 3, 1)) == 0.75
    assert percent(None) == "no attempts"
    assert percent(0.955) == "95.5%" and percent(0.955, 0) == "96%"


def test_commit_fields_sum_the_workers_reports():
    def report(producer: str, window: dict[str, int], warm: dict[str, int], total: dict[str, int]) -> dict:
        return {"totals": total, "window": {producer: window}, "warmup": {producer: warm}}

    fields = commit_fields(
        [
            report("a", counts(10, 4, 3, 1), counts(1, 1, 1, 0), counts(12, 5, 4, 1)),
            report("b", counts(6, 3, 3, 0), counts(2, 1, 1, 0), counts(7, 4, 4, 0)),
        ]
    )
    assert fields["tgbs_committed"] == 19 and fields["tgbs_in_window"] == 16
    assert (fields["attempts"], fields["window_attempts"], fields["steady_attempts"]) == (9, 7, 5)
    assert fields["commit_success_rate"] == 8 / 9 and fields["window_commit_success_rate"] == 6 / 7
    assert fields["steady_commit_success_rate"] == 4 / 5 and fields["conflicts"] == 1


def test_the_follow_cost_is_a_producers_reading_of_the_heads_only(tmp_path, monkeypatch):
    # A producer reads each version's head (Journal(heads_only=True)); the benchmark's
    # estimate of what following costs it read every version whole, slice tables and
    # all: 3 to 9 times a producer's whole CPU at 128 producers x 100 KB.
    with Producer(str(tmp_path), "p0", dp=2, cp=1, commit_policy="naive") as producer:
        for _ in range(3):
            producer.append([b"x" * 64, b"y" * 64])
    store = Store(str(tmp_path))
    assert Journal(store, heads_only=True, read_only=True).load_state().steps == 3

    def whole_version(*args, **kwargs):
        raise AssertionError("a whole version was decoded: no producer does")

    monkeypatch.setattr(log, "decode_version", whole_version)
    assert _follow_cpu_s(store) >= 0
