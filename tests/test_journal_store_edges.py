"""Edges of what the journal keeps beside the log and what garbage collection reclaims:
head copies put in the background on an object store (a bounded number in flight, each
holding the version's bytes), copies a store refuses or that are damaged (logged, read
around), a damaged group-commit intent, a collection report as the CLI prints it, and a
collector beaten to the same reclaim by another."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import threading
import time
import uuid
import zlib

import msgspec
import pytest
from worker import tgb

import batchweave as bw
from batchweave import keys, log, logrules
from batchweave.commit.claims import claim_key
from batchweave.commit.policies import Manual
from batchweave.errors import ConfigError, CorruptDataError, StoreError
from batchweave.intent import INTENT_FORMAT, Intent, encode_intent, intent_key
from batchweave.journal import Journal
from batchweave.journal.headcopies import CopyWriter, encode_copy, read_copy
from batchweave.journal.objects import LogObjects
from batchweave.journal.segments import RecentVersions, read_segment
from batchweave.journal.snapshots import Snapshots
from batchweave.keys import INTENT_PREFIX
from batchweave.lifecycle.gc import GCReport
from batchweave.lifecycle.gcsummary import GC_PREFIX, summary_key
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, released_key
from batchweave.log import LOG_FORMAT, LOG_FORMAT_1, LOG_FORMAT_2, Layout, LogState, ReadVersion, Reclaim, TGBDescriptor
from batchweave.segment import SEGMENT_MAX_BYTES, SEGMENT_PREFIX, SEGMENT_VERSIONS, segment_key
from batchweave.store import Store
from batchweave.testing import versiontext

WAIT_S = 10.0  # how long a test waits for a background put before it fails (never reached when it passes)
HEADCOPIES_LOGGER = "batchweave.journal.headcopies"


def memory_url(what: str) -> str:
    return f"memory://store-edges-{what}-{uuid.uuid4().hex}"


class ObjectLikeStore(Store):
    """A store that calls itself remote, as an object store does, so writers put its head
    copies in the background; each copy put waits for the gate its test set for that key,
    and the store records which keys and threads its copy puts came from and keeps what
    they put in ``kept`` (no request: a forked child may use it, see ``store.requests``)."""

    def __init__(self, url: str, copies: int) -> None:
        super().__init__(url)
        self.copies = copies
        self.gates: dict[str, threading.Event] = {}
        self.barrier: threading.Barrier | None = None  # copy puts meet here first, when set
        self.changed = threading.Condition()
        self.entered: list[str] = []
        self.met: list[str] = []
        self.finished: list[str] = []
        self.threads: set[int] = set()
        self.kept: dict[str, bytes] = {}

    @property
    def remote(self) -> bool:
        return True

    @property
    def head_copies(self) -> int:
        return self.copies

    def put(self, key: str, data: bytes | memoryview) -> None:
        if not key.startswith(keys.HEAD_PREFIX):
            return super().put(key, data)
        with self.changed:
            self.entered.append(key)
            self.threads.add(threading.get_ident())
            barrier = self.barrier
            self.changed.notify_all()
        try:
            if barrier is not None:
                barrier.wait(WAIT_S)
                with self.changed:
                    self.met.append(key)
                    self.changed.notify_all()
            if not self.gates[key].wait(WAIT_S):
                raise AssertionError(f"the test never opened the gate of {key}")
            self.kept[key] = bytes(data)
        finally:
            with self.changed:
                self.finished.append(key)
                self.changed.notify_all()

    def wait_until(self, predicate, what: str) -> None:
        with self.changed:
            if not self.changed.wait_for(predicate, WAIT_S):
                raise AssertionError(f"still waiting for {what}: {len(self.finished)} copy puts finished")

    def gate(self, versions: range) -> threading.Event:
        """A closed gate for every copy of ``versions``."""
        gate = threading.Event()
        for version in versions:
            for copy in range(keys.HEAD_COPIES):
                self.gates[keys.head_copy_key(version, copy)] = gate
        return gate


def test_on_an_object_store_copies_are_put_in_the_background_with_the_versions_bytes():
    """The committer does not wait for its copies on an object store: ``write`` returns
    while every copy put still waits, and each copy then holds exactly the bytes given."""
    store = ObjectLikeStore(memory_url("background"), copies=3)
    gate = store.gate(range(5, 6))
    data = b'{"version": 5, "the bytes": "as put"}'
    CopyWriter(store).write(5, data, "the-id")
    assert store.finished == []  # returned while the puts wait
    gate.set()
    store.wait_until(lambda: len(store.finished) == 3, "the three copies")
    assert store.kept == {keys.head_copy_key(5, copy): encode_copy(5, "the-id", data) for copy in range(3)}


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _copy_rounds() -> dict:
    """Two rounds of 70 copy puts against a store that holds them: the first takes 64,
    then 8 copies hold every pool thread while the second takes what the cap leaves."""
    handler = _Keep()
    logger = logging.getLogger(HEADCOPIES_LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    store = ObjectLikeStore(memory_url("rounds"), copies=10)

    def skipped_while(write) -> list[str]:
        before = len(handler.records)
        write()
        return [record.getMessage() for record in handler.records[before:]]

    def write_versions(versions: range) -> None:
        writer = CopyWriter(store)
        for version in versions:
            writer.write(version, b"version %d" % version, "the-id")

    first = store.gate(range(1, 8))
    result = {"first": skipped_while(lambda: write_versions(range(1, 8)))}
    store.wait_until(lambda: len(store.entered) >= 8, "eight puts in flight")
    first.set()
    store.wait_until(lambda: len(store.finished) == 64, "the first round's puts")
    store.copies = 8  # one copy for each pool thread, all held until the second round is in
    store.barrier = threading.Barrier(8)
    second = store.gate(range(8, 16))
    result["holding"] = skipped_while(lambda: write_versions(range(8, 9)))
    store.wait_until(lambda: len(store.met) == 8, "eight copies holding the eight threads")
    store.barrier = None
    store.copies = 10
    result["second"] = skipped_while(lambda: write_versions(range(9, 16)))
    second.set()
    store.wait_until(lambda: len(store.finished) == 64 + 8 + 56, "the second round's puts")
    result["threads"] = len(store.threads)
    result["copies stored"] = len(store.kept)
    return result


def _report_copy_rounds(conn) -> None:
    try:
        conn.send(_copy_rounds())
    except BaseException as exc:  # the parent's assertion names it
        conn.send(repr(exc))


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_copy_puts_in_flight_are_capped_at_64_and_the_cap_frees_as_they_finish(start):
    """A slow store makes a process skip copies past 64 puts in flight (each skip logged
    with its key) rather than queue them; as puts finish, the cap frees exactly that many
    places, and 8 threads put them. Run in a new process (started fresh, or forked from
    this one, whose pool the child must not inherit) so no other test's put is in flight."""
    if start not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {start} start method here")
    context = multiprocessing.get_context(start)
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_report_copy_rounds, args=(child,))
    process.start()
    child.close()
    try:
        assert parent.poll(6 * WAIT_S), "the child process never answered"
        result = parent.recv()
    finally:
        process.join(WAIT_S)
        if process.is_alive():
            process.kill()
            process.join()

    def skipped(version: int, copies: range) -> list[str]:
        return [f"skipped the head copy {keys.head_copy_key(version, copy)}: 64 copy puts in flight" for copy in copies]

    assert result == {
        "first": skipped(7, range(4, 10)),  # 70 copies: 64 in flight, 6 skipped
        "holding": [],
        "second": skipped(14, range(6, 10)) + skipped(15, range(10)),  # 8 held + 56 in flight, 14 skipped
        "threads": 8,
        "copies stored": 64 + 8 + 56,
    }


class RefusingCopies(Store):
    """A memory store that refuses every put of a head copy."""

    def put(self, key: str, data: bytes | memoryview) -> None:
        if key.startswith(keys.HEAD_PREFIX):
            raise StoreError(key, "refused by the test")
        super().put(key, data)


def test_a_store_refusing_copies_costs_the_commit_nothing_and_each_refusal_names_its_copy(monkeypatch, caplog):
    """Copies are best effort: a store refusing them leaves every commit committed, and
    the debug log says which copy was not written and why."""
    monkeypatch.setenv("BATCHWEAVE_HEAD_COPIES", "2")
    url = memory_url("refusing")
    with caplog.at_level(logging.DEBUG, logger=HEADCOPIES_LOGGER):
        with bw.Producer(RefusingCopies(url), "p", dp=1, commit_policy=Manual()) as producer:
            producer.append(tgb("p", 0, 1))
            producer.flush()
    assert Journal(Store(url), read_only=True).load_state().steps == 1
    refused = [keys.head_copy_key(version, copy) for version in (1, 2) for copy in range(2)]
    messages = [r.getMessage() for r in caplog.records if r.name == HEADCOPIES_LOGGER]
    assert messages == [f"did not write the head copy {key}: {key}: refused by the test" for key in refused]
    assert [info.key for info in Store(url).list(keys.HEAD_PREFIX)] == []


def test_a_copy_read_carries_the_bytes_it_holds_and_a_damaged_one_is_named_in_the_warning(monkeypatch, caplog):
    """A copy read hands on the version's bytes exactly as stored (a reader's proof and a
    node's hub use them); a copy that names its version but does not decode is read
    around, and the warning says which copy of which version and what is wrong with it."""
    monkeypatch.setenv("BATCHWEAVE_HEAD_COPIES", "3")
    url = memory_url("read-copy")
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        producer.append(tgb("p", 0, 1))
        producer.flush()
    store = Store(url)
    objects = LogObjects(store)
    namespace = Journal(store, read_only=True).load_state().namespace
    read = read_copy(objects, 2, 1, namespace)
    assert isinstance(read, ReadVersion) and read.delta.version == 2
    assert bytes(read.data) == bytes(store.get(keys.version_key(2)))
    other = versiontext.loads(read.data) | {"version": 72, "format": "batchweave.log/99"}
    key = keys.head_copy_key(72, 2)
    store.put(key, encode_copy(72, namespace, versiontext.dumps(other)))
    with caplog.at_level(logging.WARNING, logger=HEADCOPIES_LOGGER):
        assert read_copy(objects, 72, 2, namespace) is True
    assert caplog.messages == [
        f"read around a damaged copy of log version 72 ({key}): {key}: unsupported log format "
        f"'batchweave.log/99' (this reader knows {LOG_FORMAT}, {LOG_FORMAT_2} and {LOG_FORMAT_1})"
    ]


def encoded_intent(producer: str, epoch: int, first: int) -> bytes:
    """A well-formed intent of one TGB at offset ``first``."""
    tgb_of = TGBDescriptor(
        producer=producer,
        epoch=epoch,
        source_offset=first,
        dp=1,
        cp=1,
        kind="arrays",
        objects=[f"data/{producer}/e{epoch:06d}/{first:012d}-t.0.bwb"],
        slices=[(0, 0, 10, 0)],
        nbytes=10,
    )
    return encode_intent(Intent(INTENT_FORMAT, producer, epoch, [tgb_of]))


def test_collection_deletes_the_intents_that_can_never_be_folded_and_only_those():
    """Of a producer at epoch 2 that has committed nothing: its epoch-1 intent (fenced) and
    a damaged epoch-2 intent (nothing in it can be folded, even at offset 0) go; its live
    intent, another producer's the log does not know yet, and an object that is no
    intent stay, wherever they sort."""
    url = memory_url("intents")
    for _ in range(2):
        with bw.Producer(url, "p", dp=1, commit_policy=Manual()):
            pass  # claims: epoch 2 in the end, nothing committed
    recorded = Journal(Store(url), read_only=True).load_state().producers["p"]
    assert (recorded.epoch, recorded.offset) == (2, 0)
    store = Store(url)
    dead = {intent_key("p", 1, 0): encoded_intent("p", 1, 0), intent_key("p", 2, 0): b"{not an intent"}
    kept = {
        INTENT_PREFIX + "0-not-an-intent": b"{}",
        intent_key("a-unknown", 1, 0): encoded_intent("a-unknown", 1, 0),
        intent_key("p", 2, 1): encoded_intent("p", 2, 1),
    }
    for key, data in {**dead, **kept}.items():
        store.put(key, data)
    assert bw.collect_garbage(url, grace_s=0, dry_run=True).deleted_intents == 2
    report = bw.collect_garbage(url, grace_s=0)
    assert report.deleted_intents == 2
    assert sorted(info.key for info in store.list(INTENT_PREFIX)) == sorted(kept)


def test_a_collection_report_reads_as_a_dict_of_every_field_for_json():
    """``GCReport.to_dict`` (what ``batchweave gc`` prints as JSON) names every field."""
    report = GCReport(w_global_step=4, reclaimed_steps=4, deleted_objects=["data/a"], deleted_bytes=10)
    as_dict = report.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["w_global_step"] == 4 and as_dict["deleted_objects"] == ["data/a"]
    assert as_dict["dry_run"] is False and as_dict["deleted_intents"] == 0
    assert set(as_dict) == set(GCReport.__dataclass_fields__)


class BeatenCollector(Store):
    """A store whose first create-only put of a log version lets another collector run to
    the end first (the two planned the same reclaim from the same state)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.rival: bw.GCReport | None = None

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if self.rival is None and key.startswith(keys.LOG_PREFIX):
            self.rival = bw.collect_garbage(self.url, grace_s=0)
        super().put_if_absent(key, data)


def test_a_collector_beaten_to_the_same_reclaim_adopts_it_and_reports_what_it_planned():
    """Two collectors plan the same reclaim; the one that loses the race to record it
    finds it recorded and carries out its plan: it reports what the winner reported (both
    delete the same objects: deletes are idempotent), rather than planning again from its
    older listing and taking the reclaimed objects for orphans."""
    url = memory_url("beaten")
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(6):
            producer.append(tgb("p", offset, 1))
            producer.flush()
    with bw.Consumer(url, dp=1, rank=0) as consumer:
        for _ in range(4):
            next(consumer)
        consumer.mark_checkpoint("ck")
    store = BeatenCollector(url)
    report = bw.collect_garbage(store, grace_s=0)
    assert store.rival is not None and store.rival.reclaimed_steps == 4
    assert len(store.rival.deleted_objects) == 4
    assert report == store.rival  # the same objects and bytes reclaimed; none taken for an orphan
    assert Journal(Store(url), read_only=True).load_state().reclaimed.steps == 4


# -- the log's objects, counted ------------------------------------------------------------


def test_log_objects_count_every_request_and_read_a_miss_as_none_and_a_lost_race_as_false():
    """``LogObjects`` (``Journal.requests``) counts each request once, whatever it found."""
    objects = LogObjects(Store(memory_url("objects")))
    assert objects.requests == 0
    assert objects.get("_log/a.json") is None
    assert objects.put_if_absent("_log/a.json", b"first") == "landed"
    assert objects.put_if_absent("_log/a.json", b"second") == "taken"
    assert bytes(objects.get("_log/a.json")) == b"first"
    objects.store.put("_log/b.json", b"b")
    objects.store.put("other/c.json", b"c")
    assert sorted(objects.list_keys("_log/")) == ["_log/a.json", "_log/b.json"]
    assert objects.requests == 5


# -- segments: what a writer holds and writes --------------------------------------------


def raw_version(version: int, size: int = 0) -> bytes:
    """Bytes standing for a log version (a segment copies them as they are)."""
    text = b'{"version":%d,"pad":"' % version
    return text + b"x" * max(0, size - len(text) - 2) + b'"}'


def segment_versions(store: Store, last: int) -> list[bytes]:
    """The versions' bytes a stored segment holds."""
    raw = msgspec.json.decode(zlib.decompress(bytes(store.get(segment_key(last)))), type=dict[str, msgspec.Raw])
    return [bytes(v) for v in msgspec.json.decode(raw["versions"], type=list[msgspec.Raw])]


def test_a_holder_of_a_segments_versions_writes_it_byte_for_byte_and_one_missing_a_version_writes_none():
    """``RecentVersions.write_segment`` writes the segment ending at ``last`` from exactly
    the 32 versions it kept, and nothing when it misses one."""
    store = Store(memory_url("segment"))
    recent = RecentVersions()
    for version in range(2, 33):
        recent.keep(version, raw_version(version))
    assert recent.write_segment(store, 32) is False  # version 1 was never kept
    assert store.size(segment_key(32)) is None
    recent.keep(1, raw_version(1))
    assert recent.write_segment(store, 32) is True
    assert segment_versions(store, 32) == [raw_version(v) for v in range(1, 33)]
    assert [info.key for info in store.list(SEGMENT_PREFIX)] == [segment_key(32)]
    assert recent.write_segment(store, 32) is True  # written already (by us or another writer)
    recent.clear()
    assert recent.write_segment(Store(memory_url("segment-after-clear")), 32) is False


def test_a_holder_keeps_one_segments_worth_of_consecutive_versions():
    """Keeping the version after a segment drops the segment's first version: a writer
    holds at most 32 consecutive versions' bytes."""
    store = Store(memory_url("segment-window"))
    recent = RecentVersions()
    for version in range(1, 34):
        recent.keep(version, raw_version(version))
    assert recent.write_segment(store, 32) is False
    assert store.size(segment_key(32)) is None


def test_a_holder_keeps_versions_read_out_of_order_until_it_holds_two_segments_worth():
    """Versions kept out of order (reloads that skipped ahead) are held until 64 are
    kept; the next one drops all but those near it, and it starts the next segment."""
    store = Store(memory_url("segment-skips"))
    recent = RecentVersions()
    for version in range(1, 33):
        recent.keep(version, raw_version(version))
    for far in range(32):
        recent.keep(10_000 + 1_000 * far, raw_version(10_000 + 1_000 * far))
    assert recent.write_segment(store, 32) is True  # 64 held: none dropped yet
    store.delete(segment_key(32))
    first = 64 * 1_000 + 1  # the 65th: the first version of the segment ending at 64,032
    for version in range(first, first + SEGMENT_VERSIONS):
        recent.keep(version, raw_version(version))
    assert recent.write_segment(store, 32) is False
    assert recent.write_segment(store, first + SEGMENT_VERSIONS - 1) is True
    assert segment_versions(store, 64_032) == [raw_version(v) for v in range(first, 64_033)]


def test_a_segment_of_exactly_the_byte_limit_is_written_and_one_byte_more_is_not():
    """Versions totalling ``SEGMENT_MAX_BYTES`` get a segment; a byte more, none."""
    store = Store(memory_url("segment-bytes"))
    recent = RecentVersions()
    for version in range(1, 33):
        recent.keep(version, raw_version(version, SEGMENT_MAX_BYTES // SEGMENT_VERSIONS))
    assert recent.write_segment(store, 32) is True
    recent.keep(64, raw_version(64, SEGMENT_MAX_BYTES // SEGMENT_VERSIONS + 1))
    for version in range(33, 64):
        recent.keep(version, raw_version(version, SEGMENT_MAX_BYTES // SEGMENT_VERSIONS))
    assert recent.write_segment(store, 64) is False
    assert store.size(segment_key(64)) is None


class RefusingSegments(Store):
    """A memory store that refuses every put of a log segment."""

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if key.startswith(SEGMENT_PREFIX):
            raise StoreError(key, "refused by the test")
        super().put_if_absent(key, data)


def test_a_segment_the_store_refuses_is_reported_not_written_and_logged(caplog):
    """A refused segment costs readers time only: ``write_segment`` answers False and the
    warning says which segment and why."""
    store = RefusingSegments(memory_url("segment-refused"))
    recent = RecentVersions()
    for version in range(1, 33):
        recent.keep(version, raw_version(version))
    with caplog.at_level(logging.WARNING, logger="batchweave.journal.segments"):
        assert recent.write_segment(store, 32) is False
    assert caplog.messages == [
        f"could not write the log segment ending at version 32: {segment_key(32)}: refused by the test"
    ]


def test_a_missing_segment_reads_as_none_and_a_damaged_one_is_read_around_with_a_warning(caplog):
    """``read_segment``: None for no segment; None and a warning naming the damage for a
    damaged one; else its versions."""
    url = memory_url("segment-read")
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(31):
            producer.append([b"x"], source_offset=offset)
            producer.flush()  # versions 1..32: the committer of 32 writes the segment
    store = Store(url)
    objects = LogObjects(store)
    assert [read.delta.version for read in read_segment(objects, 32)] == list(range(1, 33))
    assert [bytes(read.data) for read in read_segment(objects, 32)] == [
        bytes(store.get(keys.version_key(v))) for v in range(1, 33)
    ]
    assert read_segment(objects, 64) is None
    store.put(segment_key(64), b"not zlib at all")
    with caplog.at_level(logging.WARNING, logger="batchweave.journal.segments"):
        assert read_segment(objects, 64) is None
    [message] = caplog.messages
    assert message.startswith(
        f"reading log versions one by one instead of a damaged segment: {segment_key(64)}: damaged log segment: "
    )


# -- snapshots and the hint ----------------------------------------------------------------

NAMESPACE = "ns-edges"
REBUILD = (
    "; the namespace state depends on it. If the log versions after the previous snapshot are intact, "
    "deleting this object lets readers rebuild the state"
)


def state_at(version: int, namespace: str = NAMESPACE) -> LogState:
    return LogState(version=version, namespace=namespace)


def snapshots_of(url: str, every: int = 4) -> tuple[Snapshots, LogObjects]:
    """A fresh reader's view of the snapshots, and the objects counting its requests."""
    objects = LogObjects(Store(url))
    return Snapshots(objects, every), objects


def with_snapshots(*versions: int, every: int = 4) -> str:
    url = memory_url("snapshots")
    snapshots, _ = snapshots_of(url, every)
    for version in versions:
        snapshots.write(state_at(version))
    return url


def test_a_snapshot_write_stores_the_state_and_a_hint_naming_it_even_when_the_snapshot_exists():
    """The snapshot holds the state; the hint names it and repeats the namespace's id, and
    it is written again when the (deterministic) snapshot was there already."""
    url = with_snapshots(4, 8)
    store = Store(url)
    assert log.decode_snapshot(store.get(keys.snapshot_key(4)), keys.snapshot_key(4)) == state_at(4)
    assert log.decode_hint(bytes(store.get(keys.HINT_KEY))) == log.Hint(8, NAMESPACE)
    snapshots, _ = snapshots_of(url)
    snapshots.write(state_at(4))  # another writer's copy of the same snapshot
    assert log.decode_hint(bytes(store.get(keys.HINT_KEY))) == log.Hint(4, NAMESPACE)


class RefusingPuts(Store):
    """A memory store that refuses puts of the keys starting with ``refused``."""

    def __init__(self, url: str, refused: str) -> None:
        super().__init__(url)
        self.refused = refused

    def put(self, key: str, data: bytes | memoryview) -> None:
        if key.startswith(self.refused):
            raise StoreError(key, "refused by the test")
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if key.startswith(self.refused):
            raise StoreError(key, "refused by the test")
        super().put_if_absent(key, data)


@pytest.mark.parametrize("refused", [keys.SNAPSHOT_PREFIX, keys.HINT_KEY], ids=["snapshot", "hint"])
def test_a_snapshot_or_hint_the_store_refuses_is_logged_and_costs_nothing_else(refused, caplog):
    """A refused snapshot put leaves the hint as it was; a refused hint leaves the snapshot
    written. Either is logged, naming the version and the refused object, and never raises."""
    url = with_snapshots(8)
    with caplog.at_level(logging.WARNING, logger="batchweave.journal.snapshots"):
        Snapshots(LogObjects(RefusingPuts(url, refused)), 4).write(state_at(12))
    key = keys.snapshot_key(12) if refused == keys.SNAPSHOT_PREFIX else keys.HINT_KEY
    assert caplog.messages == [f"could not write snapshot at version 12: {key}: refused by the test"]
    store = Store(url)
    assert log.decode_hint(bytes(store.get(keys.HINT_KEY))).version == 8
    assert (store.size(keys.snapshot_key(12)) is not None) == (refused == keys.HINT_KEY)


def test_a_stale_hint_costs_one_probe_per_snapshot_it_is_behind():
    """From the hint a load probes forward, one GET per snapshot past it and one past the
    newest; with a current hint only that last probe; without trusting the hint one
    listing and no probe."""
    url = with_snapshots(4, 8, 12)
    snapshots, objects = snapshots_of(url)
    assert snapshots.newest(trust_hint=True) == state_at(12)
    assert objects.requests == 3  # the hint, snapshot 12, snapshot 16 (none)
    Store(url).put(keys.HINT_KEY, log.encode_hint(state_at(4)))
    snapshots, objects = snapshots_of(url)
    assert snapshots.newest(trust_hint=True) == state_at(12)
    assert objects.requests == 5  # the hint, snapshots 4, 8, 12 and 16 (none)
    snapshots, objects = snapshots_of(url)
    assert snapshots.newest(trust_hint=False) == state_at(12)
    assert objects.requests == 2  # the listing, snapshot 12


@pytest.mark.parametrize("hint", ["missing", "damaged"])
def test_without_a_usable_hint_a_load_lists_the_snapshots(hint, caplog):
    """A missing hint costs one listing; a damaged one too, with a warning naming it."""
    url = with_snapshots(4, 8)
    store = Store(url)
    if hint == "missing":
        store.delete(keys.HINT_KEY)
    else:
        store.put(keys.HINT_KEY, b'{"version": "eight"')
    snapshots, objects = snapshots_of(url)
    with caplog.at_level(logging.WARNING, logger="batchweave.journal.snapshots"):
        assert snapshots.newest(trust_hint=True) == state_at(8)
    assert objects.requests == 3  # the hint, the listing, snapshot 8
    if hint == "missing":
        assert caplog.messages == []
    else:
        [message] = caplog.messages
        assert message.startswith(f"ignoring a damaged snapshot hint: {keys.HINT_KEY}: damaged snapshot hint: ")


def test_a_namespace_without_snapshots_loads_from_nothing_in_two_requests():
    """No hint and no snapshot: the empty state, after one GET and one listing."""
    snapshots, objects = snapshots_of(memory_url("no-snapshots"))
    assert snapshots.newest(trust_hint=True) == LogState()
    assert objects.requests == 2
    assert snapshots.listed_version() == 0
    assert snapshots.namespace() is None


def test_a_snapshot_of_version_1_is_found():
    """With a snapshot every version, the first one counts like any other."""
    url = with_snapshots(1, every=1)
    snapshots, _ = snapshots_of(url, every=1)
    assert snapshots.newest(trust_hint=True) == state_at(1)
    assert snapshots.newest(trust_hint=False) == state_at(1)


def test_the_listing_takes_only_snapshot_names_and_the_newest_of_them():
    """Objects under the snapshot prefix that are not ``<digits>.json`` are not snapshots."""
    url = with_snapshots(4, 12, 8)
    store = Store(url)
    for name in ("readme.json", "00000000000000000040-copy.json", "00000000000000000044x.json", "99.json.partial"):
        store.put(keys.SNAPSHOT_PREFIX + name, b"{}")
    store.put(keys.version_key(40), b"{}")  # not under the prefix: a log version, not a snapshot
    snapshots, objects = snapshots_of(url)
    assert snapshots.listed_version() == 12
    assert objects.requests == 1


def damage(url: str, version: int, says: int | None = None) -> str:
    """Damage the snapshot of ``version``: unreadable, or the state of version ``says``."""
    key = keys.snapshot_key(version)
    Store(url).put(key, b"{not json" if says is None else log.encode(state_at(says)))
    return key


@pytest.mark.parametrize("says", [9, None], ids=["other-version", "unreadable"])
def test_a_damaged_snapshot_the_hint_names_is_read_around_when_a_newer_one_is_listed(says, caplog):
    """The hinted snapshot may be stale: damaged, it is skipped with a warning naming it
    and the problem, and the newest listed one is used."""
    url = with_snapshots(4, 8)
    Store(url).put(keys.HINT_KEY, log.encode_hint(state_at(4)))
    key = damage(url, 4, says=says)
    snapshots, _ = snapshots_of(url)
    with caplog.at_level(logging.WARNING, logger="batchweave.journal.snapshots"):
        assert snapshots.newest(trust_hint=True) == state_at(8)
    [message] = caplog.messages
    problem = "snapshot says it is of version 9" if says else "damaged snapshot: "
    assert message.startswith(f"ignoring a damaged snapshot named by the hint: {key}: {problem}")


def test_a_damaged_newest_snapshot_raises_saying_how_to_recover():
    """The newest snapshot, found by a listing or by a probe past the hint, is what the
    state depends on: damaged, the load raises naming it and how to rebuild the state."""
    url = with_snapshots(4, 8)
    key = damage(url, 8, says=9)
    for trust_hint in (False, True):
        Store(url).put(keys.HINT_KEY, log.encode_hint(state_at(4)))  # a probe finds snapshot 8
        snapshots, _ = snapshots_of(url)
        with pytest.raises(CorruptDataError) as raised:
            snapshots.newest(trust_hint=trust_hint)
        assert raised.value.key == key
        assert str(raised.value) == f"{key}: snapshot says it is of version 9{REBUILD}"
    damage(url, 8)
    with pytest.raises(CorruptDataError, match="damaged snapshot: .*deleting this object lets readers rebuild"):
        snapshots_of(url)[0].newest(trust_hint=True)


def test_the_namespace_id_comes_from_the_hint_else_from_a_snapshot():
    """One GET when the hint repeats the id; an older hint (without it) costs the hinted
    snapshot; no hint costs a listing and the newest snapshot."""
    url = with_snapshots(4, 8)
    snapshots, objects = snapshots_of(url)
    assert snapshots.namespace() == NAMESPACE
    assert objects.requests == 1
    Store(url).put(keys.HINT_KEY, msgspec.json.encode(log.Hint(8)))  # a hint from before ids
    snapshots, objects = snapshots_of(url)
    assert snapshots.namespace() == NAMESPACE
    assert objects.requests == 2
    Store(url).delete(keys.HINT_KEY)
    snapshots, objects = snapshots_of(url)
    assert snapshots.namespace() == NAMESPACE
    assert objects.requests == 3  # the hint, the listing, snapshot 8


def test_the_namespace_id_reads_around_a_damaged_hinted_snapshot_but_not_a_damaged_newest_one():
    """An older hint naming a damaged snapshot: the id comes from the newest listed one;
    that one damaged too, the read raises (the id cannot be known)."""
    url = with_snapshots(4, 8)
    Store(url).put(keys.HINT_KEY, msgspec.json.encode(log.Hint(4)))
    damage(url, 4)
    snapshots, _ = snapshots_of(url)
    assert snapshots.namespace() == NAMESPACE
    key = damage(url, 8)
    with pytest.raises(CorruptDataError, match="deleting this object lets readers rebuild") as raised:
        snapshots_of(url)[0].namespace()
    assert raised.value.key == key


# -- garbage collection: what a dry run promises -------------------------------------------


def test_a_dry_run_reports_exactly_what_the_collection_then_deletes():
    """Every count of a dry run (TGB objects and bytes, versions, snapshots, segments,
    watermarks of a released checkpoint, intents, probes, tickets, orphans) is what the
    collection after it deletes, two or more of each, and the dry run deletes nothing.
    Versions go below the live checkpoint's (288), and with them the segments all of whose
    versions go: not the one ending at 288."""
    url = memory_url("gc-dry")
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(310):  # versions 1..311: snapshots at 100, 200 and 300, segments 32..288
            producer.append([b"x%d" % offset], source_offset=offset)
            producer.flush()
    with bw.Consumer(url, dp=1, rank=0) as consumer:
        for step in range(287):  # the cursor's version: 288, the last of a segment
            next(consumer)
            if step in (9, 19):
                consumer.mark_checkpoint(f"early-{step}")
        consumer.mark_checkpoint("late")
    for step in (9, 19):
        bw.release_checkpoint(url, f"early-{step}")
    store = Store(url)
    dead = [intent_key("p", 1, 0), intent_key("p", 1, 7)]
    probes = ["_probe/" + "0" * 32, "_probe/" + "f" * 32]  # as a probe names its key: a uuid's 32 hex digits
    tickets = [claim_key("p", 1, Layout(1, 1), incarnation) for incarnation in ("0dead", "1dead")]
    # Of the producer the log knows (I13), at offsets it committed under other tokens: a retried append's debris.
    orphans = [f"data/p/e000001/00000000000{n}-0badc0de.0.bwb" for n in (0, 1)]
    pending = "data/p/e000001/000000000310-0badc0de.0.bwb"  # the live producer's next TGB: not an orphan
    for key in [*dead, *probes, *tickets, *orphans, pending]:
        store.put(key, b"{left behind")
    before = sorted(info.key for info in store.list())
    dry = bw.collect_garbage(url, grace_s=0, dry_run=True)
    assert sorted(info.key for info in store.list()) == before
    done = bw.collect_garbage(url, grace_s=0)
    assert done.deleted_versions == 287 and done.deleted_snapshots == 2 and done.deleted_segments == 8
    assert (done.deleted_watermarks, done.deleted_intents, done.deleted_probes, done.deleted_tickets) == (4, 2, 2, 2)
    assert done.orphans == orphans and len(done.deleted_objects) == 287 + 2
    assert {**dry.to_dict(), "deleted_objects": sorted(dry.deleted_objects)} == {
        **done.to_dict(),
        "deleted_objects": sorted(done.deleted_objects),
        "dry_run": True,
    }
    after = {info.key for info in store.list()}
    assert pending in after
    assert [info.key for info in store.list(GC_PREFIX)] == [summary_key(311)]  # where the next run starts
    assert set(before) - after == {
        *done.deleted_objects,
        *(keys.version_key(v) for v in range(1, 288)),
        keys.snapshot_key(100),
        keys.snapshot_key(200),
        *(segment_key(last) for last in range(32, 288, 32)),  # 288 holds version 288, kept
        *dead,
        *probes,
        *tickets,
        *(key for key in before if key.startswith(CHECKPOINT_PREFIX + "early-")),
    }


class ObjectStoreLike(Store):
    """A memory store that answers as an object store does (a prefix always exists)."""

    @property
    def object_store(self) -> bool:
        return True


def test_on_an_object_store_collection_refuses_a_namespace_that_never_was_unless_a_checkpoint_is_there():
    """Nothing committed and no checkpoint: most likely a mistyped URL, refused, saying so.
    A checkpoint alone (released, here) makes it a namespace to tidy."""
    url = memory_url("gc-no-namespace")
    with pytest.raises(ConfigError, match=r"no BatchWeave namespace at .*check the URL"):
        bw.collect_garbage(ObjectStoreLike(url))
    Store(url).put(released_key("ck"), b"{}")
    assert bw.collect_garbage(ObjectStoreLike(url), grace_s=0).deleted_watermarks == 1


def test_collection_opens_only_an_existing_directory_with_the_options_given(tmp_path):
    """A missing local directory is refused, not created; storage options reach the store,
    which refuses one it does not take."""
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError):
        bw.collect_garbage(str(missing))
    assert not missing.exists()
    with pytest.raises(ConfigError, match="fsync"):
        bw.collect_garbage(memory_url("gc-options"), storage_options={"fsync": False})


@pytest.mark.parametrize("kind", ["orphan", "probe", "staging"])
def test_an_object_becomes_collectable_exactly_when_its_age_reaches_the_grace(kind, tmp_path):
    """The grace protects an object younger than ``grace_s`` (a producer may still commit
    it, a probe or a put may still be running) and no longer: at an age of exactly the
    grace it goes, with the dry run and the collection agreeing."""
    root = tmp_path / "ns"
    url = str(root)
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()):
        pass  # the namespace exists
    store = Store(url)
    if kind == "orphan":
        key = "data/p/e000000/000000000000-0badc0de.0.bwb"  # of an epoch before the log's (I13: a known producer)
        store.put(key, b"never committed")
    elif kind == "probe":
        key = "_probe/" + "0" * 32
        store.put(key, b"")
    else:
        key = "data/q/e000001/000000000001-0badc0de.0.bwb#123456789012345678"
        older = "data/q/e000001/000000000000-0badc0de.0.bwb#876543210987654321"
        (root / "data" / "q" / "e000001").mkdir(parents=True)
        for name, data, modified in ((key, b"a put killed mid-write", 1_700_000_000), (older, b"older", 1_699_999_000)):
            (root / name).write_bytes(data)
            os.utime(root / name, (modified, modified))
    infos = store.staging_files() if kind == "staging" else list(store.list())
    [written] = [info.modified_s for info in infos if info.key == key]

    def collected(report: bw.GCReport) -> bool:
        return {"orphan": key in report.orphans, "probe": report.deleted_probes == 1}.get(
            kind,
            report.deleted_staging == 2,  # this one, and one older
        )

    assert not collected(bw.collect_garbage(url, grace_s=60, now=written + 30, dry_run=True))
    assert not collected(bw.collect_garbage(url, now=written + 3599.5, dry_run=True))  # the default: an hour
    assert collected(bw.collect_garbage(url, now=written + 3600.5, dry_run=True))
    assert not collected(bw.collect_garbage(url, grace_s=0, now=written - 0.5, dry_run=True))
    assert collected(bw.collect_garbage(url, grace_s=0, now=written, dry_run=True))
    report = bw.collect_garbage(url, grace_s=0, now=written)
    assert collected(report)
    if kind == "staging":
        assert report.deleted_staging_bytes == len(b"a put killed mid-write") + len(b"older")
    assert not (root / key).exists()


def reclaim_one_step_more(url: str) -> None:
    """Another collector records a reclaim one step further than the log's."""
    rival = Journal(Store(url))
    state = rival.load_state()
    done = state.reclaimed
    further = Reclaim(done.steps + 1, done.versions, done.bytes)
    rival.commit(state, lambda s: logrules.build_reclaim(s, further, time.time()))


class OvertakenWhilePlanning(Store):
    """A store on which, once a collection has loaded the log and reads the snapshot hint
    again (to plan), another collector records a reclaim first."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.versions_read = False
        self.overtaken = 0

    def get(self, key: str) -> memoryview:
        if re.fullmatch(r"_log/\d{20}\.json", key):
            self.versions_read = True
        elif key == keys.HINT_KEY and self.versions_read and not self.overtaken:
            reclaim_one_step_more(self.url)
            self.overtaken += 1
        return super().get(key)


def thirty_steps_checkpointed_at_twenty(url: str) -> None:
    """Thirty one-step versions, and a live checkpoint at step 20: a collection reclaims 20."""
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(30):
            producer.append([b"x%d" % offset], source_offset=offset)
            producer.flush()
    with bw.Consumer(url, dp=1, rank=0) as consumer:
        for _ in range(20):
            next(consumer)
        consumer.mark_checkpoint("ck")


def test_a_collection_overtaken_while_it_plans_plans_again_and_completes():
    """A reclaim recorded by another collector between our load and our commit makes our
    plan stale: we plan again from the newer state and record our own reclaim."""
    url = memory_url("gc-overtaken-planning")
    thirty_steps_checkpointed_at_twenty(url)
    store = OvertakenWhilePlanning(url)
    report = bw.collect_garbage(store, grace_s=0)
    assert store.overtaken == 1
    assert report.reclaimed_steps == 20
    assert (
        len(list(Store(url).list(keys.DATA_PREFIX))) == 10
    )  # steps 20..29 (the rival recorded step 0, deleted nothing)
    assert Journal(Store(url), read_only=True).load_state().reclaimed.steps == 20


class OvertakenEveryTime(Store):
    """A store on which, before each create-only put of a log version, another collector
    records a reclaim one step further (so every plan is overtaken before it lands)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.overtaken = 0

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if re.fullmatch(r"_log/\d{20}\.json", key):
            reclaim_one_step_more(self.url)
            self.overtaken += 1
        super().put_if_absent(key, data)


def test_a_collection_overtaken_at_every_plan_gives_up_after_eight_saying_why():
    """Another collector reclaiming further before each of our reclaim versions lands:
    after 8 plans the collection raises, saying the log kept moving under it."""
    url = memory_url("gc-overtaken")
    thirty_steps_checkpointed_at_twenty(url)
    store = OvertakenEveryTime(url)
    with pytest.raises(StoreError) as raised:
        bw.collect_garbage(store, grace_s=0)
    assert str(raised.value) == f"{keys.LOG_PREFIX}: the log kept moving under garbage collection over 8 plans"
    assert store.overtaken == 8


def test_each_collection_leaves_one_summary_and_a_damaged_one_is_read_around_with_a_warning(caplog):
    """A collection after new commits replaces the summary with one of the newer version;
    a damaged summary is named in a warning and the log's versions are read instead."""
    url = memory_url("gc-summaries")
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()) as producer:
        for offset in range(10):
            producer.append([b"x%d" % offset], source_offset=offset)
            producer.flush()
        bw.collect_garbage(url, grace_s=0)
        assert [info.key for info in Store(url).list(GC_PREFIX)] == [summary_key(11)]
        for offset in range(10, 15):
            producer.append([b"x%d" % offset], source_offset=offset)
            producer.flush()
    bw.collect_garbage(url, grace_s=0)
    assert [info.key for info in Store(url).list(GC_PREFIX)] == [summary_key(16)]
    Store(url).put(summary_key(16), b"{damaged")
    with caplog.at_level(logging.WARNING, logger="batchweave.lifecycle.gc"):
        assert bw.collect_garbage(url, grace_s=0).orphans == []
    [message] = caplog.messages
    assert message.startswith(f"garbage collection: {summary_key(16)}: ")
    assert message.endswith("; reading the log's versions instead")
