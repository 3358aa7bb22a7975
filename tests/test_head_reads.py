"""A writer reads a log version's head, not its body (``LogObjects.get_head``): one ranged
GET of the first bytes holds a small version whole or a large one's head; a head longer
than that costs one more, and the next reads ask for twice it; a version of format 1 that
the first bytes do not hold is read whole. Requests counted on a real local directory."""

from __future__ import annotations

import msgspec
import pytest

from batchweave import keys, log
from batchweave.journal import Journal
from batchweave.journal.objects import LogObjects
from batchweave.log import Layout, LogVersion, ProducerState, TGBDescriptor
from batchweave.logrules import build_claim
from batchweave.store import Store


class ReadsStore(Store):
    """A real local directory that records its reads, whole or ranged, as (read, key)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []

    def get(self, key: str) -> memoryview:
        self.calls.append(("get", key))
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> memoryview:
        self.calls.append(("get_range", key))
        return super().get_range(key, start, length)


def _version(tgbs: int, producers: int = 1, form: str = log.LOG_FORMAT) -> LogVersion:
    pids = [f"producer-{i:04d}" for i in range(producers)]
    rows = [
        TGBDescriptor(
            producer=pid,
            epoch=1,
            source_offset=offset,
            dp=32,
            cp=1,
            kind="bytes",
            objects=[keys.data_key(pid, 1, offset, "ab", 0)],
            slices=[(0, i * 4096, 4096, 2**31 + i) for i in range(32)],
            nbytes=32 * 4096,
        )
        for pid in pids
        for offset in range(tgbs)
    ]
    states = {pid: ProducerState(tgbs, 1, "inc") for pid in pids}
    return LogVersion(form, 3, 0, rows, states, committed_at=1.0)


@pytest.fixture
def objects(tmp_path):
    store = ReadsStore(str(tmp_path))
    return store, LogObjects(store)


def _put(store: ReadsStore, version: LogVersion) -> tuple[str, bytes]:
    key, data = keys.version_key(version.version), log.encode(version)
    store.put_if_absent(key, data)
    store.calls.clear()
    return key, data


def test_a_short_version_is_read_whole_in_one_ranged_get(objects):
    store, reader = objects
    key, data = _put(store, _version(4))
    assert len(data) < reader.head_guess
    read, whole = reader.get_head(key)
    assert whole and bytes(read) == data
    assert store.calls == [("get_range", key)] and reader.requests == 1


def test_a_long_versions_head_is_read_in_one_ranged_get(objects):
    store, reader = objects
    key, data = _put(store, _version(400))  # 400 TGBs of 32 slices: about 400 KB of slice tables
    read, whole = reader.get_head(key)
    assert not whole and len(read) < len(data) // 50
    assert log.digest(read) == log.digest(data)
    assert log.decode_version_head(read, key, 3) == log.decode_version_head(data, key, 3)
    assert store.calls == [("get_range", key)] and reader.bytes_read == len(read)


def test_a_head_longer_than_the_first_bytes_costs_one_more_get_and_doubles_the_guess(objects):
    store, reader = objects
    key, data = _put(store, _version(2, producers=1000))  # a run and a state each: about 120 KB of head
    extent = log.head_extent(data)
    assert extent is not None and extent > reader.head_guess
    read, whole = reader.get_head(key)
    assert not whole and len(read) == extent
    assert log.decode_version_head(read, key, 3).tgb_count() == 2000
    assert store.calls == [("get_range", key), ("get_range", key)]
    assert reader.head_guess == 2 * extent
    store.calls.clear()
    reader.get_head(key)
    assert store.calls == [("get_range", key)]  # the next read asks for enough at once


def test_a_long_version_of_format_1_is_read_whole(objects):
    store, reader = objects
    key, data = _put(store, _version(400, form=log.LOG_FORMAT_1))
    read, whole = reader.get_head(key)
    assert whole and bytes(read) == data
    assert store.calls == [("get_range", key), ("get", key)] and reader.requests == 2


def test_a_missing_version_reads_as_none(objects):
    store, reader = objects
    assert reader.get_head(keys.version_key(9)) is None
    assert reader.requests == 1


def test_a_head_whose_object_is_cut_short_is_refused_naming_it(objects):
    store, reader = objects
    key, data = _put(store, _version(2, producers=1000))
    extent = log.head_extent(data)
    assert extent is not None
    cut = keys.version_key(4)
    store.put_if_absent(cut, data[: extent - 10])
    read, _ = reader.get_head(cut)
    with pytest.raises(log.CorruptDataError, match=cut):
        log.decode_version_head(read, cut, 3)


def test_a_writer_follows_a_long_version_by_its_head_and_proves_it(objects, tmp_path):
    """Through the journal: a writer's load reads the long version's head and proves its
    view by the anchor's head; it reaches the state a full reader does."""
    store, _ = objects
    journal = Journal(store)
    state = journal.load_state()
    state = journal.commit(state, lambda s: build_claim(s, "producer-0000", "inc", 1.0, Layout(32, 1))).state
    epoch = state.producers["producer-0000"].epoch
    big = _version(400)
    big = msgspec.structs.replace(
        big,
        version=state.version + 1,
        tgbs=[msgspec.structs.replace(t, epoch=epoch) for t in big.tgbs],
        producers={"producer-0000": ProducerState(400, epoch, "inc")},
    )
    state = journal.commit(state, lambda s: big).state
    writer = Journal(ReadsStore(str(tmp_path)), heads_only=True)
    followed = writer.load_state()
    assert followed.steps == 400 and followed.digest == state.digest == Journal(store).load_state().digest
    stored = len(store.get(keys.version_key(state.version)))
    assert writer.bytes_read < stored // 10
