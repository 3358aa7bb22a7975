"""The story a run tells: every event recorded (its ``kind`` and facts go to the summary
and the figure) and printed as it happens, with what it proves."""

from __future__ import annotations

import time
from typing import Any


class Story:
    """The run's events, in order; ``started`` is the run's start on the monotonic clock."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.events: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def tell(self, kind: str, text: str, proves: str = "", **facts: Any) -> dict[str, Any]:
        """Record one event (its ``kind`` and facts go to the summary) and print it."""
        t = round(self.elapsed_s(), 2)
        record = {"kind": kind, "t_s": t, **facts}
        self.events.append(record)
        self.console.print(f"[dim]{t:6.1f}s[/] {text}", highlight=False)
        if proves:
            self.console.print(f"        [green]proves:[/] {proves}", highlight=False)
        return record

    def kinds(self) -> set[str]:
        return {e["kind"] for e in self.events}

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]
