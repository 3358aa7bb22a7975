"""Unit tests for device-mesh arithmetic: rank order pp, dp, cp, tp (outermost first)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from batchweave.errors import ConfigError
from batchweave.mesh import Coords, Mesh, resolve_rank

SMALL_MESHES = [(dp, cp, tp, pp) for dp, cp, tp, pp in itertools.product([1, 2, 3], [1, 2], [1, 2, 3], [1, 2])]


def expected_coords(rank: int, dp: int, cp: int, tp: int, pp: int) -> Coords:
    # Enumerate the mesh in nested-loop order (pp outermost, tp innermost) and index it.
    order = [Coords(pp=p, dp=d, cp=c, tp=t) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]
    return order[rank]


@pytest.mark.parametrize("dims", SMALL_MESHES, ids=lambda d: "dp%d-cp%d-tp%d-pp%d" % d)
def test_all_ranks_coords_and_roundtrip(dims):
    dp, cp, tp, pp = dims
    mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp)
    assert mesh.world_size == dp * cp * tp * pp
    assert mesh.slices == dp * cp
    seen = set()
    for rank in range(mesh.world_size):
        coords = mesh.coords(rank)
        assert coords == expected_coords(rank, dp, cp, tp, pp)
        assert mesh.rank(coords) == rank
        assert mesh.slice_index(rank) == coords.dp * cp + coords.cp
        seen.add(coords)
    assert len(seen) == mesh.world_size


def test_explicit_rank_order_example():
    mesh = Mesh(dp=2, cp=3, tp=4, pp=5)
    # rank = ((p*DP + d)*CP + c)*TP + t
    assert mesh.coords(0) == Coords(0, 0, 0, 0)
    assert mesh.coords(1) == Coords(pp=0, dp=0, cp=0, tp=1)  # tp is innermost
    assert mesh.coords(4) == Coords(pp=0, dp=0, cp=1, tp=0)
    assert mesh.coords(12) == Coords(pp=0, dp=1, cp=0, tp=0)
    assert mesh.coords(24) == Coords(pp=1, dp=0, cp=0, tp=0)  # pp is outermost
    c = Coords(pp=3, dp=1, cp=2, tp=3)
    assert mesh.rank(c) == ((3 * 2 + 1) * 3 + 2) * 4 + 3
    assert mesh.coords(mesh.world_size - 1) == Coords(pp=4, dp=1, cp=2, tp=3)


@pytest.mark.parametrize("dims", SMALL_MESHES, ids=lambda d: "dp%d-cp%d-tp%d-pp%d" % d)
def test_tp_and_pp_ranks_share_a_slice(dims):
    dp, cp, tp, pp = dims
    mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp)
    for d in range(dp):
        for c in range(cp):
            ranks = [mesh.rank(Coords(pp=p, dp=d, cp=c, tp=t)) for p in range(pp) for t in range(tp)]
            assert len(set(ranks)) == tp * pp
            assert {mesh.slice_index(r) for r in ranks} == {d * cp + c}


def test_paper_example_16_ranks_4_slices():
    mesh = Mesh(dp=2, cp=2, tp=2, pp=2)
    assert mesh.world_size == 16
    readers = Counter(mesh.slice_index(rank) for rank in range(16))
    assert sorted(readers) == [0, 1, 2, 3]
    assert all(count == 4 for count in readers.values())
    # Replica 0 reads slices (0,0),(0,1); replica 1 reads (1,0),(1,1).
    for rank in range(16):
        coords = mesh.coords(rank)
        assert mesh.slice_index(rank) == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}[(coords.dp, coords.cp)]


def test_defaults_are_one():
    mesh = Mesh(dp=4)
    assert (mesh.cp, mesh.tp, mesh.pp) == (1, 1, 1)
    assert [mesh.slice_index(r) for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dp": 0},
        {"dp": -1},
        {"dp": 2, "cp": 0},
        {"dp": 1, "tp": 0},
        {"dp": 1, "pp": -2},
        {"dp": 1.5},
        {"dp": "2"},
        {"dp": True},
        {"dp": None},
    ],
)
def test_bad_mesh_sizes(kwargs):
    with pytest.raises(ConfigError):
        Mesh(**kwargs)


@pytest.mark.parametrize("rank", [-1, 16, 100])
def test_coords_out_of_range(rank):
    mesh = Mesh(dp=2, cp=2, tp=2, pp=2)
    with pytest.raises(ConfigError) as info:
        mesh.coords(rank)
    assert str(rank) in str(info.value)
    with pytest.raises(ConfigError):
        mesh.slice_index(rank)


def test_rank_rejects_out_of_range_coords():
    mesh = Mesh(dp=2, cp=2, tp=2, pp=2)
    with pytest.raises(ConfigError):
        mesh.rank(Coords(pp=0, dp=0, cp=0, tp=2))


def test_mesh_is_frozen_and_hashable():
    mesh = Mesh(dp=2, cp=2)
    with pytest.raises(AttributeError):
        mesh.dp = 3  # type: ignore[misc]
    assert {mesh: 1}[Mesh(dp=2, cp=2)] == 1


# -- resolve_rank ----------------------------------------------------------------------


def test_resolve_rank_explicit():
    mesh = Mesh(dp=2, tp=2)
    assert resolve_rank(3, mesh, environ={}) == 3
    # An explicit rank wins over RANK.
    assert resolve_rank(1, mesh, environ={"RANK": "2", "WORLD_SIZE": "4"}) == 1


@pytest.mark.parametrize("rank", range(8))
def test_resolve_rank_from_env(rank):
    mesh = Mesh(dp=2, cp=2, tp=2)
    assert resolve_rank(None, mesh, environ={"RANK": str(rank), "WORLD_SIZE": "8"}) == rank
    assert resolve_rank(None, mesh, environ={"RANK": str(rank)}) == rank


def test_resolve_rank_single_process_default():
    assert resolve_rank(None, Mesh(dp=1), environ={}) == 0
    assert resolve_rank(None, Mesh(dp=1), environ={"WORLD_SIZE": "1"}) == 0


def test_world_size_mismatch_names_numbers():
    mesh = Mesh(dp=2, cp=3, tp=1, pp=1)
    with pytest.raises(ConfigError) as info:
        resolve_rank(None, mesh, environ={"RANK": "0", "WORLD_SIZE": "4"})
    msg = str(info.value)
    assert "4" in msg and "6" in msg
    assert "WORLD_SIZE" in msg
    # Also with an explicit rank.
    with pytest.raises(ConfigError):
        resolve_rank(0, mesh, environ={"WORLD_SIZE": "12"})


@pytest.mark.parametrize("world", ["abc", "-6", "6.0"])
def test_world_size_not_a_number(world):
    with pytest.raises(ConfigError):
        resolve_rank(0, Mesh(dp=6), environ={"WORLD_SIZE": world})


@pytest.mark.parametrize("rank", ["8", "100"])
def test_env_rank_out_of_range(rank):
    with pytest.raises(ConfigError) as info:
        resolve_rank(None, Mesh(dp=8), environ={"RANK": rank, "WORLD_SIZE": "8"})
    assert rank in str(info.value)


@pytest.mark.parametrize("rank", [-1, 8])
def test_explicit_rank_out_of_range(rank):
    with pytest.raises(ConfigError):
        resolve_rank(rank, Mesh(dp=8), environ={})


@pytest.mark.parametrize("rank", ["-1", "x", "", "1.0"])
def test_env_rank_not_a_number(rank):
    with pytest.raises(ConfigError):
        resolve_rank(None, Mesh(dp=8), environ={"RANK": rank})


def test_missing_rank_with_world_above_one():
    with pytest.raises(ConfigError) as info:
        resolve_rank(None, Mesh(dp=2, tp=2), environ={"WORLD_SIZE": "4"})
    assert "RANK" in str(info.value)
    with pytest.raises(ConfigError):
        resolve_rank(None, Mesh(dp=2), environ={})


def test_resolve_rank_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank(None, Mesh(dp=4)) == 3
