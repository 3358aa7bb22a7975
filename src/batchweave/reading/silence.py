"""A reader waiting at the head says so: when a silent log is worth a log record.

A rank pointed at a mistyped prefix, at an empty directory, or started long before its
producers finds no log version and would wait forever without a word (the default
``timeout_s`` is None). ``SilenceWatch`` follows the misses of one follower and decides
when to speak:

- **Nothing committed yet** (no version found since the follower started): a WARNING
  after ``FIRST_WARNING_S`` naming the URL and what to check, then again after twice
  as long, and so on, at most every ``MAX_REMINDER_S``; never again once a version
  is found.
- **Nothing new** (versions were found, then none for as long): the same rhythm at
  INFO, saying the producers may have stalled. Each new version starts the count afresh.

Only a follower that probes the head speaks: with node sharing, the node's hub (once per
node, not once per rank); otherwise each rank.

The decision is pure (``due`` takes the time); ``missed`` reads the clock given (this
module's ``time.monotonic`` by default, which a simulation may replace) and logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchweave.errors import ConfigError

__all__ = ["FIRST_WARNING_S", "MAX_REMINDER_S", "SilenceNotice", "SilenceWatch", "silence_message"]

# The consumer's logger: the message is about what a rank waits for.
_logger = logging.getLogger("batchweave.consumer")

# Seconds of silence before the first record: longer than a producer takes to start and
# commit its first TGB in the common case, short enough that a typo shows within a minute.
FIRST_WARNING_S = 30.0
# The longest pause between reminders while the silence lasts (the pauses double up to it).
MAX_REMINDER_S = 600.0


@dataclass(frozen=True, slots=True)
class SilenceNotice:
    """What a follower should say: ``empty`` (no version found ever) or nothing new,
    after ``waited_s`` seconds, with the next reminder in ``next_in_s`` seconds."""

    empty: bool
    waited_s: float
    next_in_s: float


def silence_message(url: str, notice: SilenceNotice) -> str:
    """The record for ``notice`` about the namespace at ``url``: what is wrong and what to check."""
    if notice.empty:
        return (
            f"no BatchWeave namespace at {url}: nothing committed yet after waiting {notice.waited_s:.0f} s. "
            "Check that this URL, prefix included, is the one the producers write to; that the producers are "
            "running and have committed (batchweave inspect URL); and that this process reaches the same store "
            "(endpoint and credentials: AWS_ENDPOINT_URL, AWS_PROFILE, ...). "
            f"Still waiting; next reminder in {notice.next_in_s:.0f} s"
        )
    return (
        f"{url}: no new log version for {notice.waited_s:.0f} s: the producers may have stopped or stalled "
        f"(batchweave watch URL shows their progress). Still waiting; next reminder in {notice.next_in_s:.0f} s"
    )


class SilenceWatch:
    """When one follower of ``url`` should say that the log shows nothing (see the module doc).

    Args:
        url: the namespace, named in the records.
        first_s: seconds of silence before the first record (``FIRST_WARNING_S``).
        max_reminder_s: the longest pause between reminders (``MAX_REMINDER_S``).
        clock: seconds on a monotonic clock (``time.monotonic`` by default).
    """

    def __init__(
        self,
        url: str,
        *,
        first_s: float | None = None,
        max_reminder_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.url = url
        # Read here, not as defaults: a test may shorten the module's constant first.
        self.first_s = FIRST_WARNING_S if first_s is None else first_s
        self.max_reminder_s = MAX_REMINDER_S if max_reminder_s is None else max_reminder_s
        if not (self.first_s > 0 and self.max_reminder_s > 0):  # also refuses nan
            raise ConfigError(
                f"{url}: a silence watch needs positive first_s and max_reminder_s (seconds), got "
                f"{self.first_s} and {self.max_reminder_s}"
            )
        self._clock = clock
        self.seen = False  # whether any version was ever found
        self._since: float | None = None  # when the current silence began (None: not silent)
        self._next_at = 0.0  # when the next record is due
        self._pause_s = 0.0  # the pause before the record after it

    def found(self) -> None:
        """A version was found: the silence, if any, is over."""
        self.seen = True
        self._since = None

    def due(self, now: float) -> SilenceNotice | None:
        """A miss at ``now``: the notice to give, if one is due."""
        if self._since is None:
            self._since, self._next_at, self._pause_s = now, now + self.first_s, self.first_s
            return None
        if now < self._next_at:
            return None
        self._pause_s = min(2 * self._pause_s, self.max_reminder_s)
        self._next_at = now + self._pause_s
        return SilenceNotice(empty=not self.seen, waited_s=now - self._since, next_in_s=self._pause_s)

    def missed(self) -> SilenceNotice | None:
        """A miss now: log the notice if one is due (WARNING while nothing was ever
        committed, INFO after), and return it."""
        notice = self.due(self._clock() if self._clock is not None else time.monotonic())
        if notice is not None:
            _logger.log(logging.WARNING if notice.empty else logging.INFO, "%s", silence_message(self.url, notice))
        return notice
