"""Preprocessing functions for the pool tests: module-level, so spawned workers import them."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np

DP = 2


def tgb_of(shard: int) -> list[dict[str, np.ndarray]]:
    """One TGB per shard; every slice says which shard and which slice it is."""
    return [{"shard": np.full(4, shard, np.int64), "slice": np.full(4, d, np.int64)} for d in range(DP)]


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
