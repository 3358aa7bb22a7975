"""PyTorch, JAX (Grain) and TensorFlow (tf.data) reading one namespace: the cases are in
``frameworks_cases.py``, run here by pytest in a fresh interpreter.

Why apart: Grain's checkpoint handler starts JAX's backend (it names state files by
``jax.process_index()``), and once it has started, a fork in the same process may
deadlock, as JAX warns. The tests after these in a pytest worker start producers with
multiprocessing, so the cases must not run in a worker's own interpreter.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("frameworks_cases.py")


def test_torch_grain_and_tf_read_the_same_bytes_in_a_fresh_interpreter():
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=220, cwd=CASES.parent.parent)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode == 5 or re.fullmatch(r"\d+ skipped.*", summary):  # a framework is not installed
        pytest.skip(f"frameworks_cases.py: {summary}")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 11 and "failed" not in summary and "error" not in summary, summary
