"""The rules of ``keys`` that say whether a key is this namespace's (I13), pure.

A collection deletes only keys of its own layout: every key its writers create matches
``keys.LAYOUT`` in full, and no key of another namespace below it ever does, whatever
the nesting, since every such key starts (after that namespace's root) with a prefix
whose first segment is no name of ours.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from batchweave import keys
from batchweave.commit.claims import claim_key, parse_claim_key
from batchweave.intent import intent_key, parse_intent_key
from batchweave.lifecycle.gcsummary import summary_key, summary_version
from batchweave.lifecycle.watermarks import Watermark, released_key
from batchweave.log import Layout
from batchweave.segment import segment_key
from batchweave.shardlist import record_key


def every_kind_of_key(producer: str = "p0") -> dict[str, str]:
    """One key of each kind, as the writers that own them build it."""
    mark = Watermark("ck-1", 2, 1, 1, 0, Fraction(3), 7)
    return {
        "version": keys.version_key(7),
        "snapshot": keys.snapshot_key(100),
        "segment": segment_key(32),
        "hint": keys.HINT_KEY,
        "head copy": keys.head_copy_key(71, 3),
        "tgb": keys.data_key(producer, 2, 41, "0badc0de", 1),
        "intent": intent_key(producer, 2, 41),
        "claim": claim_key(producer, 3, Layout(2, 1), "c0ffee"),
        "pool record": record_key("pool-a", 4),
        "watermark": mark.key,
        "release": released_key("ck-1"),
        "probe": f"{keys.PROBE_PREFIX}{'ab' * 16}",
        "gc summary": summary_key(311),
    }


def test_every_key_a_writer_makes_is_of_the_layout_and_of_its_kind():
    made = every_kind_of_key()
    assert set(made) == set(keys.LAYOUT)  # one of each kind: a new kind needs a writer here
    for kind, key in made.items():
        assert keys.layout_kind(key) == kind, key
        assert keys.is_own_key(key)


@pytest.mark.parametrize("root", ["data/", "data/p0/", "data/p0/e000001/", "_log/", "_probe/ns/", "a/b/c/"])
def test_no_key_of_a_namespace_below_ours_is_ours(root):
    """Wherever another namespace lies below ours (even among our own TGB objects, with a
    producer named like ours or like an epoch), none of its keys matches our layout."""
    for producer in ("p0", "e000001", "data"):
        for kind, key in every_kind_of_key(producer).items():
            assert not keys.is_own_key(root + key), (kind, root + key)


@pytest.mark.parametrize(
    "key",
    [
        "data/p0/e000001/000000000001-0badc0de.0.bwb.tmp",  # a suffix
        "data/p0/e1/000000000001-0badc0de.0.bwb",  # an epoch not of data_key's width
        "data/p0/e000001/1-0badc0de.0.bwb",  # an offset not of its width
        "data/p0/e000001/000000000001-TOKEN.0.bwb",  # a token that is not hex
        "data/_p0/e000001/000000000001-0badc0de.0.bwb",  # a name no producer may have
        "data/p0/e000001/00000000000\u0661-0badc0de.0.bwb",  # a digit that is not ASCII
        "_log/7.json",
        "_log/0000000000000000000\u0667.json",
        "_log/_snapshots/00000000000000000100.json.bak",
        "_probe/left-behind",
        "_gc/00000000000000000311.json/x",
        "_checkpoints/ck-1/0-0.json.old",
        "_checkpoints/_log/_released",
        "_intents/p0/e000002/41.json",
        "_claims/p0/e000003/2x1-c0ffee/x",
        "data/.DS_Store",
        "",
    ],
)
def test_a_key_that_only_looks_like_ours_is_not(key):
    assert keys.layout_kind(key) is None and not keys.is_own_key(key)


def test_the_parsers_of_each_kind_follow_the_layout():
    made = every_kind_of_key()
    assert keys.parse_data_key(made["tgb"]) == keys.DataKey("p0", 2, 41)
    assert parse_intent_key(made["intent"]) == ("p0", 2, 41)
    ticket = parse_claim_key(made["claim"])
    assert ticket is not None and (ticket.producer, ticket.epoch, ticket.incarnation) == ("p0", 3, "c0ffee")
    assert summary_version(made["gc summary"]) == 311
    assert keys.numbered_key(made["version"], "version") == 7
    assert keys.numbered_key(made["snapshot"], "snapshot") == 100
    assert keys.numbered_key(made["segment"], "segment") == 32
    assert keys.numbered_key(made["snapshot"], "version") is None
    for parse in (keys.parse_data_key, parse_intent_key, parse_claim_key, summary_version):
        assert parse("data/" + made["tgb"]) is None  # the same key of a namespace inside ours
    assert parse_intent_key("data/" + made["intent"]) is None
    assert parse_claim_key("_claims/x/" + made["claim"]) is None


def test_a_namespace_is_known_by_its_log_and_a_nested_one_by_its_root():
    for key in (keys.version_key(1), keys.snapshot_key(100), keys.HINT_KEY):
        assert keys.is_namespace_marker(key)
        assert keys.nested_namespace(key) is None  # ours, at our root
        assert keys.nested_namespace("data/" + key) == "data/"
        assert keys.nested_namespace("runs/a/" + key) == "runs/a/"
    for key in every_kind_of_key().values():
        assert keys.nested_namespace(key) is None  # no key of our layout says "another namespace"
    assert not keys.is_namespace_marker(segment_key(32))  # a segment only copies versions
    assert not keys.is_namespace_marker("data/" + keys.version_key(1))
    assert keys.nested_namespace("data/_log/7.json") is None
