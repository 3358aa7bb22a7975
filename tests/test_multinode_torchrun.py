"""Two torchrun "nodes" on this machine read a namespace on S3 (moto): two agents started with
``--nnodes=2 --node_rank=0/1 --nproc_per_node=2`` and a static rendezvous on a free port,
each running tests/torchrun_worker.py on 2 ranks. The mesh is DP=2 x TP=2, so the two TP
ranks of each DP slice share it, and they sit on the same node: ranks 0 and 1 read slice 0
on node 0, ranks 2 and 3 slice 1 on node 1.

Each node reaches the store through its own counting proxy (``LatencyProxy`` with no
latency), so the store requests of each node are counted apart (``node_requests``).

1. Every rank reads exactly its slice of every step, once, in order, and the ranks are
   grouped on the nodes as torchrun's environment says.
2. Node 1 (its agent and its two workers, by PID) is SIGKILLed while its ranks hold steps
   prefetched but not delivered, and is started again with the same command: its ranks
   resume from their saved cursors, node 0 carries on, and no step is lost or read twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import S3_BUCKET, _point_s3_at, _unique_prefix
from torchrun_worker import slice_checksum

import batchweave as bw
from batchweave.mesh import Mesh
from batchweave.testing import servers
from batchweave.testing.proxy import LatencyProxy

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.s3]

WORKER = Path(__file__).with_name("torchrun_worker.py")
MESH = Mesh(dp=2, tp=2)
NODES, PER_NODE = 2, 2
WAIT_S = 120


@pytest.fixture
def cluster(request, moto_server, tmp_path, monkeypatch):
    """A fresh namespace on moto and one counting proxy in front of it per node."""
    _point_s3_at(monkeypatch, moto_server)  # this process (the producer) talks to moto directly
    proxies = [LatencyProxy(moto_server).start() for _ in range(NODES)]
    nodes = TorchrunNodes(f"s3://{S3_BUCKET}/{_unique_prefix(request)}", tmp_path, proxies)
    try:
        yield nodes
    finally:
        nodes.kill_all()  # after a failure: nothing of ours outlives the test
        for proxy in proxies:
            proxy.stop()


class TorchrunNodes:
    """The torchrun agents of one job, one per node, started and SIGKILLed by PID."""

    def __init__(self, url: str, tmp_path: Path, proxies: list[LatencyProxy]) -> None:
        self.url, self.proxies = url, proxies
        self.out = tmp_path / "ranks"
        self.out.mkdir()
        self.logs = tmp_path
        self.port = free_port()
        self.agents: dict[int, subprocess.Popen] = {}

    def start(self, node: int, *worker_args: str) -> subprocess.Popen:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--node_rank={node}"),
            *(f"--nproc_per_node={PER_NODE}", "--master_addr=127.0.0.1", f"--master_port={self.port}"),
            *(str(WORKER), "--data", self.url, "--out", str(self.out), "--dp", str(MESH.dp), "--tp", str(MESH.tp)),
            *worker_args,
        ]
        env = {**os.environ, **servers.s3_env(self.proxies[node].endpoint)}
        log = (self.logs / f"node{node}.log").open("ab")
        self.agents[node] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self.agents[node]

    def record(self, rank: int) -> dict:
        path = self.out / f"rank-{rank}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def wait_until(self, condition, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            for node, agent in self.agents.items():
                if agent.poll() is not None:
                    pytest.fail(f"node {node}'s torchrun exited {agent.returncode} before {what}:\n{self.log_tails()}")
            if time.monotonic() > deadline:
                self.kill_all()
                pytest.fail(f"timed out waiting for {what}:\n{self.log_tails()}")
            time.sleep(0.02)

    def finish(self) -> None:
        for node, agent in self.agents.items():
            try:
                code = agent.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.kill_all()
                pytest.fail(f"node {node}'s torchrun did not finish:\n{self.log_tails()}")
            assert code == 0, f"node {node}'s torchrun exited {code}:\n{self.log_tails()}"

    def kill_node(self, node: int) -> None:
        """SIGKILL node ``node`` at once, as a machine failure would: its agent, then the
        workers it started (by the PIDs they recorded; they outlive a killed agent)."""
        agent = self.agents.pop(node)
        workers = [self.record(rank)["incarnations"][-1]["pid"] for rank in ranks_of(node)]
        assert [self.record(rank)["incarnations"][-1]["agent_pid"] for rank in ranks_of(node)] == [agent.pid] * PER_NODE
        for pid in [agent.pid, *workers]:
            os.kill(pid, signal.SIGKILL)
        assert agent.wait(timeout=WAIT_S) == -signal.SIGKILL
        self.wait_until(lambda: not any(map(self.is_our_worker, workers)), f"node {node}'s workers to die")

    def kill_all(self) -> None:
        """SIGKILL every agent still running and every worker of ours still alive (by PID)."""
        for agent in self.agents.values():
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        for rank in range(MESH.world_size):
            for incarnation in self.record(rank).get("incarnations", []):
                if self.is_our_worker(incarnation["pid"]):
                    os.kill(incarnation["pid"], signal.SIGKILL)

    def is_our_worker(self, pid: int) -> bool:
        """``pid`` is alive and is a worker of this test (not a process that reused the PID)."""
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return False
        return str(self.out).encode() in command

    def log_tails(self) -> str:
        return "\n".join(f"--- node {n}:\n{(self.logs / f'node{n}.log').read_text()[-3000:]}" for n in self.agents)

    def node_requests(self) -> dict[int, dict[str, int]]:
        """Store requests per node, by HTTP method, as each node's proxy counted them
        (every request of that node's ranks, log polls and slice reads), and the slice
        reads among them (``range``: GETs of a byte range)."""
        return {
            node: dict(proxy.counters().requests) | {"range": proxy.counters().range_gets}
            for node, proxy in enumerate(self.proxies)
        }


def ranks_of(node: int) -> list[int]:
    return list(range(node * PER_NODE, (node + 1) * PER_NODE))


def free_port() -> int:
    """A free port below the ephemeral range: the rendezvous binds it seconds later (after
    torchrun imports torch), and a port from the ephemeral range (``bind(0)``) could be taken
    meanwhile by any outgoing connection on the machine; these are never handed out there."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10_000, low), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
            return port
    raise RuntimeError(f"no free port in 10000..{low}")


def tgb(offset: int) -> list[dict[str, np.ndarray]]:
    """The TGB at source offset ``offset``: every slice distinct, a pure function of both."""
    rng = np.random.default_rng(offset)
    return [{"step": np.full(4, offset, np.int64), "x": rng.standard_normal((3, 5)) + d} for d in range(MESH.dp)]


def produce(url: str, upto: int, end: bool = False) -> None:
    """Offsets up to ``upto`` from the one producer (its offset k is step k), each TGB an
    object of its own (the test counts a node's reads per step), then maybe the end."""
    with bw.Producer(url, "prep", dp=MESH.dp, pack_steps=1) as producer:
        for offset in range(producer.resume_offset, upto):
            producer.append(tgb(offset), source_offset=offset)
    if end:
        bw.end_stream(url)


def check_every_rank_read_its_slices_once(nodes: TorchrunNodes, steps: int) -> dict[int, dict]:
    records = {rank: nodes.record(rank) for rank in range(MESH.world_size)}
    versions = {}
    for rank, record in records.items():
        d = MESH.slice_index(rank)
        read = [(step, checksum) for step, checksum, _ in record["steps"]]
        assert read == [(s, slice_checksum(tgb(s)[d])) for s in range(steps)], f"rank {rank}"
        assert record["done"]
        for step, _, version in record["steps"]:
            assert versions.setdefault(step, version) == version, f"rank {rank} saw step {step} at another version"
    return records


def check_node_of(record: dict, rank: int, agent_pid: int) -> None:
    incarnation = record["incarnations"][-1]
    where = {k: incarnation[k] for k in ("rank", "group_rank", "local_rank", "local_world_size", "world_size")}
    assert where == {
        "rank": rank,
        "group_rank": rank // PER_NODE,
        "local_rank": rank % PER_NODE,
        "local_world_size": PER_NODE,
        "world_size": MESH.world_size,
    }
    assert incarnation["agent_pid"] == agent_pid


def test_two_nodes_each_rank_reads_its_slice_of_every_step_once(cluster):
    nodes = cluster
    produce(nodes.url, 12, end=True)
    agents = [nodes.start(node) for node in range(NODES)]
    nodes.finish()

    records = check_every_rank_read_its_slices_once(nodes, 12)
    for rank, record in records.items():
        check_node_of(record, rank, agents[rank // PER_NODE].pid)
        assert len(record["incarnations"]) == 1
    # The TP pairs share a slice and a node: ranks 0, 1 read slice 0 on node 0; 2, 3 slice 1 on node 1.
    assert [MESH.slice_index(rank) for rank in range(4)] == [0, 0, 1, 1]
    # Node sharing (on by default under torchrun on an object store): the TP pair of each
    # node reads its slice once per step, through the node's own proxy; the other node's
    # proxy sees none of it.
    requests = nodes.node_requests()
    assert [requests[node]["range"] for node in range(NODES)] == [12, 12], requests


def test_a_node_killed_mid_run_restarts_and_its_ranks_resume_from_their_cursors(cluster):
    nodes = cluster
    produce(nodes.url, 8)  # the rest comes after the restart: the ranks also wait for new steps
    first = [nodes.start(node, "--hold-after", "3") for node in range(NODES)]
    # Mid-run: every rank has delivered steps 0..3, saved its cursor and holds there, with
    # steps 4..7 committed (prefetched by the consumer, not delivered).
    nodes.wait_until(lambda: all(nodes.record(r).get("held") for r in range(MESH.world_size)), "every rank to hold")
    nodes.kill_node(1)

    again = nodes.start(1, "--hold-after", "3")  # the same command: it holds only in a first incarnation
    nodes.wait_until(lambda: all(len(nodes.record(r)["incarnations"]) == 2 for r in ranks_of(1)), "node 1's restart")
    (nodes.out / "go").touch()  # node 0's ranks carry on
    produce(nodes.url, 12, end=True)
    nodes.finish()

    records = check_every_rank_read_its_slices_once(nodes, 12)
    for rank, record in records.items():
        node = rank // PER_NODE
        check_node_of(record, rank, again.pid if node == 1 else first[0].pid)
        incarnations = [(i["agent_pid"], i["group_rank"], i["resumed_at"]) for i in record["incarnations"]]
        if node == 0:
            assert incarnations == [(first[0].pid, 0, 0)]
        else:
            assert incarnations == [(first[1].pid, 1, 0), (again.pid, 1, 4)]  # resumed at step 4, not 8
