"""``bench commit-cost``: the fragile window (read latest + conditional write) against history.

For each history size a namespace is filled with that many committed TGBs (written
directly, without latency: building history is not what we measure), then a real
``Producer`` on the latency model commits one TGB at a time and we record each
attempt's fragile window. Beside it, the paper's full-snapshot manifest is measured on
the same latency model: every commit reads the newest manifest and writes a new one,
both the size of the whole TGB list, so its window grows with history.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

from batchweave import log, logrules
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.latency import CLOUD_DEFAULTS, LatencyStore
from batchweave.log import LogState, TGBDescriptor
from batchweave.producer import Producer
from batchweave.store import Store
from benchmarks.ingest import store_model
from benchmarks.report import BenchOptions, BenchResult, machine

NAME = "commit-cost"
HISTORIES = (1_000, 10_000, 100_000)
TGBS_PER_VERSION = 50
SLICES = 8
COLUMNS = (
    "system",
    "history_tgbs",
    "fragile_window_p50_s",
    "fragile_window_p95_s",
    "open_s",
    "open_requests",
    "samples",
)


def run(options: BenchOptions, progress: Any) -> BenchResult:
    if options.quick:  # two histories a decade apart; a 100k-TGB manifest alone takes seconds per sample
        histories, samples, manifest_samples = HISTORIES[:2], 5, 2
    else:
        histories, samples, manifest_samples = HISTORIES, 200, 50
    task = progress.add_task("bench commit-cost", total=len(histories) * 2)
    results: list[dict[str, Any]] = []
    for history in histories:
        progress.update(task, description=f"commit-cost: batchweave @ {history} TGBs")
        results.append(_measure_batchweave(history, samples, options.seed))
        progress.advance(task)
        progress.update(task, description=f"commit-cost: full manifest @ {history} TGBs")
        results.append(_measure_full_manifest(history, manifest_samples, options.seed))
        progress.advance(task)
    config = {
        "histories_tgbs": list(histories),
        "tgbs_per_history_version": TGBS_PER_VERSION,
        "tgb_slices": SLICES,
        "samples_per_point": samples,
        "quick": options.quick,
        "store": store_model(BenchOptions(store="latency")),
        "machine": machine(),
    }
    return BenchResult(NAME, config, results, COLUMNS, summary=verdict(results))


def verdict(results: list[dict[str, Any]]) -> list[str]:
    ours = {r["history_tgbs"]: r for r in results if r["system"] == "batchweave"}
    full = {r["history_tgbs"]: r for r in results if r["system"] == "full-manifest"}
    lo, hi = min(ours), max(ours)
    ratio = ours[hi]["fragile_window_p50_s"] / ours[lo]["fragile_window_p50_s"]
    full_ratio = full[hi]["fragile_window_p50_s"] / full[lo]["fragile_window_p50_s"]
    return [
        f"fragile window p50 at {hi} TGBs = {ratio:.2f}x its p50 at {lo} (target <= 1.3x)",
        f"a full-snapshot manifest grows {full_ratio:.1f}x over the same history "
        f"({full[hi]['fragile_window_p50_s'] * 1e3:.0f} ms at {hi} TGBs)",
        f"opening the namespace at {hi} TGBs: {ours[hi]['open_requests']} requests, {ours[hi]['open_s'] * 1e3:.0f} ms",
    ]


def _descriptor(offset: int) -> TGBDescriptor:
    return TGBDescriptor(
        producer="history",
        epoch=1,
        source_offset=offset,
        dp=SLICES,
        cp=1,
        kind="bytes",
        objects=[f"data/history/e000001/{offset:012d}-00000000.0.bwb"],
        slices=[(0, i * 12_500, 12_500, 0x1234ABCD) for i in range(SLICES)],
        nbytes=100_000,
    )


def build_history(store: Store, tgbs: int) -> LogState:
    """Commit ``tgbs`` TGBs straight into ``store`` (no latency), with snapshots as usual."""
    journal = Journal(store)
    state = journal.commit(
        LogState(),
        lambda s: logrules.build_claim(s, "history", "history-writer", time.time()) if not s.producers else None,
    ).state
    for first in range(0, tgbs, TGBS_PER_VERSION):
        batch = [_descriptor(o) for o in range(first, min(tgbs, first + TGBS_PER_VERSION))]
        me = state.producers["history"]
        state = journal.commit(
            state, lambda s, b=batch, m=me: logrules.build_commit(s, "history", m, b, time.time())
        ).state
    return state


def _measure_batchweave(history: int, samples: int, seed: int) -> dict[str, Any]:
    url = f"memory://bench-cc-{uuid.uuid4().hex[:8]}"
    build_history(Store(url), history)
    store = LatencyStore(url, CLOUD_DEFAULTS, seed=seed, discard_prefix="data/")
    journal = Journal(store)
    started = time.perf_counter()
    journal.load_state()
    open_s, open_requests = time.perf_counter() - started, journal.requests
    windows = []
    with Producer(store, "probe", dp=SLICES, commit_policy=Manual(), background_commit=False, pack_steps=1) as producer:
        for _ in range(samples):
            producer.append([b"x" * 1000] * SLICES)
            producer.flush()
            windows.append(producer.metrics()["last_fragile_window_s"])
    return _record("batchweave", history, windows, open_s, open_requests)


def _measure_full_manifest(history: int, samples: int, seed: int) -> dict[str, Any]:
    """The paper's manifest: each version holds the whole TGB list, read then rewritten."""
    store = LatencyStore(f"memory://bench-fm-{uuid.uuid4().hex[:8]}", CLOUD_DEFAULTS, seed=seed)
    entry = log.encode(_descriptor(0))
    manifest = b"[" + b",".join([entry] * history) + b"]"
    Store(store.url).put_if_absent("manifest/00000001.json", manifest)
    windows = []
    for version in range(1, samples + 1):
        started = time.perf_counter()
        latest = store.get(f"manifest/{version:08d}.json")
        grown = bytes(latest[:-1]) + b"," + entry + b"]"
        store.put_if_absent(f"manifest/{version + 1:08d}.json", grown)
        windows.append(time.perf_counter() - started)
        Store(store.url).delete(f"manifest/{version:08d}.json")  # keep memory bounded
    started = time.perf_counter()
    store.get(f"manifest/{samples + 1:08d}.json")
    return _record("full-manifest", history, windows, time.perf_counter() - started, 1)


def _record(system: str, history: int, windows: list[float], open_s: float, open_requests: int) -> dict[str, Any]:
    ordered = sorted(windows)
    return {
        "system": system,
        "history_tgbs": history,
        "fragile_window_p50_s": statistics.median(ordered),
        "fragile_window_p95_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "open_s": open_s,
        "open_requests": open_requests,
        "samples": len(windows),
    }


def plot(result: BenchResult, figure: Any) -> None:
    axes = figure.subplots(1, 1)
    for system, style in (("batchweave", "o-"), ("full-manifest", "s--")):
        rows = [r for r in result.results if r["system"] == system]
        xs = [r["history_tgbs"] for r in rows]
        axes.plot(xs, [r["fragile_window_p50_s"] * 1e3 for r in rows], style, label=f"{system} p50")
        axes.plot(xs, [r["fragile_window_p95_s"] * 1e3 for r in rows], style, alpha=0.4, label=f"{system} p95")
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="committed history (TGBs)",
        ylabel="fragile window (ms)",
        title="commit cost as the log grows (latency model)",
    )
    axes.legend()
