"""The parent's side of the demo's child processes: starting producers and ranks (each a
``spawn``ed OS process, see ``batchweave_demo.workers``), their pipes, and the kills.

Progress crosses processes in lock-free shared counters: a SIGKILLed writer cannot
wedge a lock. Only processes the demo started are killed, by their handle.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from batchweave_demo.plan import DemoPlan, producer_id
from batchweave_demo.workers import consumer_main, producer_main


class Processes:
    """Every producer and rank process of one run; ``killed`` holds the OS pids the demo
    killed on purpose (their exit is no failure)."""

    def __init__(self, url: str, plan: DemoPlan, results: Path, checkpoints: Path) -> None:
        self.url, self.plan, self.results, self.checkpoints = url, plan, results, checkpoints
        self.ctx = mp.get_context("spawn")
        self.appended = self.ctx.RawArray("q", plan.producers)  # offsets appended, per producer
        self.progress = self.ctx.RawArray("q", plan.world + 1)  # steps received, per rank and the twin
        self.producers: list[Any] = [None] * plan.producers
        self.incarnations = [0] * plan.producers
        self.consumers: dict[str, Any] = {}
        self.killed: set[int] = set()
        self.conns: dict[Connection, tuple[str, int]] = {}

    # -- starting --------------------------------------------------------------------

    def _spawn(self, target: Any, spec: dict[str, Any], shared: Any, name: str, role: tuple[str, int] | None) -> Any:
        pipe = self.ctx.Pipe() if role is not None else None
        child = None if pipe is None else pipe[1]
        proc = self.ctx.Process(target=target, args=(spec, shared, child), name=f"batchweave-demo-{name}", daemon=True)
        proc.start()
        if pipe is not None and role is not None:
            pipe[1].close()  # only the child holds its end: its death reads as EOF here
            self.conns[pipe[0]] = role
        return proc

    def start_producer(self, index: int) -> None:
        first = self.incarnations[index] == 0
        spec = {
            "url": self.url,
            "index": index,
            "share": self.plan.shares[index],
            "dp": self.plan.dp,
            "cp": self.plan.cp,
            "images": self.plan.images,
            "results": str(self.results),
            "incarnation": self.incarnations[index],
            "gate": self.plan.producer_gate if first and index == self.plan.victim_producer else 0,
        }
        self.producers[index] = self._spawn(producer_main, spec, self.appended, producer_id(index), ("producer", index))

    def restart_producer(self, index: int) -> None:
        self.incarnations[index] += 1
        self.start_producer(index)

    def start_consumer(self, name: str, rank: int, *, slot: int, mark: bool, gate: int = 0, resume: str = "") -> None:
        spec = {
            "url": self.url,
            "name": name,
            "rank": rank,
            "slot": slot,
            "dp": self.plan.dp,
            "cp": self.plan.cp,
            "results": str(self.results),
            "checkpoints": str(self.checkpoints),
            "checkpoint_every": self.plan.checkpoint_every,
            "steps": self.plan.steps,
            "mark": mark,
            "gate": gate,
            "resume": resume,
        }
        self.consumers[name] = self._spawn(consumer_main, spec, self.progress, name, ("rank", rank) if gate else None)

    def start_all(self) -> None:
        """The ranks (the victim with its gate), the twin of the victim, then the producers."""
        plan = self.plan
        for r in range(plan.world):
            gate = plan.rank_gate if r == plan.victim_rank else 0
            self.start_consumer(f"rank-{r}", r, slot=r, mark=True, gate=gate)
        self.start_consumer("twin", plan.victim_rank, slot=plan.twin_slot, mark=False)
        for i in range(plan.producers):
            self.start_producer(i)

    # -- messages ----------------------------------------------------------------------

    def ready(self, timeout_s: float) -> list[Connection]:
        """The pipes with a message (or an EOF) to read, waiting up to ``timeout_s``."""
        ready = set(wait(list(self.conns), timeout=timeout_s))
        return [c for c in self.conns if c in ready]

    def receive(self, conn: Connection) -> tuple[str, int, dict[str, Any]] | None:
        """(role, index, message) from a ready pipe; None once its child has exited (or
        was killed): nothing more will come, and the pipe is closed."""
        role, index = self.conns[conn]
        try:
            message = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            del self.conns[conn]
            conn.close()
            return None
        return role, index, message

    # -- ending ------------------------------------------------------------------------

    def sigkill(self, proc: Any) -> None:
        self.killed.add(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # for real: no handler, no flush, no goodbye
        proc.join()

    def stop_all(self) -> None:
        """Kill whatever of ours still runs (only after a failure), by handle."""
        for proc in [*self.producers, *self.consumers.values()]:
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns.clear()

    def producer_failures(self) -> list[str]:
        """Producers that exited with an error since the last call (each reported once)."""
        failures = []
        for i, proc in enumerate(self.producers):
            if proc.exitcode not in (None, 0) and proc.pid not in self.killed:
                failures.append(f"{producer_id(i)} exited with code {proc.exitcode}")
                self.killed.add(proc.pid)  # report it once
        return failures

    def consumer_failures(self) -> list[str]:
        """Ranks (and the twin) that did not exit cleanly, except those the demo killed."""
        return [
            f"{name} exited with code {proc.exitcode}"
            for name, proc in self.consumers.items()
            if proc.exitcode != 0 and proc.pid not in self.killed
        ]

    def producers_done(self) -> bool:
        return all(p.exitcode is not None for p in self.producers)

    def consumers_done(self) -> bool:
        return all(p.exitcode is not None for p in self.consumers.values())
