"""The run's summary: what every process received (read back from the records they
wrote under ``results/``), every check on it, and the run's figures of merit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchweave.log import LogState
from batchweave_demo.checks import (
    check,
    consumer_kill_check,
    first_event,
    gc_check,
    payload_check,
    producer_kill_checks,
    reshard_check,
    stream_checks,
    uploaded_offsets,
)
from batchweave_demo.directory import read_json
from batchweave_demo.plan import DemoPlan

_LISTS = ("steps", "sources", "checksums", "epochs")


def _load_reader(results: Path, name: str, rank: int) -> dict[str, Any]:
    empty: dict[str, Any] = {key: [] for key in _LISTS}
    return read_json(results / f"{name}.json") or {
        "name": name,
        "rank": rank,
        "bytes": 0,
        "start_step": 0,
        "error": "no result file",
        **empty,
    }


def _readers(plan: DemoPlan, results: Path) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Each rank's whole stream (the killed rank's: before its checkpoint, then its resumed
    incarnation's), the resumed incarnation's record alone, and the twin's."""
    ranks = [_load_reader(results, f"rank-{r}", r) for r in range(plan.world)]
    killed = ranks[plan.victim_rank]
    resumed = _load_reader(results, f"rank-{plan.victim_rank}-resumed", plan.victim_rank)
    start = resumed.get("start_step", 0)
    merged = dict(killed, error=killed["error"] or resumed["error"], bytes=killed["bytes"] + resumed["bytes"])
    merged.update({key: killed[key][:start] + resumed[key] for key in _LISTS})
    merged["before_kill"] = killed
    ranks[plan.victim_rank] = merged
    return ranks, resumed, _load_reader(results, "twin", plan.victim_rank)


def _all_checks(
    plan: DemoPlan,
    readers: tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]],
    events: list[dict[str, Any]],
    failures: list[str],
    state: LogState,
) -> list[dict[str, Any]]:
    ranks, resumed, twin = readers
    errors = [f"{r['name']}: {r['error']}" for r in [*ranks, resumed, twin] if r["error"]]
    checks = [
        check(
            "processes",
            not failures and not errors,
            "; ".join(failures + errors) or "every process exited cleanly, except the two the demo SIGKILLed",
        )
    ]
    offsets = {pid: p.offset for pid, p in state.producers.items()}
    checks += stream_checks(ranks, plan.shares, offsets, state.end_of_stream)
    checks += producer_kill_checks(ranks, events, plan.victim_producer)
    checks.append(consumer_kill_check(events, ranks[plan.victim_rank]["before_kill"], resumed, twin, plan.steps))
    checks.append(gc_check(events))
    checks.append(reshard_check(ranks, events, plan.steps))
    kill = first_event(events, "producer_killed_with_uncommitted")
    focus = {(plan.victim_producer, o) for o in uploaded_offsets(kill)}
    checks.append(payload_check(ranks, plan.images, focus))
    return checks


def summarize(
    plan: DemoPlan, results: Path, events: list[dict[str, Any]], failures: list[str], state: LogState
) -> dict[str, Any]:
    """The summary ``run_demo`` returns (before the run's url, times and figure are added)."""
    readers = _readers(plan, results)
    checks = _all_checks(plan, readers, events, failures, state)
    ranks = readers[0]
    records = [rec for p in sorted(results.glob("producer-*.json")) if (rec := read_json(p))]
    metric = lambda name: int(sum(rec.get("metrics", {}).get(name, 0) for rec in records))  # noqa: E731
    ranks[plan.victim_rank].pop("before_kill")
    return {
        "ok": all(c["ok"] for c in checks),
        "plan": plan.to_dict(),
        "producers": plan.producers,
        "dp": plan.dp,
        "cp": plan.cp,
        "steps": state.steps,
        "steps_expected": plan.steps,
        "log_version": state.version,
        "mb_committed": round(state.bytes / 1e6, 2),
        "mb_live": round((state.bytes - state.reclaimed.bytes) / 1e6, 2),
        "mb_read_by_ranks": round(sum(r["bytes"] for r in ranks) / 1e6, 2),
        "commit_attempts": metric("attempts"),
        "commit_successes": metric("successes"),
        "commit_conflicts": metric("conflicts"),
        "events": events,
        "checks": checks,
    }
