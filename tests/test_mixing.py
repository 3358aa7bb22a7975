"""Shuffling and mixing at the producer side (``batchweave.shuffle``, ``batchweave.mixing``) and
evaluation passes (``batchweave.evaluation``).

The order is a pure function of (seed, position): properties check that every shuffle is
a permutation per epoch, that each source's share stays within its bound over every
window, and that a step computed alone equals the same step computed in sequence. Real
producers on local-directory namespaces (one SIGKILLed mid-run in its own process, one
closed mid-run, a pool whose worker is SIGKILLed) continue the identical order, and a
Consumer reads exactly what an uninterrupted run gives.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchweave as bw
from batchweave.mixing import MAX_PERIOD, integer_weights, schedule
from batchweave.shardlist import encode_shard
from batchweave.shuffle import IndexPermutation, derive_key

DP = 2
NAMES = ("web", "code", "books")
KILL_ENV = "BW_TEST_MIX_KILL"  # "<step>:<marker dir>": the pool worker at that step SIGKILLs itself once


def small_plan(epochs: int = 2) -> bw.MixPlan:
    """Two weighted sources, one indexable and one sharded; 8 samples a step."""
    sources = [bw.IndexedSource("web", 37, weight=3), bw.ShardedSource("code", (5, 0, 7, 4), weight=1)]
    return bw.MixPlan(bw.Mixture(sources, seed=11), batch_size=8, epochs=epochs)


def slices_of(step: bw.Step) -> list[dict[str, np.ndarray]]:
    """One TGB per step: slice d holds the d-th share of the step's sample references."""
    per_slice = len(step.samples) // DP
    out = []
    for d in range(DP):
        refs = step.samples[d * per_slice : (d + 1) * per_slice]
        out.append(
            {
                "step": np.full(per_slice, step.step, np.int64),
                "source": np.array([NAMES.index(ref.source) for ref in refs], np.int64),
                "epoch": np.array([ref.epoch for ref in refs], np.int64),
                "index": np.array([ref.sample for ref in refs], np.int64),
            }
        )
    return out


def tgb_of_step(step: bw.Step) -> list[dict[str, np.ndarray]]:
    """The pool's preprocessing function (module-level: spawned workers import it)."""
    victim, _, marker_dir = os.environ.get(KILL_ENV, "-1::").partition(":")
    marker = Path(marker_dir) / "killed"
    if step.step == int(victim) and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return slices_of(step)


def read_all(url: str) -> list[list[dict[str, list[int]]]]:
    """Every step as each of the DP ranks reads it, until the stream ends."""
    ranks = []
    for rank in range(DP):
        with bw.Consumer(url, dp=DP, rank=rank, timeout_s=30) as consumer:
            ranks.append([{k: v.tolist() for k, v in batch.data.items()} for batch in consumer])  # type: ignore[union-attr]
    return [list(step) for step in zip(*ranks, strict=True)]


def expected(plan: bw.MixPlan, steps: list[int] | None = None) -> list[list[dict[str, list[int]]]]:
    chosen = range(len(plan)) if steps is None else steps
    return [[{k: v.tolist() for k, v in s.items()} for s in slices_of(plan[k])] for k in chosen]


# -- shuffles: permutations per epoch --------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3000), st.binary(min_size=1, max_size=16))
def test_an_index_permutation_is_a_bijection_and_each_position_is_computed_alone(size, key):
    permutation = IndexPermutation(size, key)
    everything = permutation(np.arange(size))
    assert sorted(everything.tolist()) == list(range(size))
    position = size // 3
    assert permutation(position) == everything[position] == IndexPermutation(size, key)(np.array([position]))[0]


def test_a_permutation_depends_on_its_key_and_refuses_positions_outside():
    orders = {tuple(IndexPermutation(1000, derive_key(0, "web", e))(np.arange(1000)).tolist()) for e in range(4)}
    assert len(orders) == 4  # each epoch reshuffles
    assert IndexPermutation(1000, derive_key(0, "web", 0))(np.arange(1000)).tolist() != list(range(1000))
    with pytest.raises(bw.ConfigError, match=r"\[0, 10\)"):
        IndexPermutation(10, b"k")(np.array([10]))
    for bad in (0, -1, 2**63, 1.5):
        with pytest.raises(bw.ConfigError, match="size"):
            IndexPermutation(bad, b"k")  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(any),
    st.integers(1, 4),
    st.integers(0, 5),
    st.integers(0, 99),
)
def test_a_sharded_epoch_is_a_permutation_that_reads_one_group_of_shards_at_a_time(sizes, group, epoch, seed):
    source = bw.ShardedSource("code", tuple(sizes), shards_in_memory=group)
    order = source.indices(seed, epoch, np.arange(source.samples))
    assert sorted(order.tolist()) == list(range(source.samples))
    slot = {shard: i for i, shard in enumerate(source.shard_order(seed, epoch).tolist())}
    groups = [slot[source.locate(index)[0]] // group for index in order.tolist()]
    assert groups == sorted(groups)  # a restart re-reads at most the group of shards it was in
    part = np.arange(source.samples)[source.samples // 2 :]
    assert source.indices(seed, epoch, part).tolist() == order[source.samples // 2 :].tolist()


def test_more_shards_in_memory_spread_a_shards_samples_further():
    def spread(group: int) -> float:
        source = bw.ShardedSource("code", (64,) * 32, shards_in_memory=group)
        position = np.argsort(source.indices(0, 0, np.arange(source.samples)))
        return float(np.abs(np.diff(position)).mean())

    assert spread(1) < 40 and 80 < spread(4) < 200 < spread(16)  # ~ a third of the group's samples


def test_sources_refuse_bad_input_by_name():
    with pytest.raises(bw.ConfigError, match="'web': weight"):
        bw.IndexedSource("web", 10, weight=0)
    with pytest.raises(bw.ConfigError, match="'web': weight"):
        bw.IndexedSource("web", 10, weight=math.nan)
    with pytest.raises(bw.ConfigError, match="'web': size"):
        bw.IndexedSource("web", 0)
    with pytest.raises(bw.ConfigError, match="non-empty name"):
        bw.IndexedSource("", 3)
    with pytest.raises(bw.ConfigError, match="'code': shard_sizes"):
        bw.ShardedSource("code", (0, 0))
    with pytest.raises(bw.ConfigError, match="'code': shard_sizes"):
        bw.ShardedSource("code", (3, -1))
    with pytest.raises(bw.ConfigError, match="'code': shards_in_memory must be a positive int"):
        bw.ShardedSource("code", (3,), shards_in_memory=0)
    with pytest.raises(bw.ConfigError, match="samples 0 to 6, not 7"):
        bw.ShardedSource("code", (3, 4)).locate(7)
    assert bw.ShardedSource("code", (3, 0, 4)).locate(3) == (2, 0)


# -- mixing: shares within the bound, from any position --------------------------------


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_every_source_keeps_its_share_within_the_bound_over_every_window(weights):
    sources = [bw.IndexedSource(f"s{i}", 50, weight=w) for i, w in enumerate(weights)]
    mixture = bw.Mixture(sources, seed=3)
    period = int(mixture.weights.sum())
    numbers, _ = mixture.source_positions(np.arange(2 * period + 7))
    counts = np.zeros((len(numbers) + 1, len(weights)))
    counts[1:] = np.cumsum(np.eye(len(weights))[numbers], axis=0)
    share = mixture.weights / period
    prefix = np.abs(counts - np.arange(len(numbers) + 1)[:, None] * share).max()
    assert prefix <= 1 - 1 / max(2 * len(weights) - 2, 1) + 1e-9  # Tijdeman's bound
    for window in {1, 3, period // 2 + 1, period, period + 5}:
        got = counts[window:] - counts[:-window]
        assert np.abs(got - window * share).max() < 2, window


def test_the_schedule_is_exact_per_period_and_weights_become_small_integers():
    assert integer_weights([0.7, 0.3]).tolist() == [7, 3]
    assert integer_weights([2, 4, 6]).tolist() == [1, 2, 3]
    assert integer_weights([1 / 3, 2 / 3]).tolist() == [1, 2]
    rounded = integer_weights([0.123456, 0.5, 0.37654])
    assert rounded.sum() == MAX_PERIOD and rounded.tolist() == [8091, 32768, 24677]
    period = schedule(np.array([5, 2, 1]))
    assert np.bincount(period).tolist() == [5, 2, 1] and period.tolist() == [0, 0, 1, 0, 2, 0, 1, 0]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(16, 60), st.integers(1, 5)), min_size=1, max_size=3),
    st.integers(1, 16),
    st.integers(0, 2**32),
    st.data(),
)
def test_step_k_alone_equals_step_k_in_sequence(spec, batch_size, seed, data):
    def plan() -> bw.MixPlan:
        sources = [bw.IndexedSource(NAMES[i], size, weight=w) for i, (size, w) in enumerate(spec)]
        return bw.MixPlan(bw.Mixture(sources, seed), batch_size, steps=25)

    sequence = list(plan())
    k = data.draw(st.integers(0, 24))
    assert plan()[k] == sequence[k] == plan()[k - 25]  # a fresh plan, and a negative index
    assert [s.step for s in sequence] == list(range(25))
    assert all(len(s.samples) == batch_size for s in sequence)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(6, 30), st.integers(1, 4)), min_size=1, max_size=3), st.integers(0, 999))
def test_each_source_epoch_is_a_permutation_and_epochs_reshuffle(spec, seed):
    sources = [bw.IndexedSource(NAMES[i], size, weight=w) for i, (size, w) in enumerate(spec)]
    plan = bw.MixPlan(bw.Mixture(sources, seed), batch_size=4, epochs=6)
    seen: dict[tuple[str, int], list[int]] = {}
    for step in plan:
        for ref in step.samples:
            seen.setdefault((ref.source, ref.epoch), []).append(ref.sample)
    sizes = {source.name: source.size for source in sources}
    complete = [(name, epoch) for name, epoch in seen if (name, epoch + 1) in seen]
    assert complete  # some source got past an epoch (the one whose weight beats its size)
    for name, epoch in complete:
        assert sorted(seen[name, epoch]) == list(range(sizes[name]))
        if sizes[name] >= 8:  # 8! orders: two epochs alike would be a missing reshuffle, not chance
            assert seen[name, epoch] != seen[name, epoch + 1][: sizes[name]]


def test_a_plans_epochs_count_steps_and_a_dividing_batch_matches_the_sources_epochs():
    plan = bw.MixPlan(bw.Mixture([bw.IndexedSource("web", 12)], seed=5), batch_size=4, epochs=3)
    assert len(plan) == 9 and [plan.epoch_of(k) for k in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for k, step in enumerate(plan):
        assert step.epoch == k // 3 and {ref.epoch for ref in step.samples} == {k // 3}
    epoch0 = [ref.sample for step in plan[0:3] for ref in step.samples]
    epoch1 = [ref.sample for step in plan[3:6] for ref in step.samples]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12)) and epoch0 != epoch1
    uneven = bw.MixPlan(bw.Mixture([bw.IndexedSource("web", 10)], seed=5), batch_size=4, epochs=2)
    assert len(uneven) == 4 and uneven[2].samples[0] == ("web", 0, uneven[2].samples[0].sample)  # no gap
    assert [ref.epoch for ref in uneven[2].samples] == [0, 0, 1, 1]


def test_a_plan_refuses_bad_bounds():
    mixture = bw.Mixture([bw.IndexedSource("web", 10)], seed=0)
    for kwargs in ({}, {"epochs": 1, "steps": 2}):
        with pytest.raises(bw.ConfigError, match="exactly one of epochs= and steps="):
            bw.MixPlan(mixture, 2, **kwargs)
    with pytest.raises(bw.ConfigError, match="holds no whole step of batch_size 11"):
        bw.MixPlan(mixture, 11, epochs=1)
    with pytest.raises(bw.ConfigError, match="batch_size must be a positive int"):
        bw.MixPlan(mixture, 0, epochs=1)
    with pytest.raises(bw.ConfigError, match="names must differ"):
        bw.Mixture([bw.IndexedSource("web", 10), bw.IndexedSource("web", 5)], seed=0)
    with pytest.raises(bw.ConfigError, match="at least one source"):
        bw.Mixture([], seed=0)
    with pytest.raises(IndexError, match="outside this plan's 5 steps"):
        bw.MixPlan(mixture, 2, steps=5)[5]


def test_a_step_is_plain_data_for_json_msgspec_and_a_pool_fingerprint():
    step = small_plan()[3]
    assert msgspec.json.decode(msgspec.json.encode(step), type=bw.Step) == step
    number, epoch, samples = json.loads(json.dumps(step))
    assert (number, epoch) == (3, 0) and [tuple(s) for s in samples] == list(step.samples)
    assert encode_shard(step) == encode_shard(json.loads(json.dumps(step)))  # a tuple and a list are the same shard


# -- exact on resume: real producers on a local directory ------------------------------

KILLED_PRODUCER = """
import os, signal, sys
import batchweave as bw
from test_mixing import slices_of, small_plan

url, flush_at, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
plan = small_plan()
producer = bw.Producer(url, "mixer", dp=2)
for offset in range(producer.resume_offset, len(plan)):
    if offset == flush_at:
        producer.flush()  # everything before flush_at is committed; what follows may or may not be
    if offset == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    producer.append(slices_of(plan[offset]), source_offset=offset)
"""


def produce(url: str, plan: bw.MixPlan, until: int | None = None) -> int:
    """The plain producer loop from where the log says; returns the offset it resumed at."""
    with bw.Producer(url, "mixer", dp=DP) as producer:
        resumed = producer.resume_offset
        for offset in range(resumed, len(plan) if until is None else until):
            producer.append(slices_of(plan[offset]), source_offset=offset)
    return resumed


def test_a_sigkilled_producer_restarts_into_the_identical_order(tmp_path):
    plan = small_plan()
    straight, killed = (tmp_path / "straight").as_uri(), (tmp_path / "killed").as_uri()
    assert produce(straight, plan) == 0
    bw.end_stream(straight)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", KILLED_PRODUCER, killed, "3", "8"], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    resumed = produce(killed, plan)
    assert 3 <= resumed <= 8  # committed through the flush, and not past the kill
    bw.end_stream(killed)
    assert read_all(killed) == read_all(straight) == expected(plan)


def test_a_closed_producer_continues_where_the_log_says(tmp_path):
    plan = small_plan(epochs=3)
    url = (tmp_path / "ns").as_uri()
    assert produce(url, plan, until=5) == 0
    assert produce(url, plan) == 5
    bw.end_stream(url)
    assert read_all(url) == expected(plan)


def test_a_pool_over_a_plan_commits_every_step_once_across_a_sigkill(tmp_path, monkeypatch):
    plan = small_plan()
    url = (tmp_path / "ns").as_uri()
    monkeypatch.setenv(KILL_ENV, f"5:{tmp_path}")
    report = bw.run_pool(url, "mix", plan, tgb_of_step, producers=2, dp=DP, progress=False, end_of_stream=True)
    assert (tmp_path / "killed").exists() and sum(report.restarts.values()) == 1
    got = read_all(url)
    order = [step[0]["step"][0] for step in got]
    assert sorted(order) == list(range(len(plan)))
    for owner in range(2):  # each producer's steps in plan order; producers interleave by commit
        assert [k for k in order if k % 2 == owner] == list(range(owner, len(plan), 2))
    assert got == expected(plan, order)


# -- evaluation passes -----------------------------------------------------------------


def write_steps(url: str, values: range, end: bool) -> None:
    with bw.Producer(url, "writer", dp=DP) as producer:
        for value in values:
            producer.append([{"x": np.full(3, value * 10 + d, np.int64)} for d in range(DP)])
    if end:
        bw.end_stream(url)


def test_evaluation_passes_read_the_same_data_and_leave_training_alone(tmp_path):
    train, evaluation = (tmp_path / "train").as_uri(), (tmp_path / "eval").as_uri()
    write_steps(train, range(10), end=False)
    write_steps(evaluation, range(100, 104), end=True)
    trainers = [bw.Consumer(train, dp=DP, rank=rank, timeout_s=30) for rank in range(DP)]
    first = [[int(next(t).data["x"][0]) for _ in range(6)] for t in trainers]  # type: ignore[index]
    for trainer in trainers:
        trainer.mark_checkpoint("ck-6")  # both ranks: a complete checkpoint at step 6
    cursors = [t.state_dict() for t in trainers]
    passes = [
        [b.data["x"].tolist() for b in bw.evaluation_pass(evaluation, dp=DP, rank=1)]  # type: ignore[union-attr]
        for _ in range(2)
    ]
    assert passes[0] == passes[1] == [[v * 10 + 1] * 3 for v in range(100, 104)]
    assert [t.state_dict() for t in trainers] == cursors
    rest = [int(b.data["x"][0]) for _, b in zip(range(4), trainers[1], strict=False)]  # type: ignore[index]
    assert first[1] + rest == [v * 10 + 1 for v in range(10)]
    for trainer in trainers:
        trainer.close()
    assert bw.inspect_namespace(evaluation).checkpoints == ()  # a pass marks nothing
    assert bw.collect_garbage(evaluation, grace_s=0).w_global_step is None  # so it holds nothing back
    assert bw.collect_garbage(train, grace_s=0).w_global_step == 6  # training's checkpoint alone decides


def test_an_evaluation_pass_refuses_a_namespace_that_has_not_ended(tmp_path):
    url = (tmp_path / "eval").as_uri()
    write_steps(url, range(2), end=False)
    with pytest.raises(bw.ConfigError, match="has not ended.*bw.end_stream"):
        bw.evaluation_pass(url, dp=DP, rank=0)  # at once, before any iteration


# -- the guides' code runs, and prints what they say -----------------------------------

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guides"
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def printed_lines_promised(block: str) -> list[str]:
    """The output a block promises: each comment line right after a ``print(`` line."""
    lines = block.splitlines()
    return [
        line.removeprefix("# ")
        for before, line in zip(lines, lines[1:], strict=False)
        if before.startswith("print(") and line.startswith("# ")
    ]


@pytest.mark.parametrize("page", ["shuffling.md", "coming-from.md"])
def test_every_code_block_of_the_guide_runs_and_prints_what_it_says(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = CODE_BLOCK.findall((GUIDES / page).read_text())
    assert len(blocks) >= 4, "the page was read"
    namespace: dict = {"__name__": "guide"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for block in blocks:
        first = block.splitlines()[0]
        if first.startswith("# file: "):  # a script to save and run, as the page says
            script = tmp_path / first.removeprefix("# file: ")
            script.write_text(block)
            done = subprocess.run(
                [sys.executable, str(script), f"mix-demo/{script.stem}"],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            output = done.stdout
        else:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block, f"{page} block", "exec"), namespace)
            output = out.getvalue()
        printed = iter(output.splitlines())
        missing = [line for line in printed_lines_promised(block) if line not in printed]  # in order
        assert not missing, (missing, output)
