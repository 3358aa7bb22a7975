"""Issue #9: no interleaving of producers, collectors, restarts and damaged objects may
fork the log or lose a committed TGB. One regression test per reproduced scenario, each
forcing its interleaving with ``interleave.PausingStore`` instead of hoping for it.

Memory and local stores run them all; the protocol above the store is the same on every
backend (tests/test_store.py checks that the backends behave alike).
"""

from __future__ import annotations

import uuid

import pytest
from worker import origin_of, tgb

import batchweave as bw
from batchweave import keys, log
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.store import Store, open_store
from batchweave.testing.interleave import AmbiguousOnceStore, Background, PausingStore

VERSION_KEY = r"_log/\d{20}\.json"


@pytest.fixture
def url(fast_url) -> str:
    return fast_url


def producer(url, pid, dp=1, **kwargs) -> bw.Producer:
    return bw.Producer(url, pid, dp=dp, commit_policy=Manual(), snapshot_every=10, **kwargs)


def commit(prod: bw.Producer, count: int) -> None:
    """``count`` TGBs, one log version each."""
    for _ in range(count):
        prod.append(tgb(prod.producer_id, prod.next_offset, prod.mesh.dp))
        prod.flush()


def read_all(url, dp=1, state=None, timeout_s=10.0) -> list[tuple[str, int]]:
    """Every (producer, offset) a rank reads until the stream ends, from ``state`` on."""
    with bw.Consumer(url, dp=dp, rank=0, timeout_s=timeout_s) as consumer:
        if state is not None:
            consumer.load_state_dict(state)
        return [origin_of(batch.data) for batch in consumer]


def checkpoint_at(url, steps, name, dp=1, start=None) -> dict:
    """A complete checkpoint after ``steps`` steps (every rank marks), reading from the
    cursor ``start`` (a live checkpoint's) or step 0; returns rank 0's cursor."""
    states = []
    for rank in range(dp):
        with bw.Consumer(url, dp=dp, rank=rank, timeout_s=10) as consumer:
            if start is not None:
                consumer.load_state_dict(start)
            while consumer.state_dict()["step"] < steps:
                next(consumer)
            consumer.mark_checkpoint(name)
            states.append(consumer.state_dict())
    return states[0]


def assert_offsets_dense(url, expected: dict[str, int]) -> None:
    """The log's replay from the newest snapshot agrees with what each producer committed."""
    state = Journal(open_store(url)).load_state()
    assert {pid: p.offset for pid, p in state.producers.items()} == expected


# -- 1. a producer idle across a collection --------------------------------------------


def test_producer_idle_across_gc_commits_visibly_and_resumes_exactly(url):
    slow = producer(url, "slow")
    commit(slow, 1)
    with producer(url, "fast") as fast:
        commit(fast, 40)  # versions 3..42, snapshots at 10, 20, 30, 40
    cursor = checkpoint_at(url, 35, "ck35")
    report = bw.collect_garbage(url, grace_s=0)
    assert report.deleted_versions > 0  # the versions slow last saw are gone

    commit(slow, 12)  # crosses a snapshot boundary (50) from a view GC overtook
    slow.close()
    assert_offsets_dense(url, {"slow": 13, "fast": 40})
    restarted = producer(url, "slow")
    assert (restarted.resume_offset, restarted.epoch) == (13, 2)
    restarted.close(flush=False)
    bw.end_stream(url)
    after = read_all(url, state=cursor)
    assert [o for p, o in after if p == "slow"] == list(range(1, 13))  # every one visible, in order


# -- 2. opening the namespace while a collection runs ----------------------------------


def test_producer_opening_while_gc_deletes_builds_the_newest_state(url):
    with producer(url, "fast") as fast:
        commit(fast, 15)  # versions 2..16, snapshot 10
    # The opener has read snapshot 10 and found no snapshot 20; it is held before reading
    # version 11 while the log moves on and a collection deletes below version 20.
    store = PausingStore(url)
    held = store.pause("get", keys.version_key(11))
    opening = Background(producer, store, "late")
    held.wait_reached()
    with producer(url, "fast") as fast:
        commit(fast, 10)  # versions 18..27, snapshot 20
    ck24 = checkpoint_at(url, 24, "ck24")
    assert bw.collect_garbage(url, grace_s=0).deleted_versions >= 19
    held.release()
    late = opening.result()
    assert (late.epoch, late.resume_offset) == (1, 0)
    commit(late, 3)
    late.close()
    bw.end_stream(url)
    state = Journal(open_store(url)).load_state()
    assert state.producers["late"].offset == 3 and state.producers["fast"].offset == 25
    tail = read_all(url, state=checkpoint_at(url, 25, "ck25", start=ck24))
    assert tail == [("late", 0), ("late", 1), ("late", 2)]


def test_end_stream_racing_gc_lands_in_the_live_log(url):
    with producer(url, "p") as p:
        commit(p, 15)
    store = PausingStore(url)
    held = store.pause("get", keys.version_key(11))
    ending = Background(bw.end_stream, store)
    held.wait_reached()
    with producer(url, "p") as p:
        commit(p, 10)
    ck24 = checkpoint_at(url, 24, "ck24")
    bw.collect_garbage(url, grace_s=0)
    held.release()
    ending.result()
    state = Journal(open_store(url)).load_state()
    assert state.end_of_stream and state.steps == 25
    cursor = checkpoint_at(url, 25, "ck25", start=ck24)
    assert read_all(url, state=cursor) == []  # ends, instead of polling a dead version forever


# -- 3. a damaged newest snapshot after a collection -----------------------------------


def test_damaged_newest_snapshot_is_an_error_never_an_older_state(url):
    with producer(url, "p") as p:
        commit(p, 30)  # versions 2..31, snapshots 10, 20, 30
    checkpoint_at(url, 29, "ck29")
    bw.collect_garbage(url, grace_s=0)
    store = open_store(url)
    assert store.size(keys.version_key(1)) is None  # collected
    damaged = keys.snapshot_key(30)
    store.put(damaged, b'{"format": "batchweave.snapshot/1", "vers')
    with pytest.raises(bw.CorruptDataError, match=damaged):
        producer(url, "p")
    with pytest.raises(bw.CorruptDataError, match=damaged):
        bw.inspect_namespace(url)
    assert store.size(keys.version_key(1)) is None  # nothing re-created version 1


# -- 4. two collectors that overlap ---------------------------------------------------


def test_overlapping_collectors_never_commit_a_reclaim_the_log_rejects(url):
    with producer(url, "p") as p:
        commit(p, 45)  # versions 2..46, snapshots 10..40
    checkpoint_at(url, 20, "ck20")
    ck40 = checkpoint_at(url, 40, "ck40")
    slow_store = PausingStore(url)
    held = slow_store.pause("put_if_absent", VERSION_KEY)
    slow = Background(bw.collect_garbage, slow_store, grace_s=0)
    held.wait_reached()  # planned against W_global = ck20: steps 20, versions 20
    bw.release_checkpoint(url, "ck20")
    # The hint is advisory and may go back (two snapshot writers overwrite it out of
    # order): the second collector sees snapshot 10 as the newest.
    open_store(url).put(keys.HINT_KEY, b'{"version": 10}')
    fast = bw.collect_garbage(url, grace_s=0)
    assert fast.reclaimed_steps == 40
    held.release()
    slow.result()  # loses the race, plans again from the newest state
    info = bw.inspect_namespace(url)  # would raise "reclaim ... goes back" on a bricked log
    assert info.reclaimed_steps == 40 and info.steps == 45
    with producer(url, "p") as p:
        commit(p, 2)
    bw.end_stream(url)
    assert read_all(url, state=checkpoint_at(url, 45, "ck45", start=ck40)) == [("p", 45), ("p", 46)]


def test_collector_racing_a_committing_producer_keeps_every_tgb(url):
    with producer(url, "p") as p:
        commit(p, 25)
    ck22 = checkpoint_at(url, 22, "ck22")
    store = PausingStore(url)
    held = store.pause("put_if_absent", VERSION_KEY)
    collecting = Background(bw.collect_garbage, store, grace_s=0)
    held.wait_reached()
    with producer(url, "p") as p:
        commit(p, 3)  # takes the version the collector wanted
    held.release()
    assert collecting.result().reclaimed_steps == 22
    bw.end_stream(url)
    assert [o for _, o in read_all(url, state=ck22)] == list(range(22, 28))


# -- 6. one namespace, one layout -------------------------------------------------------


def test_producer_of_another_layout_is_refused_at_construction(url):
    with bw.Producer(url, "four", dp=4, commit_policy=Manual()) as four:
        four.append(tgb("four", 0, 4))
    with pytest.raises(bw.LayoutError, match=r"dp=2 cp=1.*dp=4 cp=1"):
        bw.Producer(url, "two", dp=2)
    with pytest.raises(bw.LayoutError, match="dp=4 cp=2"):
        bw.Producer(url, "four-by-two", dp=4, cp=2)
    info = bw.inspect_namespace(url)
    assert info.layout == {"dp": 4, "cp": 1, "kind": "arrays"} and info.steps == 1
    assert set(info.producers) == {"four"}  # the refused producers claimed nothing


def test_tgb_of_another_payload_kind_is_refused_before_upload(url):
    with bw.Producer(url, "arrays", dp=2, commit_policy=Manual()) as arrays:
        arrays.append(tgb("arrays", 0, 2))
        arrays.append(tgb("arrays", 1, 2))  # dp=1 reads two TGBs a step
    with bw.Producer(url, "bytes", dp=2, commit_policy=Manual()) as raw:
        with pytest.raises(bw.LayoutError, match="arrays"):
            raw.append([b"a", b"b"])
    assert not [o for o in open_store(url).list("data/bytes/")]
    for dp in (1, 2, 4):  # every mesh still reads the namespace
        with bw.Consumer(url, dp=dp, rank=0, timeout_s=5) as consumer:
            assert next(consumer).step == 0


def test_racing_first_producers_of_two_layouts_one_is_refused(url):
    early = bw.Producer(url, "early", dp=2, commit_policy=Manual())
    early.append(tgb("early", 0, 2))
    late = bw.Producer(url, "late", dp=2, commit_policy=Manual())
    # Both saw kind unset; the first commit fixes it, the second producer's commit is refused.
    late.append([b"x", b"y"])
    early.flush()
    with pytest.raises(bw.LayoutError, match="arrays"):
        late.flush()
    early.close()
    late.close(flush=False)
    assert bw.inspect_namespace(url).steps == 1


# -- 8. cursors from elsewhere ---------------------------------------------------------


def test_cursor_from_another_namespace_is_refused_at_load(url, tmp_path):
    other = f"memory://other-{uuid.uuid4().hex}"
    for target in (url, other):
        with producer(target, "p") as p:
            commit(p, 3)
    foreign = checkpoint_at(other, 2, "ck")
    with bw.Consumer(url, dp=1, rank=0) as consumer:  # timeout_s=None: a hang would hang
        with pytest.raises(bw.ConfigError, match="saved from namespace"):
            consumer.load_state_dict(foreign)


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        ({"version": 999}, bw.ConfigError, "log ends at version"),
        ({"version": 2}, bw.ConfigError, "holds steps"),
        ({"version": 0}, bw.ConfigError, "at log version 0"),
        ({"namespace": 5}, bw.ConfigError, "namespace must be"),
    ],
)
def test_edited_cursor_is_refused_at_load(url, edit, error, match):
    with producer(url, "p") as p:
        commit(p, 5)
    cursor = checkpoint_at(url, 4, "ck")
    with bw.Consumer(url, dp=1, rank=0) as consumer, pytest.raises(error, match=match):
        consumer.load_state_dict({**cursor, **edit})


def test_cursor_of_reclaimed_data_says_so_at_load(url):
    with producer(url, "p") as p:
        commit(p, 30)
    old = checkpoint_at(url, 5, "old")
    bw.release_checkpoint(url, "old")
    checkpoint_at(url, 25, "new")
    bw.collect_garbage(url, grace_s=0)
    with bw.Consumer(url, dp=1, rank=0) as consumer, pytest.raises(bw.DataReclaimedError, match="step 5"):
        consumer.load_state_dict(old)
    with bw.Consumer(url, dp=1, rank=0, timeout_s=5) as fresh, pytest.raises(bw.DataReclaimedError):
        next(fresh)


# -- 10. background threads and collection bookkeeping --------------------------------


class BrokenLogStore(Store):
    """Raises a non-BatchWeave error on log-version puts after ``after`` of them."""

    def __init__(self, url: str, after: int) -> None:
        super().__init__(url)
        self.after = after

    def put_if_absent(self, key, data):
        if key.startswith("_log/0"):
            if self.after == 0:
                raise RuntimeError("simulated bug in the commit path")
            self.after -= 1
        super().put_if_absent(key, data)


def test_commit_thread_failing_on_any_error_fails_flush_instead_of_hanging(url):
    prod = bw.Producer(BrokenLogStore(url, after=1), "p", dp=1, commit_policy=Manual())
    prod.append(tgb("p", 0, 1))
    with pytest.raises(RuntimeError, match="simulated bug"):
        prod.flush(timeout_s=30)  # raised at once, not after the timeout
    with pytest.raises(RuntimeError, match="simulated bug"):
        prod.append(tgb("p", 1, 1))
    prod.close(flush=False)


class BrokenReadStore(Store):
    def get(self, key):
        if key.startswith("_log/0"):
            raise RuntimeError("simulated bug in the follow path")
        return super().get(key)


def test_follow_thread_failing_on_any_error_fails_next_instead_of_hanging(url):
    with producer(url, "p") as p:
        commit(p, 2)
    with bw.Consumer(BrokenReadStore(url), dp=1, rank=0) as consumer:  # timeout_s=None
        with pytest.raises(RuntimeError, match="simulated bug"):
            next(consumer)
        with pytest.raises(RuntimeError, match="simulated bug"):
            next(consumer)  # stays failed: never skips a step


def test_gc_deletes_watermarks_of_released_checkpoints_and_dry_run_counts(url):
    with producer(url, "p") as p:
        commit(p, 30)
    checkpoint_at(url, 5, "old")
    bw.release_checkpoint(url, "old")
    checkpoint_at(url, 25, "new")
    store = open_store(url)
    dry = bw.collect_garbage(url, grace_s=0, dry_run=True)
    assert dry.deleted_bytes > 0 and dry.deleted_versions > 0 and dry.deleted_snapshots > 0
    assert dry.deleted_watermarks == 2  # one mark and the release marker
    assert store.size("_checkpoints/old/_released") is not None  # a dry run deletes nothing
    real = bw.collect_garbage(url, grace_s=0)
    assert (real.deleted_bytes, real.deleted_versions, real.deleted_snapshots, real.deleted_watermarks) == (
        dry.deleted_bytes,
        dry.deleted_versions,
        dry.deleted_snapshots,
        dry.deleted_watermarks,
    )
    assert sorted(i.key for i in store.list("_checkpoints/")) == ["_checkpoints/new/0-0.json"]
    assert bw.inspect_namespace(url).reclaimed_steps == 25


# -- 5. a fork that got past the store: consumers check offsets as the replay does ------


def test_consumer_refuses_a_forked_stream_instead_of_reading_it(url):
    """On a store that let two racing commits "win", a later version may repeat or skip a
    producer's offsets. A consumer that starts mid-log cannot replay the whole log, but it
    checks every producer's offsets continue where they left off."""
    with producer(url, "p") as p:
        commit(p, 3)  # versions 2..4: p@0, p@1, p@2
    store = open_store(url)
    journal = Journal(store)
    state = journal.load_state()
    forked = log.LogVersion(  # as if a racing writer's p@1 had overwritten version 5
        format=log.LOG_FORMAT,
        version=5,
        first_step=3,
        tgbs=[journal.read_version(3).tgbs[0]],
        producers={"p": state.producers["p"]},
    )
    store.put_if_absent(keys.version_key(5), log.encode(forked))
    cursor = checkpoint_at(url, 1, "ck1")
    with bw.Consumer(url, dp=1, rank=0, timeout_s=5) as consumer:
        consumer.load_state_dict(cursor)
        assert [next(consumer).step for _ in range(2)] == [1, 2]
        with pytest.raises(bw.CorruptDataError, match=r"p@1 .* does not continue .* at 3"):
            next(consumer)


def test_collector_reading_marks_another_collector_deletes_carries_on(url):
    """Found by the state machine: a collector lists a released checkpoint's mark, another
    collector deletes it, and the first one's read of it must not fail the collection."""
    with producer(url, "p") as p:
        commit(p, 12)
    checkpoint_at(url, 3, "old")
    bw.release_checkpoint(url, "old")
    checkpoint_at(url, 10, "new")
    store = PausingStore(url)
    held = store.pause("get", r"_checkpoints/old/0-0\.json")
    first = Background(bw.collect_garbage, store, grace_s=0)
    held.wait_reached()
    assert bw.collect_garbage(url, grace_s=0).deleted_watermarks == 2
    held.release()
    assert first.result().reclaimed_steps == 10


def test_zombie_with_an_ambiguous_put_into_a_freed_key_is_fenced_and_leaves_nothing(url):
    """Found by the state machine: a zombie whose view GC overtook re-creates a freed log
    version with an ambiguous outcome; its retry then reads that version and one that does
    not follow it. That is a stale view, not a damaged log: the zombie must be fenced."""
    store = AmbiguousOnceStore(url)
    zombie = bw.Producer(store, "p", dp=1, commit_policy=Manual(), snapshot_every=2)  # version 1
    with bw.Producer(url, "p", dp=1, commit_policy=Manual(), snapshot_every=2) as p:  # versions 2..6
        commit(p, 4)
    checkpoint_at(url, 3, "ck3")
    bw.collect_garbage(url, grace_s=0)
    assert open_store(url).size(keys.version_key(2)) is None
    store.armed = True
    zombie.append(tgb("p", 0, 1))
    with pytest.raises(bw.ProducerFencedError):
        zombie.flush(timeout_s=30)
    zombie.close(flush=False)
    assert store.fired == keys.version_key(2)
    assert open_store(url).size(store.fired) is None  # deleted again
    assert_offsets_dense(url, {"p": 4})


def test_end_stream_is_idempotent_across_later_collections(url):
    with producer(url, "p") as p:
        commit(p, 5)
    ended = bw.end_stream(url)
    checkpoint_at(url, 4, "ck4")
    bw.collect_garbage(url, grace_s=0)  # commits a reclaim version after the marker
    assert bw.inspect_namespace(url).latest_version == ended + 1
    assert bw.end_stream(url) == ended


def test_a_young_log_growing_its_first_snapshot_is_not_mistaken_for_a_collection(url, caplog):
    """Found by `bench producers`: a writer that opened a log with versions but no snapshot
    anchored on "no snapshot exists", so a first snapshot written by anyone else before
    its first commit looked like a collection, and it reloaded. It anchors on version 1."""
    with producer(url, "first") as first:
        commit(first, 2)  # versions 1..3, no snapshot yet
    store = PausingStore(url)
    held = store.pause("put_if_absent", VERSION_KEY)
    opening = Background(producer, store, "late")  # loads versions 1..3, held at its claim
    held.wait_reached()
    with producer(url, "busy") as busy:
        commit(busy, 12)  # snapshot 10 appears
    with caplog.at_level("INFO", logger="batchweave.journal"):
        held.release()
        late = opening.result()
    late.close()
    assert "overtook" not in caplog.text
    assert_offsets_dense(url, {"first": 2, "busy": 12, "late": 0})


def test_a_resumed_consumer_checks_its_cursor_once(url, monkeypatch):
    """load_state_dict checks the cursor against the log; the pipeline does not load again."""
    with producer(url, "p") as p:
        commit(p, 30)
    cursor = checkpoint_at(url, 24, "ck24")
    with bw.Consumer(url, dp=1, rank=0, timeout_s=10) as consumer:
        consumer.load_state_dict(cursor)
        loads = []
        monkeypatch.setattr(Journal, "load_state", lambda journal, **kw: loads.append(kw))
        assert [next(consumer).step for _ in range(2)] == [24, 25]
        assert loads == []  # the pipeline read versions 25.. (and ahead), never the state again
