"""WebDataset, a reading-side peer of ``bench consumers``.

The benchmark's samples (the same bytes as ``streaming_peer``'s) as POSIX tar shards, one
``{key}.bin`` entry per sample (key ``s{step:06d}r{rank:05d}``), and one rank's pass with
``wds.WebDataset(urls, nodesplitter=...)``, whose node splitter gives rank ``r`` of ``W``
the shards ``r, r + W, r + 2W, ...`` of the list (``wds.split_by_node``'s rule, with the
rank given instead of read from the environment, so ranks can run one after another in
one process). WebDataset has no resume: a rank restarts its shards from the beginning.

Shards hold at most ``SHARD_BYTES`` (64 MB, as MDS shards and LitData chunks) and are
written whole with ``wds.TarWriter`` (set-up, straight to the server). Two layouts:

- ``webdataset`` (``step-major``): the samples in the global order (step-major,
  rank-minor, as MDS and LitData hold them), cut into at least W shards so that every
  rank gets one: rank r reads a contiguous block of whole steps (all ranks' slices), not
  its own slice of each step. Shuffling shards (``shardshuffle``) would not change that.
- ``webdataset-per-rank`` (``rank-major``): each rank's slices, step by step, in shards of
  their own, listed so that the node splitter hands rank r exactly its shards. Every
  rank reads its own samples, but the shard layout fixes the world size when the data is
  written: a different W needs the data rewritten.

Reads go through the benchmark's proxy with a ``gopen`` handler (WebDataset's URL
opener table) for the scheme ``bwproxy://HOST:PORT/BUCKET/KEY`` that streams the object
with obstore from that endpoint: one GET per shard, read as the tar is parsed.
"""

from __future__ import annotations

import io
import itertools
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.peers import base_payload, sample_payload, timed_pass

__all__ = ["SHARD_BYTES", "read_pass", "shard_plan", "write"]

SHARD_BYTES = 64_000_000
SCHEME = "bwproxy"
_STREAM_CHUNK = 8 * 1024 * 1024


def shard_plan(world: int, steps: int, payload: int, layout: str) -> list[list[tuple[int, int]]]:
    """The shards in list order, each the (step, rank) of its samples in order."""
    fit = max(1, SHARD_BYTES // payload)
    if layout == "step-major":
        order = [(step, rank) for step in range(steps) for rank in range(world)]
        size = min(fit, -(-len(order) // world))  # at least W shards
        return [order[i : i + size] for i in range(0, len(order), size)]
    if layout == "rank-major":
        size = min(fit, steps)
        # Chunk j of every rank, rank by rank: the node splitter's slice r::W is rank r's.
        return [
            [(step, rank) for step in range(start, min(steps, start + size))]
            for start in range(0, steps, size)
            for rank in range(world)
        ]
    raise ValueError(f"unknown layout {layout!r}")


def write(url: str, world: int, steps: int, payload: int, seed: int, layout: str) -> list[str]:
    """Write the shards under ``url`` (``s3://bucket/prefix``, the server itself); return
    their keys in list order."""
    import webdataset as wds

    from batchweave.store import open_store

    store = open_store(url)
    base = base_payload(payload, seed)
    keys = []
    for index, samples in enumerate(shard_plan(world, steps, payload, layout)):
        buffer = io.BytesIO()
        with wds.TarWriter(buffer) as tar:
            for step, rank in samples:
                tar.write({"__key__": f"s{step:06d}r{rank:05d}", "bin": sample_payload(base, step, rank)})
        key = f"shard-{index:06d}.tar"
        store.put(key, buffer.getvalue())
        keys.append(key)
    return keys


def shard_urls(endpoint: str, bucket: str, prefix: str, keys: list[str]) -> list[str]:
    host = endpoint.split("://", 1)[1].rstrip("/")
    return [f"{SCHEME}://{host}/{bucket}/{prefix}/{key}" for key in keys]


def read_pass(urls: list[str], world: int, rank: int) -> dict[str, Any]:
    """One rank's pass over its shards: arrival times, (step, rank) tags, bytes delivered."""
    import webdataset as wds

    _register_opener()
    started = time.monotonic()
    dataset = wds.WebDataset(
        urls,
        shardshuffle=False,
        nodesplitter=lambda src: itertools.islice(src, rank, None, world),  # wds.split_by_node's rule
        empty_check=False,  # a rank without shards reads nothing, as WebDataset would leave it
    )
    record, _ = timed_pass((sample["bin"] for sample in dataset), started)
    return record


# ---------------------------------------------------------------------- reading through obstore

_stores: dict[tuple[str, str], Any] = {}


def _register_opener() -> None:
    from webdataset.gopen import gopen_schemes

    gopen_schemes[SCHEME] = _open


def _open(url: str, mode: str = "rb", bufsize: int = 8192, **_: Any) -> io.BufferedReader:
    """WebDataset's opener for ``bwproxy://HOST:PORT/BUCKET/KEY``: a streaming GET."""
    import obstore

    host, bucket, key = url.split("://", 1)[1].split("/", 2)
    result = obstore.get(_store(host, bucket), key)
    return io.BufferedReader(_ChunkStream(result.stream(min_chunk_size=_STREAM_CHUNK)), buffer_size=bufsize)


def _store(host: str, bucket: str) -> Any:
    from obstore.store import S3Store

    if (host, bucket) not in _stores:
        # Credentials and region from the AWS_* environment; the endpoint is the proxy's.
        _stores[host, bucket] = S3Store(
            bucket,
            config={"endpoint": f"http://{host}", "virtual_hosted_style_request": False},
            client_options={"allow_http": True},
        )
    return _stores[host, bucket]


class _ChunkStream(io.RawIOBase):
    """A readable raw stream over an iterator of byte chunks (obstore's streamed body)."""

    def __init__(self, chunks: Iterator[Any]) -> None:
        self._chunks = chunks
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = memoryview(bytes(chunk))
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count
