"""Preprocessing functions for the pool tests: module-level, so spawned workers import them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

DP = 2


def tgb_of(shard: int) -> list[dict[str, np.ndarray]]:
    """One TGB per shard; every slice says which shard and which slice it is."""
    return [{"shard": np.full(4, shard, np.int64), "slice": np.full(4, d, np.int64)} for d in range(DP)]


def tgb_of_line(line: str) -> list[dict[str, np.ndarray]]:
    """For ``batchweave pool``: a shards file line holding the shard number."""
    return tgb_of(int(line))


def killed_once_at(item: tuple[int, int, str]) -> list[dict[str, np.ndarray]]:
    """``(shard, victim, marker_dir)``: the worker SIGKILLs itself at shard ``victim``, once."""
    shard, victim, marker_dir = item
    marker = Path(marker_dir) / "killed"
    if shard == victim and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return tgb_of(shard)


def fails_at(item: tuple[int, int]) -> list[dict[str, np.ndarray]]:
    """``(shard, bad)``: a preprocessing bug at shard ``bad``, every time."""
    shard, bad = item
    if shard == bad:
        raise ValueError(f"cannot parse shard {shard}")
    return tgb_of(shard)


def fixed(item: tuple[int, int]) -> list[dict[str, np.ndarray]]:
    """The fixed ``fails_at``: the same source (a fixed function keeps its pool's shard list)."""
    shard, _ = item
    return tgb_of(shard)


def held_at(item: tuple[int, int, str]) -> list[dict[str, np.ndarray]]:
    """``(shard, victim, marker_dir)``: at shard ``victim``, the first time only, the worker
    writes its PID to ``<marker_dir>/held`` and waits there to be killed (at most 60 s)."""
    shard, victim, marker_dir = item
    marker = Path(marker_dir) / "held"
    if shard == victim and not marker.exists():
        partial = marker.with_suffix(".tmp")
        partial.write_text(str(os.getpid()))
        partial.rename(marker)  # the test sees the PID whole or not at all
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
    return tgb_of(shard)


def noted_held_at(item: tuple[int, int, str]) -> list[dict[str, np.ndarray]]:
    """``(shard, victim, marker_dir)``: ``held_at``, and every shard also writes which Ray node
    and process preprocessed it to ``<marker_dir>/ran/<shard>-<pid>`` (for the multi-node tests)."""
    import ray  # only the Ray tests use this function

    shard, _, marker_dir = item
    ran = Path(marker_dir) / "ran"
    ran.mkdir(exist_ok=True)
    (ran / f"{shard}-{os.getpid()}").write_text(ray.get_runtime_context().get_node_id())
    return held_at(item)


def ragged_tgb_of(shard: int) -> list[dict[str, np.ndarray]]:
    """A TGB whose ``tokens`` have ``shard + 1`` rows: a first dimension that varies."""
    return [{"tokens": np.full((shard + 1, 3), shard, np.int32)} for _ in range(DP)]
