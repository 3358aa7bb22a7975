"""``bench producers``: ingestion throughput against producer count and payload size,
for BatchWeave under every commit policy, for NATS JetStream in strict-TGB mode, and for
raw create-only puts of the same bytes at the same concurrency with no commit protocol
(the store's own limit). Every point also reports visibility latency P50/P95: from the
call that hands a TGB over to the moment a commit made it visible (for raw puts, the
put itself).

NATS runs on loopback with no latency model, so the like-for-like comparison with it is
``--store local`` (both write to this machine's disk); on the default latency model the
BatchWeave figures carry a cloud store's per-request latency that NATS does not.
NATS runs twice per point: with its default 1 MiB message limit (larger TGBs fail, as
the paper's Kafka did) and with the limit raised to 64 MiB.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from batchweave.commit.policies import POLICY_NAMES
from batchweave.store import Store
from benchmarks.ingest import IngestSpec, bench_store, percent, run_ingest, store_model
from benchmarks.report import BenchOptions, BenchResult, machine, visibility_percentiles

NAME = "producers"
COLUMNS = (
    "system",
    "policy",
    "producers",
    "payload_bytes",
    "pace_s",
    "throughput_mb_s",
    "steady_commit_success_rate",
    "window_commit_success_rate",
    "commit_success_rate",
    "tgbs_committed",
    "visibility_p50_s",
    "visibility_p95_s",
    "error",
)
RAISED_NATS_LIMIT = 64 * 1024 * 1024


def plan(options: BenchOptions) -> dict[str, Any]:
    if options.quick:
        # One point, past NATS's default 1 MiB limit, so both NATS records (refused, raised
        # limit) and BatchWeave's are exercised end to end.
        return {
            "producers": [4],
            "payloads": [10_000_000],
            "policies": ["dac", "group"],
            "duration_s": 1.0,
            "nats": True,
            "paced": None,
        }
    # 8 to 128 producers in factors of 4: on 2 cores a finer sweep only adds hours.
    sweep = {
        "producers": [8, 32, 128],
        "payloads": [100_000, 1_000_000, 10_000_000],
        "policies": [*POLICY_NAMES, "group"],
        "duration_s": 10.0,
        "nats": True,
        # At 128 producers flat out, the 2 cores of the development machine go to the
        # producers themselves (each one reads every version of the log): these runs give
        # each producer 0.25 s of "preprocessing" per TGB, so the commit protocol, not the
        # machine, decides visibility and commit success.
        "paced": {"producers": 128, "payload_bytes": 100_000, "pace_s": 0.25, "duration_s": 45.0},
    }
    if options.store == "seaweedfs":
        # On the real server: DAC against group commit and the store's own limit, within
        # the time budget. The latency-model sweep ranks the paper's other policies, NATS
        # does not use the store, and 128 producers flat out measure this machine's two
        # cores (the paced point stands for them).
        sweep.update(producers=[8, 32], policies=["dac", "group"], nats=False)
    return sweep


def run(options: BenchOptions, progress: Any) -> BenchResult:
    from benchmarks.nats_baseline import find_nats_server, measure_nats

    sweep = plan(options)
    points = [(n, size) for size in sweep["payloads"] for n in sweep["producers"]]
    nats_limits = (None, RAISED_NATS_LIMIT) if sweep["nats"] else ()
    task = progress.add_task("bench producers", total=len(points) * (len(sweep["policies"]) + 1 + len(nats_limits)))
    results: list[dict[str, Any]] = []
    for producers, payload in points:
        for policy in sweep["policies"]:
            progress.update(task, description=f"producers: {policy} x{producers}, {payload // 1000} KB")
            spec = IngestSpec(policy, producers, payload, sweep["duration_s"])
            with bench_store(options, f"prod-{policy}") as store:
                record, _ = run_ingest(spec, store)
            results.append({**record, "store": options.store})
            progress.advance(task)
        progress.update(task, description=f"producers: raw puts x{producers}, {payload // 1000} KB")
        with bench_store(options, "prod-raw") as store:
            results.append({**measure_raw_puts(store, producers, payload, sweep["duration_s"]), "store": options.store})
        progress.advance(task)
        for limit in nats_limits:
            progress.update(task, description=f"producers: nats x{producers}, {payload // 1000} KB, limit {limit}")
            if find_nats_server() is None:
                record = _nats_missing(producers, payload)
            else:
                with tempfile.TemporaryDirectory(prefix="bench-nats-") as workdir:
                    record = measure_nats(producers, payload, sweep["duration_s"], Path(workdir), limit)
            results.append(
                {**record, "policy": "strict-tgb" if limit is None else "strict-tgb-64MiB", "store": "nats-loopback"}
            )
            progress.advance(task)
    results.extend(_paced(options, sweep, progress))
    config = {
        **sweep,
        "tgb_slices": 8,
        "quick": options.quick,
        "store": store_model(options),
        "nats": {"mode": "strict TGB: one message per TGB, ack awaited", "limits": ["1 MiB", "64 MiB"]},
        "machine": machine(),
    }
    return BenchResult(NAME, config, results, COLUMNS, summary=verdict(results))


def _paced(options: BenchOptions, sweep: dict[str, Any], progress: Any) -> list[dict[str, Any]]:
    """DAC and group commit with paced producers (see ``plan``)."""
    paced = sweep["paced"]
    if not paced:
        return []
    records = []
    task = progress.add_task("producers, paced", total=2)
    for policy in ("dac", "group"):
        progress.update(task, description=f"producers: {policy} x{paced['producers']} paced {paced['pace_s']} s")
        spec = IngestSpec(
            policy, paced["producers"], paced["payload_bytes"], paced["duration_s"], pace_s=paced["pace_s"]
        )
        with bench_store(options, f"prod-paced-{policy}") as store:
            record, _ = run_ingest(spec, store)
        records.append({**record, "store": options.store})
        progress.advance(task)
    return records


def measure_raw_puts(store: Store, writers: int, payload_bytes: int, duration_s: float) -> dict[str, Any]:
    """``writers`` threads doing create-only puts of ``payload_bytes`` objects for
    ``duration_s``: what the store gives with no log, no commit and no exactly-once."""
    body = os.urandom(payload_bytes)
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + duration_s

    def write(writer: int) -> None:
        for n in itertools.count():
            if time.monotonic() >= deadline:
                return
            started = time.monotonic()
            try:
                store.put_if_absent(f"data/raw/{writer:04d}/{n:09d}", body)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            latencies.append(time.monotonic() - started)

    started = time.monotonic()
    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    return {
        "system": "raw-puts",
        "policy": "none",
        "producers": writers,
        "payload_bytes": payload_bytes,
        "throughput_mb_s": len(latencies) * payload_bytes / seconds / 1e6,
        "commit_success_rate": 1.0,
        "window_commit_success_rate": 1.0,
        "tgbs_committed": len(latencies),
        **visibility_percentiles(latencies),
        "error": errors[0] if errors else None,
    }


def _nats_missing(producers: int, payload: int) -> dict[str, Any]:
    return {
        "system": "nats",
        "producers": producers,
        "payload_bytes": payload,
        "throughput_mb_s": 0.0,
        "commit_success_rate": 0.0,
        "tgbs_committed": 0,
        "error": "nats-server not installed",
    }


def verdict(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    paced = [r for r in results if r.get("pace_s")]
    results = [r for r in results if not r.get("pace_s")]
    for payload in sorted({r["payload_bytes"] for r in results}):
        rows = [r for r in results if r["payload_bytes"] == payload]
        wins, compared = 0, 0
        for producers in sorted({r["producers"] for r in rows}):
            dac = _pick(rows, "batchweave", "dac", producers)
            nats = [r for r in rows if r["system"] == "nats" and r["producers"] == producers and r["tgbs_committed"]]
            if dac and nats:
                compared += 1
                wins += dac["throughput_mb_s"] >= max(r["throughput_mb_s"] for r in nats)
        failed = [r for r in rows if r["system"] == "nats" and r["policy"] == "strict-tgb" and not r["tgbs_committed"]]
        if compared or failed:
            lines.append(
                f"{payload // 1000} KB: BatchWeave (DAC) >= NATS at {wins}/{compared} producer counts; "
                f"NATS with its default limit failed at {len(failed)} of them"
            )
        lines.extend(_group_against_dac(rows, payload))
    if paced:
        lines.extend(
            f"paced {paced[0]['pace_s']} s/TGB: {line}" for line in _group_against_dac(paced, paced[0]["payload_bytes"])
        )
    return lines


def _group_against_dac(rows: list[dict[str, Any]], payload: int) -> list[str]:
    """Group commit against DAC at each producer count: the issue's targets are visibility
    P95 <= 2 s, commit success >= 95% and throughput no lower than DAC's."""
    lines = []
    for producers in sorted({r["producers"] for r in rows}):
        dac, grouped = _pick(rows, "batchweave", "dac", producers), _pick(rows, "batchweave", "group", producers)
        if not (dac and grouped and dac["throughput_mb_s"]):
            continue
        lines.append(
            f"{payload // 1000} KB x{producers}: group commit P95 visible {grouped['visibility_p95_s']:.2f} s "
            f"(DAC {dac['visibility_p95_s']:.2f} s), success {percent(grouped['steady_commit_success_rate'], 0)} "
            f"after warm-up (DAC {percent(dac['steady_commit_success_rate'], 0)}), "
            f"throughput {grouped['throughput_mb_s'] / dac['throughput_mb_s']:.2f}x DAC"
        )
    return lines


def _pick(rows: list[dict[str, Any]], system: str, policy: str, producers: int) -> dict[str, Any] | None:
    for r in rows:
        if r["system"] == system and r.get("policy") == policy and r["producers"] == producers:
            return r
    return None


def plot(result: BenchResult, figure: Any) -> None:
    payloads = sorted({r["payload_bytes"] for r in result.results})
    axes = figure.subplots(1, len(payloads), squeeze=False)[0]
    for ax, payload in zip(axes, payloads, strict=True):
        rows = [r for r in result.results if r["payload_bytes"] == payload and not r.get("pace_s")]
        for system, policy in sorted({(r["system"], r["policy"]) for r in rows}):
            line = sorted(
                (r["producers"], r["throughput_mb_s"])
                for r in rows
                if (r["system"], r["policy"]) == (system, policy) and r["throughput_mb_s"] > 0
            )
            if line:
                style = "s--" if system == "nats" else ("o-" if policy == "dac" else ".-")
                xs, ys = zip(*line, strict=True)
                ax.plot(xs, ys, style, label=f"{system} {policy}")
        ax.set(title=f"{payload // 1000} KB TGBs", xlabel="producers", ylabel="MB/s", xscale="log")
    axes[0].legend(fontsize="small")
