"""Issue 18: a put on a local directory returns only once the object is durable, and what a
killed put leaves behind (a staging file) is never an object and is collected."""

from __future__ import annotations

import errno
import os
import pickle  # only to prove the handle keeps its options across processes; never on data
import signal
import subprocess
import sys
import time

import pytest

import batchweave as bw
from batchweave.store import Store, open_store
from batchweave.store.spares import SPARES_AHEAD

KEY = "data/p/e000001/00000000000000000000.bwb"


class Recorder:
    """Wraps os.fsync, os.link and os.replace, recording each call in order: fsyncs by the
    (device, inode) of what was synced, links and renames by their paths."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple] = []
        for name in ("fsync", "link", "replace"):
            monkeypatch.setattr(os, name, self._recording(name, getattr(os, name)))

    def _recording(self, name, real):
        def call(*args):
            if name == "fsync":
                stat = os.fstat(args[0])
                self.calls.append(("fsync", (stat.st_dev, stat.st_ino)))
            else:
                self.calls.append((name, *map(os.fspath, args)))
            return real(*args)

        return call

    def index(self, call) -> int:
        assert call in self.calls, f"{call} not among {self.calls}"
        return self.calls.index(call)


def identity(path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def test_a_create_only_put_fsyncs_the_file_then_links_it_then_fsyncs_the_directories(tmp_path, monkeypatch):
    root = tmp_path / "ns"
    store = open_store(root)
    recorder = Recorder(monkeypatch)
    store.put_if_absent(KEY, b"x" * 1000)
    target = root / KEY
    links = [c for c in recorder.calls if c[0] == "link"]
    assert len(links) == 1, recorder.calls  # one link into place (obstore's puts make no call here)
    link = links[0]
    assert link[2] == str(target) and link[1].startswith(f"{target}#")  # staged next to it
    linked_at = recorder.calls.index(link)
    assert recorder.index(("fsync", identity(target))) < linked_at  # the bytes first
    # Then the directory holding the new name, and every directory the put made (a new
    # producer's data/p/e000001/) in its parent, up to the namespace root.
    for directory in (target.parent, root / "data/p", root / "data", root):
        assert recorder.index(("fsync", identity(directory))) > linked_at, directory
    assert bytes(store.get(KEY)) == b"x" * 1000
    assert store.staging_files() == []  # the staging name is gone


def test_an_overwrite_fsyncs_the_file_then_renames_it_then_fsyncs_the_directory(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    store.put("_log/_last_snapshot.json", b"1")
    recorder = Recorder(monkeypatch)
    store.put("_log/_last_snapshot.json", b"2")
    target = tmp_path / "_log" / "_last_snapshot.json"
    renames = [c for c in recorder.calls if c[0] == "replace"]
    assert len(renames) == 1, recorder.calls
    rename = renames[0]
    assert rename[2] == str(target)
    renamed_at = recorder.calls.index(rename)
    assert recorder.index(("fsync", identity(target))) < renamed_at
    assert recorder.index(("fsync", identity(target.parent))) > renamed_at
    assert bytes(store.get("_log/_last_snapshot.json")) == b"2"


def test_the_local_path_keeps_create_only_semantics(tmp_path):
    store = open_store(tmp_path)
    store.put_if_absent(KEY, b"first")
    with pytest.raises(bw.ObjectExistsError, match=KEY) as info:
        store.put_if_absent(KEY, b"second")
    assert isinstance(info.value, FileExistsError)
    assert bytes(store.get(KEY)) == b"first"
    assert [o.key for o in store.list()] == [KEY] and store.staging_files() == []  # the loser left nothing


def test_fsync_false_skips_every_fsync_and_travels_with_the_handle(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "scratch"), storage_options={"fsync": False})
    clone = pickle.loads(pickle.dumps(store))
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    for handle in (store, clone):
        handle.put_if_absent(f"data/p/e000001/{id(handle)}.bwb", b"x")
        handle.put("_log/_last_snapshot.json", b"1")
    assert synced == []
    assert len(list(store.list())) == 3
    open_store(tmp_path / "durable").put_if_absent(KEY, b"x")
    assert synced  # the default fsyncs (a test that could not see them would prove nothing above)


@pytest.mark.parametrize("url", ["memory://no-fsync", "s3://bucket/run"])
def test_fsync_is_an_option_of_local_directories_only(url):
    with pytest.raises(bw.ConfigError, match="'fsync' is for local directories only"):
        Store(url, storage_options={"fsync": False})
    with pytest.raises(bw.ConfigError, match="'fsync' must be True or False, got a value of type str"):
        Store("relative-dir-never-made", create=False, storage_options={"fsync": "no"})


def test_a_full_disk_is_a_store_error_naming_the_key_and_leaves_no_staging_file(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    store.put_if_absent("_log/00000000000000000001.json", b"{}")  # the handle and directories exist

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(bw.StoreError, match="No space left on device") as info:
        store.put_if_absent("_log/00000000000000000002.json", b"{}")
    assert type(info.value) is bw.StoreError and info.value.key == "_log/00000000000000000002.json"
    monkeypatch.undo()
    assert store.staging_files() == [] and store.size("_log/00000000000000000002.json") is None


def test_a_write_that_stops_short_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """The pieces go to the kernel as they are, in one writev; one that writes less (a
    signal, a nearly full disk) is followed by writes of the rest, in bytes, whatever the
    pieces' item sizes (an int32 view's len is its items)."""
    import numpy as np

    store = open_store(tmp_path, storage_options={"fsync": False})
    store.put_if_absent("_log/00000000000000000001.json", b"{}")  # the handle and directories exist
    real_writev, calls = os.writev, []

    def short(fd, pieces):
        calls.append(len(pieces))
        first = memoryview(pieces[0]).cast("B")
        return real_writev(fd, [first[: max(1, len(first) // 2)]])  # half of the first piece at most

    monkeypatch.setattr(os, "writev", short)
    words = np.arange(10, dtype=np.int32)
    pieces = [b"abc", memoryview(words), b"", b"xyz"]  # the view's len is 10, its bytes 40
    store.stage_if_absent("data/p/e000001/a.bwb", pieces)
    monkeypatch.undo()
    assert bytes(store.get("data/p/e000001/a.bwb")) == b"abc" + words.tobytes() + b"xyz"
    assert len(calls) > 3  # it went on, piece by piece
    store.release()


def test_a_batch_of_pieces_that_stops_short_where_their_lens_end_goes_on(tmp_path, monkeypatch):
    """Past ``IOV_MAX`` pieces each batch's bytes are counted to tell a short write. A
    write that stops exactly where the pieces' ``len``s would end (an int32 view's len is
    its items) must still be seen as short."""
    import numpy as np

    store = open_store(tmp_path, storage_options={"fsync": False})
    store.put_if_absent("_log/00000000000000000001.json", b"{}")  # the handle and directories exist
    real_writev, calls = os.writev, []
    words = np.arange(10, dtype=np.int32)
    pieces = [memoryview(words), *[bytes([i % 251]) for i in range(1500)]]
    lens_of_first_batch = len(pieces[0]) + 1023  # 1,033: what len() says; the bytes are 1,063

    def short_once(fd, batch):
        calls.append(len(batch))
        if len(calls) > 1:
            return real_writev(fd, batch)
        whole = b"".join(bytes(memoryview(piece).cast("B")) for piece in batch)
        return real_writev(fd, [whole[:lens_of_first_batch]])

    monkeypatch.setattr(os, "writev", short_once)
    store.stage_if_absent("data/p/e000001/a.bwb", pieces)
    monkeypatch.undo()
    expected = words.tobytes() + b"".join(pieces[1:])
    assert bytes(store.get("data/p/e000001/a.bwb")) == expected
    assert calls[0] == 1024 and len(calls) >= 3  # a full batch, its rest, then the next batch
    store.release()


def test_a_producer_writes_its_callers_arrays_memory_with_one_writev_per_object(tmp_path, monkeypatch):
    """On a local directory an append's object reaches the kernel as the arrays' own memory
    (no copy in the process), in one system call."""
    import numpy as np

    from batchweave.commit.policies import Manual

    arrays = [{"x": np.full(50_000, d, np.int32)} for d in range(8)]
    writes: list[list] = []
    real_writev = os.writev

    def spy(fd, pieces):
        writes.append(list(pieces))
        return real_writev(fd, pieces)

    producer = bw.Producer(tmp_path.as_uri(), "p", dp=8, commit_policy=Manual(), pack_steps=1)
    monkeypatch.setattr(os, "writev", spy)
    producer.append(arrays, source_offset=0)
    monkeypatch.undo()
    (pieces,) = [w for w in writes if sum(len(bytes(memoryview(p))) for p in w) > 8 * 200_000]
    viewed = [p.obj for p in pieces if isinstance(p, memoryview) and isinstance(p.obj, np.ndarray)]
    assert len(viewed) == 8 and all(np.shares_memory(v, a["x"]) for v, a in zip(viewed, arrays, strict=True))
    producer.close()


def test_a_staging_file_deleted_under_a_put_is_written_again(tmp_path, monkeypatch):
    """A collection with grace_s=0 may delete the staging file of a put in flight."""
    store = open_store(tmp_path)
    real_link = os.link
    deleted = []

    def collect_first(staging, target):
        if not deleted:
            os.unlink(staging)
            deleted.append(staging)
        return real_link(staging, target)

    monkeypatch.setattr(os, "link", collect_first)
    store.put_if_absent(KEY, b"payload")
    assert deleted and bytes(store.get(KEY)) == b"payload"


# -- staging files and garbage collection ---------------------------------------------


def leave_staging(root, key: str, age_s: float) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"s" * 1000)
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_staging_files_older_than_the_grace_are_collected_and_never_listed(tmp_path):
    with bw.Producer(tmp_path, "p", dp=1) as producer:
        producer.append([b"tgb"], source_offset=0)
        producer.flush()
    old_ours = "data/p/e000001/000000000001-0badc0de.0.bwb#123456789012345678"  # of a key of the layout (I13)
    old_obstores = "_log/00000000000000000009.json#1"  # obstore's own staging name
    fresh = "data/p/e000001/000000000002-0badc0de.0.bwb#876543210987654321"
    leave_staging(tmp_path, old_ours, age_s=7200)
    leave_staging(tmp_path, old_obstores, age_s=7200)
    leave_staging(tmp_path, fresh, age_s=10)
    store = open_store(tmp_path)
    assert sorted(info.key for info in store.staging_files()) == sorted([old_ours, old_obstores, fresh])
    assert not [o.key for o in store.list() if "#" in o.key]  # readers never see one as an object

    dry = bw.collect_garbage(tmp_path, grace_s=3600, dry_run=True)
    assert (dry.deleted_staging, dry.deleted_staging_bytes) == (2, 2000)
    assert len(store.staging_files()) == 3
    report = bw.collect_garbage(tmp_path, grace_s=3600)
    assert (report.deleted_staging, report.deleted_staging_bytes) == (2, 2000)
    assert [info.key for info in store.staging_files()] == [fresh]
    with bw.Consumer(tmp_path, dp=1, rank=0, timeout_s=10) as consumer:
        assert next(consumer).data == b"tgb"  # the committed data is untouched


def test_delete_staging_refuses_an_object_key_or_a_file_outside(tmp_path):
    store = open_store(tmp_path / "ns")
    store.put_if_absent(KEY, b"x")
    (tmp_path / "outside#1").write_bytes(b"not ours")
    for key in (KEY, "../outside#1", "/data/x#1"):
        with pytest.raises(bw.ConfigError, match="not a staging file"):
            store.delete_staging(key)
    assert (tmp_path / "outside#1").exists()
    assert store.size(KEY) == 1
    assert open_store("memory://no-staging").staging_files() == []


_PUT_FOREVER = """
import sys
from batchweave.store import open_store
store = open_store(sys.argv[1])
body = bytes(64 * 1024 * 1024)
for index in range(10**6):
    store.put_if_absent(f"data/p/e000001/{index:012d}-0badc0de.0.bwb", body)
"""


def test_a_put_killed_mid_write_leaves_a_staging_file_that_gc_removes(tmp_path):
    """A real SIGKILL of a process in the middle of 64 MiB puts (fsync included, most of
    its time is inside a put; a kill that lands between two puts is tried again)."""
    store = open_store(tmp_path)
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", _PUT_FOREVER, str(tmp_path)], stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not store.staging_files():
                assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
                assert time.monotonic() < deadline, "the child never started a put"
                time.sleep(0.005)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(30)
            if child.stderr:
                child.stderr.close()
        if store.staging_files():
            break
    left = store.staging_files()
    assert left, "three kills all landed between two puts"
    assert not [o.key for o in store.list() if "#" in o.key]
    whole = list(store.list())
    assert all(o.size == 64 * 1024 * 1024 for o in whole)  # finished puts are whole, the rest absent
    report = bw.collect_garbage(tmp_path, grace_s=3600, now=time.time() + 3600)
    assert report.deleted_staging == len(left) and report.deleted_staging_bytes == sum(i.size for i in left)
    assert store.staging_files() == [] and [o.key for o in store.list()] == [o.key for o in whole]


# -- staged objects: a producer's TGBs are fsynced in the background, before the commit ----


class HeldSyncs:
    """Replaces the background fsync of staged objects: each waits for ``release`` (or
    fails with ``error``), and records the files it was asked to sync."""

    def __init__(self, monkeypatch, error: OSError | None = None) -> None:
        import threading

        from batchweave.store import syncs

        self.started = threading.Event()
        self.released = threading.Event()
        self.synced: list[str] = []
        self._error = error
        self._real = syncs.fsync_file
        monkeypatch.setattr(syncs, "fsync_file", self._sync)

    def _sync(self, path):
        self.started.set()
        assert self.released.wait(30), "a held fsync was never released"
        if self._error is not None:
            raise self._error
        self._real(path)
        self.synced.append(os.path.basename(path))


def _log_versions(root) -> list[str]:
    return sorted(p.name for p in (root / "_log").glob("*.json"))


def test_append_returns_before_its_objects_fsync_and_the_commit_waits_for_them(tmp_path, monkeypatch):
    from batchweave.commit.policies import Manual
    from batchweave.testing.interleave import Background

    held = HeldSyncs(monkeypatch)
    producer = bw.Producer(tmp_path.as_uri(), "p", dp=2, commit_policy=Manual())
    try:
        before = _log_versions(tmp_path)  # the epoch claim
        appended = Background(producer.append, [b"a" * 100, b"b" * 100])
        assert appended.result(10) == 0  # returned while its object's fsync is held
        assert held.started.wait(10)
        flushing = Background(producer.flush)
        assert not flushing.finished.wait(0.5), "the commit did not wait for its object to be durable"
        assert _log_versions(tmp_path) == before  # no version names an object that is not durable
        held.released.set()
        flushing.result(10)
        assert len(_log_versions(tmp_path)) == len(before) + 1
        assert len(held.synced) == 1 and held.synced[0].startswith("000000000000-")
    finally:
        held.released.set()
        producer.close(flush=False)


def test_a_commit_waits_for_its_objects_fsyncs_before_its_fragile_window_opens(tmp_path, monkeypatch):
    """Regression: the version's put waited for the staged objects' fsyncs inside the
    window between reading the log and putting the version, so slow disks made commits
    conflict (DAC on a local disk: 65% success and half the throughput)."""
    from batchweave.commit.policies import Manual
    from batchweave.testing.interleave import Background

    held = HeldSyncs(monkeypatch)
    producer = bw.Producer(tmp_path.as_uri(), "p", dp=2, commit_policy=Manual(), background_commit=False, pack_steps=1)
    try:
        producer.append([b"a" * 100, b"b" * 100])
        assert held.started.wait(10)
        flushing = Background(producer.flush)
        assert not flushing.finished.wait(0.5)  # held by the object's fsync for 0.5 s at least
        held.released.set()
        flushing.result(10)
        assert producer.metrics()["last_fragile_window_s"] < 0.25  # the fsync's wait is not in it
    finally:
        held.released.set()
        producer.close(flush=False)


def test_a_failed_fsync_fails_the_commit_naming_the_object_and_commits_nothing(tmp_path, monkeypatch):
    from batchweave.commit.policies import Manual

    held = HeldSyncs(monkeypatch, error=OSError(errno.EIO, "Input/output error"))
    held.released.set()
    producer = bw.Producer(tmp_path.as_uri(), "p", dp=1, commit_policy=Manual())
    before = _log_versions(tmp_path)
    producer.append([b"x" * 10])
    with pytest.raises(bw.NotDurableError, match=r"data/p/e000001/000000000000-\w+\.0\.bwb: could not make"):
        producer.flush()
    producer.close(flush=False)
    assert _log_versions(tmp_path) == before


def test_staged_objects_are_written_into_the_staging_files_opened_ahead_for_them(tmp_path):
    """Creating a file is slow on some disks: the store keeps SPARES_AHEAD staging files
    opened beforehand for the directory of each staged object, and the next objects
    are those files."""
    store = open_store(tmp_path)
    store.stage_if_absent("data/p/e000001/a.bwb", [b"first"])

    def spares():
        return {
            info.key: os.stat(tmp_path / info.key).st_ino for info in store.staging_files() if "/.next#" in info.key
        }

    deadline = time.monotonic() + 10
    while len(spares()) < SPARES_AHEAD:  # opened on a background thread
        assert time.monotonic() < deadline, f"{SPARES_AHEAD} staging files were not opened ahead: {spares()}"
        time.sleep(0.01)
    assert SPARES_AHEAD > 1
    # One directory up: a creation holds its directory's lock, which a link into it would wait for.
    assert {os.path.dirname(key) for key in spares()} == {"data/p"}
    opened_ahead = set(spares().values())
    for name in ("b", "c"):
        store.stage_if_absent(f"data/p/e000001/{name}.bwb", [b"sec", b"ond"])  # pieces, written back to back
        assert os.stat(tmp_path / f"data/p/e000001/{name}.bwb").st_ino in opened_ahead
    assert bytes(store.get("data/p/e000001/c.bwb")) == b"second"
    store.stage_if_absent("data/q/e000001/c.bwb", b"elsewhere")  # another directory: a file of its own
    assert bytes(store.get("data/q/e000001/c.bwb")) == b"elsewhere"
    _wait_for_spares(store, {"data/p": SPARES_AHEAD, "data/q": SPARES_AHEAD})  # each directory keeps its own
    store.put_if_absent("_log/00000000000000000001.json", b"{}")  # waits for the fsyncs too
    store.release()
    assert store.staging_files() == []


def _spares_by_directory(store: Store) -> dict[str, int]:
    """The spare staging files (``.next#...``) by the directory they are in."""
    found: dict[str, int] = {}
    for info in store.staging_files():
        if "/.next#" in info.key:
            directory = os.path.dirname(info.key)
            found[directory] = found.get(directory, 0) + 1
    return found


def _wait_for_spares(store: Store, wanted: dict[str, int]) -> None:
    deadline = time.monotonic() + 10
    while _spares_by_directory(store) != wanted:  # opened (and removed) on a background thread
        assert time.monotonic() < deadline, f"spares {_spares_by_directory(store)}, expected {wanted}"
        time.sleep(0.01)


def test_producers_sharing_a_store_keep_their_spares_one_file_created_per_put(tmp_path, monkeypatch):
    """Regression (issue 44's profile): producers sharing one Store (threads of a process,
    as `bench producers` runs them) write into directories of their own, and each put of
    another producer threw the spares away and opened SPARES_AHEAD new ones: five file
    creations a put, half of a producer's CPU. Each directory now keeps its own spares."""
    from batchweave.store import localfs, spares

    created: list[str] = []
    real_open_staging = localfs.open_staging

    def counting(path: str):
        created.append(path)
        return real_open_staging(path)

    monkeypatch.setattr(spares, "open_staging", counting)
    monkeypatch.setattr(localfs, "open_staging", counting)
    store = open_store(tmp_path, storage_options={"fsync": False})  # (no fsyncs left running after the test)
    producers, puts = 4, 12
    for n in range(puts):
        for p in range(producers):
            store.stage_if_absent(f"data/p{p}/e000001/{n:04d}.bwb", [b"tgb ", b"%d" % n])
    _wait_for_spares(store, {f"data/p{p}": SPARES_AHEAD for p in range(producers)})
    assert bytes(store.get("data/p3/e000001/0011.bwb")) == b"tgb 11"
    store.release()  # once it returns, the background thread has done all it was given
    assert store.staging_files() == []
    # Each directory's first put makes its own file (a try in the missing directory, then
    # one) and opens SPARES_AHEAD spares; every later put takes a spare and opens one to
    # replace it: one creation a put.
    first_puts = producers * (2 + SPARES_AHEAD)
    assert len(created) == first_puts + producers * (puts - 1)


def test_a_put_hands_the_staging_thread_one_task(tmp_path, monkeypatch):
    """Removing the linked staging name and opening the spare that replaces it are one
    task for the background thread: each hand-off costs both threads a wake-up and the
    interpreter lock (two a put before issue 44)."""
    from concurrent.futures import ThreadPoolExecutor

    from batchweave.store import spares

    submitted: list[str] = []

    class Counting(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            submitted.append(getattr(fn, "__name__", repr(fn)))
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(spares, "ThreadPoolExecutor", Counting)
    store = open_store(tmp_path, storage_options={"fsync": False})
    store.stage_if_absent("data/p/e000001/first.bwb", [b"x"])  # opens the spares
    before = len(submitted)
    for n in range(20):
        store.stage_if_absent(f"data/p/e000001/{n:04d}.bwb", [b"tgb"])
    assert len(submitted) - before == 20
    store.release()
    assert store.staging_files() == []


def test_a_store_keeps_spares_for_at_most_its_budget_of_files(tmp_path):
    """Many directories share the budget: fewer spares each (one at least), and the
    directory written longest ago gives its spares up beyond that."""
    from batchweave.store.spares import SpareStaging

    staging = SpareStaging(str(tmp_path), ahead=4, budget=6)

    def directory(name: str) -> str:
        (tmp_path / name / "e1").mkdir(parents=True, exist_ok=True)
        return str(tmp_path / name / "e1")

    def taken(name: str) -> int:
        """How many spares ``name`` had: take them all (and close them)."""
        count = 0
        while (spare := staging.take(directory(name))) is not None:
            os.close(spare[0])
            os.unlink(spare[1])
            count += 1
        return count

    for name in "abc":
        staging.prepare(directory(name))
    assert [taken(name) for name in "abc"] == [4, 3, 2]  # as many as the directories then allowed
    for name in "abc":
        staging.prepare(directory(name))
    assert [taken(name) for name in "abc"] == [2, 2, 2]  # 6 // 3 each
    for name in "abcdefghij":
        staging.prepare(directory(name))
    # ten directories, room for six: the four written longest ago gave theirs up
    assert [taken(name) for name in "abcdefghij"] == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    staging.discard()
    assert not list(tmp_path.glob("*/.next#*"))


def test_a_durable_put_waits_for_staged_objects_while_another_put_is_waiting_for_them(tmp_path, monkeypatch):
    """Regression: the second of two durable puts found the staged fsyncs already taken by
    the first (still waiting for them) and went ahead, naming an object not yet durable."""
    from batchweave.testing.interleave import Background

    held = HeldSyncs(monkeypatch)
    store = open_store(tmp_path)
    store.stage_if_absent("data/p/e000001/a.bwb", [b"tgb"])
    assert held.started.wait(10)
    first = Background(store.put_if_absent, "_log/00000000000000000001.json", b"{}")
    second = Background(store.put_if_absent, "_log/00000000000000000002.json", b"{}")
    try:
        assert not second.finished.wait(0.5), "a durable put went ahead of a staged object's fsync"
        assert store.size("_log/00000000000000000002.json") is None
    finally:
        held.released.set()
        store.release()
    first.result(10)
    second.result(10)
    assert held.synced == ["a.bwb"]


def test_objects_staged_during_an_fsync_are_synced_together_and_a_durable_put_waits_for_all(tmp_path, monkeypatch):
    """The fsync thread takes what was staged since its last pass together: it starts the
    writeback of each, then fsyncs each (fewer journal commits than one after another),
    and a durable put waits for the last of them."""
    from batchweave.store import syncs
    from batchweave.testing.interleave import Background

    held = HeldSyncs(monkeypatch)
    events: list[str] = []
    real_start = syncs.start_writeback
    held_sync = syncs.fsync_file
    monkeypatch.setattr(
        syncs, "start_writeback", lambda path: (events.append(f"start {os.path.basename(path)}"), real_start(path))
    )
    monkeypatch.setattr(
        syncs, "fsync_file", lambda path: (held_sync(path), events.append(f"sync {os.path.basename(path)}"))
    )
    store = open_store(tmp_path)
    store.stage_if_absent("data/p/e000001/a.bwb", [b"a"])
    assert held.started.wait(10)  # the first pass holds a's fsync
    store.stage_if_absent("data/p/e000001/b.bwb", [b"b"])
    store.stage_if_absent("data/p/e000001/c.bwb", [b"c"])
    committing = Background(store.put_if_absent, "_log/00000000000000000001.json", b"{}")
    try:
        assert not committing.finished.wait(0.5), "a durable put went ahead of staged objects' fsyncs"
    finally:
        held.released.set()
    committing.result(10)
    assert held.synced == ["a.bwb", "b.bwb", "c.bwb"]
    # b and c in one pass: both writebacks started before either fsync
    assert events == ["start a.bwb", "sync a.bwb", "start b.bwb", "start c.bwb", "sync b.bwb", "sync c.bwb"]
    store.release()


def test_spares_for_objects_at_the_top_of_a_namespace_stay_inside_it(tmp_path):
    """Spares go one directory up from the objects, but never above the namespace."""
    from batchweave.store.spares import SPARES_AHEAD

    store = open_store(tmp_path / "ns")
    store.stage_if_absent("a.bwb", [b"first"])
    deadline = time.monotonic() + 10
    while len(store.staging_files()) < SPARES_AHEAD:
        assert time.monotonic() < deadline, "no staging files were opened ahead"
        time.sleep(0.01)
    store.stage_if_absent("b.bwb", [b"second"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ns"]
    assert bytes(store.get("b.bwb")) == b"second"
    store.release()
    assert store.staging_files() == []


def test_the_first_object_of_a_new_epoch_goes_into_a_spare_opened_for_the_last(tmp_path):
    """Spares sit one directory up, so those opened for epoch 1's objects serve epoch 2's
    first one too: its directory is made before the link, instead of the link failing and
    the object being written a second time into a file of its own."""
    from batchweave.store.spares import SPARES_AHEAD

    store = open_store(tmp_path)
    store.stage_if_absent("data/p/e000001/a.bwb", [b"first"])
    deadline = time.monotonic() + 10
    while len(store.staging_files()) < SPARES_AHEAD:
        assert time.monotonic() < deadline, "no staging files were opened ahead"
        time.sleep(0.01)
    opened_ahead = {os.stat(tmp_path / info.key).st_ino for info in store.staging_files()}
    store.stage_if_absent("data/p/e000002/b.bwb", [b"new epoch"])
    assert os.stat(tmp_path / "data/p/e000002/b.bwb").st_ino in opened_ahead
    assert bytes(store.get("data/p/e000002/b.bwb")) == b"new epoch"
    store.put_if_absent("_log/00000000000000000001.json", b"{}")  # fsyncs the new directory's parent too
    store.release()
    assert store.staging_files() == []


def test_an_unexpected_error_in_the_background_fsync_fails_the_commit_instead_of_hanging_it(tmp_path, monkeypatch):
    """Any error the background pass meets is the object's NotDurableError: escaping the
    pass, it would leave every later durable put waiting for an object never counted."""
    from batchweave.store import syncs

    def broken(path):
        raise RuntimeError("not an OSError")

    monkeypatch.setattr(syncs, "fsync_file", broken)
    store = open_store(tmp_path)
    store.stage_if_absent("data/p/e000001/a.bwb", [b"tgb"])
    with pytest.raises(bw.NotDurableError, match=r"data/p/e000001/a\.bwb: could not make the object durable"):
        store.put_if_absent("_log/00000000000000000001.json", b"{}")
    assert store.size("_log/00000000000000000001.json") is None
    store.release()
