"""``bench shuffle-quality``: how well our shuffles and weighted mixing mix, beside Streaming's and Grain's.

Pure computation, no store: every order is built in this process and measured the same way.

Shuffles (``kind: shuffle``): ``n`` samples in shards of ``shard`` samples, numbered in
shard order, so samples ``i`` and ``i + 1`` are neighbours in the source (the same shard,
usually the same document or recording). For each algorithm's order of one epoch:

- ``mean_distance`` / ``median_distance``: how far apart neighbours ``i`` and ``i + 1`` end
  up in the output, divided by ``n``. Uniformly random positions give 1/3 and
  ``1 - 1/sqrt(2)`` (0.293); no shuffle gives ``1/n``.
- ``within_64``: the fraction of neighbours that land within 64 positions of each other
  (random: about ``128 / n``).
- ``shards_per_step``: distinct shards in a step of 1,024 consecutive positions, the reading
  cost: a global shuffle touches a shard per sample, a shard-local one few shards.

Algorithms: ours (``IndexPermutation``: a global index shuffle; ``ShardedSource``: shard
order shuffled, and the samples of one shard, or of 16 shards held in memory together,
shuffled), Grain's ``index_shuffle`` (4 rounds, as its
``MapDataset.shuffle``), MosaicML Streaming's ``get_shuffle`` with ``py1e``, ``py1br``,
``py1s`` and ``naive``, one canonical node, and ``shuffle_block_size = n / 64`` (what its
default block of 4M samples is to a data set of 256M samples), and no shuffle.

Mixing (``kind: mixing``): sources with weights, ``positions`` positions; for windows of 64
and 1,024 positions, the worst deviation over every window and source of the source's
count from ``window * weight``. Ours is the Tijdeman schedule (``batchweave.mixing``: below
2 for every window); Grain's ``MapDataset.mix`` is deterministic too; LitData's
``CombinedStreamingDataset`` draws a source per sample (``random.choices``); Streaming mixes
``Stream``s by shuffling their proportioned samples together (``py1e`` here).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np

from batchweave.mixing import Mixture
from batchweave.shuffle import IndexedSource, IndexPermutation, ShardedSource, derive_key
from benchmarks.report import BenchOptions, BenchResult, machine

NAME = "shuffle-quality"
COLUMNS = (
    "kind",
    "algorithm",
    "mean_distance",
    "median_distance",
    "within_64",
    "shards_per_step",
    "weights",
    "worst_deviation_64",
    "worst_deviation_1024",
)
STEP = 1024  # positions per step, for shards_per_step
GROUP = 16  # shards_in_memory of the second ShardedSource
WEIGHT_SETS = ((0.5, 0.3, 0.2), (0.7, 0.2, 0.07, 0.03))
STREAMING_ALGORITHMS = ("py1e", "py1br", "py1s", "naive")


def sizes(options: BenchOptions) -> dict[str, int]:
    if options.quick:
        return {"n": 1 << 14, "shard": 1 << 8, "positions": 1 << 14}
    return {"n": 1 << 20, "shard": 1 << 12, "positions": 1 << 20}


def run(options: BenchOptions, progress: Any) -> BenchResult:
    scale = sizes(options)
    n, shard = scale["n"], scale["shard"]
    shard_sizes = np.full(n // shard, shard, dtype=np.int64)
    orders = shuffle_orders(n, shard_sizes, options.seed)
    mixers = mixing_orders(scale["positions"], options.seed)
    task = progress.add_task(f"bench {NAME}", total=len(orders) + len(mixers))
    results = []
    for name, build in orders.items():
        results.append({"kind": "shuffle", "algorithm": name, **shuffle_quality(build(), shard)})
        progress.advance(task)
    for (name, weights), build in mixers.items():
        results.append(
            {"kind": "mixing", "algorithm": name, "weights": "/".join(map(str, weights)), **mixing_quality(build())}
        )
        progress.advance(task)
    config = {
        "quick": options.quick,
        "store": "none (pure computation)",
        "seed": options.seed,
        "machine": machine(),
        **scale,
        "streaming_block_size": n // 64,
        "streaming_canonical_nodes": 1,
        "grain_rounds": 4,
        "step_positions": STEP,
        "weight_sets": [list(w) for w in WEIGHT_SETS],
    }
    return BenchResult(NAME, config, results, COLUMNS, summary=summary(results))


def shuffle_orders(n: int, shard_sizes: np.ndarray, seed: int) -> dict[str, Callable[[], np.ndarray]]:
    """Algorithm -> a function giving its order of one epoch (sample ids by output position)."""
    orders: dict[str, Callable[[], np.ndarray]] = {
        "batchweave index (IndexPermutation)": lambda: IndexPermutation(n, derive_key(seed, "bench", 0))(np.arange(n)),
        "batchweave sharded (ShardedSource)": _sharded(shard_sizes, seed, 1),
        f"batchweave sharded, {GROUP} shards in memory": _sharded(shard_sizes, seed, GROUP),
        "grain index_shuffle": lambda: grain_order(n, seed),
    }
    for algorithm in STREAMING_ALGORITHMS:
        orders[f"streaming {algorithm}"] = _streaming(algorithm, shard_sizes, seed, n // 64)
    orders["no shuffle"] = lambda: np.arange(n)
    return orders


def _sharded(shard_sizes: np.ndarray, seed: int, group: int) -> Callable[[], np.ndarray]:
    def order() -> np.ndarray:
        source = ShardedSource("bench", tuple(shard_sizes.tolist()), shards_in_memory=group)
        return source.indices(seed, 0, np.arange(source.samples))

    return order


def grain_order(n: int, seed: int) -> np.ndarray:
    """Grain's index_shuffle gives each position's sample, as its MapDataset.shuffle reads it."""
    from grain.experimental import index_shuffle

    return np.fromiter((index_shuffle(i, n - 1, seed, 4) for i in range(n)), dtype=np.int64, count=n)


def _streaming(algorithm: str, shard_sizes: np.ndarray, seed: int, block: int) -> Callable[[], np.ndarray]:
    def order() -> np.ndarray:
        return streaming_shuffle(algorithm, shard_sizes, seed, block)

    return order


def streaming_shuffle(algorithm: str, shard_sizes: np.ndarray, seed: int, block: int) -> np.ndarray:
    # ``import streaming`` needs transformers and torchvision, absent here; the shuffle
    # module itself needs only numpy, so the peer benchmark's stand-ins for those packages
    # (benchmarks.streaming_peer.import_streaming) are all it takes.
    from benchmarks.streaming_peer import import_streaming

    import_streaming()
    from streaming.base.shuffle import get_shuffle

    return np.asarray(get_shuffle(algorithm, shard_sizes, 1, seed, 0, block), dtype=np.int64)


def shuffle_quality(order: np.ndarray, shard: int) -> dict[str, float]:
    n = len(order)
    assert np.array_equal(np.sort(order), np.arange(n)), "not a permutation"
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)  # where each sample landed
    distance = np.abs(np.diff(position))
    steps = (order[: n - n % STEP] // shard).reshape(-1, STEP)
    shards_per_step = np.mean([len(np.unique(row)) for row in steps])
    return {
        "mean_distance": float(distance.mean() / n),
        "median_distance": float(np.median(distance) / n),
        "within_64": float(np.mean(distance <= 64)),
        "shards_per_step": float(shards_per_step),
    }


def mixing_orders(positions: int, seed: int) -> dict[tuple[str, tuple[float, ...]], Callable[[], tuple]]:
    """(algorithm, weights) -> a function giving (source of each position, normalised weights)."""
    out: dict[tuple[str, tuple[float, ...]], Callable[[], tuple]] = {}
    for weights in WEIGHT_SETS:
        share = np.array(weights) / sum(weights)
        out["batchweave Mixture", weights] = _bound(lambda w: (ours_mix(w, positions, seed), w), share)
        out["grain MapDataset.mix", weights] = _bound(lambda w: (grain_mix(w, positions), w), share)
        out["litdata random choice", weights] = _bound(lambda w: (random_mix(w, positions, seed), w), share)
        out["streaming streams (py1e)", weights] = _bound(lambda w: (streaming_mix(w, positions, seed), w), share)
    return out


def _bound(function: Callable[[np.ndarray], tuple], share: np.ndarray) -> Callable[[], tuple]:
    return lambda: function(share)


def ours_mix(share: np.ndarray, positions: int, seed: int) -> np.ndarray:
    sources = [IndexedSource(f"s{i}", positions, weight=float(w)) for i, w in enumerate(share)]
    return Mixture(sources, seed).source_positions(np.arange(positions))[0]


def grain_mix(share: np.ndarray, positions: int) -> np.ndarray:
    import grain

    datasets = [grain.MapDataset.source([i] * (positions + 1)) for i in range(len(share))]
    mixed = grain.MapDataset.mix(datasets, share.tolist())
    return np.fromiter((mixed[i] for i in range(positions)), dtype=np.int64, count=positions)


def random_mix(share: np.ndarray, positions: int, seed: int) -> np.ndarray:
    rng = random.Random(seed)  # LitData: self._rng.choices(indexes, weights=weights, k=1) per sample
    return np.array(rng.choices(range(len(share)), weights=share.tolist(), k=positions), dtype=np.int64)


def streaming_mix(share: np.ndarray, positions: int, seed: int) -> np.ndarray:
    """Streams proportioned to ``share`` (whole shards of 1/256 of the positions each), their
    samples shuffled together by py1e as one epoch of a StreamingDataset with several streams."""
    shard = max(positions // 256, 1)
    counts = [max(1, round(w * positions / shard)) for w in share]
    shard_sizes = np.full(sum(counts), shard, dtype=np.int64)
    source_of_shard = np.repeat(np.arange(len(share)), counts)
    order = streaming_shuffle("py1e", shard_sizes, seed, max(positions // 64, 1))
    return source_of_shard[order // shard][:positions]


def mixing_quality(built: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    sources, share = built
    counts = np.zeros((len(sources) + 1, len(share)))
    counts[1:] = np.cumsum(np.eye(len(share))[sources], axis=0)
    out = {}
    for window in (64, 1024):
        got = counts[window:] - counts[:-window]
        out[f"worst_deviation_{window}"] = float(np.abs(got - window * share).max())
    return out


def summary(results: list[dict[str, Any]]) -> list[str]:
    shuffles = {r["algorithm"]: r for r in results if r["kind"] == "shuffle"}
    ours = shuffles["batchweave index (IndexPermutation)"]
    lines = [
        f"neighbours' mean distance / n: ours {ours['mean_distance']:.3f} (random: 0.333), "
        + ", ".join(
            f"{name} {row['mean_distance']:.3f}" for name, row in shuffles.items() if not name.startswith("batchweave")
        )
    ]
    for name in ("batchweave sharded (ShardedSource)", f"batchweave sharded, {GROUP} shards in memory"):
        sharded = shuffles[name]
        lines.append(
            f"{name}: {sharded['shards_per_step']:.1f} shards per step of {STEP} (global index shuffle: "
            f"{ours['shards_per_step']:.0f}); neighbours within 64: {sharded['within_64']:.2f}, "
            f"mean distance {sharded['mean_distance']:.4f}"
        )
    for weights in WEIGHT_SETS:
        label = "/".join(map(str, weights))
        rows = {r["algorithm"]: r for r in results if r["kind"] == "mixing" and r["weights"] == label}
        lines.append(
            f"weights {label}, worst share deviation over 1024 positions: "
            + ", ".join(f"{name} {row['worst_deviation_1024']:.1f}" for name, row in rows.items())
        )
    return lines


def plot(result: BenchResult, figure: Any) -> None:
    shuffles = [r for r in result.results if r["kind"] == "shuffle"]
    left, right = figure.subplots(1, 2)
    names = [r["algorithm"] for r in shuffles]
    y = np.arange(len(names))
    for offset, column, label in ((-0.2, "mean_distance", "mean"), (0.2, "median_distance", "median")):
        left.bar_label(left.barh(y + offset, [r[column] for r in shuffles], 0.4, label=label), fmt="%.3g", fontsize=7)
    left.axvline(1 / 3, color="gray", linestyle="--", linewidth=1, label="uniform mean (1/3)")
    left.set_yticks(y, names, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("distance of source neighbours in the output / n")
    left.set_title("shuffle: how far neighbours move (higher is better mixed)")
    left.legend(fontsize=8)
    mixing = [r for r in result.results if r["kind"] == "mixing"]
    labels = sorted({r["algorithm"] for r in mixing})
    weights = list(dict.fromkeys(r["weights"] for r in mixing))
    x = np.arange(len(labels))
    width = 0.8 / max(len(weights), 1)
    for i, label in enumerate(weights):
        rows = {r["algorithm"]: r for r in mixing if r["weights"] == label}
        values = [max(rows[a]["worst_deviation_1024"], 0.01) for a in labels]
        bars = right.bar(x + i * width - 0.4 + width / 2, values, width, label=f"weights {label}")
        right.bar_label(bars, fmt="%.3g", fontsize=6)
    right.set_yscale("log")
    right.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    right.set_ylabel("worst |count - 1024 x weight| over windows of 1024")
    right.set_title("mixing: worst share deviation (lower is better)")
    right.legend(fontsize=8)
