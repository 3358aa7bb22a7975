"""Garbage collection as a service: ``batchweave gc URL --every S`` and ``batchweave.Collector``.

The command runs as a real process; its runs are waited for by their JSON or log lines,
never by sleeping. Two services on one SeaweedFS namespace, beside producer processes
and ranks that mark and release checkpoints, delete nothing a live checkpoint reaches.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from checks import assert_referenced_objects_exist
from test_lifecycle import produce, resume, train
from worker import digest

import batchweave as bw
from batchweave.lifecycle.collector import CollectionRun, Collector, check_period_s
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX
from batchweave.store import Store
from batchweave.testing import Background, LatencyProxy, PausingStore

WORKER = str(Path(__file__).with_name("worker.py"))
# The keys every JSON line adds to what a one-shot `gc --json` prints.
RUN_KEYS = {"run", "started_at", "duration_s", "error"}


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "batchweave"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "batchweave.cli"]


class _Lines:
    """The lines a pipe delivers, read by a thread as they come, to wait for one."""

    def __init__(self, pipe) -> None:
        self.lines: list[str] = []
        self.ended = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._reader.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, matches, timeout_s: float = 60.0) -> str:
        """The first line (of all read so far or to come) that ``matches``; fails at the timeout."""
        deadline, checked = time.monotonic() + timeout_s, 0
        with self._changed:
            while True:
                for line in self.lines[checked:]:
                    if matches(line):
                        return line
                checked = len(self.lines)
                remaining = deadline - time.monotonic()
                if self.ended or remaining <= 0:
                    raise AssertionError(f"no matching line (ended: {self.ended}); got {self.lines[-20:]}")
                self._changed.wait(remaining)

    def all(self, timeout_s: float = 60.0) -> list[str]:
        """Every line, once the pipe has closed (the process exited)."""
        self._reader.join(timeout_s)
        assert self.ended, "the pipe is still open"
        return list(self.lines)


class _Service:
    """``batchweave gc URL --every S ...`` as a process, its stdout and stderr read as they come."""

    def __init__(self, url: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*_cli(), "gc", url, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out, self.err = _Lines(self.proc.stdout), _Lines(self.proc.stderr)

    def runs(self) -> list[dict]:
        """Every JSON line it printed (once it exited)."""
        return [json.loads(line) for line in self.out.all()]

    def run_where(self, condition, timeout_s: float = 60.0) -> dict:
        return json.loads(self.out.wait_for(lambda line: condition(json.loads(line)), timeout_s))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        self.proc.send_signal(sig)  # only to the process this test started, by its PID
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def service():
    started: list[_Service] = []

    def start(url: str, *args: str) -> _Service:
        started.append(_Service(url, *args))
        return started[-1]

    yield start
    for svc in started:  # a test that failed half-way leaves nothing running
        svc.kill()


@pytest.fixture
def collected(tmp_path):
    """A local namespace of 6 TGBs, a live checkpoint at step 4: a collection deletes 4 objects."""
    url = str(tmp_path / "ns")
    produce(url, "p", 6)
    train(url, 2, 4, checkpoint_every=4)
    return url


# -- the flag -----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_every_refuses_a_period_that_is_not_positive_seconds(collected, value):
    done = subprocess.run([*_cli(), "gc", collected, "--every", value], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"error: gc --every={float(value)!r}: "), done.stderr
    assert "number of seconds above 0" in done.stderr and "Traceback" not in done.stderr


def test_every_refuses_a_word_as_argparse_does():
    done = subprocess.run([*_cli(), "gc", "ns", "--every", "soon"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "argument --every: invalid float value: 'soon'" in done.stderr


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "60"])
def test_collector_refuses_a_bad_period_with_a_config_error(collected, value):
    with pytest.raises(bw.ConfigError, match=r"every_s=.*: the time between collections must be"):
        Collector(collected, value)


def test_check_period_s_takes_positive_seconds():
    assert check_period_s(60, "x") == 60.0 and check_period_s(0.25, "x") == 0.25


# -- runs, JSON lines and stopping --------------------------------------------------


def test_every_json_prints_the_gc_summary_with_time_and_duration_per_run(collected, service):
    one_shot = json.loads(
        subprocess.run([*_cli(), "gc", collected, "--dry-run", "--json"], capture_output=True, text=True).stdout
    )
    before = time.time()
    svc = service(collected, "--every", "0.1", "--grace-s", "0", "--json")
    first = svc.run_where(lambda run: run["run"] == 1)
    second = svc.run_where(lambda run: run["run"] == 2)
    assert svc.stop() == 0
    assert first.keys() == one_shot.keys() | RUN_KEYS
    assert first["error"] is None and first["w_global_step"] == 4 and first["reclaimed_steps"] == 4
    assert first["deleted_object_count"] == 4 and first["deleted_bytes"] > 0
    assert before - 1 <= first["started_at"] <= second["started_at"] <= time.time()
    assert 0 <= first["duration_s"] < 60
    assert second["error"] is None and second["deleted_object_count"] == 0  # nothing new to delete
    assert second["started_at"] - first["started_at"] >= 0.09  # runs start --every seconds apart
    took = f"{first['duration_s']:.2f}"  # the log line says what the JSON line says
    expected = f" INFO collection 1 took {took} s: W_global step 4, reclaimed below step 4 ("
    assert any(expected in line for line in svc.err.all())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_service_at_once_and_it_exits_0(collected, service, sig):
    svc = service(collected, "--every", "3600", "--grace-s", "0")  # waits an hour after run 1
    svc.err.wait_for(lambda line: "collection 1 took" in line)
    assert svc.stop(sig, timeout_s=30) == 0
    svc.err.wait_for(lambda line: f"{sig.name}: stopping (after the collection in progress, if any" in line)
    svc.err.wait_for(lambda line: "stopped after 1 collections" in line)
    assert not any("Traceback" in line for line in svc.err.all())
    assert svc.out.all() == []  # no --json: nothing on stdout


def test_a_missing_bucket_is_permanent_the_service_exits_2_naming_it(service, moto_server, monkeypatch):
    from conftest import _point_s3_at

    _point_s3_at(monkeypatch, moto_server)
    svc = service("s3://no-such-bucket-gcevery/ns", "--every", "1", "--json")
    assert svc.proc.wait(60) == 2
    svc.err.wait_for(lambda line: line.startswith("error: ") and "'no-such-bucket-gcevery'" in line)
    assert "does not exist" in svc.err.all()[-1] and svc.out.all() == []


def test_no_namespace_at_the_url_is_permanent_too(tmp_path, service):
    svc = service(str(tmp_path / "missing"), "--every", "1")
    assert svc.proc.wait(60) == 2
    svc.err.wait_for(lambda line: line.startswith("error: no namespace at"))


def test_stop_during_a_collection_lets_it_finish_and_starts_no_other(collected):
    store = PausingStore(collected, create=False)
    gate = store.pause("list", "data/")
    runs: list[CollectionRun] = []
    collector = Collector(store, every_s=0.01, grace_s=0, on_run=runs.append)
    background = Background(collector.run_forever)
    gate.wait_reached()  # the first collection is under way
    collector.stop()
    gate.release()
    background.result()
    assert collector.runs == 1 and len(runs) == 1
    assert runs[0].ok and runs[0].report is not None and len(runs[0].report.deleted_objects) == 4


class _CountingStore(Store):
    """Counts the GETs of checkpoint watermarks."""

    mark_gets = 0

    def get(self, key: str) -> memoryview:
        if key.startswith(CHECKPOINT_PREFIX):
            self.mark_gets += 1
        return super().get(key)


def test_a_service_reads_each_watermark_once_a_one_shot_collection_every_time(tmp_path):
    url = str(tmp_path / "ns")
    produce(url, "p", 6)
    store = _CountingStore(url, create=False)
    collector = Collector(store, every_s=60, grace_s=0)
    ranks = [bw.Consumer(url, dp=2, rank=r, timeout_s=20) for r in range(2)]

    def read_and_mark(steps: int, name: str) -> None:
        for consumer in ranks:
            for _ in range(steps):
                next(consumer)
            consumer.mark_checkpoint(name)

    read_and_mark(2, "a")
    assert collector.run_once().ok and store.mark_gets == 2  # the two positions' marks
    assert collector.run_once().ok and store.mark_gets == 2  # create-only: not read again
    read_and_mark(2, "b")
    assert collector.run_once().ok and store.mark_gets == 4  # only the new checkpoint's
    bw.collect_garbage(store, grace_s=0)
    assert store.mark_gets == 8  # a one-shot collection reads them all
    for consumer in ranks:
        consumer.close()


@pytest.mark.s3
def test_a_transient_store_error_is_logged_and_the_next_run_succeeds(request, tmp_path, monkeypatch, caplog):
    """A throttling storm longer than the retry deadline fails a run; the service logs it,
    keeps going, and collects once the store answers again."""
    from conftest import _make_backend_url, _point_s3_at

    url = _make_backend_url("s3", request, tmp_path, monkeypatch)
    produce(url, "p", 6)
    train(url, 2, 4, checkpoint_every=4)
    with LatencyProxy(request.getfixturevalue("moto_server")) as proxy:
        _point_s3_at(monkeypatch, proxy.endpoint)
        runs: queue.Queue[CollectionRun] = queue.Queue()
        collector = Collector(url, 0.05, grace_s=0, on_run=runs.put, storage_options={"retry_deadline_s": 0.5})
        proxy.storm(120)
        with caplog.at_level(logging.INFO, logger="batchweave.lifecycle.collector"):
            background = Background(collector.run_forever)
            failed = runs.get(timeout=60)
            proxy.storm(0)  # the store answers again
            done = runs.get(timeout=60)
            while not done.ok:  # runs that began inside the storm
                done = runs.get(timeout=60)
            collector.stop()
            background.result()
    assert not failed.ok and failed.report is None and "SlowDown" in (failed.error or "")
    assert done.report is not None and len(done.report.deleted_objects) == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "failed" in r.getMessage()]
    assert warnings and warnings[0].startswith(f"collection {failed.number} failed after ")


@pytest.mark.s3
def test_sigterm_during_a_store_outage_abandons_the_run_at_once_and_exits_0(request, tmp_path, monkeypatch, service):
    """The store throttles every request; the service's run is retrying (for up to 10
    minutes); SIGTERM ends those retries and the service at once."""
    from conftest import _make_backend_url, _point_s3_at

    url = _make_backend_url("s3", request, tmp_path, monkeypatch)
    produce(url, "p", 6)
    with LatencyProxy(request.getfixturevalue("moto_server")) as proxy:
        _point_s3_at(monkeypatch, proxy.endpoint)
        proxy.storm(600)
        svc = service(url, "--every", "60", "--json")
        svc.err.wait_for(lambda line: "store throttled or unavailable: retrying" in line)
        assert svc.stop(timeout_s=30) == 0
    run = svc.run_where(lambda run: run["run"] == 1)
    assert run["error"].startswith("abandoned: stopped while the store was failing")
    assert run.keys() == RUN_KEYS and len(svc.runs()) == 1
    svc.err.wait_for(lambda line: "stopped after 1 collections" in line)


# -- two services, producers and a training job, on SeaweedFS -----------------------


@pytest.mark.slow
@pytest.mark.seaweedfs
def test_two_services_beside_producers_and_checkpoints_keep_what_live_checkpoints_reach(
    request, tmp_path, monkeypatch, service
):
    from conftest import _make_backend_url

    url = _make_backend_url("seaweedfs", request, tmp_path, monkeypatch)
    per_producer, every, keep = 30, 5, 2
    producers = [
        subprocess.Popen(
            [sys.executable, WORKER, "produce", url, pid, str(per_producer), "--pace", "0.02"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in ("a", "b")
    ]
    steps, services = 2 * per_producer, []
    seen: dict[int, dict[int, str]] = {0: {}, 1: {}}
    saved: dict[str, list[dict]] = {}
    try:
        ranks = [bw.Consumer(url, dp=2, rank=r, timeout_s=60) for r in range(2)]
        for step in range(steps):
            for rank, consumer in enumerate(ranks):
                batch = next(consumer)
                seen[rank][batch.step] = digest(batch.data)
            if not services:  # something is committed: a service refuses a URL where nothing is
                services = [service(url, "--every", "0.2", "--grace-s", "0", "--json") for _ in range(2)]
            if (step + 1) % every == 0:
                name = f"step-{step + 1:04d}"
                saved[name] = [c.state_dict() for c in ranks]
                for consumer in ranks:
                    consumer.mark_checkpoint(name)
                for old in sorted(saved)[:-keep]:  # training deletes its older checkpoints
                    # again at every save: one a service collected since is forgotten (missing_ok)
                    bw.release_checkpoint(url, old, missing_ok=True)
        for consumer in ranks:
            consumer.close()
        for proc in producers:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, (out, err)
    finally:
        for proc in producers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    live = sorted(saved)[-keep:]
    w_global = steps - (keep - 1) * every
    for svc in services:  # each has seen the reclaim reach the oldest live checkpoint
        svc.run_where(lambda run: run["error"] is None and run["reclaimed_steps"] >= w_global, timeout_s=120)
    assert [svc.stop() for svc in services] == [0, 0]
    assert max(run["reclaimed_steps"] for svc in services for run in svc.runs() if run["error"] is None) == w_global
    for svc in services:
        assert not any("Traceback" in line for line in svc.err.all()), svc.err.all()
    runs = [run for svc in services for run in svc.runs()]
    assert sum(run["deleted_object_count"] for run in runs if run["error"] is None) > 0
    assert all(len([r for r in svc.runs() if r["error"] is None]) >= 2 for svc in services)
    assert_referenced_objects_exist(url)
    for name in live:
        start = saved[name][0]["step"]
        for rank in range(2):
            replay = resume(url, saved[name][rank], rank, steps - start)
            assert replay == {s: seen[rank][s] for s in range(start, steps)}, (name, rank)
    with pytest.raises(bw.DataReclaimedError):
        resume(url, saved[sorted(saved)[0]][0], 0, 1)  # released: its steps are gone
