"""What one garbage collection leaves for the next: the objects of every TGB not yet
reclaimed, as of the log version it planned from.

A collection needs, for each step not reclaimed yet, the objects its TGB is made of:
those below the new reclaim point are deleted, the rest are referenced (a data object no
version references is an orphan). Reading them from the log costs one GET per version
since the reclaim point, on every run however little changed: with no checkpoint yet,
a run at 1,601 versions read all 1,600 of them to delete nothing. So each run writes
down what it read, create-only, and the next reads that and only the versions committed
since (``batchweave.lifecycle.gc``).

    _gc/<version, 20 digits>.json    the TGBs of steps first_step... as of that version

Trusted as far as a snapshot is, and checked the same way: a summary names the version
it was read through and that version's digest, and a collection uses it only if that
version is still in the log (at or past the reclaim point, so never deleted and never
re-created) with the same digest, in the same namespace. Otherwise (gone, damaged,
another namespace's, written by a run whose view was overtaken) the collection reads the
versions as before: a bad summary costs requests, never an object. The run that writes a
newer summary deletes the older ones. Encoding and decoding here are pure.
"""

from __future__ import annotations

import msgspec

from batchweave.decoding import decoding
from batchweave.errors import CorruptDataError
from batchweave.keys import GC_PREFIX, numbered_key
from batchweave.log import digest

__all__ = [
    "GC_PREFIX",
    "SUMMARY_FORMAT",
    "GCSummary",
    "StepObjects",
    "decode_summary",
    "encode_summary",
    "summary_key",
    "summary_version",
]

SUMMARY_FORMAT = "batchweave.gc-summary/1"


class StepObjects(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One step's TGB: its bytes and the objects it is made of."""

    nbytes: int
    objects: list[str]


class GCSummary(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The TGBs of steps ``first_step``, ``first_step + 1``, ... as of log ``version``."""

    format: str
    namespace: str  # the namespace's id (version 1's): a summary copied from another one is ignored
    version: int  # read through this log version
    digest: str  # that version's digest (``log.digest`` of its bytes)
    first_step: int
    tgbs: list[StepObjects]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(GCSummary)


def summary_key(version: int) -> str:
    return f"{GC_PREFIX}{version:020d}.json"


def summary_version(key: str) -> int | None:
    """The version a summary's key names; None for any other key under ``_gc/``."""
    return numbered_key(key, "gc summary")


def encode_summary(summary: GCSummary) -> bytes:
    """The summary's JSON, then a line with its digest: a summary that decodes but names
    one wrong key would have an object deleted as an orphan, so none is taken unchecked."""
    body = _encoder.encode(summary)
    return body + b"\n" + digest(body).encode()


def decode_summary(data: bytes | memoryview, key: str) -> GCSummary:
    """The summary stored at ``key``; CorruptDataError naming it if it is not one, or
    not the one its digest line vouches for."""
    body, _, check = bytes(data).rpartition(b"\n")
    if not body or digest(body).encode() != check:
        raise CorruptDataError(key, "a garbage-collection summary whose digest does not match its bytes")
    with decoding(key, "not a garbage-collection summary"):
        summary = _decoder.decode(body)
    if summary.format != SUMMARY_FORMAT or summary_version(key) != summary.version:
        raise CorruptDataError(key, f"format {summary.format!r} for version {summary.version}, not ours")
    return summary
