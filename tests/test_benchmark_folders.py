"""docs/benchmarks/ tells the current story: every result folder is named by the day it
was measured and the commit the code was at, every folder has its entry in the README,
and the README's lead table of current figures names only folders that exist.

Pure file reads (no git, no build): a few milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
FOLDER = re.compile(r"\d{4}-\d{2}-\d{2}-[0-9a-f]{7,40}")
# The lead table sits between the snippet markers the figures page includes it by.
START, END = "--8<-- [start:current]", "--8<-- [end:current]"


def _folders() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir())


def _readme() -> str:
    return (RESULTS / "README.md").read_text(encoding="utf-8")


def _lead_table(readme: str) -> str:
    assert readme.count(START) == 1 and readme.count(END) == 1, "the current-figures markers, once each"
    table = readme.split(START)[1].split(END)[0]
    table = table.split("\n", 1)[-1]  # past the rest of the marker's line (an HTML comment in the README)
    assert table.strip().startswith("|"), "the current figures are a table"
    return table


def _history(readme: str) -> str:
    return readme.split(END)[1]


def test_every_results_folder_is_named_by_date_and_commit():
    folders = _folders()
    assert folders, "no result folders found"
    misnamed = [name for name in folders if not FOLDER.fullmatch(name)]
    assert not misnamed, f"name these YYYY-MM-DD-<commit>: {misnamed}"


def test_every_results_folder_has_an_entry_in_the_history():
    history = _history(_readme())
    missing = [name for name in _folders() if f"`{name}/`" not in history]
    assert not missing, f"docs/benchmarks/README.md has no history entry for {missing}"


def test_the_lead_table_names_only_folders_that_exist():
    table = _lead_table(_readme())
    named = set(FOLDER.findall(table))
    assert named, "the lead table names no folder"
    absent = sorted(named - set(_folders()))
    assert not absent, f"the lead table names folders that do not exist: {absent}"


def test_the_checks_catch_a_bad_name_and_a_missing_folder():
    # The patterns the tests rely on reject what they must.
    assert not FOLDER.fullmatch("session-5") and not FOLDER.fullmatch("2026-11-25-group")
    table = _lead_table(f"{START}\n| a | `2026-01-01-abcdef0` |\n{END}")
    assert set(FOLDER.findall(table)) - set(_folders()) == {"2026-01-01-abcdef0"}
