"""The demo's figure (``demo.png``): steps committed and consumed over time, and live TGB
bytes, with the kills and GC marked. Needs matplotlib (``pip install 'batchweave[demo]'``);
without it the figure is skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchweave_demo.plan import DemoPlan

_MARKS = {  # event kind -> (colour, line style, label)
    "producer_killed_with_uncommitted": ("tab:red", "-", "SIGKILL {producer_id} ({uncommitted_objects} uncommitted)"),
    "producer_restarted": ("tab:red", ":", "{producer_id} resumes at {resume_offset}"),
    "consumer_killed": ("tab:orange", "-", "SIGKILL rank {rank}"),
    "consumer_resumed": ("tab:orange", ":", "rank {rank} resumes at step {from_step}"),
    "gc": ("tab:green", "-", "GC: steps < {reclaimed_steps} reclaimed"),
    "end_of_stream": ("grey", "--", "end of stream"),
}


def draw_figure(timeline: list[dict[str, Any]], events: list[dict[str, Any]], plan: DemoPlan, path: Path) -> str | None:
    """Steps committed and consumed, and live TGB bytes, over time, with the kills and GC
    marked; returns the PNG's path, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    _plot_progress(ax, plt.get_cmap("Blues"), timeline, events, plan)
    t = [s["t_s"] for s in timeline]
    ax2.plot(t, [s["live_bytes"] / 1e6 for s in timeline], color="tab:blue", label="live TGB data (MB)")
    _mark_events((ax, ax2), events, plan)
    ax.set_ylabel("step")
    ax.set_ylim(0, plan.steps * 1.05)
    ax.set_title(f"BatchWeave demo: {plan.producers} producers, dp={plan.dp} x cp={plan.cp} ranks, {plan.steps} steps")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax2.set_ylabel("MB")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def _plot_progress(
    ax: Any, blues: Any, timeline: list[dict[str, Any]], events: list[dict[str, Any]], plan: DemoPlan
) -> None:
    """Steps committed, each rank's (and the twin's) steps received, the complete checkpoints."""
    t = [s["t_s"] for s in timeline]
    ax.plot(t, [s["committed"] for s in timeline], color="black", lw=2.2, label="steps committed (log)")
    for slot in range(plan.world + 1):  # ranks in blues, so the events' red, orange and green stand out
        twin = slot == plan.twin_slot
        ax.plot(
            t,
            [s["consumed"][slot] for s in timeline],
            lw=1.2,
            ls="--" if twin else "-",
            color="grey" if twin else blues(0.45 + 0.5 * slot / max(1, plan.world - 1)),
            label=f"twin of rank {plan.victim_rank} (never killed)" if twin else f"rank {slot}: steps received",
        )
    marks = [e for e in events if e["kind"] == "checkpoint_complete"]
    ax.scatter([e["t_s"] for e in marks], [e["step"] for e in marks], marker="D", s=18, color="tab:purple", zorder=3)
    ax.plot([], [], "D", color="tab:purple", ms=4, label="checkpoint complete (all ranks marked)")


def _mark_events(axes: tuple[Any, Any], events: list[dict[str, Any]], plan: DemoPlan) -> None:
    """A vertical line on both panels for each kill, restart, GC and the end of stream.

    Events are numbered on the plot and named in the legend: several happen within a second."""
    ax, ax2 = axes
    marked = [e for e in events if e["kind"] in _MARKS]
    for n, e in enumerate(marked, 1):
        colour, style, label = _MARKS[e["kind"]]
        ax.axvline(e["t_s"], color=colour, ls=style, lw=1.2, label=f"{n}. {label.format(**e)} ({e['t_s']:.1f} s)")
        ax2.axvline(e["t_s"], color=colour, ls=style, lw=1.2)
        y = plan.steps * (1.0 - 0.07 * (n % 3))  # staggered, so close events stay readable
        ax.text(e["t_s"], y, str(n), ha="center", fontsize=8, bbox={"boxstyle": "circle", "fc": "white", "ec": colour})
