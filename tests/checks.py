"""Invariant checks shared by the protocol and crash tests: read the log back and judge it;
a store that records the requests it makes, for the tests that count them; and a Ray temp
root of a test's own."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator

from batchweave import keys, log, logrules
from batchweave.journal import Journal
from batchweave.store import Store, open_store


class RecordingStore(Store):
    """A store that records every request it makes, as (request, key), in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []

    def _call(self, key, op, request, nbytes=0, *, conditional=False):
        self.calls.append((request, key))
        return super()._call(key, op, request, nbytes, conditional=conditional)


def committed_tgbs(url: str) -> list[tuple[int, str, int, int]]:
    """Every committed TGB as (step, producer, source_offset, version), replaying the whole log."""
    journal = Journal(open_store(url))
    state = log.LogState()
    out = []
    for delta in journal.versions_after(0):
        state = logrules.apply_version(state, delta, keys.version_key(delta.version))  # validates I2/I3 rules
        out.extend((step, t.producer, t.source_offset, delta.version) for step, t in zip(delta.steps(), delta.tgbs))
    return out


def assert_exactly_once(url: str, expected: dict[str, int]) -> list[tuple[int, str, int, int]]:
    """Steps are dense from 0; each producer's offsets are exactly 0..n-1 in commit order."""
    tgbs = committed_tgbs(url)
    assert [s for s, *_ in tgbs] == list(range(len(tgbs))), "steps are not dense"
    offsets: dict[str, list[int]] = defaultdict(list)
    for _, producer, offset, _ in tgbs:
        offsets[producer].append(offset)
    assert {p: o for p, o in offsets.items()} == {p: list(range(n)) for p, n in expected.items() if n}
    return tgbs


def assert_referenced_objects_exist(url: str) -> None:
    """I4: every object the retained log references (steps not reclaimed) is still there, whole."""
    store = open_store(url)
    sizes = {o.key: o.size for o in store.list("data/")}
    journal = Journal(store)
    reclaimed = journal.load_state().reclaimed
    for delta in journal.versions_after(max(0, reclaimed.versions - 1)):
        for step, t in zip(delta.steps(), delta.tgbs):
            if step < reclaimed.steps:
                continue
            for index, key in enumerate(t.objects):
                ends = [off + length for obj, off, length, _ in t.slices if obj == index]
                assert key in sizes and sizes[key] > max(ends), f"{key} is missing or truncated"


def assert_ranks_agree(seen_by_rank: dict[int, list[dict]], tgbs: list[tuple[int, str, int, int]]) -> None:
    """Every rank saw every step once, in order, and each step came from the TGB the log names."""
    by_step = {step: [producer, offset] for step, producer, offset, _ in tgbs}
    for rank, seen in seen_by_rank.items():
        assert [s["step"] for s in seen] == list(range(len(tgbs))), f"rank {rank} saw a gap or a repeat"
        for s in seen:
            assert s["origin"] == by_step[s["step"]], f"rank {rank} step {s['step']} came from the wrong TGB"


def read_pool_shards(url: str, dp: int) -> list[int]:
    """The shard each step holds, in step order, as rank 0 of a ``dp``-wide job reads them
    (for the pool tests: ``pool_work.tgb_of`` writes the shard number into every slice)."""
    from batchweave import Consumer

    with Consumer(url, dp=dp, rank=0, timeout_s=30) as consumer:
        return [int(batch.data["shard"][0]) for batch in consumer]  # pyright: ignore[reportIndexIssue]


def check_pool_exactly_once_in_order(url: str, shards: int, producers: int, dp: int) -> None:
    """Every shard in exactly one step, and each producer's shards in their offset order."""
    seen = read_pool_shards(url, dp)
    assert sorted(seen) == list(range(shards))
    for owner in range(producers):
        mine = [s for s in seen if s % producers == owner]
        assert mine == sorted(mine)


@contextlib.contextmanager
def own_ray_temp_root() -> Iterator[str]:
    """A Ray temp root of this test's own, removed after: every file Ray writes (its sessions,
    sockets and the ``ray_current_cluster`` file a ``Cluster`` writes under the *default* root)
    lands there, never in /tmp/ray, which another Ray user of the machine may own. Short: Ray's
    socket paths under it must stay within the 107 bytes of a Unix socket."""
    root = tempfile.mkdtemp(prefix="bw-ray-")
    os.mkdir(os.path.join(root, "ray"))  # Ray's default root under RAY_TMPDIR, which a Cluster writes into
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root
    try:
        yield root
    finally:
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(root, ignore_errors=True)
