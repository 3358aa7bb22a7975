"""Checkpoint-aligned lifecycle on every backend: watermarks, W_global, garbage
collection (I4), orphans, backpressure and DataReclaimedError."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading

import pytest
from checks import assert_exactly_once
from worker import digest, tgb

import batchweave as bw
from batchweave.commit.policies import Manual
from batchweave.lifecycle.watermarks import global_watermark, read_watermarks
from batchweave.store import open_store


def produce(url, producer_id, count, dp=2):
    with bw.Producer(url, producer_id, dp=dp, commit_policy=Manual()) as producer:
        for offset in range(producer.resume_offset, count):
            producer.append(tgb(producer_id, offset, dp))
            producer.flush()


def train(url, ranks, steps, checkpoint_every, dp=2):
    """Every rank reads ``steps`` steps, marking a checkpoint every few; returns the saved
    cursors per checkpoint and each rank's digests by step."""
    saved, seen = {}, {}
    consumers = [bw.Consumer(url, dp=dp, rank=r, timeout_s=20) for r in range(ranks)]
    for step in range(steps):
        for rank, consumer in enumerate(consumers):
            batch = next(consumer)
            seen.setdefault(rank, {})[batch.step] = digest(batch.data)
        if (step + 1) % checkpoint_every == 0:
            name = f"step-{step + 1:04d}"
            saved[name] = [c.state_dict() for c in consumers]
            for consumer in consumers:
                consumer.mark_checkpoint(name)
    for consumer in consumers:
        consumer.close()
    return saved, seen


def resume(url, state, rank, steps, dp=2):
    with bw.Consumer(url, dp=dp, rank=rank, timeout_s=20) as consumer:
        consumer.load_state_dict(state)
        return {b.step: digest(b.data) for _, b in zip(range(steps), consumer)}


def test_rollback_to_every_live_checkpoint_replays_identical_bytes(backend_url):
    produce(backend_url, "p", 30)
    saved, seen = train(backend_url, 2, 25, checkpoint_every=5)
    for old in ("step-0005", "step-0010"):
        bw.release_checkpoint(backend_url, old)
    report = bw.collect_garbage(backend_url, grace_s=0)
    assert report.w_global_step == 15 and report.reclaimed_steps == 15
    assert len(report.deleted_objects) == 15 and report.deleted_bytes > 0
    for name in ("step-0015", "step-0020", "step-0025"):
        start = int(name[-4:])
        for rank in range(2):
            replay = resume(backend_url, saved[name][rank], rank, 25 - start)
            assert replay == {s: seen[rank][s] for s in range(start, 25)}, f"{name} rank {rank} replayed other bytes"
    with pytest.raises(bw.DataReclaimedError, match="step 5 was reclaimed.*oldest step still available is 15"):
        resume(backend_url, saved["step-0005"][0], 0, 1)
    with pytest.raises(bw.DataReclaimedError, match="oldest step still available is 15"):
        resume(
            backend_url,
            {**saved["step-0005"][0], "version": 0, "position_numerator": 0, "position_denominator": 1, "step": 0},
            0,
            1,
        )


def test_gc_is_idempotent_and_dry_run_deletes_nothing(backend_url):
    produce(backend_url, "p", 12)
    train(backend_url, 2, 10, checkpoint_every=10)
    store = open_store(backend_url)
    before = sorted(o.key for o in store.list())
    dry = bw.collect_garbage(backend_url, grace_s=0, dry_run=True)
    assert dry.dry_run and len(dry.deleted_objects) == 10
    assert sorted(o.key for o in store.list()) == before
    first = bw.collect_garbage(backend_url, grace_s=0)
    assert sorted(first.deleted_objects) == sorted(dry.deleted_objects)
    again = bw.collect_garbage(backend_url, grace_s=0)
    assert again.deleted_objects == [] and again.reclaimed_steps == 10
    assert bw.inspect_namespace(backend_url).steps == 12


def test_a_partly_marked_checkpoint_protects_nothing_and_holds_nothing_back(backend_url):
    produce(backend_url, "p", 20)
    consumers = [bw.Consumer(backend_url, dp=2, rank=r, timeout_s=20) for r in range(2)]
    for _ in range(5):
        for c in consumers:
            next(c)
    consumers[0].mark_checkpoint("crashed-between-marks")  # rank 1 died before marking
    assert global_watermark(read_watermarks(open_store(backend_url))) is None
    assert bw.collect_garbage(backend_url, grace_s=0).deleted_objects == []  # nothing is protected...
    for _ in range(5):
        for c in consumers:
            next(c)
    for c in consumers:
        c.mark_checkpoint("complete")
        c.close()
    report = bw.collect_garbage(backend_url, grace_s=0)
    assert report.w_global_step == 10  # ...and the partial one at step 5 holds nothing back


def test_marking_is_idempotent_and_ids_are_not_reused(backend_url):
    produce(backend_url, "p", 4)
    consumer = bw.Consumer(backend_url, dp=2, rank=0, timeout_s=20)
    next(consumer)
    consumer.mark_checkpoint("ckpt")
    consumer.mark_checkpoint("ckpt")  # a retry after a crash writes the same watermark
    next(consumer)
    with pytest.raises(bw.ConfigError, match="must not be reused"):
        consumer.mark_checkpoint("ckpt")
    with pytest.raises(bw.ConfigError, match="checkpoint_id"):
        consumer.mark_checkpoint("../evil")
    consumer.close()


@pytest.mark.parametrize("backend_url", ["local", pytest.param("s3", marks=pytest.mark.s3)], indirect=True)
def test_releasing_a_mistyped_checkpoint_is_an_error_and_the_real_one_keeps_pinning(backend_url):
    produce(backend_url, "p", 6)
    train(backend_url, 2, 4, checkpoint_every=2)  # step-0002 and step-0004, both live
    store = open_store(backend_url)

    def w_global():
        oldest = global_watermark(read_watermarks(store))
        return oldest.checkpoint if oldest else None

    with pytest.raises(bw.CheckpointNotFoundError) as caught:
        bw.release_checkpoint(backend_url, "step-002")  # a typo of step-0002
    message = str(caught.value)
    assert message.startswith(f"{store.url}: no checkpoint 'step-002' to release")
    assert "did you mean 'step-0002' or 'step-0004'?" in message and "missing_ok=True" in message
    assert isinstance(caught.value, LookupError) and caught.value.live == ("step-0002", "step-0004")
    assert w_global() == "step-0002", "the checkpoint meant still pins its data"
    # Nothing was written for the typo: a checkpoint marked later under that id is not born released.
    assert list(store.list("_checkpoints/step-002/")) == []
    assert bw.release_checkpoint(backend_url, "step-002", missing_ok=True) is False
    assert list(store.list("_checkpoints/step-002/")) == []

    assert bw.release_checkpoint(backend_url, "step-0002") is True
    assert w_global() == "step-0004"
    assert bw.release_checkpoint(backend_url, "step-0002") is True  # released again: quiet, no change
    assert w_global() == "step-0004"
    assert bw.collect_garbage(backend_url, grace_s=0).deleted_watermarks == 3  # 2 marks and the release
    # Collected, the released checkpoint is forgotten: a re-release script needs missing_ok.
    with pytest.raises(bw.CheckpointNotFoundError, match="its checkpoints not released are 'step-0004'"):
        bw.release_checkpoint(backend_url, "old-one")
    assert bw.release_checkpoint(backend_url, "step-0002", missing_ok=True) is False
    assert w_global() == "step-0004"


def test_orphans_are_collected_after_the_grace_period_and_live_pending_is_kept(backend_url):
    crashed = bw.Producer(backend_url, "p", dp=2, commit_policy=Manual(), pack_steps=1)
    crashed.append(tgb("p", 0, 2))
    crashed.flush()
    crashed.append(tgb("p", 1, 2))  # written, never committed: the process dies
    crashed.close(flush=False)
    live = bw.Producer(backend_url, "p", dp=2, commit_policy=Manual(), pack_steps=1)
    live.append(tgb("p", 1, 2))  # pending in the live incarnation
    store = open_store(backend_url)
    data = sorted(o.key for o in store.list("data/"))
    assert len(data) == 3
    assert bw.collect_garbage(backend_url, grace_s=3600).orphans == []  # too young
    report = bw.collect_garbage(backend_url, grace_s=0)
    assert len(report.orphans) == 1 and "/e000001/000000000001-" in report.orphans[0]
    live.flush()
    live.close()
    assert_exactly_once(backend_url, {"p": 2})
    with bw.Consumer(backend_url, dp=2, rank=1, timeout_s=20) as consumer:
        assert [next(consumer).step for _ in range(2)] == [0, 1]


def test_backpressure_holds_append_until_a_checkpoint_is_marked(backend_url):
    producer = bw.Producer(backend_url, "p", dp=2, commit_policy=Manual(), max_lag=4)
    appended = []
    progress = threading.Condition()

    def run():
        for offset in range(8):
            producer.append(tgb("p", offset, 2))
            producer.flush()
            with progress:
                appended.append(offset)
                progress.notify_all()

    def appended_count_stays(count):
        with progress:
            progress.wait_for(lambda: len(appended) >= count, timeout=20)
            # Nothing more may come while W_global stands still: give it a fair chance.
            return not progress.wait_for(lambda: len(appended) > count, timeout=1.0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    consumers = [bw.Consumer(backend_url, dp=2, rank=r, timeout_s=20) for r in range(2)]
    assert appended_count_stays(4), "append went past max_lag without a checkpoint"
    for _ in range(3):
        for c in consumers:
            next(c)
    for c in consumers:
        c.mark_checkpoint("ckpt-3")
    assert appended_count_stays(7)  # W_global = 3: steps up to 3 + 4 may be committed
    for _ in range(4):
        for c in consumers:
            next(c)
    for c in consumers:
        c.mark_checkpoint("ckpt-7")
    assert appended_count_stays(7), "W_global is the oldest live checkpoint: ckpt-3 still holds it"
    bw.release_checkpoint(backend_url, "ckpt-3")
    thread.join(20)
    assert appended == list(range(8))
    producer.close()
    for c in consumers:
        c.close()


def test_gc_while_producers_commit_and_consumers_mark(backend_url):
    """Randomized: GC runs repeatedly while two producers commit and two ranks read and
    mark; afterwards every live checkpoint replays and every producer can recover."""
    rng = random.Random()
    stop = threading.Event()
    errors = []

    def producer(pid):
        try:
            produce(backend_url, pid, 20)
        except Exception as exc:
            errors.append(exc)

    def collector():
        while not stop.is_set():
            try:
                bw.collect_garbage(backend_url, grace_s=0)
            except bw.ConfigError as exc:
                # An object-store namespace exists from its first commit (or mark) on: before
                # that, collect_garbage refuses it as a mistyped URL would be.
                if not str(exc).startswith(f"no BatchWeave namespace at {backend_url}: nothing committed yet"):
                    errors.append(exc)
            except Exception as exc:
                errors.append(exc)
            stop.wait(rng.uniform(0, 0.05))

    threads = [threading.Thread(target=producer, args=(p,)) for p in ("a", "b")]
    threads.append(threading.Thread(target=collector))
    for t in threads:
        t.start()
    saved, seen = train(backend_url, 2, 35, checkpoint_every=rng.choice([3, 4, 5]))
    live = sorted(saved)[-3:]
    for name in sorted(saved)[:-3]:
        bw.release_checkpoint(backend_url, name)
    for t in threads[:2]:
        t.join()
    stop.set()
    threads[2].join()
    assert errors == []
    bw.collect_garbage(backend_url, grace_s=0)
    for name in live:
        start = saved[name][0]["step"]
        for rank in range(2):
            assert resume(backend_url, saved[name][rank], rank, 35 - start) == {
                s: seen[rank][s] for s in range(start, 35)
            }
    for pid in ("a", "b"):
        with bw.Producer(backend_url, pid, dp=2) as again:
            assert again.resume_offset == 20
    assert bw.inspect_namespace(backend_url).steps == 40


def test_gc_command_line(tmp_path):
    url = str(tmp_path / "ns")
    produce(url, "p", 6)
    train(url, 2, 4, checkpoint_every=4)
    done = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "gc", url, "--grace-s", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["w_global_step"] == 4 and report["deleted_object_count"] == 4 and "deleted_objects" not in report
