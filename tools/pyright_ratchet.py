"""A ratchet on pyright's strict mode: each file's error count may only go down.

    node_modules/.bin/pyright -p tools/pyright-strict.json --outputjson | python tools/pyright_ratchet.py

reads pyright's JSON report on stdin and compares each file's strict-mode errors with
``tools/pyright-strict-baseline.json``. A file above its baseline fails (the new errors
are printed); a file below it, or a new file with none, passes and the message says to
lower the baseline (``--update`` rewrites it from the report). The baseline's errors are
mostly deliberate: ``isinstance`` checks of what a user passed, which strict mode calls
unnecessary because the annotation already says the type.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

BASELINE = Path(__file__).with_name("pyright-strict-baseline.json")
ROOT = Path(__file__).resolve().parent.parent


def relative(path: str) -> str:
    return Path(path).resolve().relative_to(ROOT).as_posix()


def errors_by_file(report: dict) -> Counter[str]:
    """Strict-mode error count per file (paths relative to the repository)."""
    return Counter(relative(d["file"]) for d in report.get("generalDiagnostics", []) if d["severity"] == "error")


def compare(now: Counter[str], baseline: dict[str, int]) -> tuple[list[str], list[str]]:
    """(files over their baseline, files under it), each as a line to print."""
    over = [
        f"{f}: {n} strict errors, baseline {baseline.get(f, 0)}"
        for f, n in sorted(now.items())
        if n > baseline.get(f, 0)
    ]
    under = [f"{f}: {now.get(f, 0)} strict errors, baseline {n}" for f, n in sorted(baseline.items()) if now[f] < n]
    return over, under


def main(argv: list[str]) -> int:
    report = json.load(sys.stdin)
    now = errors_by_file(report)
    if "--update" in argv:
        BASELINE.write_text(json.dumps(dict(sorted(now.items())), indent=2) + "\n")
        print(f"{BASELINE.name}: {sum(now.values())} strict errors in {len(now)} files")
        return 0
    over, under = compare(now, json.loads(BASELINE.read_text()))
    for line in under:
        print(f"pyright strict ratchet: fewer errors, lower the baseline (--update): {line}")
    if not over:
        print(f"pyright strict ratchet: {sum(now.values())} errors, none above the baseline")
        return 0
    print("pyright strict ratchet: new strict-mode errors in the core layers (fix them; never raise the baseline):")
    print("".join(f"  {line}\n" for line in over), end="")
    grown = {line.split(":")[0] for line in over}
    for d in report["generalDiagnostics"]:
        if d["severity"] == "error" and relative(d["file"]) in grown:
            print(f"  {relative(d['file'])}:{d['range']['start']['line'] + 1}: {d['message'].splitlines()[0]}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
