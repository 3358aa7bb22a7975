"""The README's first code block runs as written and prints what its comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def test_the_first_code_block_is_python_and_runs_as_written_twice(tmp_path):
    language, code = FENCE.search(README.read_text(encoding="utf-8")).groups()
    assert language == "python"
    for attempt in ("first", "second"):  # a reader runs it again, in the same directory
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, (attempt, result.stderr)
        assert result.stdout.splitlines() == ["0 1", "1 11", "2 21", "3 31", "[2, 3]"], attempt


def test_the_readme_says_how_to_open_the_built_site():
    """Opened from disk or served: both ways, named where the README speaks of ``make docs``."""
    text = README.read_text(encoding="utf-8")
    documentation = text[text.index("## Documentation") :]
    assert "open `site/index.html`" in documentation
    assert "`python -m http.server -d site`" in documentation


def test_every_relative_link_of_the_readme_exists():
    root = README.parent
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8")):
        assert (root / target).exists(), target
