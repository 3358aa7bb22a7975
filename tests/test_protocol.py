"""The commit protocol and invariants I1-I7 on every backend: memory, local, S3, Azure.

Producers and consumers run in this process here (threads where they race); the
crash tests with real processes and SIGKILL are in test_crashes.py.
"""

from __future__ import annotations

import threading
import time
from functools import partial

import numpy as np
import pytest
from checks import assert_exactly_once, assert_ranks_agree
from worker import Eager, digest, origin_of, tgb

import batchweave as bw
from batchweave import keys, log
from batchweave import producer as producer_module
from batchweave.commit.policies import Manual, RecentCommitters
from batchweave.journal import Journal
from batchweave.store import Store, open_store


def read_all(url, mesh, rank, **kw):
    with bw.Consumer(url, **mesh, rank=rank, timeout_s=20, **kw) as consumer:
        return [{"step": b.step, "origin": list(origin_of(b.data)), "digest": digest(b.data)} for b in consumer]


def produce(url, producer_id, count, dp=2, cp=1, policy=None, pack_steps=None):
    with bw.Producer(
        url, producer_id, dp=dp, cp=cp, commit_policy=policy or Eager(), pack_steps=pack_steps
    ) as producer:
        for offset in range(producer.resume_offset, count):
            producer.append(tgb(producer_id, offset, dp * cp))


def test_uncommitted_tgbs_are_invisible_until_commit(backend_url):
    """I1: objects written by append are invisible until a log version references them."""
    producer = bw.Producer(backend_url, "p", dp=2, commit_policy=Manual(), pack_steps=1)
    for offset in range(3):
        producer.append(tgb("p", offset, 2))
    store = open_store(backend_url)
    assert len([o for o in store.list("data/")]) == 3  # the objects exist...
    consumer = bw.Consumer(backend_url, dp=2, rank=0, timeout_s=0.5)
    with pytest.raises(bw.StepTimeoutError, match="no step 0"):
        next(consumer)  # ...but no rank can see them
    producer.flush()
    consumer.timeout_s = 10  # the idle consumer has backed off; it must find them anyway
    assert [b.step for b in (next(consumer), next(consumer), next(consumer))] == [0, 1, 2]
    producer.close()
    consumer.close()


def test_racing_producers_give_every_rank_one_dense_order(backend_url):
    """I1+I2+I3: concurrent committers linearize; all 4 ranks see the same TGB at each step."""
    counts = {"a": 15, "b": 15, "c": 10}
    threads = [threading.Thread(target=produce, args=(backend_url, pid, n, 2, 2)) for pid, n in counts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bw.end_stream(backend_url)
    tgbs = assert_exactly_once(backend_url, counts)
    seen = {rank: read_all(backend_url, {"dp": 2, "cp": 2}, rank) for rank in range(4)}
    assert_ranks_agree(seen, tgbs)
    # Each rank got its own slice: the payload encodes the slice index.
    for rank, records in seen.items():
        for record in records:
            producer, offset = record["origin"]
            assert record["digest"] == digest(tgb(producer, offset, 4)[rank])


def test_restart_resumes_at_committed_offset_with_a_new_epoch(backend_url):
    """I3 across restarts: the log remembers the next offset; a restart claims epoch+1."""
    produce(backend_url, "p", 5)
    with bw.Producer(backend_url, "p", dp=2) as again:
        assert (again.resume_offset, again.epoch) == (5, 2)
        again.append(tgb("p", 5, 2))
    assert_exactly_once(backend_url, {"p": 6})


def test_zombie_is_fenced_and_commits_nothing_more(backend_url):
    """I3 with zombies: an older incarnation still running gets ProducerFencedError."""
    zombie = bw.Producer(backend_url, "p", dp=2, commit_policy=Manual())
    zombie.append(tgb("p", 0, 2))
    zombie.flush()
    successor = bw.Producer(backend_url, "p", dp=2, commit_policy=Manual())
    assert successor.resume_offset == 1 and successor.epoch == zombie.epoch + 1
    zombie.append(tgb("p", 1, 2))
    with pytest.raises(bw.ProducerFencedError, match="fenced by a newer incarnation"):
        zombie.flush()
    with pytest.raises(bw.ProducerFencedError):
        zombie.append(tgb("p", 2, 2))
    zombie.close()
    successor.append(tgb("p", 1, 2))
    successor.close()
    tgbs = assert_exactly_once(backend_url, {"p": 2})
    epochs = {t.source_offset: t.epoch for v in Journal(open_store(backend_url)).versions_after(0) for t in v.tgbs}
    assert epochs == {0: 1, 1: 2}, "the zombie's offset 1 must not be committed"
    assert len(tgbs) == 2


def test_ambiguous_commit_outcome_neither_duplicates_nor_drops(backend_url, monkeypatch):
    """I3 with a timeout after the store applied the write: the rebase recognizes it."""
    real = Store.put_if_absent
    failed = []

    def applied_then_timed_out(self, key, data):
        real(self, key, data)
        if key.startswith("_log/") and len(failed) < 3 and b'"tgbs":[[' in bytes(data):
            failed.append(key)
            raise bw.TransientStoreError(key, "simulated timeout after the write was applied")

    monkeypatch.setattr(Store, "put_if_absent", applied_then_timed_out)
    with bw.Producer(backend_url, "p", dp=2, commit_policy=Manual()) as producer:
        for offset in range(12):
            producer.append(tgb("p", offset, 2))
            producer.flush()
    assert len(failed) == 3
    assert_exactly_once(backend_url, {"p": 12})


def test_every_object_is_written_once(backend_url, monkeypatch):
    """I5: data, log versions and snapshots use create-only puts; only the hint and the
    head copies' slots (written in the background on an object store) are overwritten."""
    overwritten = []
    real_put = Store.put
    monkeypatch.setattr(Store, "put", lambda self, key, data: (overwritten.append(key), real_put(self, key, data)))
    with bw.Producer(backend_url, "p", dp=1, commit_policy=Manual(), snapshot_every=3) as producer:
        for offset in range(10):
            producer.append(tgb("p", offset, 1))
            producer.flush()
    copies = {key for key in overwritten if key.startswith(keys.HEAD_PREFIX)}
    assert overwritten and set(overwritten) - copies == {keys.HINT_KEY}


def test_consumer_resumes_from_state_dict_with_identical_bytes(backend_url):
    """I6: the cursor counts what was received; a restart replays byte-identical data."""
    produce(backend_url, "p", 12, dp=2, cp=2)
    bw.end_stream(backend_url)
    full = read_all(backend_url, {"dp": 2, "cp": 2}, rank=2)
    first = bw.Consumer(backend_url, dp=2, cp=2, rank=2, prefetch=8, timeout_s=10)
    received = [next(first) for _ in range(5)]  # prefetch has run ahead of this
    state = first.state_dict()
    first.close()
    assert state["step"] == 5 and received[-1].step == 4
    resumed = bw.Consumer(backend_url, dp=2, cp=2, rank=2, timeout_s=10)
    resumed.load_state_dict(state)
    rest = [{"step": b.step, "origin": list(origin_of(b.data)), "digest": digest(b.data)} for b in resumed]
    assert rest == full[5:]
    assert [digest(b.data) for b in received] == [r["digest"] for r in full[:5]]


def test_one_rank_reads_without_waiting_for_the_others(backend_url):
    """I7: nothing on the read path waits for another rank or a coordinator."""
    produce(backend_url, "p", 4, dp=4)
    bw.end_stream(backend_url)
    assert [r["step"] for r in read_all(backend_url, {"dp": 4}, rank=3)] == [0, 1, 2, 3]


def test_end_of_stream_stops_consumers_and_refuses_appends(backend_url):
    produce(backend_url, "p", 3)
    version = bw.end_stream(backend_url)
    assert bw.end_stream(backend_url) == version  # idempotent
    assert len(read_all(backend_url, {"dp": 2}, rank=1)) == 3
    with pytest.raises(bw.StreamEndedError, match="cannot start"):
        bw.Producer(backend_url, "late", dp=2)
    info = bw.inspect_namespace(backend_url)
    assert (info.steps, info.end_of_stream, info.producers["p"]["offset"]) == (3, True, 3)


def test_running_producer_cannot_append_after_the_stream_ends(backend_url):
    producer = bw.Producer(backend_url, "p", dp=2, commit_policy=Manual())
    producer.append(tgb("p", 0, 2))
    bw.end_stream(backend_url)
    with pytest.raises(bw.StreamEndedError, match="1 TGB\\(s\\) of producer 'p' from offset 0 were not committed"):
        producer.flush()
    with pytest.raises(bw.StreamEndedError):
        producer.append(tgb("p", 1, 2))
    producer.close()
    assert bw.inspect_namespace(backend_url).steps == 0


def test_close_without_flush_drops_uncommitted_tgbs(backend_url):
    with pytest.raises(RuntimeError, match="preprocessing failed"):
        with bw.Producer(backend_url, "p", dp=2, commit_policy=Manual()) as producer:
            producer.append(tgb("p", 0, 2))
            producer.flush()
            producer.append(tgb("p", 1, 2))
            raise RuntimeError("preprocessing failed")
    assert bw.inspect_namespace(backend_url).producers["p"]["offset"] == 1
    with bw.Producer(backend_url, "p", dp=2) as again:
        assert again.resume_offset == 1


def test_bad_append_input_is_rejected_and_nothing_committed_is_lost(backend_url):
    producer = bw.Producer(backend_url, "p", dp=2, commit_policy=Eager())
    producer.append(tgb("p", 0, 2))
    producer.flush()
    bad_inputs = [
        (tgb("p", 1, 3), bw.LayoutError, "needs dp\\*cp"),
        ([{"x": np.zeros(2)}, b"raw"], bw.LayoutError, "mixed layouts"),
        ([{"x": np.zeros(2)}, {"y": np.zeros(2)}], bw.LayoutError, "mixed layouts"),
        ([{"x": np.array([object()])}, {"x": np.zeros(1)}], bw.LayoutError, "not supported"),
        (["text", "text"], bw.LayoutError, "unsupported payload type str"),
        ({"x": np.zeros(2)}, bw.LayoutError, "list of dp\\*cp"),
    ]
    for slices, error, message in bad_inputs:
        with pytest.raises(error, match=message):
            producer.append(slices)
    with pytest.raises(bw.SourceOffsetError, match="is not the next offset 1"):
        producer.append(tgb("p", 0, 2), source_offset=0)
    producer.append(tgb("p", 1, 2))  # still usable, offset 1 was never taken
    producer.close()
    assert_exactly_once(backend_url, {"p": 2})
    assert len(read_all_until(backend_url, 2)) == 2


def read_all_until(url, steps):
    with bw.Consumer(url, dp=2, rank=0, timeout_s=10) as consumer:
        return [next(consumer) for _ in range(steps)]


def test_corrupt_and_truncated_objects_raise_typed_errors_naming_the_key(backend_url):
    produce(backend_url, "p", 3, pack_steps=1)  # each step an object of its own, cut below
    store = open_store(backend_url)
    versions = list(Journal(store).versions_after(0))
    damaged = versions[-1].tgbs[-1]  # step 2
    key = damaged.objects[0]
    body = bytearray(store.get(key))
    obj, offset, length, _ = damaged.slices[0]
    body[offset + length - 1] ^= 0xFF
    store.delete(key)
    store.put_if_absent(key, bytes(body))
    consumer = bw.Consumer(backend_url, dp=2, rank=0, timeout_s=10)
    assert [next(consumer).step for _ in range(2)] == [0, 1]  # what came before is intact
    with pytest.raises(bw.CorruptDataError, match=f"{key}.*checksum mismatch"):
        next(consumer)
    with pytest.raises(bw.CorruptDataError):
        next(consumer)  # never skips past the damaged step
    consumer.close()
    store.delete(key)
    store.put_if_absent(key, bytes(body[: offset + 3]))
    with bw.Consumer(backend_url, dp=2, rank=0, timeout_s=10) as again:
        next(again), next(again)
        with pytest.raises(bw.CorruptDataError, match=key):
            next(again)
    store.delete(key)
    store.put_if_absent(key, bytes(body[: max(1, offset - 1)]))  # cut before the slice starts
    with bw.Consumer(backend_url, dp=2, rank=0, timeout_s=10) as third:
        next(third), next(third)
        with pytest.raises(bw.CorruptDataError, match=f"{key}: truncated"):
            next(third)


def test_damaged_log_version_raises_typed_errors_and_keeps_earlier_steps(backend_url):
    produce(backend_url, "p", 2)
    store = open_store(backend_url)
    latest = bw.inspect_namespace(backend_url).latest_version
    bad_key = keys.version_key(latest + 1)
    store.put_if_absent(bad_key, b'{"format": "batchweave.log/1", "version": ')
    with bw.Consumer(backend_url, dp=2, rank=1, timeout_s=10) as consumer:
        assert [next(consumer).step for _ in range(2)] == [0, 1]
        with pytest.raises(bw.CorruptDataError, match=bad_key):
            next(consumer)
    with pytest.raises(bw.CorruptDataError, match="damaged log version"):
        bw.inspect_namespace(backend_url)
    with pytest.raises(bw.CorruptDataError, match=bad_key):
        bw.Producer(backend_url, "q", dp=2)
    assert [s for s, *_ in committed_tgbs_upto(backend_url, latest)] == [0, 1]


def committed_tgbs_upto(url, version):
    journal = Journal(open_store(url))
    return [
        (s, t)
        for v in range(1, version + 1)
        for s, t in zip(journal.read_version(v).steps(), journal.read_version(v).tgbs)
    ]


def test_log_keys_outside_the_namespace_are_rejected(backend_url):
    produce(backend_url, "p", 1)
    store = open_store(backend_url)
    latest = bw.inspect_namespace(backend_url).latest_version
    evil = Journal(store).read_version(latest)
    forged = log.LogVersion(
        format=log.LOG_FORMAT,
        version=latest + 1,
        first_step=1,
        tgbs=[log.TGBDescriptor(**{**_fields(evil.tgbs[0]), "objects": ["../../etc/passwd"], "source_offset": 1})],
        producers={"p": log.ProducerState(2, evil.tgbs[0].epoch, "x")},
    )
    store.put_if_absent(keys.version_key(latest + 1), log.encode(forged))
    with bw.Consumer(backend_url, dp=2, rank=0, timeout_s=10) as consumer:
        next(consumer)
        with pytest.raises(bw.CorruptDataError, match="not under the namespace's data/ prefix"):
            next(consumer)


def _fields(struct):
    return {f: getattr(struct, f) for f in struct.__struct_fields__}


def test_opening_costs_constant_requests_plus_the_tail(backend_url):
    """Cost model: snapshots every K versions keep open and commit O(1) + tail, not O(history)."""
    with bw.Producer(backend_url, "p", dp=1, commit_policy=Eager(), snapshot_every=10) as producer:
        for offset in range(45):
            producer.append(tgb("p", offset, 1))
            producer.flush()
    journal = Journal(open_store(backend_url), snapshot_every=10)
    state = journal.load_state()
    assert state.steps == 45 and state.version == 46
    # hint + snapshot@40 + probe@50 + versions 41..46 + the miss at 47 + the anchor re-read (I10)
    assert journal.requests == 1 + 1 + 1 + 6 + 1 + 1
    assert state == replay(backend_url)


def replay(url):
    """The state from version 1 on, ignoring snapshots."""
    return Journal(open_store(url)).catch_up(log.LogState())[0]


def test_commit_cost_does_not_grow_with_history(backend_url):
    """A commit reads only versions it has not seen: requests per commit stay flat."""
    with bw.Producer(backend_url, "p", dp=1, commit_policy=Manual(), snapshot_every=10) as producer:
        costs = []
        for offset in range(40):
            producer.append(tgb("p", offset, 1))
            before = producer.log_requests
            producer.flush()
            costs.append(producer.log_requests - before)
    # one probe for newer versions + one conditional put + one read of the anchor (I8)
    assert set(costs) == {3}


def test_stale_snapshot_hint_only_costs_probes(backend_url):
    with bw.Producer(backend_url, "p", dp=1, commit_policy=Eager(), snapshot_every=5) as producer:
        for offset in range(22):
            producer.append(tgb("p", offset, 1))
            producer.flush()
    store = open_store(backend_url)
    store.put(keys.HINT_KEY, b'{"version": 5}')
    assert Journal(store, snapshot_every=5).load_state() == replay(backend_url)
    store.put(keys.HINT_KEY, b"garbage")
    assert Journal(store, snapshot_every=5).load_state() == replay(backend_url)


def test_inspect_reports_producers_steps_and_bytes(backend_url):
    produce(backend_url, "a", 3)
    produce(backend_url, "b", 2)
    info = bw.inspect_namespace(backend_url)
    assert info.steps == 5
    assert info.producers == {"a": {"offset": 3, "epoch": 1}, "b": {"offset": 2, "epoch": 1}}
    assert info.bytes == sum(o.size for o in open_store(backend_url).list("data/"))
    assert info.latest_version == len(committed_tgbs_versions(backend_url))


def committed_tgbs_versions(url):
    return list(Journal(open_store(url)).versions_after(0))


def test_idle_consumer_backs_off(backend_url):
    """An idle rank probes only the next version, less and less often (on a local store
    while it waits in next(), on an object store on its background thread)."""
    produce(backend_url, "p", 1)
    consumer = bw.Consumer(backend_url, dp=2, rank=0, timeout_s=10, max_poll_interval_s=0.4)
    next(consumer)
    opened = consumer.metrics().log_requests  # the load that checks the cursor, and the first probes
    consumer.timeout_s = 2.0
    with pytest.raises(bw.StepTimeoutError):
        next(consumer)
    probes = consumer.metrics().log_requests - opened
    consumer.close()
    # Without backoff a 10 ms poll would make ~200 probes in 2 s.
    assert 3 <= probes <= 18


@pytest.mark.parametrize("policy", ["naive", "fixed10", "incr", "aimd", "dac"])
def test_inline_commit_mode_with_every_policy(backend_url, policy):
    """background_commit=False: the paper's single-loop producer (each TGB written in its
    append), same guarantees."""
    with bw.Producer(backend_url, "p", dp=2, commit_policy=policy, background_commit=False, pack_steps=1) as producer:
        assert producer._thread is None
        for offset in range(25):
            producer.append(tgb("p", offset, 2))
        if policy == "naive":
            assert producer.resume_offset == 25  # committed inside each append
    assert_exactly_once(backend_url, {"p": 25})


def test_published_metrics_show_in_inspect(backend_url):
    # DAC's, whose fragile-window estimate is among the counters (group commit has none).
    with bw.Producer(backend_url, "loud", dp=2, commit_policy="dac", publish_metrics=True) as loud:
        for offset in range(3):
            loud.append(tgb("loud", offset, 2))
            loud.flush()
    produce(backend_url, "quiet", 1)
    producers = bw.inspect_namespace(backend_url).producers
    assert "metrics" not in producers["quiet"]
    published = producers["loud"]["metrics"]
    # Published with the third commit, which they count: the log is never one commit behind.
    assert published["attempts"] == 3 and published["successes"] == 3 and published["tgbs_committed"] == 3
    assert published["fragile_window_ema_s"] > 0


class Recording:
    """A policy that records what the producer tells it."""

    name = "recording"

    def __init__(self):
        self.observed = []

    def wait_s(self, pending_tgbs, since_last_attempt_s):
        return float("inf")

    def observe(self, fragile_window_s, producers, success):
        self.observed.append((fragile_window_s, producers, success))


def test_policy_learns_the_producer_count_from_the_log(backend_url):
    """DAC's N comes from the committed producer states, with no message between producers."""
    produce(backend_url, "a", 1)
    produce(backend_url, "b", 1)
    policy = Recording()
    with bw.Producer(backend_url, "c", dp=2, commit_policy=policy) as producer:
        assert policy.observed[0][1:] == (3, True)  # the claim primes it: a, b and itself
        produce(backend_url, "d", 1)  # a fourth producer joins meanwhile
        producer.append(tgb("c", 0, 2))
        producer.flush()
    assert [(n, ok) for _, n, ok in policy.observed[1:]] == [(4, True)]
    assert all(window > 0 for window, _, _ in policy.observed)


def test_departed_producers_stop_counting_for_the_policy(backend_url, monkeypatch):
    """A pool that shrinks from 6 producers to 2: the survivors' N falls to 2, not stays at 6."""
    window_s = 2.0  # RecentCommitters' floor, shortened from 10 s for the test
    monkeypatch.setattr(producer_module, "RecentCommitters", partial(RecentCommitters, min_window_s=window_s))
    policies = {pid: Recording() for pid in "abcdef"}
    producers = {pid: bw.Producer(backend_url, pid, dp=2, commit_policy=policies[pid]) for pid in "abcdef"}
    offsets = dict.fromkeys(producers, 0)

    def one_round():
        for pid, producer in producers.items():
            producer.append(tgb(pid, offsets[pid], 2))
            producer.flush()
            offsets[pid] += 1

    try:
        one_round()
        assert [n for _, n, _ in policies["f"].observed] == [6, 6]  # claim, then its first commit
        for pid in "cdef":
            producers.pop(pid).close()
        left_at = time.monotonic()
        while policies["a"].observed[-1][1] != 2 or policies["b"].observed[-1][1] != 2:
            assert time.monotonic() - left_at < 30, (policies["a"].observed, policies["b"].observed)
            one_round()
        assert time.monotonic() - left_at >= window_s  # not before the departed aged out
        after_claim = [n for _, n, _ in policies["a"].observed][1:]  # its claim saw only itself
        # From 6 down to 2, never back up: the versions between two looks, which a producer
        # that jumps to the head counts instead of who committed them, fall with the pool.
        assert after_claim[0] == 6 and after_claim[-1] == 2, after_claim
        assert after_claim == sorted(after_claim, reverse=True), after_claim
        assert producers["a"].metrics()["producers_active"] == 2
        assert producers["a"].metrics()["producers_seen"] == 6
    finally:
        for producer in producers.values():
            producer.close()


def test_append_has_written_the_slices_before_it_returns(fast_url):
    """The producer writes the caller's arrays without copying them first (no join on a
    local directory): what is committed is what the arrays held during ``append``."""
    arrays = [np.arange(1000, dtype=np.int64) + rank for rank in range(2)]
    with bw.Producer(fast_url, "p", dp=2, commit_policy=Manual()) as producer:
        producer.append([{"x": a} for a in arrays])
        for a in arrays:
            a[:] = -1  # the caller reuses its buffers at once
        producer.flush()
    for rank in range(2):
        with bw.Consumer(fast_url, dp=2, rank=rank, timeout_s=10) as consumer:
            np.testing.assert_array_equal(next(consumer).data["x"], np.arange(1000) + rank)
