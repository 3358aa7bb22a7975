"""``bench producers`` (the paper's Fig. 6): the like-for-like sweep's plan on a local
directory, its budget, the verdict lines, the figure's colours, and quick mode end to end
on a local directory with a real nats-server."""

from __future__ import annotations

import json

import pytest

from benchmarks import producers
from benchmarks.producers import (
    LOCAL_BUDGET_S,
    REFUSAL_WINDOW_S,
    STYLES,
    TGB_SLICES,
    Run,
    expected_s,
    plan,
    runs,
    verdict,
)
from benchmarks.report import BenchOptions, BenchResult
from tests.test_bench import bench

LOCAL_FULL = BenchOptions(store="local")


def test_every_plan_makes_tgbs_of_the_papers_32_slices():
    for options in (LOCAL_FULL, BenchOptions(), BenchOptions(store="seaweedfs"), BenchOptions(quick=True)):
        assert plan(options)["tgb_slices"] == TGB_SLICES == 32, options


def test_the_local_full_sweep_compares_every_system_at_8_to_128_producers():
    sweep = plan(LOCAL_FULL)
    assert sweep["producers"] == [8, 16, 32, 64, 128]
    assert sweep["policies"] == ["dac", "group"] and sweep["nats"] and not sweep["paced"]
    assert sweep["fsync"] is False  # JetStream 2.9 acks before it syncs: so do BatchWeave and the raw puts here
    systems = {(r.system, r.policy) for r in runs(sweep)}
    assert systems == {
        *(("batchweave", p) for p in ("dac", "group")),
        ("raw-puts", "none"),
        ("nats", "strict-tgb"),
        ("nats", "strict-tgb-64MiB"),
    }
    # every system at every point, each point once
    points = [(r.system, r.policy, r.producers, r.payload_bytes) for r in runs(sweep)]
    assert len(points) == len(set(points)) == len(systems) * len(sweep["producers"]) * len(sweep["payloads"])


def test_the_local_full_sweep_fits_its_budget_with_windows_for_steady_state():
    sweep = plan(LOCAL_FULL)
    assert expected_s(sweep) <= LOCAL_BUDGET_S
    # BatchWeave's window is no shorter than the baselines': its commit pacing has to settle.
    assert sweep["duration_s"] >= sweep["baseline_duration_s"] >= 10


def test_nats_refusing_a_tgb_over_its_default_limit_gets_a_short_window():
    sweep = {**plan(LOCAL_FULL), "payloads": [100_000, 10_000_000]}
    windows = {(r.policy, r.payload_bytes): r.window_s for r in runs(sweep) if r.system == "nats"}
    assert windows["strict-tgb", 10_000_000] == REFUSAL_WINDOW_S < windows["strict-tgb", 100_000]
    assert windows["strict-tgb-64MiB", 10_000_000] == sweep["baseline_duration_s"]


def test_the_latency_sweep_keeps_its_plan_and_paced_point():
    sweep = plan(BenchOptions())
    assert sweep["producers"] == [8, 32, 128] and sweep["duration_s"] == 10.0
    paced = [r for r in runs(sweep) if r.pace_s]
    assert {(r.policy, r.producers, r.pace_s) for r in paced} == {("dac", 128, 0.25), ("group", 128, 0.25)}


def test_the_local_sweeps_store_does_not_fsync_and_is_removed_after(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with producers._store(LOCAL_FULL, False, "t") as store:
        assert store.storage_options.get("fsync") is False
        store.put_if_absent("data/x", b"1")
        assert len(list(tmp_path.iterdir())) == 1
    assert not list(tmp_path.iterdir())


def row(system: str, policy: str, n: int, mb_s: float, **more) -> dict:
    return {
        "system": system,
        "policy": policy,
        "producers": n,
        "payload_bytes": 100_000,
        "throughput_mb_s": mb_s,
        "tgbs_committed": int(mb_s * 10),
        **more,
    }


def test_the_verdict_names_each_systems_scaling_and_the_windows_adequacy():
    rows = [
        row("batchweave", "dac", 8, 100.0, steady_attempts=40),
        row("batchweave", "dac", 128, 800.0, steady_attempts=256),
        row("nats", "strict-tgb-64MiB", 8, 200.0),
        row("nats", "strict-tgb-64MiB", 128, 300.0),
        row("nats", "strict-tgb", 8, 0.0),
        row("nats", "strict-tgb", 128, 0.0),
    ]
    lines = verdict(rows)
    assert (
        "100 KB: BatchWeave >= NATS at 1/2 producer counts with DAC, 1/2 with the better of DAC and group commit; "
        "NATS with its default limit failed at 2 of them"
    ) in lines
    assert (
        "100 KB, 8 -> 128 producers (16x): BatchWeave, DAC 100 -> 800 MB/s (8.0x); "
        "NATS JetStream, 64 MiB limit 200 -> 300 MB/s (1.5x)"
    ) in lines
    assert "DAC steady commit attempts per producer in the window (fewest over payloads): x8 5.0, x128 2.0" in lines


def test_the_figure_gives_every_system_its_own_colour_and_the_papers_number():
    colours = [colour for _, colour, _ in STYLES.values()]
    assert len(set(colours)) == len(colours)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [
        row("batchweave", "dac", 8, 100.0),
        row("batchweave", "dac", 32, 300.0),
        row("raw-puts", "none", 8, 150.0),
        row("raw-puts", "none", 32, 500.0),
        row("nats", "strict-tgb-64MiB", 8, 200.0),
        row("nats", "strict-tgb-64MiB", 32, 210.0),
        row("nats", "strict-tgb", 8, 0.0),
    ]
    result = BenchResult("producers", {"store": {"kind": "local"}, "tgb_slices": 32}, results, producers.COLUMNS)
    figure = plt.figure()
    try:
        producers.plot(result, figure)
        (ax,) = figure.axes
        drawn = {line.get_label(): line.get_color() for line in ax.get_lines()}
        assert drawn["raw create-only puts (no commit)"] != drawn["NATS JetStream, 64 MiB limit"]
        assert "NATS JetStream, 1 MiB limit: no TGB committed" in drawn  # the refusal is marked, not dropped
        assert [t.get_text() for t in ax.texts] == ["300", "500", "210"]  # each line's last value, written
        assert figure.get_suptitle().startswith("Fig. 6 (paper)") and "32 slices" in figure.get_suptitle()
    finally:
        plt.close(figure)


def test_expected_seconds_add_each_runs_window_and_overhead():
    one = {**plan(LOCAL_FULL), "producers": [8], "payloads": [100_000]}
    planned = runs(one)
    assert expected_s(one) == pytest.approx(sum(r.window_s + producers.overhead_s(r) for r in planned))
    assert all(producers.overhead_s(r) > 0 for r in planned)
    assert producers.overhead_s(Run("batchweave", "dac", 128, 100_000, 1.0)) > producers.overhead_s(
        Run("batchweave", "dac", 8, 100_000, 1.0)
    )


@pytest.mark.slow
def test_quick_mode_on_a_local_directory_runs_every_system_with_32_slices(tmp_path):
    done = bench("producers", "--quick", "--store", "local", "--out", str(tmp_path), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "producers.json").read_text())
    assert result["config"]["tgb_slices"] == 32 and result["config"]["store"]["kind"] == "local"
    assert result["config"]["fsync"] is False
    records = result["results"]
    assert {(r["system"], r["policy"]) for r in records} == {
        ("batchweave", "dac"),
        ("batchweave", "group"),
        ("raw-puts", "none"),
        ("nats", "strict-tgb"),
        ("nats", "strict-tgb-64MiB"),
    }
    for record in records:
        assert record["run_s"] >= record["duration_s"] > 0, record
        if record["system"] != "raw-puts":  # the TGBs were built of the plan's slices
            assert record["tgb_slices"] == 32, record
        if record["system"] == "batchweave" or record["policy"] == "strict-tgb-64MiB":
            assert record["tgbs_committed"] > 0 and record["error"] is None, record
    (refused,) = [r for r in records if r["policy"] == "strict-tgb"]
    assert refused["tgbs_committed"] == 0 and "max_payload" in refused["error"]
    assert (tmp_path / "producers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
