"""The Ray backend of producer pools (``batchweave.ray_pool``) on a real local Ray cluster,
shared by the module: every shard exactly once, in order, across ``ray.kill`` and SIGKILLs
of producer actors at chosen shards, and across a restart of the whole pool."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pool_work
import pytest
from checks import check_pool_exactly_once_in_order, own_ray_temp_root

import batchweave as bw
from batchweave.pool import PoolPlan, run_pool

ray = pytest.importorskip("ray")
from batchweave.ray_pool import actor_name  # noqa: E402  (needs ray)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    tests = Path(__file__).parent
    with own_ray_temp_root():
        ray.init(
            address="local",  # never attach to another cluster on this machine
            num_cpus=2,
            include_dashboard=False,
            # Workers import pool_work, and examples.lerobot_video from the repository's root;
            # and batchweave from this checkout, as the driver does (not whichever the venv holds).
            runtime_env={
                "env_vars": {"PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests), str(tests.parent)])}
            },
            log_to_driver=False,
        )
        yield
        ray.shutdown()


def check_exactly_once_in_order(url, shards: int, producers: int) -> None:
    check_pool_exactly_once_in_order(url, shards, producers, pool_work.DP)


def wait_for(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def test_ray_pool_commits_every_shard_once_and_a_rerun_commits_nothing(tmp_path):
    url = (tmp_path / "ns").as_uri()
    shards = list(range(23))
    report = run_pool(
        url, "prep", shards, pool_work.tgb_of, producers=3, dp=pool_work.DP, backend="ray", progress=False
    )
    assert report.produced == 23 and set(report.resumed_at.values()) == {0}
    assert report.restarts == {f"prep.000{i}-of-0003": 0 for i in range(3)}
    again = run_pool(
        url, "prep", shards, pool_work.tgb_of, producers=3, dp=pool_work.DP, backend="ray", progress=False,
        end_of_stream=True,
    )  # fmt: skip
    assert again.produced == 0
    assert again.resumed_at == {PoolPlan("prep", 3, 23).producer_id(i): n for i, n in enumerate((8, 8, 7))}
    check_exactly_once_in_order(url, 23, 3)
    # The Ray backend goes through the same shard-list check, before any actor starts.
    with pytest.raises(bw.ConfigError, match=r"pool 'prep' recorded another shard list .*shard 0 differs"):
        run_pool(url, "prep", shards[::-1], pool_work.tgb_of, producers=3, dp=2, backend="ray", progress=False)


@pytest.mark.parametrize("kill", ["ray.kill", "SIGKILL"])
def test_a_killed_producer_actor_is_restarted_by_ray_and_no_shard_repeats_or_goes_missing(tmp_path, kill):
    url = (tmp_path / "ns").as_uri()
    source = [(shard, 13, str(tmp_path)) for shard in range(20)]  # shard 13: producer 1, offset 6
    with ThreadPoolExecutor(1) as driver:
        running = driver.submit(
            run_pool, url, "prep", source, pool_work.held_at, producers=2, dp=pool_work.DP, backend="ray",
            progress=False, end_of_stream=True,
        )  # fmt: skip
        pid = int(wait_for(tmp_path / "held"))  # the actor's own PID, written from inside it
        assert bw.inspect_namespace(url).producers["prep.0001-of-0002"]["offset"] <= 6
        if kill == "ray.kill":
            ray.kill(ray.get_actor(actor_name("prep.0001-of-0002")), no_restart=False)
        else:
            os.kill(pid, signal.SIGKILL)  # only that worker process
        report = running.result(timeout=120)
    assert report.restarts == {"prep.0000-of-0002": 0, "prep.0001-of-0002": 1}
    assert report.resumed_at == {"prep.0000-of-0002": 0, "prep.0001-of-0002": 0}
    # report.produced counts the last incarnation only: the killed one's metrics died with it.
    check_exactly_once_in_order(url, 20, 2)


def test_a_preprocessing_bug_surfaces_after_the_retries_run_out(tmp_path):
    url = (tmp_path / "ns").as_uri()
    source = [(shard, 5) for shard in range(8)]
    with pytest.raises(bw.PoolFailedError, match=r"prep.0001-of-0002 failed 2 times .*cannot parse shard 5") as raised:
        run_pool(
            url, "prep", source, pool_work.fails_at, producers=2, dp=pool_work.DP, backend="ray", max_restarts=1,
            progress=False,
        )  # fmt: skip
    assert raised.value.attempts == 2 and "cannot parse shard 5" in raised.value.cause
    assert bw.inspect_namespace(url).producers["prep.0001-of-0002"]["offset"] == 2


def test_more_producers_than_the_cluster_has_room_for_run_as_others_finish(tmp_path):
    url = (tmp_path / "ns").as_uri()
    # 3 producers reserving a CPU each on a 2-CPU cluster: the third starts when one is done.
    with ThreadPoolExecutor(1) as driver:
        running = driver.submit(
            run_pool, url, "prep", list(range(9)), pool_work.tgb_of, producers=3, dp=pool_work.DP, backend="ray",
            progress=False, end_of_stream=True, ray_remote_args={"num_cpus": 1},
        )  # fmt: skip
        try:
            report = running.result(timeout=60)
        except TimeoutError:
            for index in range(3):  # end the pool: its run tasks fail once their actors are gone
                ray.kill(ray.get_actor(actor_name(PoolPlan("prep", 3, 9).producer_id(index))), no_restart=True)
            pytest.fail("a producer never started: the finished ones kept their CPUs")
    assert report.produced == 9
    check_exactly_once_in_order(url, 9, 3)


def test_the_video_example_publishes_its_steps_from_ray_actors(tmp_path):
    lv = pytest.importorskip("examples.lerobot_video")  # PyAV and pyarrow: the examples extra
    root = tmp_path / "dataset"
    lv.write_dataset(root, 2, lv.EpisodeSpec(cameras=2, height=48, width=64, fps=10, seconds=3, gop=5), seed=0)
    sample = lv.SampleSpec(frames=(2, 3), image_size=32, patch=8, text_tokens=12, seq_len=128)
    batches = lv.global_batches(lv.sample_refs(root, sample, seed=0, per_episode=2), 2)
    url = (tmp_path / "ns").as_uri()
    source = [lv.step_item(root, refs, sample, 2, 1) for refs in batches]
    report = run_pool(
        url, "video", source, lv.preprocess_item, producers=2, dp=2, backend="ray", progress=False,
        end_of_stream=True,
    )  # fmt: skip
    assert report.produced == len(batches) == 2
    ranks = []
    for rank in range(2):
        with bw.Consumer(url, dp=2, rank=rank, timeout_s=30) as consumer:
            ranks.append([batch.data["tokens"].tobytes() for batch in consumer])
    expected = [[s["tokens"].tobytes() for s in lv.preprocess_step(root, refs, sample, 2, 1)] for refs in batches]
    assert sorted(map(list, zip(*ranks))) == sorted(expected)
