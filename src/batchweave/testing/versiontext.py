"""Log versions as one JSON object a test can change field by field, and back, for tests
and the simulation that write damaged or forged versions. Not used by the library.

``loads`` gives a version of any format as format 1 lays it out (every field of the
version, each TGB one object with its object keys and slices); ``dumps`` writes such an
object in format 3 (``log``; format 2 if it says so), with the head's length and the body's digest made to fit
whatever the object now says, so that a change reaches the decoder's rules, not its
framing. A key the format does not know stays in the bytes: in a TGB, as one more value of
its head's row.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["dumps", "loads"]

# A TGB's fields in its head row (``log.TGBHead``) and in its body row (``log._TGBBody``), in
# format 2; format 3's head row adds how many TGBs it stands for, and its body row their size.
_ROW = ("producer", "epoch", "source_offset", "dp", "cp", "kind", "nbytes", "schema")
_BODY = ("objects", "slices")
_FORMAT_2 = "batchweave.log/2"


def loads(data: bytes | memoryview) -> dict[str, Any]:
    """A log version's fields, its TGBs as whole descriptors, whatever its format."""
    value = json.loads(bytes(data))
    if isinstance(value, dict):
        return value  # format 1
    _, head, body = value
    head.pop("body", None)
    tgbs: list[dict[str, Any]] = []
    for row in head["tgbs"]:
        run = dict(zip(_ROW, row, strict=False))
        for i in range(row[len(_ROW)] if len(row) > len(_ROW) else 1):
            rest = body[len(tgbs)]
            sized = {"nbytes": rest[2]} if len(rest) > 2 else {}
            located = dict(zip(_BODY, rest, strict=False))
            tgbs.append(run | {"source_offset": run["source_offset"] + i} | located | sized)
    head["tgbs"] = tgbs
    return head


def dumps(fields: Any) -> bytes:
    """``fields`` (as ``loads`` gives them, or changed into any JSON at all) as a version of
    format 3 (of format 2 if it says so), a head row per TGB; what is not a version's object
    (or a TGB's) goes into the head as it is."""
    if not isinstance(fields, dict):
        return _frame(_compact(fields), b"[]")
    head = dict(fields)
    sized = head.get("format") != _FORMAT_2
    tgbs = head.get("tgbs")
    if not isinstance(tgbs, list) or not all(isinstance(t, dict) for t in tgbs):
        tgbs = []
    else:
        tgbs = [dict(t) for t in tgbs]
        head["tgbs"] = [_head_row(t, sized) for t in tgbs]
    body = _compact([[t.get(k) for k in _BODY] + ([t.get("nbytes")] if sized else []) for t in tgbs])
    head["body"] = hashlib.blake2b(body, digest_size=16).hexdigest()
    return _frame(_compact(head), body)


def _head_row(tgb: dict[str, Any], sized: bool) -> list[Any]:
    """A TGB's head row: its row fields in order (a TGB's own in format 3), then any other key's value."""
    rest = {k: v for k, v in tgb.items() if k not in _BODY and k not in _ROW}
    row = [tgb[k] for k in _ROW if k in tgb]
    return row + ([1] if sized and len(row) == len(_ROW) else []) + list(rest.values())


def _frame(head: bytes, body: bytes) -> bytes:
    return b"[%d,%s,%s]" % (len(head), head, body)


def _compact(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
