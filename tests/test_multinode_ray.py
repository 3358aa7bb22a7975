"""A producer pool over a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
a head node and a worker node, each its own raylet with its own resources and processes).

Placement is forced by resources: the head has no CPUs (``num_cpus=0``, as Ray advises for
large clusters), producer 0 is pinned to it and reserves nothing, producer 1 reserves the
worker node's only CPU. The worker node is killed (SIGKILL of its raylet and services) while
producer 1 is held inside a shard with shards of its own committed; a replacement node
joins, as an autoscaler would bring one, Ray restarts producer 1 there, and every shard is
committed exactly once, in order.

An actor that reserves a CPU can only go to the worker node: that is how the pool's
progress tracker used to be lost with that node, failing the pool at its end (it now runs
on the driver's node, reserving nothing).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pool_work
import pytest
from checks import check_pool_exactly_once_in_order, own_ray_temp_root

import batchweave as bw
from batchweave.pool import PoolPlan

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402  (needs ray)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from batchweave.ray_pool import producer_options  # noqa: E402

pytestmark = pytest.mark.slow

WAIT_S = 60


@pytest.fixture(scope="module")
def cluster():
    """Head (the driver's node, no CPUs) + one worker node, stopped by ``cluster.shutdown()``."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Workers import pool_work from tests/, and batchweave from this checkout, as the driver does.
    tests = os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(Path(__file__).parent)])
    with own_ray_temp_root() as temp_dir:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "temp_dir": temp_dir,
                # A lost node is declared dead after ~0.6 s of failed health checks (default ~15 s).
                "_system_config": {"health_check_period_ms": 200, "health_check_failure_threshold": 3},
            },
        )
        try:
            worker = cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": tests}}, log_to_driver=False)
            yield cluster, worker
        finally:
            ray.shutdown()
            cluster.shutdown()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def offset_of(url: str, producer_id: str) -> int:
    return bw.inspect_namespace(url).producers.get(producer_id, {}).get("offset", 0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_pool_across_two_nodes_survives_the_loss_of_one_and_commits_every_shard_once(cluster, tmp_path):
    cluster, worker = cluster
    head = cluster.head_node.node_id
    url = (tmp_path / "ns").as_uri()  # both nodes are this machine: a directory they share
    victim = 9  # producer 1 (on the worker node) at offset 4
    source = [(shard, victim, str(tmp_path)) for shard in range(16)]
    # Producer 0 on the head, reserving nothing; producer 1 needs a CPU: the worker node's.
    # (Ray's soft node affinity would let producer 1 restart anywhere, but it also spills to
    # another node while the chosen one is alive but slow to start a worker process.)
    placed = [
        {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(head, soft=False)},
        {"num_cpus": 1},
    ]

    with ThreadPoolExecutor(1) as driver:
        running = driver.submit(
            bw.run_pool, url, "prep", source, pool_work.noted_held_at, producers=2, dp=pool_work.DP,
            backend="ray", progress=False, end_of_stream=True, ray_remote_args=placed.__getitem__,
        )  # fmt: skip
        wait_until(lambda: (tmp_path / "held").exists() or running.done(), "producer 1 to hold at shard 9")
        assert not running.done(), running.result()  # the pool's error, if it ended early
        held = int((tmp_path / "held").read_text())
        # Mid-run: the worker node's producer has committed the 4 shards before shard 9 (DAC
        # commits what is pending while it holds) and is inside shard 9. Waiting for all 4
        # makes the restart redo exactly shard 9 (with fewer, it would redo some on the new node).
        wait_until(lambda: offset_of(url, "prep.0001-of-0002") == 4, "producer 1 to commit shards 1, 3, 5, 7")
        cluster.remove_node(worker, allow_graceful=False)  # SIGKILL of that node's raylet and services
        replacement = cluster.add_node(num_cpus=1)
        report = running.result(timeout=WAIT_S)
    wait_until(lambda: not alive(held), "the held producer on the lost node to exit")

    assert report.restarts == {"prep.0000-of-0002": 0, "prep.0001-of-0002": 1}
    check_pool_exactly_once_in_order(url, 16, 2, pool_work.DP)
    ran: dict[int, set[tuple[str, int]]] = {}
    for note in (tmp_path / "ran").iterdir():
        shard, pid = map(int, note.name.split("-"))
        ran.setdefault(shard, set()).add((note.read_text(), pid))
    assert sorted(ran) == list(range(16))
    assert {node for shard in range(0, 16, 2) for node, _ in ran[shard]} == {head}
    before = {node for shard in range(1, victim, 2) for node, _ in ran[shard]}
    after = {node for shard in range(victim + 2, 16, 2) for node, _ in ran[shard]}
    assert (before, after) == ({worker.node_id}, {replacement.node_id})
    assert {node for node, pid in ran[victim] if pid != held} == {replacement.node_id}


def test_producer_actor_options_spread_by_default_and_keep_what_the_pool_owns():
    plan = PoolPlan("prep", 2, 10)
    assert producer_options(plan, 0, None) == {"scheduling_strategy": "SPREAD"}
    chosen = {"num_cpus": 2, "resources": {"tokenizer": 1}, "scheduling_strategy": "DEFAULT"}
    assert producer_options(plan, 1, chosen) == chosen
    assert producer_options(plan, 1, lambda index: {"num_cpus": index}) == {
        "scheduling_strategy": "SPREAD",
        "num_cpus": 1,
    }
    with pytest.raises(bw.ConfigError, match=r"prep.0001-of-0002 sets \['max_restarts', 'name'\], which the pool sets"):
        producer_options(plan, 1, {"name": "mine", "max_restarts": 9})
    with pytest.raises(bw.ConfigError, match=r"prep.0000-of-0002 must be a dict of Ray actor options, got \[1\]"):
        producer_options(plan, 0, lambda index: [1])  # pyright: ignore[reportArgumentType]


def test_ray_remote_args_need_the_ray_backend(tmp_path):
    with pytest.raises(bw.ConfigError, match="ray_remote_args places Ray actors: it needs backend='ray', not 'local'"):
        bw.run_pool(
            tmp_path.as_uri(), "prep", [0], pool_work.tgb_of, producers=1, dp=2, ray_remote_args={"num_cpus": 1}
        )


def test_bad_ray_remote_args_are_refused_before_the_pool_touches_the_store(tmp_path):
    url = (tmp_path / "ns").as_uri()
    with pytest.raises(bw.ConfigError, match=r"prep.0000-of-0001 sets \['lifetime'\]"):
        bw.run_pool(url, "prep", [0], pool_work.tgb_of, producers=1, dp=2, backend="ray",
                    ray_remote_args={"lifetime": "detached"})  # fmt: skip
    assert not (tmp_path / "ns").exists()  # no shard list recorded, no namespace created
