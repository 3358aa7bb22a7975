"""The node's shared log (``batchweave.sharedlog``): a model test against a plain model,
and its rules one by one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from batchweave import log
from batchweave.log import LogVersion, ReadVersion
from batchweave.sharedlog import SharedLog, decode_versions


def version(n: int) -> ReadVersion:
    delta = LogVersion(format=log.LOG_FORMAT, version=n, first_step=n - 1, tgbs=[], producers={})
    return ReadVersion(delta, log.encode(delta))


def test_a_rank_below_what_is_kept_restarts_the_follower_and_keeps_what_was_proven():
    shared = SharedLog()
    assert shared.ask("a", 5)  # the first rank starts the follower
    assert shared.publish(1, [version(5), version(6)])
    assert [v.delta.version for v in decode_versions(shared.versions_from(5, 1 << 20), 5)] == [5, 6]
    assert not shared.ask("b", 6)
    assert shared.ask("c", 2)  # below: a new follower from 2
    assert not shared.publish(1, [version(7)])  # the replaced one must stop
    assert shared.versions_from(6, 1 << 20) is not None  # proven versions stay


def test_versions_every_rank_is_past_are_forgotten_and_a_full_log_waits_for_the_slowest():
    shared = SharedLog(retain_bytes=1)
    shared.ask("a", 1)
    shared.ask("b", 1)
    shared.publish(1, [version(1), version(2), version(3)])
    assert shared.full()  # b has not moved: nothing to forget
    shared.ask("a", 3)
    assert shared.full()
    shared.ask("b", 3)  # both past 1 and 2: forgotten
    assert shared.versions_from(1, 1 << 20) is None and shared.versions_from(3, 1 << 20) is not None
    assert shared.ask("c", 1)  # a rank asking for them restarts the follower


def test_a_failure_reaches_a_rank_only_after_every_version_before_it():
    shared = SharedLog()
    shared.ask("a", 1)
    shared.publish(1, [version(1)])
    shared.fail(1, "boom")
    assert shared.versions_from(1, 1 << 20) is not None  # version 1 first
    assert shared.versions_from(2, 1 << 20) is None and shared.failure == "boom"
    shared.fail(0, "stale")  # from a replaced follower: ignored
    assert shared.failure == "boom"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 30), st.integers(0, 4)), max_size=60))
def test_every_rank_gets_exactly_the_versions_published_in_order(steps):
    """Ranks ask from random places while a follower publishes; whatever a rank is handed
    is a contiguous run of genuine versions from where it asked."""
    shared = SharedLog(retain_bytes=200)
    follower_at: int | None = None
    for rank, first, publish in steps:
        if shared.ask(rank, first):
            follower_at = first
        if publish and follower_at is not None:
            batch = [version(n) for n in range(follower_at, follower_at + publish)]
            if shared.publish(shared.generation, batch):
                follower_at += publish
        parts = shared.versions_from(first, 100)
        if parts is not None:
            handed = decode_versions(parts, first)
            assert [v.delta.version for v in handed] == list(range(first, first + len(handed)))
            assert all(bytes(v.data) == bytes(version(v.delta.version).data) for v in handed)
