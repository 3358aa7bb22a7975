"""The node's shared log (``batchweave.reading.sharedlog``): a model test against a plain model,
and its rules one by one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchweave import log
from batchweave.log import LogVersion, ReadVersion
from batchweave.reading.sharedlog import (
    ALONE,
    RESTART,
    RESTART_WINDOW,
    SERVE,
    NodeBehind,
    SharedLog,
    check_first,
    decode_versions,
)


def version(n: int, *, end: bool = False) -> ReadVersion:
    delta = LogVersion(format=log.LOG_FORMAT, version=n, first_step=n - 1, tgbs=[], producers={}, end_of_stream=end)
    return ReadVersion(delta, log.encode(delta))


def test_a_rank_below_what_is_kept_restarts_the_follower_only_while_nothing_is_proven():
    shared = SharedLog()
    assert shared.ask("a", 5) == RESTART  # the first rank starts the follower
    assert shared.ask("b", 3) == RESTART  # a little below, nothing proven yet: costs nobody anything
    assert not shared.publish(1, [version(5)])  # the replaced one must stop
    assert shared.publish(2, [version(3), version(4)])
    assert [v.delta.version for v in decode_versions(shared.versions_from(3, 1 << 20), 3)] == [3, 4]
    assert shared.ask("a", 5) == SERVE
    assert shared.ask("c", 2) == ALONE  # below what others are served from: reads on its own
    assert shared.generation == 2 and shared.versions_from(3, 1 << 20) is not None


def test_no_request_pulls_the_follower_back_or_drives_it_ahead_of_the_others():
    """A careless or stale client of the node: far ahead, or from version 1 after GC."""
    shared = SharedLog(restart_window=10)
    assert shared.ask("a", 50) == RESTART
    shared.publish(1, [version(50), version(51)])
    assert shared.ask("b", 51) == SERVE
    assert shared.ask("bogus", 10**12) == ALONE  # far beyond anything proven
    assert shared.ask("reclaimed", 1) == ALONE  # far below: its own follower says what is true for it
    assert shared.generation == 1 and shared.versions_from(50, 1 << 20) is not None
    first = SharedLog(restart_window=10)
    assert first.ask("bogus", 10**12) == RESTART  # the first asker starts it anywhere ...
    assert first.ask("a", 5) == RESTART  # ... and an honest one below takes it back while nothing is proven
    first.publish(2, [version(5)])
    assert first.wants_more()  # read ahead from the honest rank, not towards the bogus place
    first.publish(2, [version(n) for n in range(6, 5 + first.read_ahead + 1)])
    assert not first.wants_more()


def test_versions_every_rank_is_past_are_forgotten_and_the_slowest_rank_is_let_go_past_the_budget():
    kept = SharedLog(retain_bytes=10_000, restart_window=2)
    kept.ask("a", 1)
    kept.publish(1, [version(1), version(2), version(3)])
    kept.ask("a", 3)
    assert kept.ask("late", 1) == SERVE  # within the window behind the slowest: served, not sent alone
    shared = SharedLog(retain_bytes=10_000, restart_window=0)
    shared.ask("a", 1)
    shared.ask("b", 1)
    shared.publish(1, [version(1), version(2), version(3)])
    shared.ask("a", 3)
    shared.ask("b", 3)  # both past 1 and 2: forgotten
    assert shared.versions_from(1, 1 << 20) is None and shared.versions_from(3, 1 << 20) is not None
    assert shared.ask("c", 1) == ALONE  # below what is kept, others served: on its own
    tight = SharedLog(retain_bytes=1)
    tight.ask("slow", 1)
    tight.ask("fast", 1)
    tight.publish(1, [version(1), version(2)])
    tight.ask("fast", 3)
    assert tight.trim(force=False)  # over budget, but the slow rank is close: the follower waits
    assert tight.versions_from(1, 1 << 20) is not None
    tight.trim(force=True)  # let go: what only it needed is forgotten
    assert tight.versions_from(1, 1 << 20) is None


def test_a_rank_far_below_what_is_kept_follows_on_its_own_rather_than_pulling_the_others_back():
    shared = SharedLog()
    far = RESTART_WINDOW + 10
    shared.ask("training", far)
    shared.publish(1, [version(far)])
    assert shared.ask("evaluation", 1) == ALONE
    assert shared.generation == 1  # the training ranks' follower goes on
    alone = SharedLog()
    alone.ask("only", far)
    alone.leave("only")
    assert alone.ask("evaluation", 1) == RESTART  # nobody else to hold back


def test_a_failure_reaches_no_rank_as_an_error_and_the_next_ask_starts_again():
    shared = SharedLog()
    shared.ask("a", 1)
    shared.ask("b", 1)
    shared.publish(1, [version(1)])
    shared.fail(1, "boom")
    assert shared.versions_from(1, 1 << 20) is not None  # version 1 first
    assert shared.versions_from(2, 1 << 20) is None and shared.failed  # then: read alone
    shared.fail(0, "stale")  # from a replaced follower: ignored
    assert shared.ask("a", 1) == SERVE  # what was proven before the failure is still served
    assert shared.ask("b", 2) == RESTART and not shared.failed  # a new follower, from b's place


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 30), st.integers(0, 4)), max_size=60))
def test_every_rank_gets_exactly_the_versions_published_in_order(steps):
    """Ranks ask from random places while a follower publishes; whatever a rank is handed
    is a contiguous run of genuine versions from where it asked."""
    shared = SharedLog(retain_bytes=200)
    follower_at: int | None = None
    for rank, first, publish in steps:
        answer = shared.ask(rank, first)
        if answer == ALONE:
            continue
        if answer == RESTART:
            follower_at = first
        if publish and follower_at is not None:
            batch = [version(n) for n in range(follower_at, follower_at + publish)]
            if shared.publish(shared.generation, batch):
                follower_at += publish
            shared.trim(force=True)
        parts = shared.versions_from(first, 100)
        if parts is not None:
            handed = decode_versions(parts, first)
            assert [v.delta.version for v in handed] == list(range(first, first + len(handed)))
            assert all(bytes(v.data) == bytes(version(v.delta.version).data) for v in handed)


def test_the_follower_reads_at_most_read_ahead_versions_beyond_the_furthest_rank():
    shared = SharedLog(read_ahead=3)
    assert not shared.wants_more()  # nobody asks
    shared.ask("a", 1)
    assert shared.wants_more()
    shared.publish(1, [version(1), version(2), version(3)])
    assert not shared.wants_more()  # 3 ahead of the request for 1
    shared.ask("a", 2)
    assert shared.wants_more()


def test_the_follower_reads_nothing_past_the_end_of_the_stream_until_it_is_started_again():
    """Ranks stop at the end; their hub kept probing the head until the last one closed
    (CI at 5873bd9: 28 log requests for a node against 22 for one rank alone)."""
    shared = SharedLog()
    shared.ask("a", 1)
    shared.publish(1, [version(1), version(2, end=True)])
    assert shared.ask("a", 3) == SERVE  # a rank's read-ahead asks past it: answered from what is kept ...
    assert not shared.wants_more() and shared.at_head  # ... and the follower reads nothing more
    assert shared.ask("a", 0) == RESTART  # below what is kept, nobody else served: it starts again
    assert shared.wants_more()  # a new follower reads (to the end again)


def test_a_rank_far_behind_is_let_go_when_the_budget_runs_out():
    far = RESTART_WINDOW + 5
    shared = SharedLog(retain_bytes=1)
    shared.ask("slow", 1)
    shared.ask("fast", 1)
    shared.publish(1, [version(n) for n in range(1, far + 2)])
    shared.ask("fast", far + 1)
    shared.trim(force=False)  # the slow rank is over a window behind: let go
    assert shared.versions_from(1, 1 << 20) is None and shared.versions_from(far + 1, 1 << 20) is not None
    assert shared.ask("slow", 2) == ALONE


def test_a_rank_checks_its_cursors_version_itself_and_reads_alone_when_it_differs():
    """The node's follower proves the log, not a rank's cursor: the rank compares the first
    version it is handed with the digest its checkpoint saved."""
    cursor = version(5)
    anchor = (5, log.digest(cursor.data))
    check_first([cursor, version(6)], anchor)  # the same bytes: fine
    check_first([version(6)], anchor)  # not the cursor's version: nothing to compare
    check_first([cursor], None)  # a start has no anchor
    other = LogVersion(format=log.LOG_FORMAT, version=5, first_step=99, tgbs=[], producers={})
    with pytest.raises(NodeBehind) as behind:
        check_first([ReadVersion(other, log.encode(other))], anchor)
    assert behind.value.next_version == 5  # alone from the cursor: its own proof says what is wrong
