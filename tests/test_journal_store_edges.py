"""Edges of what the journal keeps beside the log and what garbage collection reclaims:
head copies put in the background on an object store (a bounded number in flight, each
holding the version's bytes), copies a store refuses or that are damaged (logged, read
around), a damaged group-commit intent, a collection report as the CLI prints it, and a
collector beaten to the same reclaim by another."""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
import uuid

import msgspec
import pytest
from worker import tgb

import batchweave as bw
from batchweave import keys
from batchweave.commit.group import intent_key
from batchweave.commit.policies import Manual
from batchweave.errors import StoreError
from batchweave.journal import Journal
from batchweave.journal.headcopies import CopyWriter, read_copy
from batchweave.journal.objects import LogObjects
from batchweave.lifecycle.gc import GCReport
from batchweave.log import LOG_FORMAT
from batchweave.store import Store

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
    CopyWriter(store).write(5, data)
    assert store.finished == []  # returned while the puts wait
    gate.set()
    store.wait_until(lambda: len(store.finished) == 3, "the three copies")
    assert store.kept == {keys.head_copy_key(5, copy): data for copy in range(3)}


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
            writer.write(version, b"version %d" % version)

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
    read = read_copy(objects, 2, 1)
    assert read.delta.version == 2
    assert bytes(read.data) == bytes(store.get(keys.version_key(2)))
    other = msgspec.json.decode(bytes(read.data))
    other.update(version=72, format="batchweave.log/99")
    key = keys.head_copy_key(72, 2)
    store.put(key, msgspec.json.encode(other))
    with caplog.at_level(logging.WARNING, logger=HEADCOPIES_LOGGER):
        assert read_copy(objects, 72, 2) is True
    assert caplog.messages == [
        f"read around a damaged copy of log version 72 ({key}): {key}: unsupported log format "
        f"'batchweave.log/99' (this reader knows {LOG_FORMAT})"
    ]


def test_a_damaged_intent_of_a_producer_that_has_committed_nothing_yet_is_collected():
    """An intent that cannot be read is dead even for a producer whose committed offset
    is still 0: its TGBs can never be folded, so collection deletes it."""
    url = memory_url("intent")
    with bw.Producer(url, "p", dp=1, commit_policy=Manual()):
        pass  # claimed epoch 1, nothing committed
    recorded = Journal(Store(url), read_only=True).load_state().producers["p"]
    assert (recorded.epoch, recorded.offset) == (1, 0)
    damaged = intent_key("p", 1, 0)
    Store(url).put(damaged, b"{not an intent")
    report = bw.collect_garbage(url, grace_s=0)
    assert report.deleted_intents == 1
    assert Store(url).size(damaged) is None


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
