"""Shrinking a failing schedule: delta debugging over its recorded choices.

A run is a function of its choice list, so a smaller list that still fails with the
same kind of violation is a smaller counterexample. In order, while the budget lasts
(runs, which a test counts, or seconds, which a person at a terminal gives): the
shortest failing prefix (an exhausted list answers 0, the calm choice), then zeroing
chunks (calm stretches, no shift), then removing chunks (halves, quarters, ... single
choices), then lowering each value (to 0, else to half). Each accepted candidate is
replaced by what its run really recorded, so the list stays exactly replayable.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batchweave import keys
from batchweave.testing.simulation.choices import Choices
from batchweave.testing.simulation.run import Result, simulate
from batchweave.testing.simulation.world import Config, role

__all__ = ["format_trace", "shrink"]


class _Budget:
    """What a shrink may still spend: simulated runs, seconds, or both (None: no limit)."""

    def __init__(self, runs: int | None, seconds: float | None) -> None:
        self._runs = runs
        self._deadline = None if seconds is None else time.monotonic() + seconds

    def __bool__(self) -> bool:
        runs_left = self._runs is None or self._runs > 0
        return runs_left and (self._deadline is None or time.monotonic() < self._deadline)

    def spend(self) -> None:
        if self._runs is not None:
            self._runs -= 1


def shrink(
    failing: Result,
    config: Config,
    kind: str | None = None,
    budget_s: float | None = 60.0,
    *,
    budget_runs: int | None = None,
) -> Result:
    """The smallest run found that still has a violation of ``kind`` (default: the first's)
    by an actor of the same role (a lagging reader stays a lagging reader), within
    ``budget_runs`` simulated runs and ``budget_s`` seconds (None: no limit on that one;
    a test gives runs, so that a loaded machine shrinks as far as an idle one)."""
    first = next(v for v in failing.violations if kind is None or v.kind == kind)
    wanted = (first.kind, role(first.actor))
    budget = _Budget(budget_runs, budget_s)
    best = failing

    def attempt(candidate: list[int]) -> bool:
        nonlocal best
        if not budget:
            return False
        budget.spend()
        result = simulate(Choices(replay=candidate), config)
        same = any((v.kind, role(v.actor)) == wanted for v in result.violations)
        if same and len(result.choices) <= len(best.choices):
            best = result
            return True
        return False

    _shortest_prefix(best.choices, attempt)
    _zero_chunks(lambda: best.choices, attempt, budget)
    _remove_chunks(lambda: best.choices, attempt, budget)
    _lower_values(lambda: best.choices, attempt, budget)
    while best.choices and best.choices[-1] == 0:
        best.choices.pop()  # an exhausted list answers 0 anyway
    return best


def _shortest_prefix(choices: list[int], attempt: Callable[[list[int]], bool]) -> None:
    low, high = 0, len(choices)  # choices[:high] fails
    while low < high:
        middle = (low + high) // 2
        if attempt(choices[:middle]):
            high = middle
        else:
            low = middle + 1


def _zero_chunks(current: Callable[[], list[int]], attempt: Callable[[list[int]], bool], budget: _Budget) -> None:
    """Calm whole stretches of the schedule down (0 everywhere) without shifting the rest."""
    chunk = max(1, len(current()) // 4)
    while chunk >= 4 and budget:
        start = 0
        while start < len(current()) and budget:
            choices = current()
            if any(choices[start : start + chunk]):
                attempt([*choices[:start], *[0] * len(choices[start : start + chunk]), *choices[start + chunk :]])
            start += chunk
        chunk //= 2


def _remove_chunks(current: Callable[[], list[int]], attempt: Callable[[list[int]], bool], budget: _Budget) -> None:
    chunk = max(1, len(current()) // 2)
    while chunk >= 1 and budget:
        start = 0
        while start < len(current()) and budget:
            choices = current()
            if not attempt(choices[:start] + choices[start + chunk :]):
                start += chunk
        chunk //= 2


def _lower_values(current: Callable[[], list[int]], attempt: Callable[[list[int]], bool], budget: _Budget) -> None:
    index = 0
    while index < len(current()) and budget:
        choices = current()
        value = choices[index]
        if value and not attempt([*choices[:index], 0, *choices[index + 1 :]]) and value > 1:
            attempt([*choices[:index], value // 2, *choices[index + 1 :]])
        index += 1


def _short_key(key: str) -> str:
    """``_log/00000000000000000012.json`` reads as ``_log/12.json``."""
    head, _, tail = key.rpartition("/")
    digits = tail.split(".", 1)[0]
    if digits.isdigit() and len(digits) == 20:
        tail = str(int(digits)) + tail[20:]
    return f"{head}/{tail}" if head else tail


def _in_story(entry: tuple[float, str, str, str], culprits: set[str]) -> bool:
    """Log writes and deletes, claims of checkpoints, crashes, exits, what hub channels
    did, and whatever the violating actors did: the part of a trace that tells what happened."""
    _, actor, op, key = entry
    if actor in culprits or op in ("CRASH", "exit", "HUB"):
        return True
    return (
        op not in ("get", "get_range")
        and op != "list"
        and op != "size"
        and (key.startswith((keys.LOG_PREFIX + "0", keys.CHECKPOINT_PREFIX)))
    )


def format_trace(result: Result, last: int | None = None, story: bool = False) -> str:
    """The run's store operations, one a line: virtual seconds, actor, operation, key.
    ``story``: only the operations that tell what happened (``_in_story``)."""
    trace = result.trace
    if story:
        culprits = {v.actor for v in result.violations}
        trace = [entry for entry in trace if _in_story(entry, culprits)]
    lines = []
    repeats = 0
    for index, (t, actor, op, key) in enumerate(trace):
        if index + 1 < len(trace) and trace[index + 1][1:] == (actor, op, key):
            repeats += 1  # a poll repeated: one line says how often
            continue
        times = f" (x{repeats + 1} since {trace[index - repeats][0]:.2f})" if repeats else ""
        lines.append(f"{t:9.2f}  {actor:<10} {op:<14} {_short_key(key)}{times}")
        repeats = 0
    if last is not None and len(lines) > last:
        lines = [f"... {len(lines) - last} earlier operations", *lines[-last:]]
    return "\n".join(lines)
