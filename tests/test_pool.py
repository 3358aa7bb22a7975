"""Producer pools (``batchweave.pool``): every shard becomes one TGB, exactly once, across
worker crashes (real SIGKILLs), restarts of the whole pool, and preprocessing errors."""

from __future__ import annotations

import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import numpy as np
import pool_work
import pytest

import batchweave as bw
from batchweave.pool import PoolPlan, check_shard_list, run_pool
from batchweave.shardlist import (
    checkpoint_lengths,
    compare,
    encode_record,
    encode_shard,
    prefix_digests,
    record_key,
)
from batchweave.store import open_store


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


def test_a_pool_declares_a_variable_first_dimension_for_every_producer(tmp_path):
    url = (tmp_path / "ns").as_uri()
    declared = {"tokens": ("int32", (None, 3))}
    run_pool(
        url,
        "prep",
        list(range(4)),
        pool_work.ragged_tgb_of,
        producers=2,
        dp=pool_work.DP,
        progress=False,
        schema=declared,
    )
    assert bw.read_schema(url) == bw.Schema.of(declared)
    with bw.Consumer(url, dp=pool_work.DP, rank=0, timeout_s=30) as consumer:
        rows = sorted(next(consumer).data["tokens"].shape[0] for _ in range(4))
    assert rows == [1, 2, 3, 4]


def test_a_pool_without_the_declaration_stops_at_the_first_shard_of_another_length(tmp_path):
    url = (tmp_path / "ns").as_uri()
    # The worker's error crosses the process boundary as its type's name and its message.
    with pytest.raises(bw.PoolFailedError, match=r"SchemaError: .*array 'tokens' is int32 \(2, 3\)") as failed:
        run_pool(
            url, "prep", [0, 1], pool_work.ragged_tgb_of, producers=1, dp=pool_work.DP, progress=False, max_restarts=0
        )
    assert (failed.value.pool, failed.value.producer, failed.value.attempts) == ("prep", "prep.0000-of-0001", 1)
    assert failed.value.cause_type == "SchemaError" and "array 'tokens'" in failed.value.cause


def test_a_pool_refuses_a_bad_declaration_before_any_worker_starts(tmp_path):
    url = (tmp_path / "ns").as_uri()
    with pytest.raises(bw.SchemaError, match="give \\(dtype, shape\\)"):
        run_pool(
            url,
            "prep",
            [0],
            pool_work.ragged_tgb_of,
            producers=1,
            dp=pool_work.DP,
            progress=False,
            schema={"tokens": "int32"},
        )
    assert not list((tmp_path / "ns").glob("prep*"))


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
    with pytest.raises(bw.PoolFailedError, match=failed) as raised:
        run_pool(url, "prep", source, pool_work.fails_at, producers=2, dp=pool_work.DP, max_restarts=1, progress=False)
    assert (raised.value.producer, raised.value.attempts) == ("prep.0001-of-0002", 2)
    assert (raised.value.cause_type, raised.value.cause) == ("ValueError", "cannot parse shard 5")
    # What came before the bad shard is committed; the fixed pool resumes right there.
    state = bw.inspect_namespace(url).producers
    assert state["prep.0001-of-0002"]["offset"] == 2 and state["prep.0000-of-0002"]["offset"] == 4
    fixed = run_pool(url, "prep", source, pool_work.fixed, producers=2, dp=2, progress=False, end_of_stream=True)
    assert fixed.resumed_at["prep.0001-of-0002"] == 2 and fixed.produced == 2
    assert sorted(read_shards(url)) == list(range(8))


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(bw.ConfigError, match="unknown pool backend"):
        run_pool((tmp_path / "ns").as_uri(), "prep", [1], pool_work.tgb_of, producers=1, dp=2, backend="mpi")


# -- the shard list: recorded at the first start, checked at every restart -------------------


def test_shard_encoding_is_the_documented_canonical_form():
    shard = ("a/b", 3, b"x", None, True, 1.5, {"k": [1]})
    assert encode_shard(shard) == b"l7:s3:a/bi3;b1:xNTf0x1.8000000000000p+0;d1:s1:kl1:i1;"
    assert encode_shard(["a", 1]) == encode_shard(("a", 1))  # a list and a tuple are the same shard
    assert encode_shard(PurePosixPath("d/f.txt")) == encode_shard("d/f.txt")
    assert encode_shard(np.int64(7)) == encode_shard(7)
    assert encode_shard({"b": 1, "a": 2}) == encode_shard({"a": 2, "b": 1})
    distinct = [1, "1", b"1", 1.0, True, None, [1], ["1"], ("ab", "c"), ("a", "bc"), {"a": 1}]
    assert len({encode_shard(value) for value in distinct}) == len(distinct)
    # Pinned: another encoding or hash would change every recorded pool (a new SHARDS_FORMAT).
    assert prefix_digests("p", ["shard-0", "shard-1"], [2]) == {2: "08a538c9024269b717b8c43145894d4e"}


@pytest.mark.parametrize(
    "shard,type_name",
    [({1, 2}, "builtins.set"), (object(), "builtins.object"), (np.zeros(2), "numpy.ndarray"), ({1: "a"}, "keys")],
)
def test_a_shard_without_a_stable_encoding_is_refused_naming_pool_and_index(shard, type_name):
    with pytest.raises(bw.ConfigError, match=rf"pool 'prep': shard 2 holds .*{type_name}.*no stable fingerprint"):
        prefix_digests("prep", ["a", "b", ["c", shard]], [1])  # every shard is checked, not only the first


def test_the_verdict_pins_the_first_differing_shard_to_its_power_of_two_bracket():
    def verdict(recorded: list[int], given: list[int]):
        store = open_store(f"memory://verdict-{uuid.uuid4().hex}")
        record = check_shard_list(store, PoolPlan("prep", 3, len(recorded)), recorded)
        digests = prefix_digests("prep", given, {*checkpoint_lengths(len(given)), record.shards})
        return compare(record, len(given), digests)

    shards = list(range(20))
    assert verdict(shards, shards).kind == "same"
    assert verdict(shards, shards + [20, 21]).kind == "appended"
    assert verdict(shards, shards[:19]).kind == "shrunk"
    for position in range(20):  # a shard inserted at each position, then one changed there
        for given in (shards[:position] + [99] + shards[position:], shards[:position] + [99] + shards[position + 1 :]):
            found = verdict(shards, given)
            low, high = found.first_differing
            assert found.kind == "changed" and low <= position <= high
            assert low in (0, *checkpoint_lengths(20)) and high + 1 in checkpoint_lengths(20)


@pytest.mark.parametrize("recorded_before", [0, 4], ids=["first-start", "extension"])
def test_racing_drivers_record_one_list_and_the_other_is_compared_with_it(recorded_before):
    url = f"memory://race-{uuid.uuid4().hex}"
    base = [f"shard-{i}" for i in range(recorded_before)]
    if base:
        check_shard_list(open_store(url), PoolPlan("prep", 2, len(base)), base)
    ours, theirs = base + ["a-4", "a-5"], base + ["b-4", "b-5"]
    everyone_listed = threading.Barrier(2, timeout=30)

    def driver(shards: list[str]):
        store = open_store(url)
        listed_once = store.list

        def list_then_wait(prefix: str = ""):  # both drivers see the same newest record before either writes
            store.list = listed_once
            listed = list(listed_once(prefix))
            everyone_listed.wait()
            return iter(listed)

        store.list = list_then_wait
        return check_shard_list(store, PoolPlan("prep", 2, len(shards)), shards)

    with ThreadPoolExecutor(2) as drivers:  # the same list twice: both go on with one record
        same = [future.result() for future in [drivers.submit(driver, ours), drivers.submit(driver, list(ours))]]
    assert same[0] == same[1] and same[0].version == (1 if base else 0)

    url = f"memory://race-{uuid.uuid4().hex}"
    if base:
        check_shard_list(open_store(url), PoolPlan("prep", 2, len(base)), base)
    with ThreadPoolExecutor(2) as drivers:  # two lists: one is recorded, the other refused
        futures = [drivers.submit(driver, ours), drivers.submit(driver, theirs)]
        outcomes = [future.exception() for future in futures]
    refused = [error for error in outcomes if error is not None]
    assert len(refused) == 1 and isinstance(refused[0], bw.ConfigError)
    assert ("shard 0 differs" if not base else "one of shards 4 to 5") in str(refused[0])
    versions = sorted(info.key for info in open_store(url).list("_pools/"))
    assert versions == [record_key("prep", v) for v in range(len(versions))] and len(versions) == 1 + bool(base)


def test_a_pool_without_a_record_adopts_its_list_unless_it_is_too_short_for_what_was_committed():
    plan = PoolPlan("prep", 3, 7)  # producer 1 owns shards 1 and 4: two offsets
    store = open_store(f"memory://adopt-{uuid.uuid4().hex}")
    with pytest.raises(bw.ConfigError, match=r"prep.0001-of-0003 committed 3 shards, but 7 shards give it only 2"):
        check_shard_list(store, plan, list(range(7)), {"prep.0001-of-0003": 3})
    assert list(store.list("_pools/")) == []  # nothing recorded
    adopted = check_shard_list(store, plan, list(range(7)), {"prep.0001-of-0003": 2, "other.0001-of-0003": 9})
    assert (adopted.version, adopted.shards) == (0, 7)


def test_a_damaged_or_misplaced_record_is_refused_naming_its_key():
    store = open_store(f"memory://damaged-{uuid.uuid4().hex}")
    plan = PoolPlan("prep", 2, 3)
    record = check_shard_list(store, plan, ["a", "b", "c"])
    store.put_if_absent(record_key("other", 0), encode_record(record))  # pool "prep"'s record under "other"
    with pytest.raises(bw.CorruptDataError, match=r"_pools/other/0{20}.json: holds record 0 of pool 'prep'"):
        check_shard_list(store, PoolPlan("other", 2, 3), ["a", "b", "c"])
    store.put_if_absent(record_key("prep", 1), b'{"format": "batchweave.pool-shards/9"}')
    with pytest.raises(bw.CorruptDataError, match=r"_pools/prep/0{19}1.json: damaged pool shard-list record"):
        check_shard_list(store, plan, ["a", "b", "c"])


@pytest.fixture(scope="module")
def pool_of_ten(tmp_path_factory) -> Path:
    """A namespace where pool "prep" (3 producers) committed shards 0..9."""
    root = tmp_path_factory.mktemp("pool") / "ns"
    run_pool(root.as_uri(), "prep", list(range(10)), pool_work.tgb_of, producers=3, dp=pool_work.DP, progress=False)
    return root


REFUSED = {
    "inserted": (
        list(range(5)) + [99] + list(range(5, 10)),
        r"first 4 shards are the same and .* one of shards 4 to 7",
    ),
    "reordered": ([1, 0] + list(range(2, 10)), r"shard 0 differs"),
    "reordered-at-the-end": (list(range(8)) + [9, 8], r"first 8 shards are the same and .* one of shards 8 to 9"),
    "another-dataset": (list(range(100, 110)), r"shard 0 differs"),
    "shrunk": (list(range(7)), r"recorded with 10 shards .*, now given 7"),
    "shrunk-and-appended": (list(range(9)) + [99, 100], r"first 8 shards are the same and .* one of shards 8 to 9"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_restart_over_another_shard_list_is_refused_before_any_producer_starts(case, pool_of_ten, tmp_path):
    shards, message = REFUSED[case]
    copy = shutil.copytree(pool_of_ten, tmp_path / "ns")
    before = bw.inspect_namespace(copy.as_uri()).producers
    with pytest.raises(bw.ConfigError, match=rf"pool 'prep' .*{message}.*Restart it with the recorded list"):
        run_pool(copy.as_uri(), "prep", shards, pool_work.tgb_of, producers=3, dp=pool_work.DP, progress=False)
    assert bw.inspect_namespace(copy.as_uri()).producers == before  # no producer claimed a new epoch
    assert sorted(p.name for p in (copy / "_pools" / "prep").iterdir()) == [record_key("prep", 0).split("/")[-1]]


def test_a_restart_with_shards_appended_produces_each_new_shard_once_and_records_the_longer_list(pool_of_ten, tmp_path):
    url = shutil.copytree(pool_of_ten, tmp_path / "ns").as_uri()
    grown = run_pool(url, "prep", list(range(16)), pool_work.tgb_of, producers=3, dp=pool_work.DP, progress=False)
    assert grown.produced == 6
    assert grown.resumed_at == {"prep.0000-of-0003": 4, "prep.0001-of-0003": 3, "prep.0002-of-0003": 3}
    # Positions 10..15 are produced now: another extension of the ten must not reuse them.
    with pytest.raises(
        bw.ConfigError, match=r"recorded another shard list .*00001.json, 16 shards.*one of shards 8 to 15"
    ):
        run_pool(url, "prep", list(range(10)) + [90, 91, 92, 93, 94, 95], pool_work.tgb_of, producers=3, dp=2)
    bw.end_stream(url)
    assert sorted(read_shards(url)) == list(range(16))


def test_a_shard_of_an_unsupported_type_is_refused_before_any_producer_starts(tmp_path):
    url = (tmp_path / "ns").as_uri()
    with pytest.raises(bw.ConfigError, match=r"pool 'prep': shard 1 holds a builtins.set"):
        run_pool(url, "prep", [0, {1}], pool_work.tgb_of, producers=1, dp=pool_work.DP, max_restarts=0, progress=False)
    assert bw.inspect_namespace(url).producers == {}


def test_a_pool_starts_its_producers_within_the_budget_on_the_logs_keys():
    """Every producer's start reads the same few log keys (the snapshot hint and listing,
    the head): 1,000 workers starting at once sent each of them 1,000 requests a second."""
    from batchweave.pooljob import start_delay_s
    from batchweave.reading.polling import HEAD_BUDGET_PER_S

    starts = sorted(start_delay_s(i) for i in range(1_000))
    assert starts[0] == 0.0 and starts == sorted(set(starts))
    for second in range(int(starts[-1]) + 1):  # about three requests a start to the busiest key
        assert 3 * sum(1 for t in starts if second <= t < second + 1) <= HEAD_BUDGET_PER_S + 3
    assert start_delay_s(7) < 0.31  # a pool of 8 starts within a third of a second
