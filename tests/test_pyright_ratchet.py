"""The pyright strict ratchet (``tools/pyright_ratchet.py``): a file may only lose errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "pyright_ratchet.py"
_spec = importlib.util.spec_from_file_location("pyright_ratchet", SCRIPT)
assert _spec is not None and _spec.loader is not None
ratchet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ratchet)


def report(*files: str) -> dict:
    return {
        "generalDiagnostics": [
            {"file": str(ROOT / f), "severity": "error", "message": "m", "range": {"start": {"line": 0}}} for f in files
        ]
        + [{"file": str(ROOT / "src/x.py"), "severity": "warning", "message": "w", "range": {"start": {"line": 0}}}]
    }


def test_errors_are_counted_per_file_relative_to_the_checkout_and_warnings_are_not():
    assert ratchet.errors_by_file(report("src/a.py", "src/a.py", "src/b.py")) == Counter({"src/a.py": 2, "src/b.py": 1})


def test_a_file_over_its_baseline_fails_and_one_under_it_asks_for_a_lower_baseline():
    over, under = ratchet.compare(Counter({"src/a.py": 3, "src/new.py": 1}), {"src/a.py": 3, "src/b.py": 2})
    assert over == ["src/new.py: 1 strict errors, baseline 0"]
    assert under == ["src/b.py: 0 strict errors, baseline 2"]


def test_the_script_exits_1_on_a_new_error_and_0_otherwise():
    baseline = json.loads(ratchet.BASELINE.read_text())
    worst = max(baseline, key=baseline.get)
    one_more = report(*[worst] * (baseline[worst] + 1))
    run = subprocess.run([sys.executable, str(SCRIPT)], input=json.dumps(one_more), capture_output=True, text=True)
    assert run.returncode == 1 and worst in run.stdout
    within = report(*[f for f, n in baseline.items() for _ in range(n)])
    run = subprocess.run([sys.executable, str(SCRIPT)], input=json.dumps(within), capture_output=True, text=True)
    assert run.returncode == 0 and "none above the baseline" in run.stdout
