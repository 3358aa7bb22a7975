"""Node sharing inside the trust boundary (I11, ``batchweave.reading.nodetrust``): a hub no
other user can feed, read or stall, one store identity per hub, a reader's failure kept
to that reader, and every resource and wait bounded. Each test is a scenario of issue
28, tried as another user, another job or a careless client on the same node would."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from test_node import CountingStore, assert_each_rank_read_its_slice, fill, read_node, squatting

import batchweave as bw
from batchweave import keys
from batchweave.commit.policies import Manual
from batchweave.errors import DataReclaimedError
from batchweave.mesh import Mesh
from batchweave.reading import node, nodeclient, nodehub, nodeoutbox, nodetrust, nodewire
from batchweave.reading.polling import HeadPolling
from batchweave.store import Store

pytestmark = pytest.mark.skipif(not node.sharing_supported(), reason="node sharing needs Linux")

HERE = Path(__file__).resolve().parent
# Another user runs the system's Python on a copy of the intruder (standard library only)
# in a place of its own: the checkout, its venv and its sources may lie where only their
# owner can enter (a home directory of mode 0700).
SYSTEM_PYTHON = "/usr/bin/python3"
other_user = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="needs root to run a process as nobody"
)


class Stranger:
    """The user nobody on this node, running ``hub_intruder.py`` from ``place``."""

    def __init__(self, place: Path) -> None:
        self.place = place
        self.script = place / "hub_intruder.py"

    def start(self, *args: str) -> subprocess.Popen:
        """The intruder, isolated from this process's environment (``-I``: no PYTHONPATH
        into the checkout, no user site)."""
        return subprocess.Popen(
            [SYSTEM_PYTHON, "-I", str(self.script), *args],
            user="nobody",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )

    def run(self, *args: str) -> dict:
        """What the intruder printed, or a failure that says why it printed nothing."""
        proc = self.start(*args)
        out, err = proc.communicate(timeout=60)
        return self.parsed(out, err, proc, args)

    def answer(self, proc: subprocess.Popen, args: Sequence[str]) -> dict:
        """The next line a running intruder prints (``forge``), as ``run`` reads it."""
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if line:
            return self.parsed(line, "", proc, args)
        proc.wait(30)  # it ended without a word: what it said on stderr is why
        return self.parsed(line, proc.stderr.read(), proc, args)

    @staticmethod
    def parsed(out: str, err: str, proc: subprocess.Popen, args: Sequence[str]) -> dict:
        try:
            return json.loads(out)
        except json.JSONDecodeError:
            pytest.fail(
                f"the intruder ({' '.join(args)}) run as nobody printed {out!r}, not JSON"
                f" (exit {proc.poll()}): {err.strip()[-2000:]}"
            )

    def cannot_run(self) -> str:
        """Why nobody cannot run the intruder from ``place`` ("": it can)."""
        try:
            proc = self.start("probe")
            out, err = proc.communicate(timeout=60)
        except (KeyError, OSError, subprocess.SubprocessError) as exc:  # no such user, no such Python
            return f"cannot start {SYSTEM_PYTHON} as nobody: {type(exc).__name__}: {exc}"
        if out.strip() == json.dumps({"probe": "ok"}):
            return ""
        return f"nobody cannot run {self.script} with {SYSTEM_PYTHON} (exit {proc.returncode}): {err.strip()[-500:]}"


@pytest.fixture(scope="module")
def stranger() -> Iterator[Stranger]:
    """Another user, with a copy of the intruder in a fresh place it can read (under the
    temporary directory, or /tmp when that one is private too); skipped with the reason
    when there is none."""
    tried: list[str] = []
    for base in dict.fromkeys([tempfile.gettempdir(), "/tmp"]):
        place = Path(tempfile.mkdtemp(prefix="bw-stranger-", dir=base))
        try:
            os.chmod(place, 0o755)
            shutil.copyfile(HERE / "hub_intruder.py", place / "hub_intruder.py")
            os.chmod(place / "hub_intruder.py", 0o644)
            who = Stranger(place)
            why = who.cannot_run()
            if not why:
                yield who
                return
            tried.append(why)
        finally:
            shutil.rmtree(place, ignore_errors=True)
    pytest.skip("; ".join(tried))


def serve_hub(store: Store, mesh: Mesh) -> node.HubAddress:
    address = node.node_address(store, mesh, 0)
    assert nodehub.start_hub(address, store, HeadPolling(1))
    nodehub.use_hub(address, +1)
    return address


def close_hub(address: node.HubAddress) -> None:
    nodehub.use_hub(address, -1)


class RawClient:
    """A careless (or hostile) process of the same user, speaking the wire by hand."""

    def __init__(self, address: node.HubAddress) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(address.paths()[0])
        self.send({"op": "hello", "protocol": nodewire.PROTOCOL, "identity": address.identity})
        assert self.recv()[0]["identity"] == address.identity

    def send(self, header: dict) -> None:
        nodewire.send(self.sock, header)

    def recv(self) -> tuple[dict, bytes]:
        head, payload, fds = nodewire.recv(self.sock, nodewire.REPLY_LIMITS, idle=lambda: False)
        for fd in fds:
            os.close(fd)
        return json.loads(head), payload

    def closed_by_hub(self) -> bool:
        """Whether the hub dropped this connection (end of stream, or reset) within the
        socket's timeout; whatever it sent before is skipped."""
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


# -- forged training data, reading without credentials, squatting ---------------------------


def _spec_of(store: CountingStore, path: Path) -> None:
    """The versions and objects of ``store``, as a forger would serve them."""
    versions = []
    while (data := store.size(keys.version_key(len(versions) + 1))) is not None and data:
        versions.append(bytes(store.get(keys.version_key(len(versions) + 1))).hex())
    objects = {info.key: bytes(store.get(info.key)).hex() for info in store.list("data/")}
    path.write_text(json.dumps({"versions": versions, "objects": objects}))


@other_user
def test_a_forging_hub_of_another_user_is_refused_and_training_reads_the_log(stranger, monkeypatch, caplog):
    """Another user serves versions and bytes of its own at the hub's name: with the peer
    check, the ranks refuse it (one WARNING) and read the log's data; without it (the check
    sabotaged), training takes the forged data, so the check is what stands between."""
    genuine = CountingStore("memory://trust/genuine")
    fill(genuine, 3, 1, first=0)  # slice of step s holds s
    forged = CountingStore("memory://trust/forged")
    with bw.Producer(forged, "p", dp=1, commit_policy=Manual()) as producer:
        for step in range(3):
            producer.append([{"x": np.full(4, 666)}], source_offset=step)
        producer.flush()
    bw.end_stream(forged)
    spec = stranger.place / "forge"
    spec.mkdir()
    os.chmod(spec, 0o777)  # the forger's own place, as another user would have
    _spec_of(forged, spec / "spec.json")
    os.chmod(spec / "spec.json", 0o644)
    address = node.node_address(genuine, Mesh(dp=1, tp=2), 0)
    forger_path = str(spec / "hub.sock")
    forging = ("forge", forger_path, address.identity, str(spec / "spec.json"))
    forger = stranger.start(*forging)
    try:
        assert stranger.answer(forger, forging)["serving"] == forger_path
        lock = address.paths()[1]
        monkeypatch.setattr(node.HubAddress, "paths", lambda self: (forger_path, lock))  # it got the name
        with monkeypatch.context() as sabotaged:
            sabotaged.setattr(nodeclient, "check_peer", lambda sock, what: 0)
            fooled = read_node(genuine, range(2), dp=1, tp=2, sharing=True)
        assert {int(v) for records in fooled.values() for _, v, _ in records} == {666}
        with caplog.at_level("WARNING", logger="batchweave.reading.nodeclient"):
            seen = read_node(genuine, range(2), dp=1, tp=2, sharing=True)
    finally:
        forger.kill()
        forger.wait()
    assert_each_rank_read_its_slice(seen, 3, 1, 2)
    refused = [r.getMessage() for r in caplog.records if "uid 65534" in r.getMessage()]
    assert 1 <= len(refused) <= 2, refused  # once per rank at most


@other_user
def test_another_user_can_neither_squat_the_hubs_name_nor_read_through_the_hub(stranger, caplog, monkeypatch):
    # A hub directory of this test's own, in a place the stranger can pass through: the
    # test opens it by mistake on purpose, and the node's shared one must never be open,
    # even for a moment (another test process's hubs refused to start while it was).
    base = Path(tempfile.mkdtemp(prefix="bw-hubs-", dir=stranger.place.parent))
    os.chmod(base, 0o711)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    store = CountingStore("memory://trust/private")
    fill(store, 4, 1)
    address = serve_hub(store, Mesh(dp=1, tp=2))
    path, lock = address.paths()
    directory = os.path.dirname(path)
    assert directory == str(base / f"batchweave-{os.getuid()}")
    try:
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stranger.run("squat", path + ".x") == {"bind": "PermissionError"}
        assert stranger.run("read", path, address.identity) == {"connect": "PermissionError"}
        # Even with the directory opened by mistake, the hub refuses another user's process.
        os.chmod(directory, 0o711)
        os.chmod(path, 0o777)
        with caplog.at_level("WARNING", logger="batchweave.reading.nodehub"):
            seen = stranger.run("read", path, address.identity)
        assert seen["connect"] == "ok" and "log" not in seen, seen
        assert any("uid 65534" in r.getMessage() for r in caplog.records)
    finally:
        os.chmod(directory, 0o700)
        close_hub(address)
        shutil.rmtree(base, ignore_errors=True)


def test_a_hub_directory_another_user_could_reach_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = nodetrust.hub_directory()
    assert path == str(tmp_path / f"batchweave-{os.getuid()}")
    os.chmod(path, 0o755)  # open to others: another user could connect
    with pytest.raises(nodetrust.HubRefused, match="not a directory private"):
        nodetrust.hub_directory()
    os.rmdir(path)
    os.symlink(tmp_path, path)  # a link laid in advance
    with pytest.raises(nodetrust.HubRefused):
        nodetrust.hub_directory()
    os.unlink(path)
    if os.geteuid() == 0:
        os.mkdir(path, 0o700)
        os.chown(path, 65534, 65534)  # made first by another user
        with pytest.raises(nodetrust.HubRefused):
            nodetrust.hub_directory()


def test_a_rank_maps_only_sealed_memory_of_the_announced_size(tmp_path):
    sealed = nodewire.shared_memory(b"x" * 100)
    try:
        nodetrust.check_memory(sealed, 100)
        with pytest.raises(nodetrust.HubRefused, match="holds 100 bytes"):
            nodetrust.check_memory(sealed, 4096)  # mapping past the end would fault the rank
    finally:
        os.close(sealed)
    unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.write(unsealed, b"x" * 100)
    try:
        with pytest.raises(nodetrust.HubRefused, match="not sealed"):
            nodetrust.check_memory(unsealed, 100)  # the hub could change the bytes after the CRC check
    finally:
        os.close(unsealed)
    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * 100)
    fd = os.open(plain, os.O_RDONLY)
    try:
        with pytest.raises(nodetrust.HubRefused, match="not a sealed memfd"):
            nodetrust.check_memory(fd, 100)
    finally:
        os.close(fd)


# -- one store identity per hub ------------------------------------------------------------


def test_two_endpoints_accounts_or_credentials_never_share_a_hub(monkeypatch):
    mesh = Mesh(dp=2, tp=4)

    def address(url: str, **options: str) -> str:
        return node.node_address(Store(url, storage_options=options or None), mesh, 0).identity

    s3 = "s3://bucket/path"
    assert address(s3, endpoint="http://staging:9000") != address(s3, endpoint="http://production:9000")
    assert address(s3, access_key_id="A", secret_access_key="s") != address(
        s3, access_key_id="B", secret_access_key="s"
    )
    assert address(s3, access_key_id="A", secret_access_key="s") != address(
        s3, access_key_id="A", secret_access_key="t"
    )
    azure = "az://container/path"
    assert address(azure, account_name="one") != address(azure, account_name="two")
    same = address(s3, endpoint="http://staging:9000")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://elsewhere:9000")  # obstore reads it too
    assert address(s3, endpoint="http://staging:9000") != same
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")
    assert node.node_address(Store("memory://x/y"), mesh, 0) != node.node_address(Store("memory://x/y"), mesh, 8)


@pytest.mark.s3
def test_two_jobs_on_two_s3_endpoints_with_one_url_each_read_their_own(services_dir, moto_server, monkeypatch):
    """Staging and production: ``s3://bucket/path`` on two servers, read on one node with
    default settings. Each job's ranks get their own server's data."""
    from conftest import S3_BUCKET, _point_s3_at

    from batchweave.testing import servers

    workdir = services_dir / f"moto-{os.getpid()}-{time.monotonic_ns()}"
    workdir.mkdir()
    other = servers.start_moto(workdir)
    try:
        servers.create_bucket(other.endpoint, S3_BUCKET)
        _point_s3_at(monkeypatch, moto_server)
        url = f"s3://{S3_BUCKET}/two-endpoints-{os.getpid()}-{time.monotonic_ns()}"
        options = {"endpoint": other.endpoint}  # the rest (keys, plain HTTP) from the environment
        staging, production = Store(url), Store(url, storage_options=options)
        fill(staging, 6, 1)
        with bw.Producer(production, "p", dp=1, commit_policy=Manual()) as producer:
            for step in range(6):
                producer.append([{"x": np.full(4, 1000 + step)}], source_offset=step)
            producer.flush()
        bw.end_stream(production)
        results: dict[str, dict] = {}
        jobs = [
            threading.Thread(target=lambda: results.update(a=read_node(staging, range(2), dp=1, tp=2, sharing=True))),
            threading.Thread(
                target=lambda: results.update(b=read_node(production, range(2), dp=1, tp=2, sharing=True))
            ),
        ]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join(120)
    finally:
        other.stop()
    assert_each_rank_read_its_slice(results["a"], 6, 1, 2)
    assert all([v for _, v, _ in records] == [1000 + s for s in range(6)] for records in results["b"].values())


# -- failures belong to their requester ----------------------------------------------------


def test_nonsense_requests_get_their_own_answer_and_training_reads_on(caplog):
    """A bogus anchor, a huge ``present_through``, ``from: 0``, a far ``from``: each fails
    only its sender (or sends it to read alone); the training ranks read every step."""
    store = CountingStore("memory://trust/poison")
    steps = 40
    fill(store, steps, 2, end=False)
    mesh = Mesh(dp=2, tp=2)
    address = serve_hub(store, mesh)
    try:
        far = RawClient(address)
        far.send({"op": "log", "id": 7, "from": 10**12})  # the first request: starts the follower far away
        assert far.recv()[0]["sizes"] == []
        consumers = [
            bw.Consumer(store, dp=2, tp=2, rank=r, local_rank=r, local_world_size=4, node_sharing=True, timeout_s=30)
            for r in range(4)
        ]
        firsts = [[next(c).step for _ in range(10)] for c in consumers]
        poisons = (
            {"op": "log", "id": 1, "from": 1, "anchor": [1, "00" * 16]},
            {"op": "log", "id": 2, "from": 1, "present_through": 10**9},
            {"op": "log", "id": 3, "from": 0},
            {"op": "range", "id": 4, "key": "../../etc/passwd", "start": 0, "length": 10, "sharers": 1},
        )
        for poison in poisons:
            client = RawClient(address)
            client.send(poison)
            assert "refused" in client.recv()[0]
            assert client.closed_by_hub()
        far.send({"op": "log", "id": 8, "from": 10**12})  # now the follower serves others: alone
        assert "alone" in far.recv()[0]
        fill(store, steps + 10, 2, first=steps)
        rest = [[next(c).step for _ in range(steps)] for c in consumers]
        assert all(f + r == list(range(steps + 10)) for f, r in zip(firsts, rest, strict=True))
        for consumer in consumers:
            consumer.close()
        far.close()
    finally:
        close_hub(address)


def test_an_evaluation_reader_from_a_reclaimed_step_gets_its_own_error_and_training_reads_on(tmp_path):
    """GC reclaimed steps 0-29; an evaluation reader of the job starts from step 0 beside
    training on the same hub: it hears DataReclaimedError, training hears nothing."""
    store = CountingStore("memory://trust/reclaimed")
    with bw.Producer(store, "p", dp=1, commit_policy=Manual(), snapshot_every=4) as producer:
        for step in range(40):
            producer.append([{"x": np.full(4, step)}], source_offset=step)
            if step % 5 == 4:
                producer.flush()
        with bw.Consumer(store, dp=1, rank=0) as marker:
            for _ in range(30):
                next(marker)
            marker.mark_checkpoint("ckpt")
            cursor = marker.state_dict()
        bw.collect_garbage(store, grace_s=0)

        def rank(r: int) -> bw.Consumer:
            return bw.Consumer(
                store, dp=1, tp=2, rank=r, local_rank=r, local_world_size=2, node_sharing=True, timeout_s=30
            )

        training = [rank(0), rank(1)]
        for consumer in training:
            consumer.load_state_dict(cursor)
        assert [next(c).step for c in training] == [30, 30]
        evaluation = rank(0)
        with pytest.raises(DataReclaimedError):
            next(evaluation)
        evaluation.close()
        for step in range(40, 50):
            producer.append([{"x": np.full(4, step)}], source_offset=step)
        producer.flush()
    for consumer in training:
        assert [(b.step, int(b.data["x"][0])) for b in (next(consumer) for _ in range(19))] == [
            (s, s) for s in range(31, 50)
        ]
        consumer.close()


# -- every resource and wait bounded ---------------------------------------------------------


def test_a_client_that_reads_no_reply_is_dropped_and_stalls_no_one(monkeypatch):
    """It sends requests as fast as it can and reads no reply, beside training: the
    training ranks read every step, and the flooding connection is dropped."""
    monkeypatch.setattr(nodehub, "IO_S", 1.0)  # a reply not taken within it drops the connection
    store = CountingStore("memory://trust/unread")
    steps = 30
    fill(store, steps, 1)
    mesh = Mesh(dp=1, tp=2)
    address = serve_hub(store, mesh)
    key = next(info.key for info in store.list("data/"))
    try:
        flood = RawClient(address)
        flood.sock.settimeout(5)

        def flood_hub() -> None:
            with contextlib.suppress(OSError):  # the hub drops it, or stops reading it
                for ident in range(100_000):
                    flood.send({"op": "range", "id": ident, "key": key, "start": 0, "length": 64, "sharers": 2})

        flooding = threading.Thread(target=flood_hub)
        flooding.start()
        seen = read_node(store, range(2), dp=1, tp=2, sharing=True)
        flooding.join(60)
        assert not flooding.is_alive()
        assert_each_rank_read_its_slice(seen, steps, 1, 2)
        assert flood.closed_by_hub()  # its replies were never taken
        flood.close()
    finally:
        close_hub(address)


def test_a_process_of_the_same_user_that_never_reads_stalls_no_rank_and_is_dropped(monkeypatch):
    """Issue 43: a process of the job's own user connects to the hub, asks for range after
    range (each a read and a descriptor) and never reads a reply, beside two ranks reading
    a live stream through the hub. A descriptor sent to its full socket waited out the
    socket's bound even with MSG_DONTWAIT, under the lock every other reply to it waits
    on: the hub's read threads all hung there and the ranks' steps stalled for that bound
    (7-10 s measured). Now no step waits a second, and the intruder is dropped once a
    reply of its has not moved for the bound."""
    monkeypatch.setattr(nodehub, "IO_S", 2.0)  # 10 s in production: the test's runtime
    store = CountingStore(f"memory://trust/never-reads-{uuid.uuid4().hex}")  # a hub of its own, whatever runs beside
    stop, warm = threading.Event(), threading.Event()
    produced: list[int] = []
    waits: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    failures: list[BaseException] = []

    def produce() -> None:  # a step every 30 ms, committed at once: the ranks wait for each
        with bw.Producer(store, "p", dp=1, commit_policy=Manual(), pack_steps=1) as producer:
            step = 0
            while not stop.is_set() or step < 40:
                producer.append([{"x": np.full(4, step)}], source_offset=step)
                producer.flush()
                produced.append(step)
                step += 1
                stop.wait(0.03)  # the producer's pace, not a wait for a condition
        bw.end_stream(store)

    def read(rank: int) -> None:
        try:
            consumer = bw.Consumer(
                store,
                dp=1,
                tp=2,
                rank=rank,
                local_rank=rank,
                local_world_size=2,
                node_sharing=True,
                timeout_s=30,
                max_poll_interval_s=0.05,
            )
            steps = iter(consumer)
            while True:
                asked = time.monotonic()
                batch = next(steps, None)
                if batch is None:
                    break
                waits[rank].append((batch.step, time.monotonic() - asked))
                if batch.step == 10:
                    warm.set()
            consumer.close()
        except BaseException as exc:
            failures.append(exc)
            warm.set()

    producer = threading.Thread(target=produce)
    producer.start()
    ranks = [threading.Thread(target=read, args=(r,)) for r in (0, 1)]
    try:
        for rank in ranks:
            rank.start()
        assert warm.wait(60) and not failures, failures  # the hub serves both ranks
        address = node.node_address(store, Mesh(dp=1, tp=2), 0)
        data = next(info for info in store.list("data/"))
        flood = [str(HERE / "hub_intruder.py"), "flood", address.paths()[0], address.identity, data.key]
        out = subprocess.run(
            [sys.executable, *flood, str(data.size), "20"], capture_output=True, text=True, timeout=60, check=True
        )
        flooded = json.loads(out.stdout)
    finally:
        stop.set()
        producer.join(60)
        for rank in ranks:
            rank.join(60)
    assert not failures, failures
    assert all([step for step, _ in waits[r]] == produced for r in (0, 1))
    assert flooded["requests"] > 256, flooded  # more than the hub answers unread: its socket filled
    assert flooded["dropped_s"] is not None and flooded["dropped_s"] < nodehub.IO_S + 3, flooded
    late = max((wait, step) for r in (0, 1) for step, wait in waits[r] if step > 10)
    assert late[0] < 1.0, f"step {late[1]} waited {late[0]:.2f} s"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_announced_payloads_cost_the_hub_nothing_and_stalled_messages_are_dropped(monkeypatch):
    monkeypatch.setattr(nodehub, "IO_S", 0.5)
    store = CountingStore("memory://trust/payload")
    address = serve_hub(store, Mesh(dp=1, tp=2))
    try:
        before = _rss_bytes()
        clients = [RawClient(address) for _ in range(3)]
        for client in clients:  # 300 MB announced each, never sent
            client.sock.sendall(struct.pack("<II", 100, 300 << 20) + b"{")
        assert all(client.closed_by_hub() for client in clients)  # over the limit: dropped
        assert _rss_bytes() - before < 64 << 20
        stalled = RawClient(address)
        stalled.sock.sendall(struct.pack("<II", 50, 0) + b'{"op": "lo')  # a header begun, never finished
        assert stalled.closed_by_hub()  # within IO_S
        for client in (*clients, stalled):
            client.close()
    finally:
        close_hub(address)


FD_SCRIPT = """
import resource, sys
import numpy as np
sys.path.insert(0, {tests!r})
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import batchweave as bw
from test_node import CountingStore, fill
store = CountingStore("memory://fds")
fill(store, 600, 1)
# Rank 1 shares rank 0's slices but never reads: every range rank 0 reads waits for it.
consumer = bw.Consumer(store, dp=1, tp=2, rank=0, local_rank=0, local_world_size=2, node_sharing=True, timeout_s=30)
steps = [batch.step for batch in consumer]
from batchweave.reading import nodehub
hub = next(iter(nodehub._hubs.values()))
print(len(steps), hub._memfds, nodehub.fd_budget())
consumer.close()
"""


def test_a_lagging_sibling_never_exhausts_the_hubs_descriptors():
    """600 small ranges kept for a sibling that never takes them, under a limit of 256
    descriptors: the hub keeps at most its budget open and the rank reads every step."""
    out = subprocess.run(
        [sys.executable, "-c", FD_SCRIPT.format(tests=str(HERE))], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps, memfds, budget = map(int, out.stdout.split()[-3:])
    assert steps == 600 and budget == 64 and memfds <= budget


def test_a_hub_that_cannot_share_memory_makes_its_ranks_read_directly_with_one_warning(monkeypatch, caplog):
    def no_memory(data):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(nodehub, "shared_memory", no_memory)
    store = CountingStore("memory://trust/nomemfd")
    fill(store, 10, 1)
    with caplog.at_level("WARNING"):
        seen = read_node(store, range(2), dp=1, tp=2, sharing=True)
    assert_each_rank_read_its_slice(seen, 10, 1, 2)
    warned = [r for r in caplog.records if r.name == "batchweave.reading.nodeclient" and "itself" in r.getMessage()]
    assert 1 <= len(warned) <= 2  # once per rank, not once per step


def test_descriptors_the_kernel_refuses_make_ranks_read_those_ranges_and_keep_their_hub(monkeypatch, caplog):
    """The kernel counts descriptors sent and not yet received against the user's
    RLIMIT_NOFILE and refuses more past it (ETOOMANYREFS), on every socket of the user: a
    few peers that leave replies unread (``test_node_outbox``: they keep theirs) bring a
    hub there. Each such range reply broke the rank's connection, until the rank gave up on
    the hub; now the rank reads that range itself and keeps the hub for the rest."""

    def refused(*args, **kwargs):
        raise OSError(errno.ETOOMANYREFS, "Too many references")

    monkeypatch.setattr(nodeoutbox.socket, "send_fds", refused)  # only the hub's replies carry any
    monkeypatch.setattr(nodeclient, "TAKEOVER_S", 1.0)
    store = CountingStore("memory://trust/toomanyrefs")
    fill(store, 10, 1)
    with caplog.at_level("WARNING", logger="batchweave.reading.nodeclient"):
        seen = read_node(store, range(2), dp=1, tp=2, sharing=True)
    assert_each_rank_read_its_slice(seen, 10, 1, 2)
    warnings = [r.getMessage() for r in caplog.records]
    assert not [m for m in warnings if "reads without it" in m], warnings  # the hub kept serving the log
    assert 1 <= len([m for m in warnings if "RLIMIT_NOFILE" in m]) <= 2, warnings  # once per rank


def test_an_accept_and_close_squatter_keeps_no_rank_trying_for_longer_than_the_takeover_deadline(monkeypatch, caplog):
    store = CountingStore("memory://trust/squatter")
    fill(store, 8, 1)
    accepted = [0]

    def accept_and_close(squatter: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = squatter.accept()
                accepted[0] += 1
                conn.close()

    monkeypatch.setattr(nodeclient, "TAKEOVER_S", 0.5)
    with squatting(node.node_address(store, Mesh(dp=1, tp=2), 0)) as squatter:
        threading.Thread(target=accept_and_close, args=(squatter,), daemon=True).start()
        with caplog.at_level("WARNING", logger="batchweave.reading.nodeclient"):
            seen = read_node(store, range(2), dp=1, tp=2, sharing=True)
    assert_each_rank_read_its_slice(seen, 8, 1, 2)
    assert any("unreachable" in r.getMessage() for r in caplog.records)
    assert accepted[0] < 200  # tried within the deadline, then read alone: not forever


DEAD_RANK = """
import socket, sys
sys.path.insert(0, {src!r})
from batchweave.reading import nodewire
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect({path!r})
nodewire.send(sock, {{"op": "hello", "protocol": nodewire.PROTOCOL, "identity": {identity!r}}})
nodewire.recv(sock, nodewire.REPLY_LIMITS)
nodewire.send(sock, {{"op": "log", "id": 1, "from": 5}})
print("asked", flush=True)
sys.stdin.read()
"""


def test_a_rank_that_dies_while_its_request_is_queued_leaves_no_place_behind(monkeypatch):
    store = CountingStore("memory://trust/dead")
    fill(store, 10, 1)
    mesh = Mesh(dp=1, tp=2)
    address = serve_hub(store, mesh)
    hub = nodehub._hubs[address.identity]
    queued, go, answered = threading.Event(), threading.Event(), threading.Event()
    answer_log = nodehub._Hub._answer_log

    def held(self, peer, request):  # the request waits on its pool thread until go
        queued.set()
        assert go.wait(60)
        try:
            answer_log(self, peer, request)
        finally:
            answered.set()

    monkeypatch.setattr(nodehub._Hub, "_answer_log", held)
    src = str(Path(nodehub.__file__).resolve().parents[2])
    script = DEAD_RANK.format(src=src, path=address.paths()[0], identity=address.identity)
    rank = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "asked"
        assert queued.wait(30)
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        with hub._cond:  # the hub sees the connection go
            assert hub._cond.wait_for(lambda: hub._connections == 0, timeout=30)
        go.set()
        assert answered.wait(30)
        with hub._cond:
            assert hub._log._positions == {}  # nothing holds the follower back for a dead rank
    finally:
        go.set()
        if rank.poll() is None:
            rank.kill()
            rank.wait()
        close_hub(address)


FORKING_HUB = """
import os, sys
sys.path.insert(0, {tests!r})
import batchweave as bw
from test_node import CountingStore
store = CountingStore("memory://forked")
from batchweave.mesh import Mesh
from batchweave.reading import node, nodehub
from batchweave.reading.polling import HeadPolling
address = node.node_address(store, Mesh(dp=1, tp=2), 0)
assert nodehub.start_hub(address, store, HeadPolling(1))
forked, ready = os.pipe()
child = os.fork()  # a DataLoader worker of the hub's process
if child == 0:
    os.write(ready, b"x")  # its at-fork hooks have run (before fork() returned here)
    os.read(0, 1)  # lives until the test closes its standard input, or kills it
    os._exit(0)
os.read(forked, 1)  # the parent dies only once the child holds what it kept
print(child, address.paths()[0], flush=True)
sys.stdin.read()
"""


def test_a_forked_child_of_the_hubs_process_does_not_keep_the_hub_alive():
    """The hub's process forks (DataLoader workers) and dies: the child holds no copy of
    the hub's lock or socket, so another rank takes over at once."""
    script = FORKING_HUB.format(tests=str(HERE))
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child_pid, path = proc.stdout.readline().split()
        child = int(child_pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        address = node.node_address(CountingStore("memory://forked"), Mesh(dp=1, tp=2), 0)
        assert address.paths()[0] == path
        store = CountingStore("memory://forked")
        assert nodehub.start_hub(address, store, HeadPolling(1))  # the lock went with the parent
        nodehub.use_hub(address, +1)
        probe = RawClient(address)  # and the name answers: the new hub's
        probe.close()
        nodehub.use_hub(address, -1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_reply_on_another_thread_during_a_reconnect_does_not_break_the_takeover_deadline(monkeypatch):
    """Regression (CI, stop 34): one thread reconnected after a loss while another thread's
    reply on the old connection cleared the loss time; the deadline check then subtracted
    None and the rank's reading thread died with a TypeError."""
    store = CountingStore("memory://trust/reply-race")
    address = node.node_address(store, Mesh(dp=1, tp=2), 0)
    client = nodeclient.NodeClient(address, store, HeadPolling(1), sharers=2)
    client._hosting = True  # no hub of its own: only _greet decides
    answered = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    greetings = [0]

    def greet(path: str) -> socket.socket | None:
        greetings[0] += 1
        if greetings[0] == 1:
            client._lost_at = None  # what another thread's reply does, between the two reads
            return None
        return answered

    monkeypatch.setattr(client, "_greet", greet)
    try:
        assert client._connect() is answered
        assert greetings[0] == 2
    finally:
        answered.close()
        client._hosting = False
        client.close()


def test_a_whole_message_is_cut_by_its_own_lengths_within_the_readers_limits():
    """``nodewire.unframe`` (how the simulation's hub channels carry every log reply): what
    ``frame`` made comes back as it was; lengths that do not cut it, or past the limits, are
    a lost hub, never a guess."""
    header, payload = b'{"sizes":[3,2]}', b"abcde"
    message = nodewire.frame(header, len(payload)) + payload
    assert nodewire.unframe(message, nodewire.REPLY_LIMITS) == (header, payload)
    for broken in (message[:-1], message + b"x", message[:5]):
        with pytest.raises(nodewire.HubLost):
            nodewire.unframe(broken, nodewire.REPLY_LIMITS)
    with pytest.raises(nodewire.HubLost, match="over the limit"):
        nodewire.unframe(message, nodewire.Limits(header=8, payload=1 << 20))


@pytest.mark.parametrize(
    "header",
    [b"{not json", b'{"op": "\xff"}', b'{"op": "hello", "protocol": 1, "identity": "\xff"}', b"[" * 10_000],
)
def test_a_header_that_does_not_decode_is_a_bad_request_whatever_breaks(header):
    # Regression: invalid UTF-8 from a peer escaped as a bare UnicodeDecodeError.
    with pytest.raises(nodewire.BadRequest, match="request"):
        nodewire.parse_request(header)
