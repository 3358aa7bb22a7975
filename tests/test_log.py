"""Unit tests for the log model: apply, encode/decode, validation and rebase. Pure, no store."""

from __future__ import annotations

import hashlib
import json

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from batchweave.errors import ConfigError, CorruptDataError, ProducerFencedError, StreamEndedError
from batchweave.keys import (
    DataKey,
    check_data_key,
    check_producer_id,
    data_key,
    parse_data_key,
    snapshot_key,
    version_key,
)
from batchweave.lifecycle.backpressure import active_producers
from batchweave.log import (
    LOG_FORMAT,
    LOG_FORMAT_1,
    LOG_FORMAT_2,
    SNAPSHOT_FORMAT,
    Layout,
    LogState,
    LogVersion,
    LogVersionHead,
    ProducerState,
    Reclaim,
    TGBDescriptor,
    TGBHead,
    decode_snapshot,
    decode_version,
    decode_version_head,
    digest,
    encode,
    head_extent,
    runs,
)
from batchweave.logrules import (
    apply_version,
    build_claim,
    build_commit,
    build_end_of_stream,
    build_leave,
    jump_to,
    pending_after_rebase,
)
from batchweave.testing import versiontext

K = "_log/test.json"


def tgb(producer: str, epoch: int, offset: int, *, dp: int = 1, cp: int = 1, nbytes: int = 10, objects=None):
    keys = objects or [f"data/{producer}/e{epoch:06d}/{offset:012d}-t.0.bwb"]
    return TGBDescriptor(
        producer=producer,
        epoch=epoch,
        source_offset=offset,
        dp=dp,
        cp=cp,
        kind="bytes",
        objects=keys,
        slices=[(0, 100 * i, 100, 1234 + i) for i in range(dp * cp)],
        nbytes=nbytes,
    )


def version(v: int, first_step: int, tgbs=(), producers=None, end=False) -> LogVersion:
    return LogVersion(
        format=LOG_FORMAT,
        version=v,
        first_step=first_step,
        tgbs=list(tgbs),
        producers=dict(producers or {}),
        end_of_stream=end,
    )


def claim(state: LogState, pid: str, inc: str) -> tuple[LogState, ProducerState]:
    delta = build_claim(state, pid, inc, committed_at=1.0)
    state = apply_version(state, delta, version_key(delta.version))
    return state, state.producers[pid]


# -- keys ------------------------------------------------------------------------------


def test_keys_are_zero_padded_and_sortable():
    assert version_key(7) == "_log/" + "7".zfill(20) + ".json"
    assert snapshot_key(100) == "_log/_snapshots/" + "100".zfill(20) + ".json"
    keys = [version_key(v) for v in (1, 2, 10, 99, 100, 12345)]
    assert sorted(keys) == keys


# -- applying a sequence ---------------------------------------------------------------


def test_apply_sequence_of_claims_commits_and_end():
    state = LogState()
    assert (state.version, state.steps, state.producers, state.end_of_stream, state.bytes) == (0, 0, {}, False, 0)

    state, a = claim(state, "a", "inc-a")
    assert a == ProducerState(offset=0, epoch=1, incarnation="inc-a", last_version=1)
    assert (state.version, state.steps) == (1, 0)

    state, b = claim(state, "b", "inc-b")
    assert state.version == 2

    d = build_commit(state, "a", a, [tgb("a", 1, 0, nbytes=5), tgb("a", 1, 1, nbytes=7)], committed_at=2.0)
    assert (d.version, d.first_step, list(d.steps())) == (3, 0, [0, 1])
    assert d.producers == {"a": ProducerState(2, 1, "inc-a")}
    state = apply_version(state, d, K)
    assert (state.version, state.steps, state.bytes) == (3, 2, 12)
    assert state.producers["a"].offset == 2

    d = build_commit(state, "b", b, [tgb("b", 1, 0, nbytes=1)], committed_at=3.0)
    assert list(d.steps()) == [2]
    state = apply_version(state, d, K)
    assert (state.version, state.steps, state.bytes) == (4, 3, 13)
    assert state.producers["b"] == ProducerState(1, 1, "inc-b", last_version=4)
    assert state.producers["a"].offset == 2  # untouched

    # A restart of "a" keeps its offset and bumps its epoch.
    state, a2 = claim(state, "a", "inc-a2")
    assert a2 == ProducerState(offset=2, epoch=2, incarnation="inc-a2", last_version=5)
    assert state.steps == 3

    end = build_end_of_stream(state, committed_at=4.0)
    assert end.end_of_stream and end.tgbs == [] and end.producers == {}
    state = apply_version(state, end, K)
    assert state.end_of_stream and state.version == 6 and state.steps == 3


def test_empty_commit_keeps_offset():
    state, me = claim(LogState(), "p", "i")
    d = build_commit(state, "p", me, [], committed_at=0.0)
    assert d.tgbs == [] and d.producers["p"].offset == 0
    state = apply_version(state, d, K)
    assert state.steps == 0 and state.version == 2


def test_apply_does_not_mutate_inputs():
    state, me = claim(LogState(), "p", "i")
    before = dict(state.producers)
    new = apply_version(state, build_commit(state, "p", me, [tgb("p", 1, 0)], 0.0), K)
    assert state.producers == before and state.steps == 0
    assert new.producers["p"].offset == 1


def test_apply_stamps_last_version_which_only_snapshots_carry():
    state, a = claim(LogState(), "a", "ia")
    state, _ = claim(state, "b", "ib")
    delta = build_commit(state, "a", a, [tgb("a", 1, 0)], committed_at=0.0)
    assert "last_version" not in versiontext.loads(encode(delta))["producers"]["a"]
    state = apply_version(state, delta, K)
    assert {pid: p.last_version for pid, p in state.producers.items()} == {"a": 3, "b": 2}
    assert decode_snapshot(encode(state), snapshot_key(3)).producers["b"].last_version == 2


def test_a_closed_producer_leaves_and_a_claim_of_the_same_id_brings_it_back():
    """Producers that finished kept counting for max_lag's shares (64 versions after their
    last commit). ``Producer.close`` records that it left; a restart claims again."""
    state, a = claim(LogState(), "a", "ia")
    state, b = claim(state, "b", "ib")
    state = apply_version(state, build_commit(state, "b", b, [tgb("b", 1, 0)], committed_at=1.0), K)
    leave = build_leave(state, "b", b, committed_at=2.0)
    assert leave is not None and leave.producers == {"b": ProducerState(1, 1, "ib", left=True)}  # its offset kept
    state = apply_version(state, leave, K)
    assert state.producers["b"].left and active_producers(state, "a") == ["a"]
    assert build_leave(state, "b", b, committed_at=3.0) is None  # recorded already (an earlier attempt landed)
    state, b2 = claim(state, "b", "ib2")
    assert not b2.left and b2.epoch == 2 and active_producers(state, "a") == ["a", "b"]
    assert build_leave(state, "b", b, committed_at=4.0) is None  # fenced: the newer incarnation counts
    ended = apply_version(state, build_end_of_stream(state, 5.0), K)
    assert build_leave(ended, "b", b2, committed_at=6.0) is None  # nobody appends after the end


def test_a_log_older_than_leaving_decodes_with_nobody_left():
    """Versions and snapshots written before ``left`` existed decode as they always did."""
    old = (
        b'{"format":"batchweave.log/1","version":1,"first_step":0,"tgbs":[],'
        b'"producers":{"p":{"offset":0,"epoch":1,"incarnation":"i"}}}'
    )
    assert decode_version(old, K, 1).producers["p"].left is False
    snapshot = (
        b'{"format":"batchweave.snapshot/1","version":1,'
        b'"producers":{"p":{"offset":0,"epoch":1,"incarnation":"i","last_version":1}}}'
    )
    assert decode_snapshot(snapshot, snapshot_key(1)).producers["p"] == ProducerState(0, 1, "i", last_version=1)


# -- encode / decode -------------------------------------------------------------------


def test_encode_decode_version_roundtrip():
    state, me = claim(LogState(), "p", "i")
    d = build_commit(state, "p", me, [tgb("p", 1, 0, dp=2, cp=2), tgb("p", 1, 1, dp=2, cp=2)], committed_at=12.5)
    raw = encode(d)
    parsed = versiontext.loads(raw)
    assert parsed["format"] == LOG_FORMAT and parsed["version"] == 2
    back = decode_version(raw, version_key(2), expected_version=2)
    assert back == d
    assert back.tgbs[1].slices[3] == (0, 300, 100, 1237)


# Log versions exactly as the log has always written them: the structs may be arranged
# differently in code (LogVersion and LogVersionHead share their fields), never on the wire.
_RECORDED_TGB = TGBDescriptor(
    "p", 2, 5, 2, 1, "arrays", ["data/p/e000002/000000000005-ab.0.bwb"], [(0, 0, 10, 1), (0, 10, 12, 2)], 22
)
RECORDED_VERSIONS = {
    "commit": (
        LogVersion(LOG_FORMAT_1, 7, 5, [_RECORDED_TGB], {"p": ProducerState(6, 2, "i", {"x": 1.0})}, committed_at=2.25),
        b'{"format":"batchweave.log/1","version":7,"first_step":5,"tgbs":[{"producer":"p","epoch":2,"source_offset":5,'
        b'"dp":2,"cp":1,"kind":"arrays","objects":["data/p/e000002/000000000005-ab.0.bwb"],"slices":[[0,0,10,1],'
        b'[0,10,12,2]],"nbytes":22}],"producers":{"p":{"offset":6,"epoch":2,"incarnation":"i","metrics":{"x":1.0}}},'
        b'"committed_at":2.25}',
    ),
    "a producer that left": (
        LogVersion(LOG_FORMAT_1, 8, 6, [], {"p": ProducerState(6, 2, "i", {"x": 1.0}, left=True)}, committed_at=2.5),
        b'{"format":"batchweave.log/1","version":8,"first_step":6,"tgbs":[],"producers":{"p":{"offset":6,"epoch":2,'
        b'"incarnation":"i","metrics":{"x":1.0},"left":true}},"committed_at":2.5}',
    ),
    "first, every optional field": (
        LogVersion(
            LOG_FORMAT_1, 1, 0, [], {"p": ProducerState(0, 1, "i")}, True, 0.5, Reclaim(0, 0, 0), "ns", Layout(2, 1)
        ),
        b'{"format":"batchweave.log/1","version":1,"first_step":0,"tgbs":[],"producers":{"p":{"offset":0,"epoch":1,'
        b'"incarnation":"i"}},"end_of_stream":true,"committed_at":0.5,"reclaim":{"steps":0,"versions":0,"bytes":0},'
        b'"namespace":"ns","layout":{"dp":2,"cp":1}}',
    ),
}


@pytest.mark.parametrize("name", list(RECORDED_VERSIONS))
def test_versions_encode_to_the_recorded_bytes_and_decode_from_them(name):
    version, recorded = RECORDED_VERSIONS[name]
    assert encode(version) == recorded
    assert decode_version(recorded, K, version.version) == version
    heads = [TGBHead(t.producer, t.epoch, t.source_offset, t.dp, t.cp, t.kind, t.nbytes) for t in version.tgbs]
    expected = LogVersionHead(**(msgspec.structs.asdict(version) | {"tgbs": heads}))
    assert decode_version_head(recorded, K, version.version) == expected


# The same commit as format 2 writes it: a head (every field; each TGB a row of whose it is
# and its bytes) that a writer decodes alone, then the body (each TGB's objects and slices)
# that the head names by its digest, after the head's length.
RECORDED_HEAD = (
    b'{"format":"batchweave.log/2","version":7,"first_step":5,"tgbs":[["p",2,5,2,1,"arrays",22,""]],'
    b'"producers":{"p":{"offset":6,"epoch":2,"incarnation":"i","metrics":{"x":1.0}}},"committed_at":2.25,'
    b'"body":"faa38e21f596143d61480c61ee870336"}'
)
RECORDED_BODY = b'[[["data/p/e000002/000000000005-ab.0.bwb"],[[0,0,10,1],[0,10,12,2]]]]'


def test_a_version_encodes_to_the_recorded_head_and_body_and_decodes_from_them():
    recorded_version = RECORDED_VERSIONS["commit"][0]
    version = msgspec.structs.replace(recorded_version, format=LOG_FORMAT_2)
    recorded = b"[%d,%s,%s]" % (len(RECORDED_HEAD), RECORDED_HEAD, RECORDED_BODY)
    assert encode(version) == recorded
    assert decode_version(recorded, K, 7) == version
    head = decode_version_head(recorded, K, 7)
    assert head.body == hashlib.blake2b(RECORDED_BODY, digest_size=16).hexdigest()
    assert head == msgspec.structs.replace(
        decode_version_head(RECORDED_VERSIONS["commit"][1], K, 7), format=LOG_FORMAT_2, body=head.body
    )
    # The proof's anchor is the head's digest: the head binds the body.
    assert digest(recorded) == hashlib.blake2b(RECORDED_HEAD, digest_size=16).hexdigest()
    assert (
        digest(RECORDED_VERSIONS["commit"][1])
        == hashlib.blake2b(RECORDED_VERSIONS["commit"][1], digest_size=16).hexdigest()
    )


def test_a_writer_decodes_a_versions_head_only():
    recorded = b"[%d,%s,%s]" % (len(RECORDED_HEAD), RECORDED_HEAD, b"[[not even JSON")
    assert decode_version_head(recorded, K, 7).tgbs[0].nbytes == 22
    with pytest.raises(CorruptDataError, match="body is not the one its head names"):
        decode_version(recorded, K, 7)


@pytest.mark.parametrize(
    "damage",
    [
        lambda head, body: b"[%d,%s,%s]" % (len(head) + 1, head, body),  # a length that does not fit
        lambda head, body: b"[%d,%s,%s" % (len(head), head, body),  # cut short
        lambda head, body: b"[%d,%s,%s]" % (len(head), head.replace(b'"body":"f', b'"body":"0'), body),
        lambda head, body: b"[%d,%s,%s]" % (len(head), head, body.replace(b"[0,0,10,1]", b"[0,0,10,9]")),
    ],
)
def test_a_damaged_version_of_format_2_is_refused_naming_its_key(damage):
    with pytest.raises(CorruptDataError) as info:
        decode_version(damage(RECORDED_HEAD, RECORDED_BODY), "_log/v.json", 7)
    assert "_log/v.json" in str(info.value)


# Format 3: the head has a row per run of one producer's consecutive TGBs (here p@5 and p@6,
# 22 + 30 bytes, then q@0), [producer, epoch, first offset, dp, cp, kind, bytes, schema,
# TGBs]; the body has each TGB's objects, slices and own size.
_RUN = [
    _RECORDED_TGB,
    msgspec.structs.replace(
        _RECORDED_TGB, source_offset=6, objects=["data/p/e000002/000000000006-ab.0.bwb"], nbytes=30
    ),
    msgspec.structs.replace(
        _RECORDED_TGB, producer="q", epoch=1, source_offset=0, objects=["data/q/e000001/0-ab.0.bwb"]
    ),
]
RECORDED_RUN_VERSION = LogVersion(
    LOG_FORMAT, 7, 5, _RUN, {"p": ProducerState(7, 2, "i"), "q": ProducerState(1, 1, "j")}, committed_at=2.25
)
RECORDED_RUN_HEAD = (
    b'{"format":"batchweave.log/3","version":7,"first_step":5,"tgbs":[["p",2,5,2,1,"arrays",52,"",2],'
    b'["q",1,0,2,1,"arrays",22,"",1]],"producers":{"p":{"offset":7,"epoch":2,"incarnation":"i"},'
    b'"q":{"offset":1,"epoch":1,"incarnation":"j"}},"committed_at":2.25,"body":"BODY"}'
)
RECORDED_RUN_BODY = (
    b'[[["data/p/e000002/000000000005-ab.0.bwb"],[[0,0,10,1],[0,10,12,2]],22],'
    b'[["data/p/e000002/000000000006-ab.0.bwb"],[[0,0,10,1],[0,10,12,2]],30],'
    b'[["data/q/e000001/0-ab.0.bwb"],[[0,0,10,1],[0,10,12,2]],22]]'
)


def _framed(head: bytes, body: bytes) -> bytes:
    head = head.replace(b"BODY", hashlib.blake2b(body, digest_size=16).hexdigest().encode())
    return b"[%d,%s,%s]" % (len(head), head, body)


def test_a_version_of_format_3_encodes_a_row_per_run_and_decodes_whole():
    recorded = _framed(RECORDED_RUN_HEAD, RECORDED_RUN_BODY)
    assert encode(RECORDED_RUN_VERSION) == recorded
    assert decode_version(recorded, K, 7) == RECORDED_RUN_VERSION
    head = decode_version_head(recorded, K, 7)
    assert [(r.producer, r.source_offset, r.count, r.nbytes) for r in head.tgbs] == [("p", 5, 2, 52), ("q", 0, 1, 22)]
    assert head.tgb_count() == 3 and list(head.steps()) == [5, 6, 7]
    fields = versiontext.loads(recorded)
    located = [(t["producer"], t["source_offset"], t["nbytes"]) for t in fields["tgbs"]]
    assert located == [("p", 5, 22), ("p", 6, 30), ("q", 0, 22)]
    assert decode_version(versiontext.dumps(fields), K, 7) == RECORDED_RUN_VERSION  # a TGB a row: valid too
    # A writer and a reader following the same versions reach the same state.
    state = LogState(version=6, steps=5, producers={"p": ProducerState(5, 2, "i"), "q": ProducerState(0, 1, "j")})
    assert apply_version(state, head, K) == apply_version(state, decode_version(recorded, K, 7), K)


def test_a_versions_bytes_through_its_head_are_all_a_writer_needs():
    recorded = _framed(RECORDED_RUN_HEAD, RECORDED_RUN_BODY)
    extent = head_extent(recorded[:14])  # its first bytes say where the head ends
    assert extent is not None and head_extent(recorded) == extent
    prefix = recorded[:extent]
    assert recorded[extent:] == RECORDED_RUN_BODY + b"]"
    assert digest(prefix) == digest(recorded)  # the anchor a proof compares
    assert decode_version_head(prefix, K, 7) == decode_version_head(recorded, K, 7)
    with pytest.raises(CorruptDataError, match="body is not the one its head names"):
        decode_version(prefix, K, 7)  # a reader needs the body: a head alone is refused
    with pytest.raises(CorruptDataError, match=K):
        decode_version_head(prefix[:-1], K, 7)  # a head cut short
    assert head_extent(encode(msgspec.structs.replace(RECORDED_RUN_VERSION, format=LOG_FORMAT_1))) is None


def test_runs_break_where_a_tgb_does_not_continue_the_one_before():
    a = [tgb("a", 1, i) for i in range(3)]
    b = [tgb("b", 1, 0), tgb("b", 1, 2), tgb("b", 2, 3), tgb("b", 2, 4, dp=2)]
    rows = runs([*a, *b])
    assert [(r.producer, r.epoch, r.source_offset, r.count, r.nbytes) for r in rows] == [
        ("a", 1, 0, 3, 30),
        ("b", 1, 0, 1, 10),  # then a gap
        ("b", 1, 2, 1, 10),  # then another epoch
        ("b", 2, 3, 1, 10),  # then another layout
        ("b", 2, 4, 1, 10),
    ]


@pytest.mark.parametrize(
    ("head", "body", "problem"),
    [
        (RECORDED_RUN_HEAD.replace(b'52,"",2]', b'52,"",3]'), RECORDED_RUN_BODY, "4 TGBs in its head, 3 in its body"),
        (RECORDED_RUN_HEAD.replace(b'22,"",1]', b'22,"",0]'), RECORDED_RUN_BODY, "a row of 0 TGBs"),
        (RECORDED_RUN_HEAD.replace(b",52,", b",53,"), RECORDED_RUN_BODY, "make 53 bytes in its head"),
        (RECORDED_RUN_HEAD, RECORDED_RUN_BODY.replace(b"]],30]", b"]],-8]"), "make 52 bytes in its head"),
        (RECORDED_RUN_HEAD.replace(b"log/3", b"log/2"), RECORDED_RUN_BODY, "a row of 2 TGBs"),
        (RECORDED_HEAD.replace(b"faa38e21f596143d61480c61ee870336", b"BODY"), RECORDED_BODY[:-2] + b",22]]", "sizes"),
    ],
)
def test_a_damaged_version_of_format_3_is_refused_naming_its_key(head, body, problem):
    with pytest.raises(CorruptDataError, match=problem) as info:
        decode_version(_framed(head, body), "_log/v.json", 7)
    assert "_log/v.json" in str(info.value)


def test_encode_decode_snapshot_roundtrip():
    state, me = claim(LogState(), "p", "i")
    state = apply_version(state, build_commit(state, "p", me, [tgb("p", 1, 0)], 0.0), K)
    back = decode_snapshot(encode(state), snapshot_key(state.version))
    assert back == state
    assert back.format == SNAPSHOT_FORMAT


def test_decode_snapshot_errors():
    with pytest.raises(CorruptDataError):
        decode_snapshot(b"{nope", "s")
    bad = json.loads(encode(LogState()))
    bad["format"] = "batchweave.snapshot/9"
    with pytest.raises(CorruptDataError, match="format"):
        decode_snapshot(json.dumps(bad).encode(), "s")


def _good_version_dict() -> dict:
    state, me = claim(LogState(), "p", "i")
    return versiontext.loads(encode(build_commit(state, "p", me, [tgb("p", 1, 0)], 0.0)))


def test_decode_unknown_format():
    d = _good_version_dict()
    d["format"] = "batchweave.log/4"
    with pytest.raises(CorruptDataError, match="format") as info:
        decode_version(versiontext.dumps(d), "_log/x.json", 2)
    assert "_log/x.json" in str(info.value)


def test_decode_wrong_version_number():
    raw = versiontext.dumps(_good_version_dict())
    with pytest.raises(CorruptDataError) as info:
        decode_version(raw, "_log/v3.json", 3)
    assert "2" in str(info.value) and "3" in str(info.value)


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"null", b"[]", b'{"format": "batchweave.log/1"}', b"\xff\xfe", b'{"format": 1}'],
)
def test_decode_damaged_json(raw):
    with pytest.raises(CorruptDataError) as info:
        decode_version(raw, "_log/k.json", 1)
    assert "_log/k.json" in str(info.value)


def test_decode_rejects_unknown_fields():
    d = _good_version_dict()
    d["surprise"] = True
    with pytest.raises(CorruptDataError):
        decode_version(versiontext.dumps(d), K, 2)
    d = _good_version_dict()
    d["tgbs"][0]["pickle"] = "x"
    with pytest.raises(CorruptDataError):
        decode_version(versiontext.dumps(d), K, 2)


@pytest.mark.parametrize(
    "bad_key",
    [
        "../x",
        "/etc/passwd",
        "_log/00000000000000000001.json",
        "data/../x",
        "data/p/../../_log/y",
        "data/p/..",
        "data",
        "data/",
        "data/x",  # needs at least producer/object
        "data//x",
        "s3://bucket/data/p/x",
        "data/p/x y",
        "DATA/p/x",
        "",
    ],
)
def test_decode_rejects_keys_outside_data(bad_key):
    d = _good_version_dict()
    d["tgbs"][0]["objects"] = [bad_key]
    with pytest.raises(CorruptDataError) as info:
        decode_version(versiontext.dumps(d), "_log/v.json", 2)
    assert "_log/v.json" in str(info.value)
    with pytest.raises(CorruptDataError):
        check_data_key(bad_key, "where")


def test_decode_rejects_one_bad_key_among_good():
    d = _good_version_dict()
    d["tgbs"][0]["objects"] = ["data/p/e1/0.0.bwb", "../escape"]
    d["tgbs"][0]["slices"] = [[1, 0, 10, 0]]
    with pytest.raises(CorruptDataError):
        decode_version(versiontext.dumps(d), K, 2)


@pytest.mark.parametrize("good", ["data/p/e000001/000000000000-ab.0.bwb", "data/a.b_c-d/x"])
def test_check_data_key_accepts_data_keys(good):
    assert check_data_key(good, "w") == good


def test_check_data_key_rejects_trailing_newline():
    with pytest.raises(CorruptDataError):
        check_data_key("data/p/e1/0-x.0.bwb\n", "w")


def test_data_key_round_trips_through_parse_data_key():
    key = data_key("prep-0", 3, 41, "0a1b2c3d", 2)
    assert key == "data/prep-0/e000003/000000000041-0a1b2c3d.2.bwb"
    assert check_data_key(key, "w") == key
    assert parse_data_key(key) == DataKey("prep-0", 3, 41)


@pytest.mark.parametrize(
    "other",
    [
        "data/p/e1/0.0.bwb",  # no token
        "data/p/e1/0-x.0.bwb",  # token not hex
        "data/p/1/0-ab.0.bwb",  # no "e"
        "data/p/e1/0-ab.0.bwb.tmp",
        "data/p/q/e1/0-ab.0.bwb",  # producer ids have no "/"
        "_log/00000000000000000001.json",
        "data/p/e1/0-ab.0.bwb\n",
    ],
)
def test_parse_data_key_is_none_for_other_keys(other):
    assert parse_data_key(other) is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t.update(slices=[]),  # slice count != dp*cp
        lambda t: t.update(dp=0, slices=[]),
        lambda t: t.update(objects=[]),
        lambda t: t.update(slices=[[1, 0, 100, 0]]),  # object index out of range
        lambda t: t.update(slices=[[0, -1, 100, 0]]),
        lambda t: t.update(slices=[[0, 0, -100, 0]]),
    ],
    ids=["count", "dp0", "noobjects", "objindex", "negoffset", "neglength"],
)
def test_decode_rejects_bad_descriptors(mutate):
    d = _good_version_dict()
    mutate(d["tgbs"][0])
    with pytest.raises(CorruptDataError):
        decode_version(versiontext.dumps(d), K, 2)


# -- producer ids ----------------------------------------------------------------------


@pytest.mark.parametrize("good", ["p", "worker-0", "a.b_c", "X" * 128, "0abc"])
def test_producer_id_ok(good):
    assert check_producer_id(good) == good


@pytest.mark.parametrize("bad", ["", "-p", ".hidden", "a/b", "..", "X" * 129, "a b", 5, None])
def test_producer_id_rejected(bad):
    with pytest.raises(ConfigError):
        check_producer_id(bad)


def test_producer_id_rejects_trailing_newline():
    with pytest.raises(ConfigError):
        check_producer_id("p\n")


# -- apply validation ------------------------------------------------------------------


def _state_with_a() -> tuple[LogState, ProducerState]:
    state, a = claim(LogState(), "a", "ia")
    state = apply_version(state, build_commit(state, "a", a, [tgb("a", 1, 0), tgb("a", 1, 1)], 0.0), K)
    return state, a  # version 2, steps 2, a.offset 2


def test_version_gap():
    state, a = _state_with_a()
    for v in (state.version, state.version + 2, 0):
        with pytest.raises(CorruptDataError, match="version"):
            apply_version(state, version(v, state.steps), K)


def test_first_step_mismatch():
    state, a = _state_with_a()
    for fs in (0, 1, 3):
        with pytest.raises(CorruptDataError, match="step") as info:
            apply_version(state, version(3, fs, [tgb("a", 1, 2)], {"a": ProducerState(3, 1, "ia")}), "_log/3")
        assert "_log/3" in str(info.value)


def test_tgbs_after_end_of_stream():
    state, a = _state_with_a()
    state = apply_version(state, build_end_of_stream(state, 0.0), K)
    d = build_commit(state, "a", a, [tgb("a", 1, 2)], 0.0)
    with pytest.raises(CorruptDataError, match="end-of-stream"):
        apply_version(state, d, K)
    # End of stream is sticky even if a later version says False.
    state2 = apply_version(state, version(state.version + 1, state.steps), K)
    assert state2.end_of_stream


def test_tgbs_in_the_same_version_as_end_of_stream_are_fine():
    state, a = _state_with_a()
    d = version(3, 2, [tgb("a", 1, 2)], {"a": ProducerState(3, 1, "ia")}, end=True)
    state = apply_version(state, d, K)
    assert state.end_of_stream and state.steps == 3


def test_offset_going_backwards():
    state, a = _state_with_a()
    # TGB below the committed offset.
    with pytest.raises(CorruptDataError):
        apply_version(state, version(3, 2, [tgb("a", 1, 1)], {"a": ProducerState(2, 1, "ia")}), K)
    # Producer state moving back without TGBs.
    with pytest.raises(CorruptDataError, match="goes back"):
        apply_version(state, version(3, 2, [], {"a": ProducerState(1, 1, "ia")}), K)
    # Epoch moving back (a zombie's state).
    with pytest.raises(CorruptDataError, match="goes back"):
        apply_version(state, version(3, 2, [], {"a": ProducerState(2, 0, "old")}), K)


def test_an_epoch_never_passes_to_another_incarnation():
    """I3: an epoch is one incarnation's. A version that re-gives epoch 1 to another (a
    claim ticket the log had passed, folded by mistake) would let both commit."""
    state, a = _state_with_a()
    with pytest.raises(CorruptDataError, match="passes from ia to other"):
        apply_version(state, version(3, 2, [], {"a": ProducerState(2, 1, "other")}), K)
    assert apply_version(state, version(3, 2, [], {"a": ProducerState(2, 2, "other")}), K).producers["a"].epoch == 2


def test_repeated_offset():
    state, a = _state_with_a()
    # Same offset as an already committed TGB.
    with pytest.raises(CorruptDataError, match="repeats"):
        apply_version(state, version(3, 2, [tgb("a", 1, 0)], {"a": ProducerState(2, 1, "ia")}), K)
    # Same offset twice inside one version.
    with pytest.raises(CorruptDataError, match="repeats"):
        apply_version(state, version(3, 2, [tgb("a", 1, 2), tgb("a", 1, 2)], {"a": ProducerState(3, 1, "ia")}), K)
    # Decreasing inside one version.
    with pytest.raises(CorruptDataError):
        apply_version(state, version(3, 2, [tgb("a", 1, 3), tgb("a", 1, 2)], {"a": ProducerState(4, 1, "ia")}), K)


def test_skipped_offset():
    state, _ = _state_with_a()  # producer a has committed offsets 0 and 1
    with pytest.raises(CorruptDataError, match="skips offsets from 2"):
        apply_version(state, version(3, 2, [tgb("a", 1, 3)], {"a": ProducerState(4, 1, "ia")}), K)


def test_recorded_offset_must_match_tgbs():
    state, a = _state_with_a()
    with pytest.raises(CorruptDataError, match="records offset"):
        apply_version(state, version(3, 2, [tgb("a", 1, 2)], {"a": ProducerState(5, 1, "ia")}), K)


def test_tgb_epoch_mismatch():
    state, a = _state_with_a()
    with pytest.raises(CorruptDataError, match="epoch"):
        apply_version(state, version(3, 2, [tgb("a", 2, 2)], {"a": ProducerState(3, 1, "ia")}), K)
    # A TGB with no producer state in the delta.
    with pytest.raises(CorruptDataError):
        apply_version(state, version(3, 2, [tgb("a", 1, 2)], {}), K)
    # A TGB of b riding on a's state.
    with pytest.raises(CorruptDataError):
        apply_version(state, version(3, 2, [tgb("b", 1, 0)], {"a": ProducerState(2, 1, "ia")}), K)


# -- rebase ----------------------------------------------------------------------------


def test_rebase_returns_remainder_when_nothing_changed():
    state, me = claim(LogState(), "p", "i")
    pending = [tgb("p", 1, 0), tgb("p", 1, 1)]
    assert pending_after_rebase(state, "p", me, pending) == pending


def test_rebase_unknown_producer_keeps_everything():
    pending = [tgb("p", 0, 0)]
    assert pending_after_rebase(LogState(), "p", ProducerState(0, 0, "i"), pending) == pending


def test_rebase_drops_what_an_ambiguous_commit_applied():
    state, me = claim(LogState(), "p", "i")
    pending = [tgb("p", 1, 0), tgb("p", 1, 1)]
    # The store applied our commit of offsets 0,1 but we saw a timeout and kept appending.
    state = apply_version(state, build_commit(state, "p", me, pending, 0.0), K)
    pending = pending + [tgb("p", 1, 2), tgb("p", 1, 3)]
    rest = pending_after_rebase(state, "p", me, pending)
    assert [t.source_offset for t in rest] == [2, 3]
    # Commit of the remainder applies cleanly after the rebase.
    state = apply_version(state, build_commit(state, "p", me, rest, 0.0), K)
    assert state.producers["p"].offset == 4 and state.steps == 4


def test_rebase_partial_overlap_and_other_producers_commits():
    state, p = claim(LogState(), "p", "ip")
    state, q = claim(state, "q", "iq")
    state = apply_version(state, build_commit(state, "q", q, [tgb("q", 1, 0)], 0.0), K)
    pending = [tgb("p", 1, 0), tgb("p", 1, 1)]
    assert pending_after_rebase(state, "p", p, pending) == pending  # q's commit is not ours
    state = apply_version(state, build_commit(state, "p", p, pending[:1], 0.0), K)
    assert [t.source_offset for t in pending_after_rebase(state, "p", p, pending)] == [1]


def test_rebase_fenced_by_newer_incarnation():
    state, old = claim(LogState(), "p", "old")
    state, new = claim(state, "p", "new")
    assert new.epoch == old.epoch + 1
    with pytest.raises(ProducerFencedError) as info:
        pending_after_rebase(state, "p", old, [tgb("p", old.epoch, 0)])
    assert "p" in str(info.value) and str(new.epoch) in str(info.value)
    # Fenced even with nothing pending: the process must stop.
    with pytest.raises(ProducerFencedError):
        pending_after_rebase(state, "p", old, [])
    # The new incarnation is not fenced.
    assert pending_after_rebase(state, "p", new, []) == []


def test_rebase_fenced_by_equal_epoch_of_other_incarnation():
    state = LogState(version=3, producers={"p": ProducerState(4, 2, "rival")})
    with pytest.raises(ProducerFencedError):
        pending_after_rebase(state, "p", ProducerState(4, 2, "me"), [tgb("p", 2, 4)])


def test_rebase_not_fenced_by_older_epoch_of_other_incarnation():
    state = LogState(version=3, producers={"p": ProducerState(4, 1, "older")})
    pending = [tgb("p", 2, 4)]
    assert pending_after_rebase(state, "p", ProducerState(4, 2, "me"), pending) == pending


def test_rebase_stream_ended():
    state, me = claim(LogState(), "p", "i")
    state = apply_version(state, build_end_of_stream(state, 0.0), K)
    with pytest.raises(StreamEndedError) as info:
        pending_after_rebase(state, "p", me, [tgb("p", 1, 0), tgb("p", 1, 1)])
    assert "2" in str(info.value)
    # Nothing left to commit: no error.
    assert pending_after_rebase(state, "p", me, []) == []


def test_rebase_stream_ended_but_everything_already_committed():
    state, me = claim(LogState(), "p", "i")
    pending = [tgb("p", 1, 0)]
    state = apply_version(state, build_commit(state, "p", me, pending, 0.0), K)
    state = apply_version(state, build_end_of_stream(state, 0.0), K)
    assert pending_after_rebase(state, "p", me, pending) == []


# -- model-based property: interleavings of producers -----------------------------------

PRODUCERS = ["p0", "p1", "p2"]


_KINDS = ["append"] * 9 + ["commit"] * 8 + ["start"] * 2 + ["end"]
# (kind, producer index, which handle: 0 = newest incarnation, k > 0 = k-th older one if any, ambiguous outcome)
_op = st.tuples(
    st.sampled_from(_KINDS),
    st.integers(0, 2),
    st.sampled_from([0, 0, 0, 1, 2]),
    st.booleans(),
)


class _Handle:
    def __init__(self, pid: str, incarnation: str, me: ProducerState) -> None:
        self.pid = pid
        self.me = me
        self.next_offset = me.offset
        self.pending: list[TGBDescriptor] = []


def _pick(hs: list[_Handle], back: int) -> _Handle:
    return hs[max(0, len(hs) - 1 - back)]


@settings(max_examples=150, deadline=None)
@given(st.lists(_op, min_size=5, max_size=60))
def test_property_interleaved_producers_keep_offsets_and_steps_dense(ops):
    state = LogState()
    handles: dict[str, list[_Handle]] = {pid: [] for pid in PRODUCERS}
    committed: list[TGBDescriptor] = []  # in step order
    deltas: list[LogVersion] = []
    counter = 0
    ops = [("start", i, 0, False) for i in range(len(PRODUCERS))] + ops

    def apply(delta: LogVersion) -> None:
        nonlocal state
        assert delta.first_step == len(committed)
        state = apply_version(state, delta, version_key(delta.version))
        committed.extend(delta.tgbs)
        deltas.append(delta)

    for op in ops:
        kind = op[0]
        if kind == "start":
            pid = PRODUCERS[op[1]]
            counter += 1
            delta = build_claim(state, pid, f"inc{counter}", committed_at=float(counter))
            apply(delta)
            handles[pid].append(_Handle(pid, f"inc{counter}", state.producers[pid]))
        elif kind == "append":
            pid = PRODUCERS[op[1]]
            if not handles[pid]:
                continue
            h = _pick(handles[pid], op[2])
            h.pending.append(tgb(pid, h.me.epoch, h.next_offset))
            h.next_offset += 1
        elif kind == "commit":
            pid = PRODUCERS[op[1]]
            if not handles[pid]:
                continue
            h = _pick(handles[pid], op[2])
            ambiguous = op[3]
            newest = h is handles[pid][-1]
            try:
                rest = pending_after_rebase(state, pid, h.me, h.pending)
            except ProducerFencedError:
                event("zombie fenced")
                assert not newest, "the newest incarnation must never be fenced"
                # A zombie that skipped the rebase is still stopped by the log's own rules.
                if h.pending:
                    with pytest.raises(CorruptDataError):
                        apply_version(state, build_commit(state, pid, h.me, h.pending, 0.0), "zombie")
                continue
            except StreamEndedError:
                assert state.end_of_stream
                continue
            assert newest, "an older incarnation got past the fence"
            if len(rest) < len(h.pending):
                event("rebase dropped an ambiguous commit's TGBs")
            if not rest:
                h.pending = []
                continue
            event("committed")
            apply(build_commit(state, pid, h.me, rest, committed_at=0.0))
            if not ambiguous:
                h.pending = []
            # Ambiguous: the write landed but the producer did not learn it; it keeps its pending list.
        else:
            apply(build_end_of_stream(state, committed_at=0.0))

    assert state.steps == len(committed)
    for pid in PRODUCERS:
        offsets = [t.source_offset for t in committed if t.producer == pid]
        assert offsets == list(range(len(offsets))), f"{pid}: {offsets}"
        if offsets:
            assert state.producers[pid].offset == offsets[-1] + 1
        # Each TGB was committed under the epoch that was current for its producer at the time;
        # epochs never go back along the step sequence.
        epochs = [t.epoch for t in committed if t.producer == pid]
        assert epochs == sorted(epochs)
    assert state.bytes == sum(t.nbytes for t in committed)
    # Replaying the recorded deltas (through their wire form) from scratch gives the same state.
    replay = LogState()
    for delta in deltas:
        replay = apply_version(replay, decode_version(encode(delta), "r", delta.version), "r")
    assert replay == state


def _refusals() -> list[tuple[str, LogState, LogVersion, str]]:
    """(what, state, version, the exact problem) for each rule apply_version enforces."""
    state, a = _state_with_a()  # version 2, steps 2, a.offset 2, layout dp=1 cp=1
    ended = apply_version(state, build_end_of_stream(state, 0.0), K)
    after_end = build_commit(ended, "a", a, [tgb("a", 1, 2)], 0.0)
    back = ProducerState(1, 1, "ia")
    reclaim = Reclaim(steps=state.steps + 1, versions=1, bytes=0)
    return [
        ("gap", state, version(5, state.steps), "version 5 does not follow 2"),
        ("after the end", ended, after_end, "commits TGBs after the end-of-stream marker"),
        (
            "namespace",
            state,
            msgspec.structs.replace(version(3, 2), namespace="another"),
            "names namespace 'another', but only version 1 may",
        ),
        (
            "goes back",
            state,
            version(3, 2, [], {"a": back}),
            f"producer 'a' goes back from {state.producers['a']} to {back}",
        ),
        (
            "epoch passes",
            state,
            version(3, 2, [], {"a": ProducerState(2, 1, "other")}),
            "producer 'a' epoch 1 passes from ia to other",
        ),
        (
            "reclaim",
            state,
            msgspec.structs.replace(version(3, 2), reclaim=reclaim),
            f"reclaim {reclaim} goes back from {state.reclaimed} or past the log",
        ),
        (
            "repeats",
            state,
            version(3, 2, [tgb("a", 1, 1)], {"a": ProducerState(2, 1, "ia")}),
            "TGB a@1 repeats an offset already committed",
        ),
        (
            "layout",
            state,
            msgspec.structs.replace(version(3, 2), layout=Layout(2, 1)),
            f"sets layout {Layout(2, 1).describe()}, the namespace has {state.layout.describe()}",
        ),
    ]


@pytest.mark.parametrize("refusal", _refusals(), ids=lambda refusal: refusal[0])
def test_every_refusal_names_the_versions_key_and_says_exactly_what_is_wrong(refusal):
    _, state, delta, problem = refusal
    with pytest.raises(CorruptDataError) as raised:
        apply_version(state, delta, K)
    assert raised.value.key == K and str(raised.value) == f"{K}: {problem}"


def test_a_reclaim_of_every_step_so_far_is_accepted():
    state, _ = _state_with_a()
    everything = Reclaim(steps=state.steps, versions=state.version, bytes=0)
    after = apply_version(state, msgspec.structs.replace(version(3, 2), reclaim=everything), K)
    assert after.reclaimed == everything


# -- what a writer learns from the head alone (``jump_to``) -------------------------------


def _log_of(commits: int):
    """Claims of a and b, then ``commits`` one-TGB commits alternating b, a, b, ...: the
    states after each version, and the versions."""
    state, states, versions = LogState(), [LogState()], []
    for pid in ("a", "b"):
        delta = build_claim(state, pid, f"{pid}-1", 1.0, Layout(1, 1))
        versions.append(delta)
        state = apply_version(state, delta, version_key(delta.version), f"d{delta.version}")
        states.append(state)
    for i in range(commits):
        pid = "ba"[i % 2]
        me = state.producers[pid]
        delta = build_commit(state, pid, me, [tgb(pid, 1, me.offset)], 1.0)
        versions.append(delta)
        state = apply_version(state, delta, version_key(delta.version), f"d{delta.version}")
        states.append(state)
    return states, versions


def test_every_version_says_the_bytes_and_where_the_log_last_changed():
    states, versions = _log_of(4)
    assert [v.changed_at for v in versions] == [1, 2, 3, 3, 3, 3]  # the claims, and the first TGB (its kind)
    assert [v.bytes for v in versions] == [0, 0, 10, 20, 30, 40]
    assert states[-1].changed_at == 3 and states[-1].bytes == 40


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("changed_at", 2, "says the log last changed at version 2, it did at 3"),
        ("changed_at", 5, "says the log last changed at version 5, it did at 3"),
        ("bytes", 41, "says 41 bytes are committed, its TGBs make 30"),
    ],
)
def test_a_version_whose_cumulative_fields_do_not_follow_is_refused(field, value, problem):
    states, versions = _log_of(3)
    wrong = msgspec.structs.replace(versions[-1], **{field: value})
    with pytest.raises(CorruptDataError, match=problem):
        apply_version(states[-2], wrong, K)


def test_a_log_older_than_the_fields_is_unknown_until_a_version_vouches_again():
    states, versions = _log_of(2)
    old = msgspec.structs.replace(versions[-1], changed_at=None, bytes=None)
    unknown = apply_version(states[-2], old, K)
    assert unknown.changed_at is None and unknown.bytes == states[-1].bytes  # bytes always count
    me = unknown.producers["b"]
    vouches = build_commit(unknown, "b", me, [tgb("b", 1, me.offset)], 1.0)
    assert vouches.changed_at == vouches.version  # a writer that does not know says "now"
    assert apply_version(unknown, vouches, K).changed_at == vouches.version
    # A reader that does not know takes what the writer knew (at most its own number).
    assert apply_version(msgspec.structs.replace(states[-2], changed_at=None), versions[-1], K).changed_at == 3


def test_jump_to_takes_the_head_when_nothing_a_commit_needs_changed():
    states, versions = _log_of(6)  # versions 3-8 are commits; 3 fixed the payload kind
    jumped = jump_to(states[4], versions[-1], "d8")  # from version 4 to 8: 5-7 skipped
    assert jumped is not None
    exact = states[-1]
    assert (jumped.version, jumped.steps, jumped.bytes, jumped.changed_at, jumped.digest) == (
        exact.version,
        exact.steps,
        exact.bytes,
        exact.changed_at,
        exact.digest,
    )
    assert jumped.skipped_through == 7
    assert jumped.producers["a"] == exact.producers["a"]  # the head's committer
    assert jumped.producers["b"].offset < exact.producers["b"].offset  # behind, and says so


def test_jump_to_refuses_over_a_claim_and_over_what_it_cannot_tell():
    states, versions = _log_of(2)
    state = states[-1]
    claimed = build_claim(state, "a", "a-2", 1.0)  # a restart of a: it fences a-1
    after_claim = apply_version(state, claimed, K, "dc")
    me = after_claim.producers["b"]
    head = build_commit(after_claim, "b", me, [tgb("b", 1, me.offset)], 1.0)
    assert jump_to(state, head, "dh") is None  # the claim: read every version
    assert jump_to(states[2], versions[-1], "d") is None  # over the first TGB, which fixed the kind
    old = msgspec.structs.replace(versions[-1], changed_at=None)
    assert jump_to(states[3], old, "d") is None  # a head older than the fields
    assert jump_to(states[3], msgspec.structs.replace(versions[-1], bytes=None), "d") is None


def test_a_full_read_after_a_jump_lets_a_skipped_producer_continue_where_the_log_has_it():
    states, versions = _log_of(6)
    jumped = jump_to(states[4], versions[-2], "d7")  # b's offset in it is behind
    assert jumped is not None
    me = states[-1].producers["b"]
    following = build_commit(states[-1], "b", me, [tgb("b", 1, me.offset)], 1.0)
    following = msgspec.structs.replace(following, changed_at=None)  # checked apart, below
    after = apply_version(jumped, versions[-1], K)  # a's commit: exact for a
    assert apply_version(after, following, K).producers["b"].offset == me.offset + 1
    repeat = msgspec.structs.replace(following, tgbs=[tgb("b", 1, 0)])
    with pytest.raises(CorruptDataError, match="repeats an offset"):
        apply_version(after, repeat, K)
    # Without a jump, the same skip is damage.
    exact_but_behind = msgspec.structs.replace(
        states[-1], producers={**states[-1].producers, "b": states[4].producers["b"]}
    )
    with pytest.raises(CorruptDataError, match="skips offsets"):
        apply_version(exact_but_behind, following, K)
