"""The one parser of saved cursors (``reading.cursor.parse_cursor``): every format ever
written loads to the same cursor, and each way a saved state can be wrong is refused with
a ``ConfigError`` that names the field and shows the value (checkpoints are files people
edit, merge and truncate)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from batchweave.errors import ConfigError
from batchweave.mesh import Mesh
from batchweave.reading.cursor import CURSOR_FORMAT, Cursor, cursor_state, parse_cursor

NAMESPACE = "0f" * 16
SAVED = {
    "format": CURSOR_FORMAT,
    "version": 7,
    "position_numerator": 9,
    "position_denominator": 2,
    "step": 9,
    "dp": 2,
    "cp": 1,
    "namespace": NAMESPACE,
}


def edited(**changes) -> dict:
    state = {**SAVED, **changes}
    return {key: value for key, value in state.items() if value is not DROP}


DROP = object()


def test_every_format_ever_saved_loads_to_the_same_cursor():
    mesh = Mesh(dp=2)
    expected = Cursor(7, Fraction(9, 2), 9, NAMESPACE)
    assert parse_cursor(SAVED, mesh) == expected
    consumer_v1 = {"format": "batchweave.cursor/1", "version": 7, "position": [9, 2], "step": 9, "namespace": NAMESPACE}
    assert parse_cursor(consumer_v1, mesh) == expected
    assert parse_cursor((consumer_v1 | {"position": (9, 2)}), mesh) == expected  # a tuple, as some savers write
    dataset_v1 = edited(format="batchweave.cursor/1")
    assert parse_cursor(dataset_v1, mesh) == expected
    assert parse_cursor(cursor_state(expected, mesh), mesh) == expected  # what state_dict() saves round-trips


def test_a_cursor_saved_before_namespace_ids_or_dp_loads_with_their_defaults():
    assert parse_cursor(edited(namespace=DROP), Mesh(dp=2)) == Cursor(7, Fraction(9, 2), 9, "")
    consumer_v1 = {"format": "batchweave.cursor/1", "version": 7, "position": [9, 2], "step": 9}  # no dp saved
    assert parse_cursor(consumer_v1, Mesh(dp=4)) == Cursor(7, Fraction(9, 2), 9, "")  # steps of this mesh
    assert parse_cursor(edited(namespace="a" * 64), Mesh(dp=2)).namespace == "a" * 64  # the longest id


@pytest.mark.parametrize(("saved_dp", "dp", "step"), [(2, 2, 9), (4, 2, 18), (2, 4, 4), (3, 1, 27)])
def test_a_cursors_step_is_recounted_in_the_new_meshs_steps(saved_dp, dp, step):
    """A TGB spans layout_dp / dp steps: the same position is step * saved_dp / dp here,
    rounded down (a position inside a step is refused at the first next())."""
    cursor = parse_cursor(edited(dp=saved_dp), Mesh(dp=dp))
    assert cursor.step == step and isinstance(cursor.step, int) and cursor.position == Fraction(9, 2)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (
            "not a mapping",
            r"not a BatchWeave consumer state \(expected format 'batchweave.cursor/2'\): 'not a mapping'",
        ),
        (
            {"format": "batchweave.cursor/9"},
            r"expected format 'batchweave.cursor/2'\): \{'format': 'batchweave.cursor/9'\}",
        ),
        (edited(step=DROP), r"consumer state \(batchweave.cursor/2\) lacks \['step'\]: \{'cp': 1, 'dp': 2"),
        (
            {"format": "batchweave.cursor/1", "version": 7, "position": [9, 2]},
            r"consumer state \(batchweave.cursor/1\) lacks \['step'\]",
        ),
        (edited(version=-1), r"non-negative integer version and step, got -1, 9$"),
        (edited(step=True), r"non-negative integer version and step, got 7, True$"),
        (edited(version="7"), r"got '7', 9$"),
        (
            {"format": "batchweave.cursor/1", "version": 7, "position": [9, 2, 1], "step": 9},
            r"needs position \[numerator, denominator\], got \[9, 2, 1\]",
        ),
        (
            {"format": "batchweave.cursor/1", "version": 7, "position": "9/2", "step": 9},
            r"needs position \[numerator, denominator\], got '9/2'",
        ),
        (edited(position_numerator=-9), r"position numerator must be a non-negative integer, got -9$"),
        (edited(position_numerator=4.5), r"position numerator must be a non-negative integer, got 4.5$"),
        (edited(position_denominator=0), r"position denominator must be a positive integer, got 0$"),
        (edited(position_denominator=-2), r"position denominator must be a positive integer, got -2$"),
        (edited(namespace=5), r"namespace must be the namespace's id string, got 5$"),
        (edited(namespace="a" * 65), r"namespace must be the namespace's id string, got 'aaaaa"),
        (edited(dp=0), r"dp must be a positive integer, got 0$"),
        (edited(dp=-2), r"dp must be a positive integer, got -2$"),
        (edited(dp=2.0), r"dp must be a positive integer, got 2.0$"),
    ],
)
def test_each_way_a_saved_cursor_is_wrong_is_named_with_its_value(state, match):
    with pytest.raises(ConfigError, match=match):
        parse_cursor(state, Mesh(dp=2))


def test_a_huge_edited_cursor_is_shown_bounded():
    with pytest.raises(ConfigError) as raised:
        parse_cursor(edited(step=list(range(10_000))), Mesh(dp=2))
    assert "..." in str(raised.value) and len(str(raised.value)) < 300
