"""Real processes on real stores: racing producers, SIGKILL at random points, zombies,
and consumers restarted from a saved cursor. Backends: local dir, S3 (moto and SeaweedFS),
Azure (Azurite).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checks import assert_exactly_once, assert_ranks_agree, assert_referenced_objects_exist
from worker import digest, tgb

import batchweave as bw

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).with_name("worker.py"))


def spawn(*args: str, stdin=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WORKER, *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{out}\n{err}"
    return out


def wait_until(condition, timeout_s: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def committed_offset(url: str, producer_id: str) -> int:
    return bw.inspect_namespace(url).producers.get(producer_id, {}).get("offset", 0)


def consume_all(url: str, ranks: int, tmp_path: Path, **kw) -> dict[int, list[dict]]:
    procs = {
        r: spawn("consume", url, str(r), str(tmp_path / f"rank{r}.json"), "--dp", str(ranks)) for r in range(ranks)
    }
    for proc in procs.values():
        finish(proc)
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text())["seen"] for r in procs}


def test_producer_processes_racing_commits(process_backend_url, tmp_path):
    counts = {"a": 12, "b": 12, "c": 12}
    procs = [
        spawn("produce", process_backend_url, pid, str(n), "--policy", "eager", "--pack-steps", "1")
        for pid, n in counts.items()
    ]
    for proc in procs:
        finish(proc)
    bw.end_stream(process_backend_url)
    tgbs = assert_exactly_once(process_backend_url, counts)
    assert len({version for *_, version in tgbs}) > 3, "the producers should have committed separately"
    assert_ranks_agree(consume_all(process_backend_url, 2, tmp_path), tgbs)


def test_sigkilled_producer_restarts_exactly_once(process_backend_url, tmp_path):
    """I3 and I4: SIGKILL at random points, restart, and finish with every offset once."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    total = 40
    steady = spawn("produce", process_backend_url, "steady", "30")  # commits concurrently throughout
    kills = []
    for _ in range(3):
        victim = spawn("produce", process_backend_url, "victim", str(total), "--flush-every", str(rng.randint(1, 4)))
        assert victim.stdout.readline().startswith("started")
        target = min(total - 1, committed_offset(process_backend_url, "victim") + rng.randint(1, 8))
        wait_until(lambda t=target: committed_offset(process_backend_url, "victim") >= t, what="victim progress")
        time.sleep(rng.uniform(0, 0.05))  # land anywhere inside append/commit, not just after one
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        kills.append(committed_offset(process_backend_url, "victim"))
    last = spawn("produce", process_backend_url, "victim", str(total))
    out = finish(last)
    assert f"epoch=4 resume={kills[-1]}" in out
    finish(steady)
    bw.end_stream(process_backend_url)
    tgbs = assert_exactly_once(process_backend_url, {"victim": total, "steady": 30})
    assert_referenced_objects_exist(process_backend_url)
    seen = consume_all(process_backend_url, 2, tmp_path)
    assert_ranks_agree(seen, tgbs)
    for rank, records in seen.items():  # every byte is the one produced for that (id, offset)
        for record in records:
            producer, offset = record["origin"]
            assert record["digest"] == digest(tgb(producer, offset, 2)[rank])


# A local directory and a real S3 server: group commit's logic sits above the store (the
# conformance suite runs every backend), and the suite's time is better spent elsewhere.
@pytest.mark.parametrize("process_backend_url", ["local", "seaweedfs"], indirect=True)
def test_sigkilled_producer_in_group_mode_restarts_exactly_once(process_backend_url):
    """I3 with group commit: another producer keeps folding the victim's intents, also
    while the victim lies dead; SIGKILL anywhere, restart, and every offset is there once."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    total = 30
    # steady writes each TGB at once (many turns to fold into); the victim packs by default,
    # so a kill also drops TGBs held for a pack
    steady = spawn(
        "produce", process_backend_url, "steady", "40", "--policy", "group", "--pace", "0.1", "--pack-steps", "1"
    )
    for _ in range(2):
        victim = spawn("produce", process_backend_url, "victim", str(total), "--policy", "group", "--pace", "0.05")
        assert victim.stdout.readline().startswith("started")
        target = min(total - 1, committed_offset(process_backend_url, "victim") + rng.randint(1, 6))
        wait_until(lambda t=target: committed_offset(process_backend_url, "victim") >= t, what="victim progress")
        time.sleep(rng.uniform(0, 0.3))  # anywhere in a turn: publishing, folding, committing
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finish(spawn("produce", process_backend_url, "victim", str(total), "--policy", "group"))
    finish(steady)
    bw.end_stream(process_backend_url)
    tgbs = assert_exactly_once(process_backend_url, {"victim": total, "steady": 40})
    assert_referenced_objects_exist(process_backend_url)
    folded = {version for _, producer, _, version in tgbs if producer == "victim"} & {
        version for _, producer, _, version in tgbs if producer == "steady"
    }
    assert folded, "no version carried both producers' TGBs: group commit did not fold"


def test_zombie_process_is_fenced(process_backend_url):
    zombie = spawn("produce", process_backend_url, "p", "3", "--hold", stdin=subprocess.PIPE)
    assert zombie.stdout.readline().startswith("started epoch=1")
    wait_until(lambda: zombie.stdout.readline().startswith("holding"), what="zombie holding")
    successor = finish(spawn("produce", process_backend_url, "p", "6"))
    assert "started epoch=2 resume=3" in successor
    zombie.stdin.write("go\n")
    zombie.stdin.flush()
    out, err = zombie.communicate(timeout=60)
    assert zombie.returncode == 3 and "fenced" in out, (out, err)
    assert_exactly_once(process_backend_url, {"p": 6})


def test_consumer_process_restarted_from_state_dict(process_backend_url, tmp_path):
    """I6 across processes: resume from a saved cursor with byte-identical data."""
    finish(spawn("produce", process_backend_url, "p", "15", "--dp", "2", "--cp", "2"))
    bw.end_stream(process_backend_url)
    args = ("--dp", "2", "--cp", "2")
    full, first, rest = tmp_path / "full.json", tmp_path / "first.json", tmp_path / "rest.json"
    finish(spawn("consume", process_backend_url, "3", str(full), *args))
    finish(spawn("consume", process_backend_url, "3", str(first), *args, "--stop-after", "6"))
    state = tmp_path / "state.json"
    state.write_text(json.dumps(json.loads(first.read_text())["state"]))
    finish(spawn("consume", process_backend_url, "3", str(rest), *args, "--state", str(state)))
    whole = json.loads(full.read_text())["seen"]
    resumed = json.loads(first.read_text())["seen"] + json.loads(rest.read_text())["seen"]
    assert resumed == whole and len(whole) == 15
