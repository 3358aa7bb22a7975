"""Garbage collection reads what changed since its last run (``lifecycle.gcsummary``):
each run leaves a summary of the TGBs not reclaimed yet, the next reads it and only the
versions committed since; a summary that is damaged, from another namespace or older than
the reclaim point costs requests, never an object."""

from __future__ import annotations

import logging
import uuid

from worker import tgb

import batchweave as bw
from batchweave import collect_garbage
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.lifecycle.gcsummary import GC_PREFIX, decode_summary, encode_summary
from batchweave.store import open_store
from benchmarks.scale_count import LOG_VERSION, CountingStore, Tally, by_class
from benchmarks.scale_measure import INSTANT


def namespace(versions: int, url: str | None = None) -> str:
    """``versions`` TGBs, one version each (after the claim), dp=2."""
    url = url or f"memory://gc-summary-{uuid.uuid4().hex}"
    with bw.Producer(url, "p", dp=2, commit_policy=Manual()) as producer:
        for offset in range(producer.resume_offset, producer.resume_offset + versions):
            producer.append(tgb("p", offset, 2))
            producer.flush()
    return url


def counted_gc(url: str, **kwargs) -> tuple[bw.GCReport, dict[str, int]]:
    tally = Tally()
    report = collect_garbage(CountingStore(url, tally, "gc", INSTANT), grace_s=0.0, **kwargs)
    return report, dict(by_class(tally.requests))


def summaries(url: str) -> list[str]:
    return sorted(info.key for info in open_store(url).list(GC_PREFIX))


def mark(url: str, steps: int, name: str) -> None:
    for rank in range(2):
        with bw.Consumer(url, dp=2, rank=rank) as consumer:
            for _ in range(steps):
                next(consumer)
            consumer.mark_checkpoint(name)


def test_a_run_with_nothing_new_reads_no_history():
    """With no checkpoint nothing is reclaimed, yet every run read every version to find
    the referenced objects: 1,600 GETs at 1,601 versions. Now the second run reads the
    summary and the version it names, at 100 versions as at 400."""
    costs = {}
    for versions in (100, 400):
        url = namespace(versions)
        _, first = counted_gc(url)
        assert first[LOG_VERSION] >= versions  # no summary yet: the whole log
        _, repeat = counted_gc(url)
        costs[versions] = sum(repeat.values())
        assert repeat[LOG_VERSION] <= 5, repeat
    assert costs[100] == costs[400], costs


def test_a_run_reads_only_the_versions_committed_since_the_last():
    url = namespace(200)
    counted_gc(url)
    _, nothing_new = counted_gc(url)
    namespace(10, url)  # eleven more versions: a claim and ten TGBs
    _, after = counted_gc(url)
    # Each new version is read at most twice: by the load of the newest state (from its
    # snapshot on) and by the collection's scan past the summary.
    assert 11 <= after[LOG_VERSION] - nothing_new[LOG_VERSION] <= 22, (nothing_new, after)


def test_reclaiming_from_a_summary_deletes_exactly_the_steps_below_w_global():
    url = namespace(60)
    counted_gc(url)  # the summary of all 60 steps
    mark(url, 40, "ck")
    report, _ = counted_gc(url)
    store = open_store(url)
    journal = Journal(store)
    expected = {
        key
        for version in journal.versions_after(0)
        for step, t in zip(version.steps(), version.tgbs, strict=True)
        if step < 40
        for key in t.objects
    }
    assert report.reclaimed_steps == 40 and set(report.deleted_objects) == expected
    remaining = {info.key for info in store.list("data/")}
    assert len(remaining) == 20 and not remaining & expected
    assert len(summaries(url)) == 1  # the older summary went with the run that wrote the newer


def test_orphans_are_found_from_a_summary_too():
    url = namespace(30)
    counted_gc(url)
    crashed = bw.Producer(url, "crashed", dp=2, commit_policy=Manual())
    crashed.append(tgb("crashed", 0, 2))  # uploaded, never committed
    orphan = next(info.key for info in open_store(url).list("data/crashed/"))
    crashed.close(flush=False)
    bw.Producer(url, "crashed", dp=2, commit_policy=Manual()).close()  # a new incarnation fences it
    report, _ = counted_gc(url)
    assert report.orphans == [orphan]
    assert len(list(open_store(url).list("data/p/"))) == 30  # every committed TGB kept


def test_a_damaged_summary_is_ignored_with_a_warning_and_costs_only_requests(caplog):
    url = namespace(50)
    counted_gc(url)
    (key,) = summaries(url)
    store = open_store(url)
    summary = decode_summary(store.get(key), key)
    # Valid JSON naming one wrong key: without the digest line, that TGB's real object
    # would look unreferenced and be deleted as an orphan.
    wrong = summary.tgbs[0].objects[0].replace("0000", "9999", 1)
    forged = encode_summary(summary).replace(summary.tgbs[0].objects[0].encode(), wrong.encode())
    store.delete(key)
    store.put_if_absent(key, forged)
    with caplog.at_level(logging.WARNING, logger="batchweave.lifecycle.gc"):
        report, counts = counted_gc(url)
    assert "digest does not match" in caplog.text and key in caplog.text
    assert counts[LOG_VERSION] >= 50  # read the log instead
    assert report.orphans == [] and len(list(store.list("data/"))) == 50


def test_a_summary_from_another_namespace_or_behind_the_reclaim_point_is_not_used():
    url, other = namespace(40), namespace(40)
    counted_gc(other)
    (key,) = summaries(other)
    store = open_store(url)
    store.put_if_absent(key, open_store(other).get(key))  # the same version number, another log
    report, counts = counted_gc(url)
    assert counts[LOG_VERSION] >= 40 and report.orphans == []
    assert len(list(store.list("data/"))) == 40
