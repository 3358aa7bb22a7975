"""``bench exactly-once`` (benchmarks/exactly_once.py): the control's versions are well
formed and as large as the producer's, the run over time keeps both arms of each log on
a manifest of the same size and charges the growing manifest to both, and the windows
summarise by medians without the last round's overrun; a point's margin is its paired
differences' 95% interval.
"""

from __future__ import annotations

import math
import uuid

import msgspec
import pytest

from batchweave import keys, log
from batchweave.latency import LatencyStore
from benchmarks.exactly_once import (
    FLAT,
    GROWING,
    SERIES_MODEL,
    SeriesPlan,
    _control_body,
    _margin,
    _producer,
    _warm_up,
    run_series,
    verdict,
    windows,
)


def test_a_control_version_is_well_formed_and_the_size_of_the_producers():
    store = LatencyStore(f"memory://eo-test-{uuid.uuid4().hex[:8]}", SERIES_MODEL)
    with _producer(store, 8) as producer:
        template = _warm_up(producer, store, [b"\0" * 100] * 8)
    same_place = _control_body(template, template.version, template.first_step, 1)
    assert len(same_place) == len(log.encode(template))  # dummy metadata of the same size
    body = _control_body(template, 7, 40, 3)
    head = log.decode_version_head(body, keys.version_key(7), 7)  # as a growing manifest reads it
    assert (head.version, head.first_step, len(head.tgbs)) == (7, 40, 3)
    assert list(head.producers) == ["dummy"] and list(template.producers) == ["eo"]
    assert len(msgspec.json.encode(head.producers)) == len(msgspec.json.encode(template.producers))


def pair(elapsed_s: float, manifest_tgbs: int, state_s: float, control_s: float) -> dict[str, float]:
    return {"elapsed_s": elapsed_s, "manifest_tgbs": manifest_tgbs, "state_s": state_s, "control_s": control_s}


def test_a_window_is_the_median_of_its_pairs_and_the_overrun_is_left_out():
    pairs = [
        pair(0.1, 1, 0.110, 0.100),
        pair(0.5, 10, 0.105, 0.100),
        pair(0.9, 20, 0.900, 0.100),  # an outlier (a snapshot write) moves no median
        pair(1.2, 30, 0.220, 0.200),
        pair(1.8, 40, 0.202, 0.200),
        pair(2.1, 50, 9.000, 0.100),  # started after the run's end
    ]
    first, second = windows(pairs, window_s=1.0, duration_s=2.0)
    assert first["samples"] == 3 and first["elapsed_s"] == 0.5 and first["manifest_tgbs"] == 10
    assert first["state_s"] == 0.110 and first["control_s"] == 0.100
    assert first["overhead"] == pytest.approx(0.10)
    assert second["samples"] == 2 and second["manifest_tgbs"] == 30
    assert second["overhead"] == pytest.approx((0.10 + 0.01) / 2)


def test_the_run_keeps_both_arms_in_step_and_charges_the_growing_manifest_to_both():
    plan = SeriesPlan(duration_s=1.5, window_s=0.5, filler_tgbs=3000, tgb_slices=2, payload_bytes=64, min_rounds=2)
    pairs, manifest = run_series(plan, seed=3)
    growing, flat = pairs[GROWING], pairs[FLAT]
    assert len(growing) >= 2 and len(flat) >= 2, pairs
    # Every round adds the same TGBs to every arm of both logs (measure_pair checks the
    # producer's count against its control's before each pair).
    steps = [1 + round_ * (plan.filler_tgbs + 1) for round_ in range(min(len(growing), len(flat)))]
    assert [p["manifest_tgbs"] for p in growing][: len(steps)] == steps
    assert [p["manifest_tgbs"] for p in flat][: len(steps)] == steps
    model = SERIES_MODEL
    for record in growing[1:]:
        charge_s = manifest.commit_bytes(int(record["manifest_tgbs"]), 1) / model.bandwidth_bytes_s
        # The control's probe, put and anchor read, and the manifest's transfer, at the
        # model's medians (no jitter): a sleep is never shorter, so neither is the commit.
        assert record["control_s"] >= model.first_byte_s * 2 + model.put_s + charge_s, record
        assert record["state_s"] >= model.put_s + charge_s, record
    assert manifest.entry_bytes > 100 and manifest.history_tgbs == 0


def window_row(name: str, manifest_tgbs: int, overhead: float) -> dict:
    return {
        "kind": "window",
        "log": name,
        "manifest_tgbs": manifest_tgbs,
        "overhead": overhead,
        "commit_latency_control_s": 0.1,
    }


def test_the_verdict_gives_each_log_its_first_and_last_window_beside_the_paper():
    point = {
        "kind": "point",
        "tgb_slices": 8,
        "payload_bytes": 100_000,
        "overhead": 0.04,
        "overhead_ci95": 0.025,
        "anchor_check_cost": 0.3,
    }
    rows = [point, window_row(GROWING, 1, 0.05), window_row(GROWING, 40_000, 0.01), window_row(FLAT, 1, 0.04)]
    rows.append(window_row(FLAT, 40_000, 0.039))
    points, _, over_run = verdict(rows)
    assert "mean +4.0%, worst +4.0% at 8 slices / 100 KB, each point within +-2.5% (95%" in points
    assert f"{GROWING} +5.0% -> +1.0% (manifest 1 -> 40,000 TGBs" in over_run
    assert f"{FLAT} +4.0% -> +3.9%" in over_run and "+40.6% -> +32.4%" in over_run


def test_a_points_margin_is_the_paired_differences_confidence_interval():
    assert _margin([1.1, 1.2], [1.0, 1.0]) == pytest.approx(1.96 * 0.0707107 / 2**0.5, rel=1e-5)
    assert _margin([1.0, 1.0, 1.0], [0.5, 0.5, 0.5]) == 0  # a steady difference is certain
    assert math.isnan(_margin([1.0], [0.9]))  # one pair says nothing of its spread
