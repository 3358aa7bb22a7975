"""What the demo shows in the terminal: the live progress bars while it streams, and the
summary table at the end (rich renderables)."""

from __future__ import annotations

from typing import Any

from batchweave.log import LogState
from batchweave_demo.plan import DemoPlan, producer_id


def render_live(plan: DemoPlan, state: LogState | None, appended: Any, progress: Any) -> Any:
    """Progress bars: steps committed, each producer's offsets, each rank's (and the
    twin's) steps received; ``appended`` and ``progress`` are the shared counters."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    committed = state.steps if state else 0
    table = Table.grid(padding=(0, 2))
    table.add_row(
        "[bold]committed[/]",
        ProgressBar(total=plan.steps, completed=committed, width=30),
        f"{committed}/{plan.steps} steps, log v{state.version if state else 0}",
    )
    for i, share in enumerate(plan.shares):
        done = state.producers[producer_id(i)].offset if state and producer_id(i) in state.producers else 0
        epoch = state.producers[producer_id(i)].epoch if state and producer_id(i) in state.producers else "-"
        table.add_row(
            f"{producer_id(i)} e{epoch}",
            ProgressBar(total=share, completed=done, width=30),
            f"committed {done}/{share}, appended {appended[i]}",
        )
    for slot in range(plan.world + 1):
        name = f"rank {slot}" if slot < plan.world else f"twin {plan.victim_rank}"
        got = progress[slot]
        table.add_row(name, ProgressBar(total=plan.steps, completed=got, width=30), f"{got}/{plan.steps} steps")
    return Group(table)


def render_summary(summary: dict[str, Any]) -> Any:
    """The summary as a rich table (what ``batchweave demo`` prints at the end)."""
    from rich.table import Table

    table = Table(title="BatchWeave demo summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row(
        "steps", f"{summary['steps']} (expected {summary['steps_expected']}), log version {summary['log_version']}"
    )
    table.add_row("mesh", f"{summary['producers']} producers -> dp={summary['dp']} x cp={summary['cp']} ranks")
    table.add_row("store", f"{summary.get('url')} on {summary.get('where')}")
    table.add_row(
        "wall time", f"{summary.get('wall_time_s')} s to the end of stream ({summary.get('steps_per_s')} steps/s)"
    )
    table.add_row(
        "data",
        f"{summary['mb_committed']} MB committed, {summary['mb_live']} MB live after GC, "
        f"ranks read {summary['mb_read_by_ranks']} MB; commits {summary['commit_successes']}/"
        f"{summary['commit_attempts']} attempts, {summary['commit_conflicts']} conflicts",
    )
    counts: dict[str, int] = {}
    for e in summary["events"]:
        counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    table.add_row("events", ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items()))
    for c in summary["checks"]:
        mark = "[green]PASS[/]" if c["ok"] else "[red]FAIL[/]"
        table.add_row(f"check: {c['name']}", f"{mark} {c['detail']}")
    table.add_row("result", "[green]all checks passed[/]" if summary["ok"] else "[red]CHECKS FAILED[/]")
    table.add_row("files", f"{summary['directory']}  (summary.json, timeline.json, results/, checkpoints/)")
    if summary.get("figure"):
        table.add_row("figure", summary["figure"])
    if summary.get("store") == "local":
        table.add_row("inspect", f"batchweave inspect {summary['url']}")
    return table
