"""``batchweave bench NAME [--quick] --out DIR``: benchmarks that write JSON, PNG and Markdown.

Each benchmark is a module here with ``run(options, progress) -> BenchResult`` and
``plot(result, figure)``; ``report.write_outputs`` turns the result into
``DIR/NAME.json`` (``{"benchmark", "config", "results"}``), ``DIR/NAME.png`` and
``DIR/NAME.md``. Benchmarks measure ratios between things run side by side in one
process, since absolute times on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import importlib

__all__ = ["BENCHMARKS", "load"]

# name -> module under batchweave.bench (imported lazily: matplotlib is a dev extra)
BENCHMARKS = {
    "dac": "dac",
    "producers": "producers",
    "commit-cost": "commit_cost",
    "exactly-once": "exactly_once",
    "lifecycle": "lifecycle",
    "pool-shrink": "pool_shrink",
    "consumers": "consumers",
    "e2e": "e2e",
    "overhead": "overhead",
}


def load(name: str):
    """The benchmark module for ``name``."""
    return importlib.import_module(f"batchweave.bench.{BENCHMARKS[name]}")
