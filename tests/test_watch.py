"""``batchweave watch``: snapshots of a real namespace, the rates between them, the refresh
loop driven by a fake sleep, and the command line (in process and as a real subprocess)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from fractions import Fraction

import numpy as np
import pytest

import batchweave
from batchweave import keys, log, watch
from batchweave.cli import main
from batchweave.inspect import CheckpointInfo
from batchweave.watch import Rates, Snapshot, SnapshotReader, follow, overall_steps_per_s, rates


def _slices(value: int) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(8, value * 10 + d, dtype=np.int32)} for d in range(2)]


def _produce(url: str, producer_id: str, count: int, **options: object) -> None:
    """``count`` TGBs from ``producer_id`` (dp=2), one log version each."""
    with batchweave.Producer(url, producer_id, dp=2, **options) as producer:
        for i in range(count):
            producer.append(_slices(i))
            producer.flush()


def _consumers(url: str) -> list[batchweave.Consumer]:
    return [batchweave.Consumer(url, dp=2, rank=r, timeout_s=20) for r in range(2)]


@pytest.fixture
def namespace(tmp_path) -> str:
    """5 steps (p0: 3, p1: 2, dp=2); checkpoint ck-a complete at position 2, ck-b marked by
    rank 0 only at 3, ck-old complete at 1 and then released."""
    url = str(tmp_path / "ns")
    _produce(url, "p0", 3)
    _produce(url, "p1", 2)
    consumers = _consumers(url)
    for name in ("ck-old", "ck-a"):
        for c in consumers:
            next(c)
            c.mark_checkpoint(name)
    next(consumers[0])
    consumers[0].mark_checkpoint("ck-b")
    for c in consumers:
        c.close()
    batchweave.release_checkpoint(url, "ck-old")
    return url


# -- the snapshot of a real namespace -------------------------------------------------------


def test_once_json_reports_head_producers_checkpoints_lag_and_gc(namespace, capsys):
    assert main(["watch", namespace, "--once", "--json"]) == 0
    frame = json.loads(capsys.readouterr().out)  # exactly one JSON object
    info = batchweave.inspect_namespace(namespace)
    assert frame["head"]["version"] == info.latest_version >= 4
    assert frame["head"]["steps"] == 5
    assert frame["head"]["end_of_stream"] is False
    assert frame["head"]["committed_at"] > 0
    assert frame["layout"] == {"dp": 2, "cp": 1, "kind": "arrays"}
    assert frame["producers"] == {
        "p0": {"offset": 3, "epoch": 1, "offsets_per_s": None},
        "p1": {"offset": 2, "epoch": 1, "offsets_per_s": None},
    }
    # ck-old is released: gone from the view; ck-b is listed but protects nothing
    assert frame["checkpoints"] == [
        {"id": "ck-a", "complete": True, "position": 2, "version": frame["checkpoints"][0]["version"], "lag_steps": 3},
        {"id": "ck-b", "complete": False, "position": 3, "version": frame["checkpoints"][1]["version"], "lag_steps": 2},
    ]
    assert 1 <= frame["checkpoints"][0]["version"] <= frame["checkpoints"][1]["version"] <= info.latest_version
    assert frame["gc"] == {
        "reclaimed_steps": 0,
        "reclaimed_versions": 0,
        "reclaimed_bytes": 0,
        "collectable_below_step": 2,
    }
    assert frame["steps_per_s"] is None and frame["interval_s"] is None  # one frame: no change to measure
    assert frame["overall_steps_per_s"] > 0  # from the committed_at of version 1 and of the head


def test_once_table_shows_every_section(namespace, capsys):
    assert main(["watch", namespace, "--once"]) == 0
    out = capsys.readouterr().out
    for text in ("log head", "version", "5 steps", "steps/s", "p0", "p1", "ck-a", "ck-b", "protects nothing"):
        assert text in out
    assert "ck-old" not in out
    assert "below step 2" in out  # what gc may reclaim: up to the oldest complete checkpoint


def test_rates_between_two_reads_of_a_growing_namespace(namespace):
    clock = iter([100.0, 104.0]).__next__
    reader = SnapshotReader(namespace, clock=clock, wall_clock=lambda: 0.0)
    before = reader()
    _produce(namespace, "p0", 0)  # a restart: claims epoch 2, commits nothing
    with batchweave.Producer(namespace, "p0", dp=2) as producer:
        for i in range(4):
            producer.append(_slices(i), source_offset=3 + i)
        producer.flush()
    after = reader()  # catches up from ``before``'s version
    assert (after.steps, after.producers["p0"]) == (9, {"offset": 7, "epoch": 3})
    assert rates(before, after) == Rates(interval_s=4.0, steps_per_s=1.0, offsets_per_s={"p0": 1.0, "p1": 0.0})
    assert after == _fresh_snapshot(namespace, after)


def _fresh_snapshot(url: str, like: Snapshot) -> Snapshot:
    """What a new reader sees, with ``like``'s clock readings."""
    return SnapshotReader(url, clock=lambda: like.taken_at, wall_clock=lambda: like.observed_at)()


def test_a_reader_follows_the_log_across_garbage_collection(tmp_path):
    """Collection deletes the log versions a long-running reader would catch up through:
    it must notice the newer snapshot and reload, not stop at the gap."""
    url = str(tmp_path / "ns")
    _produce(url, "p", 2, snapshot_every=4)
    reader = SnapshotReader(url)
    first = reader()
    with batchweave.Producer(url, "p", dp=2, snapshot_every=4) as producer:
        for i in range(10):
            producer.append(_slices(i))
            producer.flush()
    consumers = _consumers(url)
    for _ in range(11):
        for c in consumers:
            next(c)
    for c in consumers:
        c.mark_checkpoint("late")
        c.close()
    report = batchweave.collect_garbage(url, grace_s=0)
    assert report.deleted_versions > 0 and report.reclaimed_steps == 11
    assert not (tmp_path / "ns" / keys.version_key(first.version + 1)).exists()  # the reader's next version
    after = reader()
    assert (after.steps, after.reclaimed_steps, after.collectable_below_step) == (12, 11, 11)
    assert after.checkpoints == (CheckpointInfo("late", True, Fraction(11), after.checkpoints[0].version, Fraction(1)),)
    assert after == _fresh_snapshot(url, after)


def test_a_missing_namespace_fails_fast_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "no-such-namespace"
    with pytest.raises(batchweave.ConfigError, match="does not exist"):
        SnapshotReader(str(missing))()
    for mode in (["--once"], ["--once", "--json"], ["--json"], []):
        assert main(["watch", str(missing), *mode]) == 2, mode
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "directory does not exist" in err, err
    assert not missing.exists()


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "soon"])
def test_a_bad_interval_is_a_usage_error(namespace, interval, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["watch", namespace, "--interval", interval])
    assert exit_info.value.code == 2
    assert "--interval" in capsys.readouterr().err


# -- the refresh loop and Ctrl-C ------------------------------------------------------------


def _interrupting_sleep(after: int, on_sleep: Callable[[], None] = lambda: None) -> tuple[list[float], Callable]:
    """A sleep that records its argument, runs ``on_sleep``, and is Ctrl-C on call ``after``."""
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == after:
            raise KeyboardInterrupt
        on_sleep()

    return slept, sleep


def _snapshot(taken_at: float, steps: int, offsets: dict[str, int]) -> Snapshot:
    return Snapshot(
        url="memory://hand-made",
        taken_at=taken_at,
        observed_at=1_000_000.0 + taken_at,
        version=steps,
        steps=steps,
        end_of_stream=False,
        layout=None,
        producers={pid: {"offset": offset, "epoch": 1} for pid, offset in offsets.items()},
        checkpoints=(),
    )


def test_follow_reads_once_per_interval_until_ctrl_c():
    snapshots: Iterator[Snapshot] = iter(
        [_snapshot(0.0, 0, {"a": 0}), _snapshot(0.5, 4, {"a": 3}), _snapshot(1.5, 5, {"a": 3, "b": 1})]
    )
    slept, sleep = _interrupting_sleep(after=3)
    frames = []
    with pytest.raises(KeyboardInterrupt):
        for frame in follow(snapshots.__next__, 0.5, sleep=sleep):
            frames.append(frame)
    assert slept == [0.5, 0.5, 0.5]  # one sleep after each frame, never before the first
    assert [rate for _, rate in frames] == [
        Rates(offsets_per_s={"a": None}),
        Rates(interval_s=0.5, steps_per_s=8.0, offsets_per_s={"a": 6.0}),
        Rates(interval_s=1.0, steps_per_s=1.0, offsets_per_s={"a": 0.0, "b": None}),
    ]


@pytest.fixture
def fake_sleep(monkeypatch) -> Callable[..., list[float]]:
    """Make the CLI's refresh loop use ``_interrupting_sleep(after, on_sleep)``."""

    def install(after: int, on_sleep: Callable[[], None] = lambda: None) -> list[float]:
        slept, sleep = _interrupting_sleep(after, on_sleep)
        real_follow = watch.follow
        monkeypatch.setattr(watch, "follow", lambda read, interval_s: real_follow(read, interval_s, sleep=sleep))
        return slept

    return install


def test_json_lines_follow_new_commits_and_ctrl_c_exits_0(namespace, fake_sleep, capsys):
    slept = fake_sleep(after=2, on_sleep=lambda: _produce(namespace, "p1", 0))  # a restart: a new epoch
    assert main(["watch", namespace, "--json", "--interval", "7"]) == 0
    out, err = capsys.readouterr()
    first, second = (json.loads(line) for line in out.splitlines())
    assert slept == [7.0, 7.0]
    assert second["head"]["version"] == first["head"]["version"] + 1
    assert second["producers"]["p1"]["epoch"] == first["producers"]["p1"]["epoch"] + 1
    assert second["interval_s"] > 0 and second["steps_per_s"] == 0.0
    assert second["producers"]["p0"]["offsets_per_s"] == 0.0
    assert err == ""


def test_live_view_exits_0_on_ctrl_c(namespace, fake_sleep, capsys):
    slept = fake_sleep(after=2)
    assert main(["watch", namespace]) == 0
    out, err = capsys.readouterr()
    assert len(slept) == 2 and "ck-a" in out and "log head" in out
    assert "Traceback" not in err and "interrupted" not in err


def test_ctrl_c_ends_a_real_watch_process_with_exit_0(namespace):
    process = subprocess.Popen(
        [sys.executable, "-m", "batchweave.cli", "watch", namespace, "--json", "--interval", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Python turns SIGINT into KeyboardInterrupt only if it was not ignored when it started.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert process.stdout is not None
        first = json.loads(process.stdout.readline())  # the first frame: now it sleeps 600 s
        assert first["head"]["steps"] == 5
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert out == "" and "Traceback" not in err


# -- pure rates -----------------------------------------------------------------------------


def test_rates_of_the_first_frame_are_unknown():
    assert rates(None, _snapshot(3.0, 7, {"a": 1})) == Rates(offsets_per_s={"a": None})


def test_rates_are_the_change_per_second():
    before = _snapshot(10.0, 10, {"p0": 4, "p1": 6})
    after = _snapshot(12.0, 16, {"p0": 10, "p1": 6, "p2": 5})
    assert rates(before, after) == Rates(
        interval_s=2.0, steps_per_s=3.0, offsets_per_s={"p0": 3.0, "p1": 0.0, "p2": None}
    )


@pytest.mark.parametrize("later", [0.0, -1.0])
def test_rates_need_time_to_pass(later):
    before = _snapshot(5.0, 1, {"a": 1})
    after = _snapshot(5.0 + later, 3, {"a": 2})
    assert rates(before, after) == Rates(offsets_per_s={"a": None})


def _version(version: int, first_step: int, tgbs: int, committed_at: float) -> log.LogVersionHead:
    heads = [log.TGBHead("p", 1, first_step + i, 2, 1, "arrays", 100) for i in range(tgbs)]
    return log.LogVersionHead(log.LOG_FORMAT, version, first_step, heads, {}, committed_at=committed_at)


def test_overall_rate_counts_the_steps_committed_after_the_first_version():
    claim = _version(1, 0, 0, committed_at=100.0)
    assert overall_steps_per_s(claim, _version(9, 40, 10, committed_at=110.0), steps=50) == 5.0
    kept = _version(5, 10, 2, committed_at=100.0)  # after collection: its own 2 steps came before
    assert overall_steps_per_s(kept, _version(7, 18, 2, committed_at=104.0), steps=20) == 2.0


@pytest.mark.parametrize(
    ("first", "head"),
    [
        (None, _version(3, 0, 1, 10.0)),
        (_version(1, 0, 0, 10.0), None),
        (_version(1, 0, 0, 0.0), _version(3, 0, 1, 10.0)),  # written before committed_at existed
        (_version(1, 0, 0, 10.0), _version(1, 0, 0, 10.0)),  # one version only
        (_version(1, 0, 0, 10.0), _version(3, 0, 1, 9.0)),  # committers' clocks disagree
    ],
)
def test_overall_rate_is_unknown_without_two_timestamps(first, head):
    assert overall_steps_per_s(first, head, steps=1) is None
