"""Node-level sharing (``batchweave.reading.node``): the ranks of one node share one log follower
and one read per slice, and a hub that dies is replaced without losing a step."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import mmap
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import batchweave as bw
from batchweave.commit.policies import Manual
from batchweave.errors import ConfigError
from batchweave.latency import LatencyModel, LatencyStore
from batchweave.mesh import Mesh
from batchweave.reading import node, nodeclient, nodehub
from batchweave.reading.polling import HeadPolling
from batchweave.reading.readahead import FIRST_WINDOW
from batchweave.store import open_store

pytestmark = pytest.mark.skipif(not node.sharing_supported(), reason="node sharing needs Linux")

HERE = Path(__file__).resolve().parent
FAST = LatencyModel(put_s=0.001, first_byte_s=0.001, head_s=0.001, list_s=0.001, delete_s=0.001, jitter_sigma=0)


class CountingStore(LatencyStore):
    """A remote-like store counting range reads of data (by object and offset) and log reads."""

    def __init__(self, url: str) -> None:
        super().__init__(url, model=FAST)
        self.ranges: collections.Counter[tuple[str, int]] = collections.Counter()
        self.log_reads = 0
        self._lock = threading.Lock()

    def get_range(self, key, start, length):
        with self._lock:
            if key.startswith("_log/"):  # a proof re-reads its anchor's head so
                self.log_reads += 1
            else:
                self.ranges[(key, start)] += 1
        return super().get_range(key, start, length)

    def get(self, key):
        if key.startswith("_log/"):
            with self._lock:
                self.log_reads += 1
        return super().get(key)


def fill(store, steps: int, dp: int, *, first: int = 0, end: bool = True) -> None:
    """TGBs ``first`` to ``steps - 1`` of ``dp`` slices; slice d of step s holds ``s * dp + d``,
    each TGB in objects of its own (the tests count one read per slice and node; packs are
    read together: test_runs)."""
    with bw.Producer(store, "p", dp=dp, commit_policy=Manual(), pack_steps=1) as producer:
        for step in range(first, steps):
            producer.append([{"x": np.full(4, step * dp + d)} for d in range(dp)], source_offset=step)
            if step % 5 == 4:
                producer.flush()
    if end:
        bw.end_stream(store)


def read_node(store, ranks: range, *, dp: int, tp: int, sharing: bool) -> dict[int, list]:
    """Every rank of ``ranks`` (one node) reads to the end, each in its own thread."""
    seen: dict[int, list] = {}
    failures: list[BaseException] = []
    first = ranks[0]
    finished = threading.Barrier(len(ranks))  # a job's ranks stop together (a hub closing early hands over)

    def run(rank: int) -> None:
        try:
            consumer = bw.Consumer(
                store,
                dp=dp,
                tp=tp,
                rank=rank,
                local_rank=rank - first,
                local_world_size=len(ranks),
                node_sharing=sharing,
                timeout_s=30,
            )
            seen[rank] = [(b.step, int(b.data["x"][0]), b.data["x"]) for b in consumer]
            finished.wait(30)
            consumer.close()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    return seen


def assert_each_rank_read_its_slice(seen: dict[int, list], steps: int, dp: int, tp: int) -> None:
    mesh = Mesh(dp=dp, tp=tp)
    for rank, records in seen.items():
        d = mesh.coords(rank).dp
        assert [(s, v) for s, v, _ in records] == [(s, s * dp + d) for s in range(steps)], rank


def test_tp_ranks_on_a_node_issue_one_read_per_slice_and_one_followers_log_requests():
    steps, dp, tp = 30, 2, 4
    alone, shared = CountingStore("memory://b/alone"), CountingStore("memory://b/shared")
    for store in (alone, shared):
        fill(store, steps, dp)
        store.ranges.clear()
        store.log_reads = 0
    assert_each_rank_read_its_slice(read_node(alone, range(8), dp=dp, tp=tp, sharing=False), steps, dp, tp)
    assert_each_rank_read_its_slice(read_node(shared, range(8), dp=dp, tp=tp, sharing=True), steps, dp, tp)
    assert sum(alone.ranges.values()) == steps * dp * tp  # today: every TP rank reads
    assert len(shared.ranges) == steps * dp  # every distinct slice ...
    assert set(shared.ranges.values()) == {1}  # ... read once for the node
    single = CountingStore("memory://b/single")
    fill(single, steps, dp)
    single.log_reads = 0
    read_node(single, range(1), dp=1, tp=1, sharing=False)  # one follower's log requests
    # One follower's log reads, give or take what read-ahead speculates: each run's start
    # races up to FIRST_WINDOW probes beside the first segment and stops them at a miss at
    # a different point (16 to 26 reads for either, 28 once under load). Eight followers: ~160.
    assert shared.log_reads <= single.log_reads + 2 * FIRST_WINDOW
    # Eight followers at once race their first probes differently from one (a start probes
    # versions beside the first segment, and stops at the first miss one of them finds):
    # 16 to 28 reads each, so the node's one follower reads at least 4x less than eight
    # (1.5x of an eighth failed once in CI: 26 x 8 against 137 x 1.5).
    assert shared.log_reads * 4 <= alone.log_reads


def test_shared_slices_are_read_only_views_of_one_shared_memory_copy():
    store = CountingStore("memory://b/views")
    fill(store, 3, 1)
    seen = read_node(store, range(2), dp=1, tp=2, sharing=True)
    for rank in (0, 1):
        array = seen[rank][0][2]
        assert not array.flags.writeable
        base = array
        while not isinstance(base, memoryview) and base.base is not None:
            base = base.base
        assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


def test_ranks_of_two_nodes_on_one_machine_do_not_share():
    store = CountingStore("memory://b/twonodes")
    steps, dp, tp = 10, 2, 2
    fill(store, steps, dp)
    store.ranges.clear()
    seen = read_node(store, range(0, 2), dp=dp, tp=tp, sharing=True)  # node 0: ranks 0, 1 (d = 0)
    seen |= read_node(store, range(2, 4), dp=dp, tp=tp, sharing=True)  # node 1: ranks 2, 3 (d = 1)
    assert_each_rank_read_its_slice(seen, steps, dp, tp)
    mesh = Mesh(dp=dp, tp=tp)
    assert node.node_address(store, mesh, 0) != node.node_address(store, mesh, 2)
    assert sum(store.ranges.values()) == steps * dp


def test_closing_the_hubs_consumer_mid_run_hands_the_hub_to_another_rank():
    store = CountingStore("memory://b/handover")
    fill(store, 20, 1, end=False)
    consumers = [
        bw.Consumer(store, dp=1, tp=3, rank=r, local_rank=r, local_world_size=3, node_sharing=True, timeout_s=30)
        for r in range(3)
    ]
    its = [iter(c) for c in consumers]
    first = [[next(it).step for _ in range(10)] for it in its]
    assert [hub.users for hub in nodehub._hubs.values()] == [1]
    old_hub = next(iter(nodehub._hubs.values()))
    host = next(i for i, c in enumerate(consumers) if c._pipeline._node._hosting)
    consumers[host].close()  # its hub closes; the others' requests go to a new one
    assert old_hub not in nodehub._hubs.values()
    fill(store, 40, 1, first=20)  # what is left needs a hub
    rest = [[b.step for b in it] for i, it in enumerate(its) if i != host]
    for done, later in zip([f for i, f in enumerate(first) if i != host], rest, strict=True):
        assert done + later == list(range(40))
    hosting = sum(c._pipeline._node._hosting for i, c in enumerate(consumers) if i != host)
    assert [hub.users for hub in nodehub._hubs.values()] == [hosting] and hosting >= 1  # a new hub, in use
    assert max(store.ranges.values()) <= 2  # a range read again only across the handover
    for c in consumers:
        c.close()
    assert not nodehub._hubs


def test_node_settings_are_checked(monkeypatch):
    store = CountingStore("memory://b/settings")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
        bw.Consumer(store, dp=8, rank=0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="outside the mesh"):
        bw.Consumer(store, dp=4, rank=3, local_rank=0, local_world_size=2, node_sharing=True)
    with pytest.raises(ConfigError, match="node_sharing"):
        bw.Consumer(store, dp=2, rank=0, node_sharing="yes")
    plan = node.plan_node(store, Mesh(dp=2, tp=4), 5, 5, 8)
    assert (plan.sharers, plan.nodes) == (4, 1)
    assert node.plan_node(store, Mesh(dp=1250, tp=8), 9, 1, 8).nodes == 1250


def test_env_turns_sharing_on_for_a_remote_store_only(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert bw.Consumer(CountingStore("memory://b/env"), dp=2, rank=1).node is not None
    local = tmp_path / "ns"
    local.mkdir()
    assert bw.Consumer(local.as_uri(), dp=2, rank=1).node is None


# Made and removed by tests running beside this one in other pytest workers: the named
# semaphores of multiprocessing (producer pools, process pools), and MosaicML Streaming's
# shared state (``000024_locals``, ``000024_shard_states``: `bench consumers` runs it).
_FOREIGN_SHM = re.compile(r"^(sem\.mp-|\d{6}_)")


def shm_names() -> set[str]:
    """Names in /dev/shm, but for those other tests make (``_FOREIGN_SHM``). A hub that
    regressed to named shared memory would show here as ``psm_*``
    (multiprocessing.shared_memory) or a name of its own."""
    names = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return {name for name in names if not _FOREIGN_SHM.match(name)}


@pytest.mark.s3
def test_sigkilled_hub_process_is_replaced_and_no_rank_loses_or_repeats_a_step(tmp_path, monkeypatch, request):
    from conftest import _make_backend_url

    from batchweave.store import open_store

    url = _make_backend_url("s3", request, tmp_path, monkeypatch)
    steps, dp, tp = 24, 2, 2
    fill(url, steps, dp)
    before = shm_names()
    go = tmp_path / "go"
    procs = {
        rank: subprocess.Popen(
            [
                sys.executable,
                str(HERE / "node_worker.py"),
                url,
                str(rank),
                str(tmp_path / f"r{rank}.json"),
                "--dp",
                str(dp),
                "--tp",
                str(tp),
                "--local-world-size",
                "4",
                "--pause-at",
                "5",
                "--go",
                str(go),
            ],
        )
        for rank in range(4)
    }
    try:
        ready = {}
        for rank, proc in procs.items():
            path = tmp_path / f"r{rank}.ready"
            while not path.exists():  # each rank writes it after step 5
                assert proc.poll() is None, f"rank {rank} exited with {proc.returncode}"
                threading.Event().wait(0.02)
            ready[rank] = json.loads(path.read_text())
        hosts = [rank for rank, r in ready.items() if r["hosting"]]
        assert len(hosts) == 1, ready
        procs[hosts[0]].send_signal(signal.SIGKILL)
        procs[hosts[0]].wait()
        go.touch()
        for rank, proc in procs.items():
            if rank != hosts[0]:
                assert proc.wait(90) == 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    mesh = Mesh(dp=dp, tp=tp)
    for rank in procs:
        if rank == hosts[0]:
            continue
        seen = json.loads((tmp_path / f"r{rank}.json").read_text())["seen"]
        d = mesh.coords(rank).dp
        assert seen == [[s, s * dp + d] for s in range(steps)], rank
    assert shm_names() <= before  # memfds only: nothing named in /dev/shm, crash or not
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(OSError):  # nothing serves the hub's name once its processes are gone
        probe.connect(node.node_address(open_store(url), mesh, 0).paths()[0])
    probe.close()


@contextlib.contextmanager
def squatting(address: node.HubAddress) -> Iterator[socket.socket]:
    """A process of the same user holding the hub's election lock and name: the ranks
    cannot become the hub, and only the squatter answers (or not) at its name."""
    path, lock_path = address.paths()
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    squatter.bind(path)
    squatter.listen(64)
    try:
        yield squatter
    finally:
        squatter.close()
        os.unlink(path)
        os.close(lock)


def test_a_rank_that_reaches_no_hub_reads_on_its_own_and_says_so_once(monkeypatch, caplog):
    store = CountingStore("memory://b/nohub")
    steps = 8
    fill(store, steps, 2)
    monkeypatch.setattr(nodeclient, "TAKEOVER_S", 0.2)
    monkeypatch.setattr(nodeclient, "IO_S", 0.2)
    with (
        squatting(node.node_address(store, Mesh(dp=2), 0)),
        caplog.at_level("WARNING", "batchweave.reading.nodeclient"),
    ):
        seen = read_node(store, range(2), dp=2, tp=1, sharing=True)  # the squatter never answers
    assert_each_rank_read_its_slice(seen, steps, 2, 1)
    unreachable = [r for r in caplog.records if "reads without it" in r.getMessage()]
    assert 1 <= len(unreachable) <= 2  # once per rank at most, not once per read


def test_resharded_reads_and_resumed_cursors_are_the_same_with_sharing():
    """TGBs of dp 4 read by a node of dp 2 x tp 2 (each step joins two slices), stopped at
    step 5 and resumed from the cursors: the same steps as without sharing."""
    store = CountingStore("memory://b/reshard")
    fill(store, 12, 4)

    def read(sharing: bool) -> dict[int, list]:
        def node(cursors=None):
            consumers = []
            for rank in range(4):
                consumer = bw.Consumer(
                    store,
                    dp=2,
                    tp=2,
                    rank=rank,
                    local_rank=rank,
                    local_world_size=4,
                    node_sharing=sharing,
                    timeout_s=30,
                )
                if cursors is not None:
                    consumer.load_state_dict(cursors[rank])
                consumers.append(consumer)
            return consumers

        first = node()
        seen = {r: [] for r in range(4)}
        for rank, consumer in enumerate(first):
            for _ in range(3):
                batch = next(consumer)
                seen[rank].append((batch.step, batch.data["x"].tolist()))
        cursors = [c.state_dict() for c in first]
        for consumer in first:
            consumer.close()
        for rank, consumer in enumerate(node(cursors)):
            seen[rank] += [(b.step, b.data["x"].tolist()) for b in consumer]
            consumer.close()
        return seen

    shared = read(True)
    assert shared == read(False)
    assert all([s for s, _ in steps] == list(range(24)) for steps in shared.values())  # a TGB = 2 steps here


class _HubThatGoesAway:
    """A node follower (as the simulation injects one) that hands out proven versions
    until ``gone``, then is unreachable: the rank carries on with its own follower."""

    def __init__(self, store) -> None:
        self.store = store
        self.gone = False

    def log(self, first, anchor, present_through, next_step, url, stop):
        from batchweave.journal import Journal
        from batchweave.reading.follower import ProvenLog
        from batchweave.reading.polling import HeadPolling
        from batchweave.reading.readahead import LogReadAhead

        journal = Journal(self.store, read_only=True)
        if anchor is not None:
            journal.anchor_on(*anchor)
        reader = LogReadAhead(journal, first, 1)
        version = first
        for item in ProvenLog(journal, reader, HeadPolling(1, max_poll_s=0.05), next_step, url, present_through):
            if self.gone:
                raise nodeclient.NodeUnavailableError("the test's hub went away", version)
            if isinstance(item, list):
                version = item[-1].delta.version + 1
            yield item

    def read(self, key, start, length):
        return self.store.get_range(key, start, length)

    def close(self) -> None:
        pass


def test_a_rank_left_by_its_hub_proves_from_what_the_hub_gave_it_not_from_its_old_cursor():
    """A rank resumed from an old cursor reads on through its hub; collection meanwhile
    deletes the cursor's version. When the hub goes, the rank's own follower must anchor on
    the newest version the hub proved for it: anchored on the deleted cursor version it
    took itself for overtaken (DataReclaimedError) although every step it needs is there."""
    from batchweave.keys import version_key
    from batchweave.store import open_store

    url = f"memory://node-{uuid.uuid4().hex}"
    store = open_store(url)
    with bw.Producer(store, "p", dp=1, commit_policy=Manual(), snapshot_every=2) as producer:
        for step in range(6):
            producer.append([{"x": np.full(4, step)}], source_offset=step)
            producer.flush()
        with bw.Consumer(store, dp=1, rank=0) as early:
            next(early), next(early)
            early.mark_checkpoint("early")
            cursor = early.state_dict()
        rank = bw.Consumer(store, dp=1, rank=0, timeout_s=10, max_poll_interval_s=0.05)
        rank.load_state_dict(cursor)
        hub = _HubThatGoesAway(store)
        rank.attach_node(hub)
        assert [next(rank).step for _ in range(4)] == [2, 3, 4, 5]
        rank.mark_checkpoint("later")
        bw.release_checkpoint(store, "early")
        for step in range(6, 12):
            producer.append([{"x": np.full(4, step)}], source_offset=step)
            producer.flush()
        bw.collect_garbage(store, grace_s=0)
        assert store.size(version_key(cursor["version"])) is None, "collection did not delete the cursor's version"
        hub.gone = True
        assert [(b.step, int(b.data["x"][0])) for b in (next(rank) for _ in range(6))] == [(s, s) for s in range(6, 12)]
        rank.close()


def test_a_nodes_first_follower_waits_its_start_pause_before_its_first_request(monkeypatch):
    """1,250 nodes starting together read the snapshot hint and the first versions in the
    same second (1,250 GETs a key): the hub's first follower spreads its start within the
    budget's floor (``HeadPolling.start_pause_s``), and only its first."""
    pauses: list[float] = []

    def recorded(self):
        pauses.append(self.floor_s)
        return 0.0

    monkeypatch.setattr(HeadPolling, "start_pause_s", recorded)
    store = CountingStore("memory://b/start-pause")
    fill(store, 6, 2)
    assert_each_rank_read_its_slice(read_node(store, range(8), dp=2, tp=4, sharing=True), 6, 2, 4)
    assert pauses == [pytest.approx(1 / 70)]  # one node of one: its floor is a 70th of a second


class _AskedHub(_HubThatGoesAway):
    """A hub that notes from which version each rank asked it for the log."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.asked: list[int] = []

    def log(self, first, *rest):
        self.asked.append(first)
        return super().log(first, *rest)


def test_an_attached_node_is_its_processs_own_a_pickled_copy_reads_without_it(tmp_path):
    url = str(tmp_path / "ns")
    fill(open_store(url, create=True), 3, 1)
    hub = _AskedHub(open_store(url))
    consumer = bw.Consumer(url, dp=1, rank=0, timeout_s=10)
    consumer.attach_node(hub)
    copy = pickle.loads(pickle.dumps(consumer))  # as a DataLoader worker receives it
    assert [b.step for b in (next(copy) for _ in range(3))] == [0, 1, 2]
    assert hub.asked == []  # the copy followed the log on its own
    assert next(consumer).step == 0
    assert hub.asked == [1]  # the original reads through the node it was given
    copy.close()
    consumer.close()
