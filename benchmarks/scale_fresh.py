"""How fresh the data is at the head of a large job: real consumers of a full mesh, one
node of them started (issue 29, "fresh data at 10,000 ranks").

A job of R ranks is R / 8 nodes of 8 (tp = 8 within a node, dp = R / 8). Its node
followers share the head budget (``reading.polling``: about 70 requests a second on
each of a version's keys, its own and its ``HEAD_COPIES`` copies, ``journal.headcopies``),
so each probes about every ``nodes / 70 / (copies + 1)`` seconds. One node's 8 ranks run
here for real, with node sharing, as that node's share of the job: the same pauses,
requests and proofs as in the job, on the counting latency model (whose store keeps
copies, as an object store does), while a committer commits one TGB a step at
``steps_per_s``. Recorded:

- commit-to-delivery: seconds from a version's put until the node's rank 0 has the step
  (P50, P95), for the steps committed in the window;
- the node's requests per second, and per version key and copy (its probes before the
  version exists, its read, its proofs);
- the job's requests on one of those keys: every node does the same, at random over the
  version's keys, within about a commit interval and a pause of the commit (its probes
  and its read), plus the proofs, at random over the last ``ANCHOR_SPREAD`` versions.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchweave.commit.policies import Manual
from batchweave.latency import CLOUD_DEFAULTS, LatencyModel
from batchweave.producer import Producer
from batchweave.reading.follower import ANCHOR_SPREAD
from batchweave.reading.polling import HEAD_BUDGET_PER_S, HeadPolling
from benchmarks.scale_count import (
    HEAD_COPY,
    LOG_CLASSES,
    LOG_NEXT,
    LOG_VERSION,
    CountingStore,
    Tally,
    hottest_key_windows,
)
from benchmarks.scale_measure import MeasureConfig, Ranks

__all__ = ["FRESH_TARGET_S", "FreshConfig", "freshness"]

RANKS_PER_NODE = 8
FRESH_TARGET_S = 3.0  # P95 commit-to-delivery (issue 29)


@dataclass(frozen=True, slots=True)
class FreshConfig:
    sizes: tuple[int, ...] = (1_024, 10_000)
    steps_per_s: float = 3.0
    pauses: float = 4.0  # the window, in the node's mean pauses at the head (at least min_window_s)
    min_window_s: float = 20.0
    model: LatencyModel = CLOUD_DEFAULTS

    @classmethod
    def quick(cls) -> FreshConfig:
        return cls(sizes=(64,), pauses=2.0, min_window_s=2.0)


def freshness(ranks: int, config: FreshConfig) -> dict[str, Any]:
    """One node's 8 ranks of a ``ranks``-rank job at the head while versions arrive."""
    dp, nodes = ranks // RANKS_PER_NODE, ranks // RANKS_PER_NODE
    url = f"memory://scale-fresh-{uuid.uuid4().hex}"
    tally = Tally()
    store = CountingStore(url, tally, "committer", config.model)  # an object store's model: it keeps copies
    producer = Producer(store, "p0", dp=dp, commit_policy=Manual(), pack_steps=1)
    slices = [{"x": np.full(8, d % 256, dtype=np.uint8)} for d in range(dp)]
    committed_at: dict[int, float] = {}

    def commit(step: int) -> None:
        producer.append(slices, source_offset=step)
        producer.flush()
        committed_at[step] = time.time()  # the version's put has returned

    commit(0)
    node = Ranks(url, tally, MeasureConfig(dp=dp, tp=RANKS_PER_NODE), sharing=True, started=RANKS_PER_NODE)
    node.start()
    node.wait_for(1, timeout_s=60 + 2 * nodes / HEAD_BUDGET_PER_S)  # the node's start pause, then step 0
    polling = HeadPolling(nodes, copies=store.head_copies)  # as the node's pipeline makes it
    pause_s = max(0.01, polling.probe_floor_s)
    window_s = max(config.min_window_s, config.pauses * pause_s)
    stop = threading.Event()
    steps = [1]

    def commit_steadily() -> None:
        due = time.monotonic()
        while not stop.wait(max(0.0, due - time.monotonic())):
            commit(steps[0])
            steps[0] += 1
            due += 1.0 / config.steps_per_s

    committer = threading.Thread(target=commit_steadily, daemon=True)
    start, wall_start = time.monotonic(), time.time()
    committer.start()
    time.sleep(window_s)
    stop.set()
    committer.join()
    end = time.monotonic()
    last = steps[0] - 1
    node.wait_for(last + 1, timeout_s=60 + 4 * pause_s)  # every step of the window delivered
    node.close()
    producer.close()
    delays = [node.delivered[s] - committed_at[s] for s in range(1, last + 1) if committed_at[s] >= wall_start]
    requests = tally.between(start, end, "consumer")
    seconds = end - start
    hot_max, hot_mean, hot_key = hottest_key_windows(requests)
    log = [r for r in requests if r.key_class in LOG_CLASSES]
    # Requests of the node on the keys of each version (its own and its copies): probes
    # before the version exists and its read, each to one of the version's keys at random,
    # land on them within about a commit interval and a pause of the commit at every node;
    # proofs re-read versions read before, each one of the last ANCHOR_SPREAD (with
    # copies) at random.
    on_version_keys = [r for r in requests if r.key_class in (LOG_VERSION, LOG_NEXT, HEAD_COPY)]
    read_before: set[str] = set()
    proofs = 0
    for request in on_version_keys:
        if request.found and request.key in read_before and request.key.startswith("_log/"):
            proofs += 1
        elif request.found:
            read_before.add(request.key)
    per_version = (len(on_version_keys) - proofs) / max(1, len(delays))
    per_version_key = Counter(r.key for r in on_version_keys)
    per_key = sum(per_version_key.values()) / len(per_version_key) if per_version_key else 0.0
    keys = polling.copies + 1
    spread_s = max(1.0, pause_s + 1.0 / config.steps_per_s)
    anchors = ANCHOR_SPREAD if polling.copies else 1
    job_key_per_s = nodes * per_version / keys / spread_s + nodes * proofs / seconds / anchors
    p50, p95 = np.percentile(delays, [50, 95]) if delays else (float("nan"), float("nan"))
    return {
        "state": "at the head, commits flowing",
        "ranks": ranks,
        "nodes": nodes,
        "how": "measured (one node of the job)",
        "pause_s": pause_s,
        "copies": polling.copies,
        "node_copy_reads_per_s": sum(r.key_class == HEAD_COPY for r in requests) / seconds,
        "window_s": seconds,
        "steps": len(delays),
        "fresh_p50_s": float(p50),
        "fresh_p95_s": float(p95),
        "fresh_max_s": max(delays, default=float("nan")),
        "node_requests_per_s": len(requests) / seconds,
        "node_log_per_s": len(log) / seconds,
        "node_hot_key_per_s": hot_max,
        "node_hot_key_mean_per_s": hot_mean,
        "node_hot_key": hot_key,
        "node_requests_per_version_key": per_key,
        "node_requests_per_version": per_version,
        "node_proofs_per_s": proofs / seconds,
        # every node alike, at random over the version's keys and the anchors
        "job_version_key_per_s": job_key_per_s,
        "job_log_per_s": len(log) / seconds * nodes,
        "met": bool(p95 <= FRESH_TARGET_S),
    }
