"""``bench scale``: the store requests BatchWeave sends as a job grows to thousands of
ranks and producers, against the request limits of S3, Azure and GCS.

1. Measured (``scale_measure``): real Consumers (dp 2 x tp 4, 8 ranks), Producers
   (direct and group mode), the collector and ``watch`` on the counting latency model,
   requests by role, state, key class and operation.
2. Projected (``scale_model.project``) to (ranks, producers) = (64, 16), (1,024, 128),
   (10,000, 1,024), 8 ranks a node, tp = 8 within a node, 3 steps a second: the busiest
   key, each prefix, the total and dollars an hour, in two columns: "before" (every rank
   follows the log and reads its own slice, the pauses before HeadPolling) and "after" (one follower
   and one read per distinct slice per node, the head-polling budget of
   ``batchweave.reading.polling``).
3. Simulated (``scale_model.simulate``): every follower of those jobs, jittered, probing
   the head while a committer commits at the step rate and then stops; the busiest key's
   requests per 1-s window (max and mean), against the projection.
4. A producer pool at 16 -> 1,000 producers (``scale_pool``): real Producers claiming at
   start, following the log (group and direct mode) and held by ``max_lag``, against the
   targets at 1,000 (<= 100 requests/s on any key, <= 1,000 PUT/s and <= 3,000 GET/s on
   ``_log/``); and a garbage collection at 1,000 -> 100,000 versions (``gc_history``),
   whose cost should stay within 1.3x.
"""

from __future__ import annotations

from typing import Any

from batchweave.keys import HEAD_COPIES
from batchweave.reading.polling import HEAD_BUDGET_PER_S, HeadPolling
from batchweave.reading.sharedlog import NODE_READ_AHEAD
from benchmarks import gc_history
from benchmarks.report import BenchOptions, BenchResult, machine
from benchmarks.scale_count import LOG_CLASSES, LOG_NEXT, LOG_VERSION, SEGMENT
from benchmarks.scale_fresh import FRESH_TARGET_S, FreshConfig, freshness
from benchmarks.scale_measure import OWN, SHARED, MeasureConfig, measure_all
from benchmarks.scale_model import (
    LIMITS,
    NEXT,
    PRICES_AS_OF,
    SEGMENT_READ,
    FollowerRates,
    Load,
    OtherRates,
    Scale,
    SimResult,
    TodayPolling,
    follower_pattern,
    held_polls,
    project,
    simulate,
)
from benchmarks.scale_pool import (
    GET_TARGET_PER_S,
    KEY_TARGET_PER_S,
    PUT_TARGET_PER_S,
    PoolConfig,
    gc_rows,
    measure_pool,
)

NAME = "scale"
SCALES = ((64, 16), (1024, 128), (10_000, 1024))
QUICK_SCALES = ((64, 16), (1024, 128))
COLUMNS = (
    "kind",
    "setup",
    "state",
    "ranks",
    "producers",
    "rate",
    "unit",
    "hot_key_per_s",
    "hot_key_mean_per_s",
    "total_per_s",
    "usd_per_hour",
    "first_limit",
    "how",
    "put_peak_per_s",
    "get_peak_per_s",
    "target",
    "met",
)
Joint = dict[tuple[str, str], float]


def run(options: BenchOptions, progress: Any) -> BenchResult:
    measure = MeasureConfig.quick() if options.quick else MeasureConfig()
    scales = QUICK_SCALES if options.quick else SCALES
    pool = PoolConfig.quick() if options.quick else PoolConfig()
    task = progress.add_task("bench scale: measuring", total=5 + 2 * len(scales) + 6)
    measured = Measured(measure_all(measure, progress, task))
    other = _other_rates(measured)
    results: list[dict[str, Any]] = [_measured_row(r) for r in measured.records]
    comparisons: list[dict[str, Any]] = []
    series: dict[str, list[dict[str, float]]] = {}
    for ranks, producers in scales:
        progress.update(task, description=f"bench scale: {ranks} ranks")
        scale = Scale(ranks, producers, steps_per_s=measure.steps_per_s)
        for column in ("before", "after"):
            shared = column == "after"
            followers = scale.nodes if shared else scale.ranks
            loads = project(scale, followers, _follower_rates(measured, scale, column), other, shared=shared)
            results.extend(_projected_row(scale, column, load) for load in loads)
            for state, sim in _simulate(scale, column, followers, options).items():
                load = next(load for load in loads if load.state == state)
                results.append(_simulated_row(scale, column, state, sim))
                comparisons.append(_comparison(scale, column, state, load, sim))
                series[f"{column} {ranks} {state}"] = [{"window": i, "requests": n} for i, n in enumerate(sim.windows)]
        progress.advance(task, 2)
    progress.update(task, description="bench scale: a producer pool")
    pool_records = measure_pool(pool, lambda: progress.advance(task))
    results.extend(_pool_row(r) for r in pool_records)
    progress.update(task, description="bench scale: freshness at the head")
    fresh = FreshConfig.quick() if options.quick else FreshConfig()
    results.extend(_fresh_row(freshness(ranks, fresh)) for ranks in fresh.sizes)
    progress.advance(task)
    progress.update(task, description="bench scale: gc at growing history")
    results.extend(_gc_rows(gc_rows(pool)))
    progress.advance(task)
    checks = _model_checks(measured, measure)
    node_check = _per_node_check(measured, scales, measure)
    config = {
        "measured": {
            "mesh": f"dp {measure.dp} x tp {measure.tp} = {measure.ranks} ranks, one process, threads",
            "store": "LatencyStore over memory:// (remote=True), counting every request attempt",
            "steps_per_s": measure.steps_per_s,
            "one TGB per version": True,
            "flowing_s": measure.flowing_s,
            "idle_s": measure.idle_s,
            "producers": measure.producers,
            "producer_s": measure.producer_s,
            "watch_interval_s": measure.watch_interval_s,
            "node_sharing_measured": measured.shared,
        },
        "projection": {
            "scales": [list(s) for s in scales],
            "ranks_per_node": 8,
            "tp": 8,
            "steps_per_s": measure.steps_per_s,
            "slice_bytes": Scale(64, 1).slice_bytes,
            "producers": "direct mode, one TGB per step, requests per TGB as measured",
            "gc_every_s": other.gc_every_s,
            "watch": "one `batchweave watch` at its default 2 s interval",
            "head_budget_per_s": HEAD_BUDGET_PER_S,
            "before": "each rank its own follower: log requests behind the head as measured per rank; at the head "
            "the pauses of the consumer before HeadPolling (0.01 s doubling to 1 s, uniform(p/2, p), a re-proof "
            "every 10 s), one follower's mean pattern; one read per rank per step",
            "after": "one follower per node: log requests behind the head as measured "
            + ("per node with node sharing" if measured.shared else "per rank (node sharing not in this checkout)")
            + "; at the head HeadPolling(nodes)'s mean pattern; one read per distinct (d, c) slice per node",
        },
        "prices": PRICES_AS_OF,
        "limits": [
            {"name": lim.name, "per_s": lim.per_s, "hard": lim.hard, "document": lim.document} for lim in LIMITS
        ],
        "pool": {
            "sizes": list(pool.sizes),
            "largest_measured": pool.largest_measured,
            "above": "held before any collection only: projected linearly in P from the largest measured size "
            "(each producer sends what it did there); every other state is measured at every size",
            "model": pool.model.to_dict(),
            "mesh": "dp 2, one small TGB (2 x 64 bytes)",
            "claims": "P Producers constructed in threads on a fresh namespace (DAC), all counted: all at once, "
            "and as a producer pool starts them (worker i after i / START_RATE_PER_S s, about 23 a second)",
            "following": f"P Producers appending, paced so the pool makes {pool.pool_tgb_per_s} TGB/s in all, "
            f"counted {pool.window_s} s after {pool.warmup_s} s (claims not counted); policies {list(pool.policies)}",
            "held": f"P Producers with max_lag=1 on a log one step past a complete checkpoint of {pool.marks:,} "
            "marks, each append held: before any collection polling _checkpoints/ (counted "
            f"{pool.window_s} s once every producer read every mark, that first poll reported apart); once "
            "collected, probing the log's reclaim point",
            "peaks": "the most requests in one 1-s window",
            "targets_at_1000": {
                "any_key_per_s": KEY_TARGET_PER_S,
                "log_put_per_s": PUT_TARGET_PER_S,
                "log_get_per_s": GET_TARGET_PER_S,
            },
        },
        "fresh": {
            "sizes": list(fresh.sizes),
            "how": "one node's 8 real ranks (tp 8, dp = ranks / 8) of the job, node sharing on, on the counting "
            f"latency model, a committer at {fresh.steps_per_s} steps/s; the node follows within the head budget "
            "of a job of ranks / 8 nodes",
            "window": f"{fresh.pauses} of the node's mean pauses at the head, at least {fresh.min_window_s} s",
            "target_p95_s": FRESH_TARGET_S,
        },
        "gc": {
            "versions": list(pool.gc_versions),
            "how": "bench gc-history's collections: memory store, no latency, requests counted",
            "target": f"a collection at the longest history within {gc_history.TARGET}x of the shortest",
        },
        "comparisons": comparisons,
        "model_checks": checks,
        "per_node_log": node_check,
        "quick": options.quick,
        "store": "latency (counting), always",
        "machine": machine(),
    }
    summary = verdict(results, comparisons, node_check, checks) + pool_verdict(results) + fresh_verdict(results)
    return BenchResult(NAME, config, results, COLUMNS, summary=summary, series=series)


# -- rates from the measured records ------------------------------------------------------


class Measured:
    """The measured records, found by state and consumer setup."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.shared = any(r.get("setup") == SHARED for r in records)

    def get(self, state: str, setup: str | None = None) -> dict[str, Any]:
        return next(r for r in self.records if r["state"] == state and (setup is None or r.get("setup") == setup))

    def consumer(self, state: str, shared: bool) -> dict[str, Any]:
        return self.get(state, SHARED if shared and self.shared else OWN)


def _joint(record: dict[str, Any], classes: frozenset[str] | None = None, unit: str | None = None) -> Joint:
    """The record's (class, op) rates, per its main unit or per ``unit``."""
    factor = 1.0 if unit is None else record[f"per_{unit}"] / record[f"per_{record['per']}"]
    out: Joint = {}
    for key, value in record.items():
        if key.startswith("j:"):
            cls, op = key[2:].split("|")
            if classes is None or cls in classes:
                out[cls, op] = value * factor
    return out


def _pattern_joint(sim: SimResult) -> Joint:
    out: Joint = {}
    for kind, rate in sim.per_follower_per_s.items():
        key = (LOG_NEXT, "get") if kind == NEXT else (SEGMENT, "get") if kind == SEGMENT_READ else (LOG_VERSION, "get")
        out[key] = out.get(key, 0.0) + rate
    return out


def _follower_rates(measured: Measured, scale: Scale, column: str) -> FollowerRates:
    """One follower of the job: each rank ("before") or each node ("after"). Behind the
    head it reads what was measured (per rank, or per node with sharing); at the head it
    pauses as its policy says for the job's followers (the policy's mean pattern)."""
    shared = column == "after"
    followers = scale.nodes if shared else scale.ranks
    behind = measured.consumer("behind the head", shared)
    per_follower_step = "node_step" if behind.get("setup") == SHARED else "rank_step"
    interval = 1.0 / scale.steps_per_s
    make = _policy(column, followers)
    flowing = follower_pattern(make, interval, idle=False)
    idle = follower_pattern(make, interval, idle=True)
    policy = make(None)
    spread = max(interval, getattr(policy, "probe_floor_s", policy.floor_s))
    keys = getattr(policy, "copies", 0) + 1  # a version's keys its probes and reads spread over
    return FollowerRates(
        behind_per_step=_joint(behind, LOG_CLASSES, per_follower_step),
        behind_max_per_key=behind["max_log_requests_per_key"] / behind["followers"],
        flowing_per_s=_pattern_joint(flowing),
        # Followers coming round within a second send all of a version's requests (probes,
        # the read, proofs) to its key in that second; spread wider by the budget, each
        # follower's visit sends one request (a probe or the read) to one of the keys of
        # the version being visited.
        flowing_per_version_on_one_key=(
            flowing.requests_per_follower_per_s / flowing.versions_per_s / keys if spread <= 1.0 else 1.0 / keys
        ),
        idle_per_s=_pattern_joint(idle),
        idle_next_key_per_s=idle.per_follower_per_s.get(NEXT, 0.0) / keys,
        spread_s=spread,
        # Node followers read ahead of their ranks by a margin drawn per node: a segment's
        # reads spread over the time the job takes to consume the margins' range (one
        # TGB per version, the worst case).
        behind_spread_s=(NODE_READ_AHEAD[1] - NODE_READ_AHEAD[0]) / scale.steps_per_s if shared else 1.0,
    )


def _other_rates(measured: Measured) -> OtherRates:
    return OtherRates(
        producer_per_tgb=_joint(measured.get("producing, direct (DAC)")),
        watch_per_s=_joint(measured.get("watch refreshing")),
        gc_per_run=_joint(measured.get("gc run, reclaiming")),
    )


def _policy(column: str, followers: int):
    if column == "before":
        return lambda rng: TodayPolling(rng=rng)
    return lambda rng: HeadPolling(followers, rng=rng, copies=HEAD_COPIES)


def _model_checks(measured: Measured, measure: MeasureConfig) -> list[dict[str, Any]]:
    """The real consumer at the head (this checkout's: HeadPolling for its followers)
    against one follower's mean pattern under the same policy: log requests per follower
    and second, and the busiest key's second."""
    out = []
    setups = (OWN, SHARED) if measured.shared else (OWN,)
    for setup in setups:
        for state in ("at the head, commits flowing", "idle at the head"):
            record = measured.get(state, setup)
            followers = record["followers"]
            make = _policy("after", followers)
            pattern = follower_pattern(make, 1 / measure.steps_per_s, idle=state.startswith("idle"))
            real = record["log_per_rank_s"] * record["ranks"] / followers
            out.append(
                {
                    "setup": setup,
                    "state": state,
                    "followers": followers,
                    "measured_log_per_follower_s": real,
                    "model_log_per_follower_s": pattern.requests_per_follower_per_s,
                    "model_over_measured": pattern.requests_per_follower_per_s / real if real else float("nan"),
                    "measured_hot_key_mean_per_s": record["hot_key_mean_per_s"],
                }
            )
    return out


# -- simulation ---------------------------------------------------------------------------


def _simulate(scale: Scale, column: str, followers: int, options: BenchOptions) -> dict[str, SimResult]:
    make = _policy(column, followers)
    floor = make(None).floor_s
    interval = 1.0 / scale.steps_per_s
    counted = 4.0 if options.quick else 12.0
    settle = max(3.0, 2 * floor)
    flowing = simulate(
        followers, make, commit_interval_s=interval, flowing_s=settle + counted, warmup_s=settle, seed=options.seed
    )
    idle = simulate(
        followers,
        make,
        commit_interval_s=interval,
        flowing_s=settle,
        idle_s=settle + (4.0 if options.quick else 25.0),
        warmup_s=settle,
        seed=options.seed,
    )
    return {"at the head, commits flowing": flowing, "idle at the head": idle}


# -- rows ---------------------------------------------------------------------------------


def _measured_row(record: dict[str, Any]) -> dict[str, Any]:
    unit = record["per"]
    row = {
        "kind": "measured",
        "setup": record["role"] + (f": {record['setup']}" if "setup" in record else ""),
        "state": record["state"],
        "ranks": record.get("ranks"),
        "producers": record.get("producers"),
        "rate": record[f"per_{unit}"],
        "unit": f"requests per {unit.replace('_', '-')}",
        "hot_key_per_s": record.get("hot_key_max_per_s"),
        "hot_key_mean_per_s": record.get("hot_key_mean_per_s"),
    }
    return {**record, **row}


def _pool_row(record: dict[str, Any]) -> dict[str, Any]:
    """A producer pool's record as a row: peaks on ``_log/`` (``_checkpoints/`` when held),
    the busiest key, and whether the targets are met."""
    prefix = "checkpoints" if record["state"].startswith("held") else "log"
    reads = "list" if prefix == "checkpoints" else "get"
    checks = _pool_checks(record)
    row = {
        "kind": "pool",
        "setup": record["policy"],
        "ranks": None,
        "producers": record["producers"],
        "rate": record.get(f"{prefix}_{reads}_per_producer_s"),
        "unit": f"{reads.upper()}s on _{prefix}/ per producer-s",
        "put_peak_per_s": record.get(f"{prefix}_put_peak_per_s"),
        "get_peak_per_s": record.get(f"{prefix}_get_peak_per_s"),
        "target": "; ".join(f"{name} <= {target:,.0f}" for name, _, target in checks),
        "met": all(value <= target for _, value, target in checks),
    }
    if record["state"].endswith(", collected"):
        peak, mean = held_polls(record["producers"], window_s=600.0)
        row["independent_hot_key_per_s"], row["independent_hot_key_mean_per_s"] = peak, mean
    return {**record, **row}


def _pool_checks(record: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(what, peak per second, target) for each target a pool's record answers."""
    checks = [("requests/s on the busiest key", record["hot_key_per_s"], KEY_TARGET_PER_S)]
    if "log_put_peak_per_s" in record:
        checks.append(("PUT/s on _log/", record["log_put_peak_per_s"], PUT_TARGET_PER_S))
        checks.append(("GET/s on _log/", record["log_get_peak_per_s"], GET_TARGET_PER_S))
    return checks


def _gc_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``bench gc-history``'s rows, each against the same run at the shortest history."""
    shortest = min(r["versions"] for r in rows)
    base = {r["run"]: r["requests"] for r in rows if r["versions"] == shortest}
    out = []
    for r in rows:
        ratio = r["requests"] / base[r["run"]]
        out.append(
            {
                **r,
                "kind": "gc",
                "setup": r["run"],
                "ranks": None,
                "producers": 1,
                "hot_key_per_s": None,
                "state": f"{r['versions']:,} versions",
                "how": "measured",
                "rate": r["requests"],
                "unit": "requests per collection",
                "ratio_to_shortest": ratio,
                "target": f"<= {gc_history.TARGET}x of {shortest:,} versions",
                "met": r["run"] == "first" or ratio <= gc_history.TARGET,
            }
        )
    return out


def _first_limit(load: Load, producers: int, steps_per_s: float) -> tuple[str, float]:
    limit, rate = load.limits(producers, steps_per_s)[0]
    return limit.name, rate / limit.per_s


def _projected_row(scale: Scale, column: str, load: Load) -> dict[str, Any]:
    name, ratio = _first_limit(load, scale.producers, scale.steps_per_s)
    prefixes = load.prefix_per_s(scale.producers, scale.steps_per_s)
    limits = load.limits(scale.producers, scale.steps_per_s)
    return {
        "kind": "projected",
        "setup": column,
        "state": load.state,
        "ranks": scale.ranks,
        "producers": scale.producers,
        "nodes": scale.nodes,
        "hot_key_per_s": load.hot_key_per_s,
        "hot_key": load.hot_key,
        "total_per_s": load.total_per_s,
        "reads_per_s": load.ops_per_s(frozenset({"get", "head", "list"})),
        "writes_per_s": load.ops_per_s(frozenset({"put", "delete"})),
        "prefix_per_s": prefixes,
        "usd_per_hour": load.usd_per_hour(),
        "first_limit": f"{name} ({ratio:.0%})" + (" EXCEEDED" if ratio > 1 else ""),
        "limit_ratio": ratio,
        "limits": {lim.name: rate / lim.per_s for lim, rate in limits},
    }


def _simulated_row(scale: Scale, column: str, state: str, sim: SimResult) -> dict[str, Any]:
    return {
        "kind": "simulated",
        "setup": column,
        "state": state,
        "ranks": scale.ranks,
        "producers": scale.producers,
        "followers": sim.followers,
        "rate": sim.requests_per_follower_per_s,
        "unit": "log requests per follower-s",
        "hot_key_per_s": sim.hot_key_max_per_s,
        "hot_key_mean_per_s": sim.hot_key_mean_per_s,
        "total_per_s": sim.requests_per_follower_per_s * sim.followers,
        "hot_key_kind": sim.hot_key_kind,
        "fresh_p50_s": sim.delay_percentile(50),
        "fresh_p95_s": sim.delay_percentile(95),
    }


def _comparison(scale: Scale, column: str, state: str, load: Load, sim: SimResult) -> dict[str, Any]:
    return {
        "ranks": scale.ranks,
        "setup": column,
        "state": state,
        "projected_hot_key_per_s": load.hot_key_per_s,
        "simulated_max_per_s": sim.hot_key_max_per_s,
        "simulated_mean_per_s": sim.hot_key_mean_per_s,
        "mean_over_projected": sim.hot_key_mean_per_s / load.hot_key_per_s if load.hot_key_per_s else float("nan"),
    }


def _per_node_check(
    measured: Measured, scales: tuple[tuple[int, int], ...], measure: MeasureConfig
) -> list[dict[str, Any]]:
    """Log requests a second per node of 8 ranks: today's (8 followers with the pauses of
    before HeadPolling) against one node follower under HeadPolling at each scale, and as
    measured with node sharing (one node). Target: at most 1/8."""
    out = []
    interval = 1 / measure.steps_per_s
    for state in ("at the head, commits flowing", "idle at the head"):
        idle = state.startswith("idle")
        today = 8 * follower_pattern(_policy("before", 8), interval, idle).requests_per_follower_per_s
        nodes: list[tuple[str, float]] = [
            (
                f"{ranks:,} ranks (model)",
                follower_pattern(_policy("after", -(-ranks // 8)), interval, idle).requests_per_follower_per_s,
            )
            for ranks, _ in scales
        ]
        if measured.shared:
            record = measured.get(state, SHARED)
            nodes.append(("one node (measured)", record["log_per_rank_s"] * record["ranks"]))
        for name, after in nodes:
            out.append(
                {
                    "state": state,
                    "where": name,
                    "today_per_node_s": today,
                    "after_per_node_s": after,
                    "ratio": after / today,
                    "met": after <= today / 8,
                }
            )
    return out


def verdict(
    results: list[dict[str, Any]],
    comparisons: list[dict[str, Any]],
    node_check: list[dict[str, Any]],
    checks: list[dict[str, Any]],
) -> list[str]:
    lines = []
    for column in ("before", "after"):
        worst: dict[int, dict[str, Any]] = {}
        for row in results:
            if row["kind"] == "projected" and row["setup"] == column:
                if row["ranks"] not in worst or row["limit_ratio"] > worst[row["ranks"]]["limit_ratio"]:
                    worst[row["ranks"]] = row
        lines.append(
            f"{column}: the most loaded limit at each scale (EXCEEDED: the first one hit): "
            + "; ".join(f"{r:,} ranks: {row['first_limit']} ({row['state']})" for r, row in sorted(worst.items()))
        )
    biggest = max(c["ranks"] for c in comparisons)
    for c in comparisons:
        if c["ranks"] == biggest and c["setup"] == "after":
            lines.append(
                f"after, {biggest:,} ranks, {c['state']}: busiest key simulated max {c['simulated_max_per_s']:.0f}/s, "
                f"mean {c['simulated_mean_per_s']:.0f}/s (target <= 100), "
                f"projected {c['projected_hot_key_per_s']:.0f}/s"
            )
    off = [abs(c["mean_over_projected"] - 1) for c in comparisons if c["projected_hot_key_per_s"]]
    lines.append(f"simulated mean busiest key vs projected: within {max(off):.0%} over {len(off)} configurations")
    met = all(n["met"] for n in node_check)
    lines.append(
        "log requests per node <= 1/8 of today's: "
        + ("met" if met else "NOT met")
        + " ("
        + ", ".join(f"{n['state'].split(',')[0]}, {n['where']}: {n['ratio']:.3f}" for n in node_check)
        + ")"
    )
    lines.append(
        "real consumer vs model, log requests per follower-s: "
        + ", ".join(
            f"{c['setup'].split(' (')[0]}, {c['state'].split(',')[0]}: {c['measured_log_per_follower_s']:.2f} "
            f"measured, {c['model_log_per_follower_s']:.2f} model"
            for c in checks
        )
    )
    return lines


def _fresh_row(record: dict[str, Any]) -> dict[str, Any]:
    return {
        **record,
        "kind": "fresh",
        "setup": "node sharing, one node of the job",
        "producers": 1,
        "rate": record["fresh_p95_s"],
        "unit": "P95 s from commit to delivery",
        "hot_key_per_s": record["node_hot_key_per_s"],
        "hot_key_mean_per_s": record["job_version_key_per_s"],
        "target": f"P95 <= {FRESH_TARGET_S:.0f} s",
    }


def fresh_verdict(results: list[dict[str, Any]]) -> list[str]:
    simulated = [
        f"freshness simulated at {r['ranks']:,} ranks ({r['followers']:,} node followers, every one): commit to "
        f"read P50 {r['fresh_p50_s']:.2f} s, P95 {r['fresh_p95_s']:.2f} s; busiest key {r['hot_key_per_s']:.0f} in "
        f"its busiest second, {r['hot_key_mean_per_s']:.0f}/s mean ({r['hot_key_kind']})"
        for r in results
        if r["kind"] == "simulated" and r["setup"] == "after" and r["state"] == "at the head, commits flowing"
    ]
    return simulated + [
        f"freshness at {r['ranks']:,} ranks ({r['nodes']:,} nodes): commit to delivery P50 {r['fresh_p50_s']:.2f} s, "
        f"P95 {r['fresh_p95_s']:.2f} s over {r['steps']} steps (target <= {FRESH_TARGET_S:.0f} s: "
        f"{'met' if r['met'] else 'NOT met'}); the node probes every {r['pause_s']:.1f} s on average and sends "
        f"{r['node_requests_per_version']:.1f} requests to each version's {r['copies'] + 1} keys: the job ~"
        f"{r['job_version_key_per_s']:.0f}/s on one"
        for r in results
        if r["kind"] == "fresh"
    ]


def pool_verdict(results: list[dict[str, Any]]) -> list[str]:
    """One line per target for each pool state at its largest size, and GC's."""
    lines = []
    pools = [r for r in results if r["kind"] == "pool"]
    for state in dict.fromkeys(r["state"] for r in pools):
        largest = max((r for r in pools if r["state"] == state), key=lambda r: r["producers"])
        where = f"{state} at {largest['producers']:,} producers ({largest['how']})"
        for name, value, target in _pool_checks(largest):
            met = "met" if value <= target else "NOT met"
            lines.append(f"{where}: peak {value:,.0f} {name} (target <= {target:,.0f}: {met})")
        if "independent_hot_key_per_s" in largest:
            lines.append(
                f"{where}: as independent processes (each its own timer, modelled over 600 s): busiest key "
                f"{largest['independent_hot_key_per_s']:,.0f} in its busiest second, "
                f"{largest['independent_hot_key_mean_per_s']:,.0f}/s mean"
            )
        if state.startswith("held"):
            lines.append(
                f"{where}: {largest['checkpoints_list_per_s']:,.0f} LIST/s and {largest['checkpoints_get_per_s']:,.0f} "
                f"GET/s on _checkpoints/ and {largest['log_per_s']:,.0f}/s on _log/ steady; first poll "
                f"{largest['first_poll_gets_per_producer']:,.0f} GETs per producer"
            )
    gc = [r for r in results if r["kind"] == "gc"]
    if gc:
        lines.extend(f"gc: {line}" for line in gc_history.verdict(gc))
    return lines


# -- figure -------------------------------------------------------------------------------


def plot(result: BenchResult, figure: Any) -> None:
    rows = [r for r in result.results if r["kind"] == "projected"]
    scales = sorted({r["ranks"] for r in rows})
    ax1, ax2 = figure.subplots(1, 2)
    width = 0.2
    for i, (column, state) in enumerate(
        [(c, s) for c in ("before", "after") for s in ("at the head, commits flowing", "idle at the head")]
    ):
        values = [
            next(r["hot_key_per_s"] for r in rows if r["ranks"] == n and r["setup"] == column and r["state"] == state)
            for n in scales
        ]
        bars = ax1.bar([x + (i - 1.5) * width for x in range(len(scales))], values, width, label=f"{column}: {state}")
        ax1.bar_label(bars, fmt="%.3g", fontsize=6)
    for name, per_s, style in (
        ("Azure per blob 500/s", 500, ":"),
        ("S3 per prefix 5,500/s", 5500, "--"),
        ("budget 100/s", 100, "-."),
    ):
        ax1.axhline(per_s, linestyle=style, color="grey", linewidth=1)
        ax1.text(-0.45, per_s * 1.08, name, fontsize=7, color="grey")
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(scales)), [f"{n:,} ranks" for n in scales])
    ax1.set_ylabel("requests/s on the busiest key (projected)")
    ax1.set_title("Busiest key, before and after")
    ax1.legend(fontsize=7)
    comparisons = result.config["comparisons"]
    for marker, column in (("o", "before"), ("s", "after")):
        chosen = [c for c in comparisons if c["setup"] == column]
        ax2.scatter(
            [c["projected_hot_key_per_s"] for c in chosen],
            [c["simulated_mean_per_s"] for c in chosen],
            marker=marker,
            label=f"{column}: simulated mean",
        )
        ax2.scatter(
            [c["projected_hot_key_per_s"] for c in chosen],
            [c["simulated_max_per_s"] for c in chosen],
            marker=marker,
            facecolors="none",
            edgecolors="black",
            label=f"{column}: simulated max",
        )
    lo = min(c["projected_hot_key_per_s"] for c in comparisons) / 2
    hi = max(c["simulated_max_per_s"] for c in comparisons) * 2
    ax2.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("projected requests/s on the busiest key")
    ax2.set_ylabel("simulated (per 1-s window)")
    ax2.set_title("Discrete-event model vs projection")
    ax2.legend(fontsize=7)
