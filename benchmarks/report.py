"""Benchmark results and the three files each benchmark writes: JSON, PNG, Markdown; and a
result read back from its JSON, to draw its figure again without measuring anything."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BenchOptions",
    "BenchResult",
    "draw_figure",
    "load_result",
    "machine",
    "markdown_table",
    "visibility_percentiles",
    "write_outputs",
]

# Every figure starts at this size; a plot that needs more room sets its own.
FIGURE_INCHES, FIGURE_DPI = (11.0, 6.0), 110


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What the command line chose."""

    quick: bool = False
    store: str = "latency"  # "latency" (LatencyStore over memory), "local" (a temp dir), "s3" (moto) or "seaweedfs"
    seed: int = 0
    workload: str | None = None  # what a benchmark with several trains on (benchmarks.WORKLOADS); None: it has one
    # Only for a benchmark that lists them in its module's SWEEP_OPTIONS (``bench producers``):
    profile: bool = False  # a CPU profile of its processes, written beside the JSON
    producers: tuple[int, ...] | None = None  # producer counts instead of the plan's
    payloads: tuple[int, ...] | None = None  # payload sizes (bytes) instead of the plan's
    rounds: int = 1  # each point this many times, its systems interleaved; the median run is reported


@dataclass(slots=True)
class BenchResult:
    """``results`` are flat records; ``series`` holds time series for the figure only."""

    benchmark: str
    config: dict[str, Any]
    results: list[dict[str, Any]]
    columns: Sequence[str]  # record keys shown in the Markdown table
    summary: list[str] = field(default_factory=list)  # verdict lines for the table's caption
    series: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    # More files to write beside the JSON, by name (``NAME-profile.json``): their text.
    attachments: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"benchmark": self.benchmark, "config": self.config, "results": self.results, "series": self.series}

    @classmethod
    def from_json(cls, data: Any, source: str) -> BenchResult:
        """The result ``to_json`` wrote, read back (``source`` names the file in errors).

        The JSON keeps no ``columns`` or ``summary`` (they live in the Markdown), so both come
        back empty: enough to draw the figure again. ConfigError if ``data`` is not a result.
        """
        from batchweave.errors import ConfigError

        shape = {"benchmark": str, "config": dict, "results": list}
        if not isinstance(data, dict) or not all(isinstance(data.get(k), t) for k, t in shape.items()):
            raise ConfigError(
                f"{source} is not a benchmark's result: it needs a JSON object with 'benchmark' (a name), "
                "'config' (an object) and 'results' (a list), as `batchweave bench NAME --out DIR` writes NAME.json"
            )
        if not all(isinstance(record, dict) for record in data["results"]):
            raise ConfigError(f"{source}: every entry of 'results' must be a JSON object (a record)")
        series = data.get("series") or {}  # results written before series existed have none
        if not isinstance(series, dict):
            raise ConfigError(f"{source}: 'series' must be a JSON object (name -> list of points)")
        return cls(data["benchmark"], data["config"], data["results"], columns=(), series=series)


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


Plot = Callable[[BenchResult, Any], None]


def write_outputs(result: BenchResult, out: Path, plot: Plot) -> list[Path]:
    """Write ``NAME.json``, ``NAME.md`` and ``NAME.png`` into ``out``, and the result's
    attachments beside them; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / result.benchmark
    json_path, md_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")
    json_path.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    md = [f"# {result.benchmark}", "", *[f"- {line}" for line in result.summary], ""]
    md.append(markdown_table(result.results, result.columns))
    md_path.write_text("\n".join(md) + "\n")
    draw_figure(result, plot, png_path)
    attached = []
    for name, text in result.attachments.items():
        if Path(name).name != name:
            raise ValueError(f"an attachment is a file name beside the JSON, not a path: {name!r}")
        path = out / name
        path.write_text(text)
        attached.append(path)
    return [json_path, png_path, md_path, *attached]


def draw_figure(result: BenchResult, plot: Plot, png_path: Path) -> Path:
    """``plot`` the result onto a new figure and save it as ``png_path``.

    The PNG is written beside its final name and renamed over it, so a plot that fails
    leaves the figure already there (a committed one, when re-drawing) as it was.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=FIGURE_INCHES, dpi=FIGURE_DPI)
    partial = png_path.with_name(f".{png_path.name}.partial")
    try:
        plot(result, figure)
        if figure.get_layout_engine() is None:  # a plot that chose a layout (constrained) keeps it
            figure.tight_layout()
        figure.savefig(partial, format="png")
        partial.replace(png_path)
    finally:
        plt.close(figure)
        partial.unlink(missing_ok=True)
    return png_path


def load_result(json_path: Path) -> BenchResult:
    """The result a benchmark wrote to ``json_path`` (its ``NAME.json``).

    ConfigError if the file is absent, unreadable, not JSON, or not a benchmark's result.
    """
    from batchweave.errors import ConfigError

    try:
        text = json_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{json_path}: no such file; name the NAME.json a benchmark wrote (docs/benchmarks/<folder>/NAME.json)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{json_path} cannot be read ({exc}); name a readable NAME.json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{json_path} is not JSON ({exc}); name the NAME.json a benchmark wrote") from None
    return BenchResult.from_json(data, source=str(json_path))


def visibility_percentiles(latencies_s: list[float]) -> dict[str, float]:
    """P50 and P95 of append -> visible, in seconds (NaN when nothing became visible)."""
    if not latencies_s:
        return {"visibility_p50_s": math.nan, "visibility_p95_s": math.nan}
    ordered = sorted(latencies_s)

    def nearest_rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"visibility_p50_s": nearest_rank(0.50), "visibility_p95_s": nearest_rank(0.95)}
