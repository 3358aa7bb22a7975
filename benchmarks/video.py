"""``bench video``: how much data grows on its way to training as the model's configuration
changes (the paper's Fig. 1, its first figure), and how long preprocessing one sample takes.

**Robot video.** The data and the preprocessing are ``examples/lerobot_video.py``'s:
synthetic LeRobot episodes (three cameras of H.264 at 480x640, 30 FPS, a keyframe a
second, Parquet states and actions), decoded with PyAV from the keyframe before a
sample's first frame, each kept frame resized to ``image_size`` px (swscale), cut into
16 px patches and packed with the task text and state/action rows into one float16
sequence (``pack_sample``), sized to fit the configuration as a model of that
configuration would size it. The source episodes stay the same on every axis but the
first:

- *source CRF* (the paper's LeRobot axis): the same episodes encoded at several x264
  CRFs, preprocessed at the base configuration (224 px, 8 frames at 2 FPS);
- *resize x history* (the paper's GR00T axis): resize resolution times observation
  history, the number of consecutive 30 FPS frames per observation;
- *clip length*: frames per clip at 2 FPS, 224 px (the clip's frames and the packets
  read to decode them both grow, so the ratio barely moves).

``raw`` is what a sample reads: the compressed packets its decoders read (from the
keyframe before its first frame to its last frame, every camera) and its Parquet rows;
``ready`` is the packed sequence a producer publishes. The expansion is ready over raw.

**Image-text** (the paper's OpenCLIP panel): synthetic photo-like JPEGs with captions
(``benchmarks/expansion_images.py``), preprocessed by OpenCLIP's transform to float32
``[3, S, S]`` plus 77 int64 token ids at several resolutions; raw is the JPEG and caption.

**Latency.** Every row times each sample's preprocessing on one pinned core; the
``latency`` row takes every sample of the base packing (``examples/lerobot_video``'s
default 9,472-row sequence, as ``bench e2e --workload video`` trains on) under several
seeds and gives the spread: what a training step waits for when preprocessing is
colocated.

The source datasets are written first, on both cores at once; the measurements then run
one at a time, pinned to one core. Latencies depend on the machine (``load_1m`` is
recorded); the bytes do not.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.expansion_images import ImageTextSample, make_samples, preprocess, raw_bytes
from benchmarks.report import BenchOptions, BenchResult, machine
from examples.lerobot_video import (
    EpisodeSpec,
    SampleRef,
    SampleSpec,
    decode_sample,
    pack_sample,
    sample_refs,
    used_length,
    write_dataset,
)

NAME = "video"
COLUMNS = (
    "kind",
    "axis",
    "setting",
    "samples",
    "raw_kb_per_sample",
    "ready_kb_per_sample",
    "expansion",
    "latency_p50_s",
    "latency_p95_s",
    "latency_max_s",
)
BASE_CRF, BASE_RESOLUTION = 23, (480, 640)
CRF_AXIS, GRID_AXIS, CLIP_AXIS, CLIP_RESOLUTION_AXIS = "source CRF", "resize x history", "clip length", "resolution"
# The paper's ranges (Fig. 1), beside each of our axes.
PAPER_RANGES = {
    ("video", CRF_AXIS): "paper 62x-9,068x (LeRobot episodes, CRF varied)",
    ("image-text", CLIP_RESOLUTION_AXIS): "paper 2.6x-41.5x (OpenCLIP, 128-512 px)",
    ("video", GRID_AXIS): "paper 288x-5,263x (GR00T, resize 224-640 px, history 1-4)",
    ("video", CLIP_AXIS): "not in the paper",
}


@dataclass(frozen=True, slots=True)
class Setup:
    crfs: tuple[int, ...]  # source encodings of the CRF axis
    image_sizes: tuple[int, ...]  # resize resolutions (px) of the grid
    observations: tuple[int, ...]  # consecutive frames per observation of the grid
    clip_frames: tuple[int, ...]  # frames per clip at the base sample rate
    base_size: int  # resize resolution of the CRF and clip axes
    base_frames: int  # frames per clip of the CRF axis
    episodes: int  # per dataset
    clips_per_episode: int  # samples drawn at random starts per episode, per configuration
    latency_seeds: int  # sample lists drawn for the latency spread
    episode: EpisodeSpec  # the base source; the CRF axis re-encodes it
    sample: SampleSpec  # the base packing, for the latency spread
    images: int  # image-text samples
    image_shorter_side: tuple[int, int]  # of the source JPEGs, px
    clip_sizes: tuple[int, ...]  # image-text resolutions (px)


def setup(options: BenchOptions) -> Setup:
    if options.quick:
        # The plumbing: every axis, on tiny two-camera episodes and small images.
        return Setup(
            crfs=(18, 35),
            image_sizes=(16, 32),
            observations=(1, 2),
            clip_frames=(2, 4),
            base_size=16,
            base_frames=2,
            episodes=1,
            clips_per_episode=2,
            latency_seeds=2,
            episode=EpisodeSpec(cameras=2, height=48, width=64, fps=10, seconds=3.0, gop=10),
            sample=SampleSpec(frames=(2, 4), image_size=16, patch=8, text_tokens=8, seq_len=64),
            images=3,
            image_shorter_side=(48, 96),
            clip_sizes=(32, 64),
        )
    return Setup(
        crfs=(12, 18, 23, 28, 35, 43, 51),
        image_sizes=(96, 128, 224, 384),
        observations=(1, 2, 4, 8),
        clip_frames=(2, 4, 8, 16),
        base_size=224,
        base_frames=8,
        episodes=2,
        clips_per_episode=3,
        latency_seeds=20,
        episode=EpisodeSpec(height=BASE_RESOLUTION[0], width=BASE_RESOLUTION[1], seconds=10.0, crf=BASE_CRF),
        sample=SampleSpec(),  # 224 px, 8-16 frames at 2 FPS, 9472 rows of 772 float16
        images=48,
        image_shorter_side=(384, 768),
        clip_sizes=(64, 128, 224, 336, 448, 512),
    )


@dataclass(frozen=True, slots=True)
class VideoConfig:
    """One row of the video axes: the source encoding and what preprocessing makes of it."""

    axis: str
    setting: str
    episode: EpisodeSpec
    sample: SampleSpec


def fitted_sample(base: SampleSpec, cameras: int, image_size: int, frames: int, sample_fps: float) -> SampleSpec:
    """``base`` with exactly ``frames`` frames at ``image_size`` px, its sequence sized to hold them."""
    patches = (image_size // base.patch) ** 2
    rows = base.text_tokens + frames * (cameras * patches + 2)  # text, then per frame its patches, state, action
    return replace(base, frames=(frames, frames), image_size=image_size, sample_fps=sample_fps, seq_len=rows)


def video_configs(plan: Setup) -> list[VideoConfig]:
    """The CRF axis, the resize x history grid and the clip-length axis."""
    base, cameras, fps = plan.sample, plan.episode.cameras, plan.episode.fps
    at_base = fitted_sample(base, cameras, plan.base_size, plan.base_frames, base.sample_fps)
    configs = [VideoConfig(CRF_AXIS, f"CRF {crf}", replace(plan.episode, crf=crf), at_base) for crf in plan.crfs]
    for history in plan.observations:
        for size in plan.image_sizes:
            sample = fitted_sample(base, cameras, size, history, float(fps))
            setting = f"{size} px, {history}-frame history"
            configs.append(VideoConfig(GRID_AXIS, setting, plan.episode, sample))
    for frames in plan.clip_frames:
        sample = fitted_sample(base, cameras, plan.base_size, frames, base.sample_fps)
        setting = f"{frames} frames ({(frames - 1) / base.sample_fps:g} s)"
        configs.append(VideoConfig(CLIP_AXIS, setting, plan.episode, sample))
    return configs


def run(options: BenchOptions, progress: Any) -> BenchResult:
    plan = setup(options)
    configs = video_configs(plan)
    episodes = sorted({c.episode for c in configs} | {plan.episode}, key=repr)
    task = progress.add_task("bench video", total=len(episodes) + len(configs) + len(plan.clip_sizes) + 1)
    work = Path(tempfile.mkdtemp(prefix="bench-video-"))
    try:
        progress.update(task, description="video: writing episodes")
        roots = write_all(work, episodes, plan.episodes, options.seed, parallel=not options.quick)
        progress.advance(task, len(episodes))
        core = _preprocessing_core()
        results = []
        for config in configs:
            progress.update(task, description=f"video: {config.setting}")
            results.append(video_row(config, roots[config.episode], plan, options.seed, core))
            progress.advance(task)
        images = make_samples(plan.images, options.seed, plan.image_shorter_side)
        for size in plan.clip_sizes:
            progress.update(task, description=f"video: image-text {size} px")
            results.append(image_text_row(images, size, core))
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
        "ready_formats": {
            "video": "examples.lerobot_video.pack_sample, float16 rows of 4 + 3 * patch^2 values, sized to fit",
            "image-text": "float32 [3, S, S] (OpenCLIP transform) + int64 [77] token ids",
        },
        "paper_ranges": {f"{kind}: {axis}": text for (kind, axis), text in PAPER_RANGES.items()},
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


def timed_sample(root: Path, ref: SampleRef, sample: SampleSpec) -> dict[str, Any]:
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


def pinned(core: int, work: Callable[[], list[dict]]) -> tuple[list[dict], float]:
    """``work()`` run on ``core`` alone, and the 1-minute load average before it."""
    load_1m = os.getloadavg()[0]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        return work(), load_1m
    finally:
        os.sched_setaffinity(0, before)


def video_row(config: VideoConfig, root: Path, plan: Setup, seed: int, core: int) -> dict:
    """Every clip drawn for ``config`` (the same clips for every resolution), preprocessed and counted."""
    refs = sample_refs(root, config.sample, seed, per_episode=plan.clips_per_episode)
    timed, load_1m = pinned(core, lambda: [timed_sample(root, ref, config.sample) for ref in refs])
    episode, sample = config.episode, config.sample
    return {
        "kind": "video",
        "axis": config.axis,
        "setting": config.setting,
        "crf": episode.crf,
        "resolution": f"{episode.height}x{episode.width}",
        "image_size": sample.image_size,
        "frames": sample.frames[0],
        "sample_fps": sample.sample_fps,
        "clip_s": (sample.frames[0] - 1) / sample.sample_fps,
        "seq_len": sample.seq_len,
        **byte_counts(timed),
        **percentiles([t["latency_s"] for t in timed]),
        "load_1m": load_1m,
    }


def byte_counts(timed: list[dict]) -> dict[str, Any]:
    """Samples, raw and ready bytes (in all and per sample) and their ratio."""
    raw, ready = sum(t["raw_bytes"] for t in timed), sum(t["ready_bytes"] for t in timed)
    counts = {"samples": len(timed), "raw_bytes": raw, "ready_bytes": ready}
    counts |= {"raw_kb_per_sample": raw / len(timed) / 1e3, "ready_kb_per_sample": ready / len(timed) / 1e3}
    if "used_bytes" in timed[0]:
        counts["used_bytes"] = sum(t["used_bytes"] for t in timed)
    return counts | {"expansion": ready / raw}


def image_text_row(images: list[ImageTextSample], size: int, core: int) -> dict:
    """Every image-text sample through OpenCLIP's transform at ``size`` px, timed and counted."""

    def one(sample: ImageTextSample) -> dict:
        started = time.perf_counter()
        arrays = preprocess(sample, size)
        latency = time.perf_counter() - started
        ready = sum(array.nbytes for array in arrays.values())
        return {"latency_s": latency, "raw_bytes": raw_bytes(sample), "ready_bytes": ready}

    timed, load_1m = pinned(core, lambda: [one(sample) for sample in images])
    return {
        "kind": "image-text",
        "axis": CLIP_RESOLUTION_AXIS,
        "setting": f"{size} px",
        "image_size": size,
        **byte_counts(timed),
        **percentiles([t["latency_s"] for t in timed]),
        "load_1m": load_1m,
    }


def latency_spread(root: Path, plan: Setup, seed: int, core: int) -> tuple[dict, list[dict]]:
    """Every sample of the base dataset under ``plan.latency_seeds`` seeds, one at a time."""
    refs = [ref for s in range(plan.latency_seeds) for ref in sample_refs(root, plan.sample, seed + s)]
    timed, load_1m = pinned(core, lambda: [timed_sample(root, ref, plan.sample) for ref in refs])
    latencies = [t["latency_s"] for t in timed]
    record = {
        "kind": "latency",
        "axis": "base packing",
        "setting": "every sample",
        "crf": plan.episode.crf,
        "resolution": f"{plan.episode.height}x{plan.episode.width}",
        "image_size": plan.sample.image_size,
        **byte_counts(timed),
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


def ratio(value: float) -> str:
    """An expansion as the paper writes it: 2.6x, 41x, 9,068x."""
    return f"{value:.1f}x" if value < 10 else f"{value:,.0f}x"


def axis_rows(results: list[dict[str, Any]], kind: str, axis: str) -> list[dict[str, Any]]:
    return [r for r in results if r["kind"] == kind and r["axis"] == axis]


def verdict(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for (kind, axis), paper in PAPER_RANGES.items():
        rows = axis_rows(results, kind, axis)
        low, high = min(rows, key=lambda r: r["expansion"]), max(rows, key=lambda r: r["expansion"])
        lines.append(
            f"{kind}, {axis}: {ratio(low['expansion'])} ({low['setting']}) to {ratio(high['expansion'])} "
            f"({high['setting']}), {high['expansion'] / low['expansion']:.1f}-fold; {paper}"
        )
    latency = next(r for r in results if r["kind"] == "latency")
    lines.append(
        f"per-sample preprocessing latency of the base packing over {latency['samples']} samples: P50 "
        f"{latency['latency_p50_s']:.3f} s, P95 {latency['latency_p95_s']:.3f} s, "
        f"P99 {latency['latency_p99_s']:.3f} s, "
        f"max {latency['latency_max_s']:.3f} s (max/P50 {latency['latency_max_s'] / latency['latency_p50_s']:.1f}x); "
        f"decoding is {latency['decode_share']:.0%} of it, {latency['decoded_frames_per_kept_frame']:.1f} frames "
        "decoded per frame kept"
    )
    return lines


def plot(result: BenchResult, figure: Any) -> None:
    figure.set_size_inches(15, 8.5)
    panels = figure.subplot_mosaic([["crf", "clip_res", "grid"], ["length", "latency", "latency"]])
    rows = result.results
    figure.suptitle(
        "Paper Fig. 1: training-time preprocessing inflates data by configuration-dependent factors "
        "(ready-to-train bytes / raw bytes, log scale, one y scale for all four)",
        fontsize=12,
    )
    crf = axis_rows(rows, "video", CRF_AXIS)
    _ratio_line(panels["crf"], [r["crf"] for r in crf], crf, "x264 CRF of the source video")
    panels["crf"].set_title(f"(a) robot video, source CRF\n{PAPER_RANGES['video', CRF_AXIS]}", fontsize=9)
    images = axis_rows(rows, "image-text", CLIP_RESOLUTION_AXIS)
    _ratio_line(panels["clip_res"], [r["image_size"] for r in images], images, "training resolution (px)")
    panels["clip_res"].set_title(f"(b) image-text\n{PAPER_RANGES['image-text', CLIP_RESOLUTION_AXIS]}", fontsize=9)
    grid = axis_rows(rows, "video", GRID_AXIS)
    histories = sorted({r["frames"] for r in grid})
    for frames in histories:  # the top line's values above it, the others' below (near lines would collide)
        line = [r for r in grid if r["frames"] == frames]
        sizes = [r["image_size"] for r in line]
        above = frames == histories[-1]
        _ratio_line(panels["grid"], sizes, line, "resize resolution (px)", f"{frames}-frame history", above)
    panels["grid"].legend(fontsize=7, loc="upper left")
    panels["grid"].set_title(f"(c) robot video, resize x history\n{PAPER_RANGES['video', GRID_AXIS]}", fontsize=9)
    length = axis_rows(rows, "video", CLIP_AXIS)
    _ratio_line(panels["length"], [r["clip_s"] for r in length], length, "clip length (s) at 2 FPS")
    panels["length"].set_title("(d) robot video, clip length\n(frames and packets read grow together)", fontsize=9)
    # One y scale for the four, so that a flat axis looks flat and the ranges compare at a glance.
    ratios = [r["expansion"] for r in crf + images + grid + length]
    for name in ("clip_res", "grid", "length"):
        panels[name].sharey(panels["crf"])
    panels["crf"].set_ylim(min(1.0, min(ratios)) / 2, max(ratios) * 4)
    _latency_panel(panels["latency"], result)


def _ratio_line(
    axes: Any, xs: list[float], rows: list[dict], xlabel: str, label: str | None = None, above: bool = True
) -> None:
    """Expansion against a configuration value, each point annotated with its ratio; 1x (no growth) dashed."""
    ys = [r["expansion"] for r in rows]
    (drawn,) = axes.plot(xs, ys, marker="o", label=label)
    offset, align = ((0, 6), "bottom") if above else ((0, -8), "top")
    for x, y in zip(xs, ys, strict=True):  # in the line's colour, so a label near another line is still its own
        axes.annotate(
            ratio(y),
            (x, y),
            textcoords="offset points",
            xytext=offset,
            ha="center",
            va=align,
            fontsize=7,
            color=drawn.get_color(),
        )
    axes.axhline(1.0, color="tab:grey", linestyle="--", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_xlabel(xlabel)
    axes.set_ylabel("ready / raw (x, log)")
    axes.margins(x=0.1)


def _latency_panel(axes: Any, result: BenchResult) -> None:
    latencies = sorted(p["latency_s"] for p in result.series["latency"])
    axes.hist(latencies, bins=min(30, max(5, len(latencies) // 3)), color="tab:grey", alpha=0.6)
    axes.set(title="per-sample preprocessing latency, base packing", xlabel="seconds", ylabel="samples")
    cdf = axes.twinx()
    cdf.plot(latencies, np.arange(1, len(latencies) + 1) / len(latencies), color="tab:blue", label="CDF")
    cdf.set_ylim(0, 1.02)
    cdf.set_ylabel("fraction of samples")
    latency = next(r for r in result.results if r["kind"] == "latency")
    for key, colour in (("latency_p50_s", "tab:green"), ("latency_p95_s", "tab:orange"), ("latency_p99_s", "tab:red")):
        axes.axvline(latency[key], color=colour, linestyle=":", label=key.split("_")[1].upper())
    axes.legend(fontsize=8, loc="center right")
