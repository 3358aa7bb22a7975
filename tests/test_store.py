"""One storage conformance suite, the same test bodies on every backend."""

from __future__ import annotations

import multiprocessing
import os
import pickle  # only to prove the Store handle crosses processes; never used on data
import re
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from obstore import exceptions as obs_errors
from obstore_errors import obstore_status_message

import batchweave as bw
from batchweave.store import Store, open_store
from batchweave.store import core as store_core


# The conformance suite also runs on moto, a second S3 server (the other modules use the
# four backends of conftest's backend_url).
@pytest.fixture
def backend_url(store_backend_url):
    return store_backend_url


@pytest.fixture
def process_backend_url(store_process_backend_url):
    return store_process_backend_url


def test_create_only_put_conflicts_on_the_second_write(backend_url):
    store = open_store(backend_url)
    store.put_if_absent("a/b.bin", b"first")
    with pytest.raises(bw.ObjectExistsError, match="a/b.bin") as info:
        store.put_if_absent("a/b.bin", b"second")
    assert isinstance(info.value, FileExistsError)
    assert bytes(store.get("a/b.bin")) == b"first"


def test_racing_create_only_puts_have_exactly_one_winner(backend_url):
    """The commit protocol's one assumption about a store; plain moto breaks it about once
    in 30 keys under 8 racing writers (see batchweave.testing.moto_server)."""
    store = open_store(backend_url)
    writers, keys, keys_at_once = 8, 50, 10

    def attempt(key: str, writer: int) -> int:
        try:
            store.put_if_absent(key, f"writer {writer}".encode() * 30_000)
        except bw.ObjectExistsError:
            return 0
        return writer + 1  # who won, 1-based

    # Several keys race at once: SeaweedFS makes each loser of a key wait for the winner's
    # lock in steps of 1 s, so one key at a time would take ~100 s there. The writers of
    # one key are queued next to each other and start together.
    with ThreadPoolExecutor(writers * keys_at_once) as pool:
        races = {
            f"race/{index}": [pool.submit(attempt, f"race/{index}", writer) for writer in range(writers)]
            for index in range(keys)
        }
        for key, attempts in races.items():
            winners = [w for w in (a.result() for a in attempts) if w]
            assert len(winners) == 1, f"{key}: writers {winners} all succeeded"
            assert bytes(store.get(key)) == f"writer {winners[0] - 1}".encode() * 30_000


def test_get_range_size_list_and_delete(backend_url):
    store = open_store(backend_url)
    body = bytes(range(256)) * 40
    store.put_if_absent("data/x/1.bwb", body)
    store.put_if_absent("data/y/2.bwb", b"tiny")
    store.put_if_absent("_log/00000000000000000001.json", b"{}")
    assert bytes(store.get_range("data/x/1.bwb", 1000, 300)) == body[1000:1300]
    assert bytes(store.get_range("data/x/1.bwb", 0, 0)) == b""
    assert store.size("data/x/1.bwb") == len(body)
    assert store.size("data/missing") is None
    assert sorted((o.key, o.size) for o in store.list("data/")) == [("data/x/1.bwb", len(body)), ("data/y/2.bwb", 4)]
    assert len(list(store.list())) == 3
    store.delete("data/y/2.bwb")
    store.delete("data/y/2.bwb")  # idempotent
    assert [o.key for o in store.list("data/")] == ["data/x/1.bwb"]


def test_missing_objects_raise_file_not_found(backend_url):
    store = open_store(backend_url)
    with pytest.raises(bw.ObjectNotFoundError, match="nope/x") as info:
        store.get("nope/x")
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(bw.ObjectNotFoundError):
        store.get_range("nope/x", 0, 10)


def test_staged_pieces_are_one_object_put_create_only(backend_url):
    """``stage_if_absent`` of pieces (a producer's TGB object: headers and the arrays' own
    memory) makes one object of them back to back, and only once."""
    store = open_store(backend_url)
    array = np.arange(1000, dtype=np.int32)
    key = "data/p/e000001/000000000000-ab.0.bwb"
    store.stage_if_absent(key, [b"head:", array.data.cast("B"), b":tail"])
    with pytest.raises(bw.ObjectExistsError, match=key):
        store.stage_if_absent(key, [b"second"])
    store.wait_staged()
    assert bytes(store.get(key)) == b"head:" + array.tobytes() + b":tail"


def test_an_object_store_is_given_the_pieces_themselves_not_a_joined_copy(monkeypatch):
    """Regression (issue 44): the pieces were joined into one buffer before the put, a copy
    of every byte of every TGB. obstore takes them as they are, in one create-only PUT."""
    given: list = []
    real_put = store_core.obstore.put

    def spy(store, path, file, **options):
        given.append((file, options))
        return real_put(store, path, file, **options)

    monkeypatch.setattr(store_core.obstore, "put", spy)
    store = open_store(f"memory://pieces-{uuid.uuid4().hex}")
    array = np.arange(1000, dtype=np.int32)
    pieces = [b"head:", array.data.cast("B")]
    store.stage_if_absent("data/p/e000001/x.bwb", pieces)
    ((file, options),) = given
    assert file is pieces and file[1].obj is array  # the array's own memory reaches obstore
    assert options["mode"] == "create" and options["use_multipart"] is False
    assert bytes(store.get("data/p/e000001/x.bwb")) == b"head:" + array.tobytes()


def test_overwrite_put_is_only_for_hints(backend_url):
    store = open_store(backend_url)
    store.put("_log/_last_snapshot.json", b"1")
    store.put("_log/_last_snapshot.json", b"2")
    assert bytes(store.get("_log/_last_snapshot.json")) == b"2"


def _read_in_child(store: Store, key: str, queue) -> None:
    try:
        queue.put(bytes(store.get(key)))
    except bw.BatchWeaveError as exc:
        queue.put(f"{type(exc).__name__}: {exc}")


def _fork_and_read(store: Store, key: str):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(store, key, queue))
    child.start()
    result = queue.get(timeout=30)
    child.join(30)
    return result


def test_store_handle_is_picklable(backend_url):
    store = open_store(backend_url)
    store.put_if_absent("k", b"v")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url and bytes(clone.get("k")) == b"v"


def test_forked_children_read_or_fail_fast(process_backend_url, tmp_path):
    """Fork before the parent's first request works; after it, the child gets a clear
    error instead of hanging in obstore's inherited (dead) I/O runtime."""
    writer = f"""
import multiprocessing, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from batchweave.store import open_store
from test_store import _fork_and_read
store = open_store({process_backend_url!r})
print(_fork_and_read(store, "k"))
store.size("k")
print(_fork_and_read(store, "k"))
"""
    open_store(process_backend_url).put_if_absent("k", b"v")
    out = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0] == "b'v'", out.stderr
    assert lines[1].startswith("ConfigError") and "runtime does not survive fork()" in lines[1]


def test_transient_errors_are_retried_then_reported(monkeypatch):
    import obstore

    # A memory store (a local directory reads without obstore), with a short deadline.
    store = open_store(f"memory://retries-{uuid.uuid4().hex}", storage_options={"retry_deadline_s": 0.5})
    store.put_if_absent("k", b"v")
    real_get = obstore.get
    calls = []

    def flaky(handle, key, **kw):
        calls.append(key)
        if len(calls) <= 2:
            _always_503()
        return real_get(handle, key, **kw)

    monkeypatch.setattr(obstore, "get", flaky)
    assert bytes(store.get("k")) == b"v" and len(calls) == 3
    calls.clear()
    monkeypatch.setattr(obstore, "get", lambda *a, **k: _always_503())
    with pytest.raises(bw.TransientStoreError, match="store unavailable after retries") as info:
        store.get("k")
    assert isinstance(info.value, ConnectionError)
    assert re.search(
        r"still failing after 0\.\d s and \d+ attempts \(storage option retry_deadline_s=0.5\)", str(info.value)
    )
    assert info.value.retried_s >= 0.5


def _always_503():
    raise obs_errors.GenericError(obstore_status_message("k", 503, method="GET", code="SlowDown"))


def test_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_store("relative/dir").url == "file://" + str(tmp_path / "relative" / "dir")
    assert open_store(tmp_path).url == "file://" + str(tmp_path)
    assert open_store(f"file://{tmp_path}/").url == "file://" + str(tmp_path)
    assert open_store("s3://bucket/prefix/").url == "s3://bucket/prefix"
    with pytest.raises(bw.ConfigError, match="unsupported namespace URL"):
        open_store("ftp://host/x")
    with pytest.raises(bw.ConfigError, match="empty namespace URL"):
        open_store("")
    local = open_store(tmp_path / "made")
    local.put_if_absent("x", b"1")
    assert os.path.isfile(tmp_path / "made" / "x")


# Names a plain path may hold that a URL parser would cut or read as escapes.
ODD_NAMES = ["my run", "exp#1", "exp?x=1", "100%", "100%25", "ünïcødé", "a b#c?d%20e"]


def test_a_plain_path_is_taken_literally(tmp_path, monkeypatch):
    """`exp#1` and `exp#2` were both the directory `exp` (a URL fragment cut them)."""
    monkeypatch.chdir(tmp_path)
    for name in ODD_NAMES:
        open_store(name).put_if_absent("data/k", name.encode())
        assert (tmp_path / name / "data" / "k").read_bytes() == name.encode(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(ODD_NAMES)


def test_a_file_url_is_percent_decoded_and_names_the_same_directory_as_its_path(tmp_path):
    """`Path("my run").as_uri()` made a directory literally named `my%20run`."""
    for name in ODD_NAMES:
        directory = tmp_path / name
        store = open_store(directory.as_uri())
        store.put_if_absent("data/k", name.encode())
        assert (directory / "data" / "k").read_bytes() == name.encode(), name
        assert open_store(directory).url == store.url  # one directory, one URL
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(ODD_NAMES)  # no my%20run
    # Typed by hand, '#' and '?' are still characters of the path, not a fragment or query.
    assert open_store(f"file://{tmp_path}/exp#1").url == open_store(tmp_path / "exp#1").url
    assert open_store(f"file://{tmp_path}/exp?x=1").url == open_store(tmp_path / "exp?x=1").url


def test_a_local_store_url_round_trips_through_store_and_pickle(tmp_path):
    for name in ODD_NAMES:
        store = open_store(tmp_path / name)
        store.put_if_absent("data/k", name.encode())
        assert store.url.startswith("file:///") and not {" ", "#", "?"} & set(store.url), store.url
        for again in (Store(store.url), open_store(store.url), pickle.loads(pickle.dumps(store))):
            assert again.url == store.url
            # A fresh handle: its first request and listing go through obstore's LocalStore.
            assert [o.key for o in again.list()] == ["data/k"] and bytes(again.get("data/k")) == name.encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(ODD_NAMES)


def test_memory_stores_are_shared_by_name():
    open_store("memory://shared-name").put_if_absent("k", b"v")
    assert bytes(open_store("memory://shared-name").get("k")) == b"v"
    assert open_store("memory://other-name").size("k") is None


# -- the conditional-put probe -----------------------------------------------------------


class CountingStore(Store):
    """Records every request the store makes (the hook a simulated store uses)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[str] = []

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self.requests = []

    def _perform(self, request, nbytes, op):
        self.requests.append(request)
        return super()._perform(request, nbytes, op)


@pytest.fixture
def fresh_probe_cache(monkeypatch):
    """An empty probe cache, as in a new process (other tests probe the same buckets)."""
    monkeypatch.setattr(store_core, "_create_only_checked", {})


def test_require_create_only_passes_once_per_store_root(backend_url, fresh_probe_cache):
    store = CountingStore(backend_url)
    store.require_create_only()
    if backend_url.startswith(("memory:", "file:")):
        assert store.requests == []  # create-only by construction: no request
    else:
        assert store.requests == ["put", "put", "delete"]
    assert list(open_store(backend_url).list("_probe/")) == []  # the probe key is gone
    probed = list(store.requests)
    store.require_create_only()
    sibling = CountingStore(backend_url + "-sibling")  # another namespace in the same bucket
    sibling.require_create_only()
    assert store.requests == probed and sibling.requests == []


def _probe_in_child(store: CountingStore) -> list[str]:
    store.require_create_only()
    return store.requests


@pytest.mark.parametrize("store_backend_url", ["s3"], indirect=True)
def test_require_create_only_probes_again_in_another_process(backend_url, fresh_probe_cache):
    store = CountingStore(backend_url)
    store.require_create_only()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_probe_in_child, (store,)) == ["put", "put", "delete"]
    store.require_create_only()
    assert store.requests == ["put", "put", "delete"]


@pytest.mark.s3rver
def test_require_create_only_refuses_a_store_that_ignores_conditional_puts(s3rver_url, fresh_probe_cache):
    store = CountingStore(s3rver_url)
    with pytest.raises(bw.ConfigError, match=r"If-None-Match") as info:
        store.require_create_only()
    message = str(info.value)
    assert s3rver_url in message and "not honoured" in message and "racing commits would both win" in message
    assert "SeaweedFS" in message  # says what to use instead
    assert store.requests == ["put", "put", "delete"] and list(open_store(s3rver_url).list("_probe/")) == []
    with pytest.raises(bw.ConfigError, match=r"If-None-Match"):
        CountingStore(s3rver_url + "-sibling").require_create_only()  # the verdict is cached too
    assert store.requests == ["put", "put", "delete"]


@pytest.mark.s3rver
def test_producer_refuses_a_store_that_ignores_conditional_puts(s3rver_url, fresh_probe_cache):
    # wired by journal: the producer calls Store.require_create_only before its first write.
    with pytest.raises(bw.ConfigError, match=r"If-None-Match"):
        bw.Producer(s3rver_url, "p", dp=1)


@pytest.mark.seaweedfs
@pytest.mark.parametrize("store_backend_url", ["seaweedfs"], indirect=True)
def test_real_denied_conditional_put_of_a_409_key_is_a_permission_error(backend_url, monkeypatch):
    """A 403 whose message names `_log/...409.json` once read as a lost race."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = Store(backend_url, max_attempts=1)
    with pytest.raises(bw.StorePermissionError, match="access denied") as info:
        store.put_if_absent("_log/00000000000000000409.json", b"{}")
    assert not isinstance(info.value, bw.ObjectExistsError)


def test_local_reads_take_the_fast_path_and_agree_with_obstore(monkeypatch, tmp_path):
    """A local directory is read with os.pread (3x cheaper than obstore's local reads);
    the bytes, the misses and short ranges are what obstore gives."""
    import obstore

    store = open_store(tmp_path)
    body = bytes(range(256)) * 40
    store.put_if_absent("data/p/e000001/a.bwb", body)
    store.put_if_absent("odd key%20.bin", body)  # a key obstore encodes on disk: not the fast path
    reads = []
    monkeypatch.setattr(obstore, "get_range", lambda *a, **k: reads.append(a[1]) or b"x")
    assert bytes(store.get_range("data/p/e000001/a.bwb", 100, 500)) == body[100:600]
    assert bytes(store.get("data/p/e000001/a.bwb")) == body
    assert bytes(store.get_range("data/p/e000001/a.bwb", len(body) - 10, 50)) == body[-10:]  # short: fewer bytes
    with pytest.raises(bw.ObjectNotFoundError):
        store.get_range("data/p/e000001/missing.bwb", 0, 10)
    with pytest.raises(bw.ObjectNotFoundError):
        store.get("_log/00000000000000000007.json")
    assert reads == []
    store.get_range("odd key%20.bin", 0, 1)
    assert reads == ["odd key%20.bin"]


def test_threads_that_ask_for_the_client_at_once_share_one(monkeypatch):
    # A reader's first fetch threads all need the client at once: each used to build its own.
    built, release, cond = [], threading.Event(), threading.Condition()

    def build(*args):
        with cond:
            built.append(object())
            cond.notify_all()
        release.wait(30)
        return built[-1]

    monkeypatch.setattr(store_core, "build_backend", build)
    store = Store("memory://one-client")
    with ThreadPoolExecutor(8) as pool:
        handles = [pool.submit(lambda: store._store) for _ in range(8)]
        with cond:  # while the first build is held, no second one starts
            second = cond.wait_for(lambda: len(built) > 1, timeout=1.0)
        release.set()
        assert not second, f"{len(built)} clients built"
        assert {id(handle.result()) for handle in handles} == {id(built[0])}
    assert len(built) == 1


def _pieces(count: int) -> list[bytes]:
    rng = np.random.default_rng(count)
    return [rng.integers(0, 255, int(rng.integers(1, 40)), dtype=np.uint8).tobytes() for _ in range(count)]


def test_an_object_of_more_pieces_than_one_writev_takes_goes_in_a_writev_per_batch(tmp_path, monkeypatch):
    """A pack of 16 TGBs of 32 slices is about 1,600 pieces, past the 1,024 one writev
    takes. They go 1,024 at a time, nothing done per piece in Python (before, every piece
    past the first batch was viewed, counted and popped from the front of a list: a
    fifth of a 32-producer group commit run's CPU at 100 KB)."""
    from batchweave.store import localfs

    calls: list[int] = []
    viewed: list[object] = []  # buffers handed over as anything but the caller's own
    writev = os.writev

    def counted(fd, buffers):
        calls.append(len(buffers))
        viewed.extend(b for b in buffers if type(b) is not bytes)
        return writev(fd, buffers)

    monkeypatch.setattr(localfs.os, "writev", counted)
    store = open_store(tmp_path.as_uri(), storage_options={"fsync": False})
    pieces = _pieces(3000)
    store.stage_if_absent("data/p/e000001/x.bwb", pieces)
    assert bytes(store.get("data/p/e000001/x.bwb")) == b"".join(pieces)
    assert calls == [1024, 1024, 952]
    assert not viewed, f"{len(viewed)} pieces were viewed in Python before the kernel got them"


def test_a_writev_that_stops_short_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """A signal or a full disk may cut a writev short, in the middle of a piece: the rest
    follows, byte for byte, whatever the number of pieces."""
    from batchweave.store import localfs

    writev = os.writev

    def short(fd, buffers):  # at most 1,000 bytes a call
        cut, left = [], 1000
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            cut.append(view[:left])
            left -= len(cut[-1])
            if left == 0:
                break
        return writev(fd, cut)

    monkeypatch.setattr(localfs.os, "writev", short)
    store = open_store(tmp_path.as_uri(), storage_options={"fsync": False})
    for count in (1, 50, 2500):
        pieces = _pieces(count)
        store.stage_if_absent(f"data/p/e000001/{count}.bwb", pieces)
        assert bytes(store.get(f"data/p/e000001/{count}.bwb")) == b"".join(pieces)
