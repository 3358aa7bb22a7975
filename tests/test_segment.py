"""Log segments: 32 versions copied into one object by the committer of the last one, so
a reader behind the head needs one request per 32 steps instead of 32. Best effort on
both sides: a missing or damaged segment costs time, never a step."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib

import msgspec
import pytest

import batchweave as bw
from batchweave import keys, log
from batchweave.commit.policies import Manual
from batchweave.errors import CorruptDataError
from batchweave.journal import Journal
from batchweave.latency import LatencyModel, LatencyStore
from batchweave.reading.readahead import LogReadAhead
from batchweave.segment import SEGMENT_VERSIONS, decode_segment, encode_segment, segment_key, segment_last
from batchweave.store import Store, open_store
from batchweave.testing import versiontext

NO_LATENCY = LatencyModel(put_s=0, first_byte_s=0, head_s=0, list_s=0, delete_s=0, jitter_sigma=0)


class CountingStore(LatencyStore):
    """The latency model (no latency: a remote store, so reads go ahead in threads) that
    counts reads by kind: log versions, segments, everything else."""

    def __init__(self, url: str) -> None:
        super().__init__(url, NO_LATENCY)
        self.reads = {"version": 0, "segment": 0, "other": 0}
        self._count_lock = threading.Lock()

    def get(self, key: str):
        kind = "segment" if key.endswith(".json.z") else "version" if _is_version(key) else "other"
        with self._count_lock:
            self.reads[kind] += 1
        return super().get(key)

    def get_range(self, key: str, start: int, length: int):
        with self._count_lock:
            self.reads["other"] += 1
        return super().get_range(key, start, length)


def _is_version(key: str) -> bool:
    name = key.removeprefix(keys.LOG_PREFIX)
    return "/" not in name and name.endswith(".json") and name[:-5].isdigit()


def commit_versions(store: Store | str, count: int, producer_id: str = "p") -> None:
    """A claim, then ``count`` versions of one TGB each."""
    with bw.Producer(store, producer_id, dp=2, commit_policy=Manual()) as producer:
        for offset in range(producer.resume_offset, producer.resume_offset + count):
            producer.append([b"a%d" % offset, b"b%d" % offset], source_offset=offset)
            producer.flush()


def read_all(reader: LogReadAhead) -> list[int]:
    versions = []
    while (read := reader.next()) is not None:
        versions.append(read.delta.version)
    return versions


@pytest.fixture
def url() -> str:
    return f"memory://segment-{uuid.uuid4().hex}"


# -- the format ----------------------------------------------------------------------------


def _versions_bytes(store: Store, last: int) -> list[bytes]:
    return [bytes(store.get(keys.version_key(v))) for v in range(last - SEGMENT_VERSIONS + 1, last + 1)]


def test_the_committer_of_a_segments_last_version_writes_it_byte_for_byte(url):
    commit_versions(url, 40)  # versions 1..41
    store = open_store(url)
    raw = _versions_bytes(store, 32)
    versions = decode_segment(store.get(segment_key(32)), 32)
    assert [v.delta.version for v in versions] == list(range(1, 33))
    assert [log.encode(v.delta) for v in versions] == raw  # the same versions, not a re-encoding that may drift
    assert [bytes(v.data) for v in versions] == raw  # and each one's bytes as the log holds them
    assert store.size(segment_key(64)) is None  # version 64 is not committed yet


def test_segment_keys_and_bounds():
    assert [segment_last(v) for v in (1, 32, 33, 64, 65)] == [32, 32, 64, 64, 96]
    assert segment_key(64) == "_log/_segments/00000000000000000064.json.z"
    with pytest.raises(ValueError, match="a segment is versions 33..64"):
        encode_segment(64, [b"{}"] * 3)


def _damaged(store: Store) -> dict[str, bytes]:
    raw = _versions_bytes(store, 32)
    good = msgspec.json.decode(zlib.decompress(bytes(store.get(segment_key(32)))))
    shifted = dict(good, versions=good["versions"][1:] + good["versions"][:1])
    return {
        "damaged log segment": b"not zlib at all",
        "damaged log segment: ": zlib.compress(b'{"format": "batchweave.segment/1"'),
        "unsupported segment format": zlib.compress(msgspec.json.encode(dict(good, format="batchweave.segment/9"))),
        "its name says 1..32": zlib.compress(msgspec.json.encode(shifted)),
        "2 slices for dp=3": encode_segment(32, [*raw[:-1], _with_dp(raw[-1], 3)]),
    }


def _with_dp(version: bytes, dp: int) -> bytes:
    fields = versiontext.loads(version)
    fields["tgbs"][0]["dp"] = dp
    return versiontext.dumps(fields)


def test_a_damaged_segment_is_refused_naming_its_key(url):
    commit_versions(url, 33)
    store = open_store(url)
    for problem, data in _damaged(store).items():
        with pytest.raises(CorruptDataError, match=problem) as caught:
            decode_segment(data, 32)
        assert caught.value.key == segment_key(32)


def test_a_writer_without_every_version_of_the_segment_writes_none(url):
    commit_versions(url, 31)  # versions 1..32, segment 32 written by the committer
    store = open_store(url)
    store.delete(segment_key(32))
    assert Journal(store).write_segment(32) is False  # a fresh journal has read nothing
    assert store.size(segment_key(32)) is None
    journal = Journal(store)
    journal.load_state()  # reads versions 1..32 (no snapshot yet)
    assert journal.write_segment(32) is True
    assert decode_segment(store.get(segment_key(32)), 32)[-1].delta.version == 32


# -- reading -------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [64, 1])
def test_a_backlog_is_read_by_segments(url, depth):
    store = CountingStore(url)
    with store.paused():
        commit_versions(store, 95)  # versions 1..96: three segments
    store.reads = dict.fromkeys(store.reads, 0)
    reader = LogReadAhead(Journal(store), 1, depth=depth)
    try:
        assert read_all(reader) == list(range(1, 97))
    finally:
        reader.close()
    # Three segments, then the missing fourth (and those up to depth versions past it, read
    # ahead with it); single probes only inside the missing one's range (97..128).
    assert 4 <= store.reads["segment"] <= 4 + depth // SEGMENT_VERSIONS
    assert 1 <= store.reads["version"] <= SEGMENT_VERSIONS


@pytest.mark.parametrize("depth", [64, 1])
def test_a_missing_or_damaged_segment_is_read_around(url, depth, caplog):
    store = CountingStore(url)
    commit_versions(store, 95)
    store.delete(segment_key(32))
    store.delete(segment_key(64))
    store.put(segment_key(64), b"damaged")
    reader = LogReadAhead(Journal(store), 1, depth=depth)
    with caplog.at_level(logging.WARNING, logger="batchweave.journal"):
        try:
            assert read_all(reader) == list(range(1, 97))
        finally:
            reader.close()
    assert segment_key(64) in caplog.text
    assert store.reads["version"] >= 64  # the first two segments' versions one by one


def test_a_reader_following_the_head_reads_no_segment(url):
    store = CountingStore(url)
    commit_versions(store, 2, "first")
    reader = LogReadAhead(Journal(store), 1, depth=64)
    try:
        read_all(reader)
        store.reads = dict.fromkeys(store.reads, 0)
        for index in range(6):  # one commit at a time, each read as it lands
            commit_versions(store, 1, f"next{index}")  # a claim and a commit: two versions
            assert reader.next() is not None and reader.next() is not None
            assert reader.next() is None
        # Two versions found in a row count as a backlog: at most one segment probe each time.
        assert store.reads["segment"] <= 6
    finally:
        reader.close()


def test_a_consumer_reads_a_one_tgb_per_version_backlog_in_about_one_request_per_step(url):
    store = CountingStore(url)
    with store.paused():
        commit_versions(store, 320)
    bw.end_stream(store)
    store.reads = dict.fromkeys(store.reads, 0)
    with bw.Consumer(store, dp=2, rank=1, timeout_s=30) as consumer:
        steps = [bytes(batch.data) for batch in consumer]
    assert steps == [b"b%d" % offset for offset in range(320)]
    requests = sum(store.reads.values())
    # One range read per step, one segment per 32 versions, and one proof (I10) per batch of
    # versions: batches end where a read is still in flight, so their number varies a little.
    assert requests / 320 <= 1.15, store.reads


# -- garbage collection --------------------------------------------------------------------


def test_collection_deletes_the_segments_of_reclaimed_versions_only(tmp_path):
    url = str(tmp_path / "ns")
    commit_versions(url, 140)  # versions 1..141: segments 32..128, a snapshot at 100
    cursors = []
    for rank in (0, 1):
        with bw.Consumer(url, dp=2, rank=rank, timeout_s=10) as consumer:
            for _ in range(130):
                next(consumer)
            consumer.mark_checkpoint("ckpt")
            cursors.append(consumer.state_dict())
    report = bw.collect_garbage(url, grace_s=0)
    listed = sorted(info.key for info in open_store(url).list("_log/_segments/"))
    assert report.deleted_segments == 3
    assert listed == [segment_key(128)]  # versions 97..99 are gone, 100..128 are not
    with bw.Consumer(url, dp=2, rank=1, timeout_s=10) as consumer:  # a resume reads on from segment 128
        consumer.load_state_dict(cursors[1])
        assert [bytes(next(consumer).data) for _ in range(10)] == [b"b%d" % o for o in range(130, 140)]


def test_the_log_is_read_ahead_of_the_fetches_while_every_fetch_slot_is_taken(url):
    """With prefetch=2 and nothing consumed past the first step, the follower still reads
    the log on (bounded), so it knows where the backlog ends before the fetches get there."""
    store = CountingStore(url)
    with store.paused():
        commit_versions(store, 100)
    bw.end_stream(store)
    with bw.Consumer(store, dp=2, rank=0, prefetch=2, timeout_s=30) as consumer:
        next(consumer)
        deadline = time.monotonic() + 30
        while consumer.metrics().head_version < 102 and time.monotonic() < deadline:  # the end-of-stream version
            time.sleep(0.01)
        assert consumer.metrics().head_version == 102
        assert [bytes(b.data) for b in consumer] == [b"a%d" % o for o in range(1, 100)]
