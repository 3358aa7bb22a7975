"""``bench dac``: every commit policy at a fixed producer count as the log grows (paper Fig. 9)."""

from __future__ import annotations

from typing import Any

from batchweave.commit.policies import POLICY_NAMES
from benchmarks.ingest import IngestSpec, bench_store, ingest_config, percent, run_ingest
from benchmarks.report import BenchOptions, BenchResult

NAME = "dac"
COLUMNS = (
    "policy",
    "producers",
    "payload_bytes",
    "throughput_mb_s",
    "window_throughput_mb_s",
    "commit_success_rate",
    "window_commit_success_rate",
    "tgbs_committed",
    "attempts",
    "log_versions",
    "drain_s",
)


def specs(options: BenchOptions, producers: int = 32, payload_bytes: int = 100_000) -> list[IngestSpec]:
    # DAC's gap at 32 producers is tens of seconds (eq. 8), so only the full run shows
    # its steady state; the quick run checks that everything works end to end: 4 producers
    # in one worker process (run with processes=1), 1 s per policy.
    if options.quick:
        return [IngestSpec(policy, 4, payload_bytes, 1.0, sample_s=0.25) for policy in POLICY_NAMES]
    return [IngestSpec(policy, producers, payload_bytes, 180.0) for policy in POLICY_NAMES]


def run(options: BenchOptions, progress: Any) -> BenchResult:
    runs = specs(options)
    task = progress.add_task("bench dac", total=len(runs))
    results, series = [], {}
    for spec in runs:
        progress.update(task, description=f"dac: {spec.policy} x{spec.producers}")
        with bench_store(options, f"dac-{spec.policy}") as store:
            record, points = run_ingest(spec, store, processes=1 if options.quick else None)
        results.append(record)
        series[spec.policy] = points
        progress.advance(task)
    config = {"policies": list(POLICY_NAMES), **ingest_config(runs[0], options)}
    return BenchResult(NAME, config, results, COLUMNS, summary=verdict(results), series=series)


def verdict(results: list[dict[str, Any]]) -> list[str]:
    by_policy = {r["policy"]: r for r in results}
    dac = by_policy["dac"]
    baselines = [r for r in results if r["policy"] != "dac"]
    best = max(baselines, key=lambda r: r["throughput_mb_s"])
    ratio = dac["throughput_mb_s"] / best["throughput_mb_s"] if best["throughput_mb_s"] else float("inf")
    return [
        f"DAC commit success {percent(dac['window_commit_success_rate'])} in the window, "
        f"{percent(dac['commit_success_rate'])} including the final drain (target >= 90%)",
        "commit success in the window: "
        + ", ".join(f"{r['policy']} {percent(r['window_commit_success_rate'])}" for r in results),
        f"DAC throughput {dac['throughput_mb_s']:.1f} MB/s = {ratio:.2f}x the best baseline "
        f"({best['policy']}, {best['throughput_mb_s']:.1f} MB/s; target >= 3x)",
        f"log reached {max(r['log_steps'] for r in results)} TGBs (target: past 20k in full mode)",
    ]


def plot(result: BenchResult, figure: Any) -> None:
    left, right = figure.subplots(1, 2)
    payload = result.config["payload_bytes"]
    for policy, points in result.series.items():
        times = [p["t_s"] for p in points]
        rates, success = [], []
        previous = {"t_s": 0.0, "tgbs_committed": 0, "attempts": 0, "successes": 0}
        for p in points:
            dt = p["t_s"] - previous["t_s"] or 1e-9
            rates.append((p["tgbs_committed"] - previous["tgbs_committed"]) * payload / dt / 1e6)
            success.append(p["successes"] / p["attempts"] if p["attempts"] else float("nan"))
            previous = p
        left.plot(times, rates, label=policy)
        right.plot(times, success, label=policy)
    left.set(title="ingestion throughput (committed)", xlabel="time (s)", ylabel="MB/s")
    right.set(title="commit success rate (cumulative)", xlabel="time (s)", ylabel="success rate", ylim=(0, 1.05))
    left.legend()
    right.axhline(0.9, color="grey", linestyle=":", linewidth=1)
