"""The training job of ``batchweave bench e2e``, run under torchrun, and its image pipeline.

    python -m torch.distributed.run --standalone --nproc-per-node 1 -m benchmarks.e2e_train \\
        --feed batchweave --images DIR --url NAMESPACE --steps 200 --out steps.json

A tiny ViT (patch embedding, a few ``nn.TransformerEncoder`` layers, mean pooling) trains
under DDP (gloo on CPU, NCCL when CUDA is there) for a fixed number of steps. Every step
records its wall time and, inside it, the time spent waiting for the next batch; rank 0
writes the series as JSON. ``--feed`` chooses where the batches come from:

- ``dataloader``: a colocated ``DataLoader(num_workers=k)`` whose workers decode and
  augment the JPEGs, on the trainer's own cores (the workers inherit its CPU affinity);
- ``batchweave``: ``TGBDataset`` over a namespace that producer processes (started by
  ``benchmarks.e2e`` on other cores) fill while training runs;
- ``memory``: the same batches, preprocessed before the clock starts (the upper limit).

``--workload`` chooses what is trained on. ``image`` (the default) is here: synthetic
JPEGs through ``examples/preprocess_images.py``'s ``augment`` (JPEG decode,
random-resized crop, flip, normalize), seeded per image so that a step's batch has the
same bytes whichever process made it (the DataLoader workers and the producers import it). ``video`` is
``benchmarks.e2e_video``: robot episodes decoded from H.264 and packed into multimodal
sequences, a small transformer with an action head. Each is a *job*: a model, a loss,
and this rank's slice of step ``s``; the loop and the feeds are the same for both. This
module imports torch only inside the training functions, so the producer processes that
import the pipeline never pay for torch.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import time
from pathlib import Path

import numpy as np
from PIL import Image

from examples.preprocess_images import augment

CLASSES = 10
LABELS_FILE = "labels.json"


# -- the image pipeline (shared with the producers) -----------------------------------


def write_images(directory: Path, count: int, min_side: int, max_side: int, seed: int = 0) -> None:
    """``count`` synthetic JPEGs (rings whose scale is the class), and their labels."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = []
    for index in range(count):
        height, width = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
        label = int(rng.integers(CLASSES))
        y, x = np.mgrid[0:height, 0:width]
        rings = np.sin(np.hypot(y - height / 2, x - width / 2) / (4 + 1.6 * label))
        pixels = np.stack([x / width, y / height, (rings + 1) / 2], axis=-1)
        pixels = np.clip(pixels + rng.normal(0, 0.05, pixels.shape), 0, 1)
        Image.fromarray((pixels * 255).astype(np.uint8)).save(directory / f"{index:05d}.jpg", quality=90)
        labels.append(label)
    (directory / LABELS_FILE).write_text(json.dumps(labels))


@functools.cache
def _labels(directory: str) -> tuple[int, ...]:
    return tuple(json.loads((Path(directory) / LABELS_FILE).read_text()))


def preprocess_slice(images: str, step: int, per_step: int, rank: int, ranks: int, size: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s contiguous share of step ``step``'s batch of ``per_step`` images.

    Image ``j`` of step ``s`` is pool file ``(s * per_step + j) mod pool`` with a crop
    seeded by ``(s, j)``: the bytes depend on neither the process nor the other images.
    """
    labels = _labels(images)
    share = per_step // ranks
    picks = range(rank * share, (rank + 1) * share)
    files = [(step * per_step + j) % len(labels) for j in picks]
    pixels = [
        augment((Path(images) / f"{f:05d}.jpg").read_bytes(), size, random.Random(f"{step}-{j}"))
        for f, j in zip(files, picks, strict=True)
    ]
    return {"images": np.stack(pixels), "labels": np.array([labels[f] for f in files], dtype=np.int64)}


def preprocess_step(item: tuple[str, int, int, int, int]) -> list[dict[str, np.ndarray]]:
    """A producer's shard -> TGB: ``item`` is (images dir, step, per_step, dp, size)."""
    images, step, per_step, dp, size = item
    return [preprocess_slice(images, step, per_step, d, dp, size) for d in range(dp)]


class StepSlices:
    """Map-style dataset for the colocated DataLoader: item ``s`` is this rank's slice of step ``s``."""

    def __init__(self, job, steps: int, rank: int, ranks: int) -> None:
        self.job, self.steps, self.rank, self.ranks = job, steps, rank, ranks

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self.job.slice(step, self.rank, self.ranks)


# -- training -------------------------------------------------------------------------


class ImageJob:
    """The image workload: the tiny ViT, cross-entropy over the ring classes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def slice(self, step: int, rank: int, ranks: int) -> dict[str, np.ndarray]:
        a = self.args
        return preprocess_slice(a.images, step, a.per_step, rank, ranks, a.size)

    def memory(self, rank: int, ranks: int) -> list[dict[str, np.ndarray]]:
        return [self.slice(step, rank, ranks) for step in range(self.args.steps)]

    def model(self):
        a = self.args
        return build_model(a.dim, a.layers, a.size, a.patch)

    def loss(self, model, batch, device):
        import torch

        images, labels = batch["images"].to(device), batch["labels"].to(device)
        return torch.nn.functional.cross_entropy(model(images), labels)


def job(args: argparse.Namespace):
    """The workload's job (video's module is imported only when asked for)."""
    if args.workload == "video":
        from benchmarks.e2e_video import VideoJob

        return VideoJob(args)
    return ImageJob(args)


def build_model(dim: int, layers: int, size: int, patch: int):
    import torch

    class TinyViT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Conv2d(3, dim, patch, patch)
            self.position = torch.nn.Parameter(torch.zeros(1, (size // patch) ** 2, dim))
            layer = torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(dim, CLASSES)

        def forward(self, x):
            tokens = self.embed(x).flatten(2).transpose(1, 2) + self.position
            return self.head(self.encoder(tokens).mean(dim=1))

    return TinyViT()


def pin(cores: set[int]) -> None:
    """Run on ``cores`` only, one intra-op thread: one emulated training node."""
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(1)


def batches(args: argparse.Namespace, work, rank: int, world: int):
    """The iterator of this rank's batches for ``args.feed``, and something to close."""
    import torch
    from torch.utils.data import DataLoader

    if args.feed == "memory":
        made = work.memory(rank, world)
        return iter([{k: torch.from_numpy(v) for k, v in b.items()} for b in made]), None
    if args.feed == "batchweave":
        from batchweave.torch import TGBDataset

        dataset = TGBDataset(args.url, dp=world, rank=rank, timeout_s=args.timeout_s)
        return iter(DataLoader(dataset, batch_size=None)), dataset
    cores = os.sched_getaffinity(0)
    # prefetch_factor only with workers (torch refuses it without); None: torch's default (2)
    prefetch = {"prefetch_factor": args.prefetch} if args.prefetch and args.workers else {}
    loader = DataLoader(
        StepSlices(work, args.loader_steps or args.steps, rank, world),
        batch_size=None,
        num_workers=args.workers,
        worker_init_fn=functools.partial(_worker_init, cores),
        **prefetch,
    )
    return iter(loader), None


def parse_cores(text: str) -> set[int]:
    """``"0"``, ``"0,1"`` or ``"0-63,96"``: a CPU list as ``taskset -c`` takes it."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def _worker_init(cores: set[int], worker_id: int) -> None:
    pin(cores)  # colocated: the workers share the trainer's cores (fork inherits them too)


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    pin(parse_cores(args.cores))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(0)
    work = job(args)
    model = DistributedDataParallel(work.model().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    feed, closable = batches(args, work, rank, world)
    if rank == 0 and args.ready:
        Path(args.ready).touch()  # the producers start now: no head start before the first step
    series = []
    trained_on = hashlib.blake2b(digest_size=16)  # the bytes of every batch, in order: feeds compare it
    for step in range(args.steps):
        started = time.perf_counter()
        batch = next(feed)
        waited = time.perf_counter() - started
        loss = work.loss(model, batch, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        cpu_s = time.process_time()  # the whole process: the consumer's threads too
        series.append({"step": step, "step_s": elapsed, "wait_s": waited, "loss": loss.item(), "cpu_s": cpu_s})
        _hash_batch(trained_on, batch)  # after the step's timing
    if closable is not None:
        closable.close()
    if rank == 0:
        out = {
            "feed": args.feed,
            "workload": args.workload,
            "workers": args.workers,
            "prefetch": args.prefetch,
            "world": world,
            "cuda": cuda,
            "series": series,
            "data_digest": trained_on.hexdigest(),
        }
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _hash_batch(hasher, batch) -> None:
    """Feed ``batch`` (a tensor, or a dict, list or tuple of them) into ``hasher``, keys sorted."""
    if isinstance(batch, dict):
        for key in sorted(batch):
            hasher.update(str(key).encode())
            _hash_batch(hasher, batch[key])
    elif isinstance(batch, list | tuple):
        for item in batch:
            _hash_batch(hasher, item)
    else:
        hasher.update(np.ascontiguousarray(batch.detach().cpu().numpy()).tobytes())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feed", choices=("dataloader", "batchweave", "memory"), required=True)
    parser.add_argument("--workload", choices=("image", "video"), default="image")
    parser.add_argument("--images", help="directory of JPEGs made by write_images (image workload)")
    parser.add_argument("--url", help="namespace (batchweave feed)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--per-step", type=int, default=32, help="global batch: images (or video samples) per step")
    parser.add_argument("--size", type=int, default=64, help="crop side in pixels (image workload)")
    parser.add_argument("--patch", type=int, default=8, help="ViT patch side (image workload)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="attention heads (video workload)")
    parser.add_argument("--dataset", help="LeRobot-layout dataset directory (video workload)")
    parser.add_argument("--sample", help="the video workload's SampleSpec as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the video workload's sample list")
    parser.add_argument("--memory-cache", help="the memory feed's steps, preprocessed by the harness (video)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (dataloader feed)")
    parser.add_argument("--prefetch", type=int, help="DataLoader prefetch_factor (torch's default: 2)")
    parser.add_argument(
        "--loader-steps",
        type=int,
        help="steps the DataLoader's dataset holds (default --steps); more keep its workers busy to the "
        "end, as in a long run, instead of handing the last steps over already made",
    )
    parser.add_argument("--cores", default="0", help="CPU cores of this training node, e.g. 0, 0,1 or 0-63")
    parser.add_argument("--ready", help="file rank 0 creates just before the first step")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", required=True, help="rank 0's JSON of per-step times")
    train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
