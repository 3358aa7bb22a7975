"""Robot video preprocessing with a producer pool: decode H.264, resize, pack patches, text and actions.

    python examples/preprocess_video.py generate --data /tmp/video-run --episodes 8
    python examples/preprocess_video.py produce --data /tmp/video-run --producers 2 --dp 2 --cp 2
    torchrun --standalone --nproc_per_node=2 examples/preprocess_video.py train --data /tmp/video-run --dp 2

What it does, with nothing downloaded (the functions are in ``lerobot_video.py`` next to it):
1. ``generate`` writes synthetic robot episodes in the LeRobot v2.1 layout under
   ``<data>/dataset``: per episode, one H.264 MP4 per camera (moving shapes over a
   textured gradient, a little sensor noise, a different scene per camera) and a Parquet
   file of joint states and actions, with the ``meta/`` files LeRobot readers use.
2. ``produce`` cuts the episodes into samples of 8 to 16 frames at 2 frames per second,
   groups them into global batches of ``--batch`` samples and runs
   ``batchweave.run_pool`` over the batches (``--backend local`` processes or ``ray``
   actors). A worker decodes each camera from the keyframe before the sample's first
   frame, keeps the frames nearest the 2-FPS times, resizes them to ``--image-size``,
   cuts them into ``--patch`` x ``--patch`` patches and packs them with the task text's
   tokens and the state and action windows into one sequence of ``--seq-len`` rows. A
   batch becomes one TGB of ``dp x cp`` slices: each DP rank gets ``batch / dp``
   samples, each CP rank a ``seq_len / cp`` chunk of every sequence. Then it reads the
   namespace back as rank 0 would.
3. ``train``, under torchrun, trains a small next-row predictor on the packed sequences
   through ``batchweave.torch.TGBDataset`` (one rank per DP x CP slice), masking the
   padding with each sequence's used length.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import batchweave as bw

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lerobot_video, when imported from elsewhere
import lerobot_video as lv


def generate(args: argparse.Namespace) -> int:
    spec = lv.EpisodeSpec(
        cameras=args.cameras,
        height=args.height,
        width=args.width,
        fps=args.fps,
        seconds=args.seconds,
        crf=args.crf,
        gop=args.gop or args.fps,
    )
    info = lv.write_dataset(args.data / "dataset", args.episodes, spec, args.seed)
    print(
        f"wrote {info.episodes} episodes ({info.total_frames} frames x {spec.cameras} cameras, "
        f"{spec.height}x{spec.width} at {spec.fps} FPS): {info.video_bytes / 1e6:.2f} MB of video, "
        f"{info.data_bytes / 1e6:.2f} MB of Parquet"
    )
    return 0


def sample_spec(args: argparse.Namespace) -> lv.SampleSpec:
    return lv.SampleSpec(
        sample_fps=args.sample_fps,
        frames=(args.min_frames, args.max_frames),
        image_size=args.image_size,
        history=args.history,
        patch=args.patch,
        text_tokens=args.text_tokens,
        seq_len=args.seq_len,
        dtype=args.dtype,
    )


def steps(args: argparse.Namespace) -> list[dict]:
    """The pool's shards: one ``step_item`` per global batch, the same on every run."""
    root, sample = args.data / "dataset", sample_spec(args)
    batches = lv.global_batches(lv.sample_refs(root, sample, args.seed, args.per_episode), args.batch)
    return [lv.step_item(root, refs, sample, args.dp, args.cp) for refs in batches]


def produce(args: argparse.Namespace) -> int:
    if args.batch % args.dp or args.seq_len % args.cp:
        sys.exit("--batch must be a multiple of --dp and --seq-len a multiple of --cp")
    source = steps(args)
    if not source:
        sys.exit(f"the dataset has fewer samples than one batch of {args.batch}: generate more episodes")
    if args.backend == "ray":
        start_ray()
    url = args.url or str(args.data / "namespace")
    report = bw.run_pool(
        url,
        "video",
        source,
        lv.preprocess_item,
        producers=args.producers,
        dp=args.dp,
        cp=args.cp,
        backend=args.backend,
        end_of_stream=True,
    )
    print(f"committed {report.produced} TGBs from {len(source)} batches in {report.seconds:.1f} s")
    with bw.Consumer(url, dp=args.dp, cp=args.cp, rank=0, timeout_s=60) as rank0:
        first = [batch.data for batch in rank0]
    tokens, lengths = first[0]["tokens"], first[0]["lengths"]
    print(
        f"rank 0 read {len(first)} steps; slice {tokens.shape} {tokens.dtype}, "
        f"used lengths {lengths.tolist()} of {args.seq_len}"
    )
    return 0 if len(first) == len(source) else 1


def start_ray() -> None:
    """A private Ray cluster on this machine (or the one ``RAY_ADDRESS`` names).

    Ray workers do not inherit this script's ``sys.path``: ``PYTHONPATH`` lets them import
    ``lerobot_video`` (and batchweave from a source checkout).
    """
    import ray

    paths = [str(Path(__file__).resolve().parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    ray.init(
        address=os.environ.get("RAY_ADDRESS", "local"),
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}},
        include_dashboard=False,
    )


def train(args: argparse.Namespace) -> int:
    """A small next-row predictor on the packed sequences, one rank per DP x CP slice."""
    # torch is imported here, not at the top: a preprocessing pool needs only batchweave.
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from batchweave.torch import TGBDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (args.dp, args.cp), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    width = lv.META_COLUMNS + 3 * args.patch * args.patch
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.GELU(), torch.nn.Linear(64, width))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dataset = TGBDataset(args.url or str(args.data / "namespace"), mesh=mesh, timeout_s=args.timeout_s)
    chunk_start = mesh.get_local_rank("cp") * (args.seq_len // args.cp)
    losses = []
    for step, batch in enumerate(DataLoader(dataset, batch_size=None)):
        if step == args.steps:
            break
        rows = batch["tokens"].float()  # [samples, chunk, width]
        positions = chunk_start + torch.arange(rows.shape[1])
        used = positions[None, :] < batch["lengths"][:, None]  # padding is masked out of the loss
        pairs = (used[:, :-1] & used[:, 1:]).unsqueeze(-1)
        error = (model(rows[:, :-1]) - rows[:, 1:]) ** 2 * pairs
        loss = error.sum() / (pairs.sum() * width).clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    dataset.close()
    if dist.get_rank() == 0:
        print(f"trained {len(losses)} steps on rank 0: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()
    return 0 if losses else 1


def add_sample_options(parser: argparse.ArgumentParser) -> None:
    defaults = lv.SampleSpec()
    parser.add_argument("--sample-fps", type=float, default=defaults.sample_fps, help="frames per second kept")
    parser.add_argument("--min-frames", type=int, default=defaults.frames[0], help="fewest frames per sample")
    parser.add_argument("--max-frames", type=int, default=defaults.frames[1], help="most frames per sample")
    parser.add_argument("--image-size", type=int, default=defaults.image_size, help="model input side in pixels")
    parser.add_argument("--patch", type=int, default=defaults.patch, help="patch side in pixels")
    parser.add_argument("--history", type=int, default=defaults.history, help="states/actions per frame")
    parser.add_argument("--text-tokens", type=int, default=defaults.text_tokens)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="rows per packed sequence")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float16", "float32"])
    parser.add_argument("--batch", type=int, default=4, help="samples per global batch (one TGB)")
    parser.add_argument(
        "--per-episode", type=int, help="samples drawn at random starts per episode (default: consecutive windows)"
    )
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    spec = lv.EpisodeSpec()
    gen = commands.add_parser("generate", help="write a synthetic LeRobot v2.1 dataset to <data>/dataset")
    gen.add_argument("--data", type=Path, required=True, help="working directory")
    gen.add_argument("--episodes", type=int, default=8)
    gen.add_argument("--cameras", type=int, default=spec.cameras)
    gen.add_argument("--height", type=int, default=spec.height)
    gen.add_argument("--width", type=int, default=spec.width)
    gen.add_argument("--fps", type=int, default=spec.fps)
    gen.add_argument("--seconds", type=float, default=spec.seconds, help="episode length")
    gen.add_argument("--crf", type=int, default=spec.crf, help="x264 quality: lower is bigger and better")
    gen.add_argument("--gop", type=int, default=0, help="keyframe interval in frames (default: --fps)")
    gen.add_argument("--seed", type=int, default=0)
    for name, text in (("produce", "publish TGBs with a producer pool"), ("train", "train under torchrun")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--data", type=Path, required=True, help="working directory")
        command.add_argument("--url", help="namespace URL (default: <data>/namespace)")
        command.add_argument("--dp", type=int, default=2)
        command.add_argument("--cp", type=int, default=1)
        add_sample_options(command)
    pool = commands.choices["produce"]
    pool.add_argument("--producers", type=int, default=2)
    pool.add_argument("--backend", choices=["local", "ray"], default="local")
    training = commands.choices["train"]
    training.add_argument("--steps", type=int, default=1_000_000, help="stop after this many steps")
    training.add_argument("--lr", type=float, default=1e-3)
    training.add_argument("--timeout-s", type=float, default=600.0, help="fail when no step arrives for this long")
    args = parser.parse_args(argv)
    return {"generate": generate, "produce": produce, "train": train}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
