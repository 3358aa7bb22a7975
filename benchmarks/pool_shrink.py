"""``bench pool-shrink``: DAC after most of a producer pool leaves, counting recent committers
or every id ever seen.

DAC sizes each producer's commit gap for N contending producers (paper eq. 8). Read as
"every producer id in the log", N never falls: after 12 of 16 producers stop, the 4 that
stay keep gaps sized for 16, commit about 4x less often than they need to, and every TGB
waits that much longer before a training rank can see it. Counting the producers recorded
within the newest 4N log versions lets N fall to 4. Both runs use the same latency model
and the same pool; only the count differs.
"""

from __future__ import annotations

from typing import Any

from benchmarks.ingest import IngestSpec, bench_store, ingest_config, percent, run_ingest
from benchmarks.report import BenchOptions, BenchResult

NAME = "pool-shrink"
COLUMNS = (
    "counting",
    "producers",
    "stay",
    "producers_counted",
    "gap_s",
    "after_commits_per_s",
    "after_tgbs_per_commit",
    "after_visibility_wait_s",
    "after_throughput_mb_s",
    "commit_success_rate",
    "tgbs_committed",
)


def specs(options: BenchOptions) -> list[IngestSpec]:
    if options.quick:
        producers, stay, leave_at_s, duration_s, sample_s = 2, 1, 0.5, 2.0, 0.25
    else:
        producers, stay, leave_at_s, duration_s, sample_s = 16, 4, 60.0, 240.0, 1.0
    return [
        IngestSpec(
            "dac",
            producers,
            100_000,
            duration_s,
            sample_s=sample_s,
            leave_at_s=leave_at_s,
            stay=stay,
            count_all_ids=count_all,
        )
        for count_all in (False, True)
    ]


def run(options: BenchOptions, progress: Any) -> BenchResult:
    runs = specs(options)
    task = progress.add_task("bench pool-shrink", total=len(runs))
    results, series = [], {}
    for spec in runs:
        label = "every id ever seen" if spec.count_all_ids else "recent committers"
        progress.update(task, description=f"pool-shrink: counting {label}")
        with bench_store(options, "pool-shrink") as store:
            record, points = run_ingest(spec, store)
        results.append(record)
        series[label] = points
        progress.advance(task)
    first = runs[0]
    config = {"policy": "dac", "stay": first.stay, "leave_at_s": first.leave_at_s, **ingest_config(first, options)}
    return BenchResult(NAME, config, results, COLUMNS, summary=verdict(results), series=series)


def verdict(results: list[dict[str, Any]]) -> list[str]:
    recent, every = (
        next(r for r in results if r["counting"] == c) for c in ("recent committers", "every id ever seen")
    )
    ratio = every["after_visibility_wait_s"] / recent["after_visibility_wait_s"]
    return [
        f"after {recent['producers'] - recent['stay']} of {recent['producers']} producers left, the "
        f"{recent['stay']} that stayed counted {recent['producers_counted']:.1f} producers (recent committers) "
        f"vs {every['producers_counted']:.1f} (every id ever seen)",
        f"a TGB waited {recent['after_visibility_wait_s']:.2f} s on average before it was visible, vs "
        f"{every['after_visibility_wait_s']:.2f} s ({ratio:.1f}x longer) when counting every id",
        f"throughput after the shrink {recent['after_throughput_mb_s']:.1f} vs {every['after_throughput_mb_s']:.1f} "
        "MB/s; commit success "
        f"{percent(recent['commit_success_rate'])} vs {percent(every['commit_success_rate'])} over the whole run",
    ]


def plot(result: BenchResult, figure: Any) -> None:
    left, right = figure.subplots(1, 2)
    for label, points in result.series.items():
        times = [p["t_s"] for p in points]
        left.plot(times, [p["successes"] for p in points], label=f"counting {label}")
        right.plot(times, [p["tgbs_committed"] for p in points], label=f"counting {label}")
    for axis in (left, right):
        axis.axvline(result.config["leave_at_s"], color="grey", linestyle=":", linewidth=1)
    left.set(title="successful commits (cumulative; slope = commit rate)", xlabel="time (s)", ylabel="commits")
    right.set(title="TGBs committed (cumulative)", xlabel="time (s)", ylabel="TGBs")
    left.legend()
