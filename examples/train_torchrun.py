"""Train a small model under torchrun from a BatchWeave namespace, with DCP checkpoints.

Two commands, run side by side:

    # Preprocessing: N producer processes, each publishing its share of the TGBs.
    # Restart it any time (or raise --tgbs): each producer resumes at its resume_offset.
    python examples/train_torchrun.py produce --data file:///tmp/bw-example --producers 2 --tgbs 200

    # Training: 2 ranks (gloo on CPU), one DP slice each. Saves model, optimizer and the
    # dataset cursor together with torch.distributed.checkpoint every --checkpoint-every
    # steps, marks the checkpoint for BatchWeave's garbage collection, keeps the newest
    # --keep checkpoints and releases the rest. Relaunch the same command after a crash
    # (or pass --max-restarts to torchrun) and it resumes from the newest complete
    # checkpoint, replaying exactly the steps after it.
    torchrun --standalone --nproc_per_node=2 examples/train_torchrun.py train \\
        --data file:///tmp/bw-example --checkpoints /tmp/bw-ckpt --steps 200

    # Any time, from anywhere: delete what no live checkpoint can reach.
    batchweave gc file:///tmp/bw-example --grace-s 60

The model learns y = sin(x . u) + 0.5 (x . v) from 16 features. Each TGB is one
optimizer step: 64 rows, split into ``--dp`` slices (one per rank). The training data a
step sees is fixed by the log, not by which producer won a race, so an interrupted run
reproduces an uninterrupted one step for step; each rank appends its losses (and a
fingerprint of the rows it trained on) to ``<checkpoints>/losses-rank<R>.jsonl``.

A checkpoint also resumes on another number of ranks: copy ``step-N`` into a fresh
``--checkpoints`` directory and launch with another ``--nproc_per_node``. The dataset
cursor counts TGBs, so on 1 rank each 2-slice TGB spans two steps (step numbers double,
so raise ``--steps``) and every remaining row is still read exactly once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np

import batchweave as bw

FEATURES = 16
ROWS_PER_TGB = 64
_TARGET = np.random.default_rng(1234)  # fixed across producers: the function to learn
_U, _V = _TARGET.standard_normal(FEATURES) / 4, _TARGET.standard_normal(FEATURES) / 4
_CHECKPOINT_DIR = re.compile(r"step-(\d{8})")


# -- preprocessing --------------------------------------------------------------------


def make_tgb(producer_index: int, offset: int, dp: int) -> list[dict[str, np.ndarray]]:
    """The TGB a producer publishes at ``offset``: a pure function, so a restart repeats it."""
    rng = np.random.default_rng([producer_index, offset])
    x = rng.standard_normal((ROWS_PER_TGB, FEATURES)).astype(np.float32)
    y = (np.sin(x @ _U) + 0.5 * (x @ _V)).astype(np.float32)[:, None]
    return [{"x": xs, "y": ys} for xs, ys in zip(np.split(x, dp), np.split(y, dp), strict=True)]


def run_producer(url: str, producer_index: int, tgbs: int, dp: int) -> None:
    with bw.Producer(url, f"prep-{producer_index}", dp=dp) as producer:
        for offset in range(producer.resume_offset, tgbs):
            producer.append(make_tgb(producer_index, offset, dp), source_offset=offset)


def produce(args: argparse.Namespace) -> None:
    """Start ``--producers`` processes that together publish ``--tgbs`` TGBs, then wait."""
    if args.tgbs % args.producers:
        sys.exit(f"--tgbs {args.tgbs} must be a multiple of --producers {args.producers}")
    # spawn, not fork: each producer opens its own store connections
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=run_producer, args=(args.data, i, args.tgbs // args.producers, args.dp))
        for i in range(args.producers)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    failed = [f"prep-{i} (exit {w.exitcode})" for i, w in enumerate(workers) if w.exitcode != 0]
    if failed:
        sys.exit(f"producers failed: {', '.join(failed)}")


# -- training -------------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    # torch is imported here, not at the top: a preprocessing pool needs only batchweave.
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from batchweave.torch import TGBDataset

    torch.set_num_threads(1)  # one core per rank; also keeps the float sums reproducible
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dataset = TGBDataset(args.data, mesh=mesh, timeout_s=args.timeout_s)
    checkpoints = Path(args.checkpoints)
    state = {"app": TrainState(model, optimizer), "data": dataset}

    resumed = newest_checkpoint(checkpoints)
    if resumed is not None:
        dcp.load(state, checkpoint_id=str(resumed))  # model, optimizer and the data cursor
    log = LossLog(checkpoints / f"losses-rank{rank}.jsonl")
    log.write(event="start", resumed_from=resumed.name if resumed else None, step=dataset.state_dict()["step"])

    batches = iter(DataLoader(dataset, batch_size=None))  # lazy: reads start at the first next()
    for step in range(dataset.state_dict()["step"], args.steps):
        batch = next(batches)
        if dataset.last_step != step:
            raise RuntimeError(f"rank {rank}: expected step {step}, the dataset delivered {dataset.last_step}")
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        log.write(event="step", step=step, loss=loss.item(), mean_loss=mean_loss.item() / world, data=digest(batch))
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_checkpoint(state, dataset, checkpoints, step + 1, args)
    dataset.close()
    dist.destroy_process_group()


def init_process_group() -> None:
    """``init_process_group("gloo")``, in a store namespace of its own per torchrun restart.

    After ``torchrun --max-restarts`` restarts a worker group on one node, torch 2.13
    hands the new workers the agent's store with the previous attempt's gloo addresses
    still in it, and ``init_process_group`` fails with "Gloo connectFullMesh failed ...
    Connection refused". A prefix per ``TORCHELASTIC_RESTART_COUNT`` keeps attempts apart.
    """
    import torch.distributed as dist

    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world)


class TrainState:
    """Model and optimizer as one DCP ``Stateful`` (FQNs normalised, DDP prefix removed)."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def save_checkpoint(state: dict, dataset, checkpoints: Path, steps_done: int, args: argparse.Namespace) -> None:
    """Save, then mark the checkpoint for BatchWeave, then retire the old ones.

    The order matters. ``dcp.save`` returns on every rank only once the checkpoint's
    metadata is written, so it is durable before any rank marks it. Old checkpoints are
    released only after every rank has marked the new one (the barrier): until then they
    are what protects the data a resume would need.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = checkpoints / f"step-{steps_done:08d}"
    dcp.save(state, checkpoint_id=str(path))
    dataset.mark_checkpoint(checkpoint_id(args.run_id, path))
    dist.barrier()
    if dist.get_rank() == 0:
        for old in complete_checkpoints(checkpoints)[: -args.keep]:
            shutil.rmtree(old)
            # missing_ok: a kill between dcp.save and every rank's mark leaves a complete
            # directory that no rank marked; there is nothing to release for it.
            bw.release_checkpoint(args.data, checkpoint_id(args.run_id, old), missing_ok=True)


def checkpoint_id(run_id: str, path: Path) -> str:
    """The id BatchWeave knows a checkpoint by; unique per training run reading the namespace."""
    return f"{run_id}-{path.name}"


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """Checkpoint directories, oldest first; DCP writes ``.metadata`` last, so a crash mid-save leaves none."""
    found = [p for p in checkpoints.glob("step-*") if _CHECKPOINT_DIR.fullmatch(p.name)]
    return sorted(p for p in found if (p / ".metadata").is_file())


def newest_checkpoint(checkpoints: Path) -> Path | None:
    complete = complete_checkpoints(checkpoints)
    return complete[-1] if complete else None


def digest(batch: dict) -> str:
    """A short fingerprint of the rows a step trained on, to compare runs without storing data."""
    return hashlib.sha256(batch["x"].numpy().tobytes() + batch["y"].numpy().tobytes()).hexdigest()[:16]


class LossLog:
    """One JSON line per event, flushed at once so a SIGKILL loses nothing already written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def write(self, **record) -> None:
        record.update(pid=os.getpid(), restart=self.restart)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


# -- command line ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    producing = commands.add_parser("produce", help="publish TGBs from producer processes")
    producing.add_argument("--data", required=True, help="namespace URL, e.g. s3://bucket/run or a directory")
    producing.add_argument("--producers", type=int, default=2)
    producing.add_argument("--tgbs", type=int, required=True, help="TGBs in total, once all producers are done")
    producing.add_argument("--dp", type=int, default=2, help="slices per TGB: the training job's DP size")
    training = commands.add_parser("train", help="train under torchrun")
    training.add_argument("--data", required=True, help="namespace URL")
    training.add_argument("--checkpoints", required=True, help="directory for DCP checkpoints and loss logs")
    training.add_argument("--steps", type=int, required=True)
    training.add_argument("--checkpoint-every", type=int, default=10)
    training.add_argument("--keep", type=int, default=2, help="newest checkpoints kept; older are released")
    training.add_argument("--run-id", default="train", help="prefix of this run's checkpoint ids in the namespace")
    training.add_argument("--lr", type=float, default=1e-2)
    training.add_argument("--timeout-s", type=float, default=600.0, help="fail when no step arrives for this long")
    args = parser.parse_args(argv)
    if args.command == "produce":
        produce(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
