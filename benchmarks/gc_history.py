"""``bench gc-history``: what one garbage collection costs as the log's history grows.

A namespace of N versions (one TGB each, no checkpoint: nothing may be reclaimed, so
every version stays) on the request-counting store with no latency, and three
collections: the first (no summary yet: it reads every version), a repeat with nothing
new, and one after ten more versions. Requests are counted by key class; the target
(issue 29) is a collection's cost at 100,000 versions within 1.3x of its cost at 1,000.
Before the summaries (``batchweave.lifecycle.gcsummary``) every run read every version
not reclaimed: 2,018 requests at 2,000 versions for a run with nothing to do.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from batchweave import collect_garbage
from batchweave.commit.policies import Manual
from batchweave.producer import Producer
from batchweave.store import open_store
from benchmarks.report import BenchOptions, BenchResult, machine
from benchmarks.scale_count import LOG_VERSION, CountingStore, Tally, by_class
from benchmarks.scale_measure import INSTANT

NAME = "gc-history"
COLUMNS = ("versions", "run", "requests", "log_version_reads", "seconds")
MORE = 10  # versions committed between the repeat and the last run
TARGET = 1.3


def run(options: BenchOptions, progress: Any) -> BenchResult:
    sizes = (100, 400) if options.quick else (1_000, 10_000, 100_000)
    task = progress.add_task("bench gc-history", total=len(sizes))
    results: list[dict[str, Any]] = []
    for versions in sizes:
        progress.update(task, description=f"gc-history: {versions:,} versions")
        results.extend(collections_at(versions))
        progress.advance(task)
    config = {"quick": options.quick, "store": "memory, no latency, requests counted", "machine": machine()}
    return BenchResult(NAME, config, results, COLUMNS, verdict(results))


def verdict(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    sizes = sorted({r["versions"] for r in results})
    for run in ("repeat, nothing new", f"after {MORE} more versions"):
        cost = {r["versions"]: r["requests"] for r in results if r["run"] == run}
        ratio = cost[sizes[-1]] / cost[sizes[0]]
        met = "met" if ratio <= TARGET else "NOT met"
        lines.append(
            f"{run}: {cost[sizes[-1]]} requests at {sizes[-1]:,} versions, {cost[sizes[0]]} at {sizes[0]:,} "
            f"({ratio:.2f}x; target <= {TARGET}x: {met})"
        )
    first = {r["versions"]: r["requests"] for r in results if r["run"] == "first"}
    lines.append(f"first run (no summary yet): {first[sizes[-1]]} requests at {sizes[-1]:,} versions")
    return lines


def collections_at(versions: int) -> list[dict[str, Any]]:
    url = f"memory://gc-history-{uuid.uuid4().hex}"
    _commit(url, versions)
    rows = [_collect(url, versions, "first"), _collect(url, versions, "repeat, nothing new")]
    _commit(url, MORE)
    rows.append(_collect(url, versions, f"after {MORE} more versions"))
    return rows


def _commit(url: str, count: int) -> None:
    """``count`` versions of one small TGB each (after a claim, the first time)."""
    with Producer(open_store(url), "p", dp=1, commit_policy=Manual(), pack_steps=1) as producer:
        for _ in range(count):
            producer.append([{"x": np.zeros(4, dtype=np.float32)}])
            producer.flush()


def _collect(url: str, versions: int, run: str) -> dict[str, Any]:
    tally = Tally()
    started = time.perf_counter()
    collect_garbage(CountingStore(url, tally, "gc", INSTANT), grace_s=3600.0)
    seconds = time.perf_counter() - started
    counts = by_class(tally.requests)
    return {
        "versions": versions,
        "run": run,
        "requests": len(tally.requests),
        "log_version_reads": counts[LOG_VERSION],
        "seconds": seconds,
        **{f"c:{name}": count for name, count in sorted(counts.items())},
    }


def plot(result: BenchResult, figure: Any) -> None:
    axes = figure.subplots(1, 1)
    for run in dict.fromkeys(r["run"] for r in result.results):
        rows = [r for r in result.results if r["run"] == run]
        axes.plot([r["versions"] for r in rows], [r["requests"] for r in rows], marker="o", label=run)
    axes.set(xscale="log", yscale="log", xlabel="log versions", ylabel="requests of one collection")
    axes.set_title("garbage collection's cost against the history")
    axes.legend()
