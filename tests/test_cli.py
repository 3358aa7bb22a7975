"""The ``batchweave`` command line, run as a real subprocess (plus a few in-process calls)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import batchweave
from batchweave.cli import build_parser, main


def _cli() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m batchweave.cli``."""
    script = Path(sys.executable).parent / "batchweave"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "batchweave.cli"]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_cli(), *args], capture_output=True, text=True, timeout=timeout)


def _slices(dp: int, value: int) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(16, value * 10 + d, dtype=np.int32)} for d in range(dp)]


@pytest.fixture
def namespace(tmp_path):
    """A local namespace with 3 TGBs from p0 and 2 from p1 (dp=2), not ended."""
    url = str(tmp_path / "ns")
    written = 0
    for pid, count in (("p0", 3), ("p1", 2)):
        with batchweave.Producer(url, pid, dp=2) as producer:
            for i in range(count):
                producer.append(_slices(2, i))
            producer.flush()
            written += producer.metrics()["bytes_written"]
    return url, written


def _assert_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result
    assert result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


def test_inspect_json_reports_the_committed_state(namespace):
    url, written = namespace
    result = run_cli("inspect", url, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)  # exactly one JSON object, nothing else on stdout
    assert {"latest_version", "steps", "producers", "end_of_stream", "bytes"} <= info.keys()
    assert info["steps"] == 5
    assert info["producers"] == {"p0": {"offset": 3, "epoch": 1}, "p1": {"offset": 2, "epoch": 1}}
    assert info["end_of_stream"] is False
    assert info["bytes"] == written > 0
    # two epoch claims and at least one commit per producer
    assert info["latest_version"] >= 4
    assert info == batchweave.inspect_namespace(url).to_dict()


def test_inspect_table_is_human_readable(namespace):
    url, _ = namespace
    result = run_cli("inspect", url)
    assert result.returncode == 0, result.stderr
    for text in ("latest version", "steps", "p0", "p1", "end of stream"):
        assert text in result.stdout


def _mark(url: str, checkpoint_id: str, steps: int, ranks: tuple[int, ...] = (0, 1)) -> None:
    """The ranks of a dp=2 mesh read ``steps`` steps, then mark ``checkpoint_id``."""
    for rank in ranks:
        with batchweave.Consumer(url, dp=2, rank=rank, timeout_s=10) as consumer:
            for _ in range(steps):
                next(consumer)
            consumer.mark_checkpoint(checkpoint_id)


def test_inspect_json_reports_layout_and_checkpoints_with_their_lag(namespace):
    url, _ = namespace
    assert json.loads(run_cli("inspect", url, "--json").stdout)["checkpoints"] == []
    _mark(url, "gone", 1)
    batchweave.release_checkpoint(url, "gone")  # a deleted checkpoint is not shown
    _mark(url, "step-2", 2)
    _mark(url, "half", 4, ranks=(1,))  # rank 0 never marked: not a restore point
    result = run_cli("inspect", url, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["layout"] == {"dp": 2, "cp": 1, "kind": "arrays"}
    versions = {c.id: c.version for c in batchweave.inspect_namespace(url).checkpoints}
    assert info["checkpoints"] == [
        {"id": "half", "complete": False, "position": 4, "version": versions["half"], "lag_steps": 1},
        {"id": "step-2", "complete": True, "position": 2, "version": versions["step-2"], "lag_steps": 3},
    ]
    assert 1 <= versions["step-2"] <= versions["half"] <= info["latest_version"]
    assert info == batchweave.inspect_namespace(url).to_dict()


def test_inspect_table_shows_layout_and_checkpoints(namespace):
    url, _ = namespace
    _mark(url, "step-2", 2)
    result = run_cli("inspect", url)
    assert result.returncode == 0, result.stderr
    for text in ("layout", "dp=2 cp=1 kind=arrays", "checkpoints", "step-2", "lag (steps)"):
        assert text in result.stdout


def test_inspect_in_process(namespace, capsys):
    url, _ = namespace
    assert main(["inspect", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 5


@pytest.mark.parametrize("url", ["ftp://example.com/ns", ""])
def test_bad_url_is_an_error_not_a_traceback(url):
    _assert_error(run_cli("inspect", url))


def test_missing_directory_is_an_error(tmp_path):
    missing = tmp_path / "no-such-namespace"
    _assert_error(run_cli("inspect", str(missing)), "directory does not exist")
    _assert_error(run_cli("watch", str(missing), "--once"), "directory does not exist")
    _assert_error(run_cli("end-stream", str(missing)))
    assert not missing.exists()  # nothing was created by the failed commands


def test_corrupt_log_version_is_an_error(namespace):
    url, _ = namespace
    damaged = Path(url) / "_log" / "00000000000000000002.json"
    assert damaged.is_file()
    damaged.write_bytes(b"{not json")
    _assert_error(run_cli("inspect", url, "--json"), "00000000000000000002")
    _assert_error(run_cli("end-stream", url))


def test_end_stream_commits_the_marker_once(namespace):
    url, _ = namespace
    before = batchweave.inspect_namespace(url)
    first = run_cli("end-stream", url)
    assert first.returncode == 0, first.stderr
    assert f"log version {before.latest_version + 1}" in first.stdout
    info = json.loads(run_cli("inspect", url, "--json").stdout)
    assert info["end_of_stream"] is True
    assert info["steps"] == before.steps
    again = run_cli("end-stream", url)  # idempotent
    assert again.returncode == 0 and again.stdout == first.stdout
    assert batchweave.inspect_namespace(url).latest_version == before.latest_version + 1
    with pytest.raises(batchweave.StreamEndedError):
        batchweave.Producer(url, "p0", dp=2).append(_slices(2, 9))
    consumer = batchweave.Consumer(url, dp=2, rank=1, timeout_s=10)
    assert [b.step for b in consumer] == list(range(5))


def test_release_refuses_a_mistyped_checkpoint_and_takes_missing_ok(namespace):
    url, _ = namespace
    _mark(url, "ckpt-0001", 1)
    typo = run_cli("release", url, "ckpt-001")
    _assert_error(typo, "no checkpoint 'ckpt-001' to release", "did you mean 'ckpt-0001'?", "--missing-ok")
    assert typo.stdout == ""
    assert [c.id for c in batchweave.inspect_namespace(url).checkpoints] == ["ckpt-0001"]  # still pinning
    skipped = run_cli("release", url, "ckpt-001", "--missing-ok")
    assert skipped.returncode == 0 and skipped.stdout == "no checkpoint 'ckpt-001': nothing to release\n"
    for _ in range(2):  # releasing again changes nothing
        released = run_cli("release", url, "ckpt-0001")
        assert released.returncode == 0 and released.stdout == "released checkpoint 'ckpt-0001'\n", released.stderr
    assert batchweave.inspect_namespace(url).checkpoints == ()


def test_usage_errors_exit_2():
    assert run_cli().returncode == 2
    assert run_cli("no-such-command").returncode == 2
    assert run_cli("demo", "--steps", "0").returncode == 2


def test_subcommands_are_registered():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"inspect", "watch", "end-stream", "release", "demo"} <= set(sub.choices)


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and batchweave.__version__ in result.stdout


def test_pool_runs_a_function_over_a_shards_file_and_resumes(tmp_path, capsys):
    shards = tmp_path / "shards.txt"
    shards.write_text("".join(f"{n}\n" for n in range(9)) + "\n")  # a blank line is skipped
    url = str(tmp_path / "ns")
    args = ["pool", url, "prep", "--fn", "pool_work:tgb_of_line", "--shards", str(shards), "--producers", "2"]
    assert main([*args, "--dp", "2", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["produced"], first["shards"], first["producers"]) == (9, 9, 2)
    assert main([*args, "--dp", "2", "--end-stream"]) == 0  # everything is committed: nothing to redo
    assert "0 TGBs committed this run (9 shards in all)" in capsys.readouterr().out
    info = batchweave.inspect_namespace(url)
    assert info.steps == 9 and info.end_of_stream


@pytest.mark.parametrize(
    ("fn", "message"),
    [("pool_work", "give MODULE:FUNCTION"), ("no_such_module:f", "No module named"), ("pool_work:nope", "nope")],
)
def test_pool_names_a_bad_function(tmp_path, capsys, fn, message):
    shards = tmp_path / "shards.txt"
    shards.write_text("1\n")
    args = ["pool", str(tmp_path / "ns"), "prep", "--fn", fn, "--shards", str(shards), "--producers", "1", "--dp", "2"]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_pool_names_a_missing_shards_file(tmp_path, capsys):
    args = ["pool", str(tmp_path / "ns"), "prep", "--fn", "pool_work:tgb_of_line", "--shards", str(tmp_path / "no")]
    assert main([*args, "--producers", "1", "--dp", "2"]) == 2
    assert "cannot read the shards file" in capsys.readouterr().err


# -- startup cost, gc's report, an empty directory ---------------------------------------

# What `batchweave --version` and `--help` must not import: each costs from tens of
# milliseconds (numpy, obstore) to seconds under load (the demo, the benchmarks).
HEAVY = ("numpy", "obstore", "msgspec", "rich", "batchweave_demo", "batchweave.consumer", "batchweave.producer")
HEAVY += ("batchweave.store", "batchweave.pool", "benchmarks", "torch", "matplotlib")

IMPORTED_BY = """
import json, sys
from batchweave.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["gc", "--help"], ["demo", "--help"]])
def test_version_and_help_import_no_heavy_module(args):
    result = subprocess.run(
        [sys.executable, "-c", IMPORTED_BY, *args], capture_output=True, text=True, timeout=60, check=True
    )
    imported = set(json.loads(result.stdout.splitlines()[-1]))
    assert "batchweave.cli" in imported  # the check ran where it should
    assert sorted(name for name in imported if name.split(".")[0] in HEAVY or name in HEAVY) == []


def test_the_demo_default_the_parser_states_is_the_demo_s():
    import batchweave_demo as demo

    from batchweave import cli

    assert cli._DEMO_STEPS == demo.DEFAULT_STEPS
    assert build_parser().parse_args(["demo"]).steps == demo.DEFAULT_STEPS


def test_the_demo_is_not_in_the_batchweave_wheel_and_its_absence_is_said():
    import setuptools

    root = Path(__file__).resolve().parents[1]
    packages = setuptools.find_packages(str(root / "src"))
    assert "batchweave" in packages and not [p for p in packages if "demo" in p], packages
    code = (
        "import sys; sys.modules['batchweave_demo'] = None; "  # as if only the batchweave wheel were installed
        "from batchweave.cli import main; sys.exit(main(['demo', '--dir', sys.argv[1]]))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(root / "never-made")], capture_output=True, text=True)
    assert done.returncode == 2 and "batchweave demo is its own package" in done.stderr, done.stderr
    assert "make demo" in done.stderr and not (root / "never-made").exists()


def test_the_package_s_names_load_on_first_use():
    code = "import sys, batchweave as bw; assert 'numpy' not in sys.modules; bw.Consumer; print('numpy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "True"
    # Every name of the API is an error (errors.py is light: imported at once) or loads lazily.
    assert set(batchweave.__all__) == {*batchweave.errors.__all__, *batchweave._LAZY, "__version__"}
    assert set(batchweave._LAZY) <= set(dir(batchweave))
    with pytest.raises(AttributeError, match="no_such_name"):
        batchweave.no_such_name  # noqa: B018


def test_gc_json_is_a_summary_and_lists_keys_only_when_asked(namespace):
    url, _ = namespace
    _mark(url, "step-3", 3)
    dry = json.loads(run_cli("gc", url, "--dry-run", "--grace-s", "0", "--json").stdout)
    assert "deleted_objects" not in dry and "orphans" not in dry  # no list of keys by default
    # p0's 3 TGBs are one pack (small slices, written together): one object below step 3
    assert dry["dry_run"] is True and dry["w_global_step"] == 3 and dry["deleted_object_count"] == 1
    assert {"deleted_bytes", "deleted_versions", "deleted_snapshots", "orphan_count"} <= dry.keys()
    listed = json.loads(run_cli("gc", url, "--dry-run", "--grace-s", "0", "--json", "--keys").stdout)
    assert len(listed["deleted_objects"]) == 1 and listed["orphans"] == []
    assert {k: v for k, v in listed.items() if k not in ("deleted_objects", "orphans")} == dry
    done = run_cli("gc", url, "--grace-s", "0", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["deleted_object_count"] == 1
    _assert_error(run_cli("gc", url, "--keys"), "give --json too")


def test_gc_dry_run_without_a_checkpoint_says_w_global_is_none_yet(namespace):
    url, _ = namespace
    result = run_cli("gc", url, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("W_global: none yet (no live checkpoint); reclaimed below step 0 (0 bytes")
    assert "would delete 0 TGB objects (0 bytes)" in result.stdout
    _mark(url, "step-2", 2)
    assert run_cli("gc", url, "--dry-run").stdout.startswith("W_global: step 2; ")


def test_inspect_of_an_empty_directory_says_nothing_is_committed_as_on_s3(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    want = f"no BatchWeave namespace at {empty.as_uri()}: nothing committed yet ("
    for command in (["inspect", str(empty)], ["inspect", str(empty), "--json"]):
        _assert_error(run_cli(*command), want, "check the URL")
    assert list(empty.iterdir()) == []


@pytest.mark.s3
def test_inspect_of_an_empty_prefix_says_the_same(moto_server, monkeypatch):
    from batchweave.testing import servers

    for var in servers.S3_ENV_UNSET:
        monkeypatch.delenv(var, raising=False)
    for var, value in servers.s3_env(moto_server).items():
        monkeypatch.setenv(var, value)
    url = "s3://batchweave-test/never-written"
    _assert_error(run_cli("inspect", url), f"error: no BatchWeave namespace at {url}: nothing committed yet (")
