"""After the stream: checkpoints resumed once the producers are done and the ranks have
stopped. A released (and collected) checkpoint must be refused; the oldest live one
resumes on twice the DP size and on DP size 1, each reading every remaining slice once."""

from __future__ import annotations

import json
from typing import Any

from batchweave.consumer import Consumer
from batchweave.errors import DataReclaimedError
from batchweave.lifecycle.watermarks import global_watermark, read_watermarks
from batchweave_demo.directory import write_json
from batchweave_demo.orchestrator import DemoRun
from batchweave_demo.workers import CONSUMER_TIMEOUT_S
from batchweave_demo.workload import payload_checksum


def refuse_released(run: DemoRun) -> None:
    """A cursor of a released, collected checkpoint must be refused, not half-served."""
    released = run.story.of("checkpoints_released")
    if not released:
        return
    checkpoint = released[-1]["released"][-1]
    cursor = json.loads((run.checkpoints / checkpoint / "rank-0.json").read_text())
    consumer = Consumer(run.url, dp=run.plan.dp, cp=run.plan.cp, rank=0)
    try:
        consumer.load_state_dict(cursor)
        error = ""
    except DataReclaimedError as exc:
        error = str(exc)
    finally:
        consumer.close()
    run.story.tell(
        "released_checkpoint_refused",
        f"resuming from released checkpoint {checkpoint}: "
        + (f"refused, DataReclaimedError: {error}" if error else "[red]ACCEPTED[/]"),
        "GC deleted only what no live checkpoint can reach; a cursor from beyond that line gets a clear error",
        checkpoint=checkpoint,
        refused=bool(error),
        error=error,
    )


def resume_on_other_dp(run: DemoRun) -> None:
    """The oldest live checkpoint's cursor resumed on 2x DP and on DP 1, in this process."""
    oldest = global_watermark(read_watermarks(run.store))
    if oldest is None:
        run.failures.append("no live checkpoint left to resume on another DP size")
        return
    cursor = json.loads((run.checkpoints / oldest.checkpoint / "rank-0.json").read_text())
    for dp_new in [2 * run.plan.dp] + ([1] if run.plan.dp > 1 else []):
        _resume_on(run, dp_new, oldest.checkpoint, cursor)


def _resume_on(run: DemoRun, dp_new: int, checkpoint: str, cursor: dict[str, Any]) -> None:
    plan, reads, first_steps, steps_read = run.plan, [], set(), 0
    for rank in range(dp_new * plan.cp):
        with Consumer(run.url, dp=dp_new, cp=plan.cp, rank=rank, timeout_s=CONSUMER_TIMEOUT_S) as consumer:
            consumer.load_state_dict(cursor)
            first_steps.add(consumer.state_dict()["step"])
            for batch in consumer:
                assert isinstance(batch.data, dict)
                reads.append([*batch.data["source"].tolist(), payload_checksum(batch.data)])
                steps_read = max(steps_read, batch.step + 1 - min(first_steps))
    write_json(run.results / f"reshard-dp{dp_new}.json", {"dp": dp_new, "reads": reads})
    per_slice = plan.images
    before, after = plan.dp * plan.cp * per_slice, dp_new * plan.cp * per_slice
    new_step = min(first_steps)
    run.story.tell(
        "resumed_on_other_dp",
        f"{checkpoint} (saved at step {cursor['step']} with dp={plan.dp}) resumed with dp={dp_new}: it "
        f"continues at step {new_step} (each TGB is now {_steps_per_tgb(plan.dp, dp_new)} steps), global "
        f"batch {before} -> {after} images per step; {dp_new * plan.cp} rank(s) read {steps_read} steps, "
        f"{len(reads)} slices",
        "the cursor counts TGBs, not steps: another mesh resumes at the same data (docs/guides/resharding.md, "
        "'Why it works'; how it differs from the paper's cursor: docs/from-the-paper.md)",
        checkpoint=checkpoint,
        dp_from=plan.dp,
        dp_to=dp_new,
        saved_step=cursor["step"],
        resumed_step=new_step,
        resumed_steps_agree=len(first_steps) == 1,
        global_batch_from=before,
        global_batch_to=after,
        steps_read=steps_read,
        slices_read=len(reads),
        reads_file=str(run.results / f"reshard-dp{dp_new}.json"),
    )


def _steps_per_tgb(dp_from: int, dp_to: int) -> str:
    """Steps per TGB after a DP change, as text: 2, 1/2, ..."""
    return str(dp_from // dp_to) if dp_from >= dp_to else f"1/{dp_to // dp_from}"
