"""The mutation score's arithmetic and its ratchet (``benchmarks/mutation_score.py``)."""

from __future__ import annotations

import json

import pytest

from benchmarks import mutation_score

RESULTS = """
    batchweave.journal.proof.xǁProofǁverify__mutmut_1: killed
    batchweave.journal.proof.xǁProofǁverify__mutmut_2: survived
    batchweave.journal.proof.xǁProofǁverify__mutmut_3: timeout
    batchweave.logrules.x_apply_version__mutmut_9: survived
    batchweave.logrules.x_apply_version__mutmut_10: no tests
    batchweave.logrules.x_apply_version__mutmut_11: killed
"""


def test_equivalent_mutants_are_left_out_and_timeouts_count_as_killed():
    results = mutation_score.parse_results(RESULTS)
    assert len(results) == 6
    score = mutation_score.score(results, {"batchweave.logrules.x_apply_version__mutmut_9": "a message"})
    assert (score.killed, score.equivalent, score.unchecked) == (3, 1, 0)
    assert score.survivors == [
        "batchweave.journal.proof.xǁProofǁverify__mutmut_2",
        "batchweave.logrules.x_apply_version__mutmut_10",
    ]
    assert score.ratio == pytest.approx(3 / 5)
    assert mutation_score.by_module(score.survivors) == {"journal.proof": 1, "logrules": 1}


@pytest.mark.parametrize(("floor", "code"), [(0.4, 0), (0.6, 1)])
def test_a_score_below_the_floor_fails(tmp_path, monkeypatch, floor, code):
    kept = tmp_path / "floor.json"
    kept.write_text(json.dumps({"floor": floor, "equivalent": {}}))
    monkeypatch.setattr(mutation_score, "FLOOR_FILE", kept)
    saved = tmp_path / "results.txt"
    saved.write_text(RESULTS)
    assert mutation_score.main(["--out", str(tmp_path / "out"), "--results", str(saved)]) == code
    record = json.loads((tmp_path / "out" / "mutation.json").read_text())
    assert record["score"] == pytest.approx(3 / 6) and record["survived"] == 3
    table = (tmp_path / "out" / "mutation.md").read_text()
    assert "| journal.proof | 2 | 1 | 0 | 0 | 66.7% |" in table and "| logrules | 1 | 2 | 0 | 0 | 33.3% |" in table


def test_an_interrupted_run_is_not_judged(tmp_path):
    saved = tmp_path / "results.txt"
    saved.write_text(RESULTS + "    batchweave.logrules.x_build_claim__mutmut_1: not checked\n")
    assert mutation_score.main(["--out", str(tmp_path / "out"), "--results", str(saved)]) == 1


def test_a_recheck_counts_a_survivor_the_new_tests_fail_on_as_killed(monkeypatch, tmp_path):
    asked = []

    def fails_on(name, files, deselect=()):
        asked.append((name, files))
        return name.endswith("_2")

    monkeypatch.setattr(mutation_score, "_fails_on", fails_on)
    results = mutation_score.recheck(mutation_score.parse_results(RESULTS), [tmp_path / "test_new.py"], workers=1)
    assert results["batchweave.journal.proof.xǁProofǁverify__mutmut_2"] == "killed"
    assert results["batchweave.logrules.x_apply_version__mutmut_9"] == "survived"
    assert sorted(name for name, _ in asked) == [  # no mutant first (the tests must pass), then the survivors
        "",
        "batchweave.journal.proof.xǁProofǁverify__mutmut_2",
        "batchweave.logrules.x_apply_version__mutmut_10",
        "batchweave.logrules.x_apply_version__mutmut_9",
    ]


def test_a_recheck_with_tests_that_fail_unmutated_kills_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(mutation_score, "_fails_on", lambda name, files, deselect=(): True)
    with pytest.raises(SystemExit, match="fail with no mutant switched on"):
        mutation_score.recheck(mutation_score.parse_results(RESULTS), [tmp_path / "test_new.py"], workers=1)
