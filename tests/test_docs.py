"""The documentation site builds with ``mkdocs build --strict``: no broken link or anchor
between pages, no docstring the API reference cannot render, every nav entry present.

``make docs`` runs the same build into ``site/``; this test builds into a temporary
directory so it never touches the checkout.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material")


def _missing() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


pytestmark = pytest.mark.skipif(
    bool(_missing()),
    reason=f"the docs extra is not installed (missing {', '.join(_missing())}): pip install -e '.[docs]'",
)


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2.0
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
        + ["--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    # The API reference was generated from the docstrings, not left as `::: name` lines.
    producer = (site / "reference" / "producer" / "index.html").read_text(encoding="utf-8")
    assert "resume_offset" in producer and ":::" not in producer
    dataset = (site / "reference" / "torch" / "index.html").read_text(encoding="utf-8")
    assert "mark_checkpoint" in dataset
    for page, member in (("grain", "get_state"), ("tf", "deserialize")):  # the JAX and TensorFlow readers
        assert member in (site / "reference" / page / "index.html").read_text(encoding="utf-8"), page
    for page in ("index.html", "concepts/index.html", "guides/resharding/index.html", "benchmark-figures/index.html"):
        assert (site / page).is_file(), page
    # Figures are copied next to the pages that show them.
    assert (site / "benchmarks" / "2026-11-25-725e758" / "consumers.png").is_file()
