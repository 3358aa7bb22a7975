"""Benchmark results and the three files each benchmark writes: JSON, PNG, Markdown."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BenchOptions", "BenchResult", "machine", "markdown_table", "visibility_percentiles", "write_outputs"]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What the command line chose."""

    quick: bool = False
    store: str = "latency"  # "latency" (LatencyStore over memory), "local" (a temp dir), "s3" (moto) or "seaweedfs"
    seed: int = 0
    workload: str | None = None  # what a benchmark with several trains on (benchmarks.WORKLOADS); None: it has one


@dataclass(slots=True)
class BenchResult:
    """``results`` are flat records; ``series`` holds time series for the figure only."""

    benchmark: str
    config: dict[str, Any]
    results: list[dict[str, Any]]
    columns: Sequence[str]  # record keys shown in the Markdown table
    summary: list[str] = field(default_factory=list)  # verdict lines for the table's caption
    series: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"benchmark": self.benchmark, "config": self.config, "results": self.results, "series": self.series}


def machine() -> dict[str, Any]:
    """Facts about the machine that belong in every result's config."""
    return {"cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def markdown_table(records: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for record in records:
        lines.append("| " + " | ".join(_cell(record.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_outputs(result: BenchResult, out: Path, plot: Callable[[BenchResult, Any], None]) -> list[Path]:
    """Write ``NAME.json``, ``NAME.md`` and ``NAME.png`` into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / result.benchmark
    json_path, md_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")
    json_path.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    md = [f"# {result.benchmark}", "", *[f"- {line}" for line in result.summary], ""]
    md.append(markdown_table(result.results, result.columns))
    md_path.write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(11, 6), dpi=110)
    plot(result, figure)
    figure.tight_layout()
    figure.savefig(png_path)
    plt.close(figure)
    return [json_path, png_path, md_path]


def visibility_percentiles(latencies_s: list[float]) -> dict[str, float]:
    """P50 and P95 of append -> visible, in seconds (NaN when nothing became visible)."""
    if not latencies_s:
        return {"visibility_p50_s": math.nan, "visibility_p95_s": math.nan}
    ordered = sorted(latencies_s)

    def nearest_rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"visibility_p50_s": nearest_rank(0.50), "visibility_p95_s": nearest_rank(0.95)}
