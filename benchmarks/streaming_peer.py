"""MosaicML Streaming, the reading-side baseline of ``bench consumers`` (paper 7.4).

Two commands, each run as ``python -m benchmarks.streaming_peer ...`` in its own
process (Streaming reads rank and world size from the environment and keeps state in
shared memory and a local cache directory, so one process is one rank):

- ``write``: the benchmark's samples as MDS shards (``MDSWriter``, default 64 MiB
  ``size_limit``, one raw-bytes column) to an ``s3://`` remote; sample ``step * W + rank``
  is rank ``rank``'s slice of step ``step`` (global order, step-major, rank-minor).
- ``read``: one rank's pass with ``StreamingDataset`` from a fresh cache directory, then
  the resume check if the parent asks (``benchmarks.peers`` gives the protocol).

Every rank runs alone, as its own node (``LOCAL_WORLD_SIZE=1``): Streaming's ranks of
one node wait for each other on shared-memory barriers, so a rank of an 8-rank node
cannot be run by itself. Modes:

- ``default``: ``StreamingDataset``'s defaults (no shuffle, ``num_canonical_nodes`` =
  the number of nodes = W, ``relaxed`` partition, predownload 8 x batch_size) and
  ``batch_size=1`` (one sample per rank per step; Streaming refuses to iterate without a
  batch size when WORLD_SIZE > 1). The
  partition gives each node a contiguous 1/W of the sample order: rank r gets samples
  ``[r*S, (r+1)*S)``, i.e. whole steps' worth of every rank's slices, not its own slice
  of each step. Few shards per rank, but not the data a data-parallel rank must see.
- ``per-rank``: ``num_canonical_nodes=1, batch_size=1``: the single canonical node's
  samples are striped over the W physical nodes, so rank r gets samples
  ``r, W + r, 2W + r, ...``, exactly its slice of every step. Its samples lie in every
  shard, and Streaming fetches whole shards into the cache: each rank downloads about
  the whole data set.
"""

from __future__ import annotations

import os
import sys
import time
import types
from typing import Any

from benchmarks import peers

__all__ = ["import_streaming"]


def import_streaming() -> Any:
    """``import streaming`` in this environment.

    The dev environment pins torch 2.13 (CPU), beside which no torchvision imports, and
    has no transformers; ``streaming/__init__`` imports ``streaming.vision`` (torchvision),
    ``streaming.text`` and ``streaming.multimodal``, none of which the benchmark uses, and
    ``streaming.base.dataloader`` imports two classes from transformers only to recognise
    batches of those types. Empty modules stand in for the three packages, and dict
    subclasses for the two classes when transformers is missing. The MDS reader and
    writer, the partitioner and the S3 downloader are untouched.
    """
    for name in ("streaming.vision", "streaming.text", "streaming.multimodal"):
        sys.modules.setdefault(name, types.ModuleType(name))
    try:
        import transformers  # noqa: F401
    except ImportError:
        _stub_transformers()
    import streaming

    return streaming


def _stub_transformers() -> None:
    features = types.ModuleType("transformers.feature_extraction_utils")
    tokenization = types.ModuleType("transformers.tokenization_utils_base")
    features.BatchFeature = type("BatchFeature", (dict,), {})
    tokenization.BatchEncoding = type("BatchEncoding", (dict,), {})
    package = types.ModuleType("transformers")
    package.feature_extraction_utils = features
    package.tokenization_utils_base = tokenization
    sys.modules.update(
        {
            "transformers": package,
            "transformers.feature_extraction_utils": features,
            "transformers.tokenization_utils_base": tokenization,
        }
    )


# ---------------------------------------------------------------------- write


def write(remote: str, world: int, steps: int, payload_bytes: int, seed: int) -> dict[str, Any]:
    streaming = import_streaming()
    base = peers.base_payload(payload_bytes, seed)
    started = time.monotonic()
    with streaming.MDSWriter(out=remote, columns={"data": "bytes"}) as writer:
        for step in range(steps):
            for rank in range(world):
                writer.write({"data": peers.sample_payload(base, step, rank)})
    return {"samples": steps * world, "write_s": time.monotonic() - started}


# ---------------------------------------------------------------------- read


def _dataset(remote: str, cache: str, mode: str) -> Any:
    streaming = import_streaming()
    # With WORLD_SIZE > 1 and no process group, StreamingDataset starts one (env://
    # rendezvous) only to put barriers around its shared-memory set-up. The benchmark
    # runs ranks one at a time, each its own node, so there is nobody to meet.
    import streaming.base.dataset as dataset_module

    dataset_module.maybe_init_dist = lambda: False
    if mode == "default":
        return streaming.StreamingDataset(remote=remote, local=cache, batch_size=1)
    if mode == "per-rank":
        return streaming.StreamingDataset(remote=remote, local=cache, num_canonical_nodes=1, batch_size=1)
    raise ValueError(f"unknown mode {mode!r}")


def read_pass(remote: str, mode: str, world: int, stop_at: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One rank's whole pass; also Streaming's resume state after ``stop_at`` samples
    (``num_samples`` counts samples of all ranks, as StreamingDataLoader counts them)."""
    with peers.fresh_cache("bench-streaming-cache-") as cache:
        started = time.monotonic()
        dataset = _dataset(remote, cache, mode)
        samples = (sample["data"] for sample in dataset)
        record, state = peers.timed_pass(
            samples, started, stop_at, lambda: dataset.state_dict(num_samples=stop_at * world, from_beginning=False)
        )
        return {**record, "cache_bytes": peers.tree_bytes(cache)}, state


def resume_pass(remote: str, mode: str, state: dict[str, Any]) -> dict[str, Any]:
    """A new dataset (new process state, new cache) loads the saved state and reads on."""
    with peers.fresh_cache("bench-streaming-resume-") as cache:
        dataset = _dataset(remote, cache, mode)
        dataset.load_state_dict(state)
        return peers.resumed(sample["data"] for sample in dataset)


def main(argv: list[str] | None = None) -> int:
    parser, _ = peers.command_line("python -m benchmarks.streaming_peer")
    args = parser.parse_args(argv)
    if args.command == "write":
        return peers.emit(write(args.remote, args.world, args.steps, args.payload, args.seed))
    world = int(os.environ["WORLD_SIZE"])
    import_streaming()  # torch and all: seconds of imports that a training process has done long before
    record, state = read_pass(args.remote, args.mode, world, args.stop_at)
    return peers.answer(record, state, lambda: resume_pass(args.remote, args.mode, state))


if __name__ == "__main__":
    sys.exit(main())
