"""The benchmarks run in --quick mode and write well-formed JSON, PNG and Markdown.

These check the plumbing, not the figures: the figures are measured by the
benchmarks themselves (`make bench`) and reported in the closing notes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchweave.commit.policies import POLICY_NAMES
from benchmarks import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]

# Every ingestion run (dac, producers, pool-shrink) records these.
INGESTION = {
    *("system", "policy", "producers", "payload_bytes"),
    *("throughput_mb_s", "commit_success_rate", "tgbs_committed"),
}
REQUIRED = {
    "dac": INGESTION,
    "producers": INGESTION | {"visibility_p50_s", "visibility_p95_s"},
    "producer-scale": INGESTION | {"set", "visibility_p95_s", "cpu_per_producer_s_per_s", "follow_cpu_s_per_s"},
    "commit-cost": {"history_tgbs", "fragile_window_p50_s", "fragile_window_p95_s"},
    "exactly-once": {
        *("kind", "log", "tgb_slices", "payload_bytes"),
        *("commit_latency_state_s", "commit_latency_control_s", "overhead", "samples"),
    },
    "lifecycle": {"deletion", "step", "bytes_stored"},
    "gc-history": {"versions", "run", "requests", "log_version_reads"},
    "pool-shrink": INGESTION | {"counting", "stay", "producers_counted", "after_visibility_wait_s"},
    "consumers": {
        *("system", "store", "world_size", "payload_bytes", "steps", "throughput_mb_s", "step_p50_s"),
        *("step_p95_s", "read_amplification", "requests_per_step", "first_batch_s", "exact_resume"),
    },
    "e2e": {"system", "steps", "steps_per_s", "step_p50_s", "step_p95_s", "data_wait_fraction"},
    "overhead": {"store", "side", "steps", "batchweave_s", "plain_s", "plain_kind", "ratio", "target", "met"},
    "node-sharing": {"mesh", "sharing", "range_reads_per_step", "log_gets_per_step", "time_ratio", "reads_ratio"},
    "scale": {"kind", "setup", "state", "ranks", "producers", "hot_key_per_s"},
    "video": {"kind", "setting", "samples", "latency_p50_s", "latency_p95_s", "latency_p99_s", "latency_max_s"},
    "shuffle-quality": {"kind", "algorithm"},
}
# Each benchmark's default run, then the other workloads of those that have several.
RUNS = [(name, None) for name in sorted(REQUIRED)] + [("e2e", "video")]


def bench(*args: str, cwd: Path = ROOT, timeout: float = 60, prelude: str = "pass") -> subprocess.CompletedProcess:
    """``batchweave bench ARGS`` in a fresh interpreter in ``cwd`` (after running ``prelude`` there)."""
    code = f"import sys; {prelude}; from batchweave.cli import main; sys.exit(main(['bench', *sys.argv[1:]]))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_every_benchmark_is_checked():
    assert REQUIRED.keys() == BENCHMARKS.keys()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "workload"), RUNS, ids=[n if w is None else f"{n}-{w}" for n, w in RUNS])
def test_quick_benchmark_writes_its_three_files(name, workload, tmp_path):
    out = tmp_path / "out"
    chosen = () if workload is None else ("--workload", workload)
    done = bench(name, "--quick", "--out", str(out), *chosen, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    stem = name if workload is None else f"{name}-{workload}"  # the files are named after the result
    result = json.loads((out / f"{stem}.json").read_text())
    assert result["benchmark"] == stem and result["config"]["machine"]["cpu_count"] >= 1
    assert result["config"]["quick"] is True and "store" in result["config"]
    assert result["results"], "no records"
    for record in result["results"]:
        assert REQUIRED[name] <= record.keys(), REQUIRED[name] - record.keys()
        assert not isinstance(record.get("error"), str) or record.get("system") == "nats", record["error"]
    if name == "pool-shrink":
        counted = {r["counting"]: r["producers_counted"] for r in result["results"]}
        assert counted["every id ever seen"] == result["config"]["producers"], counted
        # (a quick run ends before the departed age out: their last commits are seconds old)
        assert 1 <= counted["recent committers"] <= result["config"]["producers"], counted
    if name in ("dac", "producers"):
        ours = [r for r in result["results"] if r["system"] == "batchweave"]
        assert all(r["tgbs_committed"] > 0 and 0 < r["commit_success_rate"] <= 1 for r in ours)
        assert {r["system"] for r in result["results"]} == (
            {"batchweave", "nats", "raw-puts"} if name == "producers" else {"batchweave"}
        )
        if name == "producers":  # visible after the append, and no sooner than the raw put alone
            for record in ours + [r for r in result["results"] if r["system"] == "raw-puts"]:
                assert 0 < record["visibility_p50_s"] <= record["visibility_p95_s"], record
        policies = {(r["system"], r["policy"]) for r in result["results"]}
        if name == "dac":  # every policy on both logs, however short the run
            assert policies == {("batchweave", p) for p in POLICY_NAMES}, policies
            runs = {(r["log"], r["policy"]) for r in result["results"]}
            assert runs == {(log, p) for log in ("manifest", "flat") for p in POLICY_NAMES}, runs
            assert result["config"]["manifest"]["entry_bytes"] > 32 * 10  # 32 slices' offsets at least
        else:  # NATS at its default message limit and with the limit raised, TGBs of the paper's 32 slices
            assert {("nats", "strict-tgb"), ("nats", "strict-tgb-64MiB")} <= policies, policies
            assert result["config"]["tgb_slices"] == 32 and all(r["tgb_slices"] == 32 for r in ours)
    if name == "overhead":  # both sides on both stores, each timed against its plain requests
        assert {(r["store"], r["side"]) for r in result["results"]} == {
            (store, side) for store in ("local", "latency") for side in ("producer", "consumer")
        }
        assert all(r["batchweave_s"] > 0 and r["plain_s"] > 0 for r in result["results"])
        # A profile of our reading code: the top functions by own time name some of its
        # modules (which lead changes with the run: decoding, the fetcher, the pipeline).
        package = ROOT / "src" / "batchweave"
        ours = [*(package / "reading").glob("*.py"), *(package / "journal").glob("*.py")]
        reading = {path.name for path in ours} | {"consumer.py", "layout.py", "log.py"}
        profile = result["config"]["profiles"]["consumer"]
        assert any(name in profile for name in reading), profile
    if name == "gc-history":  # a run with nothing new costs the same at every history length
        repeat = {r["versions"]: r["requests"] for r in result["results"] if r["run"].startswith("repeat")}
        assert len(set(repeat.values())) == 1 and max(repeat) > min(repeat), repeat
    if name == "scale":  # a producer pool in every state, and GC at growing history
        check_scale_pool_and_gc(result, (out / "scale.md").read_text())
    if name == "lifecycle":  # I12: the stored TGBs never pass max_lag, uploaded ones included
        peak = max(r["tgbs_stored"] for r in result["results"] if r["deletion"])
        assert peak <= result["config"]["bound_tgbs"] == result["config"]["max_lag"], peak
    if name == "node-sharing":  # one read per distinct slice per node, one follower's log requests
        shared = {r["mesh"]: r for r in result["results"] if r["sharing"] == "on"}
        assert shared["dp 2 x tp 4"]["range_reads_per_step"] == 2 and shared["dp 8 x tp 1"]["reads_ratio"] == 1
        assert all(r["log_ratio"] <= 0.2 for r in shared.values())
    if name == "consumers":  # the peers' rows: what each rank got, and their resume
        rows = {(r["store"], r["system"]): r for r in result["results"]}
        litdata, wds = rows["seaweedfs", "litdata-default"], rows["seaweedfs", "webdataset-per-rank"]
        assert litdata["exact_resume"] is True and litdata["delivers_own_slices"] is False  # a block of steps
        assert wds["exact_resume"] is None and wds["delivers_own_slices"] is True  # its own shards
        assert rows["seaweedfs", "batchweave"]["vs_litdata"] > 0 and litdata["read_amplification"] >= 1
    if name == "e2e":  # every feed trained on the same bytes, whichever process made them
        assert {r["feed"] for r in result["results"]} == {"memory", "batchweave", "dataloader"}
        assert len({r["data_digest"] for r in result["results"]}) == 1, result["results"]
        # The same bytes and seed; float sums may round apart when the machine's load changes
        # how the CPU kernels split their work (1.5937133 against 1.5937135 at load 15).
        losses = [r["final_loss"] for r in result["results"]]
        assert max(losses) - min(losses) <= 1e-5 * max(map(abs, losses)), result["results"]
    if stem == "e2e-video":  # the colocated loaders are tuned in prefetch too
        assert result["config"]["workload"] == "video"
        assert all("prefetch_factor" in r for r in result["results"] if r["feed"] == "dataloader")
    if name == "video":  # every axis, the expansion growing with the configuration, the latency spread
        check_video(result, (out / "video.md").read_text())
    if name == "exactly-once":  # the points, and the run over time on both logs
        check_exactly_once(result, (out / f"{stem}.md").read_text())
    if name == "shuffle-quality":  # ours mixes like a uniform shuffle, and keeps every share within 2
        check_shuffle_quality(result["results"])
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / f"{stem}.md").read_text()
    assert table.startswith(f"# {stem}") and table.count("\n|") >= len(result["results"]) + 1
    assert str(out / f"{stem}.json") in done.stdout  # the paths are printed for scripts


def check_exactly_once(result: dict, table: str) -> None:
    """The points carry the anchor check's cost and their margin; each log has windows over the run, its
    manifest growing; the verdict names both logs beside the paper's decline."""
    rows = result["results"]
    points = [r for r in rows if r["kind"] == "point"]
    assert len(points) == 4 and all(r["commit_latency_unanchored_s"] > 0 <= r["overhead_ci95"] for r in points), points
    for name in ("growing manifest (paper)", "delta log (ours)"):
        mine = [r for r in rows if r["kind"] == "window" and r["log"] == name]
        assert len(mine) >= 2 and all(r["samples"] >= 1 and r["commit_latency_control_s"] > 0 for r in mine), mine
        assert [r["manifest_tgbs"] for r in mine] == sorted(r["manifest_tgbs"] for r in mine), mine
        assert mine[-1]["manifest_tgbs"] > mine[0]["manifest_tgbs"] and mine[-1]["elapsed_s"] > mine[0]["elapsed_s"]
        assert result["series"][name], name
        assert re.search(rf"{re.escape(name)} [+-][0-9.]+% -> [+-][0-9.]+%", table), table


def check_video(result: dict, table: str) -> None:
    """``bench video``: each axis of Fig. 1 changes what it should change and nothing else."""
    rows = result["results"]
    axes = {(r["kind"], r["axis"]) for r in rows}
    assert axes == {
        *(("video", axis) for axis in ("source CRF", "resize x history", "clip length")),
        ("image-text", "resolution"),
        ("latency", "base packing"),
    }, axes
    crf = {r["crf"]: r for r in rows if r["axis"] == "source CRF"}
    best, worst = crf[min(crf)], crf[max(crf)]  # a higher CRF, a smaller video, the same tensors
    assert best["raw_bytes"] > worst["raw_bytes"] and best["ready_bytes"] == worst["ready_bytes"]
    assert best["expansion"] < worst["expansion"]
    grid = [r for r in rows if r["axis"] == "resize x history"]
    for frames in {r["frames"] for r in grid}:  # the same clips at every resolution: raw fixed, ready grows
        line = sorted((r for r in grid if r["frames"] == frames), key=lambda r: r["image_size"])
        assert len(line) >= 2 and len({r["raw_bytes"] for r in line}) == 1, line
        assert [r["ready_bytes"] for r in line] == sorted({r["ready_bytes"] for r in line}), line
    for size in {r["image_size"] for r in grid}:  # longer history, more ready bytes
        line = sorted((r for r in grid if r["image_size"] == size), key=lambda r: r["frames"])
        per_sample = [r["ready_bytes"] / r["samples"] for r in line]
        assert per_sample == sorted(set(per_sample)), line
    images = sorted((r for r in rows if r["kind"] == "image-text"), key=lambda r: r["image_size"])
    assert len({r["raw_bytes"] for r in images}) == 1 and len(images) >= 2
    for row in images:  # float32 [3, S, S] and CLIP's 77 int64 token ids per sample
        assert row["ready_bytes"] == row["samples"] * (3 * row["image_size"] ** 2 * 4 + 77 * 8), row
    assert [r["expansion"] for r in images] == sorted({r["expansion"] for r in images})
    (latency,) = [r for r in rows if r["kind"] == "latency"]
    ordered = [latency[f"latency_{q}_s"] for q in ("p50", "p95", "p99", "max")]
    assert 0 < ordered[0] and ordered == sorted(ordered) and latency["samples"] == len(result["series"]["latency"])
    for paper in ("62x-9,068x", "2.6x-41.5x", "288x-5,263x"):  # the verdict sets each range beside the paper's
        assert paper in table, paper


def check_shuffle_quality(rows: list[dict]) -> None:
    shuffles = {r["algorithm"]: r for r in rows if r["kind"] == "shuffle"}
    assert {"grain index_shuffle", "streaming py1e", "streaming py1br", "streaming py1s", "no shuffle"} <= set(shuffles)
    ours = shuffles["batchweave index (IndexPermutation)"]
    assert 0.3 < ours["mean_distance"] < 0.37 and 0.26 < ours["median_distance"] < 0.33, ours
    assert shuffles["no shuffle"]["within_64"] == 1 and shuffles["no shuffle"]["mean_distance"] < 1e-3
    sharded = shuffles["batchweave sharded (ShardedSource)"]
    assert sharded["shards_per_step"] < ours["shards_per_step"]  # the reading cost a shard-local order saves
    mixing = [r for r in rows if r["kind"] == "mixing"]
    assert {r["algorithm"] for r in mixing} >= {"batchweave Mixture", "litdata random choice"}
    for row in mixing:
        if row["algorithm"] == "batchweave Mixture":
            assert row["worst_deviation_64"] < 2 and row["worst_deviation_1024"] < 2, row


def check_scale_pool_and_gc(result: dict, table: str) -> None:
    """``bench scale``'s pool rows: each state measured at the smallest size with
    requests counted, projected above it, never a negative figure; GC's rows at each
    history length, a repeat costing the same; a verdict line per target."""
    rows = result["results"]
    pools = [r for r in rows if r["kind"] == "pool"]
    by_state = {r["state"].split(",")[0]: r for r in pools if r["how"] == "measured"}
    assert by_state.keys() == {"claiming at start", "following the log", "held by max_lag"}, by_state.keys()
    assert {r["policy"] for r in pools if r["state"].startswith("following")} == {"group", "dac"}
    for row in pools + [r for r in rows if r["kind"] == "gc"]:
        numbers = {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        assert all(v >= 0 for v in numbers.values()), (row["state"], numbers)  # (NaN fails too)
        assert isinstance(row["met"], bool) and row["target"]
    smallest = min(r["producers"] for r in pools)
    (held,) = [r for r in pools if r["state"].endswith("never collected") and r["producers"] == smallest]
    (reclaim,) = [r for r in pools if r["state"].endswith(", collected") and r["producers"] == smallest]
    # Once collected, a held producer probes the log's reclaim point: no mark read, ever.
    assert reclaim["first_poll_gets_per_producer"] == 0 and reclaim.get("checkpoints_gets", 0) == 0, reclaim
    assert reclaim.get("checkpoints_lists", 0) == 0 and reclaim["log_per_s"] > 0, reclaim
    (claims,) = [
        r for r in pools if r["state"] == "claiming at start" and r["how"] == "measured" and r["producers"] == 16
    ]
    # Tickets: a claim needs no version of its own, and a loser writes nothing more.
    assert 1 <= claims["claim_versions"] < claims["producers"] and claims["seconds_to_claim_all"] > 0, claims
    assert claims["log_puts"] <= 1.25 * claims["producers"] and claims["ticket_requests"] >= claims["producers"]
    assert held["first_poll_gets_per_producer"] == held["marks"] > 0  # each mark read once, on the first poll
    assert held["checkpoints_lists"] > 0 and held["checkpoints_gets"] == 0  # then listed only
    for policy in ("group", "dac"):
        (follow,) = [
            r for r in pools if r["policy"] == policy and r["producers"] == smallest and "following" in r["state"]
        ]
        assert follow["tgbs_committed"] > 0 and follow["log_puts"] > 0 and follow["log_gets"] > 0, follow
        assert 0 < follow["visibility_p50_s"] <= follow["visibility_p95_s"], follow
    largest = max(result["config"]["pool"]["sizes"])
    projected = [r for r in pools if r["how"] == "projected"]
    assert {r["producers"] for r in projected} == {largest}, projected
    for row in projected:  # each producer sends what it did at the measured size
        (base,) = [
            r for r in pools if r["how"] == "measured" and (r["state"], r["policy"]) == (row["state"], row["policy"])
        ]
        factor = row["producers"] / base["producers"]
        assert row["hot_key_per_s"] == pytest.approx(base["hot_key_per_s"] * factor)
    gc = [r for r in rows if r["kind"] == "gc"]
    assert {r["versions"] for r in gc} == set(result["config"]["gc"]["versions"]) and len(gc) == 3 * len(
        result["config"]["gc"]["versions"]
    )
    assert all(r["met"] for r in gc if r["setup"].startswith("repeat")), gc
    for target in ("(target <= 100:", "PUT/s on _log/ (target <= 1,000:", "GET/s on _log/ (target <= 3,000:"):
        assert target in table, target
    assert "gc: repeat, nothing new:" in table and "target <= 1.3x: met" in table
    fresh = [r for r in rows if r["kind"] == "fresh"]
    assert [r["ranks"] for r in fresh] == result["config"]["fresh"]["sizes"], fresh
    for row in fresh:  # a real node of the job delivered every step of the window
        assert row["steps"] > 0 and 0 < row["fresh_p50_s"] <= row["fresh_p95_s"] <= row["fresh_max_s"], row
        assert row["pause_s"] == pytest.approx(row["nodes"] / 70) and isinstance(row["met"], bool)
    assert "freshness at 64 ranks (8 nodes): commit to delivery P50" in table


def test_unknown_benchmark_lists_them(tmp_path):
    done = bench("nope", "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "no benchmark 'nope'; choose from commit-cost, consumers," in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("dac", "--workload", "video"), "bench dac has no --workload"),
        (("e2e", "--workload", "audio"), "bench e2e has no workload 'audio'; choose from image, video"),
    ],
)
def test_an_unknown_workload_is_refused_before_any_work(tmp_path, args, message):
    done = bench(*args, "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_found_from_a_subdirectory_of_the_checkout_and_by_python_m(tmp_path):
    done = bench("nope", "--out", str(tmp_path), cwd=ROOT / "docs")
    assert done.returncode == 2 and "no benchmark 'nope'" in done.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "nope", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no benchmark 'nope'" in done.stderr


def test_outside_a_checkout_says_where_the_benchmarks_are(tmp_path):
    t0 = time.monotonic()
    done = bench("dac", "--quick", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and "checkout of the BatchWeave repository" in done.stderr, done.stderr
    assert "pip install" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists() and time.monotonic() - t0 < 30


@pytest.mark.parametrize(
    ("args", "absent", "named"),
    [
        (("dac",), "matplotlib", "matplotlib"),
        (("consumers",), "streaming", "mosaicml-streaming"),
        (("dac", "--store", "s3"), "moto", "moto[server]"),
        (("e2e", "--workload", "video"), "av", "av"),
        (("video",), "pyarrow", "pyarrow"),
    ],
)
def test_a_missing_dependency_is_named_before_any_work(tmp_path, args, absent, named):
    # sys.modules[name] = None: importing `name` fails, as when it is not installed.
    done = bench(*args, "--out", str(tmp_path / "out"), prelude=f"sys.modules[{absent!r}] = None")
    assert done.returncode == 2 and f"needs {named}" in done.stderr, done.stderr
    assert "pip install -e '.[bench]'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
