"""``batchweave watch``: snapshots of a real namespace, the rates between them, the refresh
loop driven by a fake sleep, the line and summary of piped output, and the command line
(in process and as a real subprocess, piped and ended by a signal)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from fractions import Fraction
from pathlib import Path
from typing import IO

import numpy as np
import pytest

import batchweave
from batchweave import keys, log, watch
from batchweave.cli import build_parser, main
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


@pytest.fixture
def terminal(monkeypatch, capsys) -> Callable[[], None]:
    """Call it in the test (capsys's stdout is in place only then) to make that stdout
    pass for a terminal, to rich as well: ``watch`` shows the tables, not lines."""

    def as_terminal() -> None:
        monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
        monkeypatch.setenv("TTY_COMPATIBLE", "1")

    return as_terminal


def test_once_table_shows_every_section(namespace, terminal, capsys):
    terminal()
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
        monkeypatch.setattr(
            watch, "follow", lambda read, interval_s, **options: real_follow(read, interval_s, sleep=sleep, **options)
        )
        return slept

    return install


def test_json_lines_follow_new_commits_and_ctrl_c_exits_0(namespace, fake_sleep, capsys):
    slept = fake_sleep(after=2, on_sleep=lambda: _produce(namespace, "p1", 0))  # a restart: a new epoch
    assert main(["watch", namespace, "--json", "--interval", "7"]) == 0
    out, err = capsys.readouterr()
    first, second, summary = (json.loads(line) for line in out.splitlines())
    assert slept == [7.0, 7.0]
    assert (summary["stopped_by"], summary["refreshes"], summary["last"]) == (
        "SIGINT",
        2,
        {"version": second["head"]["version"], "steps": 5},
    )
    assert second["head"]["version"] == first["head"]["version"] + 1
    assert second["producers"]["p1"]["epoch"] == first["producers"]["p1"]["epoch"] + 1
    assert second["interval_s"] > 0 and second["steps_per_s"] == 0.0
    assert second["producers"]["p0"]["offsets_per_s"] == 0.0
    assert err == ""


def test_live_view_exits_0_on_ctrl_c_with_a_summary(namespace, fake_sleep, terminal, capsys):
    terminal()
    slept = fake_sleep(after=2)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main(["watch", namespace]) == 0
    out, err = capsys.readouterr()
    assert len(slept) == 2 and "ck-a" in out and "log head" in out
    assert "stopped=SIGINT refreshes=2 " in out.splitlines()[-1]  # one line, even past the width
    assert "Traceback" not in err and "interrupted" not in err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # put back


def test_piped_output_is_a_line_per_refresh_and_count_bounds_them(namespace, fake_sleep, capsys):
    slept = fake_sleep(after=99)
    assert main(["watch", namespace, "--count", "3", "--interval", "5"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert slept == [5.0, 5.0]  # none after the last refresh
    assert len(lines) == 3 and all(" version=" in line and " steps=5 " in line for line in lines), lines
    assert "stopped=" not in out and err == ""  # no signal, no summary


def test_piped_output_is_lines_even_where_rich_is_told_it_is_a_terminal(namespace, monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")  # CI logs often set it; a pipe still gets lines
    assert main(["watch", namespace, "--once"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert " steps=5 " in line and "\x1b" not in line


def test_once_and_count_together_are_a_usage_error(namespace, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["watch", namespace, "--once", "--count", "2"])
    assert exit_info.value.code == 2
    assert "--count" in capsys.readouterr().err


def test_a_signal_ignored_at_the_start_stays_ignored(namespace, fake_sleep, capsys):
    """``nohup`` and background jobs start with a signal ignored: a watch must not take it back."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen: list[object] = []
        fake_sleep(after=2, on_sleep=lambda: seen.append(signal.getsignal(signal.SIGINT)))
        assert main(["watch", namespace, "--json"]) == 0
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_ends_a_real_watch_process_with_exit_0_and_a_summary(namespace):
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
    summary = json.loads(out)  # one more line: the summary, and no traceback
    assert (summary["stopped_by"], summary["refreshes"], summary["last"]["steps"]) == ("SIGINT", 1, 5)
    assert "Traceback" not in err


class _Lines:
    """A child's stdout, read line by line by a thread, so that a test waits for a line
    with a deadline (a plain readline would hang a test of a watch that prints nothing)."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # end of output

    def until(self, wanted: Callable[[str], bool], timeout_s: float = 60) -> list[str]:
        """The lines up to and with the first that ``wanted`` accepts."""
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line wanted within {timeout_s} s; lines so far: {seen}")
            if line is None:
                pytest.fail(f"the output ended before a line wanted; lines: {seen}")
            seen.append(line)
            if wanted(line):
                return seen

    def rest(self, timeout_s: float = 60) -> list[str]:
        """The lines until the output ends."""
        rest: list[str] = []
        deadline = time.monotonic() + timeout_s
        while (line := self._lines.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
            rest.append(line)
        return rest


def _words(line: str) -> dict[str, str]:
    """A piped watch line's ``key=value`` words, after its timestamp."""
    return dict(word.split("=", 1) for word in line.split()[1:])


def _steps(line: str, json_lines: bool) -> int:
    return json.loads(line)["head"]["steps"] if json_lines else int(_words(line)["steps"])


@pytest.mark.parametrize("json_lines", [False, True], ids=["lines", "json"])
def test_a_piped_watch_follows_a_committing_producer_and_sigterm_ends_it_cleanly(namespace, tmp_path, json_lines):
    """Piped, a refresh is a line written at once, and SIGTERM (what a scheduler sends at
    the end of a job) ends the watch with a summary line, exit code 0 and nothing on stderr."""
    sig = signal.SIGTERM
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "batchweave.cli", "watch", namespace, "--interval", "0.2"]
            + (["--json"] if json_lines else []),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a shell
        )
    try:
        assert process.stdout is not None
        lines = _Lines(process.stdout)
        frames = lines.until(lambda _line: True)
        assert _steps(frames[0], json_lines) == 5
        with batchweave.Producer(namespace, "p0", dp=2) as producer:  # commits while the watch runs
            for i in range(3):
                producer.append(_slices(i))
                producer.flush()
            frames += lines.until(lambda line: _steps(line, json_lines) == 8)
            os.kill(process.pid, sig)
            assert process.wait(timeout=60) == 0
        rest = lines.rest()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    frames += rest[:-1]  # refreshes printed before the signal landed
    steps = [_steps(line, json_lines) for line in frames]
    assert steps == sorted(steps) and (steps[0], steps[-1]) == (5, 8), steps
    if json_lines:
        summary = json.loads(rest[-1])
        assert (summary["stopped_by"], summary["refreshes"]) == (sig.name, len(frames))
        assert (summary["first"]["steps"], summary["last"]["steps"]) == (5, 8)
        assert summary["last"]["version"] == json.loads(frames[-1])["head"]["version"]
        assert summary["steps_per_s"] == pytest.approx(3 / summary["watched_s"])
    else:
        words = _words(rest[-1])
        assert (words["stopped"], words["refreshes"], words["steps"]) == (sig.name, str(len(frames)), "5..8")
        assert all(_words(line).keys() >= {"version", "steps", "steps/s", "lag"} for line in frames)
    assert stderr_path.read_text() == ""  # no traceback, no "interrupted"


def test_a_signal_while_a_frame_prints_waits_for_it_and_a_second_one_does_not():
    signals = watch.StopSignals()
    finished: list[bool] = []
    with pytest.raises(watch.Stopped) as stopped, signals.whole():
        signals.handle(signal.SIGTERM, None)  # the frame goes on: printed and counted whole
        finished.append(True)
    assert finished == [True] and stopped.value.signal_name == "SIGTERM"
    again = watch.StopSignals()
    with pytest.raises(watch.Stopped), again.whole():
        again.handle(signal.SIGTERM, None)
        again.handle(signal.SIGINT, None)  # a stdout that blocks must not hold a second one
        pytest.fail("the second signal did not stop the watch at once")
    with pytest.raises(watch.Stopped):
        watch.StopSignals().handle(signal.SIGINT, None)  # outside a frame: at once


def test_the_cli_reference_has_every_option_of_watch():
    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command")
    options = {flag for action in commands.choices["watch"]._actions for flag in action.option_strings} - {
        "-h",
        "--help",
    }
    page = (Path(__file__).parents[1] / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    section = page.split("## `batchweave watch`")[1].split("\n## ")[0]
    assert options == {"--interval", "--count", "--once", "--json"}
    assert all(f"`{option}" in section for option in options), section
    assert "exit code is 0" in section  # the choice the tests above hold it to


def test_the_cli_reference_has_a_section_for_every_command():
    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command")
    page = (Path(__file__).parents[1] / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    missing = [name for name in commands.choices if f"## `batchweave {name}`" not in page]
    assert not missing, f"docs/reference/cli.md has no section for: {missing}"


# -- the piped line and the summary, pure ---------------------------------------------------


def test_a_frame_line_holds_the_terminal_view_in_key_value_words():
    snapshot = dataclasses.replace(
        _snapshot(2.0, 40, {"a": 30, "b": 12, "c": 7}),
        end_of_stream=True,
        head_committed_at=1_000_001.5,
        overall_steps_per_s=3.25,
        reclaimed_steps=10,
        collectable_below_step=20,
        checkpoints=(
            CheckpointInfo("old", True, Fraction(20), 21, Fraction(20)),
            CheckpointInfo("new", True, Fraction(30), 31, Fraction(10)),
            CheckpointInfo("torn", False, Fraction(15, 2), 9, Fraction(65, 2)),
        ),
    )
    rate = Rates(interval_s=2.0, steps_per_s=1.5, offsets_per_s={"a": 2.0, "b": 0.0, "c": None})
    line = watch.frame_line(snapshot, rate)
    assert line == (
        "1970-01-12T13:46:42.000Z version=40 steps=40 eos=yes last_commit=0.5s steps/s=1.50 overall=3.25 "
        "producers=3 idle=1 offsets/s=2.00 checkpoints=3 incomplete=1 lag=20 gc_reclaimed=10 gc_may_reclaim=20"
    )
    assert datetime.fromisoformat(line.split()[0]).timestamp() == snapshot.observed_at  # UTC, parseable
    first = watch.frame_line(_snapshot(0.0, 0, {}), Rates())
    assert first == (
        "1970-01-12T13:46:40.000Z version=0 steps=0 eos=no last_commit=- steps/s=- overall=- "
        "producers=0 idle=- offsets/s=- checkpoints=0 incomplete=0 lag=- gc_reclaimed=0 gc_may_reclaim=-"
    )


def test_the_summary_counts_the_frames_and_the_steps_between_the_first_and_the_last():
    tally = watch.Tally()
    assert watch.summary_line(tally.summary("SIGTERM", 1_000_000.0)) == (
        "1970-01-12T13:46:40.000Z stopped=SIGTERM refreshes=0 watched=- version=-..- steps=-..- steps/s=-"
    )
    for taken_at, steps in ((1.0, 5), (3.0, 6), (5.0, 13)):
        tally.add(_snapshot(taken_at, steps, {}))
    summary = tally.summary("SIGINT", 1_000_006.0)
    assert summary == {
        "stopped_by": "SIGINT",
        "observed_at": 1_000_006.0,
        "refreshes": 3,
        "watched_s": 4.0,
        "first": {"version": 5, "steps": 5},
        "last": {"version": 13, "steps": 13},
        "steps_per_s": 2.0,
    }
    assert watch.summary_line(summary) == (
        "1970-01-12T13:46:46.000Z stopped=SIGINT refreshes=3 watched=4.0s version=5..13 steps=5..13 steps/s=2.00"
    )


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
