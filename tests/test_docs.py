"""The documentation site builds with ``mkdocs build --strict``: no broken link or anchor
between pages, no docstring the API reference cannot render, every nav entry present,
every page in the nav; and it works opened from disk (every link goes to a file, the
search index is in a script). No file of the checkout sends its reader to a file the
checkout does not have. The pages that say they run as they are run, twice.

``make docs`` runs the same build into ``site/``; this test builds into a temporary
directory so it never touches the checkout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
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


needs_docs_extra = pytest.mark.skipif(
    bool(_missing()),
    reason=f"the docs extra is not installed (missing {', '.join(_missing())}): pip install -e '.[docs]'",
)

# The project's design notes, its style guide and the paper it implements are kept outside
# the repository; a reader of a checkout (or of the site) has none of them. The paper is
# cited on docs/from-the-paper.md instead.
OUTSIDE_THE_REPOSITORY = ("DESIGN.md", "STYLE.md", "paper.tex", "../shared")
DOCS_PATH = re.compile(r"\bdocs/[\w./-]*\w\.(?:md|png|json)\b")
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".txt", ".cfg", ".ini"}
RESULTS = ROOT / "docs" / "benchmarks"  # its dated folders are kept as measured


def _checkout_text_files() -> list[Path]:
    """The text a checkout ships: code, tests, benchmarks, examples, docs and the root's
    files, except the dated result folders and this file (which names what it forbids)."""
    files = [ROOT / name for name in ("README.md", "Makefile", "mkdocs.yml", "pyproject.toml")]
    for top in ("src", "tests", "benchmarks", "examples", "docs"):
        files += [path for path in (ROOT / top).rglob("*") if path.suffix in TEXT_SUFFIXES and path.is_file()]
    return [
        path
        for path in files
        if path.is_file()
        and path != Path(__file__).resolve()
        and not (path.is_relative_to(RESULTS) and path.parent != RESULTS)
    ]


def _lines(path: Path):
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        yield f"{path.relative_to(ROOT)}:{number}", line


def test_no_file_names_a_file_outside_the_repository():
    named = [
        f"{where}: {name}"
        for path in _checkout_text_files()
        for where, line in _lines(path)
        for name in OUTSIDE_THE_REPOSITORY
        if name in line
    ]
    assert not named, "these name files that are not in the repository; cite a page under docs/ instead:\n" + (
        "\n".join(named)
    )


def test_every_docs_path_named_exists():
    missing = [
        f"{where}: {found}"
        for path in _checkout_text_files()
        for where, line in _lines(path)
        for found in DOCS_PATH.findall(line)
        if not (ROOT / found).exists()
    ]
    assert not missing, "these name files under docs/ that do not exist:\n" + "\n".join(missing)


# A placeholder left in prose (a README once said "EXACTLY_ONCE_LINE" where a reading was
# to go): a word of capitals joined by underscores outside code. Constants and environment
# variables are written as code (in backticks) in these pages.
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")


def _prose(text: str) -> str:
    """``text`` without its code blocks and code spans."""
    return re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def test_no_placeholder_is_left_in_the_docs():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    left = [
        f"{page.relative_to(ROOT)}: {word}"
        for page in pages
        for word in PLACEHOLDER.findall(_prose(page.read_text(encoding="utf-8")))
    ]
    assert not left, "placeholders (or constants not written as code) in the docs:\n" + "\n".join(left)


@needs_docs_extra
def test_every_page_is_in_the_nav():
    import yaml

    def pages(entries) -> set[str]:
        found: set[str] = set()
        for entry in entries:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                found |= pages(value) if isinstance(value, list) else {value}
        return found

    nav = pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])
    docs = ROOT / "docs"
    on_disk = {
        str(path.relative_to(docs))
        for path in docs.rglob("*.md")
        if not (path.is_relative_to(RESULTS) and path.parent != RESULTS)
    }
    assert on_disk - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(on_disk - nav)}"


@needs_docs_extra
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
    for page in (
        "index.html",
        "concepts/index.html",
        "guides/resharding/index.html",
        "benchmark-figures/index.html",
        "from-the-paper/index.html",
    ):
        assert (site / page).is_file(), page
    # Figures are copied next to the pages that show them.
    assert (site / "benchmarks" / "2026-11-25-725e758" / "consumers.png").is_file()


# -- the pages that say they run as they are -----------------------------------------

CODE_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
RUNNABLE_PAGES = ("index.md", "guides/shuffling.md", "guides/coming-from.md", "guides/torchrun.md")
# A block that starts "# file: NAME" is a script the page says to save and run; how it says to.
SCRIPTS = {"mix_pool.py": lambda: [tempfile.mkdtemp() + "/pool"]}  # python mix_pool.py "$(mktemp -d)/pool"
UNDER_TORCHRUN = {"train.py"}  # torchrun.md's loop: tests/test_torchrun_example.py runs it under torchrun
# What a page promises in a comment on its print line rather than below it.
PRINTED = {"index.md": [f"{step} {10 * step + 1}" for step in range(8)]}  # "0 1, 1 11, 2 21, ... 7 71"


def printed_lines_promised(block: str) -> list[str]:
    """The output a block promises: each comment line right after a ``print(`` line."""
    lines = block.splitlines()
    return [
        line.removeprefix("# ")
        for before, line in zip(lines, lines[1:])
        if before.startswith("print(") and line.startswith("# ")
    ]


def run_page(page: str, workdir: Path) -> tuple[list[str], list[str]]:
    """Every Python block of ``page``, in order, as a reader runs them in ``workdir``: the
    lines printed, and the promised lines that did not appear (in order)."""
    blocks = CODE_BLOCK.findall((ROOT / "docs" / page).read_text(encoding="utf-8"))
    assert blocks, f"no Python block on {page}"
    namespace: dict = {"__name__": "page"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    printed: list[str] = []
    missing: list[str] = []
    for block in blocks:
        first = block.splitlines()[0]
        if first.startswith("# file: "):
            name = first.removeprefix("# file: ")
            if name in UNDER_TORCHRUN:
                continue
            (workdir / name).write_text(block, encoding="utf-8")
            done = subprocess.run(
                [sys.executable, name, *SCRIPTS[name]()], cwd=workdir, env=env, capture_output=True, text=True
            )
            assert done.returncode == 0, f"{page}: {name} failed:\n{done.stderr[-3000:]}"
            output = done.stdout
        else:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block, f"{page}, the block starting {first!r}", "exec"), namespace)
            output = out.getvalue()
        lines = iter(output.splitlines())
        missing += [line for line in printed_lines_promised(block) if line not in lines]  # in order
        printed += output.splitlines()
    return printed, missing


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_a_runnable_page_runs_as_it_is_twice_in_the_same_place(page, tmp_path, monkeypatch):
    """A reader runs a page, then runs it again: in the same directory, in the same
    interpreter (a notebook), the second run prints what the first did."""
    if page == "guides/torchrun.md":
        pytest.importorskip("torchdata")
    monkeypatch.chdir(tmp_path)
    temporary = tmp_path / "tmp"  # where the pages' fresh directories go, removed with tmp_path
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.setenv("TMPDIR", str(temporary))
    expected = PRINTED.get(page, [])
    for attempt in ("first", "second"):
        printed, missing = run_page(page, tmp_path)
        assert not missing, f"{page}, {attempt} run: promised lines not printed: {missing}"
        assert [line for line in printed if line in expected] == expected, (attempt, printed)
