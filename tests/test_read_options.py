"""Every reading option in one ``ReadOptions``, and every reader taking all of them.

``Consumer`` and the three framework readers take the options as keywords or as one
``options=``; a new field of ``ReadOptions`` fails here until every reader takes it.
"""

from __future__ import annotations

import dataclasses

import pytest

import batchweave as bw
from batchweave.reading.options import NodeSharing, ReadKeywords, ReadOptions

# A value other than the default for every keyword, valid on a local directory.
CHANGED = {
    "prefetch": 3,
    "timeout_s": 7.5,
    "max_poll_interval_s": 0.25,
    "sequence_axis": 0,
    "log_metrics_s": 30.0,
    "storage_options": {"fsync": False},
    "node_sharing": False,
    "local_rank": 1,
    "local_world_size": 2,
}


def test_the_keywords_are_the_fields_with_node_sharing_spelt_out():
    fields = {f.name for f in dataclasses.fields(ReadOptions)} - {"node"}
    node = {"node_sharing", "local_rank", "local_world_size"}
    assert set(ReadKeywords.__annotations__) == fields | node == set(CHANGED)
    assert {f.name for f in dataclasses.fields(NodeSharing)} == {"enabled", "local_rank", "local_world_size"}


def test_keywords_and_options_give_the_same_options_and_round_trip():
    options = ReadOptions.build(**CHANGED)
    assert options.node == NodeSharing(enabled=False, local_rank=1, local_world_size=2)
    assert options.prefetch == 3 and options.storage_options == {"fsync": False}
    assert ReadOptions.build(options) is options
    assert ReadOptions.build(**options.keywords()) == options
    assert ReadOptions.build() == ReadOptions()


@pytest.mark.parametrize(
    ("keywords", "problem"),
    [
        ({"prefetch": 0}, "prefetch must be a positive number of steps or None, got 0"),
        ({"prefetch": 2.5}, "prefetch must be a positive number of steps"),
        ({"timeout_s": -1}, "timeout_s must be a positive number of seconds or None"),
        ({"max_poll_interval_s": None}, "max_poll_interval_s must be a positive number of seconds, got None"),
        ({"log_metrics_s": True}, "log_metrics_s must be a positive number"),
        ({"sequence_axis": "last"}, "sequence_axis must be an axis number"),
        ({"node_sharing": "yes"}, "node_sharing must be True, False or None"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it(keywords, problem):
    with pytest.raises(bw.ConfigError, match=problem):
        ReadOptions.build(**keywords)


@pytest.mark.parametrize(
    ("storage_options", "problem"),
    [
        ("profile=prod", "got a value of type str: a string of options is not parsed"),
        ([("region", "eu-west-1")], "got a value of type list"),
        (
            {1: "x"},
            "storage_options must be a mapping with string keys \\(option names\\), got keys of type \\['int'\\]",
        ),
    ],
)
def test_storage_options_that_are_not_a_mapping_of_names_are_a_config_error(storage_options, problem):
    with pytest.raises(bw.ConfigError, match=problem) as caught:
        ReadOptions(storage_options=storage_options)
    assert "prod" not in str(caught.value)  # the type, never the value: options sit next to secrets
    with pytest.raises(bw.ConfigError, match=problem):
        ReadOptions.build(storage_options=storage_options)


def test_a_misspelt_option_is_a_type_error_at_the_call_naming_it_and_the_options():
    with pytest.raises(TypeError, match="unknown reading option\\(s\\) prefetsh: the options are prefetch, "):
        ReadOptions.build(prefetsh=4)


def test_options_and_keywords_together_are_refused():
    with pytest.raises(bw.ConfigError, match="give options=ReadOptions\\(...\\) or the keywords prefetch, not both"):
        ReadOptions.build(ReadOptions(), prefetch=2)


def _consumer(url, **options):
    return bw.Consumer(url, dp=2, rank=0, **options)


def _torch(url, **options):
    from batchweave.torch import TGBDataset

    return TGBDataset(url, dp=2, rank=0, **options)


def _grain(url, **options):
    from batchweave.grain import TGBIterDataset

    return TGBIterDataset(url, dp=2, rank=0, **options)


def _tf(url, **options):
    from batchweave.tf import TGBReader

    return TGBReader(url, dp=2, rank=0, **options)


READERS = {
    "consumer": (_consumer, None),
    "torch": (_torch, "torch"),
    "grain": (_grain, "grain"),
    "tf": (_tf, "tensorflow"),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("keyword", list(CHANGED))
def test_every_reader_takes_every_option_and_hands_it_to_its_consumer(reader, keyword, tmp_path):
    make, needs = READERS[reader]
    if needs is not None:
        pytest.importorskip(needs)
    built = make(tmp_path.as_uri(), **{keyword: CHANGED[keyword]})
    expected = ReadOptions.build(**{keyword: CHANGED[keyword]})
    if keyword == "storage_options":  # it opened the store; a reader's consumer gets the opened store
        assert built.options.storage_options in (None, CHANGED[keyword])
        return
    assert built.options == expected, (reader, keyword)


@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_refuses_storage_options_given_as_a_string(reader, tmp_path):
    make, needs = READERS[reader]
    if needs is not None:
        pytest.importorskip(needs)
    with pytest.raises(bw.ConfigError, match="storage_options must be a mapping of option names to values"):
        make(tmp_path.as_uri(), storage_options="profile=prod")


@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_takes_one_options_value_and_only_keywords_after_the_url(reader, tmp_path):
    make, needs = READERS[reader]
    if needs is not None:
        pytest.importorskip(needs)
    options = ReadOptions(prefetch=2, max_poll_interval_s=0.5, node=NodeSharing(enabled=False))
    assert make(tmp_path.as_uri(), options=options).options == options
    with pytest.raises(TypeError, match="unknown reading option"):
        make(tmp_path.as_uri(), prefetsh=2)
    # Everything after the URL is a keyword: TGBDataset(url, 4) once took 4 for a DeviceMesh.
    with pytest.raises(TypeError, match="positional"):
        type(make(tmp_path.as_uri()))(tmp_path.as_uri(), 2)
