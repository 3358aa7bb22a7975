"""``bench node-sharing``: the ranks of one node reading with and without node sharing.

One node's 8 ranks (threads of this process, as 8 torchrun workers would be processes)
read every step of a namespace on the latency model, side by side with sharing off
(every rank follows the log and reads its own slice) and on (one hub per node:
``batchweave.reading.node``). Two meshes: dp 2 x tp 4 (four ranks read each slice) and dp 8
(no slice shared: only the log is). Per row: store requests per step for the node
(range reads, log GETs), bytes read from the store, and two timings:

- *flat out*: the wall time for every rank to read every step as fast as it can (the
  node's capacity; here all ranks share one Python interpreter, and with it the hub's
  work, which in a job runs in one rank's process beside the others);
- *paced*: every rank spends ``STEP_S`` per step "training" (a sleep) and the seconds
  ``next()`` waited for data after the first step are the GPU's stall.

Each pair alternates ``rounds`` times; medians are compared.

Targets (issue 19): store reads per node per step = distinct slices on the node; log
requests per node = one follower's (at most 1/8 of today's at 8 ranks per node); and
no slower than without sharing (time ratio about 1).
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np

from batchweave.commit.policies import Manual
from batchweave.consumer import Consumer
from batchweave.producer import Producer, end_stream
from benchmarks.report import BenchOptions, BenchResult, machine
from benchmarks.scale_count import DATA, LOG_CLASSES, CountingStore, Tally, by_class

NAME = "node-sharing"
RANKS_PER_NODE = 8
STEP_S = 0.02  # paced: a training step's compute (50 steps a second, faster than most jobs)
MESHES = ((2, 4), (8, 1))  # (dp, tp) of one node
COLUMNS = (
    "mesh",
    "slice_kb",
    "sharing",
    "steps",
    "range_reads_per_step",
    "log_gets_per_step",
    "store_mb",
    "seconds",
    "time_ratio",
    "paced_stall_s",
    "reads_ratio",
    "log_ratio",
)


def run(options: BenchOptions, progress: Any) -> BenchResult:
    steps = 12 if options.quick else 150
    rounds = 1 if options.quick else 3
    slice_sizes = (64 << 10,) if options.quick else (64 << 10, 1 << 20)
    task = progress.add_task("bench node-sharing", total=len(MESHES) * len(slice_sizes))
    results: list[dict[str, Any]] = []
    for dp, tp in MESHES:
        for slice_bytes in slice_sizes:
            progress.update(task, description=f"node-sharing: dp {dp} x tp {tp}, {slice_bytes >> 10} KB slices")
            results.extend(_pair(dp, tp, slice_bytes, steps, rounds))
            progress.advance(task)
    summary = [
        f"{r['mesh']} {r['slice_kb']} KB: sharing reads {r['reads_ratio']:.2f}x the slices, "
        f"{r['log_ratio']:.2f}x the log requests; flat out {r['time_ratio']:.2f}x the time; paced, the "
        f"GPU waited {r['paced_stall_s']:.3f} s (without sharing {r['paced_stall_off_s']:.3f} s)"
        for r in results
        if r["sharing"] == "on"
    ]
    config = {
        "quick": options.quick,
        "store": "latency",
        "ranks_per_node": RANKS_PER_NODE,
        "steps": steps,
        "rounds": rounds,
        "machine": machine(),
    }
    return BenchResult(NAME, config, results, COLUMNS, summary)


def _pair(dp: int, tp: int, slice_bytes: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    store = CountingStore(f"memory://bench/{uuid.uuid4().hex[:8]}", Tally(), "node")
    _fill(store, dp, slice_bytes, steps)
    measured: dict[bool, list[tuple[float, Counter[str]]]] = {False: [], True: []}
    stalls: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for sharing in (False, True):
            store.tally = Tally()  # the node's reads only
            seconds, _ = _read_node(store, dp, tp, sharing, 0.0)
            measured[sharing].append((seconds, by_class(store.tally.requests)))
            stalls[sharing].append(_read_node(store, dp, tp, sharing, STEP_S)[1])
    rows = {sharing: _row(dp, tp, slice_bytes, steps, sharing, runs) for sharing, runs in measured.items()}
    for sharing, row in rows.items():
        row["paced_stall_s"] = statistics.median(stalls[sharing])
    off, on = rows[False], rows[True]
    on["paced_stall_off_s"] = off["paced_stall_s"]
    for row in (off, on):
        row["time_ratio"] = row["seconds"] / off["seconds"]
        row["reads_ratio"] = row["range_reads_per_step"] / off["range_reads_per_step"]
        row["log_ratio"] = row["log_gets_per_step"] / max(off["log_gets_per_step"], 1e-9)
    return [off, on]


def _row(dp: int, tp: int, slice_bytes: int, steps: int, sharing: bool, runs: list) -> dict[str, Any]:
    seconds = statistics.median(s for s, _ in runs)
    counts = runs[-1][1]  # requests by key class
    return {
        "mesh": f"dp {dp} x tp {tp}",
        "slice_kb": slice_bytes >> 10,
        "sharing": "on" if sharing else "off",
        "steps": steps,
        "range_reads_per_step": counts[DATA] / steps,  # every data request is one slice's range read
        "log_gets_per_step": sum(counts[c] for c in LOG_CLASSES) / steps,
        "store_mb": counts[DATA] * slice_bytes / 1e6,
        "seconds": seconds,
    }


def _fill(store: CountingStore, dp: int, slice_bytes: int, steps: int) -> None:
    """``steps`` TGBs of ``dp`` slices, each in objects of its own (what the hub shares is one
    read per slice and step; packs would make it one per pack for hub and ranks alike),
    committed in versions of 8 TGBs."""
    elements = slice_bytes // 4
    with Producer(store, "bench", dp=dp, commit_policy=Manual(), pack_steps=1) as producer:
        for step in range(steps):
            slices = [{"x": np.full(elements, step * dp + d, dtype=np.float32)} for d in range(dp)]
            producer.append(slices, source_offset=step)
            if step % 8 == 7:
                producer.flush()
    end_stream(store)


def _read_node(store: CountingStore, dp: int, tp: int, sharing: bool, step_s: float) -> tuple[float, float]:
    """Seconds for the node's ranks (threads) to read every step, each checking its data
    and spending ``step_s`` per step; and the most any rank's ``next()`` waited after
    its first step."""
    failures: list[BaseException] = []
    stalls: list[float] = []
    done = threading.Barrier(RANKS_PER_NODE)

    def rank_reads(rank: int) -> None:
        try:
            consumer = Consumer(
                store,
                dp=dp,
                tp=tp,
                rank=rank,
                local_rank=rank,
                local_world_size=RANKS_PER_NODE,
                node_sharing=sharing,
                timeout_s=60,
            )
            d = rank // tp
            first_wait = None
            for batch in consumer:
                if batch.data["x"][0] != batch.step * dp + d:
                    raise AssertionError(f"rank {rank} step {batch.step}: wrong slice")
                if first_wait is None:
                    first_wait = consumer.metrics().wait_s
                if step_s:
                    time.sleep(step_s)  # the training step
            stalls.append(consumer.metrics().wait_s - (first_wait or 0.0))
            done.wait(60)  # a job's ranks stop together: a hub closing early would hand over
            consumer.close()
        except BaseException as exc:
            failures.append(exc)

    started = time.perf_counter()
    threads = [threading.Thread(target=rank_reads, args=(r,)) for r in range(RANKS_PER_NODE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - started, max(stalls)


def plot(result: BenchResult, figure: Any) -> None:
    on = [r for r in result.results if r["sharing"] == "on"]
    labels = [f"{r['mesh']}\n{r['slice_kb']} KB" for r in on]
    x = np.arange(len(on))
    ax = figure.add_subplot(1, 1, 1)
    width = 0.27
    for offset, column, label in (
        (-width, "reads_ratio", "slice reads (on / off)"),
        (0.0, "log_ratio", "log requests (on / off)"),
        (width, "time_ratio", "time to read (on / off)"),
    ):
        ax.bar_label(ax.bar(x + offset, [r[column] for r in on], width, label=label), fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(1 / RANKS_PER_NODE, color="grey", linestyle=":", linewidth=0.8, label="1/8")
    ax.set_xticks(x, labels)
    ax.set_ylabel("with node sharing / without")
    ax.set_title(f"One node of {RANKS_PER_NODE} ranks on the latency model, {result.config['steps']} steps")
    ax.legend()
