"""``bench lifecycle``: stored bytes over a run with and without checkpoint-driven deletion
(paper Fig. 9: 1010 steps, a checkpoint every 10, ``max_lag=80``, the last few live).

One producer (``max_lag`` backpressure) and the ranks of a dp=2 job run as threads on a
local directory, so the bytes are real files. After each checkpoint every rank marks it,
checkpoints older than the last ``KEEP_LIVE`` are released, and with deletion on a
collector runs; stored bytes are sampled at every checkpoint boundary. The run checks its
own bound: the peak of stored TGBs with deletion against ``max_lag`` (``verdict``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any

from batchweave import collect_garbage, release_checkpoint
from batchweave.consumer import Consumer
from batchweave.producer import Producer, end_stream
from batchweave.store import open_store
from benchmarks.report import BenchOptions, BenchResult, machine

NAME = "lifecycle"
COLUMNS = ("deletion", "step", "bytes_stored", "tgbs_stored")
INTERVAL = 10
MAX_LAG = 80
KEEP_LIVE = 3
DP = 2
TGB_BYTES = 100_000
# Invariant I12: the TGBs at or above W_global, committed or only uploaded, stay within
# max_lag; the collector runs at every checkpoint, so none below W_global stays stored
# past the checkpoint that moved it (each sample is taken right after the collection).
BOUND = MAX_LAG


def run(options: BenchOptions, progress: Any) -> BenchResult:
    steps = 210 if options.quick else 1010
    task = progress.add_task("bench lifecycle", total=2 * steps)
    results = []
    for deletion in (False, True):
        progress.update(task, description=f"lifecycle: deletion {'on' if deletion else 'off'}")
        results.extend(_run(steps, deletion, lambda: progress.advance(task)))
    config = {
        "steps": steps,
        "checkpoint_every": INTERVAL,
        "max_lag": MAX_LAG,
        "bound_tgbs": BOUND,
        "live_checkpoints": KEEP_LIVE,
        "dp": DP,
        "tgb_bytes": TGB_BYTES,
        "quick": options.quick,
        "store": {"kind": "local", "where": "a temporary directory on this machine's disk"},
        "machine": machine(),
    }
    return BenchResult(NAME, config, results, COLUMNS, summary=verdict(results))


def verdict(results: list[dict[str, Any]]) -> list[str]:
    peak = {d: max(r["bytes_stored"] for r in results if r["deletion"] == d) for d in (False, True)}
    peak_tgbs = max(r["tgbs_stored"] for r in results if r["deletion"])
    held = "held" if peak_tgbs <= BOUND else "BROKEN"
    return [
        f"peak stored: {peak[True] / 1e6:.1f} MB with deletion vs {peak[False] / 1e6:.1f} MB without "
        f"({1 - peak[True] / peak[False]:.1%} reduction; paper 72.0%)",
        f"peak TGBs stored with deletion: {peak_tgbs} (bound max_lag = {BOUND}: {held})",
    ]


def _run(steps: int, deletion: bool, tick: Any) -> list[dict[str, Any]]:
    directory = tempfile.mkdtemp(prefix="bench-lifecycle-")
    try:
        url = directory
        payload = [os.urandom(TGB_BYTES // DP)] * DP
        producer_done = threading.Event()

        def produce() -> None:
            with Producer(url, "prep", dp=DP, max_lag=MAX_LAG, pack_steps=1) as producer:
                for _ in range(steps):
                    producer.append(payload)
            end_stream(url)
            producer_done.set()

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        records = []
        consumers = [Consumer(url, dp=DP, rank=r, timeout_s=120) for r in range(DP)]
        for step in range(1, steps + 1):
            for consumer in consumers:
                next(consumer)
            tick()
            if step % INTERVAL == 0:
                records.append(_checkpoint(url, consumers, step, deletion))
        for consumer in consumers:
            consumer.close()
        thread.join(120)
        return records
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _checkpoint(url: str, consumers: list[Consumer], step: int, deletion: bool) -> dict[str, Any]:
    name = f"step-{step:06d}"
    for consumer in consumers:
        consumer.mark_checkpoint(name)
    old = step - INTERVAL * KEEP_LIVE
    if old > 0:
        release_checkpoint(url, f"step-{old:06d}")
    if deletion:
        collect_garbage(url, grace_s=0)
    data = [o for o in open_store(url).list("data/")]
    return {
        "deletion": deletion,
        "step": step,
        "bytes_stored": sum(o.size for o in data),
        "tgbs_stored": len(data),
    }


def plot(result: BenchResult, figure: Any) -> None:
    axes = figure.subplots(1, 1)
    for deletion in (False, True):
        rows = [r for r in result.results if r["deletion"] == deletion]
        axes.plot(
            [r["step"] for r in rows],
            [r["bytes_stored"] / 1e6 for r in rows],
            label="deletion on" if deletion else "deletion off",
        )
    axes.set(
        xlabel="training step", ylabel="stored TGB bytes (MB)", title="checkpoint-driven reclamation (paper Fig. 9)"
    )
    axes.legend()
