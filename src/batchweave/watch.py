"""A live view of a running namespace: the data and rendering behind ``batchweave watch``.

Reading and arithmetic are kept apart: ``SnapshotReader`` makes one ``Snapshot`` per
refresh from the log and the checkpoint watermarks (the only I/O here), ``rates`` turns
two snapshots into per-second rates, and ``frame_dict`` / ``frame_line`` / ``render``
present a snapshot with its rates as JSON, as one line of text (output that is not a
terminal) or as rich tables. ``follow`` is the refresh loop, with its sleep injected so
tests drive it without waiting; ``Tally`` keeps what the summary printed at a signal says.
The command's outputs are ``View`` objects (``view_for`` picks one), and
``stopped_by_signals`` turns SIGTERM and SIGINT into ``Stopped`` for the time of a watch
(``StopSignals``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any

import msgspec
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table

from batchweave.inspect import CheckpointInfo, json_number, live_checkpoints, producer_dict, read_state
from batchweave.journal import Journal
from batchweave.lifecycle.watermarks import global_watermark, read_watermarks
from batchweave.log import LogState, LogVersion, LogVersionHead
from batchweave.store import Store, open_store

__all__ = [
    "JsonView",
    "LinesView",
    "Rates",
    "Snapshot",
    "SnapshotReader",
    "StopSignals",
    "Stopped",
    "Tally",
    "TerminalView",
    "View",
    "checkpoint_table",
    "follow",
    "frame_dict",
    "frame_line",
    "overall_steps_per_s",
    "rates",
    "render",
    "stopped_by_signals",
    "summary_line",
    "view_for",
]

Clock = Callable[[], float]
Version = LogVersion | LogVersionHead


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the namespace looked like at one refresh."""

    url: str
    taken_at: float  # the reader's monotonic clock, seconds: only differences mean anything
    observed_at: float  # wall clock, Unix seconds, for people and logs
    version: int  # the newest committed log version
    steps: int  # steps (TGBs) committed
    end_of_stream: bool
    layout: dict[str, Any] | None  # {"dp", "cp", "kind"}; None before the first producer
    producers: dict[str, dict[str, Any]]  # id -> {"offset", "epoch"[, "metrics"]}, as inspect shows them
    checkpoints: tuple[CheckpointInfo, ...]  # not released, with their lag behind ``steps``
    reclaimed_steps: int = 0  # garbage collection deleted the steps below this
    reclaimed_versions: int = 0  # ... and the log versions below this
    reclaimed_bytes: int = 0  # ... and this many bytes of TGB objects
    collectable_below_step: int | None = None  # the oldest complete checkpoint: gc may reclaim up to here
    head_committed_at: float | None = None  # the head's commit time on its committer's clock (Unix s)
    overall_steps_per_s: float | None = None  # over the log history the store still holds


@dataclass(frozen=True, slots=True)
class Rates:
    """Per-second change between two snapshots; None where it cannot be known (first frame)."""

    interval_s: float | None = None
    steps_per_s: float | None = None
    offsets_per_s: dict[str, float | None] = field(default_factory=dict)  # per producer id


def rates(before: Snapshot | None, after: Snapshot) -> Rates:
    """The rates from ``before`` to ``after``: committed steps and each producer's source
    offsets per second. A producer that ``before`` did not know has no rate yet."""
    none: dict[str, float | None] = dict.fromkeys(after.producers)
    if before is None:
        return Rates(offsets_per_s=none)
    interval_s = after.taken_at - before.taken_at
    if interval_s <= 0:
        return Rates(offsets_per_s=none)
    offsets_per_s = {
        pid: None if pid not in before.producers else (p["offset"] - before.producers[pid]["offset"]) / interval_s
        for pid, p in after.producers.items()
    }
    return Rates(interval_s, (after.steps - before.steps) / interval_s, offsets_per_s)


def overall_steps_per_s(first: Version | None, head: Version | None, steps: int) -> float | None:
    """Steps committed after ``first`` per second of commit time until ``head`` (whose
    state has ``steps``). None without two distinct versions carrying timestamps (logs
    written before ``committed_at``, or one version only). Commit times come from the
    committers' clocks, so skew between machines shows up here, not in ``rates``."""
    if first is None or head is None or not first.committed_at or not head.committed_at:
        return None
    elapsed_s = head.committed_at - first.committed_at
    if elapsed_s <= 0:
        return None
    return (steps - first.first_step - first.tgb_count()) / elapsed_s


class SnapshotReader:
    """Reads one ``Snapshot`` per call from the namespace at ``url``.

    Opens the store with ``create=False``: a missing local directory is a ``ConfigError``
    at the first call, and nothing is created. Costs per call: one watermark listing (plus
    a read per mark), the newest snapshot, the versions committed since the previous call
    and the head version (for its commit time).
    """

    def __init__(
        self,
        url: str | Store,
        *,
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._journal = Journal(
            open_store(url, create=False, storage_options=storage_options), heads_only=True, read_only=True
        )
        self._clock = clock
        self._wall_clock = wall_clock
        self._state: LogState | None = None
        self._first: Version | None = None  # the oldest version the store holds (for the overall rate)

    def __call__(self) -> Snapshot:
        if self._state is None:
            self._state, checkpoints = read_state(self._journal)
        else:
            checkpoints = read_watermarks(self._journal.store)  # first, as read_state explains
            self._state = self._newer_state(self._state)
        state = self._state
        oldest = global_watermark(checkpoints)
        head = self._journal.read_version(state.version) if state.version else None
        return Snapshot(
            url=self._journal.store.url,
            taken_at=self._clock(),
            observed_at=self._wall_clock(),
            version=state.version,
            steps=state.steps,
            end_of_stream=state.end_of_stream,
            layout=None if state.layout is None else msgspec.structs.asdict(state.layout),
            producers={pid: producer_dict(ps) for pid, ps in sorted(state.producers.items())},
            checkpoints=live_checkpoints(checkpoints, state.steps),
            reclaimed_steps=state.reclaimed.steps,
            reclaimed_versions=state.reclaimed.versions,
            reclaimed_bytes=state.reclaimed.bytes,
            collectable_below_step=None if oldest is None else min(int(oldest.position), state.steps),
            head_committed_at=head.committed_at if head is not None and head.committed_at else None,
            overall_steps_per_s=overall_steps_per_s(self._oldest_version(state), head, state.steps),
        )

    def _newer_state(self, state: LogState) -> LogState:
        """Catch up from the previous refresh instead of replaying the tail after the
        snapshot each time. Collection deletes versions only below the newest snapshot, so
        once a snapshot passes our version, the versions we would read may be gone: reload."""
        if self._journal.newest_snapshot_version() > state.version:
            return self._journal.load_state()
        return self._journal.catch_up(state)[0]

    def _oldest_version(self, state: LogState) -> Version | None:
        """The oldest version the store still holds: versions below ``reclaimed.versions``
        are deleted, the one at it is kept. Read again only when collection moves it."""
        oldest = max(1, state.reclaimed.versions)
        if self._first is None or self._first.version != oldest:
            self._first = self._journal.read_version(oldest) if state.version >= oldest else None
        return self._first


def follow(
    read: Callable[[], Snapshot],
    interval_s: float,
    *,
    count: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[tuple[Snapshot, Rates]]:
    """Snapshots ``interval_s`` apart, each with the rates since the one before: ``count``
    of them (no sleep after the last), or forever with None. A signal or Ctrl-C
    (KeyboardInterrupt) comes out of the ``sleep`` or the read; callers stop there."""
    before: Snapshot | None = None
    taken = 0
    while True:
        now = read()
        taken += 1
        yield now, rates(before, now)
        if taken == count:
            return
        before = now
        sleep(interval_s)


@dataclass(slots=True)
class Tally:
    """The frames a watch printed, for the summary it prints when a signal ends it."""

    refreshes: int = 0
    first: Snapshot | None = None
    last: Snapshot | None = None

    def add(self, snapshot: Snapshot) -> None:
        self.refreshes += 1
        if self.first is None:
            self.first = snapshot
        self.last = snapshot

    def summary(self, stopped_by: str, observed_at: float) -> dict[str, Any]:
        """What the watch saw from its first frame to its last, JSON-ready: the log head at
        both and the steps committed per second between them (None with fewer than two
        frames). ``stopped_by`` names the signal; ``observed_at`` is the wall clock at the stop."""
        first, last = self.first, self.last
        watched_s = None if first is None or last is None else last.taken_at - first.taken_at
        steps_per_s = None
        if first is not None and last is not None and watched_s:
            steps_per_s = (last.steps - first.steps) / watched_s
        return {
            "stopped_by": stopped_by,
            "observed_at": observed_at,
            "refreshes": self.refreshes,
            "watched_s": watched_s,
            "first": None if first is None else {"version": first.version, "steps": first.steps},
            "last": None if last is None else {"version": last.version, "steps": last.steps},
            "steps_per_s": steps_per_s,
        }


# -- presenting -----------------------------------------------------------------------


def frame_dict(snapshot: Snapshot, rate: Rates) -> dict[str, Any]:
    """One refresh as a JSON-ready dict (``watch --json`` prints one per line)."""
    return {
        "url": snapshot.url,
        "observed_at": snapshot.observed_at,
        "head": {
            "version": snapshot.version,
            "steps": snapshot.steps,
            "end_of_stream": snapshot.end_of_stream,
            "committed_at": snapshot.head_committed_at,
        },
        "layout": snapshot.layout,
        "interval_s": rate.interval_s,
        "steps_per_s": rate.steps_per_s,
        "overall_steps_per_s": snapshot.overall_steps_per_s,
        "producers": {
            pid: {**p, "offsets_per_s": rate.offsets_per_s.get(pid)} for pid, p in snapshot.producers.items()
        },
        "checkpoints": [c.to_dict() for c in snapshot.checkpoints],
        "gc": {
            "reclaimed_steps": snapshot.reclaimed_steps,
            "reclaimed_versions": snapshot.reclaimed_versions,
            "reclaimed_bytes": snapshot.reclaimed_bytes,
            "collectable_below_step": snapshot.collectable_below_step,
        },
    }


def frame_line(snapshot: Snapshot, rate: Rates) -> str:
    """One refresh as one line of ``key=value`` words (what ``watch`` prints when its output
    is not a terminal): the terminal view's head, its producers as a count with their
    summed rate, and the oldest complete checkpoint's lag. ``-`` where a value is unknown."""
    known = [r for r in rate.offsets_per_s.values() if r is not None]
    complete = [c.lag_steps for c in snapshot.checkpoints if c.complete]
    last_commit = _ago(snapshot).removesuffix(" s ago")
    words = {
        "version": snapshot.version,
        "steps": snapshot.steps,
        "eos": "yes" if snapshot.end_of_stream else "no",
        "last_commit": "-" if last_commit == "-" else f"{last_commit}s",
        "steps/s": _rate(rate.steps_per_s),
        "overall": _rate(snapshot.overall_steps_per_s),
        "producers": len(snapshot.producers),
        "idle": sum(r == 0 for r in known) if known else "-",
        "offsets/s": _rate(sum(known) if known else None),
        "checkpoints": len(snapshot.checkpoints),
        "incomplete": len(snapshot.checkpoints) - len(complete),
        "lag": _number(max(complete)) if complete else "-",
        "gc_reclaimed": snapshot.reclaimed_steps,
        "gc_may_reclaim": "-" if snapshot.collectable_below_step is None else snapshot.collectable_below_step,
    }
    return _line(snapshot.observed_at, words)


def summary_line(summary: dict[str, Any]) -> str:
    """``Tally.summary`` as the last line of a watch ended by a signal."""
    first, last = summary["first"] or {}, summary["last"] or {}
    watched_s = summary["watched_s"]
    words = {
        "stopped": summary["stopped_by"],
        "refreshes": summary["refreshes"],
        "watched": "-" if watched_s is None else f"{watched_s:.1f}s",
        "version": f"{first.get('version', '-')}..{last.get('version', '-')}",
        "steps": f"{first.get('steps', '-')}..{last.get('steps', '-')}",
        "steps/s": _rate(summary["steps_per_s"]),
    }
    return _line(summary["observed_at"], words)


def _line(observed_at: float, words: dict[str, Any]) -> str:
    """A UTC timestamp (ISO 8601, milliseconds), then the words: one value never holds a space."""
    at = datetime.fromtimestamp(observed_at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return " ".join([at, *(f"{key}={value}" for key, value in words.items())])


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ago(snapshot: Snapshot) -> str:
    if snapshot.head_committed_at is None:
        return "-"
    return f"{max(0.0, snapshot.observed_at - snapshot.head_committed_at):.1f} s ago"


def render(snapshot: Snapshot, rate: Rates) -> RenderableType:
    """One refresh as rich tables: the head, producers, checkpoints and collection."""
    head = Table(title=f"watch {snapshot.url}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column(overflow="fold")
    layout = snapshot.layout or {}
    head.add_row("layout", " ".join(f"{k}={layout[k]}" for k in ("dp", "cp", "kind") if layout.get(k)) or "-")
    head.add_row("log head", f"version {snapshot.version}, {snapshot.steps} steps committed")
    head.add_row("end of stream", "yes" if snapshot.end_of_stream else "no")
    head.add_row("last commit", _ago(snapshot))
    head.add_row("steps/s", f"{_rate(rate.steps_per_s)} now, {_rate(snapshot.overall_steps_per_s)} overall")
    reclaimed = f"below step {snapshot.reclaimed_steps} ({snapshot.reclaimed_bytes:,} bytes of TGBs)"
    head.add_row("gc reclaimed", reclaimed)
    collectable = snapshot.collectable_below_step
    head.add_row(
        "gc may reclaim", "nothing: no complete checkpoint" if collectable is None else f"below step {collectable}"
    )
    parts: list[RenderableType] = [head]
    if snapshot.producers:
        producers = Table(title="producers", title_justify="left")
        producers.add_column("producer id")
        producers.add_column("next offset", justify="right")
        producers.add_column("epoch", justify="right")
        producers.add_column("offsets/s", justify="right")
        producers.add_column("published metrics", overflow="fold")
        for pid, p in snapshot.producers.items():
            metrics = ", ".join(f"{k}={v:.4g}" for k, v in p.get("metrics", {}).items())
            offsets_per_s = _rate(rate.offsets_per_s.get(pid))
            producers.add_row(pid, str(p["offset"]), str(p["epoch"]), offsets_per_s, metrics or "-")
        parts.append(producers)
    if snapshot.checkpoints:
        parts.append(checkpoint_table(snapshot.checkpoints))
    return Group(*parts)


def checkpoint_table(checkpoints: tuple[CheckpointInfo, ...]) -> Table:
    """The checkpoints not released: ``inspect`` and ``watch`` show them alike."""
    table = Table(title="checkpoints", title_justify="left")
    table.add_column("checkpoint id")
    table.add_column("complete")
    table.add_column("position", justify="right")
    table.add_column("version", justify="right")
    table.add_column("lag (steps)", justify="right")
    for c in checkpoints:
        complete = "yes" if c.complete else "no (protects nothing)"
        table.add_row(c.id, complete, _number(c.position), str(c.version), _number(c.lag_steps))
    return table


def _number(value: Fraction) -> str:
    number = json_number(value)
    return str(number) if isinstance(number, int) else f"{number:.2f}"


# -- the command's outputs and its stop ------------------------------------------------


class Stopped(Exception):
    """A signal that ends a watch (SIGTERM, SIGINT), raised where the watch was waiting."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopSignals:
    """SIGTERM and SIGINT as ``Stopped``, raised in the main thread where it waits (the
    sleep, a store read). Inside ``whole`` the first signal waits for the block to end, so
    that a frame is printed and counted whole; a second one raises at once (a pipe that
    nobody reads must not make a watch deaf to signals)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._deferring = False

    def handle(self, number: int, _frame: object) -> None:
        first = self.received is None
        self.received = signal.Signals(number).name
        if not (self._deferring and first):
            raise Stopped(self.received)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self.received is not None:
            raise Stopped(self.received)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[StopSignals]:
    """For the time of a watch, SIGTERM and SIGINT are ``StopSignals``. The handlers of
    before are back on the way out, so a signal while the summary prints acts as it would
    without a watch. A signal ignored at the start (``nohup``, a background job's SIGINT)
    stays ignored. Outside the main thread, which alone may set handlers, nothing changes."""
    signals = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return
    previous = {
        sig: signal.signal(sig, signals.handle)
        for sig in (signal.SIGTERM, signal.SIGINT)
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        yield signals
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class View:
    """How ``watch`` shows its refreshes and, when a signal ends it, its summary: one
    subclass per kind of output, picked once by ``view_for``."""

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def show(self, snapshot: Snapshot, rate: Rates) -> None:
        raise NotImplementedError

    def stopped(self, summary: dict[str, Any]) -> None:
        raise NotImplementedError


class LinesView(View):
    """Not a terminal: one ``frame_line`` per refresh, flushed so that a pipe has it now."""

    def show(self, snapshot: Snapshot, rate: Rates) -> None:
        print(frame_line(snapshot, rate), flush=True)

    def stopped(self, summary: dict[str, Any]) -> None:
        print(summary_line(summary), flush=True)


class JsonView(View):
    """``--json``: one ``frame_dict`` per line; the summary is one more object, told apart
    by its ``stopped_by`` key."""

    def show(self, snapshot: Snapshot, rate: Rates) -> None:
        print(json.dumps(frame_dict(snapshot, rate), sort_keys=True), flush=True)

    def stopped(self, summary: dict[str, Any]) -> None:
        print(json.dumps(summary, sort_keys=True), flush=True)


class TerminalView(View):
    """A terminal: the tables of ``render``, redrawn in place; the last stays on screen."""

    def __init__(self, console: Console) -> None:
        self._console = console
        # No auto-refresh thread: the view changes only when a new snapshot arrives.
        self._live = Live(console=console, auto_refresh=False)

    def __enter__(self) -> TerminalView:
        self._live.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.stop()

    def show(self, snapshot: Snapshot, rate: Rates) -> None:
        self._live.update(render(snapshot, rate), refresh=True)

    def stopped(self, summary: dict[str, Any]) -> None:
        self._console.print(summary_line(summary), highlight=False, soft_wrap=True)


def view_for(json_lines: bool) -> View:
    """JSON lines with ``json_lines``; else the tables on a terminal, lines anywhere else.
    Rich draws a live view only on what it takes for a terminal, and it takes a pipe for
    one under FORCE_COLOR: the tables need both it and ``isatty``."""
    if json_lines:
        return JsonView()
    console = Console()
    if sys.stdout.isatty() and console.is_terminal:
        return TerminalView(console)
    return LinesView()
