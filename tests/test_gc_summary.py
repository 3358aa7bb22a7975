"""Garbage collection reads what changed since its last run (``lifecycle.gcsummary``):
each run leaves a summary of the TGBs not reclaimed yet, the next reads it and only the
versions committed since; a summary that is damaged, from another namespace or older than
the reclaim point costs requests, never an object."""

from __future__ import annotations

import logging
import uuid

import msgspec
import pytest
from checks import RecordingStore
from worker import tgb

import batchweave as bw
from batchweave import collect_garbage, keys
from batchweave.commit.policies import Manual
from batchweave.journal import Journal
from batchweave.lifecycle import gc
from batchweave.lifecycle.gcsummary import GC_PREFIX, decode_summary, encode_summary, summary_key
from batchweave.log import LogState, digest
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
    crashed = bw.Producer(url, "crashed", dp=2, commit_policy=Manual(), pack_steps=1)
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


def test_a_summary_whose_version_digest_does_not_match_is_not_trusted():
    """A summary names the version it was read through and that version's digest: a
    summary whose digest does not match the log (that version re-created, or the summary
    from another history) is not used. Here it also lies about a TGB's object: trusted,
    that TGB's real object would look unreferenced and go as an orphan."""
    url = namespace(40)
    counted_gc(url)
    (key,) = summaries(url)
    store = open_store(url)
    summary = decode_summary(store.get(key), key)
    first = summary.tgbs[0]
    lying = msgspec.structs.replace(
        summary,
        digest="f" * len(summary.digest),
        tgbs=[msgspec.structs.replace(first, objects=["data/p/elsewhere"]), *summary.tgbs[1:]],
    )
    store.delete(key)
    store.put_if_absent(key, encode_summary(lying))  # well formed: only the log can tell
    report, counts = counted_gc(url)
    assert counts[LOG_VERSION] >= 40  # read the log instead
    assert report.orphans == [] and len(list(store.list("data/"))) == 40


def test_a_summary_is_usable_from_the_reclaim_point_to_the_head():
    url = namespace(20)
    counted_gc(url)
    store = open_store(url)
    journal = Journal(store)
    state = journal.load_state()
    usable = gc._Summaries(store, journal).usable

    def reclaimed_at(versions: int) -> LogState:
        return msgspec.structs.replace(state, reclaimed=msgspec.structs.replace(state.reclaimed, versions=versions))

    summary = usable(state)
    assert summary is not None and summary.version == state.version
    assert usable(reclaimed_at(state.version)) == summary  # read through the reclaim point itself
    assert usable(reclaimed_at(state.version + 1)) is None  # the version it was read through is gone


def test_a_summary_is_written_once_per_version_and_never_for_an_empty_log():
    url = namespace(20)
    counted_gc(url)
    (newest_key,) = summaries(url)
    store = RecordingStore(url)
    journal = Journal(store)
    newest = decode_summary(store.get(newest_key), newest_key)
    written = gc._Summaries(store, journal)
    store.calls.clear()
    written.write(None)  # a plan with gaps
    written.write(msgspec.structs.replace(newest, version=0))  # a log with no version yet
    written.write(newest)  # the newest summary's version again
    assert store.calls == []
    written.write(msgspec.structs.replace(newest, version=1))
    assert summaries(url) == [summary_key(1), newest_key]  # only older ones are deleted
    gc._Summaries(store, journal).write(msgspec.structs.replace(newest, version=1))  # there already
    assert summaries(url) == [summary_key(1), newest_key]


def test_the_tgbs_not_reclaimed_are_read_from_the_reclaim_point_on_around_versions_deleted_half_way():
    """With no summary, every version from the reclaim point to the head is read once; a
    version an earlier collection deleted before it stopped is read around, not the end."""
    url = namespace(12)  # versions 1 (the claim) to 13, steps 0-11
    store = RecordingStore(url)
    journal = Journal(store)
    state = journal.load_state()
    store.delete(keys.version_key(5))  # steps 3
    store.calls.clear()
    tgbs = gc._unreclaimed_tgbs(journal, state, None)
    assert store.calls == [("get", keys.version_key(v)) for v in range(1, state.version + 1)]
    assert sorted(tgbs) == [step for step in range(12) if step != 3]
    later = msgspec.structs.replace(state, reclaimed=msgspec.structs.replace(state.reclaimed, versions=8, steps=6))
    store.calls.clear()
    assert sorted(gc._unreclaimed_tgbs(journal, later, None)) == list(range(6, 12))
    assert store.calls == [("get", keys.version_key(v)) for v in range(8, state.version + 1)]


@pytest.mark.parametrize("body", [b'{"format": "\xff"}', b"[" * 10_000 + b"]" * 10_000, b"{not json"])
def test_a_summary_that_does_not_decode_is_corrupt_data_naming_its_key(body):
    # Regression: only msgspec.DecodeError was caught; invalid UTF-8 escaped untyped.
    key = summary_key(7)
    with pytest.raises(bw.CorruptDataError, match=f"{key}: not a garbage-collection summary"):
        decode_summary(body + b"\n" + digest(body).encode(), key)
