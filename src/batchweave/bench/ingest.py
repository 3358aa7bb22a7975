"""Producer ingestion harness shared by ``bench dac`` and ``bench producers``.

N producers run as threads of this process, each the paper's single loop (Algorithm 1,
``background_commit=False``): write a TGB, and attempt a commit when the policy says so,
so time lost to failed commits is time not spent producing. After ``duration_s`` every
producer drains what it still holds (the algorithm's finalization phase).

Throughput is payload bytes committed over the whole run including the drain, so a
policy cannot look good by leaving work uncommitted; the in-window figure is reported
beside it. Commit success rate is successful attempts over all attempts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from batchweave.bench.report import BenchOptions
from batchweave.journal import Journal
from batchweave.latency import CLOUD_DEFAULTS, LatencyStore
from batchweave.producer import Producer
from batchweave.store import Store, open_store

__all__ = ["IngestSpec", "bench_store", "run_ingest"]


@dataclass(frozen=True, slots=True)
class IngestSpec:
    policy: str
    producers: int
    payload_bytes: int  # bytes of one TGB, split evenly over its slices
    duration_s: float
    tgb_slices: int = 8
    sample_s: float = 1.0


@contextmanager
def bench_store(options: BenchOptions, tag: str) -> Iterator[Store]:
    """A fresh namespace on the benchmark's store: the latency model, or moto S3."""
    name = f"bench-{tag}-{uuid.uuid4().hex[:8]}"
    if options.store == "latency":
        yield LatencyStore(f"memory://{name}", CLOUD_DEFAULTS, seed=options.seed, discard_prefix="data/")
        return
    if options.store == "local":
        directory = tempfile.mkdtemp(prefix=f"{name}-")
        try:
            yield open_store(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    from batchweave.bench.servers import moto_s3

    with moto_s3() as bucket_url:
        yield open_store(f"{bucket_url}/{name}")


def store_model(options: BenchOptions) -> dict[str, Any]:
    if options.store == "latency":
        return {"kind": "latency", **CLOUD_DEFAULTS.to_dict(), "data_objects": "timed, not kept"}
    if options.store == "local":
        return {"kind": "local", "where": "a temporary directory on this machine's disk"}
    return {"kind": "s3", "server": "moto on 127.0.0.1"}


def run_ingest(
    spec: IngestSpec, store: Store, on_sample: Callable[[dict[str, float]], None] | None = None
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Run one ingestion experiment; return its record and its time series."""
    producers = _start_producers(spec, store)
    slice_bytes = max(1, spec.payload_bytes // spec.tgb_slices)
    payloads = [[os.urandom(slice_bytes)] * spec.tgb_slices for _ in producers]
    stop = threading.Event()
    errors: list[str] = []
    series: list[dict[str, float]] = []
    started = time.monotonic()
    threads = [
        threading.Thread(target=_produce, args=(p, slices, stop, errors), daemon=True)
        for p, slices in zip(producers, payloads, strict=True)
    ]
    for thread in threads:
        thread.start()
    window = _sample_until(producers, started, spec, stop, series, on_sample)
    in_window = window["tgbs_committed"]
    stop.set()
    for thread in threads:
        thread.join()
    total_s = time.monotonic() - started
    totals = _totals(producers)
    state = Journal(store).load_state()
    for producer in producers:
        producer.close(flush=False)
    record = {
        "system": "batchweave",
        **asdict(spec),
        "drain_s": total_s - spec.duration_s,
        "tgbs_committed": totals["tgbs_committed"],
        "tgbs_in_window": in_window,
        "throughput_mb_s": totals["tgbs_committed"] * spec.payload_bytes / total_s / 1e6,
        "window_throughput_mb_s": in_window * spec.payload_bytes / spec.duration_s / 1e6,
        "commit_success_rate": _rate(totals),
        "window_commit_success_rate": _rate(window),
        "attempts": totals["attempts"],
        "window_attempts": window["attempts"],
        "conflicts": totals["conflicts"],
        "log_versions": state.version,
        "log_steps": state.steps,
        "error": errors[0] if errors else None,
    }
    return record, series


def _start_producers(spec: IngestSpec, store: Store) -> list[Producer]:
    """Claim every producer's epoch before the clock starts: start-up is not ingestion."""
    producers: list[Producer | None] = [None] * spec.producers

    def start(index: int) -> None:
        producers[index] = Producer(
            store, f"p{index:03d}", dp=spec.tgb_slices, commit_policy=spec.policy, background_commit=False
        )

    threads = [threading.Thread(target=start, args=(i,)) for i in range(spec.producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [p for p in producers if p is not None]


def _produce(producer: Producer, slices: list[bytes], stop: threading.Event, errors: list[str]) -> None:
    try:
        while not stop.is_set():
            producer.append(slices)
        producer.flush()  # finalization: drain what is still pending
    except Exception as exc:  # noqa: BLE001 - recorded in the result, the run goes on
        errors.append(f"{producer.producer_id}: {type(exc).__name__}: {exc}")


def _sample_until(
    producers: list[Producer],
    started: float,
    spec: IngestSpec,
    stop: threading.Event,
    series: list[dict[str, float]],
    on_sample: Callable[[dict[str, float]], None] | None,
) -> dict[str, int]:
    """Sample the producers' counters until the window closes; return the last sample."""
    deadline = started + spec.duration_s
    totals = _totals(producers)
    while (now := time.monotonic()) < deadline:
        stop.wait(min(spec.sample_s, deadline - now))
        totals = _totals(producers)
        point = {"t_s": time.monotonic() - started, **totals}
        series.append(point)
        if on_sample is not None:
            on_sample(point)
    return totals


def _rate(totals: dict[str, int]) -> float:
    """Commit success rate; 1.0 when nothing was attempted (no attempt failed)."""
    return totals["successes"] / totals["attempts"] if totals["attempts"] else 1.0


def _totals(producers: list[Producer]) -> dict[str, float]:
    keys = ("tgbs_committed", "attempts", "successes", "conflicts")
    totals = dict.fromkeys(keys, 0.0)
    for producer in producers:
        metrics = producer.metrics()
        for key in keys:
            totals[key] += metrics[key]
    return {k: int(v) for k, v in totals.items()}
