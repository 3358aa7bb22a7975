"""``python -m batchweave.testing.simulation``: run seeds, replay one, shrink it.

    python -m batchweave.testing.simulation --seeds 0-99 --minutes 1
    python -m batchweave.testing.simulation --replay 55 --trace 40
    python -m batchweave.testing.simulation --replay 55 --shrink
    python -m batchweave.testing.simulation --replay 55 --shrink --save shrunk.json
    python -m batchweave.testing.simulation --choices shrunk.json --story --trace 0
    python -m batchweave.testing.simulation --repin tests/simulation/wrong-step.json

Prints the seeds run, the store operations explored (per minute) and every violation
with its seed. A seed is replayed exactly: the same seed, the same run. ``--repin``
rewrites a pinned schedule whose replay no longer reaches its point (``pins``) with the
first seed of its shape that does.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from batchweave.testing.simulation.choices import Choices
from batchweave.testing.simulation.pins import Point, find
from batchweave.testing.simulation.run import Result, simulate
from batchweave.testing.simulation.shrink import format_trace, shrink
from batchweave.testing.simulation.world import SHAPES


def _seed_range(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchweave.testing.simulation",
        description="Deterministic simulation of the BatchWeave protocol: explore seeds, replay one, shrink it.",
    )
    parser.add_argument("--seeds", type=_seed_range, default=range(0, 100), help="seeds to run, e.g. 0-99")
    parser.add_argument("--minutes", type=float, default=None, help="stop starting new seeds after this long")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixed", help="the actors of a run")
    parser.add_argument("--replay", type=int, default=None, help="run this one seed and show it")
    parser.add_argument("--choices", default=None, help="replay a schedule saved with --save")
    parser.add_argument("--shrink", action="store_true", help="shrink the replayed run's first violation")
    parser.add_argument("--shrink-seconds", type=float, default=120.0)
    parser.add_argument("--trace", type=int, default=60, help="operations of the trace to show (0: all)")
    parser.add_argument(
        "--story", action="store_true", help="show only log writes, crashes and the culprits' operations"
    )
    parser.add_argument("--save", default=None, help="write the (shrunk) schedule to this JSON file")
    parser.add_argument("--repin", default=None, help="pin anew the schedule in this JSON file (its point, shape)")
    args = parser.parse_args(argv)
    if args.repin is not None:
        return _repin(args)
    if args.replay is not None or args.choices is not None:
        return _replay(args)
    return _explore(args)


def _explore(args: argparse.Namespace) -> int:
    config = SHAPES[args.shape]
    started = time.perf_counter()
    runs = ops = unfinished = 0
    by_kind: dict[str, list[int]] = collections.defaultdict(list)
    for seed in args.seeds:
        if args.minutes is not None and time.perf_counter() - started > 60 * args.minutes:
            break
        result = simulate(Choices(seed=seed), config)
        runs += 1
        ops += result.ops
        unfinished += not result.finished
        for violation in result.violations:
            by_kind[violation.kind].append(seed)
            print(f"seed {seed}: {violation}", flush=True)
    wall = time.perf_counter() - started
    print(
        f"{runs} seeds (schedules) run in {wall:.1f} s: {ops} store operations, "
        f"{ops / wall * 60:,.0f} per minute, {runs / wall * 60:,.0f} schedules per minute"
        + (f", {unfinished} hit max_ops" if unfinished else "")
    )
    for kind, seeds in sorted(by_kind.items()):
        print(f"  {kind}: {len(seeds)} seed(s), e.g. {seeds[:10]}")
    return 1 if by_kind else 0


def _replay(args: argparse.Namespace) -> int:
    config = SHAPES[args.shape]
    if args.choices is not None:
        with open(args.choices) as f:
            pinned = json.load(f)
        config = SHAPES[pinned["shape"]]
        result = simulate(Choices(replay=pinned["choices"]), config)
    else:
        result = simulate(Choices(seed=args.replay), config)
    _show(result, args)
    if args.shrink and result.violations:
        shrunk = shrink(result, config, budget_s=args.shrink_seconds)
        print(
            f"\nshrunk from {len(result.choices)} to {len(shrunk.choices)} choices, {len(result.trace)} to "
            f"{len(shrunk.trace)} trace entries:"
        )
        _show(shrunk, args)
        print("choices:", json.dumps(shrunk.choices, separators=(",", ":")))
        result = shrunk
    if args.save:
        with open(args.save, "w") as f:
            pinned = {
                "shape": args.shape,
                "seed": args.replay,
                "violation": str(result.violations[0]) if result.violations else None,
                "choices": result.choices,
            }
            f.write(json.dumps(pinned, separators=(",", ":")) + "\n")
    return 1 if result.violations else 0


def _repin(args: argparse.Namespace) -> int:
    """Replace a pinned schedule's choices with the first of ``--seeds`` (of its shape) that
    reaches its point and breaks nothing; what it once found stays as its history."""
    with open(args.repin) as f:
        pinned = json.load(f)
    point = Point(**pinned["point"])
    found = find(point, SHAPES[pinned["shape"]], args.seeds)
    if found is None:
        print(f"no seed of {args.seeds} reaches {point.describe()} on shape {pinned['shape']!r}; try more --seeds")
        return 1
    seed, result = found
    pinned.update(seed=seed, choices=result.choices)
    with open(args.repin, "w") as f:
        f.write(json.dumps(pinned, separators=(",", ":")) + "\n")
    print(f"{args.repin}: {pinned['shape']} seed {seed} reaches {point.describe()}")
    return 0


def _show(result: Result, args: argparse.Namespace) -> None:
    print(format_trace(result, args.trace or None, story=args.story))
    print(
        f"{result.ops} store operations, {result.virtual_s:.0f} virtual s, {result.wall_s:.2f} s, "
        f"{len(result.choices)} choices, {result.notes}"
    )
    for violation in result.violations:
        print(violation)


if __name__ == "__main__":
    sys.exit(main())
