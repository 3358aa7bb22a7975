"""Where a producer process's CPU goes: cProfile in every thread, over a measured window,
grouped into buckets a reader understands (``bench producers --profile``).

Each thread started after ``ThreadProfiles.install`` gets a profiler of its own
(``threading.setprofile``; cProfile sees one thread only), timed by the thread's CPU clock
(``time.thread_time``): a wall clock would charge every function the time it waited for
the interpreter lock or the disk while other threads ran. ``snapshot`` reads all of them
at once; the difference of two snapshots (``Snapshot.minus``) is the window. Nothing is
installed, and nothing costs, unless a run asks for a profile.

The profiler's own cost, about 1.4 us of thread CPU per call on the 2-core machine (a
system call for the clock at each end), would otherwise be charged to the profiled code
itself, to Python's small calls most of all. ``calibrate`` measures it in each process,
and ``Snapshot.minus`` takes it off each function's self time, half to the function
called and half to its caller (where the clock reads fall); cumulative times are left as
cProfile measured them.

Buckets (``BUCKETS``): a function's self time belongs to the innermost function on its
call stack that a rule of ``ROOTS`` names (the framing of a slice inside an append is
framing, a log read inside a commit attempt is following the log). cProfile keeps one
level of callers, so a function called from several places shares its time among them by
what each caller's calls cost, and each caller's share by its own callers, as gprof does.
The kinds (``kind_of``) cut across the buckets: time in Python code (the interpreter's),
in copies of bytes, in system calls and waits, and in other native code (checksums,
msgspec); a profile gives both and their cross table.
"""

from __future__ import annotations

import cProfile
import gc
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BUCKETS",
    "KINDS",
    "ROOTS",
    "Snapshot",
    "ThreadProfiles",
    "attribute",
    "bucket_rule",
    "calibrate",
    "kind_of",
    "render",
    "summarize",
]

BUCKETS: tuple[str, ...] = ("encode/frame", "checksum", "put", "commit", "following the log", "backpressure", "other")
KINDS: tuple[str, ...] = ("interpreter", "copies", "system calls and waits", "native")

# (bucket, file path suffix or "builtin", qualified name, or its prefix ending in ".",
# or "*" for every function of the file). The innermost match on a stack decides; a
# builtin is matched by a part of its name.
ROOTS: tuple[tuple[str, str, str], ...] = (
    ("checksum", "builtin", "crc32c"),
    ("checksum", "batchweave/layout.py", "checksum"),
    ("encode/frame", "batchweave/layout.py", "*"),
    ("encode/frame", "batchweave/packing.py", "*"),
    ("encode/frame", "batchweave/writing/packs.py", "PackWriter._write"),  # the pack's keys and descriptors
    ("encode/frame", "batchweave/producer.py", "Producer._schema_for"),
    ("put", "batchweave/writing/packs.py", "PackWriter._put_objects"),
    ("put", "batchweave/writing/packs.py", "PackWriter._put_object"),
    ("put", "batchweave/store/core.py", "Store.stage_if_absent"),
    ("put", "batchweave/store/spares.py", "*"),
    ("put", "batchweave/store/syncs.py", "*"),
    ("commit", "batchweave/journal/core.py", "Journal.commit"),
    ("commit", "batchweave/journal/headcopies.py", "*"),
    ("commit", "batchweave/commit/", "*"),  # policies, the commit loop, group commit's turns
    ("following the log", "batchweave/journal/core.py", "Journal._read_on"),
    ("following the log", "batchweave/journal/core.py", "Journal.catch_up"),
    ("following the log", "batchweave/journal/core.py", "Journal.load_state"),
    ("following the log", "batchweave/journal/core.py", "Journal._proven"),
    ("following the log", "batchweave/journal/core.py", "Journal.verify"),
    ("following the log", "batchweave/journal/core.py", "Journal.read_version"),
    ("following the log", "batchweave/journal/core.py", "Journal.read_version_data"),
    ("following the log", "batchweave/journal/core.py", "Journal._recover_from_stale_view"),
    ("following the log", "batchweave/journal/proof.py", "*"),
    ("following the log", "batchweave/journal/snapshots.py", "*"),
    ("following the log", "batchweave/journal/segments.py", "read_segment"),
    ("backpressure", "batchweave/lifecycle/maxlag.py", "*"),
    ("backpressure", "batchweave/lifecycle/backpressure.py", "*"),
    ("backpressure", "batchweave/lifecycle/watermarks.py", "*"),
)
# Where a function run by a pool thread belongs when nothing on its stack says (its caller
# is the pool's worker): the staging files opened ahead and removed after a put.
FALLBACKS: tuple[tuple[str, str, str], ...] = (
    ("put", "batchweave/store/localfs.py", "open_staging"),
    ("put", "batchweave/store/localfs.py", "remove_quietly"),
)
# Builtins whose time is a copy of bytes (cProfile does not see a type called as a
# function: ``bytes(view)`` is its caller's time).
_COPIES = ("'join' of 'bytes'", "'tobytes' of", "'copy' of 'numpy", "'join' of 'bytearray'", "numpy.ascontiguousarray")
# Builtins that are system calls or waits (their CPU is the kernel's work for the thread).
_SYSTEM = ("posix.", "'acquire' of", "'release' of '_thread", "select.", "time.sleep", "'wait' of", "obstore")

Key = str  # a function's label: ``path:line(qualified name)``, or a builtin's name


@dataclass
class Snapshot:
    """What cProfile counted so far, summed over threads: per function (calls, self
    seconds, cumulative seconds) and per caller-to-callee edge (calls, the callee's
    cumulative and self seconds when called from that caller)."""

    functions: dict[Key, list[float]] = field(default_factory=dict)  # [calls, tottime, cumtime]
    edges: dict[tuple[Key, Key], list[float]] = field(default_factory=dict)  # [calls, cumtime, tottime]
    where: dict[Key, tuple[str, str]] = field(default_factory=dict)  # label -> (file, qualified name)
    threads: int = 0
    raw_self_s: float = 0.0  # the self times' sum before the profiler's cost came off (``minus``)

    def add(self, stats: Iterable[Any]) -> None:
        """Add one profiler's ``getstats()``."""
        self.threads += 1
        for entry in stats:
            caller = self._label(entry.code)
            one = self.functions.setdefault(caller, [0.0, 0.0, 0.0])
            one[0] += entry.callcount
            one[1] += entry.inlinetime
            one[2] += entry.totaltime
            for sub in entry.calls or ():
                edge = self.edges.setdefault((caller, self._label(sub.code)), [0.0, 0.0, 0.0])
                edge[0] += sub.callcount
                edge[1] += sub.totaltime
                edge[2] += sub.inlinetime

    def _label(self, code: Any) -> Key:
        if isinstance(code, str):
            self.where.setdefault(code, ("builtin", code))
            return code
        path = _short(code.co_filename)
        label = f"{path}:{code.co_firstlineno}({code.co_qualname})"
        self.where.setdefault(label, (path, code.co_qualname))
        return label

    def minus(self, earlier: Snapshot, bias_s: float = 0.0) -> Snapshot:
        """What was counted since ``earlier``, with the profiler's own cost (``bias_s``
        seconds per call, ``calibrate``) taken off each function's self time: half of it
        for each call of the function, half for each call it made."""
        out = Snapshot(where=dict(self.where), threads=self.threads)
        for key, (calls, tottime, cumtime) in self.functions.items():
            before = earlier.functions.get(key, [0.0, 0.0, 0.0])
            delta = [calls - before[0], tottime - before[1], cumtime - before[2]]
            if delta[0] > 0 or delta[1] > 0:
                out.functions[key] = delta
        for key, (calls, cumtime, tottime) in self.edges.items():
            before = earlier.edges.get(key, [0.0, 0.0, 0.0])
            delta = [calls - before[0], cumtime - before[1], tottime - before[2]]
            if delta[0] > 0 or delta[2] > 0:
                out.edges[key] = delta
        out.raw_self_s = sum(one[1] for one in out.functions.values())
        if bias_s > 0:
            out._unbias(bias_s)
        return out

    def _unbias(self, bias_s: float) -> None:
        made: dict[Key, float] = defaultdict(float)
        for (caller, _), edge in self.edges.items():
            made[caller] += edge[0]
        scale: dict[Key, float] = {}
        for key, one in self.functions.items():
            corrected = max(0.0, one[1] - bias_s / 2 * (one[0] + made[key]))
            scale[key] = corrected / one[1] if one[1] > 0 else 0.0
            one[1] = corrected
        for (_, callee), edge in self.edges.items():
            edge[2] *= scale.get(callee, 1.0)

    def merge(self, other: Snapshot) -> None:
        """Add ``other`` (another process's window) to this one."""
        self.threads += other.threads
        self.raw_self_s += other.raw_self_s
        self.where.update(other.where)
        for key, values in other.functions.items():
            mine = self.functions.setdefault(key, [0.0, 0.0, 0.0])
            for i, value in enumerate(values):
                mine[i] += value
        for key, values in other.edges.items():
            mine = self.edges.setdefault(key, [0.0, 0.0, 0.0])
            for i, value in enumerate(values):
                mine[i] += value

    def to_json(self) -> dict[str, Any]:
        return {
            "functions": self.functions,
            "edges": [[caller, callee, *values] for (caller, callee), values in self.edges.items()],
            "where": {key: list(value) for key, value in self.where.items()},
            "threads": self.threads,
            "raw_self_s": self.raw_self_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Snapshot:
        return cls(
            functions={key: list(values) for key, values in data["functions"].items()},
            edges={(e[0], e[1]): list(e[2:]) for e in data["edges"]},
            where={key: (value[0], value[1]) for key, value in data["where"].items()},
            threads=data["threads"],
            raw_self_s=data.get("raw_self_s", 0.0),
        )


def _short(path: str) -> str:
    """A source path from its package on (``batchweave/layout.py``), else as it is."""
    parts = path.replace(os.sep, "/").split("/")
    for anchor in ("batchweave", "benchmarks", "concurrent", "threading.py", "obstore", "msgspec", "numpy"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) :])
    return "/".join(parts[-2:])


class ThreadProfiles:
    """A cProfile profiler in each thread started after ``install`` (see the module doc)."""

    def __init__(self) -> None:
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def install(self) -> None:
        threading.setprofile(self._start)

    def include_current(self) -> None:
        """Profile the calling thread too (one started before ``install``)."""
        self._start(None, "call", None)

    def uninstall(self) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]  # (typeshed wants a function)

    def _start(self, frame: Any, event: str, arg: Any) -> None:
        """The first profile event of a new thread: give it a profiler of its own (which
        replaces this hook in that thread)."""
        profile = cProfile.Profile(time.thread_time)
        with self._lock:
            self._profiles.append(profile)
        profile.enable()

    def snapshot(self) -> Snapshot:
        """Every thread's counts so far. The collector is off meanwhile, so that no
        finalizer runs Python code (and lets another thread change a profiler's tables)
        while they are read."""
        with self._lock:
            profiles = list(self._profiles)
        snapshot = Snapshot()
        enabled = gc.isenabled()
        gc.disable()
        try:
            for profile in profiles:
                snapshot.add(profile.getstats())
        finally:
            if enabled:
                gc.enable()
        return snapshot


def _empty() -> None:
    pass


def calibrate(calls: int = 50_000) -> float:
    """Seconds of thread CPU the profiler adds to each call it times, in this process."""

    def loop() -> None:
        for _ in range(calls):
            _empty()

    best = []
    for _ in range(3):
        started = time.thread_time()
        loop()
        plain = time.thread_time() - started
        profile = cProfile.Profile(time.thread_time)
        started = time.thread_time()
        profile.enable()
        loop()
        profile.disable()
        best.append((time.thread_time() - started - plain) / calls)
    return max(0.0, min(best))


def bucket_rule(path: str, qualname: str, rules: tuple[tuple[str, str, str], ...] = ROOTS) -> str | None:
    """The bucket ``rules`` give a function (its file, its qualified name), or None."""
    for bucket, where, name in rules:
        if where == "builtin":
            if path == "builtin" and name in qualname:
                return bucket
            continue
        if not (path.endswith(where) or (where.endswith("/") and where in path)):
            continue
        if name == "*" or name == qualname or (name.endswith(".") and qualname.startswith(name)):
            return bucket
    return None


def kind_of(path: str, qualname: str) -> str:
    """Which of ``KINDS`` a function's self time is."""
    if path != "builtin":
        return "interpreter"
    if any(part in qualname for part in _COPIES):
        return "copies"
    if any(part in qualname for part in _SYSTEM):
        return "system calls and waits"
    return "native"


def attribute(snapshot: Snapshot) -> dict[Key, dict[str, float]]:
    """Each function's self seconds by bucket (see the module doc): the innermost function
    on its stacks that ``ROOTS`` names decides, callers sharing by what their calls cost."""
    callers: dict[Key, list[tuple[Key, float, float]]] = defaultdict(list)  # callee -> (caller, cum, self)
    for (caller, callee), (_, cumtime, tottime) in snapshot.edges.items():
        callers[callee].append((caller, cumtime, tottime))
    context: dict[Key, dict[str | None, float]] = {}
    visiting: set[Key] = set()

    def context_of(key: Key) -> dict[str | None, float]:
        """The buckets a call of ``key`` runs in, as shares (None: nothing says)."""
        if key in context:
            return context[key]
        path, qualname = snapshot.where.get(key, ("", key))
        rule = bucket_rule(path, qualname)
        if rule is not None:
            context[key] = {rule: 1.0}
            return context[key]
        visiting.add(key)
        mixed: dict[str | None, float] = defaultdict(float)
        weights = [(c, w) for c, w, _ in callers.get(key, []) if c not in visiting and w > 0]
        total = sum(w for _, w in weights)
        for caller, weight in weights:
            for bucket, share in context_of(caller).items():
                mixed[bucket] += share * weight / total
        visiting.discard(key)
        if not mixed:
            mixed[None] = 1.0
        fallback = bucket_rule(path, qualname, FALLBACKS)
        if fallback is not None and None in mixed:
            mixed[fallback] += mixed.pop(None)
        context[key] = dict(mixed)
        return context[key]

    out: dict[Key, dict[str, float]] = {}
    for key, (_, tottime, _) in snapshot.functions.items():
        if tottime <= 0:
            continue
        path, qualname = snapshot.where.get(key, ("", key))
        rule = bucket_rule(path, qualname)
        shares: dict[str, float] = defaultdict(float)
        if rule is not None:
            shares[rule] = tottime
        else:
            # Its self time split by caller as cProfile measured it, then by each caller's context.
            edges = [(c, t) for c, _, t in callers.get(key, []) if t > 0]
            total = sum(t for _, t in edges)
            if not edges:
                edges, total = [("", 1.0)], 1.0
            for caller, seconds in edges:
                where = context_of(caller) if caller else {None: 1.0}
                fallback = bucket_rule(path, qualname, FALLBACKS)
                for bucket, share in where.items():
                    shares[bucket or fallback or "other"] += tottime * seconds / total * share
        out[key] = dict(shares)
    return out


def summarize(
    snapshot: Snapshot, *, window_cpu_s: float | None = None, tgbs: int | None = None, top: int = 25
) -> dict[str, Any]:
    """A window's profile as a reader needs it: CPU by bucket and by kind (and their cross
    table), with shares that add up to 1, and the top functions by cumulative and by self
    time. ``window_cpu_s``: the processes' CPU in the window (rusage), to say how much of it
    the profiled threads cover; ``tgbs``: TGBs appended in it, for the work per TGB."""
    by_function = attribute(snapshot)
    total = sum(sum(b.values()) for b in by_function.values())
    buckets = dict.fromkeys(BUCKETS, 0.0)
    kinds = dict.fromkeys(KINDS, 0.0)
    cross = {b: dict.fromkeys(KINDS, 0.0) for b in BUCKETS}
    for key, shares in by_function.items():
        kind = kind_of(*snapshot.where.get(key, ("", key)))
        for bucket, seconds in shares.items():
            buckets[bucket] += seconds
            kinds[kind] += seconds
            cross[bucket][kind] += seconds
    raw_total = snapshot.raw_self_s or total
    calls = sum(one[0] for one in snapshot.functions.values())

    def share(seconds: float) -> float:
        return seconds / total if total > 0 else 0.0

    def row(key: Key) -> dict[str, Any]:
        calls_, tottime, cumtime = snapshot.functions[key]
        shares = by_function.get(key, {})
        return {
            "function": key,
            "calls": int(calls_),
            "tottime_s": tottime,
            "cumtime_s": cumtime,
            "share": share(tottime),
            "cum_share": cumtime / raw_total if raw_total > 0 else 0.0,
            "bucket": max(shares, key=lambda b: shares[b]) if shares else "other",
            "kind": kind_of(*snapshot.where.get(key, ("", key))),
        }

    by_self = sorted(snapshot.functions, key=lambda k: -snapshot.functions[k][1])[:top]
    by_cum = sorted(snapshot.functions, key=lambda k: -snapshot.functions[k][2])[:top]
    return {
        "profiled_cpu_s": total,
        "window_cpu_s": window_cpu_s,
        # The processes' CPU the profilers saw (their own cost included), and how much of
        # what they saw was their own cost.
        "coverage": raw_total / window_cpu_s if window_cpu_s else None,
        "profiler_share": 1 - total / raw_total if raw_total > 0 else 0.0,
        "threads": snapshot.threads,
        "calls": int(calls),
        "tgbs": tgbs,
        "calls_per_tgb": calls / tgbs if tgbs else None,
        "cpu_s_per_tgb": total / tgbs if tgbs else None,
        "buckets": {b: {"cpu_s": s, "share": share(s)} for b, s in buckets.items()},
        "kinds": {k: {"cpu_s": s, "share": share(s)} for k, s in kinds.items()},
        "bucket_kinds": {b: {k: share(s) for k, s in row_.items()} for b, row_ in cross.items()},
        "by_self": [row(k) for k in by_self],
        "by_cumulative": [row(k) for k in by_cum],
    }


def render(profiles: dict[str, dict[str, Any]], note: str = "") -> str:
    """The profiles as text (Markdown with fixed-width tables): per run, the buckets and
    kinds, then the top functions by cumulative and by self time."""
    lines = ["# Where a producer's CPU goes", ""]
    if note:
        lines += [note, ""]
    for name, p in profiles.items():
        lines += [f"## {name}", ""]
        covered = (
            f"; the profilers saw {p['coverage']:.0%} of the processes' CPU in the window, "
            f"{p['profiler_share']:.0%} of it their own cost"
            if p.get("coverage")
            else ""
        )
        per_tgb = (
            f"; {p['cpu_s_per_tgb'] * 1e6:,.0f} us and {p['calls_per_tgb']:,.0f} calls per TGB" if p.get("tgbs") else ""
        )
        lines += [f"Profiled CPU {p['profiled_cpu_s']:.2f} s in {p['threads']} threads{per_tgb}{covered}.", ""]
        lines += ["```", f"{'bucket':<20} {'CPU s':>8} {'share':>7}   " + "  ".join(f"{k[:12]:>12}" for k in KINDS)]
        for bucket, value in p["buckets"].items():
            cross = "  ".join(f"{p['bucket_kinds'][bucket][k]:>12.1%}" for k in KINDS)
            lines.append(f"{bucket:<20} {value['cpu_s']:>8.3f} {value['share']:>7.1%}   {cross}")
        kinds = "  ".join(f"{p['kinds'][k]['share']:>12.1%}" for k in KINDS)
        lines += [f"{'all':<20} {p['profiled_cpu_s']:>8.3f} {1:>7.1%}   {kinds}", "```", ""]
        for title, rows in (("by cumulative time", p["by_cumulative"]), ("by self time", p["by_self"])):
            lines += [f"Top functions {title}:", "", "```"]
            lines.append(f"{'calls':>9} {'self s':>8} {'self':>6} {'cum s':>8} {'cum':>6}  {'bucket':<18} function")
            for r in rows:
                lines.append(
                    f"{r['calls']:>9} {r['tottime_s']:>8.3f} {r['share']:>6.1%} {r['cumtime_s']:>8.3f} "
                    f"{r['cum_share']:>6.1%}  {r['bucket']:<18} {r['function']}"
                )
            lines += ["```", ""]
    return "\n".join(lines)


def thread_cpu_note() -> str:
    """How to read the numbers, once at the top of the text."""
    return (
        "cProfile in every producer thread of every worker process, timed by each thread's CPU clock, over the "
        "measured window only; self times are net of the profiler's own cost per call (calibrated in each "
        "process), cumulative times are as measured (they include it). Shares are of the profiled CPU. "
        f"Python {sys.version.split()[0]}."
    )
