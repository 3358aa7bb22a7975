"""Namespaces never overlap (invariant I13, issue 43).

A namespace at ``s3://bucket`` and another at ``s3://bucket/data``: ``batchweave gc
s3://bucket --grace-s 0`` deleted every object of the inner one as an orphan (its log,
its head copies, its TGBs), and the same on a local directory, whichever was created
first. Now a collection deletes only keys it can prove are its own namespace's, and a
producer refuses to create a namespace inside another's prefix or around one. Both on a
local directory and on real object-store servers (S3 on moto and on SeaweedFS, Azurite),
in either order.
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
import pytest

import batchweave as bw
from batchweave import cli, keys
from batchweave.commit.policies import Manual
from batchweave.errors import NamespaceOverlapError, StorePermissionError
from batchweave.journal import headcopies, overlap
from batchweave.store import Store, open_store
from batchweave.store.urls import normalize_url, parent_urls
from batchweave.testing import servers


def publish(url: str, producer: str = "p", steps: int = 3, pack_steps: int = 1) -> None:
    """``steps`` TGBs of one producer, committed (an object each, unless packed)."""
    with bw.Producer(url, producer, dp=1, commit_policy=Manual(), pack_steps=pack_steps) as writer:
        for offset in range(writer.resume_offset, writer.resume_offset + steps):
            writer.append([{"x": np.full(50, offset, dtype=np.int64)}], source_offset=offset)
    copies_landed()


def copies_landed(timeout_s: float = 30.0) -> None:
    """Wait for the head copies an object store's committers put in the background, so
    that a listing taken now is the namespace's whole."""
    deadline = time.monotonic() + timeout_s
    while headcopies._background._in_flight:
        assert time.monotonic() < deadline, "head copies still in flight"
        time.sleep(0.01)


def stored(url: str) -> dict[str, int]:
    """Every object under ``url``'s prefix, with its size."""
    return {info.key: info.size for info in open_store(url, create=False).list()}


def own(url: str) -> dict[str, int]:
    """The objects of the namespace at ``url``, with their sizes: the keys of its layout
    (the inner one's prefix also holds the outer one's TGB objects)."""
    return {key: size for key, size in stored(url).items() if keys.is_own_key(key)}


def mark(url: str, steps: int, checkpoint: str) -> None:
    with bw.Consumer(url, dp=1, rank=0, node_sharing=False, timeout_s=20) as consumer:
        for _ in range(steps - consumer.state_dict()["step"]):
            next(consumer)
        consumer.mark_checkpoint(checkpoint)


@pytest.fixture
def nesting_as_before(monkeypatch):
    """Creation without the check: namespaces made by a release before it, or by two
    creations at the same moment (which both pass it). Collection must be safe anyway."""
    monkeypatch.setattr("batchweave.commit.claiming.refuse_overlap", lambda store, state: None)


# -- a collection deletes only its own keys ------------------------------------------------


@pytest.mark.parametrize("order", ["outer first", "inner first"])
def test_a_collection_deletes_none_of_the_objects_of_the_namespaces_inside_and_beside_it(
    store_process_backend_url, nesting_as_before, order
):
    outer = store_process_backend_url  # local, S3 on moto, Azurite, S3 on SeaweedFS
    inner = f"{outer}/data"  # the issue's: among the outer one's own TGB objects
    deeper = f"{outer}/runs/a"
    beside = f"{outer}-2"  # whose prefix starts with the outer one's
    others = [inner, deeper, beside]
    for url in [outer, *others] if order == "outer first" else [*others, outer]:
        publish(url, producer="p" if url != inner else "q", steps=4)
    theirs = {url: own(url) for url in others}
    assert all(len(objects) >= 6 for objects in theirs.values())  # a log and TGB objects each
    # The outer namespace has work to do: two steps to reclaim, and an orphan of its own
    # producer (a retried append's debris: an epoch before the log's).
    mark(outer, 2, "ck")
    orphan = keys.data_key("p", 0, 0, "0badc0de", 0)
    open_store(outer).put(orphan, b"debris")

    report = bw.collect_garbage(outer, grace_s=0)

    assert {url: own(url) for url in others} == theirs  # not one object of theirs
    assert report.orphans == [orphan] and orphan not in stored(outer)  # its own orphans still go
    assert report.reclaimed_steps == 2 and len(report.deleted_objects) == 3
    assert report.foreign_keys == len(theirs[inner])  # under data/, which it lists: counted, left alone
    # And the inner one's collection leaves the outer one's TGB objects (inside its prefix) alone.
    outer_objects = own(outer)
    inner_report = bw.collect_garbage(inner, grace_s=0)
    assert own(outer) == outer_objects and inner_report.deleted_objects == []
    for url in others:
        assert bw.inspect_namespace(url).steps == 4  # each is whole


@pytest.mark.s3
def test_the_issue_as_reported_gc_of_a_bucket_leaves_the_namespace_at_its_data_prefix(
    moto_server, monkeypatch, nesting_as_before, capsys
):
    """``s3://bucket`` (an empty prefix) and ``s3://bucket/data``, in a bucket of their own:
    ``batchweave gc s3://bucket --grace-s 0`` printed ``deleted 23 objects ... 23 orphans``
    and ``inspect s3://bucket/data`` then found no namespace."""
    for var in servers.S3_ENV_UNSET:
        monkeypatch.delenv(var, raising=False)
    for var, value in servers.s3_env(moto_server).items():
        monkeypatch.setenv(var, value)
    bucket = f"nest-{uuid.uuid4().hex[:12]}"
    servers.create_bucket(moto_server, bucket)
    outer, inner = f"s3://{bucket}", f"s3://{bucket}/data"
    publish(inner, producer="q", steps=6)
    publish(outer, steps=6)
    theirs = own(inner)
    assert cli.main(["gc", outer, "--grace-s", "0"]) == 0
    line = capsys.readouterr().out
    assert "0 orphans (0 bytes)" in line and f"left alone {len(theirs)} keys" in line
    assert own(inner) == theirs and bw.inspect_namespace(inner).steps == 6


def test_a_collection_leaves_staging_files_of_a_namespace_inside_it(tmp_path, nesting_as_before):
    """On a local directory a killed put leaves ``<key>#<digits>`` beside its object; the
    outer namespace's collection deletes its own, not the inner one's."""
    outer = tmp_path / "ns"
    publish(str(outer / "data"), producer="q")
    publish(str(outer))
    mine = outer / "data" / "p" / "e000001" / "000000000009-0badc0de.0.bwb#123456789012345678"
    theirs = outer / "data" / "data" / "q" / "e000001" / "000000000009-0badc0de.0.bwb#123456789012345678"
    for staging in (mine, theirs):
        staging.write_bytes(b"a put killed mid-write")
    report = bw.collect_garbage(str(outer), grace_s=0)
    assert report.deleted_staging == 1 and not mine.exists() and theirs.exists()


def test_a_collection_deletes_no_key_under_its_prefixes_that_is_not_of_its_layout(tmp_path):
    """Keys under the prefixes a collection lists (intents, tickets, probes, the log, data)
    that match none of the namespace's layout are someone else's: counted, kept. One of
    each kind that is ours and dead still goes."""
    url = str(tmp_path / "ns")
    publish(url)
    store = open_store(url)
    strangers = [
        "data/notes.txt",
        "data/p/e000001/readme.md",
        "data/unknown/e000001/000000000000-0badc0de.0.bwb",  # a producer the log never had
        "data/p/e000009/000000000000-0badc0de.0.bwb",  # an epoch the log never gave it
        "_intents/p/e000000/notes.json",
        "_claims/p/e000001/readme",
        "_probe/left-behind",
        "_log/7.json",
        "_log/_snapshots/old.json",
    ]
    for key in [*strangers, "_checkpoints/ck/notes.json"]:  # (no watermark: not read, not counted)
        store.put(key, b"not batchweave's")
    dead_probe = f"{keys.PROBE_PREFIX}{'0' * 32}"
    store.put(dead_probe, b"1")
    dry = bw.collect_garbage(url, grace_s=0, dry_run=True)
    report = bw.collect_garbage(url, grace_s=0)
    assert report.foreign_keys == dry.foreign_keys == len(strangers)
    assert report.deleted_probes == 1 and report.orphans == []
    assert {*strangers, "_checkpoints/ck/notes.json"} <= stored(url).keys() and dead_probe not in stored(url)


# -- creating a namespace inside another, or around one ---------------------------------------


@pytest.mark.parametrize("order", ["outer first", "inner first"])
@pytest.mark.parametrize("below", ["data", "runs/a"])
def test_creating_a_namespace_inside_another_or_around_one_is_refused_naming_both(
    store_process_backend_url, order, below
):
    outer, inner = store_process_backend_url, f"{store_process_backend_url}/{below}"
    first, second = (outer, inner) if order == "outer first" else (inner, outer)
    publish(first)
    before = stored(outer)
    with pytest.raises(NamespaceOverlapError) as refused:
        bw.Producer(second, "q", dp=1)
    error = refused.value
    assert isinstance(error, bw.ConfigError)
    assert (error.url, error.other, error.inside) == (
        normalize_url(second),
        normalize_url(first),
        order == "outer first",
    )
    assert normalize_url(outer) in str(error) and normalize_url(inner) in str(error)
    assert "must not nest" in str(error)
    assert stored(outer) == before  # refused before anything was written: no ticket, no version
    publish(f"{outer}-beside")  # beside it is fine, whatever its name begins with
    publish(first, steps=1)  # and the first goes on


def test_the_check_costs_one_listing_per_level_once_per_namespace(process_backend_url, monkeypatch):
    """A creation lists each prefix above (one request each on an object store) and its
    own prefix; a producer of a namespace that exists, and every commit, list nothing."""
    listed: list[tuple[str, str]] = []
    list_first = Store.list_first

    def counted(self, prefix, limit):
        listed.append((self.url, prefix))
        return list_first(self, prefix, limit)

    monkeypatch.setattr(Store, "list_first", counted)
    url = normalize_url(process_backend_url)
    publish(url, steps=5)
    assert listed == [*((parent, keys.LOG_PREFIX) for parent in parent_urls(url)), (url, "")]
    listed.clear()
    publish(url, producer="p2", steps=5)
    publish(url, steps=2)
    assert listed == []


def test_a_prefix_above_that_may_not_be_listed_is_skipped_saying_so(tmp_path, monkeypatch, caplog):
    """Credentials that may list only inside the namespace (``batchweave policy``'s) cannot
    look above it: the creation goes on, and says at INFO what it could not check."""
    url = normalize_url(str(tmp_path / "ns"))
    list_first = Store.list_first

    def denied_above(self, prefix, limit):
        if self.url != url:
            raise StorePermissionError(prefix, "access denied", action="s3:ListBucket")
        return list_first(self, prefix, limit)

    monkeypatch.setattr(Store, "list_first", denied_above)
    with caplog.at_level(logging.INFO, logger="batchweave.journal.overlap"):
        publish(url)
    assert bw.inspect_namespace(url).steps == 3
    assert any("could not check" in r.getMessage() and "access denied" in r.getMessage() for r in caplog.records)


def test_a_prefix_full_of_other_things_is_checked_up_to_a_bound_saying_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(overlap, "BELOW_LIMIT", 3)
    url = str(tmp_path / "ns")
    for n in range(5):
        open_store(url).put(f"notes/{n}.txt", b"x")
    with caplog.at_level(logging.WARNING, logger="batchweave.journal.overlap"):
        publish(url)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "checked the first 3" in warning and "must not nest" in warning


def test_memory_stores_do_not_nest():
    """Each memory:// URL is a store of its own: nothing to look at, nothing listed."""
    publish("memory://overlap-outer")
    publish("memory://overlap-outer/data")
    assert Store("memory://overlap-outer").ancestors() == []


# -- what a dry run of a namespace of packs says ----------------------------------------------


def test_a_dry_run_of_packs_counts_the_objects_and_bytes_it_would_delete_alike(tmp_path, capsys):
    """Four TGBs to a pack: reclaiming steps 0 and 1 deletes no object (steps 2 and 3 still
    read their pack). The dry run said ``would delete 0 objects (1600 bytes of TGBs)``; now
    the bytes are those of the objects it would delete, and the TGBs' bytes reclaimed are
    counted apart."""
    url = str(tmp_path / "ns")
    publish(url, steps=8, pack_steps=4)
    first_pack = sorted(key for key in stored(url) if keys.parse_data_key(key) is not None)[0]
    mark(url, 2, "ck-2")
    dry = bw.collect_garbage(url, grace_s=0, dry_run=True)
    assert dry.reclaimed_steps == 2 and dry.reclaimed_bytes > 0
    assert dry.deleted_objects == [] and dry.deleted_bytes == 0
    assert cli.main(["gc", url, "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert f"reclaimed below step 2 ({dry.reclaimed_bytes} bytes of TGBs" in line
    assert "would delete 0 TGB objects (0 bytes)" in line

    bw.collect_garbage(url, grace_s=0)
    mark(url, 5, "ck-5")
    bw.release_checkpoint(url, "ck-2")  # now past the first pack's last TGB (step 3)
    pack_bytes = stored(url)[first_pack]
    dry = bw.collect_garbage(url, grace_s=0, dry_run=True)
    done = bw.collect_garbage(url, grace_s=0)
    assert dry.deleted_objects == done.deleted_objects == [first_pack]
    assert dry.deleted_bytes == done.deleted_bytes == pack_bytes
    assert dry.reclaimed_bytes == done.reclaimed_bytes > 0  # steps 2, 3 and 4's share
    assert first_pack not in stored(url)
