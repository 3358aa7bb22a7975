"""The WebDataset peer's shard layouts (``bench consumers``): pure logic, no server."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.webdataset_peer import SHARD_BYTES, shard_plan


def rank_gets(shards: list[list[tuple[int, int]]], world: int, rank: int) -> list[tuple[int, int]]:
    """What ``wds.split_by_node`` hands rank ``rank``: shards rank, rank + W, ..."""
    return [sample for shard in itertools.islice(shards, rank, None, world) for sample in shard]


@pytest.mark.parametrize(("world", "steps", "payload"), [(4, 6, 100_000), (8, 3, 10_000_000), (3, 7, 30_000_000)])
def test_per_rank_shards_give_each_rank_its_slice_of_every_step(world, steps, payload):
    shards = shard_plan(world, steps, payload, "rank-major")
    assert all(len(shard) * payload <= max(SHARD_BYTES, payload) for shard in shards)
    for rank in range(world):
        assert rank_gets(shards, world, rank) == [(step, rank) for step in range(steps)]


@pytest.mark.parametrize(("world", "steps", "payload"), [(4, 6, 100_000), (8, 3, 10_000_000), (128, 64, 100_000)])
def test_global_order_shards_cover_every_rank_with_a_block_of_steps(world, steps, payload):
    shards = shard_plan(world, steps, payload, "step-major")
    assert [s for shard in shards for s in shard] == [(t, r) for t in range(steps) for r in range(world)]
    assert len(shards) >= world and all(len(shard) * payload <= max(SHARD_BYTES, payload) for shard in shards)
    got = rank_gets(shards, world, world - 1)
    assert got and got != [(step, world - 1) for step in range(steps)]  # not its own slices


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="unknown layout 'columns'"):
        shard_plan(2, 2, 10, "columns")
