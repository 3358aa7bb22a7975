"""Commit policies: when a producer tries its next commit. Pure: no clock, no I/O.

A policy answers one question, ``wait_s(pending_tgbs, since_last_attempt_s)``: how many
seconds until the next attempt (0 means now, ``inf`` means wait for more TGBs), and
learns from ``observe(fragile_window_s, producers, success)`` after every attempt.
The producer's commit thread supplies the clock; tests supply numbers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from batchweave.commit.group import GroupCommit
from batchweave.errors import ConfigError

__all__ = [
    "AIMD",
    "DAC",
    "INCR",
    "POLICY_NAMES",
    "ClaimBackoff",
    "CommitPolicy",
    "Fixed",
    "Manual",
    "Naive",
    "RecentCommitters",
    "VersionsBetweenLooks",
    "resolve_policy",
]


@runtime_checkable
class CommitPolicy(Protocol):
    """What the producer's commit thread asks of a policy."""

    name: str

    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float: ...

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None: ...


class DAC:
    """Decentralized Adaptive Commit (paper section 5.2, Algorithm 1).

    After every attempt the gap to the next one is the smallest that keeps the conflict
    probability under ``epsilon`` and the share of time spent in commit I/O under
    ``delta`` (equations 8-10), jittered by ``rho`` to desynchronize producers (eq. 11).
    The fragile window is tracked as an EMA with coefficient ``alpha``; the producer
    count comes from the log, so the pool can grow and shrink without messages.

    The fragile-window estimate ``fragile_window_ema_s`` is Algorithm 1's EMA, started
    at 0, divided by the weight its samples carry so far, ``1 - (1 - alpha)**k`` after
    ``k`` observations (the bias correction of Adam's moment estimates): an unbiased
    average from the first sample on. Uncorrected, the estimate after the epoch claim
    is ``alpha`` times the window, and with gaps of tens of seconds a producer makes
    too few attempts to grow out of it (2 to 5 in a few minutes at 32 or 128
    producers), so the gaps came out at a fraction of eq. 8's and the conflict rate
    above ``epsilon``. The gap formulas are unchanged.
    """

    name = "dac"

    def __init__(
        self,
        epsilon: float = 0.05,
        delta: float = 0.1,
        alpha: float = 0.2,
        rho: float = 0.25,
        rng: random.Random | None = None,
    ) -> None:
        if not (0 < epsilon < 1 and 0 < delta <= 1 and 0 < alpha <= 1 and 0 <= rho < math.inf):
            raise ConfigError(
                f"DAC needs 0<epsilon<1, 0<delta<=1, 0<alpha<=1, rho>=0; got "
                f"epsilon={epsilon}, delta={delta}, alpha={alpha}, rho={rho}"
            )
        self.epsilon = epsilon
        self.delta = delta
        self.alpha = alpha
        self.rho = rho
        self.rng = rng or random.Random()
        self.fragile_window_ema_s = 0.0  # the estimate eq. 8-9 use: the EMA over its weight
        self.gap_s = 0.0
        self.producers = 1
        self._ema_s = 0.0  # Algorithm 1's EMA, from 0
        self._ema_weight = 0.0  # the weight of the samples in it: 1 - (1 - alpha)**k

    def t_conf(self, tau_s: float, producers: int) -> float:
        """Equation 8: the gap that keeps the Poisson conflict probability <= epsilon."""
        return max(0.0, (producers - 1) * tau_s / -math.log1p(-self.epsilon) - tau_s)

    def t_cost(self, tau_s: float) -> float:
        """Equation 9: the gap that keeps commit duty tau/(T+tau) <= delta."""
        return (1 - self.delta) / self.delta * tau_s

    def next_gap(self, fragile_window_s: float, producers: int, success: bool) -> float:
        """Fold one observed attempt into the EMA and return the new gap in seconds."""
        del success  # the EMA is updated whatever the outcome (Algorithm 1, line 9)
        self._ema_s = (1 - self.alpha) * self._ema_s + self.alpha * fragile_window_s
        self._ema_weight = (1 - self.alpha) * self._ema_weight + self.alpha
        self.fragile_window_ema_s = self._ema_s / self._ema_weight
        self.producers = max(1, producers)
        tau = self.fragile_window_ema_s
        t_star = max(self.t_conf(tau, self.producers), self.t_cost(tau))
        self.gap_s = t_star * (1 + self.rho * self.rng.random())
        return self.gap_s

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        self.next_gap(fragile_window_s, producers, success)

    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
        if pending_tgbs == 0:
            return math.inf
        return max(0.0, self.gap_s - since_last_attempt_s)

    def __repr__(self) -> str:
        return f"DAC(epsilon={self.epsilon}, delta={self.delta}, alpha={self.alpha}, rho={self.rho})"


class RecentCommitters:
    """The producer count N a policy is given: producers seen committing lately. Pure.

    DAC's conflict model (eq. 8) needs the producers that contend for the next version.
    Every id ever recorded overstates it once a pool shrinks or a worker stalls, and the
    gaps then stay sized for the old pool: commits turn rare and TGBs wait to be visible.
    So a producer counts while its newest commit was noticed (on this producer's clock,
    so hosts' clocks never meet) within ``window_gaps`` commit gaps, and at least
    ``min_window_s``. A live producer commits about once per gap, so it is missed only
    after several failed attempts in a row; a departed one stops counting a few gaps
    after its last commit. Every producer in the log counts when first seen.
    """

    def __init__(self, window_gaps: float = 4.0, min_window_s: float = 10.0) -> None:
        if window_gaps <= 0 or min_window_s < 0:
            raise ConfigError(
                f"RecentCommitters needs window_gaps > 0 and min_window_s >= 0, got {window_gaps}, {min_window_s}"
            )
        self.window_gaps = window_gaps
        self.min_window_s = min_window_s
        self._noticed: dict[str, tuple[int, float]] = {}  # id -> (its last version, when that was first seen)

    def update(self, last_versions: dict[str, int], now: float) -> None:
        """Record the log's ``producer id -> version of its newest commit`` as seen at ``now``."""
        for producer_id, version in last_versions.items():
            known = self._noticed.get(producer_id)
            if known is None or known[0] != version:
                self._noticed[producer_id] = (version, now)

    def count(self, now: float, gap_s: float) -> int:
        """Producers whose newest commit was noticed within the window ending at ``now``; at least 1."""
        window = max(self.min_window_s, self.window_gaps * gap_s)
        return max(1, sum(1 for _, seen in self._noticed.values() if now - seen <= window))


class VersionsBetweenLooks:
    """The producer count N that the versions others committed between two of this
    producer's commit attempts imply. Pure.

    A producer that jumps to the head (``Journal.commit(jump=True)``) no longer reads who
    committed the versions in between, so ``RecentCommitters`` sees only the heads it
    read. Their number it still knows, for free: the head's number less its own view's.
    Each contending producer commits about once per gap, and this one attempts about once
    per gap, so about N - 1 versions land between two of its attempts; an EMA (weight
    ``alpha``) smooths the count over attempts, as DAC smooths its windows.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ConfigError(f"VersionsBetweenLooks needs 0 < alpha <= 1, got {alpha}")
        self.alpha = alpha
        self._ema: float | None = None

    def observe(self, others_landed: int) -> None:
        """One attempt found ``others_landed`` versions of others since the previous one."""
        landed = max(0, others_landed)
        self._ema = landed if self._ema is None else (1 - self.alpha) * self._ema + self.alpha * landed

    def count(self) -> int:
        """The producers contending: this one and those the versions between imply; at least 1."""
        return 1 if self._ema is None else 1 + round(self._ema)


class Manual:
    """Never commit on its own: TGBs become visible at ``flush()`` or ``close()`` only.

    For producers that want a commit at points of their choosing (the end of a shard, a
    group of steps), and for measurements where every flush must be exactly one attempt.
    """

    name = "manual"

    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
        return math.inf

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        pass

    def __repr__(self) -> str:
        return "Manual()"


class Fixed:
    """Commit once ``every`` TGBs are pending (the paper's FIXED10 / FIXED100), retrying at once."""

    def __init__(self, every: int) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"Fixed policy needs every >= 1 TGBs, got {every!r}")
        self.every = every
        self.name = f"fixed{every}"

    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
        return 0.0 if pending_tgbs >= self.every else math.inf

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        pass

    def __repr__(self) -> str:
        return f"Fixed(every={self.every})"


class Naive(Fixed):
    """Commit every TGB as soon as it is written (the paper's Naive)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.name = "naive"

    def __repr__(self) -> str:
        return "Naive()"


class INCR(Fixed):
    """Start at ``start`` TGBs per commit and add ``step`` after every conflict (paper's INCR)."""

    def __init__(self, start: int = 10, step: int = 1) -> None:
        super().__init__(start)
        self.step = step
        self.name = "incr"

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        if not success:
            self.every += self.step

    def __repr__(self) -> str:
        return f"INCR(every={self.every}, step={self.step})"


class AIMD:
    """The paper's AIMD baseline (section 7.1): TCP's congestion control applied to commits.

    The interval is the number of pending TGBs that triggers an attempt. A conflict
    doubles it (``*backoff``): the producer commits half as often, as a TCP sender halves
    its window on a loss. A success takes ``step`` TGBs off it, never below one: the
    producer probes for more frequent commits one step at a time. It starts at
    ``start`` TGBs, where the paper's INCR starts.

    The paper's sentence reads "increase the interval by a fixed addend on success, halve
    it on conflict", but it names TCP's rule, under which a sender backs off on
    congestion and probes on success; read literally it commits twice as often after
    every conflict, so under contention it falls to one TGB per commit and most attempts
    conflict (7.4% success in ``bench dac``, where the paper reports 95.5%). The rule
    here keeps the paper's quantities (the interval, a fixed addend, a factor of two)
    in TCP's directions. The paper gives no addend or start; 1 and 10 TGBs are INCR's.
    """

    name = "aimd"

    def __init__(self, start: float = 10.0, step: float = 1.0, backoff: float = 2.0) -> None:
        finite = all(math.isfinite(x) for x in (start, step, backoff))
        if not (finite and start >= 1 and step > 0 and backoff > 1):
            raise ConfigError(
                f"AIMD needs finite start>=1 TGB, step>0 TGBs, backoff>1; got start={start}, step={step}, "
                f"backoff={backoff} (the paper's rule is step=1, backoff=2)"
            )
        self.interval = float(start)
        self.step = step
        self.backoff = backoff

    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
        return 0.0 if pending_tgbs >= math.floor(self.interval) else math.inf

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        if success:
            self.interval = max(1.0, self.interval - self.step)
        else:
            self.interval *= self.backoff

    def __repr__(self) -> str:
        return f"AIMD(interval={self.interval:g}, step={self.step:g}, backoff={self.backoff:g})"


_BY_NAME: dict[str, Callable[[], CommitPolicy]] = {
    "dac": DAC,
    "naive": Naive,
    "fixed10": lambda: Fixed(10),
    "fixed100": lambda: Fixed(100),
    "incr": INCR,
    "aimd": AIMD,
    "manual": Manual,
    "group": GroupCommit,
}
POLICY_NAMES = ("dac", "naive", "fixed10", "fixed100", "incr", "aimd")  # the paper's policies, benchmarked


class ClaimBackoff:
    """How long an epoch claim waits after losing the race for a log version.

    Producers that start together all claim at once, and each claim is a version of its
    own: retried at once, P producers race P, P-1, P-2 ... times, about 0.4 P**2 create-only
    PUTs on one key (1,413 at 64 producers). A loser instead waits a pause drawn uniformly
    from ``[0, bound]`` (full jitter, the AWS architecture blog's "Exponential Backoff And
    Jitter", 2015), the bound starting at two attempts' time and doubling after every lost
    race, up to ``max_s``: the retries of P rivals spread over about P attempts' time,
    where the log takes one claim per attempt's time anyway, after about log2(P) doublings.
    Measured (``benchmarks/scale_measure.claims``), the PUTs grow as about P log P instead.
    """

    def __init__(self, min_attempt_s: float = 0.005, max_s: float = 10.0, rng: random.Random | None = None) -> None:
        if not (min_attempt_s > 0 and max_s > 0):
            raise ConfigError(f"ClaimBackoff needs positive min_attempt_s and max_s, got {min_attempt_s}, {max_s}")
        self.min_attempt_s = min_attempt_s
        self.max_s = max_s
        self.losses = 0
        self._rng = rng  # None: the random module's (which a simulation replaces)

    def pause_s(self, attempt_s: float) -> float:
        """After one more lost race whose attempt (probe and put) took ``attempt_s`` seconds."""
        self.losses += 1
        bound = min(self.max_s, max(attempt_s, self.min_attempt_s) * 2**self.losses)
        return (self._rng or random).uniform(0, bound)


def resolve_policy(policy: CommitPolicy | str | None, *, background_commit: bool = True) -> CommitPolicy:
    """A policy object, or a fresh one built from its name (``"dac"``, ``"naive"``,
    ``"fixed10"``, ``"fixed100"``, ``"incr"``, ``"aimd"``, ``"manual"``, ``"group"`` for
    group commit, see ``batchweave.commit.group``).

    None is the default: group commit for a producer with a commit thread, DAC for one
    that commits in its own thread (``background_commit=False``: group commit's turns
    need the thread). Group commit is the default because it wins at every pool size
    measured (``bench producers --store local``, producers as shipped, 100 KB TGBs,
    docs/benchmarks/2026-12-02-6109ca4: 342 against 241 MB/s visible at 8 producers,
    215 against 170 at 32, 120 against 68 at 128; 2.0-3.0x DAC at 1 MB and 10 MB), and
    because its visibility does not grow with the pool as DAC's does (paper eq. 8: about
    20 fragile windows per other producer): P95 1.7-1.8 s at 8 and 16 producers there,
    against DAC's 13-21 s from 8 producers on."""
    if policy is None:
        return GroupCommit() if background_commit else DAC()
    if isinstance(policy, str):
        try:
            return _BY_NAME[policy.lower()]()
        except KeyError:
            raise ConfigError(f"unknown commit policy {policy!r}; known: {sorted(_BY_NAME)}") from None
    if isinstance(policy, type) or not isinstance(policy, CommitPolicy):
        raise ConfigError(
            f"commit_policy {policy!r} is not a policy instance with wait_s()/observe(); "
            "see batchweave.commit.policies.CommitPolicy"
        )
    return policy
