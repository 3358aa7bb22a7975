"""``bench producer-scale``: DAC against group commit as the pool grows, and what each
producer's CPU costs.

Two sets of points, each run for DAC and for group commit:

- *targets*: 8 and 32 producers appending flat out, and 128 producers paced at 0.25 s
  per TGB (as in ``bench producers``: 128 flat out on 2 cores measure the machine).
  Group commit's targets are P95 visibility <= 2 s, commit success >= 95% and
  throughput no lower than DAC's at each of them.
- *scale*: 8, 32 and 128 producers all paced at 0.25 s per TGB, so every producer does
  the same work of its own and what grows with the pool is what it does for the others:
  following the log (every producer reads every version) and, in group commit, reading
  intents at its turns. Two CPU figures per producer per second: the producer
  processes' whole CPU in the window (user + system, ``getrusage``), and what following
  the run's log costs one producer (one journal reads, decodes, applies and proves every
  version after the run, alone). The second is fitted as ``a + b * N`` and
  extrapolated to 1,024 producers.

Visibility is read from the log (hand-over to the ``committed_at`` of the version that
holds the TGB), as in ``bench producers``.
"""

from __future__ import annotations

from typing import Any

from benchmarks.ingest import IngestSpec, bench_store, percent, run_ingest, store_model
from benchmarks.report import BenchOptions, BenchResult, machine

NAME = "producer-scale"
COLUMNS = (
    "set",
    "policy",
    "producers",
    "pace_s",
    "throughput_mb_s",
    "steady_commit_success_rate",
    "commit_success_rate",
    "tgbs_committed",
    "versions_per_s",
    "visibility_p50_s",
    "visibility_p95_s",
    "cpu_per_producer_s_per_s",
    "follow_cpu_s_per_s",
    "error",
)
PAYLOAD_BYTES = 100_000
PACE_S = 0.25
EXTRAPOLATE_TO = 1024


def plan(options: BenchOptions) -> dict[str, Any]:
    if options.quick:
        return {"points": [("scale", 2, PACE_S, 1.0)], "policies": ["dac", "group"]}
    targets = [("target", 8, 0.0, 10.0), ("target", 32, 0.0, 10.0), ("target", 128, PACE_S, 30.0)]
    scale = [("scale", 8, PACE_S, 15.0), ("scale", 32, PACE_S, 15.0)]  # 128 paced: the target point
    return {"points": targets + scale, "policies": ["dac", "group"]}


def run(options: BenchOptions, progress: Any) -> BenchResult:
    sweep = plan(options)
    task = progress.add_task("bench producer-scale", total=len(sweep["points"]) * len(sweep["policies"]))
    results: list[dict[str, Any]] = []
    for kind, producers, pace_s, duration_s in sweep["points"]:
        for policy in sweep["policies"]:
            progress.update(task, description=f"producer-scale: {policy} x{producers}, pace {pace_s} s")
            spec = IngestSpec(policy, producers, PAYLOAD_BYTES, duration_s, pace_s=pace_s)
            with bench_store(options, f"scale-{policy}") as store:
                record, _ = run_ingest(spec, store)
            seconds = duration_s + record["drain_s"]
            results.append(
                {**record, "set": kind, "store": options.store, "versions_per_s": record["log_versions"] / seconds}
            )
            progress.advance(task)
    fits = cpu_fits(results)
    config = {
        **sweep,
        "payload_bytes": PAYLOAD_BYTES,
        "tgb_slices": 8,
        "quick": options.quick,
        "store": store_model(options),
        "machine": machine(),
        "cpu_fit": fits,
    }
    return BenchResult(NAME, config, results, COLUMNS, summary=verdict(results, fits))


def paced(results: list[dict[str, Any]], policy: str) -> list[dict[str, Any]]:
    """The points where every producer is paced alike, one per pool size."""
    rows = {r["producers"]: r for r in results if r["policy"] == policy and r["pace_s"] == PACE_S}
    return [rows[n] for n in sorted(rows)]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b * x``; a flat line through one point."""
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def cpu_fits(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per policy, on the paced points: what following the log costs one producer
    (``follow_cpu_s_per_s``) fitted as ``a + b * N``, and its value at ``EXTRAPOLATE_TO``
    producers, per producer and as cores for the whole pool. The producers' whole CPU
    (``cpu_per_producer_s_per_s``) is reported beside it, not extrapolated: on a shared
    2-core machine it falls as the pool grows (the server and the other producers take
    the cores), which says nothing of a pool on its own hosts."""
    fits = {}
    for policy in sorted({r["policy"] for r in results}):
        rows = paced(results, policy)
        if not rows:
            continue
        a, b = fit_line([r["producers"] for r in rows], [r["follow_cpu_s_per_s"] for r in rows])
        at = a + b * EXTRAPOLATE_TO
        fits[policy] = {
            "follow_a": a,
            "follow_b_per_producer": b,
            f"follow_at_{EXTRAPOLATE_TO}": at,
            f"follow_cores_{EXTRAPOLATE_TO}": at * EXTRAPOLATE_TO,
        }
    return fits


def verdict(results: list[dict[str, Any]], fits: dict[str, dict[str, float]]) -> list[str]:
    lines = []
    for row in (r for r in results if r["set"] == "target" and r["policy"] == "group"):
        dac = next(
            (
                r
                for r in results
                if r["set"] == "target" and r["policy"] == "dac" and r["producers"] == row["producers"]
            ),
            None,
        )
        steady = row["steady_commit_success_rate"]  # None: no attempt after the warm-up
        met = row["visibility_p95_s"] <= 2 and steady is not None and steady >= 0.95
        ratio = row["throughput_mb_s"] / dac["throughput_mb_s"] if dac and dac["throughput_mb_s"] else float("nan")
        against = f" (DAC {dac['visibility_p95_s']:.2f} s)" if dac else ""
        lines.append(
            f"x{row['producers']} pace {row['pace_s']} s: group P95 visible {row['visibility_p95_s']:.2f} s"
            f"{against}, success {percent(steady, 0)}, "
            f"throughput {ratio:.2f}x DAC; targets {'met' if met and ratio >= 1 else 'not met'}"
        )
    for policy, fit in fits.items():
        lines.append(
            f"{policy}: following the log costs a paced producer {fit['follow_a']:.5f} + "
            f"{fit['follow_b_per_producer']:.2e} x N CPU s/s; at {EXTRAPOLATE_TO} producers "
            f"{fit[f'follow_at_{EXTRAPOLATE_TO}']:.4f} s/s each, "
            f"{fit[f'follow_cores_{EXTRAPOLATE_TO}']:.1f} cores in all"
        )
    return lines


def plot(result: BenchResult, figure: Any) -> None:
    left, right = figure.subplots(1, 2)
    for policy in sorted({r["policy"] for r in result.results}):
        rows = [r for r in result.results if r["policy"] == policy]
        targets = sorted((r["producers"], r["visibility_p95_s"]) for r in rows if r["set"] == "target")
        if targets:
            left.plot(*zip(*targets, strict=True), "o-", label=policy)
        for key, style, what in (
            ("cpu_per_producer_s_per_s", "o-", "all"),
            ("follow_cpu_s_per_s", "s--", "log following"),
        ):
            scale = sorted((r["producers"], r[key]) for r in paced(rows, policy))
            if scale:
                right.plot(*zip(*scale, strict=True), style, label=f"{policy}: {what}")
    left.axhline(2.0, color="grey", linestyle=":", label="target 2 s")
    left.set(title="P95 visibility (8, 32 flat out; 128 paced)", xlabel="producers", ylabel="s", xscale="log")
    right.set(
        title=f"CPU per producer, paced {PACE_S} s/TGB",
        xlabel="producers",
        ylabel="CPU s / s",
        xscale="log",
        yscale="log",
    )
    left.legend(fontsize="small")
    right.legend(fontsize="small")
