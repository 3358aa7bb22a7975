"""What a durable put costs on a local directory: ``python -m benchmarks.fsync_cost [--puts N] [--dir D]``.

Times ``Store.put_if_absent`` of a 1 KB object (the size of a log version) and an 800 KB
one (a TGB) on a local directory, with ``fsync`` on (the default) and off
(``storage_options={"fsync": False}``), and obstore's own local put (which fsyncs
nothing, what BatchWeave did before issue 18) for reference. The three ways take turns
put by put, so that a change in the disk's load hits them alike. Prints the median and
95th percentile of microseconds per put as a Markdown table. Not one of ``batchweave
bench``'s benchmarks: it measures the disk it runs on, not a ratio that carries over.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import obstore
from obstore.store import LocalStore

from batchweave.store import open_store

SIZES = {"1 KB (log version)": 1_000, "800 KB (TGB)": 800_000}


def _ways(root: Path) -> dict[str, Callable[[str, bytes], None]]:
    durable = open_store(root / "fsync")
    fast = open_store(root / "no-fsync", storage_options={"fsync": False})
    (root / "obstore").mkdir()
    plain = LocalStore(prefix=str(root / "obstore"))
    return {
        "fsync (default)": durable.put_if_absent,
        "fsync=False": fast.put_if_absent,
        "obstore LocalStore": lambda key, data: obstore.put(plain, key, data, mode="create"),
    }


def measure(root: Path, puts: int) -> dict[tuple[str, str], list[float]]:
    """Microseconds of each put, per (size, way)."""
    ways = _ways(root)
    times: dict[tuple[str, str], list[float]] = {}
    for size_name, size in SIZES.items():
        body = bytes(size)
        for index in range(puts):
            # A new producer epoch directory every 100 puts, as a producer makes them.
            key = f"data/p{size}/e{index // 100:06d}/{index:020d}.bwb"
            for way, put in ways.items():
                started = time.perf_counter()
                put(key, body)
                times.setdefault((size_name, way), []).append((time.perf_counter() - started) * 1e6)
    return times


def table(times: dict[tuple[str, str], list[float]]) -> str:
    lines = ["| object | put | median us | p95 us |", "|---|---|---:|---:|"]
    for (size_name, way), samples in times.items():
        p95 = statistics.quantiles(samples, n=20)[-1]
        lines.append(f"| {size_name} | {way} | {statistics.median(samples):,.0f} | {p95:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=300, help="puts per object size and way")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        print(table(measure(Path(scratch), args.puts)))


if __name__ == "__main__":
    main()
