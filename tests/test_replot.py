"""``batchweave bench --replot DIR/NAME.json`` draws a written result's figure again from
its JSON alone, into the PNG beside it, and refuses, with a typed error and before
drawing anything, a file that is absent, is not a result, or names no benchmark.

The committed results it was made for are re-drawn in real processes; the refusals are
checked both through the command line (exit 2, the message, no traceback) and in-process
(the error's type).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from batchweave.errors import BatchWeaveError, ConfigError
from benchmarks import BENCHMARKS, benchmark_of, replot
from benchmarks.report import BenchResult, load_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks"
# The committed results issue 32 re-drew, one per plot changed there.
REDRAWN = [
    "2026-11-28-dc67412/consumers.json",
    "2026-11-28-70c0cae/e2e.json",
    "2026-11-25-0de60e6/e2e-video.json",
]
NOT_A_PNG = b"an old figure"


def bench(*args: str, entry: str = "cli") -> subprocess.CompletedProcess:
    """``batchweave bench ARGS`` (or ``python -m benchmarks ARGS``) in a fresh interpreter at the root."""
    if entry == "cli":
        code = "import sys; from batchweave.cli import main; sys.exit(main(['bench', *sys.argv[1:]]))"
        command = [sys.executable, "-c", code, *args]
    else:
        command = [sys.executable, "-m", "benchmarks", *args]
    # This checkout's batchweave (the command line under test), whatever the venv installed.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def copied(relative: str, tmp_path: Path) -> Path:
    """A committed result copied into ``tmp_path``, beside a placeholder where its PNG goes."""
    source = RESULTS / relative
    tmp_path.mkdir(parents=True, exist_ok=True)
    target = tmp_path / source.name
    shutil.copyfile(source, target)
    target.with_suffix(".png").write_bytes(NOT_A_PNG)
    return target


@pytest.mark.parametrize("relative", REDRAWN, ids=[Path(r).stem for r in REDRAWN])
def test_replot_redraws_the_png_beside_the_json_from_it_alone(relative, tmp_path):
    path = copied(relative, tmp_path)
    before = path.read_bytes()
    done = bench("--replot", str(path), entry="module")
    assert done.returncode == 0, done.stderr[-3000:]
    png = path.with_suffix(".png")
    assert done.stdout.split() == [str(png)]
    with Image.open(png) as image:  # a real PNG, not the placeholder, and a readable size
        assert image.format == "PNG" and image.width >= 1000 and image.height >= 500
    assert path.read_bytes() == before, "the JSON is left as it was"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, png.name]), "nothing else written"


def test_replot_draws_every_file_named(tmp_path):
    first = copied(REDRAWN[1], tmp_path / "a")
    second = copied(REDRAWN[2], tmp_path / "b")
    done = bench("--replot", str(first), str(second))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(first.with_suffix(".png")), str(second.with_suffix(".png"))]
    assert all(p.with_suffix(".png").read_bytes().startswith(b"\x89PNG") for p in (first, second))


def _refused(done: subprocess.CompletedProcess, *phrases: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert all(phrase in done.stderr for phrase in phrases), done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_json_is_refused(tmp_path):
    absent = tmp_path / "consumers.json"
    _refused(bench("--replot", str(absent)), str(absent), "no such file")
    assert not absent.with_suffix(".png").exists()


def test_a_json_naming_an_unknown_benchmark_is_refused_and_draws_nothing(tmp_path):
    good = copied(REDRAWN[1], tmp_path / "good")
    unknown = tmp_path / "nope.json"
    unknown.write_text(json.dumps({"benchmark": "nope", "config": {}, "results": [], "series": {}}))
    # The good file comes first: nothing is drawn until every file named is known to draw.
    _refused(bench("--replot", str(good), str(unknown)), str(unknown), "no benchmark writes results named 'nope'")
    assert good.with_suffix(".png").read_bytes() == NOT_A_PNG
    assert not unknown.with_suffix(".png").exists()


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        ("[1, 2]", "is not a benchmark's result"),  # a list, as some side files are
        ('{"benchmark": "e2e", "results": []}', "is not a benchmark's result"),  # no config
        ('{"benchmark": "e2e", "config": {}, "results": [3]}', "every entry of 'results'"),
        ("{not json", "is not JSON"),
    ],
    ids=["list", "no-config", "bad-record", "not-json"],
)
def test_a_file_that_is_not_a_result_is_refused(content, phrase, tmp_path):
    path = tmp_path / "e2e.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=phrase) as caught:
        replot([path])
    assert str(path) in str(caught.value) and isinstance(caught.value, BatchWeaveError)
    assert not path.with_suffix(".png").exists()


def test_replot_takes_no_run_options(tmp_path):
    path = copied(REDRAWN[1], tmp_path)
    _refused(bench("e2e", "--out", str(tmp_path), "--replot", str(path)), "drop NAME, --out")
    _refused(bench("--quick", "--seed", "3", "--replot", str(path)), "drop --seed, --quick")
    assert path.with_suffix(".png").read_bytes() == NOT_A_PNG


def test_a_run_still_needs_a_name_and_out(tmp_path):
    _refused(bench("--out", str(tmp_path / "out")), "needs a benchmark NAME and --out DIR")
    _refused(bench("dac"), "needs a benchmark NAME and --out DIR")


def test_each_result_name_finds_the_benchmark_that_writes_it():
    assert {benchmark_of(name) for name in BENCHMARKS} == set(BENCHMARKS)
    assert benchmark_of("e2e-video") == "e2e"  # a workload's files: NAME-WORKLOAD
    for name in ("e2e-image", "nope", "e2e-"):  # the default workload's files are plain NAME.*
        with pytest.raises(ConfigError, match="no benchmark writes results named"):
            benchmark_of(name)


def test_every_committed_result_names_a_benchmark_here():
    """What --replot can draw: every NAME.json a benchmark wrote under docs/benchmarks."""
    results = [p for p in RESULTS.glob("*/*.json") if _is_result(p)]
    assert len(results) >= 30, "the committed results were not found"
    for path in results:
        assert benchmark_of(load_result(path).benchmark) in BENCHMARKS, path


def _is_result(path: Path) -> bool:
    """A benchmark's NAME.json; not an attachment written beside it (NAME-profile.json
    names its benchmark but holds profiles, not results)."""
    data = json.loads(path.read_text())
    return isinstance(data, dict) and "benchmark" in data and "results" in data


def test_a_result_reads_back_as_it_was_written():
    result = BenchResult("e2e", {"warmup": 2}, [{"system": "memory"}], ("system",), ["line"], {"memory": [{"x": 1}]})
    again = BenchResult.from_json(json.loads(json.dumps(result.to_json())), source="x.json")
    assert again.to_json() == result.to_json()
    assert (again.columns, again.summary) == ((), [])  # kept in the Markdown only
