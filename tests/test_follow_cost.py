"""What a writer reads and decodes to follow the log, counted (issue 44, "Commits that keep up").

Group commit's producers read every version: any of them may fold the others' intents
next, and needs every producer's offset for it. Each version holds, in its head, one row
per run of a producer's TGBs and one state per committer, and every TGB's object keys,
slice table and size in its body (``log``, format 3); a writer's journal decodes the head
only. So what a producer decodes per TGB committed does not grow with the TGBs' slices, nor
with the producers committing, and what it decodes per version does not grow with each
producer's TGBs in it; the log a reader reads holds the rest. Nor does a writer *read* the
body of a version too long to read whole at once: it reads its head's bytes (one ranged GET,
``LogObjects.get_head``). Versions are built as group commit builds them (one TGB of each
producer a version, or ``per_producer``), committed in a fixed order: no timing.
"""

from __future__ import annotations

import time
import uuid
from typing import NamedTuple

import msgspec
import pytest

from batchweave import keys, logrules
from batchweave.journal import Journal
from batchweave.log import Layout, TGBDescriptor
from batchweave.store import open_store

VERSIONS = 4


def _tgb(pid: str, offset: int, epoch: int, slices: int) -> TGBDescriptor:
    return TGBDescriptor(
        producer=pid,
        epoch=epoch,
        source_offset=offset,
        dp=slices,
        cp=1,
        kind="bytes",
        objects=[keys.data_key(pid, epoch, offset, "ab", 0)],
        slices=[(0, i * 4096, 4096, 2**31 + i) for i in range(slices)],
        nbytes=4096 * slices,
    )


class Followed(NamedTuple):
    decoded: int  # bytes of versions the writer decoded
    read: int  # bytes of the log's objects it read
    requests: int  # the log requests it made
    stored: int  # bytes of the versions it caught up on, as stored


def _follow(producers: int, slices: int, per_producer: int = 1) -> Followed:
    """``producers`` claim; a writer's journal loads the log; ``VERSIONS`` versions each fold
    ``per_producer`` TGBs of every producer; the writer catches up: what that cost it."""
    url = f"memory://follow-cost/{uuid.uuid4().hex}"
    store = open_store(url)
    journal = Journal(store)
    state = journal.load_state()
    pids = [f"prep-{i:04d}" for i in range(producers)]
    for pid in pids:
        claim = logrules.build_claim(state, pid, uuid.uuid4().hex, time.time(), Layout(slices, 1))
        state = journal.commit(state, lambda s, c=claim: c).state
    follower = Journal(open_store(url), heads_only=True)
    followed = follower.load_state()
    decoded, read, requests = follower.bytes_decoded, follower.bytes_read, follower.requests
    for turn in range(VERSIONS):
        offsets = range(turn * per_producer, (turn + 1) * per_producer)
        tgbs = [_tgb(pid, offset, state.producers[pid].epoch, slices) for pid in pids for offset in offsets]
        moved = {
            pid: msgspec.structs.replace(state.producers[pid], offset=offsets.stop, last_version=0) for pid in pids
        }
        version = logrules.next_version(state, time.time(), tgbs=tgbs, producers=moved)
        state = journal.commit(state, lambda s, v=version: v).state
    followed, versions = follower.catch_up(followed)
    assert versions == VERSIONS and followed.steps == VERSIONS * producers * per_producer
    stored = sum(len(store.get(keys.version_key(state.version - v))) for v in range(VERSIONS))
    return Followed(follower.bytes_decoded - decoded, follower.bytes_read - read, follower.requests - requests, stored)


@pytest.mark.parametrize("producers", [8, 32])
def test_a_writer_decodes_the_same_bytes_whatever_the_slices_of_each_tgb(producers):
    # 32 and 64 slices: the same digits in a TGB's row (whose it is, its offset, layout, bytes).
    few, many = _follow(producers, 32), _follow(producers, 64)
    assert abs(few.decoded - many.decoded) <= 4 * VERSIONS  # but a clock reading's digits
    assert many.stored > 1.8 * few.stored
    assert many.stored > 10 * many.decoded  # the slice tables are stored (readers need them), never decoded


def test_what_a_writer_decodes_per_tgb_is_flat_from_8_to_128_producers():
    per_tgb = {}
    for producers in (8, 128):
        followed = _follow(producers, 32)
        per_tgb[producers] = followed.decoded / (VERSIONS * producers)
        assert followed.decoded * 5 < followed.stored  # format 1: every byte stored was decoded
    # A row and a producer's state a TGB, whatever the pool: only a few digits longer.
    assert per_tgb[128] <= 1.05 * per_tgb[8], per_tgb
    assert per_tgb[128] < 200, per_tgb


@pytest.mark.parametrize("producers", [8, 128])
def test_what_a_writer_decodes_per_version_does_not_grow_with_each_producers_tgbs_in_it(producers):
    # Group commit folds every producer's waiting TGBs into a version: a row of its head per
    # producer whatever their number (log format 3), where format 2 had a row per TGB.
    one, many = _follow(producers, 32, per_producer=1), _follow(producers, 32, per_producer=16)
    assert many.stored > 12 * one.stored  # sixteen times the TGBs are stored for readers...
    assert many.decoded <= 1.05 * one.decoded, (one, many)  # ...and a writer decodes one row each


@pytest.mark.parametrize("producers", [32, 128])
def test_a_writer_reads_only_the_head_of_a_version_too_long_to_read_whole(producers):
    # 16 TGBs of each producer a version: 0.5 to 2 MB of slice tables, 2 to 9 KB of head.
    followed = _follow(producers, 32, per_producer=16)
    assert followed.stored > 40 * followed.decoded
    # Each version's head and its framing ("[<length>," and ","), and the proof's re-read of
    # the newest version's head: what it reads grows with the heads, never with the bodies.
    assert followed.read <= followed.decoded * (VERSIONS + 1) / VERSIONS + 32 * (VERSIONS + 1), followed
    # A GET a version, the one that finds no newer, and the proof's re-read: one ranged GET
    # each, the heads being short.
    assert followed.requests == VERSIONS + 2, followed


def test_a_writer_reads_a_short_version_whole_in_one_request():
    # Versions under the first ranged GET's bytes are read whole: kept for the segment a
    # writer writes (one GET each, as before heads were read apart).
    followed = _follow(8, 32)
    assert followed.read >= followed.stored
    assert followed.requests == VERSIONS + 2, followed
