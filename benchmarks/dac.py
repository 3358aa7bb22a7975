"""``bench dac``: every commit policy at 32 producers as the log grows, on two logs (paper Fig. 7).

The paper's ablation shows DAC widening its commit interval as a growing manifest makes
each commit dearer, while fixed and reactive cadences spend more and more of their time
on conflicts and retries. Our log writes a delta per commit instead of the whole TGB
list, so its commit cost is flat and on it alone the baselines never degrade. Every
policy therefore runs twice, on the latency model:

- ``manifest``: the paper's condition. ``GrowingManifest`` charges each commit the read
  and rewrite of the whole TGB list (one entry the size of our encoded descriptor of the
  same TGB) inside its fragile window;
- ``flat``: our log, where DAC's gain is smaller.

On a store other than the latency model only the flat log runs (the manifest is a cost
model, not a format). World size 32 (TGBs of 32 slices) and 100 KB TGBs, as the paper's
microbenchmarks.
"""

from __future__ import annotations

from typing import Any

import msgspec

from batchweave.commit.policies import POLICY_NAMES
from batchweave.latency import GrowingManifest
from batchweave.log import TGBDescriptor
from benchmarks.ingest import IngestSpec, bench_store, ingest_config, percent, run_ingest
from benchmarks.report import BenchOptions, BenchResult

NAME = "dac"
LOGS = ("manifest", "flat")
TGB_SLICES = 32
COLUMNS = (
    "log",
    "policy",
    "producers",
    "throughput_mb_s",
    "window_throughput_mb_s",
    "commit_success_rate",
    "window_commit_success_rate",
    "tgbs_committed",
    "attempts",
    "log_versions",
    "drain_s",
)
# The paper's five-hour ablation at 32 producers: MB/s and commit success per policy.
PAPER = {
    "dac": (431.9, 0.963),
    "incr": (110.5, 0.642),
    "fixed100": (107.5, 0.643),
    "aimd": (79.0, 0.955),
    "fixed10": (50.0, 0.131),
    "naive": (7.1, 0.090),
}
# Full mode: seconds per point. The manifest log's cost keeps growing, so its runs are
# the long ones (ten minutes each); on the flat log every policy settles within a minute.
FULL_S = {"manifest": 600.0, "flat": 120.0}
_SMOOTH = 10  # samples (one a second in full mode) averaged in the throughput curves


def logs(options: BenchOptions) -> tuple[str, ...]:
    return LOGS if options.store == "latency" else ("flat",)


def specs(options: BenchOptions, producers: int = 32, payload_bytes: int = 100_000) -> list[tuple[str, IngestSpec]]:
    # DAC's gap at 32 producers is tens of seconds (eq. 8), so only the full run shows
    # its steady state; the quick run checks that everything works end to end: 4 producers
    # in one worker process (run with processes=1), 1 s per policy.
    if options.quick:
        return [
            (name, IngestSpec(p, 4, payload_bytes, 1.0, tgb_slices=TGB_SLICES, sample_s=0.25))
            for name in logs(options)
            for p in POLICY_NAMES
        ]
    return [
        (name, IngestSpec(p, producers, payload_bytes, FULL_S[name], tgb_slices=TGB_SLICES))
        for name in logs(options)
        for p in POLICY_NAMES
    ]


def manifest_entry_bytes(slices: int) -> int:
    """One TGB's entry in the paper's manifest: our encoded descriptor of that TGB."""
    slice_bytes = 100_000 // slices
    descriptor = TGBDescriptor(
        producer="p000",
        epoch=1,
        source_offset=123_456,
        dp=slices,
        cp=1,
        kind="bytes",
        objects=["data/p000/e000001/000000123456-1f2e3d4c.0.bwb"],
        slices=[(0, i * slice_bytes, slice_bytes, 0x1234ABCD) for i in range(slices)],
        nbytes=100_000,
    )
    return len(msgspec.json.encode(descriptor))


def run(options: BenchOptions, progress: Any) -> BenchResult:
    runs = specs(options)
    task = progress.add_task("bench dac", total=len(runs))
    manifest = GrowingManifest(entry_bytes=manifest_entry_bytes(TGB_SLICES))
    results, series = [], {}
    for name, spec in runs:
        progress.update(task, description=f"dac: {name} log, {spec.policy} x{spec.producers}")
        cost = manifest if name == "manifest" else None
        with bench_store(options, f"dac-{name}-{spec.policy}", manifest=cost) as store:
            record, points = run_ingest(spec, store, processes=1 if options.quick else None)
        results.append({"log": name, **record})
        series[f"{name}:{spec.policy}"] = points
        progress.advance(task)
    config = {
        "policies": list(POLICY_NAMES),
        "logs": list(logs(options)),
        "duration_s_by_log": {name: s.duration_s for name, s in runs},
        "manifest": manifest.to_dict(),
        "paper": {p: {"throughput_mb_s": t, "commit_success_rate": s} for p, (t, s) in PAPER.items()},
        **ingest_config(runs[0][1], options),
    }
    return BenchResult(NAME, config, results, COLUMNS, summary=verdict(results), series=series)


def verdict(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for name in dict.fromkeys(r["log"] for r in results):
        by_policy = {r["policy"]: r for r in results if r["log"] == name}
        dac = by_policy["dac"]
        best = max((r for p, r in by_policy.items() if p != "dac"), key=lambda r: r["throughput_mb_s"])
        ratio = dac["throughput_mb_s"] / best["throughput_mb_s"] if best["throughput_mb_s"] else float("inf")
        lines += [
            f"{name} log: DAC {dac['throughput_mb_s']:.1f} MB/s = {ratio:.2f}x the best other policy "
            f"({best['policy']}, {best['throughput_mb_s']:.1f} MB/s); the paper's 431.9 MB/s = 3.91x (INCR's 110.5)",
            f"{name} log, commit success in the window: "
            + ", ".join(f"{p} {percent(r['window_commit_success_rate'])}" for p, r in by_policy.items())
            + " (paper: DAC 96.3%, AIMD 95.5%, INCR 64.2%, FIXED100 64.3%, FIXED10 13.1%, Naive 9.0%)",
            f"{name} log reached {max(r['log_steps'] for r in by_policy.values())} TGBs",
        ]
    return lines


def plot(result: BenchResult, figure: Any) -> None:
    names = result.config.get("logs", ["flat"])
    payload = result.config["payload_bytes"]
    figure.set_size_inches(16, 4.8 * len(names))
    axes = figure.subplots(len(names), 3, squeeze=False)
    colours = {p: f"C{i}" for i, p in enumerate(result.config["policies"])}
    for row, name in zip(axes, names, strict=True):
        for policy in result.config["policies"]:
            points = result.series.get(f"{name}:{policy}", result.series.get(policy, []))
            times, rates, success = _curves(points, payload)
            style = {"color": colours[policy], "linewidth": 2.5 if policy == "dac" else 1.2}
            row[0].plot(times, rates, label=policy, **style)
            row[1].plot(times, success, label=policy, **style)
        records = [r for r in result.results if r.get("log", "flat") == name]
        _bars(row[2], records, colours)
        smoothed = f"MB/s ({_SMOOTH} samples' average)"
        row[0].set(title=f"{name} log: committed throughput", xlabel="time (s)", ylabel=smoothed)
        row[1].set(title=f"{name} log: commit success (cumulative)", xlabel="time (s)", ylim=(0, 1.05))
        row[1].axhline(0.9, color="grey", linestyle=":", linewidth=1)
        row[0].legend(fontsize=8)
    figure.suptitle("DAC ablation, 32 producers, 100 KB TGBs of 32 slices (paper Fig. 7)")


def _curves(points: list[dict], payload: int, smooth: int = _SMOOTH) -> tuple[list[float], list[float], list[float]]:
    """Time, throughput averaged over ``smooth`` samples, and cumulative commit success."""
    times = [p["t_s"] for p in points]
    rates, success = [], []
    for i, p in enumerate(points):
        before = points[i - smooth] if i >= smooth else {"t_s": 0.0, "tgbs_committed": 0}
        dt = p["t_s"] - before["t_s"] or 1e-9
        rates.append((p["tgbs_committed"] - before["tgbs_committed"]) * payload / dt / 1e6)
        success.append(p["successes"] / p["attempts"] if p["attempts"] else float("nan"))
    return times, rates, success


def _bars(axes: Any, records: list[dict], colours: dict[str, str]) -> None:
    policies = [r["policy"] for r in records]
    bars = axes.bar(policies, [r["throughput_mb_s"] for r in records], color=[colours[p] for p in policies])
    axes.bar_label(
        bars, labels=[f"{r['throughput_mb_s']:.0f}\n{percent(r['window_commit_success_rate'], 0)}" for r in records]
    )
    axes.set(title="MB/s over the run; success in the window", ylabel="MB/s (drain included)")
    axes.margins(y=0.2)
