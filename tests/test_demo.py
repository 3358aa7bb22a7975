"""``batchweave demo``: real processes, a real SIGKILL, and the checks it reports."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

import batchweave
from batchweave import demo


def _cli() -> list[str]:
    return [sys.executable, "-m", "batchweave.cli"]


@pytest.mark.slow
def test_demo_with_a_killed_producer(tmp_path):
    directory, summary_file = tmp_path / "demo", tmp_path / "summary.json"
    started = time.monotonic()
    result = subprocess.run(
        [
            *_cli(),
            "demo",
            "--dir",
            str(directory),
            "--producers",
            "2",
            "--steps",
            "40",
            "--dp",
            "2",
            "--cp",
            "1",
            "--json-summary",
            str(summary_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.monotonic() - started < 60
    summary = json.loads(summary_file.read_text())
    assert summary == json.loads((directory / "summary.json").read_text())
    assert summary["ok"] is True
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert not failed, failed
    assert {c["name"] for c in summary["checks"]} >= {
        "processes",
        "namespace",
        "step order",
        "same TGB per step",
        "exactly-once offsets",
        "resume after kill",
        "payload",
    }
    assert summary["steps"] == summary["steps_expected"] == 40
    assert (summary["producers"], summary["dp"], summary["cp"]) == (2, 2, 1)
    assert 0 < summary["commit_successes"] <= summary["commit_attempts"]
    assert summary["commit_success_rate"] == pytest.approx(
        summary["commit_successes"] / summary["commit_attempts"], abs=1e-4
    )
    assert summary["wall_time_s"] > 0 and summary["steps_per_s"] > 0 and summary["mb_per_s"] > 0

    killed = summary["killed"]
    assert killed is not None and killed["producer_id"] == "prep-1"
    assert killed["resumed_at"] == killed["committed_at_kill"] <= killed["appended_before_kill"]
    assert killed["epoch_after"] == killed["epoch_before"] + 1

    # The namespace the demo leaves behind agrees, read independently of the demo.
    info = batchweave.inspect_namespace(str(directory / "namespace"))
    assert info.steps == 40 and info.end_of_stream
    assert info.producers == {"prep-0": {"offset": 20, "epoch": 1}, "prep-1": {"offset": 20, "epoch": 2}}
    ranks = [json.loads((directory / "results" / f"rank-{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["steps"] == list(range(40))
        assert [s[:2] for s in rank["sources"]] == [s[:2] for s in ranks[0]["sources"]]
    offsets = {p: [o for q, o, _ in ranks[0]["sources"] if q == p] for p in (0, 1)}
    assert offsets == {0: list(range(20)), 1: list(range(20))}
    assert "all checks passed" in result.stdout


def test_preprocessing_is_deterministic_and_well_formed():
    a = demo.build_slice(1, 7, 2)
    b = demo.build_slice(1, 7, 2)
    assert demo.slice_checksum(a) == demo.slice_checksum(b)
    assert demo.slice_checksum(a) != demo.slice_checksum(demo.build_slice(1, 8, 2))
    assert a["pixels"].shape == (demo.IMAGES_PER_SLICE, 3, demo.RESOLUTION, demo.RESOLUTION)
    assert a["pixels"].dtype == np.float16 and np.isfinite(a["pixels"]).all()
    assert a["tokens"].dtype == np.int32 and a["tokens"].shape == a["mask"].shape
    assert (a["mask"] == (a["tokens"] != demo.PAD)).all()
    assert a["mask"].any(axis=1).all()
    assert a["source"].tolist() == [1, 7, 2]


def test_pack_first_fit():
    seqs = [np.arange(1, n + 1, dtype=np.int32) for n in (5, 4, 3, 9)]
    tokens, segments = demo._pack(seqs, rows=2, seq_len=8)
    assert segments.tolist() == [[1] * 5 + [2] * 3, [1] * 4 + [0] * 4]  # 9 is truncated to 8 and dropped
    assert tokens[0].tolist() == [1, 2, 3, 4, 5, 1, 2, 3]


def test_resize_keeps_constant_images_constant():
    img = np.full((37, 53, 3), 200, dtype=np.uint8)
    assert np.allclose(demo._resize_bilinear(img, 32, 32), 200)


def test_demo_dir_is_fresh_and_never_a_foreign_one(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(batchweave.ConfigError):
        demo.prepare_demo_dir(foreign)
    assert (foreign / "thesis.tex").read_text() == "precious"

    ours = demo.prepare_demo_dir(tmp_path / "ours")
    (ours / "namespace" / "_log").mkdir(parents=True)
    (ours / "results").mkdir()
    (ours / "notes.txt").write_text("keep")
    again = demo.prepare_demo_dir(ours)
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
        d = demo.prepare_demo_dir(root / f"run{i}")
        runs.append(d)
        time.sleep(0.01)
    fresh = demo.default_demo_dir(root)
    assert not fresh.exists() and fresh.parent == root
    left = {p.name for p in root.iterdir()}
    assert "user-stuff" in left
    assert left - {"user-stuff"} == {"run2", "run3"}  # with the new one, 3 demo runs remain


def _fake_run(tmp_path, sources_by_rank, steps, shares, offsets, eos=True):
    """Rank result files as the consumers would write them, for checking the checks."""
    results = tmp_path / "results"
    results.mkdir()
    run = demo._Run("file:///x", len(shares), steps, dp=len(sources_by_rank), cp=1)
    run.shares = shares
    for r, sources in enumerate(sources_by_rank):
        checksums = [demo.slice_checksum(demo.build_slice(p, o, s, 2)) for p, o, s in sources]
        (results / f"rank-{r}.json").write_text(
            json.dumps(
                {
                    "rank": r,
                    "slice_index": r,
                    "steps": list(range(len(sources))),
                    "sources": sources,
                    "checksums": checksums,
                    "bytes": 1,
                    "error": None,
                }
            )
        )
    run.info = batchweave.NamespaceInfo(
        url="file:///x",
        latest_version=9,
        steps=steps,
        producers={demo.producer_id(i): {"offset": o, "epoch": 1} for i, o in enumerate(offsets)},
        end_of_stream=eos,
        bytes=1000,
    )
    summary = demo._summarize(run, results, None, [], 1.0, images=2)
    return {c["name"]: c["ok"] for c in summary["checks"]}, summary


def test_checks_pass_on_a_clean_run(tmp_path):
    order = [(0, 0), (1, 0), (0, 1), (1, 1)]
    ranks = [[[p, o, r] for p, o in order] for r in range(2)]
    checks, summary = _fake_run(tmp_path, ranks, 4, [2, 2], [2, 2])
    assert summary["ok"] and all(checks.values()), checks


def test_checks_catch_a_duplicate_offset(tmp_path):
    order = [(0, 0), (1, 0), (1, 0), (0, 1)]  # prep-1 offset 0 twice, offset 1 missing
    ranks = [[[p, o, r] for p, o in order] for r in range(2)]
    checks, summary = _fake_run(tmp_path, ranks, 4, [2, 2], [2, 2])
    assert not summary["ok"] and checks["exactly-once offsets"] is False
    assert checks["step order"] and checks["same TGB per step"]


def test_checks_catch_ranks_that_disagree(tmp_path):
    a = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
    b = [[0, 0, 1], [0, 1, 1], [1, 0, 1], [1, 1, 1]]  # rank 1 saw steps 1 and 2 swapped
    checks, summary = _fake_run(tmp_path, [a, b], 4, [2, 2], [2, 2])
    assert not summary["ok"] and checks["same TGB per step"] is False


def test_checks_catch_a_gap_and_a_wrong_slice(tmp_path):
    a = [[0, 0, 0], [0, 1, 0]]
    b = [[0, 0, 0], [0, 1, 1]]  # rank 1 got slice 0 at step 0
    checks, summary = _fake_run(tmp_path, [a, b], 3, [3], [3])  # a step is missing everywhere
    assert checks["step order"] is False and checks["same TGB per step"] is False
    assert checks["exactly-once offsets"] is False and not summary["ok"]
