"""``bench video``: how much robot-episode video grows on its way to training, and how
long preprocessing one sample takes (the paper's Fig. 2 and its per-sample latency spread).

The data and the preprocessing are ``examples/lerobot_video.py``'s: synthetic LeRobot
episodes (three cameras of H.264, 30 FPS, a keyframe a second, Parquet states and
actions) and, per sample, 8 to 16 frames at 2 FPS decoded from the keyframe before the
first one, resized to 224 px, cut into 16 px patches and packed with the task text and
the state/action windows into one fixed-length sequence of ``[9472, 772]`` float16.

**Expansion.** For each setting, one factor changed at a time from a base (CRF 23,
480x640, history 2): the CRF (18, 23, 28, 35), the camera resolution (480x640,
240x320) and the state/action history (1, 2, 4). ``raw`` is what a sample reads: the
compressed packets its decoder reads (from the keyframe before its first frame to its
last frame, every camera) and its Parquet rows; ``ready`` is the packed sequence as a
producer publishes it; ``used`` is its rows that are not padding (a shorter sample is
padded to the fixed length). The expansion is ready (or used) bytes over raw bytes.
``episode_bytes`` is the whole files of the episodes touched, for scale (the samples of
several seeds overlap in them, so it is no denominator). (These are the
bytes ``examples.lerobot_video.expansion`` counts; the benchmark takes them from the
decoded samples it times rather than decoding every sample twice.)

**Latency.** Every sample of the base dataset under several seeds (each seed cuts the
episodes into other windows: other frame counts, other distances from the keyframe),
preprocessed one at a time on one core (the preprocessing node's), timed in two parts:
decoding (demux, decode, resize, read the Parquet rows) and packing. Its spread is the
point: what a training step waits for when the preprocessing is colocated.

The datasets are written first, on both cores at once; the measurements then run one at
a time, pinned to one core. Absolute latencies depend on the machine (and on whatever
else runs on it: ``load_1m`` is recorded); the bytes do not.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import BenchOptions, BenchResult, machine
from examples.lerobot_video import (
    EpisodeSpec,
    SampleSpec,
    camera_keys,
    decode_sample,
    episode_data_path,
    episode_video_path,
    pack_sample,
    sample_refs,
    used_length,
    write_dataset,
)

NAME = "video"
COLUMNS = (
    "kind",
    "setting",
    "crf",
    "resolution",
    "history",
    "samples",
    "raw_kb_per_sample",
    "ready_kb_per_sample",
    "used_kb_per_sample",
    "expansion",
    "expansion_used",
    "latency_p50_s",
    "latency_p95_s",
    "latency_p99_s",
    "latency_max_s",
)
BASE_CRF, BASE_RESOLUTION, BASE_HISTORY = 23, (480, 640), 2


@dataclass(frozen=True, slots=True)
class Setup:
    crfs: tuple[int, ...]
    resolutions: tuple[tuple[int, int], ...]  # (height, width); the first is the base
    histories: tuple[int, ...]
    episodes: int  # per dataset
    seconds: float  # per episode
    setting_seeds: int  # sample lists drawn for each setting's row (each cuts other windows)
    latency_seeds: int  # sample lists drawn for the latency spread
    episode: EpisodeSpec
    sample: SampleSpec


def setup(options: BenchOptions) -> Setup:
    if options.quick:
        # The plumbing: every setting, on tiny two-camera episodes.
        return Setup(
            crfs=(18, 23, 28, 35),
            resolutions=((48, 64), (24, 32)),
            histories=(1, 2, 4),
            episodes=1,
            seconds=3.0,
            setting_seeds=1,
            latency_seeds=2,
            episode=EpisodeSpec(cameras=2, height=48, width=64, fps=10, seconds=3.0, gop=10),
            sample=SampleSpec(frames=(2, 4), image_size=16, patch=8, text_tokens=8, seq_len=64),
        )
    return Setup(
        crfs=(18, 23, 28, 35),
        resolutions=(BASE_RESOLUTION, (240, 320)),
        histories=(1, 2, 4),
        episodes=2,
        seconds=10.0,
        setting_seeds=3,
        latency_seeds=20,
        episode=EpisodeSpec(height=BASE_RESOLUTION[0], width=BASE_RESOLUTION[1], seconds=10.0, crf=BASE_CRF),
        sample=SampleSpec(history=BASE_HISTORY),  # 224 px, patch 16, 9472 rows of 772 float16
    )


def settings(plan: Setup) -> list[tuple[str, EpisodeSpec, SampleSpec]]:
    """(name, episodes, samples) of each row: one factor at a time from the base."""
    base_episode, base_sample = plan.episode, plan.sample
    rows = [(_crf_name(crf, base_episode), replace(base_episode, crf=crf), base_sample) for crf in plan.crfs]
    for height, width in plan.resolutions[1:]:
        rows.append((f"{height}x{width}", replace(base_episode, height=height, width=width), base_sample))
    for history in plan.histories:
        if history != base_sample.history:
            rows.append((f"history {history}", base_episode, replace(base_sample, history=history)))
    return rows


def _crf_name(crf: int, base: EpisodeSpec) -> str:
    return f"crf {crf} (base)" if crf == base.crf else f"crf {crf}"


def run(options: BenchOptions, progress: Any) -> BenchResult:
    plan = setup(options)
    rows = settings(plan)
    episodes = sorted({spec for _, spec, _ in rows}, key=repr)
    task = progress.add_task("bench video", total=len(episodes) + len(rows) + 1)
    work = Path(tempfile.mkdtemp(prefix="bench-video-"))
    try:
        progress.update(task, description="video: writing episodes")
        roots = write_all(work, episodes, plan.episodes, options.seed, parallel=not options.quick)
        progress.advance(task, len(episodes))
        core = _preprocessing_core()
        results = []
        for name, episode, sample in rows:
            progress.update(task, description=f"video: {name}")
            results.append(expansion_row(name, roots[episode], episode, sample, plan, options.seed, core))
            progress.advance(task)
        progress.update(task, description="video: latency spread")
        latency, series = latency_spread(roots[plan.episode], plan, options.seed, core)
        results.append(latency)
        progress.advance(task)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    config = {
        **asdict(plan),
        "base": {"crf": BASE_CRF, "resolution": f"{plan.episode.height}x{plan.episode.width}"},
        "packed_row": {"rows": plan.sample.seq_len, "width": plan.sample.row_width, "dtype": plan.sample.dtype},
        "pinned_core": core,
        "quick": options.quick,
        "store": {"kind": "none", "where": "files in a temporary directory (--store is ignored)"},
        "machine": machine(),
    }
    return BenchResult(NAME, config, results, COLUMNS, summary=verdict(results), series={"latency": series})


def write_all(work: Path, episodes: list[EpisodeSpec], count: int, seed: int, parallel: bool) -> dict:
    """Write one dataset per episode spec (on both cores at once unless ``parallel`` is off)."""
    roots = {spec: work / f"dataset-{index}" for index, spec in enumerate(episodes)}
    jobs = [(roots[spec], count, spec, seed) for spec in episodes]
    if not parallel:
        for job in jobs:
            write_dataset(*job)
        return roots
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_write, jobs))
    return roots


def _write(job: tuple) -> None:
    write_dataset(*job)


def _preprocessing_core() -> int:
    """The core measurements run on: the second usable one, as bench e2e's preprocessing node."""
    usable = sorted(os.sched_getaffinity(0))
    return usable[1 % len(usable)]


def timed_sample(root: Path, ref: Any, sample: SampleSpec) -> dict[str, Any]:
    """Preprocess one sample, timing the decode and the packing; its bytes."""
    started = time.perf_counter()
    decoded = decode_sample(root, ref, sample)
    decoded_at = time.perf_counter()
    packed = pack_sample(decoded, sample)
    done = time.perf_counter()
    return {
        "decode_s": decoded_at - started,
        "pack_s": done - decoded_at,
        "latency_s": done - started,
        "frames": ref.frames,
        "decoded_frames": decoded.decoded_frames,
        "raw_bytes": decoded.raw_bytes,
        "ready_bytes": packed.nbytes,
        "used_bytes": used_length(packed) * packed.shape[1] * packed.itemsize,
    }


def _pinned(core: int):
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    return before


def expansion_row(
    name: str, root: Path, episode: EpisodeSpec, sample: SampleSpec, plan: Setup, seed: int, core: int
) -> dict:
    refs = [ref for s in range(plan.setting_seeds) for ref in sample_refs(root, sample, seed + s)]
    load_1m = os.getloadavg()[0]
    before = _pinned(core)
    try:
        timed = [timed_sample(root, ref, sample) for ref in refs]
    finally:
        os.sched_setaffinity(0, before)
    raw, ready, used = (sum(t[key] for t in timed) for key in ("raw_bytes", "ready_bytes", "used_bytes"))
    whole = episode_bytes(root, episode, {ref.episode for ref in refs})
    return {
        "kind": "expansion",
        "setting": name,
        "crf": episode.crf,
        "resolution": f"{episode.height}x{episode.width}",
        "history": sample.history,
        "samples": len(refs),
        "raw_bytes": raw,
        "episode_bytes": whole,
        "ready_bytes": ready,
        "used_bytes": used,
        "raw_kb_per_sample": raw / len(refs) / 1e3,
        "ready_kb_per_sample": ready / len(refs) / 1e3,
        "used_kb_per_sample": used / len(refs) / 1e3,
        "expansion": ready / raw,
        "expansion_used": used / raw,
        **percentiles([t["latency_s"] for t in timed]),
        "load_1m": load_1m,
    }


def episode_bytes(root: Path, episode: EpisodeSpec, episodes: set[int]) -> int:
    """The whole MP4 and Parquet files of ``episodes``."""
    total = 0
    for index in episodes:
        total += (root / episode_data_path(index)).stat().st_size
        total += sum((root / episode_video_path(index, key)).stat().st_size for key in camera_keys(episode.cameras))
    return total


def latency_spread(root: Path, plan: Setup, seed: int, core: int) -> tuple[dict, list[dict]]:
    """Every sample of the base dataset under ``plan.latency_seeds`` seeds, one at a time."""
    refs = [ref for s in range(plan.latency_seeds) for ref in sample_refs(root, plan.sample, seed + s)]
    load_1m = os.getloadavg()[0]
    before = _pinned(core)
    try:
        timed = [timed_sample(root, ref, plan.sample) for ref in refs]
    finally:
        os.sched_setaffinity(0, before)
    latencies = [t["latency_s"] for t in timed]
    record = {
        "kind": "latency",
        "setting": "base, every sample",
        "crf": plan.episode.crf,
        "resolution": f"{plan.episode.height}x{plan.episode.width}",
        "history": plan.sample.history,
        "samples": len(timed),
        **percentiles(latencies),
        "latency_mean_s": float(np.mean(latencies)),
        "decode_share": sum(t["decode_s"] for t in timed) / sum(latencies),
        "decoded_frames_per_kept_frame": sum(t["decoded_frames"] for t in timed)
        / sum(t["frames"] * plan.episode.cameras for t in timed),
        "load_1m": load_1m,
    }
    return record, timed


def percentiles(latencies_s: list[float]) -> dict[str, float]:
    """P50, P95, P99 (nearest rank) and the maximum, in seconds."""
    ordered = sorted(latencies_s)

    def nearest_rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

    return {
        "latency_p50_s": nearest_rank(0.50),
        "latency_p95_s": nearest_rank(0.95),
        "latency_p99_s": nearest_rank(0.99),
        "latency_max_s": ordered[-1],
    }


def verdict(results: list[dict[str, Any]]) -> list[str]:
    grown = [r for r in results if r["kind"] == "expansion"]
    latency = next(r for r in results if r["kind"] == "latency")
    low, high = min(grown, key=lambda r: r["expansion"]), max(grown, key=lambda r: r["expansion"])
    return [
        f"ready-to-train bytes are {low['expansion']:.0f}x ({low['setting']}) to {high['expansion']:.0f}x "
        f"({high['setting']}) the compressed bytes a sample reads; counting only rows in use "
        f"{min(r['expansion_used'] for r in grown):.0f}x to {max(r['expansion_used'] for r in grown):.0f}x",
        f"per-sample preprocessing latency over {latency['samples']} samples: P50 {latency['latency_p50_s']:.3f} s, "
        f"P95 {latency['latency_p95_s']:.3f} s, P99 {latency['latency_p99_s']:.3f} s, max "
        f"{latency['latency_max_s']:.3f} s (max/P50 {latency['latency_max_s'] / latency['latency_p50_s']:.1f}x); "
        f"decoding is {latency['decode_share']:.0%} of it, {latency['decoded_frames_per_kept_frame']:.1f} frames "
        "decoded per frame kept",
    ]


def plot(result: BenchResult, figure: Any) -> None:
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    grown = [r for r in result.results if r["kind"] == "expansion"]
    names = [r["setting"] for r in grown]
    x = np.arange(len(grown))
    left.bar(x - 0.2, [r["expansion"] for r in grown], 0.4, label="ready / raw (as published)")
    left.bar(x + 0.2, [r["expansion_used"] for r in grown], 0.4, label="used rows / raw")
    left.set_xticks(x, names, rotation=30)
    left.set_yscale("log")
    left.set(title="expansion: ready-to-train bytes over raw bytes (paper Fig. 2)", ylabel="x (log)")
    left.legend(fontsize=8)
    latencies = sorted(p["latency_s"] for p in result.series["latency"])
    right.hist(latencies, bins=min(30, max(5, len(latencies) // 3)), color="tab:grey", alpha=0.6)
    right.set(title="per-sample preprocessing latency", xlabel="seconds", ylabel="samples")
    cdf = right.twinx()
    cdf.plot(latencies, np.arange(1, len(latencies) + 1) / len(latencies), color="tab:blue", label="CDF")
    cdf.set_ylim(0, 1.02)
    cdf.set_ylabel("fraction of samples")
    latency = next(r for r in result.results if r["kind"] == "latency")
    for key, colour in (("latency_p50_s", "tab:green"), ("latency_p95_s", "tab:orange"), ("latency_p99_s", "tab:red")):
        right.axvline(latency[key], color=colour, linestyle=":", label=key.split("_")[1].upper())
    right.legend(fontsize=8, loc="center right")
