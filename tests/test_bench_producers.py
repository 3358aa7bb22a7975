"""``bench producers`` (the paper's Fig. 6): the like-for-like sweep's plan on a local
directory, its budget, the verdict lines, the figure's colours, the CPU each system
used per GB and where (its figures from short real runs, its panel, the verdict's
lines), and quick mode end to end on a local directory with a real nats-server."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from benchmarks import producers, profiling
from benchmarks.producers import (
    LOCAL_BUDGET_S,
    REFUSAL_WINDOW_S,
    STYLES,
    TGB_SLICES,
    Run,
    cpu_fields,
    expected_s,
    plan,
    runs,
    verdict,
)
from benchmarks.profiling import Snapshot
from benchmarks.report import BenchOptions, BenchResult, load_result
from tests.test_bench import ROOT, bench

LOCAL_FULL = BenchOptions(store="local")
# A result written before the runs measured their CPU: its figure must still draw.
BEFORE_CPU = Path(__file__).resolve().parents[1] / "docs/benchmarks/2026-11-28-a5731fe/producers.json"


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


def test_cpu_per_gb_puts_the_nats_server_in_the_shared_part_and_the_rest_on_the_producers_side():
    ours = row("batchweave", "dac", 8, 100.0, duration_s=50.0, tgbs_in_window=20_000, cpu_per_producer_s_per_s=0.25)
    # 8 producers x 0.25 CPU-s/s x 50 s = 100 CPU-s for 20,000 TGBs of 100 KB = 2 GB
    assert cpu_fields(ours) == {
        "cpu_s": 100.0,
        "shared_cpu_s": 0.0,
        "cpu_s_per_gb": 50.0,
        "shared_cpu_s_per_gb": 0.0,
        "producer_cpu_s_per_gb": 50.0,
    }
    raw = row("raw-puts", "none", 8, 100.0, tgbs_committed=5_000, writers_cpu_s=2.0)
    assert measured(raw)["cpu_s_per_gb"] == pytest.approx(4.0) and measured(raw)["shared_cpu_s"] == 0.0
    nats = row("nats", "strict-tgb", 8, 100.0, tgbs_committed=10_000, server_cpu_s=3.0, client_cpu_s=1.0)
    assert cpu_fields(nats) == pytest.approx(
        {
            "cpu_s": 4.0,
            "shared_cpu_s": 3.0,
            "cpu_s_per_gb": 4.0,
            "shared_cpu_s_per_gb": 3.0,
            "producer_cpu_s_per_gb": 1.0,
        }
    )
    refused = {**nats, "tgbs_committed": 0}  # CPU spent, nothing delivered: no figure per GB
    assert cpu_fields(refused)["cpu_s"] == 4.0 and cpu_fields(refused)["cpu_s_per_gb"] is None
    unread = {**nats, "server_cpu_s": None}  # no /proc: the system's CPU is not known
    assert set(cpu_fields(unread).values()) == {None}
    assert set(cpu_fields(producers._nats_missing(8, 100_000)).values()) == {None}


def measured(record: dict) -> dict[str, float]:
    """A record's CPU figures (``cpu_fields``), every one of them known."""
    figures = cpu_fields(record)
    assert None not in figures.values(), figures
    return {k: v for k, v in figures.items() if v is not None}


def test_raw_puts_measure_their_writers_cpu(tmp_path):
    with producers._store(LOCAL_FULL, False, "cpu") as store:
        record = producers.measure_raw_puts(store, writers=2, payload_bytes=100_000, duration_s=0.3)
    assert record["tgbs_committed"] > 0 and record["error"] is None
    figures = measured(record)
    assert record["writers_cpu_s"] > 0 and figures["cpu_s_per_gb"] > 0
    assert figures["shared_cpu_s"] == 0 and figures["producer_cpu_s_per_gb"] == figures["cpu_s_per_gb"]


def test_nats_measures_its_servers_cpu_apart_from_its_clients(tmp_path):
    from benchmarks.nats_baseline import find_nats_server, measure_nats

    if find_nats_server() is None:
        pytest.skip("nats-server is not installed (`make test` installs it)")
    record = measure_nats(producers=2, payload_bytes=100_000, duration_s=1.0, workdir=tmp_path)
    assert record["tgbs_committed"] > 0 and record["error"] is None
    assert record["server_cpu_s"] > 0 and record["client_cpu_s"] > 0
    figures = measured(record)
    assert figures["shared_cpu_s_per_gb"] > 0 and figures["producer_cpu_s_per_gb"] > 0
    assert figures["cpu_s_per_gb"] == pytest.approx(figures["shared_cpu_s_per_gb"] + figures["producer_cpu_s_per_gb"])


def cpu_rows() -> list[dict]:
    """Two producer counts of every local system, with their CPU per GB (and so, over
    windows of 10 s, the CPU seconds of ``cpu_fields``)."""

    def cpu(system: str, policy: str, n: int, mb_s: float, per_gb: float, shared: float = 0.0, **more) -> dict:
        gb = mb_s * 10 / 1000
        figures = {"cpu_s_per_gb": per_gb, "shared_cpu_s_per_gb": shared, "producer_cpu_s_per_gb": per_gb - shared}
        seconds = {"duration_s": 10.0, "cpu_s": per_gb * gb, "shared_cpu_s": shared * gb}
        return row(system, policy, n, mb_s, **figures, **seconds, **more)

    return [
        cpu("batchweave", "dac", 8, 200.0, 8.0, follow_cpu_s_per_s=0.05, cpu_per_producer_s_per_s=0.2),
        cpu("batchweave", "dac", 128, 80.0, 24.0, follow_cpu_s_per_s=0.012, cpu_per_producer_s_per_s=0.015),
        cpu("raw-puts", "none", 8, 900.0, 1.5),
        cpu("raw-puts", "none", 128, 600.0, 2.0),
        cpu("nats", "strict-tgb-64MiB", 8, 400.0, 3.0, 1.25),
        cpu("nats", "strict-tgb-64MiB", 128, 700.0, 2.25, 1.0),
    ]


def test_the_verdict_says_where_each_systems_cpu_goes_and_what_one_server_core_caps():
    lines = verdict(cpu_rows())
    # cores busy: CPU-s per GB x GB per second (MB/s / 1000)
    assert (
        "100 KB, NATS JetStream, 64 MiB limit: CPU-s per GB 3 at 8 and 2.25 at 128 producers (1.2 and 1.6 cores "
        "busy); its server 1.25 at 8 and 1 at 128 (0.5 and 0.7 cores busy): one server core would cap it at about "
        "800 and 1000 MB/s however many producers publish; its clients 1.75 at 8 and 1.25 at 128 (0.7 and 0.88 cores "
        "busy, 1 at most)"
    ) in lines
    assert (
        "100 KB, BatchWeave, DAC: CPU-s per GB 8 at 8 and 24 at 128 producers (1.6 and 1.9 cores busy), all on the "
        "producers' side; following the log about 25% and 80% of it; with a core per producer, projected from "
        "these costs (not measured): 1 GB/s at 8 and 5.3 GB/s at 128"
    ) in lines
    assert (
        "100 KB, raw create-only puts (no commit): CPU-s per GB 1.5 at 8 and 2 at 128 producers (1.4 and 1.2 cores "
        "busy), all in the writers"
    ) in lines
    assert lines.count(producers.CPU_READING) == 1
    # results written before CPU was measured: no CPU lines
    assert not [line for line in verdict([row("batchweave", "dac", 8, 100.0)]) if "CPU" in line]


def test_a_core_per_producer_is_projected_from_own_work_and_following_the_whole_log():
    dac_8, dac_128 = cpu_rows()[:2]
    # 8: own work 8 x (1 - 25%) = 6 CPU-s per GB, following 0.05 CPU-s/s over 0.2 GB/s = 0.25
    # per GB the job commits, so each producer 1 / (6 + 8 x 0.25) GB/s
    assert producers.host_per_producer_gb_s(dac_8) == pytest.approx(8 / (6 + 8 * 0.25))
    # 128: own 24 x 20% = 4.8, following 0.012 / 0.08 = 0.15 a GB: sublinear, as following grows with N
    assert producers.host_per_producer_gb_s(dac_128) == pytest.approx(128 / (4.8 + 128 * 0.15))


def test_the_cpu_panel_draws_each_system_and_the_nats_server_apart():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = BenchResult("producers", {"store": {"kind": "local"}, "tgb_slices": 32}, cpu_rows(), producers.COLUMNS)
    figure = plt.figure(figsize=(11, 6))
    try:
        producers.plot(result, figure)
        throughput, cpu = figure.axes
        assert figure.get_size_inches()[1] > 6  # the second panel got room of its own
        assert "CPU-seconds per GB" in cpu.get_title() and cpu.get_yscale() == "log"
        drawn = {str(line.get_label()): np.asarray(line.get_ydata()).tolist() for line in cpu.get_lines()}
        assert drawn["NATS JetStream, 64 MiB limit: all"] == [3.0, 2.25]
        assert drawn["NATS JetStream, 64 MiB limit: server only"] == [1.25, 1.0]
        assert drawn["BatchWeave, DAC: all"] == [8.0, 24.0]
        assert not [label for label in drawn if "server only" in label and "NATS" not in label]
        assert [t.get_text() for t in cpu.texts] == ["24", "2", "2.25", "1"]
        assert [t.get_text() for t in throughput.texts] == ["80", "600", "700"]
    finally:
        plt.close(figure)


def test_a_result_from_before_cpu_was_measured_draws_its_one_panel():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = load_result(BEFORE_CPU)
    assert not any("cpu_s_per_gb" in r for r in result.results)
    figure = plt.figure(figsize=(11, 6))
    try:
        producers.plot(result, figure)
        (ax,) = figure.axes
        assert ax.get_ylabel() == "committed MB/s" and len(ax.get_lines()) == 5
        assert list(figure.get_size_inches()) == [11, 6]
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
    # CPU per GB delivered: the NATS server's is shared, BatchWeave's and the raw puts' are not
    for record in [r for r in records if r["tgbs_committed"]]:
        assert record["cpu_s"] > 0 and record["cpu_s_per_gb"] > 0, record
        if record["system"] == "nats":
            assert 0 < record["shared_cpu_s_per_gb"] < record["cpu_s_per_gb"], record
        else:
            assert record["shared_cpu_s_per_gb"] == 0, record
            assert record["producer_cpu_s_per_gb"] == record["cpu_s_per_gb"], record
    assert refused["cpu_s"] > 0 and refused["cpu_s_per_gb"] is None  # it worked, and delivered nothing
    assert not (tmp_path / producers.PROFILE_JSON).exists()  # no profile unless asked for
    assert not any("profile_shares" in r for r in records)
    assert (tmp_path / "producers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- --profile: where a producer's CPU goes -------------------------------------------------


def synthetic(functions: dict[str, tuple[str, str, float]], edges: list[tuple[str, str, float]]) -> Snapshot:
    """A window's counts: ``functions`` label -> (file, qualified name, self seconds);
    ``edges`` (caller, callee, the callee's seconds when called from there)."""
    snapshot = Snapshot()
    for label, (path, qualname, tottime) in functions.items():
        snapshot.functions[label] = [10.0, tottime, tottime]
        snapshot.where[label] = (path, qualname)
    for caller, callee, seconds in edges:
        snapshot.edges[(caller, callee)] = [5.0, seconds, seconds]
    return snapshot


def test_a_functions_self_time_goes_to_the_innermost_bucket_its_callers_run_in():
    snapshot = synthetic(
        {
            "commit": ("batchweave/journal/core.py", "Journal.commit", 1.0),
            "read_on": ("batchweave/journal/core.py", "Journal._read_on", 1.0),
            "helper": ("batchweave/log.py", "decode_version", 4.0),  # no rule: its callers decide
            "crc": ("builtin", "<built-in method crc32c._crc32c.crc32c>", 2.0),
            "work": ("concurrent/futures/thread.py", "_WorkItem.run", 0.5),
            "open": ("batchweave/store/localfs.py", "open_staging", 1.0),
            "loose": ("somewhere.py", "f", 1.0),
        },
        [
            ("commit", "read_on", 2.0),  # a log read inside a commit is following the log
            ("commit", "helper", 3.0),
            ("read_on", "helper", 1.0),
            ("read_on", "crc", 2.0),  # a builtin with a rule of its own keeps it wherever it runs
            ("work", "open", 1.0),  # a pool's task: nothing on its stack says, its fallback does
        ],
    )
    by_function = profiling.attribute(snapshot)
    assert by_function["helper"] == pytest.approx({"commit": 3.0, "following the log": 1.0})
    assert by_function["read_on"] == {"following the log": 1.0}
    assert by_function["crc"] == {"checksum": 2.0}
    assert by_function["open"] == {"put": 1.0}
    assert by_function["loose"] == {"other": 1.0} and by_function["work"] == {"other": 0.5}
    summary = profiling.summarize(snapshot)
    shares = {bucket: v["share"] for bucket, v in summary["buckets"].items()}
    assert list(shares) == list(profiling.BUCKETS) and sum(shares.values()) == pytest.approx(1)
    assert summary["profiled_cpu_s"] == pytest.approx(10.5)
    assert shares["commit"] == pytest.approx(4.0 / 10.5)
    assert summary["kinds"]["native"]["cpu_s"] == pytest.approx(2.0)  # the checksum's builtin


def test_the_profilers_cost_comes_off_half_from_the_function_and_half_from_its_caller():
    before = synthetic({}, [])
    after = synthetic(
        {"caller": ("a.py", "f", 1.0), "callee": ("a.py", "g", 1.0)},
        [("caller", "callee", 1.0)],  # 5 calls of g from f; 10 calls of each in all
    )
    window = after.minus(before, bias_s=0.02)
    # callee: 10 calls x 0.01; caller: 10 calls of it and 5 it made, x 0.01
    assert window.functions["callee"][1] == pytest.approx(0.9)
    assert window.functions["caller"][1] == pytest.approx(0.85)
    assert window.edges[("caller", "callee")][2] == pytest.approx(0.9)  # scaled as the callee was
    assert window.raw_self_s == pytest.approx(2.0)


def test_a_profile_of_real_threads_counts_framing_checksums_and_puts_apart(tmp_path):
    from batchweave.layout import encode_tgb
    from batchweave.store import open_store

    profiles = profiling.ThreadProfiles()
    profiles.install()
    try:
        started = profiles.snapshot()

        def produce() -> None:
            store = open_store(tmp_path, storage_options={"fsync": False})
            for n in range(40):
                encoded = encode_tgb([b"x" * 10_000] * 16, 16, 1)
                store.stage_if_absent(f"data/p/e000001/{n:04d}.bwb", encoded.parts[0])
            store.release()

        thread = threading.Thread(target=produce)
        thread.start()
        thread.join()
        window = profiles.snapshot().minus(started, profiling.calibrate())
    finally:
        profiles.uninstall()
    by_function = profiling.attribute(window)

    def buckets_of(part: str) -> set[str]:
        return {bucket for key, shares in by_function.items() if part in key for bucket in shares}

    assert buckets_of("crc32c._crc32c") == {"checksum"}  # called inside the framing
    assert buckets_of("posix.writev") == {"put"}
    assert "encode/frame" in buckets_of("layout.py")
    summary = profiling.summarize(window)
    assert sum(v["share"] for v in summary["buckets"].values()) == pytest.approx(1)
    assert summary["threads"] >= 2  # the producing thread and the store's own (its spares)
    text = profiling.render({"one run": summary})
    assert "## one run" in text and "Top functions by self time" in text


def test_profile_options_are_only_for_the_benchmark_that_takes_them(tmp_path, capsys):
    import benchmarks
    from batchweave.cli import main
    from batchweave.errors import ConfigError

    with pytest.raises(ConfigError, match="bench overhead does not take --producers, --profile"):
        benchmarks.main("overhead", tmp_path, profile=True, producers=(8,))
    with pytest.raises(SystemExit):
        main(["bench", "producers", "--quick", "--producers", "8,x", "--out", str(tmp_path)])
    assert "expected positive whole numbers separated by commas, got '8,x'" in capsys.readouterr().err


def test_the_sweep_takes_the_producer_counts_and_sizes_asked_for():
    sweep = plan(BenchOptions(quick=True, profile=True, producers=(8, 32), payloads=(100_000,)))
    assert sweep["producers"] == [8, 32] and sweep["payloads"] == [100_000] and sweep["profile"] is True
    assert sweep["duration_s"] == producers.QUICK_PROFILE_WINDOW_S  # a profile of more than the warm-up
    assert plan(BenchOptions(quick=True))["profile"] is False


@pytest.mark.slow
def test_quick_mode_with_a_profile_writes_it_beside_the_json_in_buckets_that_add_up(tmp_path):
    done = bench(
        "producers",
        *("--quick", "--store", "local", "--profile", "--producers", "2", "--payloads", "100000"),
        *("--out", str(tmp_path)),
        timeout=400,
        prelude=f"sys.path.insert(0, {str(ROOT / 'src')!r})",  # this checkout's, in its worker processes too
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / producers.PROFILE_JSON).read_text())
    assert set(written["profiles"]) == {"dac x2, 100 KB", "group x2, 100 KB"}
    for name, profile in written["profiles"].items():
        shares = {bucket: v["share"] for bucket, v in profile["buckets"].items()}
        assert list(shares) == list(profiling.BUCKETS), name
        assert sum(shares.values()) == pytest.approx(1, abs=0.01), (name, shares)
        assert shares["encode/frame"] > 0 and shares["put"] > 0 and shares["commit"] > 0, (name, shares)
        assert profile["tgbs"] > 0 and profile["coverage"] > 0.5, name  # the profilers saw the producers' CPU
        for row in profile["by_self"]:
            assert {"function", "calls", "tottime_s", "cumtime_s", "share", "bucket"} <= row.keys()
    text = (tmp_path / producers.PROFILE_TEXT).read_text()
    assert "## dac x2, 100 KB" in text and "Top functions by cumulative time" in text
    records = json.loads((tmp_path / "producers.json").read_text())["results"]
    profiled = [r for r in records if r["system"] == "batchweave"]
    assert all(sum(r["profile_shares"].values()) == pytest.approx(1, abs=0.01) for r in profiled)
    assert not any("profile_shares" in r for r in records if r["system"] != "batchweave")


def test_rounds_run_every_system_of_a_point_once_a_round_one_after_the_other():
    sweep = {**plan(BenchOptions(store="local", producers=(8, 32), payloads=(100_000,), rounds=3))}
    assert sweep["rounds"] == 3
    planned = runs(sweep)
    one_round = [(r.system, r.policy) for r in runs({**sweep, "rounds": 1}) if r.producers == 8]
    at_8 = [r for r in planned if r.producers == 8]
    assert [(r.system, r.policy) for r in at_8] == one_round * 3  # interleaved, not each system three times in a row
    assert [r.round for r in at_8] == [k for k in range(3) for _ in one_round]
    assert expected_s(sweep) == pytest.approx(3 * expected_s({**sweep, "rounds": 1}))


def test_each_system_is_reported_by_its_median_run_whole():
    def row(system, throughput, p95, round_):
        return {"system": system, "policy": "none", "producers": 8, "payload_bytes": 100_000, "round": round_,
                "throughput_mb_s": throughput, "visibility_p95_s": p95}  # fmt: skip

    rows = [row("raw-puts", 628.0, 0.1, 0), row("raw-puts", 309.0, 0.3, 1), row("raw-puts", 338.0, 0.2, 2)]
    rows += [row("nats", 400.0, 0.05, 0)]
    (raw, nats) = producers.median_runs(rows)
    assert raw["throughput_mb_s"] == 338.0 and raw["visibility_p95_s"] == 0.2  # the median run's own P95
    assert raw["round_throughputs_mb_s"] == [628.0, 309.0, 338.0]
    assert nats == rows[-1]  # a single round passes unchanged
    two = producers.median_runs(rows[:2])
    assert two[0]["throughput_mb_s"] == 309.0  # of an even count, the lower middle


def test_rounds_are_only_for_bench_producers_and_at_least_one(tmp_path, capsys):
    import benchmarks
    from batchweave.cli import main
    from batchweave.errors import ConfigError

    with pytest.raises(ConfigError, match="bench overhead does not take --rounds"):
        benchmarks.main("overhead", tmp_path, rounds=3)
    with pytest.raises(SystemExit):
        main(["bench", "producers", "--quick", "--rounds", "0", "--out", str(tmp_path)])
    assert "expected a whole number of rounds, at least 1, got '0'" in capsys.readouterr().err


def test_the_profile_written_is_that_of_the_run_the_table_reports():
    def row(throughput, round_):
        return {"system": "batchweave", "policy": "group", "producers": 8, "payload_bytes": 100_000,
                "round": round_, "throughput_mb_s": throughput}  # fmt: skip

    rows = producers.median_runs([row(300.0, 0), row(400.0, 1), row(500.0, 2)])
    profiles = {("group x8, 100 KB", k): {"round": k} for k in range(3)}
    # the median run's profile (round 1), not the last round's
    assert producers.reported_profiles(profiles, rows) == {"group x8, 100 KB": {"round": 1}}
    assert producers.reported_profiles({}, rows) == {}
