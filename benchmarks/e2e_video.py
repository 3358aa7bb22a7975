"""``bench e2e --workload video``: the video workload of ``bench e2e`` (paper Fig. 5).

The harness is ``benchmarks.e2e`` (the same three feeds, the same emulation of a
training node on core 0 and a preprocessing node on core 1, the same figures); this
module says what is trained on, for the harness, the trainer (``benchmarks.e2e_train
--workload video``) and the producers:

- the data: synthetic LeRobot-layout robot episodes, three cameras of H.264 at 480x640,
  30 FPS, a keyframe a second (``examples.lerobot_video.write_dataset``);
- the preprocessing, at training time: ``examples.lerobot_video.preprocess_step``. For
  each sample (8 to 16 frames at 2 FPS, 4 to 8 seconds of video) every camera is decoded
  from the keyframe before its first frame, so about 15 frames are decoded for each
  one kept (30 FPS video sampled at 2 FPS); the kept frames are resized, states and actions windowed, the task text
  tokenized, and all packed into one fixed-length sequence of rows (``[seq_len, 772]``
  float16 per sample, a ``lengths`` array giving the used rows);
- the model: a small transformer over those rows. Each row is embedded by its kind (an
  image patch through a linear layer, a text token through an embedding table, a state
  window through a linear layer, an action row as a learned query), plus embeddings of
  its camera, frame slot and patch position; padding rows past the used length are
  masked out of attention; an action head regresses every action row's window
  (mean squared error), as a vision-language-action policy does.

Sizes (``setup``), and how they were chosen. Decoding dominates the preprocessing and
hardly depends on the model's input size (64, 96 or 224 px frames: 0.23, 0.22 and 0.28 s
per sample on one core of the development machine at 480x640; 0.09 s at 240x320). A
global batch of 2 samples therefore costs about 0.5 s to preprocess on one core. The
model (64 px frames in 16 px patches: 832 rows per sample, up to 768 of them patches)
was then sized, timing training steps pinned to one core beside preprocessed steps
pinned to the other, so that a training step costs a little less than that: width 128
gave 0.27 s a step, width 160 0.40 s (4 layers each); 160 it is. Preprocessing is then
the heavy side, as for the paper's video workloads: a colocated DataLoader must fit
preprocessing and training into one core's time per step, a producer on the
preprocessing node only preprocessing. The memory feed's step time and the producer's
TGBs per second in each result are the two costs as measured in that run.

The memory feed's batches are made once by the harness (on both cores, before any run)
and stored in an ``.npz`` the trainer loads before its clock starts: the same bytes the
producers publish, at no cost per run.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.e2e import PRODUCE_AHEAD, Workload
from benchmarks.report import BenchOptions
from examples.lerobot_video import (
    ACTION,
    PATCH,
    STATE,
    TEXT,
    EpisodeSpec,
    SampleRef,
    SampleSpec,
    preprocess_step,
    sample_refs,
    write_dataset,
)

NAME = "e2e-video"
REF_SEEDS = 8  # sample lists drawn (each cuts the episodes into other windows): more distinct samples
TOKEN_IDS = 259  # the byte-level tokenizer's ids: 3 special + 256 bytes
MEMORY_CACHE = "memory.npz"


@dataclass(frozen=True, slots=True)
class VideoSetup:
    steps: int  # per run, warm-up included
    warmup: int  # first steps left out of the figures
    loaders: tuple[tuple[int, int], ...]  # colocated DataLoaders tried: (num_workers, prefetch_factor)
    per_step: int = 2  # global batch, samples
    episodes: int = 2
    cameras: int = 3
    height: int = 480  # camera frames (ALOHA's, LeRobot's common size)
    width: int = 640
    fps: int = 30
    seconds: float = 12.0
    crf: int = 23
    gop: int = 30  # a keyframe a second
    frames: tuple[int, int] = (8, 16)  # per sample, at 2 FPS
    image_size: int = 64  # model input side
    patch: int = 16
    history: int = 2
    text_tokens: int = 32
    dim: int = 160
    layers: int = 4
    heads: int = 4
    producers: int = 1
    ranks: int = 1  # one training rank per emulated training node

    def episode(self) -> EpisodeSpec:
        return EpisodeSpec(
            cameras=self.cameras,
            height=self.height,
            width=self.width,
            fps=self.fps,
            seconds=self.seconds,
            crf=self.crf,
            gop=self.gop,
        )

    def sample(self) -> SampleSpec:
        patches = (self.image_size // self.patch) ** 2
        # The longest sample fits exactly: its text, then per frame slot every camera's
        # patches, a state row and an action row. Shorter ones are padded (and masked).
        seq_len = self.text_tokens + self.frames[1] * (self.cameras * patches + 2)
        return SampleSpec(
            frames=self.frames,
            image_size=self.image_size,
            history=self.history,
            patch=self.patch,
            text_tokens=self.text_tokens,
            seq_len=seq_len,
        )


def setup(options: BenchOptions) -> VideoSetup:
    if options.quick:
        # The plumbing, not the figures: tiny two-camera episodes, a tiny model.
        return VideoSetup(
            steps=5,
            warmup=2,
            loaders=((1, 2),),
            episodes=1,
            cameras=2,
            height=48,
            width=64,
            fps=10,
            seconds=3.0,
            gop=10,
            frames=(2, 4),
            image_size=32,
            text_tokens=8,
            dim=32,
            layers=1,
            heads=2,
        )
    return VideoSetup(steps=50, warmup=6, loaders=((1, 2), (2, 4), (4, 2)))


def video_workload(options: BenchOptions) -> Workload:
    plan = setup(options)
    return Workload(
        name=NAME,
        plan=plan,
        loaders=plan.loaders,
        prepare=functools.partial(prepare, plan, options.seed),
        trainer_args=functools.partial(trainer_args, plan, options.seed),
        source=functools.partial(source, plan, options.seed),
        preprocess=preprocess_item,
        describe=functools.partial(describe, plan),
    )


# -- the harness's side ---------------------------------------------------------------


def prepare(plan: VideoSetup, seed: int, work: Path) -> None:
    """Write the episodes, then the memory feed's batches (both cores; before any run)."""
    write_dataset(work / "dataset", plan.episodes, plan.episode(), seed)
    items = source(plan, seed, work, plan.steps)
    if len(items) < 10:  # a quick run: starting two processes would cost more than it saves
        made = [preprocess_item(item) for item in items]
    else:
        with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
            made = list(pool.map(preprocess_item, items))
    arrays = {
        f"{step}.{rank}.{name}": array
        for step, slices in enumerate(made)
        for rank, payload in enumerate(slices)
        for name, array in payload.items()
    }
    np.savez(work / MEMORY_CACHE, **arrays)


def trainer_args(plan: VideoSetup, seed: int, work: Path) -> list[str]:
    # The DataLoader's dataset is longer than the run, as the producers' work is: its
    # workers keep preprocessing until training ends, the steady state of a long run.
    # (With exactly --steps items its last num_workers x prefetch_factor steps, up to 8 of
    # 44 measured, would come ready-made while the training core no longer preprocesses.)
    return [
        *("--loader-steps", str(PRODUCE_AHEAD * plan.steps)),
        *("--workload", "video", "--dataset", str(work / "dataset")),
        *("--sample", json.dumps(plan.sample().to_dict()), "--seed", str(seed)),
        *("--memory-cache", str(work / MEMORY_CACHE), "--per-step", str(plan.per_step)),
        *("--dim", str(plan.dim), "--layers", str(plan.layers), "--heads", str(plan.heads)),
    ]


def source(plan: VideoSetup, seed: int, work: Path, tgbs: int) -> list[tuple]:
    sample = json.dumps(plan.sample().to_dict())  # a string: hashable for the refs' cache
    return [(str(work / "dataset"), sample, seed, step, plan.per_step, plan.ranks) for step in range(tgbs)]


def describe(plan: VideoSetup) -> dict[str, Any]:
    sample = plan.sample()
    rows = sample.seq_len
    return {
        **asdict(plan),
        "loaders": [list(pair) for pair in plan.loaders],
        "frames": list(plan.frames),
        "workload": "video",
        "model": f"transformer over packed rows: {rows} rows per sample ({plan.image_size}px frames, "
        f"patch {plan.patch}), dim {plan.dim}, {plan.layers} encoder layers, {plan.heads} heads, action head",
        "preprocessing": f"{plan.cameras} cameras of H.264 {plan.height}x{plan.width} at {plan.fps} FPS "
        f"(crf {plan.crf}, a keyframe every {plan.gop} frames); {plan.frames[0]}-{plan.frames[1]} frames per "
        f"sample at 2 FPS decoded from the keyframe before, resized to {plan.image_size}px, history "
        f"{plan.history}, packed into [{rows}, {sample.row_width}] {sample.dtype}; examples/lerobot_video.py",
    }


# -- the producers' and the DataLoader's side -------------------------------------------


@functools.cache
def _refs(root: str, sample: str, seed: int) -> tuple[SampleRef, ...]:
    """The samples of ``REF_SEEDS`` sample lists, one after the other: other frame counts
    and distances from the keyframe than one list over a few episodes has."""
    spec = SampleSpec.from_dict(json.loads(sample))
    return tuple(ref for k in range(REF_SEEDS) for ref in sample_refs(Path(root), spec, seed + k))


def step_refs(root: str, sample: str, seed: int, step: int, per_step: int) -> list[SampleRef]:
    """Sample ``j`` of step ``s`` is ref ``(s * per_step + j) mod refs``: every step a fresh decode."""
    refs = _refs(root, sample, seed)
    return [refs[(step * per_step + j) % len(refs)] for j in range(per_step)]


def preprocess_item(item: tuple) -> list[dict[str, np.ndarray]]:
    """A producer's shard -> TGB: ``item`` is (dataset, sample spec JSON, seed, step, per_step, dp)."""
    root, sample, seed, step, per_step, dp = item
    spec = SampleSpec.from_dict(json.loads(sample))
    return preprocess_step(Path(root), step_refs(root, sample, seed, step, per_step), spec, dp, 1)


def rank_slice(root: str, sample: str, seed: int, step: int, per_step: int, rank: int, ranks: int):
    """Rank ``rank``'s slice of step ``step`` alone: its consecutive share of the samples
    (``preprocess_step``'s split over dp), without decoding the other ranks' samples."""
    share = per_step // ranks
    refs = step_refs(root, sample, seed, step, per_step)[rank * share : (rank + 1) * share]
    return preprocess_step(Path(root), refs, SampleSpec.from_dict(json.loads(sample)), 1, 1)[0]


# -- the trainer's side -----------------------------------------------------------------


class VideoJob:
    """The video workload for ``benchmarks.e2e_train``: a model, its loss, a rank's slices."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.spec = SampleSpec.from_dict(json.loads(args.sample))

    def slice(self, step: int, rank: int, ranks: int) -> dict[str, np.ndarray]:
        a = self.args
        return rank_slice(a.dataset, a.sample, a.seed, step, a.per_step, rank, ranks)

    def memory(self, rank: int, ranks: int) -> list[dict[str, np.ndarray]]:
        with np.load(self.args.memory_cache, allow_pickle=False) as cache:
            return [
                {name: cache[f"{step}.{rank}.{name}"] for name in ("tokens", "lengths")}
                for step in range(self.args.steps)
            ]

    def model(self):
        a = self.args
        info = json.loads((Path(a.dataset) / "meta" / "info.json").read_text())
        action_dim = info["features"]["action"]["shape"][0]
        return build_model(self.spec, action_dim, a.dim, a.layers, a.heads)

    def loss(self, model, batch, device):
        return model(batch["tokens"].to(device), batch["lengths"].to(device))


def build_model(spec: SampleSpec, action_dim: int, dim: int, layers: int, heads: int):
    """A transformer over packed rows whose forward pass returns the action loss."""
    import torch

    payload = 3 * spec.patch * spec.patch
    action_values = action_dim * spec.history  # an action row: the window, flattened

    class PackedTransformer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = torch.nn.Linear(payload, dim)
            self.text = torch.nn.Embedding(TOKEN_IDS, dim)
            self.state = torch.nn.Linear(payload, dim)
            self.action_query = torch.nn.Parameter(torch.zeros(dim))
            self.kind = torch.nn.Embedding(5, dim)
            self.camera = torch.nn.Embedding(8, dim)
            self.slot = torch.nn.Embedding(max(spec.frames[1], spec.text_tokens), dim)
            self.position = torch.nn.Embedding(spec.patches_per_frame, dim)
            layer = torch.nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(dim, action_values)

        def forward(self, tokens, lengths):
            rows = tokens.float()
            kind, values = rows[..., 0].long(), rows[..., 4:]
            of = {k: (kind == k).unsqueeze(-1) for k in (PATCH, TEXT, STATE, ACTION)}  # rows of each kind
            x = (
                torch.where(of[PATCH], self.patch(values), 0.0)
                + torch.where(of[TEXT], self.text(values[..., 0].long().clamp(0, TOKEN_IDS - 1)), 0.0)
                + torch.where(of[STATE], self.state(values), 0.0)
                + torch.where(of[ACTION], self.action_query, 0.0)
                + self.kind(kind)
                + self.camera(rows[..., 1].long())
                + self.slot(rows[..., 2].long())
                + self.position(rows[..., 3].long())
            )
            # Rows past the used length are padding: masked out of attention and the loss.
            padding = torch.arange(rows.shape[1], device=rows.device)[None, :] >= lengths[:, None]
            hidden = self.encoder(x, src_key_padding_mask=padding)
            wanted = of[ACTION].squeeze(-1) & ~padding
            predicted = self.head(hidden[wanted])
            return torch.nn.functional.mse_loss(predicted, values[wanted][:, :action_values])

    return PackedTransformer()
