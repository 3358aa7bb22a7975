"""Resuming on a different mesh through the Consumer: TP/PP, DP and CP changes on 2/4/8
ranks, checked against the rule that nothing is skipped and nothing is read twice."""

from __future__ import annotations

import itertools
import logging
import uuid

import numpy as np
import pytest

import batchweave as bw
from batchweave.commit.policies import Manual

SEQ = 8  # tokens per slice along the sequence axis


def slice_tokens(tgb: int, index: int) -> np.ndarray:
    """Slice ``index`` of TGB ``tgb``: token ids that say where each token came from."""
    return (tgb * 10_000 + index * 100 + np.arange(SEQ, dtype=np.int64)).reshape(1, SEQ)


def write(url: str, dp: int, cp: int, tgbs: int) -> None:
    with bw.Producer(url, "p", dp=dp, cp=cp, commit_policy=Manual()) as producer:
        for n in range(tgbs):
            producer.append([{"tokens": slice_tokens(n, i)} for i in range(dp * cp)])
    bw.end_stream(url)


def origins(tokens: np.ndarray) -> set[tuple[int, int, int]]:
    """(tgb, slice, token) of every token a rank received."""
    values = tokens.reshape(-1)
    return {(int(v) // 10_000, int(v) % 10_000 // 100, int(v) % 100) for v in values}


def read_positions(url, mesh, steps=None, state=None):
    """Tokens read per logical step by every distinct (dp, cp) position of ``mesh``."""
    out = {}
    world = mesh.world_size
    for rank in range(world):
        coords = mesh.coords(rank)
        consumer = bw.Consumer(url, **_sizes(mesh), rank=rank, timeout_s=10)
        if state is not None:
            consumer.load_state_dict(state)
        batches = list(itertools.islice(consumer, steps)) if steps is not None else list(consumer)
        out.setdefault((coords.dp, coords.cp), {})
        for batch in batches:
            got = origins(batch.data["tokens"])
            key = (coords.dp, coords.cp)
            if batch.step in out[key]:
                assert out[key][batch.step] == got, "TP/PP ranks of one position must read the same data"
            out[key][batch.step] = got
        consumer.close()
    return out


def _sizes(mesh):
    return {"dp": mesh.dp, "cp": mesh.cp, "tp": mesh.tp, "pp": mesh.pp}


def everything(tgbs, dp, cp, first_tgb=0):
    return {(n, i, t) for n in range(first_tgb, tgbs) for i in range(dp * cp) for t in range(SEQ)}


def flatten(per_position):
    seen = []
    for steps in per_position.values():
        for tokens in steps.values():
            seen.extend(tokens)
    return seen


MESHES = [
    # (written dp, cp) -> reading mesh, on 2/4/8 ranks
    ((2, 1), bw.Mesh(dp=2, tp=2)),  # TP changes only
    ((2, 1), bw.Mesh(dp=2, pp=2, tp=2)),  # TP and PP
    ((2, 1), bw.Mesh(dp=4)),  # DP grows 2x
    ((2, 1), bw.Mesh(dp=8)),  # DP grows 4x
    ((4, 1), bw.Mesh(dp=2)),  # DP shrinks 2x
    ((8, 1), bw.Mesh(dp=2, tp=2)),  # DP shrinks 4x, with TP
    ((2, 2), bw.Mesh(dp=2, cp=1, tp=2)),  # CP shrinks 2x
    ((1, 4), bw.Mesh(dp=1, cp=1, tp=2)),  # CP shrinks 4x
    ((2, 1), bw.Mesh(dp=2, cp=2)),  # CP grows 2x
    ((1, 2), bw.Mesh(dp=1, cp=8)),  # CP grows 4x
    ((2, 2), bw.Mesh(dp=4, cp=1)),  # DP grows while CP shrinks
    ((4, 1), bw.Mesh(dp=2, cp=2)),  # DP shrinks while CP grows
]


@pytest.mark.parametrize(("layout", "mesh"), MESHES, ids=lambda v: str(v))
def test_every_token_is_read_exactly_once(layout, mesh):
    url = f"memory://reconf-{uuid.uuid4().hex}"
    dp, cp = layout
    write(url, dp, cp, tgbs=8)
    seen = flatten(read_positions(url, mesh))
    assert sorted(seen) == sorted(everything(8, dp, cp)), "a token was skipped or read twice"


@pytest.mark.parametrize(("layout", "mesh"), MESHES, ids=lambda v: str(v))
def test_resume_on_a_new_mesh_skips_nothing_and_repeats_nothing(layout, mesh):
    """Half the run on the layout's own mesh, the rest on ``mesh`` from the saved cursor."""
    url = f"memory://reconf-{uuid.uuid4().hex}"
    dp, cp = layout
    write(url, dp, cp, tgbs=8)
    first = bw.Consumer(url, dp=dp, cp=cp, rank=0, timeout_s=10)
    list(itertools.islice(first, 4))
    state = first.state_dict()
    first.close()
    assert (state["position_numerator"], state["position_denominator"]) == (4, 1)
    before = flatten(read_positions(url, bw.Mesh(dp=dp, cp=cp), steps=4))
    after = flatten(read_positions(url, mesh, state=state))
    assert sorted(before + after) == sorted(everything(8, dp, cp))


def test_resume_inside_a_logical_step_is_refused_with_the_nearest_steps():
    url = f"memory://reconf-{uuid.uuid4().hex}"
    write(url, 2, 1, tgbs=8)
    first = bw.Consumer(url, dp=2, rank=0, timeout_s=10)
    list(itertools.islice(first, 3))  # position 3: inside a dp=4 step (2 TGBs each)
    state = first.state_dict()
    first.close()
    grown = bw.Consumer(url, dp=4, rank=0, timeout_s=10)
    grown.load_state_dict(state)
    with pytest.raises(bw.LayoutError, match=r"resume at step 1 \(position 2\) or step 2 \(position 4\)"):
        next(grown)
    grown.close()


@pytest.mark.parametrize(("saved_dp", "taken", "dp", "step"), [(2, 3, 1, 6), (2, 4, 4, 2), (2, 4, 8, 1), (4, 3, 1, 12)])
def test_a_loaded_cursor_counts_steps_on_the_new_mesh(saved_dp, taken, dp, step):
    """Right after load_state_dict, before any read, the state already names this mesh's step."""
    url = f"memory://reconf-{uuid.uuid4().hex}"
    write(url, 2, 1, tgbs=8)
    with bw.Consumer(url, dp=saved_dp, rank=0, timeout_s=10) as first:
        list(itertools.islice(first, taken))
        state = first.state_dict()
    with bw.Consumer(url, dp=dp, rank=0, timeout_s=10) as resumed:
        resumed.load_state_dict(state)
        assert (resumed.state_dict()["step"], resumed.state_dict()["dp"]) == (step, dp)
        assert bw.Consumer.state_on_mesh(state, bw.Mesh(dp=dp)) == resumed.state_dict()
        assert next(resumed).step == step


def test_dp_shrunk_run_resumes_mid_tgb_on_its_own_mesh():
    url = f"memory://reconf-{uuid.uuid4().hex}"
    write(url, 4, 1, tgbs=4)
    first = bw.Consumer(url, dp=2, rank=1, timeout_s=10)
    taken = list(itertools.islice(first, 3))  # 1.5 TGBs
    state = first.state_dict()
    first.close()
    assert (state["position_numerator"], state["position_denominator"]) == (3, 2) and [b.step for b in taken] == [
        0,
        1,
        2,
    ]
    again = bw.Consumer(url, dp=2, rank=1, timeout_s=10)
    again.load_state_dict(state)
    assert [b.step for b in again] == [3, 4, 5, 6, 7]
    with pytest.raises(bw.LayoutError, match="falls inside"):
        same = bw.Consumer(url, dp=4, rank=0, timeout_s=10)
        same.load_state_dict(state)
        next(same)


def test_cp_growth_of_raw_bytes_is_refused():
    url = f"memory://reconf-{uuid.uuid4().hex}"
    with bw.Producer(url, "p", dp=1, cp=1) as producer:
        producer.append([b"abcd"])
    with bw.Consumer(url, dp=1, cp=2, rank=0, timeout_s=10) as consumer, pytest.raises(bw.LayoutError, match="bytes"):
        next(consumer)


def test_cp_shrink_of_raw_bytes_joins_them():
    url = f"memory://reconf-{uuid.uuid4().hex}"
    with bw.Producer(url, "p", dp=1, cp=2) as producer:
        producer.append([b"ab", b"cd"])
    bw.end_stream(url)
    with bw.Consumer(url, dp=1, cp=1, rank=0, timeout_s=10) as consumer:
        assert [b.data for b in consumer] == [b"abcd"]


def test_cp_growth_needs_a_divisible_sequence():
    url = f"memory://reconf-{uuid.uuid4().hex}"
    with bw.Producer(url, "p", dp=1) as producer:
        producer.append([{"tokens": np.zeros((1, 7))}])
    with bw.Consumer(url, dp=1, cp=2, rank=1, timeout_s=10) as consumer:
        with pytest.raises(bw.LayoutError, match="cannot be split into 2 equal pieces"):
            next(consumer)


def test_cp_shrink_crosses_object_boundaries():
    """Slices split over several objects (size cap) still join correctly."""
    url = f"memory://reconf-{uuid.uuid4().hex}"
    with bw.Producer(url, "p", dp=1, cp=4, max_object_bytes=300) as producer:
        producer.append([{"tokens": slice_tokens(0, i)} for i in range(4)])
    bw.end_stream(url)
    with bw.Consumer(url, dp=1, cp=1, rank=0, timeout_s=10) as consumer:
        (batch,) = list(consumer)
    assert sorted(origins(batch.data["tokens"])) == sorted(everything(1, 1, 4))
    assert batch.data["tokens"].shape == (1, 4 * SEQ)


# -- a mesh other than the written layout says how it reads, and what it leaves out ---------

PIPELINE_LOGGER = "batchweave.reading.pipeline"


def _said(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == PIPELINE_LOGGER and r.levelno == level]


@pytest.mark.parametrize("prefetch", [None, 2], ids=["inline", "threaded"])
def test_a_grown_dp_says_once_how_it_reads_and_warns_of_the_tgb_it_leaves_out(tmp_path, caplog, prefetch):
    url = str(tmp_path / "ns")
    write(url, 2, 1, tgbs=5)
    caplog.set_level(logging.INFO, logger=PIPELINE_LOGGER)
    with bw.Consumer(url, dp=4, rank=3, timeout_s=10, prefetch=prefetch) as consumer:
        assert [b.step for b in consumer] == [0, 1]  # TGBs 0..3: TGB 4 makes no step of 2 TGBs
    namespace = f"file://{tmp_path / 'ns'}"
    assert _said(caplog, logging.INFO) == [
        f"{namespace} rank 3: reading TGBs written for dp=2, cp=1 as dp=4, cp=1: 2 TGBs per step"
    ]
    (warning,) = _said(caplog, logging.WARNING)
    assert warning.startswith(
        f"{namespace} rank 3: the stream ended: 1 TGB after step 1 (TGB 4) is not delivered: "
        "a step of dp=4, cp=1 reads 2 TGBs written for dp=2, cp=1, and 5 TGBs make 2 whole steps; "
        "to read every TGB, read with dp=2 as written"
    )


@pytest.mark.parametrize(("dp", "tp", "steps", "info"), [(2, 2, 5, 0), (1, 1, 10, 1)])
def test_a_mesh_that_reads_every_tgb_warns_of_nothing(tmp_path, caplog, dp, tp, steps, info):
    url = str(tmp_path / "ns")
    write(url, 2, 1, tgbs=5)
    caplog.set_level(logging.INFO, logger=PIPELINE_LOGGER)
    with bw.Consumer(url, dp=dp, tp=tp, rank=0, timeout_s=10) as consumer:
        assert len(list(consumer)) == steps
    assert len(_said(caplog, logging.INFO)) == info  # TP alone changes nothing; DP shrunk reads 2 steps a TGB
    assert _said(caplog, logging.WARNING) == []


def test_an_evaluation_pass_that_would_leave_tgbs_out_is_refused(tmp_path):
    url = str(tmp_path / "eval")
    write(url, 2, 1, tgbs=5)
    with pytest.raises(bw.LayoutError) as caught:
        bw.evaluation_pass(url, dp=4, rank=0)
    assert str(caught.value).startswith(
        f"file://{tmp_path / 'eval'}: an evaluation pass reads every TGB of the set, but 1 TGB after step 1 "
        "(TGB 4) would not be read: a step of dp=4, cp=1 reads 2 TGBs written for dp=2, cp=1"
    )
    # The written dp, or one that shrinks it, reads every token of the set.
    for dp in (2, 1):
        seen = [
            t
            for rank in range(dp)
            for b in bw.evaluation_pass(url, dp=dp, rank=rank)
            for t in origins(b.data["tokens"])
        ]
        assert sorted(seen) == sorted(everything(5, 2, 1))
