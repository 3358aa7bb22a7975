"""The latency store: its model, its faults, and the protocol surviving them (chaos)."""

from __future__ import annotations

import pickle  # only to prove the store handle crosses processes; never used on data
import threading
import time
import uuid

import pytest
from checks import assert_exactly_once, assert_referenced_objects_exist
from worker import Eager, digest, origin_of, tgb

import batchweave as bw
from batchweave import keys
from batchweave.latency import CLOUD_DEFAULTS, GrowingManifest, LatencyModel, LatencyStore, _is_version_key
from batchweave.store import Store

FAST = LatencyModel(put_s=0.002, first_byte_s=0.001, head_s=0.001, list_s=0.001, delete_s=0.001, jitter_sigma=0.0)


def fresh(model=FAST, **kw) -> LatencyStore:
    return LatencyStore(f"memory://latency-{uuid.uuid4().hex}", model, seed=7, **kw)


def test_model_closed_form():
    model = LatencyModel(put_s=0.04, first_byte_s=0.025, bandwidth_bytes_s=100e6)
    assert model.base_s("put", 1_000_000) == pytest.approx(0.04 + 0.01)
    assert model.base_s("get", 0) == pytest.approx(0.025)
    assert CLOUD_DEFAULTS.to_dict()["bandwidth_bytes_s"] == 90e6
    with pytest.raises(bw.ConfigError, match="fault rates"):
        LatencyModel(error_rate=1.5)
    with pytest.raises(bw.ConfigError, match="positive bandwidth"):
        LatencyModel(bandwidth_bytes_s=0)


def test_requests_take_the_modelled_time():
    model = LatencyModel(put_s=0.05, first_byte_s=0.03, jitter_sigma=0.0, bandwidth_bytes_s=1e9)
    store = fresh(model)
    started = time.perf_counter()
    store.put_if_absent("k", b"x" * 1000)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    store.get("k")
    get_s = time.perf_counter() - started
    assert 0.05 <= put_s < 0.5 and 0.03 <= get_s < 0.5
    assert store.requests == {"put": 1, "get": 1}


def test_staged_pieces_are_one_modelled_put_that_nothing_joins_first(monkeypatch):
    """A TGB's pieces are staged as a real store takes them: one put of the pieces, its
    time modelled on their bytes, and no ``bytes.join`` before it (a join no real store
    makes cost an 800 KB TGB 0.8 ms here); a discarded data key still costs its bytes."""
    model = LatencyModel(put_s=0.0, first_byte_s=0.0, jitter_sigma=0.0, bandwidth_bytes_s=1e6)
    pieces = [memoryview(b"a" * 30_000), memoryview(b"b" * 20_000)]
    joined = []
    store = fresh(model)
    with monkeypatch.context() as patched:  # the path that joins the pieces goes through put_if_absent
        patched.setattr(LatencyStore, "put_if_absent", lambda *_: pytest.fail("the pieces were joined"))
        started = time.perf_counter()
        store.stage_if_absent("data/p/e000001/000000000000-t.0.bwb", pieces)
        assert time.perf_counter() - started >= 0.05  # 50 KB at 1 MB/s
    assert bytes(store.get("data/p/e000001/000000000000-t.0.bwb")) == b"a" * 30_000 + b"b" * 20_000
    assert store.requests == {"put": 1, "get": 1}
    discarding = fresh(model, discard_prefix="data/")
    started = time.perf_counter()
    discarding.stage_if_absent("data/p/e000001/000000000001-t.0.bwb", pieces, 50_000)
    assert time.perf_counter() - started >= 0.05 and discarding.requests == {"put": 1}

    class Intercepting(LatencyStore):
        def put_if_absent(self, key, data):
            joined.append(bytes(data))
            super().put_if_absent(key, data)

    Intercepting(f"memory://latency-{uuid.uuid4().hex}", FAST).stage_if_absent("data/x.bwb", pieces)
    assert joined == [b"a" * 30_000 + b"b" * 20_000]  # a subclass that intercepts puts sees this one whole


def test_injected_faults_go_through_the_retry_path():
    store = fresh(LatencyModel(put_s=0, first_byte_s=0, head_s=0, jitter_sigma=0, error_rate=0.5), max_attempts=20)
    for i in range(20):
        store.put_if_absent(f"k{i}", b"v")  # each retried until it is applied
    assert store.requests["put"] > 20
    hopeless = fresh(LatencyModel(put_s=0, first_byte_s=0, jitter_sigma=0, error_rate=0.99), max_attempts=2)
    with pytest.raises(bw.TransientStoreError, match="SlowDown"):
        hopeless.put_if_absent("k", b"v")


def test_latency_store_pickles_with_its_model():
    store = fresh()
    clone = pickle.loads(pickle.dumps(store))
    assert (clone.url, clone.model, clone.seed) == (store.url, store.model, store.seed)


def test_protocol_survives_faults_and_ambiguous_writes():
    """Chaos: 10% failed requests and 10% writes that land but report a timeout."""
    model = LatencyModel(
        put_s=0.002, first_byte_s=0.001, head_s=0.001, jitter_sigma=0.5, error_rate=0.1, ambiguous_rate=0.1
    )
    store = fresh(model, max_attempts=30)
    counts = {"a": 25, "b": 25, "c": 25}

    def produce(producer_id, count):
        with bw.Producer(store, producer_id, dp=2, commit_policy=Eager()) as producer:
            for offset in range(count):
                producer.append(tgb(producer_id, offset, 2))

    threads = [threading.Thread(target=produce, args=item) for item in counts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bw.end_stream(store)
    clean = Store(store.url)  # judge the result without faults
    assert_exactly_once(clean.url, counts)
    assert_referenced_objects_exist(clean.url)
    with bw.Consumer(store, dp=2, rank=1, timeout_s=30) as consumer:
        seen = [(b.step, origin_of(b.data), digest(b.data)) for b in consumer]
    assert [s for s, _, _ in seen] == list(range(75))
    assert all(d == digest(tgb(p, o, 2)[1]) for _, (p, o), d in seen)


def test_a_growing_manifest_charges_each_commit_the_whole_list_read_and_written():
    manifest = GrowingManifest(entry_bytes=100, history_tgbs=10)
    assert manifest.commit_bytes(0, 0) == 2 * 10 * 100  # a claim still reads and rewrites the list
    assert manifest.commit_bytes(5, 3) == (2 * 15 + 3) * 100
    with pytest.raises(bw.ConfigError, match="entry_bytes"):
        GrowingManifest(entry_bytes=0)
    store = fresh(manifest=manifest)
    assert pickle.loads(pickle.dumps(store)).manifest == manifest  # ingest workers are other processes


def test_only_log_versions_pay_the_manifest():
    assert _is_version_key(keys.version_key(7))
    for key in (keys.snapshot_key(7), keys.HINT_KEY, keys.head_copy_key(7, 0), "data/p/e000001/x.bwb"):
        assert not _is_version_key(key), key


def test_the_manifest_cost_falls_inside_each_commits_fragile_window():
    def window(manifest):
        store = fresh(LatencyModel(**{**FAST.to_dict(), "bandwidth_bytes_s": 1e8}), manifest=manifest)
        with bw.Producer(store, "p", dp=2, commit_policy=bw.Manual(), background_commit=False, pack_steps=1) as p:
            p.append([b"a", b"b"])
            p.flush()
            return p.metrics()["last_fragile_window_s"]

    # 10,000 TGBs of 1 KB: 20 MB read and written at 100 MB/s, 0.2 s on top of a few ms.
    assert window(GrowingManifest(entry_bytes=1000, history_tgbs=10_000)) >= 0.2 > 4 * window(None)
