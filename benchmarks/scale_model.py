"""The arithmetic of ``bench scale``: published store limits and prices, the projection of
measured per-actor request rates to thousands of ranks, and a discrete-event model of
log followers probing the head. Pure: no I/O, no clock; randomness from a seeded rng.

Three ways to the same number, so that each checks the others:
- measured: real Consumers on the counting latency model (``scale_measure``), 8 ranks;
- projected: one follower's request pattern times the followers of a job; the "before"
  column takes the pattern from the measured real consumer, the "after" column from
  ``follower_pattern`` (one follower, no jitter: each pause its mean) under
  ``batchweave.reading.polling.HeadPolling``;
- simulated: ``simulate`` runs every follower of the job (thousands), each with its
  own jittered pauses, against a committer, and counts each key's requests per second.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchweave.layout import DEFAULT_MAX_OBJECT_BYTES, MAX_SLICES_PER_OBJECT
from batchweave.lifecycle.backpressure import MAX_BACKOFF_S, poll_pause_s
from batchweave.reading.follower import ANCHOR_SPREAD
from batchweave.reading.polling import HEAD_BUDGET_PER_S, IDLE_PROOF_S, MIN_PAUSE_S
from batchweave.segment import segment_last

__all__ = [
    "LIMITS",
    "PRICES",
    "Limit",
    "MidpointRng",
    "Scale",
    "SimResult",
    "TodayPolling",
    "follower_pattern",
    "held_polls",
    "project",
    "simulate",
]

# -- published limits and prices ----------------------------------------------------------

READ_OPS = frozenset({"get", "head", "list"})
WRITE_OPS = frozenset({"put", "delete"})


@dataclass(frozen=True, slots=True)
class Limit:
    """A published request-rate limit. ``scope``: what one limit covers (a key, a prefix,
    a bucket, an account); ``ops``: "read", "write" or "all"; ``hard``: False where the
    store raises it by itself as load grows (it still throttles while it does)."""

    name: str
    scope: str
    ops: str
    per_s: float
    hard: bool
    document: str


S3_DOC = "Amazon S3 User Guide, 'Best practices design patterns: optimizing Amazon S3 performance'"
AZURE_BLOB_DOC = "Azure Storage documentation, 'Scalability and performance targets for Blob storage'"
AZURE_ACCOUNT_DOC = "Azure Storage documentation, 'Scalability and performance targets for standard storage accounts'"
GCS_DOC = "Google Cloud Storage documentation, 'Request rate and access distribution guidelines'"
LIMITS: tuple[Limit, ...] = (
    # A key cannot be split across partitions: its prefix's figure is its ceiling.
    Limit("S3 GET/HEAD per key", "key", "read", 5500, True, S3_DOC),
    Limit("S3 GET/HEAD per prefix", "prefix", "read", 5500, False, S3_DOC),
    Limit("S3 PUT/DELETE per prefix", "prefix", "write", 3500, False, S3_DOC),
    Limit("Azure requests per blob", "key", "all", 500, True, AZURE_BLOB_DOC),
    Limit("Azure requests per account", "account", "all", 20000, True, AZURE_ACCOUNT_DOC),
    Limit("GCS reads per bucket (initial)", "account", "read", 5000, False, GCS_DOC),
    Limit("GCS writes per bucket (initial)", "account", "write", 1000, False, GCS_DOC),
)

# S3 Standard, US East (N. Virginia), dollars per 1,000 requests, as published on the
# Amazon S3 pricing page (checked November 2026): GET/HEAD in the cheaper tier, PUT/COPY/
# POST/LIST in the dearer one; DELETE is free.
PRICES = {"get": 0.0004, "head": 0.0004, "put": 0.005, "list": 0.005, "delete": 0.0}
PRICES_AS_OF = "S3 Standard, US East (N. Virginia), per 1,000 requests, as published in November 2026"


# -- polling policies ---------------------------------------------------------------------


class Polling(Protocol):
    idle_proof_s: float

    def found(self, committed_at: float) -> None: ...
    def missed(self) -> float: ...


class TodayPolling:
    """The consumer's pauses before ``HeadPolling`` (to commit 6349aa0): doubling from
    0.01 s to ``max_poll_interval_s`` (1 s) after each miss, drawn from uniform(p/2, p),
    and an idle re-proof of the anchor every 10 s (the same constants as ``polling``'s)."""

    idle_proof_s = IDLE_PROOF_S
    floor_s = 0.0

    def __init__(self, max_poll_s: float = 1.0, rng: Any = None) -> None:
        self.max_poll_s = max_poll_s
        self._rng = rng or random.Random()
        self._pause = 0.0

    def found(self, committed_at: float) -> None:
        self._pause = 0.0

    def missed(self) -> float:
        self._pause = min(self.max_poll_s, max(MIN_PAUSE_S, self._pause * 2))
        return self._rng.uniform(self._pause / 2, self._pause)


class MidpointRng:
    """An rng whose every draw is the middle of its range: a policy's mean pauses."""

    def uniform(self, a: float, b: float) -> float:
        return (a + b) / 2


# -- the discrete-event model -------------------------------------------------------------

NEXT, ANCHOR, READ, SEGMENT_READ = "next version (miss)", "anchor (proof)", "version (read)", "segment (read)"
# A key of the model: a version (a segment as minus its last version), or (version, copy).
Key = int | tuple[int, int]


def catch_up_keys(first: int, head: int) -> list[int]:
    """The keys a follower reads to go from ``first`` to ``head`` (committed), as
    ``LogReadAhead`` does: version by version until two are found in a row, then each
    whole segment (32 versions, written once its last version is) as one object, the
    rest version by version. Versions as themselves, segments as minus their last."""
    keys: list[int] = []
    version = first
    while version <= head:
        last = segment_last(version)
        if version - first >= 2 and last <= head:
            keys.append(-last)
            version = last + 1
        else:
            keys.append(version)
            version += 1
    return keys


@dataclass(slots=True)
class SimResult:
    followers: int
    seconds: float  # counted (after the warm-up)
    hot_key_max_per_s: float  # the busiest key's requests in the busiest 1-s window
    hot_key_mean_per_s: float  # ... averaged over the windows
    hot_key_kind: str  # what the busiest key was at its peak (NEXT, ANCHOR, READ or SEGMENT_READ)
    per_follower_per_s: dict[str, float]  # requests by kind
    versions_per_s: float
    windows: list[float] = field(default_factory=list)  # the busiest key's count, window by window
    delays: list[float] = field(default_factory=list)  # commit to a follower's read, each version and follower

    def delay_percentile(self, q: float) -> float:
        """The ``q``-th percentile of ``delays`` (nan when none)."""
        if not self.delays:
            return float("nan")
        ordered = sorted(self.delays)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    @property
    def requests_per_follower_per_s(self) -> float:
        return sum(self.per_follower_per_s.values())


def simulate(
    followers: int,
    make_policy: Callable[[Any], Polling],
    *,
    commit_interval_s: float,
    flowing_s: float,
    idle_s: float = 0.0,
    warmup_s: float = 2.0,
    seed: int = 0,
    rng_factory: Callable[[int], Any] | None = None,
    request_s: float = 0.025,
) -> SimResult:
    """``followers`` log followers at the head while a committer commits a version every
    ``commit_interval_s`` for ``flowing_s`` seconds and then nothing for ``idle_s``.

    Counted: the windows of the flowing stretch after ``warmup_s`` when ``idle_s`` is 0,
    else the windows of the idle stretch after ``warmup_s``. A follower that probes a
    committed version reads every version up to the head (``catch_up_keys``: one GET a
    version, or a segment), proves the batch with one GET of its anchor (the newest
    version it had), and probes the next version at once; a probe that misses pauses as
    the policy says; a follower waiting re-proves its anchor every ``idle_proof_s``.
    After the end, followers go on (uncounted) until each has read the last version. Each probe takes ``request_s`` (the
    latency model's GET) before the pause starts. Followers start spread over one
    pause of the budget's floor (at least 1 s), as a job that has run a while is.

    With a policy that reads head copies (``copies`` > 0, ``journal.headcopies``), each
    probe and each read goes to one of the version's ``copies + 1`` keys at random (no
    segments near the head), and each proof's anchor is one of the last ``ANCHOR_SPREAD``
    versions read, as ``reading.follower.log_reader`` sets a follower up. ``delays`` records, for each
    version committed in the counted stretch, the seconds until each follower read it.
    """
    rng = random.Random(seed)
    make_rng = rng_factory or (lambda i: random.Random(seed * 1_000_003 + i))
    end = flowing_s + idle_s
    counted_from = warmup_s if idle_s == 0 else flowing_s + warmup_s
    counted_to = flowing_s if idle_s == 0 else end
    base = 10  # versions committed before the start (at time 0 and before)
    versions = int(flowing_s / commit_interval_s)

    def head_at(t: float) -> int:
        return base + min(versions, int(t / commit_interval_s))

    def committed_at(version: int) -> float:
        return max(0.0, (version - base) * commit_interval_s)

    policies = [make_policy(make_rng(i)) for i in range(followers)]
    copies = getattr(policies[0], "copies", 0)
    # Followers go on after the end (nothing counted) until each has read every version
    # committed: a delay is recorded when its version is read, however long after.
    drain_s = 2.0 * max(1.0, getattr(policies[0], "floor_s", 0.0))
    picks = random.Random(seed + 1)  # which of a version's keys a probe reads, which anchor a proof
    nxt = [base + 1] * followers
    proven: list[list[int]] = [[base] for _ in range(followers)]  # the newest versions read: anchors
    anchor = [base] * followers
    last_proof = [0.0] * followers
    windows: dict[int, Counter[Key]] = {}
    kinds: dict[tuple[int, Key], str] = {}
    by_kind: Counter[str] = Counter()
    delays: list[float] = []

    def count(t: float, key: Key, kind: str) -> None:
        if counted_from <= t < counted_to:
            window = int(t - counted_from)
            windows.setdefault(window, Counter())[key] += 1
            kinds[window, key] = kind
            by_kind[kind] += 1

    def head_key(version: int) -> Key:
        """The key a probe (or the read it makes) goes to: with copies, one of ``copies + 1``."""
        which = picks.randrange(copies + 1) if copies else 0
        return version if which == copies else (version, which)

    def prove(i: int, t: float, newest: int) -> None:
        count(t, anchor[i], ANCHOR)
        proven[i] = ([*proven[i], newest])[-ANCHOR_SPREAD:] if copies else [newest]
        anchor[i] = proven[i][picks.randrange(len(proven[i]))] if copies else newest

    events = [(rng.uniform(0.0, max(1.0, getattr(p, "floor_s", 0.0))), i) for i, p in enumerate(policies)]
    for policy in policies:
        policy.found(committed_at(base))
    heapq.heapify(events)
    while events:
        t, i = heapq.heappop(events)
        if t >= end + drain_s:
            continue
        policy = policies[i]
        head = head_at(t)
        if nxt[i] <= head:
            if copies:  # near the head: each version from one of its keys at random, no segments
                for version in range(nxt[i], head + 1):
                    count(t, head_key(version), READ)
            else:
                for key in catch_up_keys(nxt[i], head):
                    count(t, key, READ if key > 0 else SEGMENT_READ)
            for version in range(nxt[i], head + 1):
                if counted_from <= committed_at(version) < counted_to:
                    delays.append(t + request_s - committed_at(version))
            prove(i, t, head)
            nxt[i], last_proof[i] = head + 1, t
            policy.found(committed_at(head))
        count(t, head_key(nxt[i]), NEXT)  # the probe past the head (at once after reading)
        if t - last_proof[i] >= policy.idle_proof_s:
            count(t, anchor[i], ANCHOR)
            last_proof[i] = t
        heapq.heappush(events, (t + request_s + policy.missed(), i))
    result = _result(followers, windows, kinds, by_kind, counted_to - counted_from, versions / max(flowing_s, 1e-9))
    result.delays = delays
    return result


def held_polls(producers: int, *, window_s: float, seed: int = 0) -> tuple[float, float]:
    """The busiest key's (max, mean) requests per 1-s window of ``producers`` held producers
    polling the log's reclaim point, each its own process with its own timer: a first look
    after ``uniform(0, producers / HEAD_BUDGET_PER_S)``, then ``backpressure.poll_pause_s``
    (past the backoff, the pool's floor), one request each on the head key, counted for
    ``window_s`` after two floors. A pool measured as threads of one process on two cores
    polls in bursts where the interpreter stalls; independent processes do not."""
    rng = random.Random(seed)
    floor = producers / HEAD_BUDGET_PER_S
    start, end = 2 * floor, 2 * floor + window_s
    counts: Counter[int] = Counter()
    for _ in range(producers):
        t = rng.uniform(0, floor)
        while t < end:
            if t >= start:
                counts[int(t - start)] += 1
            t += poll_pause_s(MAX_BACKOFF_S, producers, rng.random())
    per_window = [counts.get(w, 0) for w in range(int(window_s))]
    return float(max(per_window)), sum(per_window) / len(per_window)


def _result(
    followers: int,
    windows: dict[int, Counter[Key]],
    kinds: dict[tuple[int, Key], str],
    by_kind: Counter[str],
    seconds: float,
    versions_per_s: float,
) -> SimResult:
    whole = [w for w in sorted(windows) if w + 1 <= seconds]
    tops = [(windows[w].most_common(1)[0], w) for w in whole]
    counts = [float(n) for (_, n), _ in tops]
    (key, peak), window = max(tops, key=lambda item: item[0][1]) if tops else ((0, 0), 0)
    return SimResult(
        followers=followers,
        seconds=seconds,
        hot_key_max_per_s=float(peak),
        hot_key_mean_per_s=sum(counts) / len(counts) if counts else 0.0,
        hot_key_kind=kinds.get((window, key), ""),
        per_follower_per_s={k: n / followers / seconds for k, n in sorted(by_kind.items())},
        versions_per_s=versions_per_s,
        windows=counts,
    )


def follower_pattern(make_policy: Callable[[Any], Polling], commit_interval_s: float, idle: bool) -> SimResult:
    """One follower's requests per second with every pause at its mean (no jitter): what
    the projection multiplies by the followers of a job."""
    floor = getattr(make_policy(MidpointRng()), "floor_s", 0.0)
    settle = max(20.0, 3 * floor)
    counted = max(120.0, 100 * floor)  # a hundred pauses at least: whole ones, few cut off at the end
    return simulate(
        1,
        make_policy,
        commit_interval_s=commit_interval_s,
        flowing_s=settle + counted if not idle else settle,
        idle_s=settle + counted if idle else 0.0,
        warmup_s=settle,
        rng_factory=lambda i: MidpointRng(),
    )


# -- the projection -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scale:
    """A job: ``ranks`` training ranks on nodes of ``ranks_per_node``, a dp x tp mesh
    (cp = pp = 1) with ``tp`` ranks of one (d, c) side by side on a node, ``producers``
    producers, one TGB a step at ``steps_per_s``, ``slice_bytes`` per (d, c) slice."""

    ranks: int
    producers: int
    ranks_per_node: int = 8
    tp: int = 8
    steps_per_s: float = 3.0
    slice_bytes: int = 1 << 20

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.ranks_per_node)

    @property
    def dp(self) -> int:
        return self.ranks // self.tp

    @property
    def tgb_parts(self) -> int:
        by_bytes = math.ceil(self.dp * self.slice_bytes / DEFAULT_MAX_OBJECT_BYTES)
        return max(1, by_bytes, math.ceil(self.dp / MAX_SLICES_PER_OBJECT))

    def data_reads_per_step(self, shared: bool) -> int:
        """Range reads of one step's TGB: one per rank, or with node sharing one per
        distinct (d, c) slice per node."""
        if not shared:
            return self.ranks
        slices_per_node = max(1, self.ranks_per_node // self.tp)  # tp ranks of a slice side by side
        nodes_per_slice = max(1, self.tp // self.ranks_per_node)  # a slice spread over nodes
        return self.dp * nodes_per_slice if self.tp >= self.ranks_per_node else self.nodes * slices_per_node


Rates = Mapping[tuple[str, str], float]  # (key class, operation) -> requests a second


@dataclass(frozen=True, slots=True)
class Load:
    """One state of one job: its requests a second by (key class, operation), and its
    busiest key's requests in the busiest second."""

    state: str
    rates: dict[tuple[str, str], float]
    hot_key_per_s: float
    hot_key: str

    @property
    def total_per_s(self) -> float:
        return sum(self.rates.values())

    def ops_per_s(self, ops: frozenset[str]) -> float:
        return sum(rate for (_, op), rate in self.rates.items() if op in ops)

    def usd_per_hour(self) -> float:
        return 3600 * sum(rate * PRICES.get(op, 0.0) / 1000 for (_, op), rate in self.rates.items())

    def prefix_per_s(self, producers: int, steps_per_s: float) -> dict[str, dict[str, float]]:
        """Reads and writes a second per prefix: the log, the intents and the watermarks
        one prefix each; data one per producer, of which the reads of one second fall on
        the prefixes of that second's TGBs (about ``steps_per_s`` of them)."""
        out: dict[str, dict[str, float]] = {}
        for (cls, op), rate in self.rates.items():
            prefix = PREFIX_OF_CLASS.get(cls, "other")
            if prefix == "data/<producer>/":
                rate /= max(1.0, min(producers, steps_per_s))
            kind = "read" if op in READ_OPS else "write"
            out.setdefault(prefix, {"read": 0.0, "write": 0.0})[kind] += rate
        return out

    def limits(self, producers: int, steps_per_s: float) -> list[tuple[Limit, float]]:
        """Each limit with this load's rate against it, the most loaded first."""
        prefixes = self.prefix_per_s(producers, steps_per_s)
        out = []
        for limit in LIMITS:
            ops = READ_OPS if limit.ops == "read" else WRITE_OPS if limit.ops == "write" else READ_OPS | WRITE_OPS
            if limit.scope == "key":
                rate = self.hot_key_per_s  # the busiest key's requests are nearly all GETs
            elif limit.scope == "prefix":
                rate = max(p[limit.ops] for p in prefixes.values())
            else:
                rate = self.ops_per_s(ops)
            out.append((limit, rate))
        return sorted(out, key=lambda item: item[1] / item[0].per_s, reverse=True)


PREFIX_OF_CLASS = {
    "log next (miss)": "_log/",
    "log version": "_log/",
    "log listing": "_log/",
    "segment": "_log/",
    "snapshot": "_log/",
    "snapshot hint": "_log/",
    "data": "data/<producer>/",
    "intents": "_intents/",
    "watermarks": "_checkpoints/",
    "probe": "_probe/",
}


@dataclass(frozen=True, slots=True)
class FollowerRates:
    """One log follower's requests by (key class, operation): behind the head per step,
    at the head with commits flowing per second, idle at the head per second; and its
    requests per version on the key of that version at the head (next-version probes,
    the read, the proofs anchored on it)."""

    behind_per_step: dict[tuple[str, str], float]
    behind_max_per_key: float  # the most requests one follower sends to one log key reading behind
    flowing_per_s: dict[tuple[str, str], float]
    flowing_per_version_on_one_key: float
    idle_per_s: dict[tuple[str, str], float]
    idle_next_key_per_s: float
    spread_s: float  # how long the job's followers take to all come round to a new version
    behind_spread_s: float = 1.0  # how long the job's followers take to all read one segment behind the head


@dataclass(frozen=True, slots=True)
class OtherRates:
    """Producers per TGB, watch per second, the collector per run (by class and op)."""

    producer_per_tgb: dict[tuple[str, str], float]
    watch_per_s: dict[tuple[str, str], float]
    gc_per_run: dict[tuple[str, str], float]
    gc_every_s: float = 600.0


def _scaled(rates: Mapping[tuple[str, str], float], factor: float) -> dict[tuple[str, str], float]:
    return {key: rate * factor for key, rate in rates.items()}


def _sum(*parts: Mapping[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    out: Counter[tuple[str, str]] = Counter()
    for part in parts:
        for key, rate in part.items():
            out[key] += rate
    return dict(out)


def project(scale: Scale, followers: int, rates: FollowerRates, other: OtherRates, *, shared: bool) -> list[Load]:
    """The job's load in three states: reading behind the head at the step rate, at the
    head with commits flowing at the step rate, and idle at the head (no commits).

    The busiest key: behind the head, the ranks of a synchronous job reach each TGB
    object within the same second, and each log segment within ``behind_spread_s`` (a
    second without node sharing; with it, each node's follower reads a margin drawn per
    node ahead of its ranks, ``sharedlog.NODE_READ_AHEAD``); at the head, every follower's
    requests for a new version land within ``spread_s`` (the whole count in one second
    when that is shorter); idle, every probe goes to the next version's key.
    """
    s = scale.steps_per_s
    reads_per_step = scale.data_reads_per_step(shared)
    data = {("data", "get"): reads_per_step * s}
    background = _sum(
        _scaled(other.producer_per_tgb, s), other.watch_per_s, _scaled(other.gc_per_run, 1 / other.gc_every_s)
    )
    per_object = reads_per_step / scale.tgb_parts
    segment_hot = followers * rates.behind_max_per_key / max(1.0, rates.behind_spread_s)
    behind = Load(
        "behind the head",
        _sum(_scaled(rates.behind_per_step, followers * s), data, background),
        max(segment_hot, per_object),
        "a log segment" if segment_hot >= per_object else "a TGB object",
    )
    spread = max(1.0, rates.spread_s)
    flowing_hot = followers * rates.flowing_per_version_on_one_key / spread
    flowing = Load(
        "at the head, commits flowing",
        _sum(_scaled(rates.flowing_per_s, followers), data, background),
        max(flowing_hot, per_object / spread),
        "the next log version" if flowing_hot >= per_object / spread else "a TGB object",
    )
    idle_background = _sum(other.watch_per_s, _scaled(other.gc_per_run, 1 / other.gc_every_s))
    idle = Load(
        "idle at the head",
        _sum(_scaled(rates.idle_per_s, followers), idle_background),
        followers * rates.idle_next_key_per_s,
        "the next log version",
    )
    return [behind, flowing, idle]
