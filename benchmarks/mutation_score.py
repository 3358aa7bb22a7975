"""The mutation score of the safety modules, and its ratchet: ``make mutation`` runs it.

mutmut (``[tool.mutmut]`` in pyproject.toml) changes one point of the code at a time and
runs the fast tests of the proof rules against each change (a *mutant*). A mutant the
tests fail on is killed; a mutant they pass on survived: either the tests miss a broken
rule, or the change does not change behaviour (an *equivalent* mutant, which no test can
kill). The score is killed / (all - equivalent); a timeout counts as killed (a test
failed to finish), a mutant no test reaches as survived.

``--recheck TEST_FILE ...`` runs the survivors of a finished run again against test files
written since (each mutant by mutmut's switch, ``MUTANT_UNDER_TEST``, in ``mutants/``),
without a whole new run: a survivor one of them fails on counts as killed.

``benchmarks/mutation_floor.json`` keeps the floor and every mutant judged equivalent,
with why. This script reads ``mutmut results --all true``, writes the score, the
survivors and a table to ``--out``, and fails when the score is below the floor (the
ratchet: it can only go up; raise the floor when it does).

    python -m benchmarks.mutation_score --out bench-out/mutation
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

FLOOR_FILE = Path(__file__).resolve().parent / "mutation_floor.json"
MUTANTS = Path("mutants")  # mutmut's tree, under the directory it ran in
_KILLED = {"killed", "timeout"}
_SURVIVED = {"survived", "no tests"}


@dataclass(frozen=True)
class Score:
    killed: int
    survivors: list[str]  # not killed, not judged equivalent
    equivalent: int
    unchecked: int  # not run yet (an interrupted run)

    @property
    def judged(self) -> int:
        return self.killed + len(self.survivors)

    @property
    def ratio(self) -> float:
        return self.killed / self.judged if self.judged else 0.0


def parse_results(text: str) -> dict[str, str]:
    """``mutmut results --all true`` -> {mutant name: status}."""
    results = {}
    for line in text.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name.startswith("batchweave."):
            results[name] = status.strip()
    return results


def score(results: dict[str, str], equivalent: dict[str, str]) -> Score:
    """The score of ``results``, the mutants in ``equivalent`` left out."""
    killed = sum(1 for status in results.values() if status in _KILLED)
    survivors = sorted(n for n, s in results.items() if s in _SURVIVED and n not in equivalent)
    judged_equivalent = sum(1 for n, s in results.items() if s in _SURVIVED and n in equivalent)
    unchecked = sum(1 for s in results.values() if s not in _KILLED | _SURVIVED)
    return Score(killed, survivors, judged_equivalent, unchecked)


def recheck(
    results: dict[str, str],
    test_files: list[Path],
    workers: int = 2,
    deselect: tuple[str, ...] = (),
    only: tuple[str, ...] = ("batchweave.",),
) -> dict[str, str]:
    """``results`` with each survivor (named with a prefix in ``only``) that one of
    ``test_files`` fails on marked killed. The tests must pass with no mutant switched on
    first: one that fails anyway (it tests code changed since the run) would kill every
    survivor; ``deselect`` leaves such out."""
    if _fails_on("", test_files, deselect):
        names = [path.name for path in test_files]
        raise SystemExit(f"{names} fail with no mutant switched on: deselect the tests of code changed since")
    survivors = [name for name, status in results.items() if status in _SURVIVED and name.startswith(only)]
    with ThreadPoolExecutor(workers) as pool:
        verdicts = pool.map(lambda name: _fails_on(name, test_files, deselect), survivors)
        failed = dict(zip(survivors, verdicts, strict=True))
    return {name: "killed" if failed.get(name) else status for name, status in results.items()}


def _fails_on(mutant: str, test_files: list[Path], deselect: tuple[str, ...] = ()) -> bool:
    """Whether the tests in ``test_files`` fail with ``mutant`` switched on ("": none) in
    mutmut's tree (copied there first, so they import its trampolined modules)."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    command += ["--timeout=30", *(f"tests/{path.name}" for path in test_files)]
    command += [f"--deselect={test}" for test in deselect]
    env = {**os.environ, "MUTANT_UNDER_TEST": mutant, "PYTHONPATH": "src"}
    try:
        done = subprocess.run(command, cwd=MUTANTS, env=env, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return True  # a test that never ends has failed
    return done.returncode == 1  # tests failed (2+: the run itself broke, which kills nothing)


def module_of(name: str) -> str:
    """``batchweave.journal.core.xǁJournalǁverify__mutmut_3`` -> ``journal.core``."""
    return name.split(".x", 1)[0].removeprefix("batchweave.")


def by_module(names: list[str]) -> Counter[str]:
    """Survivors per module."""
    return Counter(module_of(name) for name in names)


def module_table(results: dict[str, str], equivalent: dict[str, str]) -> list[str]:
    """Markdown rows: per module, killed, survived, equivalent, not run and the score."""
    rows = ["| module | killed | survived | equivalent | not run | score |", "|---|---|---|---|---|---|"]
    for module in sorted({module_of(name) for name in results}):
        mine = {n: s for n, s in results.items() if module_of(n) == module}
        part = score(mine, equivalent)
        cells = (module, part.killed, len(part.survivors), part.equivalent, part.unchecked)
        rows.append("| " + " | ".join(map(str, cells)) + f" | {f'{part.ratio:.1%}' if part.judged else '-'} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for mutation.json and mutation.md")
    parser.add_argument("--results", type=Path, default=None, help="saved `mutmut results --all true` output")
    parser.add_argument("--recheck", type=Path, nargs="+", default=[], help="test files to run the survivors against")
    parser.add_argument("--deselect", action="append", default=[], help="a test of --recheck's files to leave out")
    parser.add_argument("--only", action="append", default=[], help="recheck only mutants named with this prefix")
    args = parser.parse_args(argv)
    text = (
        args.results.read_text()
        if args.results
        else subprocess.run(["mutmut", "results", "--all", "true"], capture_output=True, text=True, check=True).stdout
    )
    kept = json.loads(FLOOR_FILE.read_text())
    results = parse_results(text)
    if args.recheck:
        for path in args.recheck:
            shutil.copy(path, MUTANTS / "tests" / path.name)
        only = tuple(args.only or ["batchweave."])
        results = recheck(results, args.recheck, deselect=tuple(args.deselect), only=only)
    result = score(results, kept["equivalent"])
    args.out.mkdir(parents=True, exist_ok=True)
    # every verdict, as `mutmut results --all true` prints them: --results of a next recheck
    (args.out / "results.txt").write_text("".join(f"    {name}: {status}\n" for name, status in results.items()))
    record = {
        "score": result.ratio,
        "rechecked_with": [path.name for path in args.recheck],
        "killed": result.killed,
        "survived": len(result.survivors),
        "equivalent": result.equivalent,
        "unchecked": result.unchecked,
        "floor": kept["floor"],
        "survivors": result.survivors,
    }
    (args.out / "mutation.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        f"mutation score {result.ratio:.1%}: {result.killed} killed of {result.judged} "
        f"({result.equivalent} equivalent left out, {result.unchecked} not run); floor {kept['floor']:.1%}",
        "",
        *module_table(results, kept["equivalent"]),
    ]
    (args.out / "mutation.md").write_text("\n".join(lines) + "\n")
    print(lines[0])
    if result.unchecked:
        print("not every mutant was run: the score is not judged against the floor")
        return 1
    if result.ratio < kept["floor"]:
        print(f"below the floor {kept['floor']:.1%}: a change weakened the tests of the proof rules")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
