"""``bench e2e``: end-to-end training speed with three feeds (paper section 7.2, Fig. 5).

``--workload image`` (the default, described here) or ``--workload video``
(``benchmarks.e2e_video``: robot episodes decoded from H.264 and packed into multimodal
sequences; the paper's Fig. 5 trains on robot video too). Both go through the same
harness below: the same feeds, the same emulation of two nodes, the same figures; a
``Workload`` says what is trained on.

The same tiny ViT trains under torchrun (DDP, gloo on CPU) for the same number of steps on
the same global batch of JPEG images (decode, random-resized crop, flip, normalize: the
image half of ``examples/preprocess_images.py``, in ``benchmarks.e2e_train``), fed
three ways:

- ``dataloader-k=N``: a colocated ``DataLoader(num_workers=N)`` preprocessing on the
  training node, for each N tried (the best one is the baseline to beat);
- ``batchweave``: producer processes on a separate preprocessing node publish TGBs to a
  local-directory namespace while training runs; the rank reads with ``TGBDataset``;
- ``memory``: the batches preprocessed before the clock starts (the upper limit);
- ``memory+producers`` (full mode): the same, while producers work on the other core as
  for BatchWeave. The two cores share hardware: producers slow training by themselves
  (measured 6-11% on the development machine), which two real nodes would not, so this
  row is the limit the emulation can show for a feed whose producers run beside it.

Emulating the paper's nodes on one small machine, by CPU affinity: the training node is
core 0 (the trainer pins itself there with one torch thread; DataLoader workers inherit
the pin, so colocated preprocessing competes with training, as on a real node whose CPUs
train), and the preprocessing node is core 1 (producers are started pinned there). The
torchrun agent is not pinned: it only watches its ranks, and its start-up (importing
torch) then overlaps the rank's, before any step is timed. The producers start only when
the trainer is about to take its first step, so they get no head start, and have more
TGBs to make than training takes, so they publish until it ends; the first
``warmup`` steps of every run (worker start-up, first reads) are left out of the figures.
Limits of the emulation: the cores share caches, memory bandwidth and one disk (page
cache), so "the store" is a local directory read at memory speed, not a network hop; the
two cores are shared with whatever else runs on the machine, so absolute rates are noisy
and only ratios between runs mean much; and one training rank stands for a node, so
DDP's all-reduce is trivial. The consumer's own work (following the log, reading and
CRC-checking each slice) runs on the trainer's core, as it would on a training node, and
is part of what BatchWeave is charged.

Noise: ``trainer_cpu_share`` is the trainer process's CPU time over its wall time in the
timed steps. With the in-memory feed and BatchWeave nothing of ours shares the training
core, so a share well under 1 means other work on the machine took it (while our
producer keeps core 1 busy, the scheduler puts foreign work on core 0), and the ratios
then say more about the machine than about the feeds; ``load_1m`` is the load average
when each run started. Run the full benchmark on a quiet machine.

Sizes are tuned so that preprocessing a step costs about 60% of a training step on one
core: enough that a colocated DataLoader visibly slows training, little enough that one
producer core keeps ahead of the trainer.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from batchweave.journal import Journal
from batchweave.pool import PoolPlan, produce_shards
from batchweave.store import open_store
from benchmarks.e2e_train import preprocess_step, write_images
from benchmarks.report import BenchOptions, BenchResult, machine

NAME = "e2e"
COLUMNS = (
    "system",
    "steps",
    "steps_per_s",
    "step_p50_s",
    "step_p95_s",
    "data_wait_fraction",
    "vs_memory",
    "vs_best_dataloader",
    "vs_memory_with_producers",
    "producer_tgbs_per_s",
    "trainer_cpu_per_step_s",
    "trainer_cpu_share",
    "load_1m",
)
TARGET_VS_MEMORY = 0.95
PRODUCE_AHEAD = 2  # the producers have this many times the trainer's steps to make
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Setup:
    steps: int  # per run, warm-up included
    warmup: int  # first steps left out of the figures
    workers: tuple[int, ...]  # DataLoader worker counts tried
    per_step: int = 32  # global batch, images
    size: int = 64  # crop side
    patch: int = 8
    dim: int = 128
    layers: int = 2
    pool_images: int = 64  # distinct JPEG files; every (step, image) gets its own crop
    min_side: int = 320  # JPEG sides: the decode is the cost
    max_side: int = 480
    producers: int = 1
    ranks: int = 1  # one training rank per emulated training node


@dataclass(frozen=True, slots=True)
class Workload:
    """What ``bench e2e`` trains on; the harness (feeds, emulation, figures) is the same for all.

    ``plan`` has at least ``steps``, ``warmup``, ``per_step``, ``producers`` and ``ranks``.
    """

    name: str  # the result's name (its files' stem)
    plan: Any
    loaders: tuple[tuple[int, int | None], ...]  # colocated DataLoaders tried: (num_workers, prefetch_factor)
    prepare: Callable[[Path], None]  # write the raw data under the work directory (before any run)
    trainer_args: Callable[[Path], list[str]]  # benchmarks.e2e_train's options for this workload
    source: Callable[[Path, int], list[Any]]  # the producers' items for that many TGBs
    preprocess: Callable[[Any], list[dict[str, Any]]]  # item -> a TGB's slices (module level: spawn pickles it)
    describe: Callable[[], dict[str, Any]]  # the config's model and preprocessing entries


def workload(options: BenchOptions) -> Workload:
    if options.workload == "video":
        from benchmarks.e2e_video import video_workload

        return video_workload(options)
    return image_workload(options)


def image_workload(options: BenchOptions) -> Workload:
    plan = setup(options)
    return Workload(
        name=NAME,
        plan=plan,
        loaders=tuple((k, None) for k in plan.workers),
        prepare=partial(_write_images, plan, options.seed),
        trainer_args=partial(_image_trainer_args, plan),
        source=partial(_image_source, plan),
        preprocess=preprocess_step,
        describe=partial(_describe_images, plan),
    )


def _write_images(plan: Setup, seed: int, work: Path) -> None:
    write_images(work / "images", plan.pool_images, plan.min_side, plan.max_side, seed=seed)


def _image_trainer_args(plan: Setup, work: Path) -> list[str]:
    return [
        *("--images", str(work / "images"), "--per-step", str(plan.per_step), "--size", str(plan.size)),
        *("--patch", str(plan.patch), "--dim", str(plan.dim), "--layers", str(plan.layers)),
    ]


def _image_source(plan: Setup, work: Path, tgbs: int) -> list[Any]:
    return [(str(work / "images"), step, plan.per_step, plan.ranks, plan.size) for step in range(tgbs)]


def _describe_images(plan: Setup) -> dict[str, Any]:
    return {
        **asdict(plan),
        "workers": list(plan.workers),
        "model": f"ViT: {plan.size}px, patch {plan.patch}, dim {plan.dim}, {plan.layers} encoder layers",
        "preprocessing": f"JPEG decode ({plan.min_side}-{plan.max_side} px sides), random-resized crop, "
        "flip, normalize; examples/preprocess_images.py",
    }


def setup(options: BenchOptions) -> Setup:
    if options.quick:
        # The plumbing, not the figures: every feed once, a few steps of a smaller model on
        # smaller images. Each run's fixed cost (torchrun, torch imports, DDP set-up) is
        # most of its time anyway.
        return Setup(
            steps=5,
            warmup=2,
            workers=(1,),
            per_step=8,
            size=32,
            dim=32,
            layers=1,
            pool_images=8,
            min_side=96,
            max_side=128,
        )
    return Setup(steps=200, warmup=10, workers=(1, 2, 4))


def cores() -> tuple[set[int], set[int]]:
    """(training node, preprocessing node): the first two cores we may use."""
    usable = sorted(os.sched_getaffinity(0))
    return {usable[0]}, {usable[1 % len(usable)]}


def run(options: BenchOptions, progress: Any) -> BenchResult:
    chosen = workload(options)
    plan = chosen.plan
    # memory+producers: the in-memory feed while producers work on the other core, as for
    # BatchWeave. The two cores of one machine share caches and memory bandwidth (two nodes
    # would not): this is the limit the emulation can show, beside the plain one.
    no_loader = (0, None)
    loaded = () if options.quick else (("memory+producers", no_loader),)
    runs = [("memory", no_loader), *loaded, ("batchweave", no_loader), *(("dataloader", lo) for lo in chosen.loaders)]
    task = progress.add_task(f"bench {chosen.name}", total=len(runs))
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    results, series = [], {}
    try:
        progress.update(task, description=f"{chosen.name}: writing the data")
        chosen.prepare(work)

        def one_run(feed: str, loader: tuple[int, int | None]) -> tuple[str, list[dict], dict[str, Any]]:
            label = _label(feed, loader)
            progress.update(task, description=f"{chosen.name}: {label}")
            load_1m = os.getloadavg()[0]
            points, extra = train_once(chosen, work, feed, loader, label)
            extra["load_1m"] = load_1m
            progress.advance(task)
            return label, points, extra

        if options.quick:
            # --quick proves the plumbing only (its figures mean nothing), so its runs go at
            # once: each is mostly fixed start-up (torchrun and the rank importing torch,
            # DDP's set-up), which two cores then overlap. Each run has its own files and
            # namespace under ``work``. The full benchmark runs one feed at a time, alone.
            with ThreadPoolExecutor(max_workers=len(runs)) as pool:
                outcomes = list(pool.map(lambda r: one_run(*r), runs))
        else:
            outcomes = [one_run(feed, loader) for feed, loader in runs]
        for (feed, (workers, prefetch)), (label, points, extra) in zip(runs, outcomes, strict=True):
            record = {"system": label, "feed": feed, "workers": workers}
            if prefetch is not None:
                record["prefetch_factor"] = prefetch
            results.append({**record, **measure(points, plan.warmup), **extra})
            series[label] = points
    finally:
        shutil.rmtree(work, ignore_errors=True)
    compare(results)
    return BenchResult(chosen.name, config(chosen, options), results, COLUMNS, summary=verdict(results), series=series)


def _label(feed: str, loader: tuple[int, int | None]) -> str:
    workers, prefetch = loader
    if feed != "dataloader":
        return feed
    return f"dataloader-k={workers}" + ("" if prefetch is None else f"-pf={prefetch}")


# -- one training run -----------------------------------------------------------------


def train_once(
    chosen: Workload, work: Path, feed: str, loader: tuple[int, int | None], label: str
) -> tuple[list[dict], dict[str, Any]]:
    """Run the trainer under torchrun (and, for BatchWeave, the producers); return rank 0's
    per-step series and extra record fields."""
    plan, (workers, prefetch) = chosen.plan, loader
    trainer_cores, producer_cores = cores()
    out, ready, log = work / f"{label}.json", work / f"{label}.ready", work / f"{label}.log"
    url = str(work / f"namespace-{label}")
    # The namespace exists before the trainer opens it (readers never create one); the
    # producers, started after the trainer, commit into it.
    (work / f"namespace-{label}").mkdir(exist_ok=True)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(plan.ranks)),
        *("-m", "benchmarks.e2e_train", "--feed", _trainer_feed(feed), "--url", url),
        *("--steps", str(plan.steps), *chosen.trainer_args(work)),
        *("--workers", str(workers), "--cores", ",".join(map(str, sorted(trainer_cores)))),
        *(() if prefetch is None else ("--prefetch", str(prefetch))),
        *("--ready", str(ready), "--out", str(out)),
    ]
    producers: list[Any] = []
    stopped: list[Any] = []  # producers still publishing when training ended: stopped by us, not failed
    with log.open("w") as log_file:
        # A session of its own: the trainer and its ranks are one process group we can stop.
        trainer = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            extra = {}
            if feed in ("batchweave", "memory+producers"):  # the latter only loads the other core
                _wait_for(ready, trainer, timeout_s=300)
                started = time.monotonic()
                producers = start_producers(chosen, work, url, producer_cores)
                done_at = _wait_trainer(trainer, producers, _deadline(plan))
                produced_s = (done_at or time.monotonic()) - started
                extra["producer_tgbs_per_s"] = Journal(open_store(url)).load_state().steps / produced_s
            else:
                _wait_trainer(trainer, [], _deadline(plan))
        finally:
            _stop_trainer(trainer)
            stopped = [p for p in producers if p.is_alive()]
            for producer in producers:
                producer.kill()  # a no-op for those that finished
                producer.join()
    if trainer.returncode != 0 or not out.exists():
        raise RuntimeError(f"e2e {label}: trainer exit {trainer.returncode}:\n{log.read_text()[-3000:]}")
    failed = [p.exitcode for p in producers if p.exitcode != 0 and p not in stopped]
    if failed:
        raise RuntimeError(f"e2e {label}: producers exited with {failed}")
    trained = json.loads(out.read_text())
    extra["data_digest"] = trained["data_digest"]  # every feed must train on the same bytes
    return trained["series"], extra


def _trainer_feed(feed: str) -> str:
    return "memory" if feed == "memory+producers" else feed


def start_producers(chosen: Workload, work: Path, url: str, producer_cores: set[int]) -> list[Any]:
    """``plan.producers`` spawned producer processes, each one member of a pool (its share
    of the steps, exactly once), pinned to the preprocessing node's cores."""
    plan = chosen.plan
    # More TGBs than the trainer takes: the producers keep publishing until training ends,
    # so the consumer follows a live log throughout, the steady state of a long job.
    tgbs = PRODUCE_AHEAD * plan.steps
    pool = PoolPlan("e2e", plan.producers, tgbs)
    source = chosen.source(work, tgbs)
    context = mp.get_context("spawn")  # obstore's runtime does not survive fork
    processes = [
        context.Process(
            target=_produce,
            args=(url, pool, index, source, chosen.preprocess, plan.ranks, producer_cores),
            daemon=True,
        )
        for index in range(plan.producers)
    ]
    # Pinned from birth: a spawned child's imports would otherwise run on the trainer's core.
    with _pinned_thread(producer_cores):
        for process in processes:
            process.start()
    return processes


@contextmanager
def _pinned_thread(cores: set[int]):
    """Run this thread on ``cores`` for a while (affinity is per thread; children inherit it)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _produce(
    url: str, pool: PoolPlan, index: int, source: list, preprocess: Callable, dp: int, producer_cores: set[int]
) -> None:
    os.sched_setaffinity(0, producer_cores)  # the preprocessing node
    produce_shards(url, pool, index, source, preprocess, dp=dp)


def _deadline(plan: Setup) -> float:
    return time.monotonic() + 120 + 3.0 * plan.steps


def _wait_for(path: Path, trainer: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if trainer.poll() is not None:
            return  # it failed before its first step; the caller reports its log
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer did not reach its first step within {timeout_s} s")
        time.sleep(_POLL_S)


def _wait_trainer(trainer: subprocess.Popen, producers: list[Any], deadline: float) -> float | None:
    """Wait for the trainer to exit; return when every producer had finished (or None)."""
    producers_done = None
    while trainer.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the trainer ran past its deadline")
        failed = [p.exitcode for p in producers if p.exitcode not in (None, 0)]
        if failed:  # the trainer would only wait for steps that never come
            raise RuntimeError(f"producers exited with {failed} while the trainer waited")
        if producers_done is None and producers and all(p.exitcode is not None for p in producers):
            producers_done = time.monotonic()
        time.sleep(_POLL_S)
    return producers_done


def _stop_trainer(trainer: subprocess.Popen) -> None:
    """Stop the torchrun process group we started (it is gone already after a normal run)."""
    if trainer.poll() is not None:
        return
    for sig, grace_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(trainer.pid, sig)
        except ProcessLookupError:
            return
        try:
            trainer.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


# -- figures --------------------------------------------------------------------------


def measure(points: list[dict], warmup: int) -> dict[str, Any]:
    """Figures over the steps after the warm-up."""
    steady = points[warmup:]
    total_s = sum(p["step_s"] for p in steady)
    ordered = sorted(p["step_s"] for p in steady)
    cpu_s = steady[-1]["cpu_s"] - points[warmup - 1]["cpu_s"]

    def nearest_rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "steps": len(steady),
        "steps_per_s": len(steady) / total_s,
        "step_p50_s": nearest_rank(0.50),
        "step_p95_s": nearest_rank(0.95),
        "data_wait_fraction": sum(p["wait_s"] for p in steady) / total_s,
        # CPU of the whole trainer process (all its threads, the consumer's included) per step
        "trainer_cpu_per_step_s": cpu_s / len(steady),
        "trainer_cpu_share": cpu_s / total_s,  # under 1: something else ran on the training core
        "final_loss": steady[-1]["loss"],
    }


def compare(results: list[dict[str, Any]]) -> None:
    """Every row against the in-memory feed; BatchWeave also against the best DataLoader."""
    memory = _row(results, "memory")["steps_per_s"]
    best = best_dataloader(results)
    for record in results:
        record["vs_memory"] = record["steps_per_s"] / memory
    ours = _row(results, "batchweave")
    ours["vs_best_dataloader"] = ours["steps_per_s"] / best["steps_per_s"]
    loaded = [r for r in results if r["feed"] == "memory+producers"]
    if loaded:
        ours["vs_memory_with_producers"] = ours["steps_per_s"] / loaded[0]["steps_per_s"]


def best_dataloader(results: list[dict[str, Any]]) -> dict[str, Any]:
    return max((r for r in results if r["feed"] == "dataloader"), key=lambda r: r["steps_per_s"])


def _row(results: list[dict[str, Any]], feed: str) -> dict[str, Any]:
    return next(r for r in results if r["feed"] == feed)


def verdict(results: list[dict[str, Any]]) -> list[str]:
    ours, memory, best = _row(results, "batchweave"), _row(results, "memory"), best_dataloader(results)
    met_memory = "met" if ours["vs_memory"] >= TARGET_VS_MEMORY else "MISSED"
    met_best = "met" if ours["vs_best_dataloader"] > 1 else "MISSED"
    keeps_up = ours["producer_tgbs_per_s"] >= ours["steps_per_s"]
    return [
        f"BatchWeave {ours['steps_per_s']:.2f} steps/s = {ours['vs_memory']:.3f}x the in-memory feed "
        f"({memory['steps_per_s']:.2f} steps/s); target >= {TARGET_VS_MEMORY}x: {met_memory}",
        f"best colocated DataLoader ({best['system']}) {best['steps_per_s']:.2f} steps/s = "
        f"{best['vs_memory']:.3f}x the in-memory feed; BatchWeave {ours['vs_best_dataloader']:.2f}x of it; "
        f"target > 1x: {met_best}",
        f"time waiting for data: BatchWeave {ours['data_wait_fraction']:.1%}, best DataLoader "
        f"{best['data_wait_fraction']:.1%}, memory {memory['data_wait_fraction']:.1%} of step time",
        f"one producer core made {ours['producer_tgbs_per_s']:.2f} TGBs/s while training took "
        f"{ours['steps_per_s']:.2f} steps/s ({'kept up' if keeps_up else 'the producer was the bottleneck'})",
        f"trainer CPU per step: BatchWeave {ours['trainer_cpu_per_step_s'] * 1e3:.1f} ms vs memory "
        f"{memory['trainer_cpu_per_step_s'] * 1e3:.1f} ms (the consumer's cost on the training core); "
        f"trainer's share of its core: BatchWeave {ours['trainer_cpu_share']:.0%}, memory "
        f"{memory['trainer_cpu_share']:.0%} (well under 100%: other work on the machine took the core)",
        "emulation: training node = core 0 (DataLoader workers share it), preprocessing node = core 1 "
        "(CPU affinity on one 2-core machine shared with other work; ratios, not absolute rates)",
        *_loaded_lines(results, ours, memory),
    ]


def _loaded_lines(results: list[dict[str, Any]], ours: dict[str, Any], memory: dict[str, Any]) -> list[str]:
    """How much producers on the other core slow training by themselves (shared hardware)."""
    loaded = [r for r in results if r["feed"] == "memory+producers"]
    if not loaded:
        return []
    return [
        f"the in-memory feed with producers working on the other core: {loaded[0]['steps_per_s']:.2f} steps/s "
        f"= {loaded[0]['vs_memory']:.3f}x the in-memory feed alone (trainer CPU per step "
        f"{loaded[0]['trainer_cpu_per_step_s'] * 1e3:.1f} ms against {memory['trainer_cpu_per_step_s'] * 1e3:.1f}): "
        f"the two cores share hardware; BatchWeave = {ours['vs_memory_with_producers']:.3f}x this limit"
    ]


def config(chosen: Workload, options: BenchOptions) -> dict[str, Any]:
    trainer_cores, producer_cores = cores()
    return {
        **chosen.describe(),
        "emulation": {
            "training_node_cores": sorted(trainer_cores),
            "preprocessing_node_cores": sorted(producer_cores),
            "torch_threads": 1,
            "dataloader_workers": "colocated: pinned to the training node's cores",
            "producers_start": "when the trainer reaches its first step (no head start)",
            "producers_stop": f"when training ends; they have {PRODUCE_AHEAD}x the trainer's steps to make, "
            "so the consumer follows a live log throughout",
            "limits": "shared caches, memory bandwidth and disk; the store is a local directory; other work "
            "on the machine adds noise; one rank per node, so DDP's all-reduce is trivial",
        },
        "quick": options.quick,
        "runs": "all feeds at once (--quick: plumbing only, the figures mean nothing)"
        if options.quick
        else "one feed at a time",
        "store": {"kind": "local", "where": "a temporary directory on this machine's disk (--store is ignored)"},
        "machine": machine(),
    }


# The paper's figure of end-to-end training (its Fig. 5) trains on images and on robot video alike.
PAPER_FIGURE = 5
WORKLOAD_TITLES = {
    "e2e": "a small ViT on JPEG images",
    "e2e-video": "a small transformer on robot video decoded at training time",
}
# Each feed keeps its colour in both panels (its line and its bar): BatchWeave stands out,
# the in-memory feeds (the limit) are greys, the colocated DataLoaders warm colours.
FEED_COLOURS = {"batchweave": "tab:blue", "memory": "0.3", "memory+producers": "0.6"}
DATALOADER_COLOURS = ("tab:orange", "tab:red", "tab:brown", "tab:pink", "tab:purple", "tab:olive")


def plot(result: BenchResult, figure: Any) -> None:
    """Step time over the run (left) and training speed per feed, with its value (right)."""
    figure.set_size_inches(13, 6)
    figure.set_layout_engine("constrained")  # room for the suptitle and the bars' values
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    colours = _colours(result.results)
    workload = WORKLOAD_TITLES.get(result.benchmark, result.benchmark)
    figure.suptitle(f"End-to-end training: {workload} (paper Fig. {PAPER_FIGURE})", fontsize="large")
    _step_times(left, result, colours)
    _speeds(right, result.results, colours)


def _step_times(ax: Any, result: BenchResult, colours: dict[str, str]) -> None:
    warmup = result.config["warmup"]
    for label, points in result.series.items():
        ours = label == "batchweave"
        ax.plot(
            [p["step"] for p in points],
            [p["step_s"] * 1e3 for p in points],
            label=_readable(label),
            color=colours.get(label),
            linewidth=1.8 if ours else 1.0,
            zorder=3 if ours else 2,
        )
    ax.axvspan(0, warmup, color="grey", alpha=0.15, label="warm-up (left out of the figures)")
    ax.set(title="time of each training step", xlabel="step", ylabel="step time (ms)")
    ax.set_ylim(0, _ylim_ms(result))
    ax.legend(fontsize="small", ncols=2, loc="upper right")


def _speeds(ax: Any, results: list[dict[str, Any]], colours: dict[str, str]) -> None:
    """Horizontal bars (the feeds' names read level), each with its rate and its ratio to the in-memory feed."""
    memory = _row(results, "memory")["steps_per_s"]
    names = [_readable(r["system"]) for r in results]
    rates = [r["steps_per_s"] for r in results]
    bars = ax.barh(names, rates, color=[colours.get(r["system"]) for r in results])
    values = [f"{rate:.2f} ({rate / memory:.2f}x)" for rate in rates]
    clear = {"facecolor": "white", "edgecolor": "none", "pad": 1}  # the target line passes behind, not through
    ax.bar_label(bars, labels=values, padding=3, fontsize="small", bbox=clear)
    target = TARGET_VS_MEMORY * memory
    ax.axvline(target, color="tab:red", linestyle=":")
    # First row on top, as in the table, and a row kept free below the last bar to name the
    # target line in: a legend would cover the line or a bar's value.
    ax.set_ylim(len(rates) + 0.2, -0.6)
    label = f"target: {TARGET_VS_MEMORY}x in-memory "
    ax.text(target, len(rates) - 0.1, label, ha="right", va="center", color="tab:red", fontsize="small")
    ax.set_xlim(0, max(rates) * 1.35)  # room for the values beside the longest bar
    ax.set(title="training speed\n(steps/s, and in brackets x the in-memory feed)", xlabel="steps/s (higher is better)")


def _colours(results: list[dict[str, Any]]) -> dict[str, str]:
    loaders = iter(DATALOADER_COLOURS * len(results))
    return {r["system"]: FEED_COLOURS.get(r["feed"]) or next(loaders) for r in results}


def _readable(system: str) -> str:
    """A feed's name for a newcomer: 'dataloader-k=2-pf=4' -> 'DataLoader, 2 workers, prefetch 4'."""
    fixed = {
        "memory": "in-memory feed (the limit)",
        "memory+producers": "in-memory, producers busy",
        "batchweave": "BatchWeave",
    }
    if system in fixed:
        return fixed[system]
    loader = re.fullmatch(r"dataloader-k=(\d+)(?:-pf=(\d+))?", system)
    if loader is None:
        return system
    workers, prefetch = loader.groups()
    text = f"DataLoader, {workers} worker{'s' if workers != '1' else ''}"
    return text if prefetch is None else f"{text}, prefetch {prefetch}"


def _ylim_ms(result: BenchResult) -> float:
    """Room for the steady state; a slow first step would flatten everything else."""
    p95 = max(r["step_p95_s"] for r in result.results)
    return 1e3 * p95 * 1.8 if math.isfinite(p95) else 1.0
