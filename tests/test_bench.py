"""The benchmarks run in --quick mode and write well-formed JSON, PNG and Markdown.

These check the plumbing, not the figures: the figures are measured by the
benchmarks themselves (`make bench`) and reported in the closing notes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from batchweave.policies import POLICY_NAMES

pytestmark = pytest.mark.slow

# Every ingestion run (dac, producers, pool-shrink) records these.
INGESTION = {
    *("system", "policy", "producers", "payload_bytes"),
    *("throughput_mb_s", "commit_success_rate", "tgbs_committed"),
}
REQUIRED = {
    "dac": INGESTION,
    "producers": INGESTION | {"visibility_p50_s", "visibility_p95_s"},
    "commit-cost": {"history_tgbs", "fragile_window_p50_s", "fragile_window_p95_s"},
    "exactly-once": {
        "tgb_slices",
        "payload_bytes",
        "commit_latency_state_s",
        "commit_latency_control_s",
        "commit_latency_unanchored_s",
        "anchor_check_cost",
    },
    "lifecycle": {"deletion", "step", "bytes_stored"},
    "pool-shrink": INGESTION | {"counting", "stay", "producers_counted", "after_visibility_wait_s"},
    "consumers": {
        *("system", "store", "world_size", "payload_bytes", "steps", "throughput_mb_s", "step_p50_s"),
        *("step_p95_s", "read_amplification", "requests_per_step", "first_batch_s", "exact_resume"),
    },
    "e2e": {"system", "steps", "steps_per_s", "step_p50_s", "step_p95_s", "data_wait_fraction"},
    "overhead": {"store", "side", "steps", "batchweave_s", "plain_s", "plain_kind", "ratio", "target", "met"},
}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_quick_benchmark_writes_its_three_files(name, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "bench", name, "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / f"{name}.json").read_text())
    assert result["benchmark"] == name and result["config"]["machine"]["cpu_count"] >= 1
    assert result["config"]["quick"] is True and "store" in result["config"]
    assert result["results"], "no records"
    for record in result["results"]:
        assert REQUIRED[name] <= record.keys(), REQUIRED[name] - record.keys()
        assert not isinstance(record.get("error"), str) or record.get("system") == "nats", record["error"]
    if name == "pool-shrink":
        counted = {r["counting"]: r["producers_counted"] for r in result["results"]}
        assert counted["every id ever seen"] == result["config"]["producers"], counted
        # (a quick run ends before the departed age out: their last commits are seconds old)
        assert 1 <= counted["recent committers"] <= result["config"]["producers"], counted
    if name in ("dac", "producers"):
        ours = [r for r in result["results"] if r["system"] == "batchweave"]
        assert all(r["tgbs_committed"] > 0 and 0 < r["commit_success_rate"] <= 1 for r in ours)
        assert {r["system"] for r in result["results"]} == (
            {"batchweave", "nats", "raw-puts"} if name == "producers" else {"batchweave"}
        )
        if name == "producers":  # visible after the append, and no sooner than the raw put alone
            for record in ours + [r for r in result["results"] if r["system"] == "raw-puts"]:
                assert 0 < record["visibility_p50_s"] <= record["visibility_p95_s"], record
        policies = {(r["system"], r["policy"]) for r in result["results"]}
        if name == "dac":  # every policy, however short the run
            assert policies == {("batchweave", p) for p in POLICY_NAMES}, policies
        else:  # NATS at its default message limit and with the limit raised
            assert {("nats", "strict-tgb"), ("nats", "strict-tgb-64MiB")} <= policies, policies
    if name == "overhead":  # both sides on both stores, each timed against its plain requests
        assert {(r["store"], r["side"]) for r in result["results"]} == {
            (store, side) for store in ("local", "latency") for side in ("producer", "consumer")
        }
        assert all(r["batchweave_s"] > 0 and r["plain_s"] > 0 for r in result["results"])
        assert "consumer.py" in result["config"]["profiles"]["consumer"]  # a profile of our reading code
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / f"{name}.md").read_text()
    assert table.startswith(f"# {name}") and table.count("\n|") >= len(result["results"]) + 1
    assert str(out / f"{name}.json") in done.stdout  # the paths are printed for scripts


def test_unknown_benchmark_is_a_usage_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "bench", "nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "invalid choice" in done.stderr
