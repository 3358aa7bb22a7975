"""A namespace's schema: fixed by its first TGB of arrays, recorded in the log, checked by
the log's rules, refused at the producer with a SchemaError that names the array."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import numpy as np
import pytest

import batchweave as bw
from batchweave import intent as intent_format
from batchweave import keys, log, logrules
from batchweave import schema as schemas
from batchweave.cli import main
from batchweave.commit import group
from batchweave.commit.policies import Manual
from batchweave.errors import CorruptDataError, LayoutError, SchemaError
from batchweave.journal import Journal
from batchweave.log import Layout, LogState, LogVersion, ProducerState, TGBDescriptor, encode
from batchweave.schema import ArraySchema, Schema
from batchweave.store import open_store
from batchweave.testing import versiontext

ROOT = Path(__file__).resolve().parents[1]
TOKENS = Schema.of({"tokens": ("int32", (2048,))})


def arrays(dp: int = 2, **named: np.ndarray) -> list[dict[str, np.ndarray]]:
    return [dict(named) for _ in range(dp)]


def url_of(url: str) -> str:
    """The URL a namespace's errors name (a local path is shown as file://)."""
    return open_store(url).url


def data_objects(url: str) -> int:
    return len(list(open_store(url).list("data/")))


def read_all(url: str, dp: int = 2) -> list[dict[str, np.ndarray]]:
    """Rank 0's slice of every step, after the stream is ended."""
    bw.end_stream(url)
    with bw.Consumer(url, dp=dp, rank=0, timeout_s=20) as consumer:
        return [{k: np.array(v) for k, v in batch.data.items()} for batch in consumer]  # pyright: ignore


# -- the schema as a value -----------------------------------------------------------------


def test_a_declared_schema_spells_dtypes_as_numpy_writes_them_and_sorts_its_arrays():
    schema = Schema.of({"tokens": (np.int32, [None, 2048]), "mask": ("bool", (None,))})
    assert schema.arrays == (ArraySchema("mask", "|b1", (None,)), ArraySchema("tokens", "<i4", (None, 2048)))
    assert schema.describe() == "mask: bool (*,), tokens: int32 (*, 2048)"
    assert schema.to_dict() == {
        "mask": {"dtype": "|b1", "shape": [None]},
        "tokens": {"dtype": "<i4", "shape": [None, 2048]},
    }
    example = {"tokens": np.zeros((7, 2048), np.int32), "mask": np.zeros(7, bool)}
    assert Schema.from_arrays(example, variable_first_dim=["tokens", "mask"]) == schema
    assert Schema.from_arrays(example) == Schema.of({"tokens": ("int32", (7, 2048)), "mask": ("bool", (7,))})


@pytest.mark.parametrize(
    ("declared", "problem"),
    [
        ({"x": ("object", (2,))}, "unsupported dtype"),
        ({"x": ("not-a-dtype", (2,))}, "is not a numpy dtype"),
        ({"x": ("int32", (2, None))}, "only the first dimension may vary"),
        ({"x": ("int32", (-1,))}, "none is negative"),
        ({"x": ("int32", "2")}, "shape must be a sequence of sizes"),
        ({"x": ("int32",)}, "give (dtype, shape)"),
        ({"x": "int32"}, "give (dtype, shape)"),
        ({"": ("int32", (2,))}, "non-empty strings"),
        ({}, "lists no arrays"),
    ],
)
def test_a_declaration_no_slice_can_have_is_refused(declared, problem):
    with pytest.raises(SchemaError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        Schema.of(declared)


def test_from_arrays_refuses_a_variable_dimension_it_cannot_vary():
    with pytest.raises(SchemaError, match=r"variable_first_dim names \['y'\]"):
        Schema.from_arrays({"x": np.zeros(2)}, variable_first_dim=["y"])
    with pytest.raises(SchemaError, match="has no dimensions"):
        Schema.from_arrays({"x": np.float32(1.0) * np.ones(())}, variable_first_dim=["x"])


def test_the_digest_is_short_and_tells_schemas_apart():
    other = Schema.of({"tokens": ("int64", (2048,))})
    assert len(TOKENS.digest) == 16 and TOKENS.digest == Schema.of({"tokens": ("<i4", [2048])}).digest
    assert other.digest != TOKENS.digest


def test_a_schema_read_from_the_log_is_checked_like_any_input():
    assert schemas.problem(TOKENS) == ""
    assert "not distinct and sorted" in schemas.problem(
        Schema((ArraySchema("b", "<i4", ()), ArraySchema("a", "<i4", ())))
    )
    assert "unsupported dtype" in schemas.problem(Schema((ArraySchema("a", "<O8", ()),)))
    assert "only the first dimension" in schemas.problem(Schema((ArraySchema("a", "<i4", (2, None)),)))
    assert "at most 32" in schemas.problem(Schema((ArraySchema("a", "<i4", (1,) * 33),)))


def test_mismatch_names_the_array_what_it_is_and_what_the_schema_says():
    def layout(name: str, dtype: str, shape: tuple[int, ...]):
        return ((name, dtype, shape),)

    assert schemas.mismatch(TOKENS, layout("tokens", "<i4", (2048,))) == ""
    assert (
        schemas.mismatch(TOKENS, layout("tokens", "<i8", (2048,)))
        == "array 'tokens' is int64 (2048,), the namespace's schema says int32 (2048,)"
    )
    assert schemas.mismatch(TOKENS, layout("tokens", "<i4", (2049,))) == (
        "array 'tokens' is int32 (2049,), the namespace's schema says int32 (2048,) "
        "(only a first dimension declared variable may vary)"
    )
    assert (
        schemas.mismatch(TOKENS, layout("tokens", "<i4", (1, 2048)))
        == "array 'tokens' is int32 (1, 2048), the namespace's schema says int32 (2048,)"
    )
    assert (
        schemas.mismatch(TOKENS, layout("ids", "<i4", (2048,)), "their schema")
        == "array 'ids' (int32 (2048,)) is not in their schema (tokens: int32 (2048,))"
    )
    assert schemas.mismatch(TOKENS, ()) == "array 'tokens' is missing, the namespace's schema has it as int32 (2048,)"
    variable = Schema.of({"tokens": ("int32", (None, 4))})
    assert schemas.mismatch(variable, layout("tokens", "<i4", (9, 4))) == ""
    assert "is int32 (9, 5)" in schemas.mismatch(variable, layout("tokens", "<i4", (9, 5)))
    assert schemas.mismatch(TOKENS, layout("tokens", ">i4", (2048,))).startswith("array 'tokens' is >i4 (2048,)")


# -- the log's rules -------------------------------------------------------------------------


def descriptor(producer: str, offset: int, schema: str = "", kind: str = "arrays") -> TGBDescriptor:
    return TGBDescriptor(
        producer=producer,
        epoch=1,
        source_offset=offset,
        dp=1,
        cp=1,
        kind=kind,  # pyright: ignore[reportArgumentType]
        objects=[keys.data_key(producer, 1, offset, "t", 0)],
        slices=[(0, 0, 10, 1)],
        nbytes=10,
        schema=schema,
    )


def claimed(*producers: str) -> LogState:
    state = LogState()
    for producer in producers:
        version = logrules.build_claim(state, producer, f"i-{producer}", 1.0, Layout(1, 1))
        state = logrules.apply_version(state, version, keys.version_key(version.version))
    return state


def committing(state: LogState, *tgbs: TGBDescriptor, schema: Schema | None = None) -> LogVersion:
    producers = {
        t.producer: ProducerState(t.source_offset + 1, 1, f"i-{t.producer}")
        for t in tgbs  # the last TGB of each producer gives its offset
    }
    return logrules.next_version(state, 2.0, tgbs=list(tgbs), producers=producers, schema=schema)


def first_commit(state: LogState, producer: str, offset: int) -> LogState:
    """``state`` after a version that commits ``producer``'s TGB of TOKENS and sets the schema."""
    version = committing(state, descriptor(producer, offset, TOKENS.digest), schema=TOKENS)
    return logrules.apply_version(state, version, keys.version_key(version.version))


def test_the_version_of_the_first_tgb_of_arrays_sets_the_schema_and_later_tgbs_must_name_it():
    state = claimed("a", "b")
    first = committing(state, descriptor("a", 0, schema=TOKENS.digest), schema=TOKENS)
    state = logrules.apply_version(state, first, "v3")
    assert state.schema == TOKENS
    later = committing(state, descriptor("b", 0, schema=TOKENS.digest))
    assert b'"schema":{' not in encode(later), "the full schema travels once"
    assert logrules.apply_version(state, later, "v4").schema == TOKENS


@pytest.mark.parametrize(
    ("tgb", "schema", "problem"),
    [
        (descriptor("b", 0, schema="0123456789abcdef"), None, "has schema '0123456789abcdef', the namespace's is"),
        (descriptor("b", 0), None, "has schema 'none'"),
        (descriptor("b", 0, schema=TOKENS.digest), TOKENS, "sets a schema, but the namespace has one already"),
    ],
)
def test_a_version_whose_tgbs_do_not_fit_the_schema_is_refused(tgb, schema, problem):
    state = claimed("a", "b")
    state = logrules.apply_version(
        state, committing(state, descriptor("a", 0, schema=TOKENS.digest), schema=TOKENS), "v3"
    )
    with pytest.raises(CorruptDataError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        logrules.apply_version(state, committing(state, tgb, schema=schema), "v4")


def test_a_schema_is_set_only_with_what_needs_it_and_never_for_bytes():
    state = claimed("a")
    with pytest.raises(CorruptDataError, match="names schema .* but the namespace has no schema"):
        logrules.apply_version(state, committing(state, descriptor("a", 0, schema=TOKENS.digest)), "v2")
    damaged = Schema((ArraySchema("x", "<i4", (2, None)),))
    with pytest.raises(CorruptDataError, match="sets a damaged schema: array 'x'"):
        logrules.apply_version(
            state, committing(state, descriptor("a", 0, schema=damaged.digest), schema=damaged), "v2"
        )
    state = logrules.apply_version(state, committing(state, descriptor("a", 0, kind="bytes")), "v2")
    with pytest.raises(CorruptDataError, match="sets a schema of arrays, but the namespace holds bytes"):
        logrules.apply_version(state, committing(state, schema=TOKENS), "v3")
    with pytest.raises(CorruptDataError, match=r"TGB a@1 \(bytes\) names schema"):
        logrules.apply_version(state, committing(state, descriptor("a", 1, TOKENS.digest, kind="bytes")), "v3")


def test_a_log_older_than_schemas_is_not_checked_until_a_schema_is_set():
    state = claimed("a", "b")
    # Versions written before schemas: TGBs of arrays without a digest, and no schema.
    old = committing(state, descriptor("a", 0), descriptor("b", 0))
    assert b'"schema"' not in encode(old)
    state = logrules.apply_version(state, old, "v3")
    assert state.schema is None and state.layout is not None and state.layout.kind == "arrays"
    # The first TGB with a digest sets the schema there; from then on every TGB is checked.
    state = logrules.apply_version(
        state, committing(state, descriptor("a", 1, schema=TOKENS.digest), schema=TOKENS), "v4"
    )
    assert state.schema == TOKENS
    with pytest.raises(CorruptDataError, match="TGB b@1 has schema 'none'"):
        logrules.apply_version(state, committing(state, descriptor("b", 1)), "v5")


def test_build_commit_carries_the_committers_schema_only_while_the_namespace_has_none():
    state = claimed("a")
    me = state.producers["a"]
    first = logrules.build_commit(state, "a", me, [descriptor("a", 0, schema=TOKENS.digest)], 2.0, schema=TOKENS)
    assert first.schema == TOKENS
    state = logrules.apply_version(state, first, "v2")
    second = logrules.build_commit(state, "a", me, [descriptor("a", 1, schema=TOKENS.digest)], 3.0, schema=TOKENS)
    assert second.schema is None
    bytes_only = logrules.build_commit(claimed("a"), "a", me, [descriptor("a", 0, kind="bytes")], 2.0, schema=TOKENS)
    assert bytes_only.schema is None


def test_a_rebase_onto_another_schema_raises_schema_error_naming_the_array():
    state = claimed("a", "b")
    state = logrules.apply_version(
        state, committing(state, descriptor("a", 0, schema=TOKENS.digest), schema=TOKENS), "v3"
    )
    mine = Schema.of({"tokens": ("int64", (2048,))})
    with pytest.raises(SchemaError) as raised:
        logrules.pending_after_rebase(
            state, "b", state.producers["b"], [descriptor("b", 0, schema=mine.digest)], mine, "s3://b/run"
        )
    assert str(raised.value).startswith(
        "s3://b/run: TGB b@0: array 'tokens' is int64 (2048,), the namespace's schema says int32 (2048,); "
        "producer 'b' cannot commit it (log version 3"
    )
    assert isinstance(raised.value, LayoutError) and isinstance(raised.value, ValueError)


def test_group_commit_folds_only_intents_of_the_schema_its_version_has():
    state = claimed("a", "b", "c")
    other = Schema.of({"tokens": ("int64", (2048,))})

    def intent(producer: str, schema: Schema) -> intent_format.Intent:
        return intent_format.Intent(
            intent_format.INTENT_FORMAT, producer, 1, [descriptor(producer, 0, schema=schema.digest)]
        )

    intents = [intent("b", other), intent("c", TOKENS)]
    version = group.build_group_commit(
        state, "a", state.producers["a"], [descriptor("a", 0, schema=TOKENS.digest)], intents, 2.0, schema=TOKENS
    )
    assert version is not None and version.schema == TOKENS
    assert [t.producer for t in version.tgbs] == ["a", "c"]  # b's waits for its own turn, which refuses it
    assert logrules.apply_version(state, version, "v4").schema == TOKENS
    # A committer with no schema of its own folds no intent that would need one.
    assert group.build_group_commit(state, "a", state.producers["a"], [], intents, 2.0) is None


# -- the producer -------------------------------------------------------------------------------


def test_append_refuses_a_tgb_whose_dtype_differs_before_writing_anything(fast_url):
    with bw.Producer(fast_url, "prep-7", dp=2) as producer:
        producer.append(arrays(tokens=np.zeros(2048, np.int32)))
        producer.flush()
        objects = data_objects(fast_url)
        with pytest.raises(SchemaError) as raised:
            producer.append(arrays(tokens=np.zeros(2048, np.int64)))
        assert str(raised.value).startswith(
            f"{url_of(fast_url)}: TGB prep-7@1: array 'tokens' is int64 (2048,), "
            "the namespace's schema says int32 (2048,); nothing was written."
        )
        assert data_objects(fast_url) == objects
        assert producer.append(arrays(tokens=np.ones(2048, np.int32))) == 1  # the offset was not used
    assert [step["tokens"].dtype for step in read_all(fast_url)] == [np.int32, np.int32]
    assert bw.read_schema(fast_url) == TOKENS


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"tokens": np.zeros(1024, np.int32)}, "array 'tokens' is int32 (1024,), {whose} says int32 (2048,)"),
        ({"ids": np.zeros(2048, np.int32)}, "array 'ids' (int32 (2048,)) is not in {whose} (tokens: int32 (2048,))"),
        (
            {"tokens": np.zeros(2048, np.int32), "mask": np.zeros(2048, bool)},
            "array 'mask' (bool (2048,)) is not in {whose} (tokens: int32 (2048,))",
        ),
    ],
)
def test_append_refuses_a_shape_or_an_array_the_schema_does_not_have(fast_url, second, message):
    producer = bw.Producer(fast_url, "p", dp=2, commit_policy=Manual())
    producer.append(arrays(tokens=np.zeros(2048, np.int32)))
    # Not committed yet: the producer's own first TGB is the schema it holds to.
    with pytest.raises(SchemaError, match=re.escape(message.format(whose="the schema of this producer's first TGB"))):
        producer.append(arrays(**second))
    producer.flush()
    with pytest.raises(SchemaError, match=re.escape(message.format(whose="the namespace's schema"))):
        producer.append(arrays(**second))
    producer.close()


def test_append_refuses_a_missing_array(fast_url):
    with bw.Producer(fast_url, "p", dp=1) as producer:
        producer.append(arrays(1, tokens=np.zeros(4, np.int32), mask=np.zeros(4, bool)))
        producer.flush()
        with pytest.raises(
            SchemaError, match="TGB p@1: array 'mask' is missing, the namespace's schema has it as bool"
        ):
            producer.append(arrays(1, tokens=np.zeros(4, np.int32)))


def test_an_undeclared_first_dimension_may_not_vary_within_or_across_tgbs(fast_url):
    hint = r"\(only a first dimension declared variable may vary\)"
    with bw.Producer(fast_url, "p", dp=2) as producer:
        within = r"array 'x' is float32 \(5, 8\), the schema of this TGB's first slice says float32 \(3, 8\) "
        with pytest.raises(SchemaError, match=within + hint):
            producer.append([{"x": np.zeros((3, 8), np.float32)}, {"x": np.zeros((5, 8), np.float32)}])
        producer.append(arrays(x=np.zeros((3, 8), np.float32)))
        with pytest.raises(SchemaError, match=rf"array 'x' is float32 \(4, 8\), .* says float32 \(3, 8\) {hint}"):
            producer.append(arrays(x=np.zeros((4, 8), np.float32)))


def test_a_declared_variable_first_dimension_is_accepted_and_read_back(fast_url):
    declared = {"tokens": ("int32", (None, 4)), "lengths": ("int64", (None,))}
    with bw.Producer(fast_url, "p", dp=2, schema=declared) as producer:
        for n in (3, 5):
            producer.append(
                [
                    {"tokens": np.full((n + d, 4), n, np.int32), "lengths": np.arange(n + d, dtype=np.int64)}
                    for d in range(2)
                ]
            )
        producer.flush()  # the namespace's schema (the declared one) is now known: named the same way
        with pytest.raises(SchemaError, match=r"array 'tokens' is int32 \(2, 5\), this producer's declared schema"):
            producer.append(arrays(tokens=np.zeros((2, 5), np.int32), lengths=np.zeros(2, np.int64)))
    # Another producer that declares nothing takes the namespace's schema, variable dimension too.
    with bw.Producer(fast_url, "q", dp=2) as other:
        assert other.schema == Schema.of(declared)
        other.append(arrays(tokens=np.zeros((9, 4), np.int32), lengths=np.zeros(9, np.int64)))
    assert [step["tokens"].shape for step in read_all(fast_url)] == [(3, 4), (5, 4), (9, 4)]
    assert bw.read_schema(fast_url) == Schema.of(declared)


def test_a_declaration_unlike_the_namespaces_is_refused_at_construction(fast_url):
    with bw.Producer(fast_url, "p", dp=2) as producer:
        producer.append(arrays(tokens=np.zeros(2048, np.int32)))
    versions = bw.inspect_namespace(fast_url).latest_version
    with pytest.raises(SchemaError) as raised:
        bw.Producer(fast_url, "q", dp=2, schema={"tokens": ("int32", (None,))})
    assert str(raised.value) == (
        f"{url_of(fast_url)}: producer 'q' declares another schema than the namespace's (log version {versions}): "
        "array 'tokens' is int32 (*,), the namespace says int32 (2048,); declare the namespace's schema "
        "(batchweave.read_schema), or use a new namespace"
    )
    assert bw.inspect_namespace(fast_url).latest_version == versions, "a refused producer claims nothing"
    with bw.Producer(fast_url, "q", dp=2, schema=TOKENS) as same:  # the namespace's own is welcome
        same.append(arrays(tokens=np.ones(2048, np.int32)))


def test_bytes_have_no_schema(fast_url):
    with bw.Producer(fast_url, "p", dp=2) as producer:
        producer.append([b"a", b"b"])
        assert producer.schema is None
    assert bw.read_schema(fast_url) == "bytes"
    with pytest.raises(SchemaError, match="declares a schema of arrays .* but the namespace holds bytes"):
        bw.Producer(fast_url, "q", dp=2, schema=TOKENS)


def test_a_producer_with_a_declared_schema_refuses_bytes(fast_url):
    with bw.Producer(fast_url, "p", dp=2, schema=TOKENS) as producer:
        with pytest.raises(SchemaError, match="slices are bytes, but this producer's schema is of arrays"):
            producer.append([b"a", b"b"])


# -- two producers, two schemas, one namespace ------------------------------------------------------


@pytest.mark.parametrize("policy", ["manual", "group"])
def test_the_loser_of_a_schema_race_stops_with_schema_error_and_nothing_committed_is_lost(tmp_path, policy):
    url = str(tmp_path / "ns")
    winner = bw.Producer(url, "a", dp=2, commit_policy=policy)
    loser = bw.Producer(url, "b", dp=2, commit_policy=policy)
    # Both hold a TGB before either commits: only the log can tell them apart.
    winner.append(arrays(tokens=np.zeros(2048, np.int32)))
    loser.append(arrays(tokens=np.zeros(2048, np.int64)))
    winner.flush()
    with pytest.raises(SchemaError) as raised:
        loser.flush()
    assert str(raised.value).startswith(
        f"{url_of(url)}: TGB b@0: array 'tokens' is int64 (2048,), the namespace's schema says int32 (2048,); "
        "producer 'b' cannot commit it"
    )
    with pytest.raises(SchemaError):
        loser.append(arrays(tokens=np.zeros(2048, np.int64)))
    loser.close()  # told already: close does not raise it again
    winner.append(arrays(tokens=np.ones(2048, np.int32)))
    winner.close()
    assert [int(step["tokens"][0]) for step in read_all(url)] == [0, 1]


def test_a_schema_error_the_commit_thread_found_alone_is_raised_by_close(tmp_path):
    url = str(tmp_path / "ns")
    with bw.Producer(url, "a", dp=2) as winner:
        loser = bw.Producer(url, "b", dp=2, commit_policy="naive")  # commits each TGB at once
        winner.append(arrays(tokens=np.zeros(2048, np.int32)))
    # The loser read the log before the winner's commit: append cannot know, its commit can.
    loser.append(arrays(tokens=np.zeros(2048, np.int64)))
    thread = loser._thread  # pyright: ignore[reportPrivateUsage]
    assert thread is not None
    thread.join(timeout=30)  # the commit thread stops at the SchemaError
    assert not thread.is_alive()
    with pytest.raises(SchemaError, match="TGB b@0: array 'tokens' is int64 \\(2048,\\), the namespace's schema"):
        loser.close()
    loser.close()  # idempotent, and told once
    assert bw.inspect_namespace(url).producers["b"]["offset"] == 0
    assert [int(step["tokens"][0]) for step in read_all(url)] == [0]


RACER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import numpy as np
    import batchweave as bw

    url, producer_id, dtype, go = sys.argv[1:5]
    deadline = time.monotonic() + 60
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.001)  # both start at once: the race is the point
    committed = 0
    try:
        with bw.Producer(url, producer_id, dp=2, commit_policy="naive") as producer:
            for offset in range(5):
                producer.append([{"tokens": np.full(64, offset, dtype)}] * 2)
            producer.flush()
        print(json.dumps({"ok": True}))
    except bw.SchemaError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
    """
)


def test_two_processes_racing_with_two_schemas_one_wins_and_the_other_gets_schema_error(tmp_path):
    url, go = str(tmp_path / "ns"), tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, url, producer_id, dtype, str(go)],
            stdout=subprocess.PIPE,
            text=True,
            env={"PYTHONPATH": f"{ROOT / 'src'}", "PATH": "/usr/bin:/bin"},
        )
        for producer_id, dtype in (("i32", "int32"), ("i64", "int64"))
    ]
    go.touch()
    results = {}
    for racer, producer_id in zip(racers, ("i32", "i64"), strict=True):
        out, _ = racer.communicate(timeout=120)
        assert racer.returncode == 0, out
        results[producer_id] = json.loads(out.strip().splitlines()[-1])
    winners = [p for p, r in results.items() if r["ok"]]
    assert len(winners) == 1, results
    winner = winners[0]
    loser = "i64" if winner == "i32" else "i32"
    assert "array 'tokens' is " in results[loser]["error"] and "the namespace's schema says" in results[loser]["error"]
    expected = np.dtype("int32" if winner == "i32" else "int64")
    assert bw.read_schema(url) == Schema.of({"tokens": (expected, (64,))})
    steps = read_all(url)
    assert [int(step["tokens"][0]) for step in steps] == list(range(5))  # every committed TGB readable
    assert {step["tokens"].dtype for step in steps} == {expected}
    assert bw.inspect_namespace(url).producers[loser]["offset"] == 0


# -- readers --------------------------------------------------------------------------------------


def test_a_reader_refuses_a_version_whose_tgb_has_another_schema(tmp_path):
    url = str(tmp_path / "ns")
    with bw.Producer(url, "p", dp=1) as producer:
        producer.append(arrays(1, tokens=np.zeros(2048, np.int32)))
    store = open_store(url)
    journal = Journal(store, read_only=True)
    state = journal.load_state()
    [committed] = [t for v in journal.versions_after(0) for t in v.tgbs]
    assert committed.schema == TOKENS.digest
    # A writer that broke the rules (or a forged object): a TGB of another schema.
    other = Schema.of({"tokens": ("int64", (2048,))}).digest
    forged = msgspec.structs.replace(committed, source_offset=1, schema=other)
    me = msgspec.structs.replace(state.producers["p"], offset=2, last_version=0)
    version = logrules.next_version(state, 3.0, tgbs=[forged], producers={"p": me})
    store.put_if_absent(keys.version_key(version.version), encode(version))
    with pytest.raises(CorruptDataError, match="TGB p@1 has schema"):
        Journal(store, read_only=True).load_state()


def test_a_log_written_before_schemas_still_reads_and_gets_a_schema_from_its_next_tgb(tmp_path):
    url = str(tmp_path / "ns")
    with bw.Producer(url, "p", dp=2) as producer:
        producer.append(arrays(tokens=np.zeros(8, np.int32)))
        producer.append(arrays(tokens=np.ones(8, np.int32)))
    # As the log was before schemas: format 1, no digest in any TGB, no schema in any version.
    for path in sorted((tmp_path / "ns" / "_log").rglob("*.json")):
        version = versiontext.loads(path.read_bytes())
        version.pop("schema", None)
        version["format"] = log.LOG_FORMAT_1
        for tgb in version["tgbs"]:
            tgb.pop("schema", None)
        path.write_bytes(json.dumps(version, separators=(",", ":")).encode())
    assert b"schema" not in b"".join(p.read_bytes() for p in (tmp_path / "ns").rglob("*.json"))
    assert bw.read_schema(url) is None
    info = bw.inspect_namespace(url)
    assert info.schema is None and info.steps == 2
    # A producer of today writes on: its first commit records the schema, checked from then on.
    with bw.Producer(url, "p", dp=2) as producer:
        assert producer.schema is None
        producer.append(arrays(tokens=np.full(8, 2, np.int32)))
        producer.flush()
        assert bw.read_schema(url) == Schema.of({"tokens": ("int32", (8,))})
        with pytest.raises(SchemaError, match="array 'tokens' is int64 \\(8,\\), the namespace's schema says int32"):
            producer.append(arrays(tokens=np.zeros(8, np.int64)))
    assert [int(step["tokens"][0]) for step in read_all(url)] == [0, 1, 2]


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_shows_the_schema(tmp_path, capsys):
    url = str(tmp_path / "ns")
    with bw.Producer(url, "p", dp=2, schema={"tokens": ("int32", (None, 4))}) as producer:
        producer.append(arrays(tokens=np.zeros((3, 4), np.int32)))
    assert main(["inspect", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == {"tokens": {"dtype": "<i4", "shape": [None, 4]}}
    assert main(["inspect", url]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│ schema ")]
    assert len(rows) == 1 and "tokens: int32 (*, 4)" in rows[0]


def test_inspect_says_bytes_and_nothing_yet(tmp_path, capsys):
    url = str(tmp_path / "ns")
    (tmp_path / "ns").mkdir()
    assert main(["inspect", url, "--json"]) == 2  # the command refuses an empty directory, as an empty S3 prefix
    assert "no BatchWeave namespace at" in capsys.readouterr().err
    assert bw.inspect_namespace(url).to_dict()["schema"] is None  # the function describes it
    with bw.Producer(url, "p", dp=1) as producer:
        producer.append([b"x"])
    assert main(["inspect", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == "bytes"
    assert main(["inspect", url]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│ schema ")]
    assert len(rows) == 1 and "│ bytes " in rows[0]


def test_a_schema_from_torch_tensors_is_the_one_their_numpy_views_have():
    torch = pytest.importorskip("torch")
    example = {"x": torch.zeros(3, 4, dtype=torch.int16), "y": torch.ones(2, dtype=torch.float32)}
    assert Schema.from_arrays(example, variable_first_dim=["x"]) == Schema.of(
        {"x": ("int16", (None, 4)), "y": ("float32", (2,))}
    )
    with pytest.raises(SchemaError, match="torch dtype torch.bfloat16 has no numpy equivalent"):
        Schema.from_arrays({"x": torch.zeros(2, dtype=torch.bfloat16)})


def test_a_tgb_is_held_to_the_declaration_the_namespace_or_its_first_slice_and_told_whose():
    first = (("x", "<i4", (3,)),)
    exact = Schema.of({"x": ("int32", (3,))})
    declared = Schema.of({"x": ("int32", (None,))})
    assert schemas.held_to(None, None, None, first) == (exact, "the schema of this TGB's first slice")
    assert schemas.held_to(None, exact, None, first) == (exact, "the schema of this producer's first TGB")
    assert schemas.held_to(exact, exact, None, first) == (exact, "the namespace's schema")
    # The declaration by its name, whether the namespace's copy of it was read back or not.
    assert schemas.held_to(None, declared, declared, first) == (declared, "this producer's declared schema")
    assert schemas.held_to(declared, declared, declared, first) == (declared, "this producer's declared schema")
