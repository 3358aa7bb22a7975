"""Unit tests for resharding: a mesh with a different DP/CP layout reading existing TGBs.

The central check is nothing-skipped-nothing-twice: over a window of logical steps,
the (tgb, slice, piece, pieces) units read by the distinct (d, c) positions of the mesh
are every unit of every TGB in the window, exactly once. Expected values are literal
tables or plain enumerations of TGBs x slices x pieces, never the module's own formulas.
"""

from __future__ import annotations

import itertools
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchweave.errors import ConfigError, LayoutError
from batchweave.mesh import Coords, Mesh
from batchweave.reading.reshard import Reshard, SliceRead

SIZES = [1, 2, 4, 8]


def ratio(old: int, new: int) -> tuple[int, int]:
    """(grow, shrink) factors of one axis, independent of the module."""
    return (new // old, 1) if new >= old else (1, old // new)


def reads_by_position(rs: Reshard, step: int) -> dict[tuple[int, int], SliceRead]:
    """Read of every distinct (d', c'); asserts the TP/PP ranks of one position agree."""
    mesh = rs.mesh
    out: dict[tuple[int, int], SliceRead] = {}
    for d, c in itertools.product(range(mesh.dp), range(mesh.cp)):
        ranks = [mesh.rank(Coords(pp=p, dp=d, cp=c, tp=t)) for p in range(mesh.pp) for t in range(mesh.tp)]
        reads = {rs.read(r, step) for r in ranks}
        assert len(reads) == 1, f"TP/PP ranks of (d={d}, c={c}) disagree at step {step}: {reads}"
        out[(d, c)] = reads.pop()
    return out


def step_units(rs: Reshard, steps: range) -> Counter:
    units: Counter = Counter()
    for step in steps:
        reads = reads_by_position(rs, step).values()
        assert {r.tgb for r in reads} == set(rs.tgbs(step))
        for r in reads:
            assert 0 <= r.piece < r.pieces
            units.update((r.tgb, r.first_slice + i, r.piece, r.pieces) for i in range(r.count))
    return units


def all_units(dp: int, cp: int, pieces: int, tgbs: range) -> Counter:
    return Counter(itertools.product(tgbs, range(dp * cp), range(pieces), [pieces]))


def check_coverage(layout: tuple[int, int], mesh: Mesh, start: int, steps: int, kind: str = "arrays") -> None:
    """Steps ``start .. start+steps-1``, padded back/forward to whole TGBs, read each unit once."""
    dp, cp = layout
    rs = Reshard(dp, cp, mesh, kind)
    grow, shrink = ratio(dp, mesh.dp)
    pieces = ratio(cp, mesh.cp)[0]
    lo = start - start % shrink  # first step of the TGB that `start` is in
    hi = -(-(start + steps) // shrink) * shrink  # end of the TGB the window ends in
    before = step_units(rs, range(lo, start))
    after = step_units(rs, range(start, hi))
    assert not set(before) & set(after), "a resumed run re-reads what the steps before it read"
    assert before + after == all_units(dp, cp, pieces, range(lo * grow // shrink, hi * grow // shrink))


# -- literal tables, one per rule ------------------------------------------------------


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_identity_reads_own_slice_at_its_step(tp, pp):
    mesh = Mesh(dp=2, cp=2, tp=tp, pp=pp)
    rs = Reshard(2, 2, mesh)
    assert rs.identity
    for step, rank in itertools.product(range(5), range(mesh.world_size)):
        assert rs.read(rank, step) == SliceRead(step, mesh.slice_index(rank), 1)
        assert rs.tgbs(step) == range(step, step + 1)
        assert rs.position(step) == step
        assert rs.step_at(Fraction(step)) == step


def test_tp_pp_change_keeps_each_replica_on_its_slice():
    # Written for dp=2 cp=1 (any tp/pp); resumed with tp=2, pp=2: 8 ranks, 2 slices.
    mesh = Mesh(dp=2, tp=2, pp=2)
    rs = Reshard(2, 1, mesh)
    expected_slice = {c: c.dp for c in (mesh.coords(r) for r in range(8))}
    for rank in range(8):
        assert rs.read(rank, 7) == SliceRead(7, expected_slice[mesh.coords(rank)], 1)


def test_dp_grow_reads_consecutive_tgbs():
    mesh = Mesh(dp=4, tp=2)  # 8 ranks over TGBs of dp=2
    rs = Reshard(2, 1, mesh)
    assert not rs.identity
    table = {0: (2, 0), 1: (2, 1), 2: (3, 0), 3: (3, 1)}  # step 1: replica -> (tgb, slice)
    for rank in range(8):
        tgb, s = table[mesh.coords(rank).dp]
        assert rs.read(rank, 1) == SliceRead(tgb, s, 1)
    assert rs.tgbs(1) == range(2, 4)
    assert rs.position(3) == 6


def test_dp_shrink_spreads_one_tgb_over_k_steps():
    mesh = Mesh(dp=2)  # 2 ranks over TGBs of dp=4
    rs = Reshard(4, 1, mesh)
    table = {0: [(0, 0), (0, 1)], 1: [(0, 2), (0, 3)], 2: [(1, 0), (1, 1)], 3: [(1, 2), (1, 3)]}
    for step, row in table.items():
        assert [rs.read(r, step) for r in range(2)] == [SliceRead(t, s, 1) for t, s in row]
        assert rs.tgbs(step) == range(row[0][0], row[0][0] + 1)
    assert [rs.position(t) for t in range(4)] == [0, Fraction(1, 2), 1, Fraction(3, 2)]


def test_cp_shrink_reads_adjacent_slices_in_one_range():
    mesh = Mesh(dp=1, cp=2, tp=2)  # 4 ranks over TGBs of cp=4
    rs = Reshard(1, 4, mesh)
    for rank in range(4):
        first = {0: 0, 1: 2}[mesh.coords(rank).cp]
        assert rs.read(rank, 3) == SliceRead(3, first, 2)


def test_cp_shrink_with_dp_keeps_runs_inside_a_replica():
    mesh = Mesh(dp=2, cp=1)
    rs = Reshard(2, 4, mesh)  # slices 0..3 belong to replica 0, 4..7 to replica 1
    assert [rs.read(r, 0) for r in range(2)] == [SliceRead(0, 0, 4), SliceRead(0, 4, 4)]


def test_cp_grow_names_the_piece():
    mesh = Mesh(dp=2, cp=2, pp=2)  # 8 ranks over TGBs of dp=2 cp=1
    rs = Reshard(2, 1, mesh)
    for rank in range(8):
        c = mesh.coords(rank)
        assert rs.read(rank, 4) == SliceRead(4, c.dp, 1, piece=c.cp, pieces=2)


def test_dp_grow_with_cp_shrink():
    mesh = Mesh(dp=2, cp=2)  # 4 ranks over TGBs of dp=1 cp=4
    rs = Reshard(1, 4, mesh)
    table = {(0, 0): (2, 0), (0, 1): (2, 2), (1, 0): (3, 0), (1, 1): (3, 2)}  # step 1: (d', c') -> (tgb, first)
    for (d, c), (tgb, first) in table.items():
        assert rs.read(mesh.rank(Coords(0, d, c, 0)), 1) == SliceRead(tgb, first, 2)


def test_dp_shrink_with_cp_grow():
    mesh = Mesh(dp=1, cp=4)  # 4 ranks over TGBs of dp=2 cp=2
    rs = Reshard(2, 2, mesh)
    # step 3 = second half of TGB 1: replica 1, slices 2 (c=0) and 3 (c=1), halved.
    assert [rs.read(r, 3) for r in range(4)] == [
        SliceRead(1, 2, 1, 0, 2),
        SliceRead(1, 2, 1, 1, 2),
        SliceRead(1, 3, 1, 0, 2),
        SliceRead(1, 3, 1, 1, 2),
    ]


def test_paper_example_unchanged_mesh_reads_four_distinct_slices():
    mesh = Mesh(dp=2, cp=2, tp=2, pp=2)
    rs = Reshard(2, 2, mesh)
    for step in range(3):
        reads = [rs.read(r, step) for r in range(16)]
        assert Counter(reads) == {SliceRead(step, s, 1): 4 for s in range(4)}


# -- coverage on small meshes ------------------------------------------------------------

# (layout dp, cp) -> Mesh: 2-, 4- and 8-rank meshes covering every rule and the mixes.
CASES = [
    ((2, 1), Mesh(dp=2)),
    ((2, 2), Mesh(dp=2, cp=2, tp=2)),
    ((1, 1), Mesh(dp=2)),
    ((2, 1), Mesh(dp=4, tp=2)),
    ((4, 1), Mesh(dp=2)),
    ((8, 1), Mesh(dp=2, tp=2, pp=2)),
    ((1, 4), Mesh(dp=1, cp=2, tp=2)),
    ((2, 4), Mesh(dp=2, cp=1, pp=2)),
    ((2, 1), Mesh(dp=2, cp=2)),
    ((1, 2), Mesh(dp=1, cp=8)),
    ((1, 4), Mesh(dp=2, cp=2)),
    ((4, 1), Mesh(dp=1, cp=2)),
    ((4, 2), Mesh(dp=8, cp=1)),
    ((8, 1), Mesh(dp=2, cp=4)),
]


@pytest.mark.parametrize("layout,mesh", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("start", [0, 1, 3, 6])
def test_coverage_from_resume_point(layout, mesh, start):
    check_coverage(layout, mesh, start, steps=5)


@given(
    dp=st.sampled_from(SIZES),
    cp=st.sampled_from(SIZES),
    new_dp=st.sampled_from(SIZES),
    new_cp=st.sampled_from(SIZES),
    tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    start=st.integers(0, 40),
    steps=st.integers(1, 6),
)
@settings(max_examples=120, deadline=None)
def test_property_coverage_and_positions(dp, cp, new_dp, new_cp, tp, pp, start, steps):
    mesh = Mesh(dp=new_dp, cp=new_cp, tp=tp, pp=pp)
    check_coverage((dp, cp), mesh, start, steps)
    rs = Reshard(dp, cp, mesh)
    grow, shrink = ratio(dp, new_dp)
    assert rs.position(start) == Fraction(start * grow, shrink)
    assert rs.step_at(rs.position(start)) == start


@given(
    dp=st.sampled_from(SIZES),
    new_dp=st.sampled_from(SIZES),
    numerator=st.integers(0, 200),
    denominator=st.integers(1, 12),
)
@settings(max_examples=200, deadline=None)
def test_property_step_at_boundaries_and_neighbours(dp, new_dp, numerator, denominator):
    rs = Reshard(dp, 2, Mesh(dp=new_dp, cp=2))
    grow, shrink = ratio(dp, new_dp)
    position = Fraction(numerator, denominator)
    # Boundaries are multiples of grow/shrink TGBs; enumerate them instead of dividing.
    boundaries = [Fraction(t * grow, shrink) for t in range(numerator * shrink + 2)]
    if position in boundaries:
        assert rs.step_at(position) == boundaries.index(position)
        return
    after = next(t for t, b in enumerate(boundaries) if b > position)
    with pytest.raises(LayoutError) as info:
        rs.step_at(position)
    message = str(info.value)
    assert f"inside logical step {after - 1} " in message
    assert f"step {after - 1} (position {boundaries[after - 1]})" in message
    assert f"step {after} (position {boundaries[after]})" in message


# -- errors ------------------------------------------------------------------------------


def test_step_at_inside_a_grown_step_names_both_neighbours():
    rs = Reshard(2, 1, Mesh(dp=4))
    with pytest.raises(LayoutError) as info:
        rs.step_at(Fraction(5))
    assert str(info.value) == (
        "TGB position 5 falls inside logical step 2 (TGBs 4..5) of dp=4, cp=1 over TGBs written with "
        "dp=2, cp=1; resume at step 2 (position 4) or step 3 (position 6)"
    )


def test_step_at_inside_a_shrunk_step_names_the_part_of_the_tgb():
    rs = Reshard(4, 1, Mesh(dp=2))
    with pytest.raises(LayoutError, match=r"inside logical step 2 \(part 1 of 2 of TGB 1\).*step 2 \(position 1\) "):
        rs.step_at(Fraction(5, 4))
    assert rs.step_at(Fraction(3, 2)) == 3
    assert rs.step_at(2) == 4


def test_step_at_rejects_negative_and_float_positions():
    rs = Reshard(2, 1, Mesh(dp=2))
    with pytest.raises(LayoutError, match="negative"):
        rs.step_at(Fraction(-1, 2))
    with pytest.raises(ConfigError, match="Fraction"):
        rs.step_at(0.5)


@pytest.mark.parametrize(
    "layout,mesh,axis",
    [
        ((4, 1), Mesh(dp=3), "dp"),
        ((2, 1), Mesh(dp=3), "dp"),
        ((1, 2), Mesh(dp=1, cp=3), "cp"),
        ((6, 1), Mesh(dp=4), "dp"),
    ],
)
def test_non_integral_factor_names_both_layouts(layout, mesh, axis):
    with pytest.raises(LayoutError) as info:
        Reshard(*layout, mesh)
    message = str(info.value)
    assert f"dp={layout[0]}, cp={layout[1]}" in message
    assert f"dp={mesh.dp}, cp={mesh.cp}" in message
    assert f"{axis} must change by an integral factor" in message


def test_cp_growth_cannot_split_raw_bytes():
    with pytest.raises(LayoutError, match="cp from 1 to 2.*raw-bytes"):
        Reshard(2, 1, Mesh(dp=2, cp=2), kind="bytes")
    # Every other change works for bytes: nothing is split.
    check_coverage((2, 4), Mesh(dp=4, cp=2), start=1, steps=3, kind="bytes")
    check_coverage((4, 2), Mesh(dp=2, cp=1, tp=2), start=1, steps=3, kind="bytes")


def test_rank_out_of_range_is_a_config_error():
    rs = Reshard(2, 1, Mesh(dp=4, tp=2))
    with pytest.raises(ConfigError, match="rank 8 is outside the mesh"):
        rs.read(8, 0)
    with pytest.raises(ConfigError, match="rank -1"):
        rs.read(-1, 0)
    identity = Reshard(2, 1, Mesh(dp=2))
    with pytest.raises(ConfigError, match="rank 2 is outside"):
        identity.read(2, 0)


@pytest.mark.parametrize("kwargs", [{"layout_dp": 0}, {"layout_cp": True}, {"kind": "pickle"}, {"mesh": (2, 1)}])
def test_bad_arguments_are_config_errors(kwargs):
    args = {"layout_dp": 2, "layout_cp": 1, "mesh": Mesh(dp=2)} | kwargs
    with pytest.raises(ConfigError):
        Reshard(**args)


@pytest.mark.parametrize("step", [-1, 1.0, True])
def test_bad_steps_are_config_errors(step):
    rs = Reshard(2, 1, Mesh(dp=4))
    for call in (lambda: rs.read(0, step), lambda: rs.tgbs(step), lambda: rs.position(step)):
        with pytest.raises(ConfigError, match="logical step"):
            call()


# -- what a mesh other than the layout says: how it reads, and what an ended stream leaves out


@pytest.mark.parametrize(
    ("layout", "mesh", "tgbs", "whole", "left"),
    [
        ((2, 1), Mesh(dp=4), 5, 2, 1),  # steps 0 and 1 read TGBs 0..3; TGB 4 makes no step
        ((2, 1), Mesh(dp=8), 7, 1, 3),
        ((2, 1), Mesh(dp=8), 8, 2, 0),
        ((2, 1), Mesh(dp=4), 1, 0, 1),
        ((4, 1), Mesh(dp=2), 5, 10, 0),  # DP shrinks: every TGB is read, in 2 steps each
        ((2, 2), Mesh(dp=2, cp=1), 5, 5, 0),  # CP changes move no TGB between steps
        ((2, 1), Mesh(dp=2, tp=4), 5, 5, 0),
    ],
)
def test_whole_steps_and_leftover_of_an_ended_stream(layout, mesh, tgbs, whole, left):
    rs = Reshard(layout[0], layout[1], mesh)
    assert rs.whole_steps(tgbs) == whole
    assert rs.leftover(tgbs) == left
    assert (rs.describe_leftover(tgbs) == "") == (left == 0)


def test_describe_leftover_counts_and_names_the_tgbs_left_out():
    assert Reshard(2, 1, Mesh(dp=4)).describe_leftover(5) == (
        "1 TGB after step 1 (TGB 4) is not delivered: a step of dp=4, cp=1 reads 2 TGBs written for dp=2, "
        "cp=1, and 5 TGBs make 2 whole steps; to read every TGB, read with dp=2 as written (or a dp that "
        "divides it), or end the stream after a multiple of 2 TGBs"
    )
    assert (
        Reshard(2, 1, Mesh(dp=8))
        .describe_leftover(7, ahead=True)
        .startswith("3 TGBs after step 0 (TGBs 4..6) would not be read: a step of dp=8, cp=1 reads 4 TGBs")
    )
    assert Reshard(2, 1, Mesh(dp=8)).describe_leftover(2).startswith("2 TGBs before step 0 (TGBs 0..1) are not")


@pytest.mark.parametrize(
    ("layout", "mesh", "how"),
    [
        ((2, 1), Mesh(dp=4), "as dp=4, cp=1: 2 TGBs per step"),
        ((4, 1), Mesh(dp=2), "as dp=2, cp=1: each TGB spans 2 steps, each of 1/2 of its replicas"),
        ((2, 4), Mesh(dp=2, cp=2), "as dp=2, cp=2: each rank joins 2 adjacent slices along the sequence axis"),
        ((2, 1), Mesh(dp=2, cp=4), "as dp=2, cp=4: each rank keeps 1 of 4 pieces of a slice along the sequence"),
        ((2, 2), Mesh(dp=4, cp=1), "as dp=4, cp=1: 2 TGBs per step; each rank joins 2 adjacent slices"),
    ],
)
def test_describe_says_how_a_changed_mesh_reads(layout, mesh, how):
    text = Reshard(layout[0], layout[1], mesh).describe()
    assert text.startswith(f"reading TGBs written for dp={layout[0]}, cp={layout[1]} {how}")
