"""LitData (Lightning AI's ``litdata``), a reading-side peer of ``bench consumers``.

Two commands, each run as ``python -m benchmarks.litdata_peer ...`` in its own process
(LitData reads the rank from ``GLOBAL_RANK`` and the world size from ``WORLD_SIZE`` and
keeps downloaded chunks in a local cache directory, so one process is one rank):

- ``write``: the benchmark's samples (the same bytes as ``streaming_peer``'s, sample
  ``step * W + rank`` is rank ``rank``'s slice of step ``step``) with ``litdata.optimize``
  to an ``s3://`` output directory: LitData's chunked binary format, each sample a bare
  ``bytes`` leaf (see ``_sample``), chunks of LitData's default size (``chunk_bytes``
  64 MiB, as MDS shards), one worker so that the chunks keep the samples in order, plus
  an ``index.json`` naming the chunks.
- ``read``: one rank's pass from a fresh cache directory, then the resume check if the
  parent asks (``benchmarks.peers`` gives the protocol).

LitData 0.2.76 reaches S3 with boto3 (``index.json``, and the byte ranges of random
access) and obstore (whole chunks, configured from the same boto3 client); it has no
s5cmd path. ``storage_options={"endpoint_url": ...}`` goes to the boto3 client, whose
endpoint obstore copies, so every request passes through the benchmark's proxy.

Modes:

- ``default``: ``StreamingDataset`` iterated with its defaults (no shuffle,
  ``max_pre_download=2`` chunks downloaded ahead by a background thread). Like
  Streaming's default, it gives rank r a contiguous 1/W of the sample order
  (``[r*S, (r+1)*S)``): whole steps' worth of every rank's slices, not its own slice
  of each step. Resume: ``state_dict(num_samples_yielded, num_workers=1, batch_size=1)``
  then ``load_state_dict`` in a new dataset.
- ``per-rank``: LitData's iteration has no striped partition (its ``num_canonical_nodes``
  only freezes the node count for elastic resume), so a rank that must see its slice of
  every step uses LitData's random access, as a map-style ``DistributedSampler`` would
  (``shuffle=False``): ``dataset[step * W + rank]`` for each step, one after another.
  Random access fetches only the sample's bytes (two range GETs: its offsets in the
  chunk's header, then the sample) and keeps nothing in the cache; there is no read-ahead
  (concurrency would come from DataLoader worker processes, one rank at a time here).
  Resume is the application's own index into the order: no LitData state, so "n/a".
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

from benchmarks import peers

__all__ = ["storage_options"]


def storage_options() -> dict[str, str]:
    """boto3 client options: the endpoint the parent chose (the proxy, or the server itself
    for writing)."""
    endpoint = os.environ["S3_ENDPOINT_URL"]
    if endpoint.startswith("http://"):
        _allow_plain_http()
    return {"endpoint_url": endpoint}


def _allow_plain_http() -> None:
    """The local server speaks plain HTTP (cloud S3 speaks HTTPS). LitData hands obstore
    its own client options, which leave out ``allow_http`` (obstore then refuses any
    ``http://`` URL, whatever ``AWS_ALLOW_HTTP`` says): add it to that dict, nothing else."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"


# ---------------------------------------------------------------------- write


def _sample(index: int, base: bytes, world: int) -> bytes:
    """The sample itself, not ``{"data": bytes}``: LitData 0.2.76 stores a dict of one
    bytes field as an Arrow table at the chunk's end (its writer's "Arrow footer" for flat
    structs) with every item offset pointing at the header, and its random access by
    byte range then reads 0 bytes and fails (``struct.error``). A bare bytes leaf keeps
    the offset table that both iteration and random access read."""
    step, rank = divmod(index, world)
    return peers.sample_payload(base, step, rank)


def write(remote: str, world: int, steps: int, payload_bytes: int, seed: int) -> dict[str, Any]:
    from litdata import optimize
    from litdata.constants import _DEFAULT_CHUNK_BYTES

    base = peers.base_payload(payload_bytes, seed)
    started = time.monotonic()
    optimize(
        fn=functools.partial(_sample, base=base, world=world),
        inputs=list(range(steps * world)),
        output_dir=remote,
        chunk_bytes=_DEFAULT_CHUNK_BYTES,  # required; LitData's own default, as MDS's 64 MiB
        num_workers=1,  # one writer: the chunks hold the samples in the order given
        mode="overwrite",
        start_method="fork",  # the worker inherits this process's imports (spawn: seconds of torch again)
        storage_options=storage_options(),
        verbose=False,
    )
    return {"samples": steps * world, "write_s": time.monotonic() - started}


# ---------------------------------------------------------------------- read


def _dataset(remote: str, cache: str) -> Any:
    from litdata import StreamingDataset

    return StreamingDataset(remote, cache_dir=cache, storage_options=storage_options())


def read_pass(remote: str, mode: str, world: int, rank: int, steps: int, stop_at: int) -> tuple[dict, dict]:
    """One rank's whole pass, and (default mode) LitData's resume state after ``stop_at``
    samples."""
    with peers.fresh_cache("bench-litdata-cache-") as cache:
        started = time.monotonic()
        dataset = _dataset(remote, cache)
        if mode == "default":
            record, state = peers.timed_pass(
                iter(dataset),
                started,
                stop_at,
                lambda: dataset.state_dict(num_samples_yielded=stop_at, num_workers=1, batch_size=1),
            )
        else:
            record, state = peers.timed_pass((dataset[step * world + rank] for step in range(steps)), started)
        return {**record, "cache_bytes": peers.tree_bytes(cache)}, state


def resume_pass(remote: str, state: dict[str, Any]) -> dict[str, Any]:
    """A new dataset (new cache) loads the saved state and reads on."""
    with peers.fresh_cache("bench-litdata-resume-") as cache:
        dataset = _dataset(remote, cache)
        # The state names the first pass's cache directory (a fresh one per pass here, as
        # on a new machine), which LitData checks against its own: this dataset's.
        dataset.load_state_dict({**state, "cache_dir_path": cache, "input_dir_path": dataset.input_dir.path})
        return peers.resumed(dataset)


def main(argv: list[str] | None = None) -> int:
    parser, read = peers.command_line("python -m benchmarks.litdata_peer")
    read.add_argument("--steps", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "write":
        return peers.emit(write(args.remote, args.world, args.steps, args.payload, args.seed))
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["GLOBAL_RANK"])
    import litdata  # noqa: F401  (torch and all: seconds of imports a training process has done long before)

    record, state = read_pass(args.remote, args.mode, world, rank, args.steps, args.stop_at)
    return peers.answer(record, state, (lambda: resume_pass(args.remote, state)) if state else None)


if __name__ == "__main__":
    sys.exit(main())
