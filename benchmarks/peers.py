"""What the reading peers of ``bench consumers`` share (``streaming_peer``, ``litdata_peer``,
``webdataset_peer``): the samples every system reads, one rank's pass timed sample by
sample, and the command line of a peer run in its own process.

The samples: sample ``step * W + rank`` is rank ``rank``'s slice of step ``step``, the same
random bytes for every system with the first 16 naming step and rank, so a delivered
sample says which one it is.

A peer process has two commands: ``write`` (the samples to a remote, in the peer's own
format) prints one JSON line; ``read`` (one rank's pass from a fresh cache) prints one
JSON line, then waits for a line on stdin: ``resume`` runs the resume check (the parent
resets its byte counters in between, so the check's downloads are not charged to the
pass), anything else exits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "answer",
    "base_payload",
    "command_line",
    "emit",
    "fresh_cache",
    "resumed",
    "sample_payload",
    "sample_tag",
    "tag_of",
    "timed_pass",
    "tree_bytes",
]

_TAG_BYTES = 16


# ---------------------------------------------------------------------- the samples


def sample_payload(base: bytes, step: int, rank: int) -> bytes:
    """Rank ``rank``'s slice of step ``step``: ``base`` with its first bytes naming both, so
    a delivered sample says which one it is (the same bytes go to every system)."""
    return sample_tag(step, rank) + base[_TAG_BYTES:]


def sample_tag(step: int, rank: int) -> bytes:
    return step.to_bytes(8, "little") + rank.to_bytes(8, "little")


def tag_of(sample: bytes) -> tuple[int, int]:
    return int.from_bytes(sample[:8], "little"), int.from_bytes(sample[8:_TAG_BYTES], "little")


def base_payload(payload_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(max(payload_bytes, _TAG_BYTES))


# ---------------------------------------------------------------------- one rank's pass


def timed_pass(
    samples: Iterable[bytes], started: float, stop_at: int = 0, state_at: Callable[[], Any] | None = None
) -> tuple[dict[str, Any], Any]:
    """Each sample's arrival time since ``started``, its (step, rank) tag and the bytes
    delivered; and ``state_at()``, the peer's resume state, taken right after the
    ``stop_at``-th sample (``{}`` if the pass is shorter or there is no ``state_at``)."""
    times, tags, delivered, state = [], [], 0, None
    for index, data in enumerate(samples):
        times.append(time.monotonic() - started)
        tags.append(tag_of(data))
        delivered += len(data)
        if state_at is not None and index + 1 == stop_at:
            state = state_at()
    return {"times_s": times, "tags": tags, "bytes": delivered}, state or {}


def resumed(samples: Iterable[bytes]) -> dict[str, Any]:
    """What a resumed pass delivered: its tags (the check compares them with the rest of
    the first pass) and bytes."""
    tags, delivered = [], 0
    for data in samples:
        tags.append(tag_of(data))
        delivered += len(data)
    return {"tags": tags, "bytes": delivered}


@contextmanager
def fresh_cache(prefix: str) -> Iterator[str]:
    """A new, empty cache directory for one pass (as on a new machine), removed after it."""
    cache = tempfile.mkdtemp(prefix=prefix)
    try:
        yield cache
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# ---------------------------------------------------------------------- the peer process


def command_line(prog: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The parser of a peer process, and its ``read`` command's parser, for the peer to add
    what only it needs."""
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("--remote", required=True)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--payload", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("read")
    r.add_argument("--remote", required=True)
    r.add_argument("--mode", choices=("default", "per-rank"), required=True)
    r.add_argument("--stop-at", type=int, required=True, help="samples after which the resume state is taken")
    return parser, r


def emit(record: dict[str, Any]) -> int:
    """One JSON line to the parent; the process's exit status."""
    print(json.dumps(record), flush=True)
    return 0


def answer(record: dict[str, Any], state: Any, resume: Callable[[], dict[str, Any]] | None) -> int:
    """Send a read pass's record and resume state, then run ``resume`` if the parent asks
    for it (and the peer has one)."""
    emit({**record, "state": state})
    if sys.stdin.readline().strip() == "resume" and resume is not None:
        emit(resume())
    return 0
