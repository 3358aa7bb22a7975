"""Log versions as one JSON object a test can change field by field, and back, for tests
and the simulation that write damaged or forged versions. Not used by the library.

``loads`` gives a version of either format as format 1 lays it out (every field of the
version, each TGB one object with its object keys and slices); ``dumps`` writes such an
object in format 2 (``log``), with the head's length and the body's digest made to fit
whatever the object now says, so that a change reaches the decoder's rules, not its
framing. A key the format does not know stays in the bytes: in a TGB, as one more value of
its head's row.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["dumps", "loads"]

# A TGB's fields in its head row (``log.TGBHead``) and in its body row (``log._TGBBody``).
_ROW = ("producer", "epoch", "source_offset", "dp", "cp", "kind", "nbytes", "schema")
_BODY = ("objects", "slices")


def loads(data: bytes | memoryview) -> dict[str, Any]:
    """A log version's fields, its TGBs as whole descriptors, whatever its format."""
    value = json.loads(bytes(data))
    if isinstance(value, dict):
        return value  # format 1
    _, head, body = value
    head.pop("body", None)
    head["tgbs"] = [
        dict(zip(_ROW, row, strict=False)) | dict(zip(_BODY, rest, strict=True))
        for row, rest in zip(head["tgbs"], body, strict=True)
    ]
    return head


def dumps(fields: Any) -> bytes:
    """``fields`` (as ``loads`` gives them, or changed into any JSON at all) as a version of
    format 2; what is not a version's object (or a TGB's) goes into the head as it is."""
    if not isinstance(fields, dict):
        return _frame(_compact(fields), b"[]")
    head = dict(fields)
    tgbs = head.get("tgbs")
    if not isinstance(tgbs, list) or not all(isinstance(t, dict) for t in tgbs):
        tgbs = []
    else:
        tgbs = [dict(t) for t in tgbs]
        head["tgbs"] = [[t.pop(k) for k in _ROW if k in t] + list(t.values()) for t in _drop_body(tgbs)]
    body = _compact([[t.get(k) for k in _BODY] for t in tgbs])
    head["body"] = hashlib.blake2b(body, digest_size=16).hexdigest()
    return _frame(_compact(head), body)


def _drop_body(tgbs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in t.items() if k not in _BODY} for t in tgbs]


def _frame(head: bytes, body: bytes) -> bytes:
    return b"[%d,%s,%s]" % (len(head), head, body)


def _compact(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
