"""Producer pools (``batchweave.pool``): every shard becomes one TGB, exactly once, across
worker crashes (real SIGKILLs), restarts of the whole pool, and preprocessing errors."""

from __future__ import annotations

import pool_work
import pytest

import batchweave as bw
from batchweave.pool import PoolPlan, run_pool


def read_shards(url) -> list[int]:
    """The shard behind every step, in step order (rank 0 of dp=2), until the stream ends."""
    with bw.Consumer(url, dp=pool_work.DP, rank=0, timeout_s=30) as consumer:
        return [int(batch.data["shard"][0]) for batch in consumer]


def test_plan_gives_every_shard_to_exactly_one_producer_offset():
    for producers in range(1, 8):
        for shards in range(0, 30):
            plan = PoolPlan("prep", producers, shards)
            owned = [
                plan.shard(index, offset) for index in range(producers) for offset in range(plan.shard_count(index))
            ]
            assert sorted(owned) == list(range(shards))
    assert PoolPlan("prep", 3, 10).producer_id(2) == "prep.0002-of-0003"


def test_plan_refuses_a_pool_known_with_another_size():
    plan = PoolPlan("prep", 4, 10)
    plan.check_log(["prep.0000-of-0004", "other.0000-of-0002", "prepare.0001-of-0002"])
    with pytest.raises(bw.ConfigError, match="started with 3 producers, now with 4"):
        plan.check_log(["prep.0000-of-0003"])
    for bad in ("", "a/b", "x" * 200):
        with pytest.raises(bw.ConfigError):
            PoolPlan(bad, 1, 1)
    with pytest.raises(bw.ConfigError, match="at least one producer"):
        PoolPlan("prep", 0, 1)


def test_pool_commits_every_shard_once_and_a_rerun_commits_nothing(tmp_path):
    url = (tmp_path / "ns").as_uri()
    shards = list(range(23))
    report = run_pool(url, "prep", shards, pool_work.tgb_of, producers=3, dp=pool_work.DP, progress=False)
    assert report.produced == 23 and set(report.resumed_at.values()) == {0}
    assert sorted(report.metrics) == [f"prep.000{i}-of-0003" for i in range(3)]
    again = run_pool(
        url, "prep", shards, pool_work.tgb_of, producers=3, dp=pool_work.DP, progress=False, end_of_stream=True
    )
    assert again.produced == 0
    assert again.resumed_at == {PoolPlan("prep", 3, 23).producer_id(i): n for i, n in enumerate((8, 8, 7))}
    seen = read_shards(url)
    assert sorted(seen) == shards
    for owner in range(3):  # each producer's shards arrive in its offset order
        mine = [s for s in seen if s % 3 == owner]
        assert mine == sorted(mine)
    with pytest.raises(bw.ConfigError, match="started with 3 producers"):
        run_pool(url, "prep", shards, pool_work.tgb_of, producers=4, dp=pool_work.DP, progress=False)


def test_sigkilled_worker_is_restarted_and_no_shard_repeats_or_goes_missing(tmp_path):
    url = (tmp_path / "ns").as_uri()
    source = [(shard, 13, str(tmp_path)) for shard in range(20)]
    report = run_pool(
        url, "prep", source, pool_work.killed_once_at, producers=2, dp=pool_work.DP, progress=False, end_of_stream=True
    )
    assert (tmp_path / "killed").exists()
    assert report.restarts == {"prep.0000-of-0002": 0, "prep.0001-of-0002": 1}  # shard 13 is producer 1's
    assert sorted(read_shards(url)) == list(range(20))


def test_a_preprocessing_bug_surfaces_after_the_restarts_run_out(tmp_path):
    url = (tmp_path / "ns").as_uri()
    source = [(shard, 5) for shard in range(8)]
    failed = r"prep.0001-of-0002 failed 2 times .*ValueError: cannot parse shard 5"
    with pytest.raises(bw.BatchWeaveError, match=failed):
        run_pool(url, "prep", source, pool_work.fails_at, producers=2, dp=pool_work.DP, max_restarts=1, progress=False)
    # What came before the bad shard is committed; the fixed pool resumes right there.
    state = bw.inspect_namespace(url).producers
    assert state["prep.0001-of-0002"]["offset"] == 2 and state["prep.0000-of-0002"]["offset"] == 4
    fixed = run_pool(
        url, "prep", list(range(8)), pool_work.tgb_of, producers=2, dp=2, progress=False, end_of_stream=True
    )
    assert fixed.resumed_at["prep.0001-of-0002"] == 2 and fixed.produced == 2
    assert sorted(read_shards(url)) == list(range(8))


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(bw.ConfigError, match="unknown pool backend"):
        run_pool((tmp_path / "ns").as_uri(), "prep", [1], pool_work.tgb_of, producers=1, dp=2, backend="mpi")
