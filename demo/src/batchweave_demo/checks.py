"""The demo's checks, on what the processes actually received: dense step order, the
same TGB on every rank of a step, exactly-once offsets, the kills and resumes, GC, the
resumes on other DP sizes, and bit-identical regeneration of the payload.

Each takes the records the processes wrote and the run's events and returns
``{"name", "ok", "detail"}``; pure but for ``reshard_check``, which reads the resumes'
files. Tests feed them runs that must fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchweave_demo.directory import read_json
from batchweave_demo.plan import producer_id
from batchweave_demo.workload import build_slice, slice_checksum


def check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}


def stream_checks(
    ranks: list[dict[str, Any]], shares: Sequence[int], offsets: dict[str, int], end_of_stream: bool
) -> list[dict[str, Any]]:
    """Order, agreement and exactly-once over the ranks' streams. Pure: tests feed it."""
    tgbs = [tuple(s[:2]) for s in ranks[0]["sources"]]  # (producer, offset) of each step
    return [
        _namespace_check(sum(shares), offsets, end_of_stream),
        _order_check(ranks, sum(shares)),
        _agreement_check(ranks, tgbs),
        _exactly_once_check(tgbs, shares, offsets),
    ]


def _namespace_check(steps: int, offsets: dict[str, int], end_of_stream: bool) -> dict[str, Any]:
    return check(
        "namespace",
        sum(offsets.values()) == steps and end_of_stream,
        f"{sum(offsets.values())} TGBs committed (expected {steps}), end of stream: {end_of_stream}",
    )


def _order_check(ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    bad = [r["rank"] for r in ranks if r["steps"] != list(range(steps))]
    return check(
        "step order",
        not bad,
        f"ranks {bad} did not see steps 0..{steps - 1} once each in order"
        if bad
        else f"all {len(ranks)} ranks saw steps 0..{steps - 1} in order, no duplicate, no gap (across the kills)",
    )


def _agreement_check(ranks: list[dict[str, Any]], tgbs: list[tuple[int, ...]]) -> dict[str, Any]:
    disagree = sorted(
        {i for r in ranks for i, s in enumerate(r["sources"]) if i >= len(tgbs) or tuple(s[:2]) != tgbs[i]}
    )
    wrong_slice = [r["rank"] for r in ranks if any(s[2] != r.get("slice_index") for s in r["sources"])]
    return check(
        "same TGB per step",
        not disagree and not wrong_slice,
        (f"steps {disagree[:5]} differ across ranks; " if disagree else "")
        + (f"ranks {wrong_slice} got another rank's slice" if wrong_slice else "")
        or "every rank of every step read the same (producer, offset), each its own slice",
    )


def _exactly_once_check(tgbs: list[tuple[int, ...]], shares: Sequence[int], offsets: dict[str, int]) -> dict[str, Any]:
    per_producer: dict[int, list[int]] = {}
    for p, o in tgbs:
        per_producer.setdefault(p, []).append(o)
    bad = [
        producer_id(i)
        for i, share in enumerate(shares)
        if per_producer.get(i, []) != list(range(share)) or offsets.get(producer_id(i)) != share
    ]
    return check(
        "exactly-once offsets",
        not bad,
        f"producers {bad} have duplicate, missing or unordered offsets"
        if bad
        else "each producer's committed offsets are exactly 0..k-1 ("
        + ", ".join(f"{producer_id(i)}: {share}" for i, share in enumerate(shares))
        + ")",
    )


def payload_check(ranks: list[dict[str, Any]], images: int, focus: set[tuple[int, int]]) -> dict[str, Any]:
    """Regenerate sampled slices (and every slice of the ``focus`` TGBs) from their source
    and compare with the checksum the rank computed on what it read from the store."""
    steps = len(ranks[0]["sources"])
    samples = {(step, step % len(ranks)) for step in range(0, steps, max(1, steps // 12))}
    samples |= {
        (step, r) for step, s in enumerate(ranks[0]["sources"]) if tuple(s[:2]) in focus for r in range(len(ranks))
    }
    mismatched = []
    for step, r in sorted(samples):
        rec = ranks[r]
        if step >= len(rec["sources"]):
            mismatched.append((step, r))
            continue
        p, o, s = rec["sources"][step]
        if slice_checksum(build_slice(p, o, s, images)) != rec["checksums"][step]:
            mismatched.append((step, r))
    return check(
        "payload",
        not mismatched,
        f"{len(mismatched)} of {len(samples)} sampled slices differ from a regeneration: {mismatched[:5]}"
        if mismatched
        else f"{len(samples)} sampled slices (all of the re-made TGBs among them) regenerate bit-identically",
    )


def first_event(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next((e for e in events if e["kind"] == kind), {})


def producer_kill_checks(ranks: list[dict[str, Any]], events: list[dict[str, Any]], victim: int) -> list[dict]:
    kill, restart = first_event(events, "producer_killed_with_uncommitted"), first_event(events, "producer_restarted")
    n = kill.get("uncommitted_objects", 0)
    ok = (
        n > 0
        and kill.get("protected_while_alive") is True
        and restart.get("resume_offset") == kill.get("committed_at_kill")
        and restart.get("epoch_after", 0) > kill.get("epoch_before", 0)
        and restart.get("orphaned_after_restart") == n
    )
    resume = kill.get("committed_at_kill", 0)
    delivered = [(o, e) for r in ranks for (p, o, _), e in zip(r["sources"], r["epochs"], strict=True) if p == victim]
    stale = sorted({o for o, e in delivered if o >= resume and e != restart.get("epoch_after")})
    redone = sorted({o for o, _ in delivered if o in uploaded_offsets(kill)})
    return [
        check(
            "producer kill and resume",
            ok,
            f"{kill.get('producer_id')} killed with {n} uploaded, uncommitted TGB objects (kept by GC while it "
            f"lived: {kill.get('protected_while_alive')}); restarted at offset {restart.get('resume_offset')} "
            f"(log said {kill.get('committed_at_kill')}), epoch {kill.get('epoch_before')} -> "
            f"{restart.get('epoch_after')}; orphans after restart: {restart.get('orphaned_after_restart')}",
        ),
        check(
            "orphans never delivered",
            bool(kill) and not stale and redone == list(uploaded_offsets(kill)),
            f"offsets {stale} were delivered from the killed incarnation"
            if stale
            else f"every slice of {kill.get('producer_id')} from offset {resume} on came from epoch "
            f"{restart.get('epoch_after')}; offsets {kill.get('uploaded_offsets')} were re-made and delivered "
            "from the new incarnation, never from the orphans",
        ),
    ]


def uploaded_offsets(kill: dict[str, Any]) -> range:
    """The offsets the killed producer had uploaded, uncommitted (none without a kill)."""
    first, last = kill.get("uploaded_offsets", [0, -1])
    return range(first, last + 1)


def consumer_kill_check(
    events: list[dict[str, Any]], killed: dict[str, Any], resumed: dict[str, Any], twin: dict[str, Any], steps: int
) -> dict[str, Any]:
    kill = first_event(events, "consumer_killed")
    start, stop = kill.get("checkpoint_step", -1), kill.get("delivered_steps", -1)
    rest = list(range(start, steps))
    same_as_twin = resumed["checksums"] == twin["checksums"][start:] and resumed["sources"] == twin["sources"][start:]
    replay_same = killed["checksums"][start:stop] == resumed["checksums"][: stop - start]
    ok = (
        bool(kill)
        and 0 < start < stop
        and resumed.get("start_step") == start
        and resumed["steps"] == rest
        and twin["steps"] == list(range(steps))
        and same_as_twin
        and replay_same
    )
    return check(
        "consumer kill and resume",
        ok,
        f"rank {kill.get('rank')} killed after {stop} steps, resumed from its checkpoint at step {start}: received "
        f"steps {resumed['steps'][:1]}..{resumed['steps'][-1:]} ({len(resumed['steps'])} of the {len(rest)} "
        f"remaining); byte-identical to the uninterrupted twin: {same_as_twin}; the {stop - start} replayed "
        f"steps identical to the first delivery: {replay_same}",
    )


def gc_check(events: list[dict[str, Any]]) -> dict[str, Any]:
    gc, refused = first_event(events, "gc"), first_event(events, "released_checkpoint_refused")
    ok = (
        gc.get("reclaimed_steps", 0) > 0
        and gc.get("reclaimed_steps") == gc.get("w_global_step")
        and gc.get("deleted_bytes", 0) > 0
        and gc.get("orphans_deleted") == gc.get("orphans_expected", 0) > 0
        and refused.get("refused") is True
    )
    return check(
        "checkpoint-aligned GC",
        ok,
        f"steps below {gc.get('w_global_step')} (the oldest live checkpoint) reclaimed: "
        f"{gc.get('reclaimed_steps')}, {gc.get('deleted_bytes', 0) / 1e6:.2f} MB; orphans deleted "
        f"{gc.get('orphans_deleted')}/{gc.get('orphans_expected')}; released checkpoint "
        f"{refused.get('checkpoint')} refused: {refused.get('refused')}",
    )


def reshard_check(ranks: list[dict[str, Any]], events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Each resume on another DP size read every slice from the checkpoint on exactly once,
    byte-identical to what the original ranks read (DP grown: up to the last whole step)."""
    resumes = [e for e in events if e["kind"] == "resumed_on_other_dp"]
    original = {tuple(s): c for r in ranks for s, c in zip(r["sources"], r["checksums"], strict=True)}
    step_of = {tuple(s[:2]): i for i, s in enumerate(ranks[0]["sources"])}
    problems = []
    for e in resumes:
        grow = max(1, e["dp_to"] // e["dp_from"])
        first = e["saved_step"]
        last = first + (steps - first) // grow * grow
        reads = (read_json(Path(e["reads_file"])) or {"reads": []})["reads"]
        got = [tuple(r[:3]) for r in reads]
        expected = {s for s, _ in original.items() if first <= step_of.get(s[:2], -1) < last}
        if len(got) != len(set(got)) or set(got) != expected:
            problems.append(f"dp={e['dp_to']}: read {len(got)} slices, expected each of {len(expected)} once")
        elif any(original[tuple(r[:3])] != r[3] for r in reads):
            problems.append(f"dp={e['dp_to']}: slices differ from what the original ranks read")
        if e["resumed_step"] != first * e["dp_from"] // e["dp_to"] or not e["resumed_steps_agree"]:
            problems.append(f"dp={e['dp_to']}: resumed at step {e['resumed_step']}")
    return check(
        "resume on another DP size",
        len(resumes) >= 1 and not problems and all(e["slices_read"] > 0 for e in resumes),
        "; ".join(problems)
        or "; ".join(
            f"dp {e['dp_from']}->{e['dp_to']}: step {e['saved_step']}->{e['resumed_step']}, "
            f"{e['slices_read']} slices each read once, byte-identical"
            for e in resumes
        )
        or "no resume happened",
    )
