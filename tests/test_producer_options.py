"""Every producer option in one ``ProducerOptions``: ``Producer`` takes it as keywords or as
one ``options=``, and a pool carries it whole to every worker, encoded as JSON, never
pickled (a commit policy by its name)."""

from __future__ import annotations

import dataclasses
import pickle

import pool_work
import pytest

import batchweave as bw
from batchweave.journal import Journal
from batchweave.keys import SNAPSHOT_PREFIX
from batchweave.pool import PoolJob, PoolPlan, run_pool
from batchweave.store import open_store
from batchweave.writing.options import ProducerKeywords, ProducerOptions

# A value other than the default for every option, valid on a local directory.
CHANGED = {
    "commit_policy": "fixed10",
    "max_object_bytes": 1 << 20,
    "snapshot_every": 7,
    "background_commit": False,
    "publish_metrics": True,
    "max_lag": 1000,
    "storage_options": {"fsync": False},
    "schema": bw.Schema.of({"tokens": ("int32", (None, 3))}),
    "pack_steps": 1,
    "pack_delay_s": 0.25,
}


def test_the_keywords_are_the_fields_and_every_one_is_changed_here():
    fields = {f.name for f in dataclasses.fields(ProducerOptions)}
    assert set(ProducerKeywords.__annotations__) == fields == set(CHANGED)
    defaults = ProducerOptions()
    assert all(getattr(defaults, name) != value for name, value in CHANGED.items())


def test_keywords_and_options_give_the_same_options_and_round_trip():
    options = ProducerOptions.build(**CHANGED)  # type: ignore[arg-type]
    assert ProducerOptions.build(options) is options
    assert ProducerOptions.build(**options.keywords()) == options
    assert ProducerOptions.build() == ProducerOptions()
    # A schema given as a mapping is held as the Schema it declares: one spelling.
    assert ProducerOptions(schema={"tokens": ("int32", (None, 3))}) == ProducerOptions(schema=CHANGED["schema"])


def test_a_producer_takes_its_options_as_keywords_or_as_one_value(tmp_path):
    url = str(tmp_path / "ns")
    keywords = {"commit_policy": "manual", "pack_steps": 1, "storage_options": {"fsync": False}, "max_lag": 50}
    with bw.Producer(url, "p", dp=1, **keywords) as by_keywords:  # type: ignore[arg-type]
        assert by_keywords.options == ProducerOptions(**keywords)  # type: ignore[arg-type]
    with bw.Producer(url, "p", dp=1, options=ProducerOptions(**keywords)) as by_value:  # type: ignore[arg-type]
        assert by_value.options == by_keywords.options
        assert by_value.policy.name == "manual"


def test_options_with_keywords_or_a_misspelt_keyword_are_refused_before_the_store_is_touched(tmp_path):
    url = tmp_path / "ns"
    with pytest.raises(bw.ConfigError, match=r"give options=ProducerOptions\(...\) or the keywords max_lag, not both"):
        bw.Producer(str(url), "p", dp=1, options=ProducerOptions(), max_lag=3)
    with pytest.raises(TypeError, match="unknown producer option.* max_lagg: the options are commit_policy"):
        bw.Producer(str(url), "p", dp=1, max_lagg=3)  # type: ignore[call-arg]
    with pytest.raises(bw.ConfigError, match="options must be a ProducerOptions, got"):
        bw.Producer(str(url), "p", dp=1, options={"max_lag": 3})  # type: ignore[arg-type]
    assert not url.exists()


@pytest.mark.parametrize(
    ("keywords", "problem"),
    [
        ({"max_object_bytes": 0}, "max_object_bytes must be a positive number of bytes, got 0"),
        ({"max_object_bytes": 1.5}, "max_object_bytes must be a positive number of bytes, got 1.5"),
        ({"snapshot_every": 0}, "snapshot_every must be a positive number of log versions, got 0"),
        ({"background_commit": 1}, "background_commit must be True or False, got 1"),
        ({"publish_metrics": "yes"}, "publish_metrics must be True or False, got 'yes'"),
        ({"max_lag": 0}, "max_lag must be a positive number of steps or None, got 0"),
        ({"max_lag": True}, "max_lag must be a positive number of steps or None, got True"),
        ({"storage_options": "fsync=False"}, "storage_options must be a mapping of option names to values"),
        ({"pack_steps": 0}, "pack_steps must be a positive number of TGBs or None"),
        ({"pack_delay_s": -1}, "pack_delay_s must be zero or more seconds, got -1"),
        ({"commit_policy": 3}, "commit_policy 3 is not a policy name or a policy instance"),
        ({"commit_policy": bw.DAC}, "is not a policy name or a policy instance"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it_and_its_value(keywords, problem):
    with pytest.raises(bw.ConfigError, match=problem):
        ProducerOptions(**keywords)


def test_a_bad_schema_is_a_schema_error():
    with pytest.raises(bw.SchemaError, match="give \\(dtype, shape\\)"):
        ProducerOptions(schema={"tokens": "int32"})  # type: ignore[dict-item]


def test_options_survive_the_trip_to_another_process_exactly():
    options = ProducerOptions(**CHANGED)  # type: ignore[arg-type]
    encoded = options.to_json()
    assert ProducerOptions.from_json(encoded) == options
    assert ProducerOptions.from_json(ProducerOptions().to_json()) == ProducerOptions()
    nested = ProducerOptions(storage_options={"client_options": {"timeout": "30s"}, "retry_deadline_s": 60})
    assert ProducerOptions.from_json(nested.to_json()) == nested
    # A pool's job crosses to its workers by pickle (spawn, Ray): the options inside it are
    # our JSON, so what a worker decodes is what the driver gave.
    job = PoolJob.of("file:///ns", PoolPlan("prep", 2, 4), [0, 1], pool_work.tgb_of, 2, 1, 0, options)
    assert pickle.loads(pickle.dumps(job)).options == options
    assert isinstance(job.options_json, bytes)


class _Nameless:
    """A policy object without a name: it waits and observes, but says no name."""

    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
        return 0.0

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        pass


def test_a_policy_object_without_a_name_is_refused():
    with pytest.raises(bw.ConfigError, match="is not a policy name or a policy instance with wait_s"):
        ProducerOptions(commit_policy=_Nameless())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "fix"), [(None, "give a policy name, such as 'dac'"), ("dac", "give its name, commit_policy='dac'")]
)
def test_a_policy_object_cannot_cross_and_says_what_to_give(name, fix):
    policy = bw.DAC(epsilon=0.01)  # its settings would not cross with its name
    if name is None:
        policy.name = None  # type: ignore[assignment]
    options = ProducerOptions(commit_policy=policy)  # a producer in this process takes it
    with pytest.raises(bw.ConfigError, match="is a policy object, which cannot cross to another process") as refused:
        options.to_json()
    assert fix in str(refused.value)


def test_storage_options_that_are_not_plain_data_cannot_cross_and_the_message_shows_no_value():
    options = ProducerOptions(storage_options={"credential_provider": lambda: {"token": "SECRET"}})
    with pytest.raises(bw.ConfigError, match="storage_options cannot cross to another process") as refused:
        options.to_json()
    assert "SECRET" not in str(refused.value)


@pytest.mark.parametrize("data", [b"{}", b"not json", b'{"format": "batchweave.producer-options/9"}'])
def test_anything_but_encoded_options_is_refused(data):
    with pytest.raises(bw.ConfigError, match="producer options"):
        ProducerOptions.from_json(data)


def test_a_pool_carries_its_options_whole_to_every_worker(tmp_path):
    """Options no pool keyword gave before (``publish_metrics``, ``snapshot_every``) reach
    each worker's producer: every producer published its counters, and the log has its
    snapshots every 2 versions."""
    url = (tmp_path / "ns").as_uri()
    options = ProducerOptions(publish_metrics=True, snapshot_every=2, commit_policy="naive", pack_steps=1)
    report = run_pool(url, "prep", list(range(6)), pool_work.tgb_of, producers=2, dp=pool_work.DP, options=options)
    assert report.produced == 6
    state = Journal(open_store(url)).load_state()
    published = {pid: p.metrics for pid, p in state.producers.items()}
    assert set(published) == {"prep.0000-of-0002", "prep.0001-of-0002"}
    assert all(metrics and metrics["tgbs_committed"] >= 1 for metrics in published.values()), published
    snapshots = [info.key for info in open_store(url).list(SNAPSHOT_PREFIX)]
    assert snapshots, "no snapshot: snapshot_every did not reach the workers"


def test_a_pool_refuses_options_with_the_old_keywords_and_a_policy_object_before_any_worker_starts(tmp_path):
    url = tmp_path / "ns"
    with pytest.raises(bw.ConfigError, match="give options=ProducerOptions.* or commit_policy, not both"):
        run_pool(url.as_uri(), "prep", [0], pool_work.tgb_of, producers=1, dp=2, options=ProducerOptions(),
                 commit_policy="dac")  # fmt: skip
    with pytest.raises(bw.ConfigError, match="cannot cross to another process"):
        run_pool(url.as_uri(), "prep", [0], pool_work.tgb_of, producers=1, dp=2,
                 options=ProducerOptions(commit_policy=bw.DAC()))  # fmt: skip
    with pytest.raises(bw.ConfigError, match="unknown commit policy 'dca'"):
        run_pool(url.as_uri(), "prep", [0], pool_work.tgb_of, producers=1, dp=2, commit_policy="dca")
    assert not url.exists()


class _Recorded:
    """Stands in for ``Producer`` in a pool worker: records what it was built with."""

    def __init__(self, built: list[tuple[str, ProducerOptions]], producer_id: str, options: ProducerOptions) -> None:
        built.append((producer_id, options))
        self.resume_offset = 10**6  # past every shard: the worker appends nothing

    def __enter__(self) -> _Recorded:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def flush(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


def test_every_option_reaches_a_workers_producer_as_it_was_given(monkeypatch):
    """The job a worker receives (pickled by spawn or Ray, the options inside it JSON)
    builds its producer with exactly the options the driver gave, every field."""
    from batchweave import pooljob

    built: list[tuple[str, ProducerOptions]] = []
    monkeypatch.setattr(pooljob, "Producer", lambda url, pid, dp, cp, *, options: _Recorded(built, pid, options))
    monkeypatch.setattr(pooljob, "start_delay_s", lambda index: 0.0)
    options = ProducerOptions(**CHANGED)  # type: ignore[arg-type]
    job = PoolJob.of("file:///ns", PoolPlan("prep", 2, 4), [0, 1, 2, 3], pool_work.tgb_of, 2, 1, 0, options)
    pickle.loads(pickle.dumps(job)).produce(1)
    assert built == [("prep.0001-of-0002", options)]
