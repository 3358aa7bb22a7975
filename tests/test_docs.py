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
import json
import os
import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
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


PYPI_EXTRA = re.compile(r"\bbatchweave\[([\w,-]+)\]")  # pip install 'batchweave[torch]'
CHECKOUT_EXTRA = re.compile(r"-e '\.\[([\w,-]+)\]'")  # pip install -e '.[torch]'


def _extras(pattern: re.Pattern[str], text: str) -> set[str]:
    return {extra for found in pattern.findall(text) for extra in found.split(",")}


def test_every_install_hint_names_a_real_extra_and_says_how_in_a_checkout():
    """``pip install 'batchweave[testing]'`` fails a reader in a checkout, who needs
    ``pip install -e '.[testing]'``: a paragraph that gives the first gives the second."""
    import tomllib

    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    )
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    paragraphs = [
        (page.relative_to(ROOT), paragraph)
        for page in pages
        if not (page.is_relative_to(RESULTS) and page.parent != RESULTS)
        for paragraph in re.split(r"\n\s*\n", page.read_text(encoding="utf-8"))
    ]
    unknown = [
        f"{page}: {extra}"
        for page, paragraph in paragraphs
        for extra in _extras(PYPI_EXTRA, paragraph) | _extras(CHECKOUT_EXTRA, paragraph)
        if extra not in declared
    ]
    assert not unknown, "extras that pyproject.toml does not declare:\n" + "\n".join(unknown)
    pypi_only = [
        f"{page}: {sorted(_extras(PYPI_EXTRA, paragraph) - _extras(CHECKOUT_EXTRA, paragraph))}"
        for page, paragraph in paragraphs
        if _extras(PYPI_EXTRA, paragraph) - _extras(CHECKOUT_EXTRA, paragraph)
    ]
    assert not pypi_only, "install hints with no -e '.[extra]' for a checkout beside them:\n" + "\n".join(pypi_only)


def _nav_pages() -> set[str]:
    """The pages mkdocs.yml's nav lists (paths under docs/)."""
    import yaml

    def pages(entries) -> set[str]:
        found: set[str] = set()
        for entry in entries:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                found |= pages(value) if isinstance(value, list) else {value}
        return found

    return pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])


@needs_docs_extra
def test_every_page_is_in_the_nav():
    nav = _nav_pages()
    docs = ROOT / "docs"
    on_disk = {
        str(path.relative_to(docs))
        for path in docs.rglob("*.md")
        if not (path.is_relative_to(RESULTS) and path.parent != RESULTS)
    }
    assert on_disk - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(on_disk - nav)}"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for the tests below as ``make docs`` builds it (``--strict``)."""
    if _missing():
        pytest.skip(f"the docs extra is not installed (missing {', '.join(_missing())}): pip install -e '.[docs]'")
    site = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2.0
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
        + ["--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return site


def test_site_builds_strict(site):
    # The API reference was generated from the docstrings, not left as `::: name` lines.
    producer = (site / "reference" / "producer.html").read_text(encoding="utf-8")
    assert "resume_offset" in producer and ":::" not in producer
    dataset = (site / "reference" / "torch.html").read_text(encoding="utf-8")
    assert "mark_checkpoint" in dataset
    for page, member in (("grain", "get_state"), ("tf", "deserialize")):  # the JAX and TensorFlow readers
        assert member in (site / "reference" / f"{page}.html").read_text(encoding="utf-8"), page
    for page in ("index.html", "concepts.html", "guides/resharding.html", "benchmark-figures.html"):
        assert (site / page).is_file(), page
    # Figures are copied next to the pages that show them.
    assert (site / "benchmarks" / "2026-11-25-725e758" / "consumers.png").is_file()


class _References(HTMLParser):
    """What a page refers to: (tag, attribute, value) of every link, script, stylesheet and image,
    and the targets of the navigation's links."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str, str]] = []
        self.nav: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for name in ("href", "src"):
            if values.get(name):
                self.found.append((tag, name, values[name] or ""))
        if tag == "a" and "md-nav__link" in (values.get("class") or "").split() and values.get("href"):
            self.nav.append(values["href"] or "")


def _references(page: Path) -> _References:
    parser = _References()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def _local_target(page: Path, value: str) -> Path | None:
    """The file a reference on ``page`` opens from disk, or None for the network or an anchor."""
    if re.match(r"[a-z][a-z0-9+.-]*:", value) or value.startswith(("#", "//")):
        return None  # https:, mailto:, data:, ... or a place on the same page
    return page.parent / value.split("#")[0].split("?")[0]


def _pages(site: Path) -> list[Path]:
    """Every page a reader opens; not 404.html, which only a web server shows (its links are absolute)."""
    return sorted(page for page in site.rglob("*.html") if page != site / "404.html")


def test_every_link_of_the_site_opens_a_file_from_disk(site):
    """Opened as file://.../index.html, a link to a directory shows a directory listing:
    every link between pages (the navigation's first) names an .html file that exists."""
    nav = {href for href in _references(site / "index.html").nav if not href.startswith("#")}  # not its TOC
    built = {re.sub(r"(^|/)README$", r"\1index", page.removesuffix(".md")) + ".html" for page in _nav_pages()}
    assert nav == built  # a folder's README.md is its index.html
    assert all((site / href).is_file() for href in nav), nav
    broken = [
        f"{page.relative_to(site)}: <{tag} {name}={value!r}>"
        for page in _pages(site)
        for tag, name, value in _references(page).found
        if (target := _local_target(page, value)) is not None and not target.is_file()
    ]
    assert not broken, "references that open no file from disk:\n" + "\n".join(broken[:40])


def test_the_search_works_offline(site):
    """From disk, the theme loads the search index as a script (search/search_index.js, no
    fetch), runs its search worker through the shim in assets/ (no CDN), and no page needs
    the network for a script or a style."""
    index = (site / "search" / "search_index.js").read_text(encoding="utf-8")
    assert index.startswith("var __index = ")
    documents = json.loads(index.removeprefix("var __index = "))["docs"]
    assert any("StatefulDataLoader" in document["text"] for document in documents)
    page = site / "guides" / "torchrun.html"
    scripts = [value for tag, name, value in _references(page).found if tag == "script" and name == "src"]
    shim = [value for value in scripts if "iframe-worker" in value]
    assert shim and (page.parent / shim[0]).is_file(), scripts
    bundle = next(page.parent / value for value in scripts if "bundle" in value)
    assert "search/search_index.js" in bundle.read_text(encoding="utf-8")  # what it reads on file://
    remote = [
        f"{page.relative_to(site)}: {value}"
        for page in _pages(site)
        for tag, name, value in _references(page).found
        if (tag == "script" or (tag == "link" and name == "href" and value.endswith(".css")))
        and re.match(r"(https?:)?//", value)
    ]
    assert not remote, "scripts and styles from the network:\n" + "\n".join(remote[:20])


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


def run_page(page: str, workdir: Path, namespace: dict) -> tuple[list[str], list[str]]:
    """Every Python block of ``page``, in order, as a reader runs them in ``workdir`` (in
    one interpreter whose globals are ``namespace``): the lines printed, and the promised
    lines that did not appear (in order)."""
    blocks = CODE_BLOCK.findall((ROOT / "docs" / page).read_text(encoding="utf-8"))
    assert blocks, f"no Python block on {page}"
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
                [sys.executable, name, *SCRIPTS[name]()],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
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
    """A reader runs a page, then runs it again in the same directory and interpreter (a
    notebook run twice): both runs print what the page promises."""
    if page == "guides/torchrun.md":
        pytest.importorskip("torchdata")
    monkeypatch.chdir(tmp_path)
    temporary = tmp_path / "tmp"  # where the pages' fresh directories go, removed with tmp_path
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.setenv("TMPDIR", str(temporary))
    expected = PRINTED.get(page, [])
    namespace: dict = {"__name__": "page"}
    for attempt in ("first", "second"):
        printed, missing = run_page(page, tmp_path, namespace)
        assert not missing, f"{page}, {attempt} run: promised lines not printed: {missing}"
        assert [line for line in printed if line in expected] == expected, (attempt, printed)
