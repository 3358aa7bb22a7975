"""The demo's orchestration: one run's event loop. It starts the processes, reacts to
their messages with the kills and restarts, watches the checkpoints, collects garbage
once the story is ready for it, and samples the namespace for the timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchweave.journal import Journal
from batchweave.keys import DATA_PREFIX, parse_data_key
from batchweave.lifecycle.gc import collect_garbage
from batchweave.lifecycle.watermarks import CHECKPOINT_PREFIX, read_watermarks, release_checkpoint
from batchweave.log import LogState
from batchweave.store import Store, open_store
from batchweave_demo.plan import DemoPlan, checkpoint_id, producer_id
from batchweave_demo.processes import Processes
from batchweave_demo.render import render_live
from batchweave_demo.story import Story

_POLL_S = 0.25


class DemoRun:
    """One run: its processes, its story, and the facts the checks need."""

    def __init__(self, url: str, root: Path, plan: DemoPlan, console: Any) -> None:
        self.url, self.root, self.plan = url, root, plan
        self.results, self.checkpoints = root / "results", root / "checkpoints"
        self.results.mkdir()
        self.checkpoints.mkdir()
        self.store: Store = open_store(url)
        self.procs = Processes(url, plan, self.results, self.checkpoints)
        self.story = Story(console)
        self.timeline: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.facts: dict[str, Any] = {}  # what the checks need beyond the events
        self.state: LogState | None = None
        self.seen_checkpoints: set[str] = set()

    def start_all(self) -> None:
        plan = self.plan
        self.procs.start_all()
        names = [producer_id(i) for i in range(plan.producers)]
        self.story.tell(
            "processes_started",
            f"started {plan.producers} producer processes ({', '.join(names)}), "
            f"{plan.world} rank processes (dp={plan.dp} x cp={plan.cp}) and a twin of rank {plan.victim_rank} that "
            "is never killed; every one a separate OS process (spawn)",
            producers={producer_id(i): p.pid for i, p in enumerate(self.procs.producers)},
            consumers={name: p.pid for name, p in self.procs.consumers.items()},
        )

    # -- the event loop ----------------------------------------------------------------

    def tick(self, live: Any) -> None:
        """Wait up to _POLL_S for a child's message, then look at the namespace."""
        for conn in self.procs.ready(_POLL_S):
            received = self.procs.receive(conn)
            if received is not None:
                self.on_message(*received)
        self.failures += self.procs.producer_failures()
        self.sample()
        self.watch_checkpoints()
        live.update(self.render_live())

    def on_message(self, role: str, index: int, message: dict[str, Any]) -> None:
        if role == "producer" and message["event"] == "started":
            self.on_producer_started(index, message)
        elif role == "producer" and message["event"] == "uploaded":
            self.kill_producer(index, message)
        elif role == "rank" and message["event"] == "stopped":
            self.kill_rank(index, message)

    def load_state(self) -> LogState:
        return Journal(self.store).load_state()

    def sample(self) -> None:
        self.state = state = self.load_state()
        self.timeline.append(
            {
                "t_s": round(self.story.elapsed_s(), 3),
                "committed": state.steps,
                "live_bytes": state.bytes - state.reclaimed.bytes,
                "consumed": list(self.procs.progress),
            }
        )

    def render_live(self) -> Any:
        return render_live(self.plan, self.state, self.procs.appended, self.procs.progress)

    # -- the producer kill -------------------------------------------------------------

    def uncommitted_objects(self, pid: str, epoch: int, committed: int) -> list[tuple[str, int]]:
        """This incarnation's data objects at offsets the log has not committed: in the
        store, but named by no log version (it records the producer's next offset)."""
        found = []
        for info in self.store.list(f"{DATA_PREFIX}{pid}/"):
            parsed = parse_data_key(info.key)
            if parsed and parsed.epoch == epoch and parsed.offset >= committed:
                found.append((info.key, info.size))
        return sorted(found)

    def kill_producer(self, index: int, message: dict[str, Any]) -> None:
        pid, proc = producer_id(index), self.procs.producers[index]
        me = self.load_state().producers[pid]
        objects = self.uncommitted_objects(pid, me.epoch, me.offset)
        keys = [k for k, _ in objects]
        # A collection now must keep them: the live incarnation may still commit them.
        protected = not set(keys) & set(collect_garbage(self.url, grace_s=0, dry_run=True).orphans)
        self.procs.sigkill(proc)
        self.facts["orphan_keys"] = keys
        self.story.tell(
            "producer_killed_with_uncommitted",
            f"[red]SIGKILL[/] {pid} (pid {proc.pid}) after it uploaded offsets {message['first']}..{message['last']} "
            f"and before its flush(): {len(keys)} TGB objects ({sum(s for _, s in objects) / 1e6:.2f} MB) are in "
            f"the store, but the log says {pid}'s next offset is {me.offset}, so no version names them:\n"
            + "\n".join(f"          {k}" for k in keys),
            "uploaded is not visible (I1): no rank can read a TGB before a log version names it; "
            f"a GC dry run now {'keeps' if protected else 'would DELETE'} them (the live incarnation may commit them)",
            producer_id=pid,
            os_pid=proc.pid,
            uploaded_offsets=[message["first"], message["last"]],
            uncommitted_objects=len(keys),
            objects=keys,
            uncommitted_bytes=sum(s for _, s in objects),
            committed_at_kill=me.offset,
            epoch_before=me.epoch,
            protected_while_alive=protected,
        )
        self.procs.restart_producer(index)

    def on_producer_started(self, index: int, message: dict[str, Any]) -> None:
        if self.procs.incarnations[index] == 0:
            return
        killed = self.story.of("producer_killed_with_uncommitted")[-1]
        orphans = set(collect_garbage(self.url, grace_s=0, dry_run=True).orphans)
        keys = self.facts["orphan_keys"]
        self.story.tell(
            "producer_restarted",
            f"{killed['producer_id']} restarted (pid {self.procs.producers[index].pid}) with the same producer_id: "
            f"epoch {killed['epoch_before']} -> {message['epoch']}, resume_offset {message['resume_offset']}; "
            f"a GC dry run now calls {len(orphans & set(keys))} of the {len(keys)} objects orphans",
            "exactly-once across a crash (I3): the new incarnation redoes exactly the uncommitted offsets, and "
            "its higher epoch fences the dead one, so those objects can never be committed",
            producer_id=killed["producer_id"],
            os_pid=self.procs.producers[index].pid,
            epoch_after=message["epoch"],
            resume_offset=message["resume_offset"],
            orphaned_after_restart=len(orphans & set(keys)),
        )

    # -- the rank kill -----------------------------------------------------------------

    def kill_rank(self, rank: int, message: dict[str, Any]) -> None:
        proc = self.procs.consumers[f"rank-{rank}"]
        self.procs.sigkill(proc)
        step = message["checkpoint"]
        cursor = self.checkpoints / checkpoint_id(step) / f"rank-{rank}.json"
        self.story.tell(
            "consumer_killed",
            f"[red]SIGKILL[/] rank {rank} (pid {proc.pid}) after it received steps 0..{message['delivered'] - 1}; "
            f"its last checkpoint is {checkpoint_id(step)}",
            "",
            rank=rank,
            os_pid=proc.pid,
            delivered_steps=message["delivered"],
            checkpoint=checkpoint_id(step),
            checkpoint_step=step,
        )
        self.procs.start_consumer(f"rank-{rank}-resumed", rank, slot=rank, mark=True, resume=str(cursor))
        self.story.tell(
            "consumer_resumed",
            f"rank {rank} restarted (pid {self.procs.consumers[f'rank-{rank}-resumed'].pid}) from "
            f"{cursor.relative_to(self.root)} (Consumer.load_state_dict): it replays steps "
            f"{step}..{message['delivered'] - 1}, as a trainer restored to that checkpoint must",
            "a rank's crash needs nobody else (I7): the other ranks never stopped",
            rank=rank,
            from_step=step,
            cursor_file=str(cursor),
        )

    # -- checkpoints and garbage collection ---------------------------------------------

    def watch_checkpoints(self) -> None:
        """Note checkpoints every position has marked (one listing: a mark is an object per
        position), and collect garbage once the story is ready for it."""
        marks: dict[str, int] = {}
        for info in self.store.list(CHECKPOINT_PREFIX):
            checkpoint, _, name = info.key[len(CHECKPOINT_PREFIX) :].partition("/")
            marks[checkpoint] = marks.get(checkpoint, 0) + name.endswith(".json")
        for checkpoint in sorted(marks):
            if marks[checkpoint] == self.plan.world and checkpoint not in self.seen_checkpoints:
                self.seen_checkpoints.add(checkpoint)
                self.story.tell(
                    "checkpoint_complete",
                    f"[dim]checkpoint {checkpoint} marked by all {self.plan.world} ranks[/]",
                    checkpoint=checkpoint,
                    step=int(checkpoint.removeprefix("step-")),
                )
        if len(self.seen_checkpoints) >= 2:
            self.maybe_collect()

    def maybe_collect(self) -> None:
        """Once, after both kills: release all complete checkpoints but the newest, then GC.

        The twin reads without checkpoints, so nothing protects its data: wait until it has
        passed the checkpoint GC will keep."""
        if "gc" in self.story.kinds() or not {"producer_restarted", "consumer_resumed"} <= self.story.kinds():
            return
        live = sorted((c for c in read_watermarks(self.store) if c.live), key=lambda c: c.position)
        if len(live) < 2 or self.procs.progress[self.plan.twin_slot] < live[-1].position:
            return
        keep, older = live[-1].checkpoint, [c.checkpoint for c in live[:-1]]
        for checkpoint in older:
            release_checkpoint(self.url, checkpoint)
        self.story.tell(
            "checkpoints_released",
            f"released {len(older)} older checkpoint(s) ({', '.join(older)}) with "
            f"batchweave.release_checkpoint; {keep} is the oldest live one",
            released=older,
            kept=keep,
        )
        self.collect(keep)

    def collect(self, keep: str) -> None:
        """Collect garbage with a grace of 0 s: behind checkpoint ``keep``, and the killed
        producer's orphans."""
        before = self.load_state()
        report = collect_garbage(self.url, grace_s=0)
        keys = self.facts.get("orphan_keys", [])
        gone = [k for k in keys if self.store.size(k) is None]
        live_before = before.bytes - before.reclaimed.bytes  # producers keep committing meanwhile
        self.story.tell(
            "gc",
            f"[bold]collect_garbage[/] (grace 0, as `batchweave gc URL --grace-s 0`): reclaimed steps "
            f"0..{report.reclaimed_steps - 1} below {keep}, {len(report.deleted_objects)} objects "
            f"({report.deleted_bytes / 1e6:.2f} MB of the {live_before / 1e6:.2f} MB of live TGB data), "
            f"{report.deleted_versions} log versions, {report.deleted_watermarks} "
            f"watermark objects, and {len(gone)}/{len(keys)} orphans of the killed producer",
            "storage is reclaimed behind the oldest live checkpoint only (I4); a crashed incarnation's "
            "uploads do not leak",
            w_global_step=report.w_global_step,
            reclaimed_steps=report.reclaimed_steps,
            deleted_objects=len(report.deleted_objects),
            deleted_bytes=report.deleted_bytes,
            deleted_versions=report.deleted_versions,
            orphans_deleted=len(gone),
            orphans_expected=len(keys),
            live_bytes_before=live_before,
        )
