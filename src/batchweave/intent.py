"""Group commit's intents: the format of a producer's published, not yet committed TGBs. Pure.

A producer in group commit (``commit.group``) writes each batch of its pending
descriptors as an *intent*, create-only, at ``_intents/<producer>/e<epoch>/<first
offset>.json``; the next committer folds it into a log version. The format lives here,
beside the log's, so that garbage collection, which deletes folded intents, reads it
without importing the commit machinery.
"""

from __future__ import annotations

import msgspec

from batchweave import log
from batchweave.decoding import decoding
from batchweave.errors import CorruptDataError
from batchweave.keys import INTENT_PREFIX, LAYOUT
from batchweave.log import TGBDescriptor

__all__ = ["INTENT_FORMAT", "Intent", "decode_intent", "encode_intent", "intent_key", "parse_intent_key"]

INTENT_FORMAT = "batchweave.intent/1"


# gc=False: as the log's values (log.ProducerState), numbers, strings and containers of them.
class Intent(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """Descriptors of consecutive TGBs of one producer incarnation, waiting to be folded."""

    format: str
    producer: str
    epoch: int
    tgbs: list[TGBDescriptor]

    @property
    def first_offset(self) -> int:
        return self.tgbs[0].source_offset

    @property
    def end_offset(self) -> int:
        """One past the last offset it carries."""
        return self.tgbs[-1].source_offset + 1


def intent_key(producer: str, epoch: int, first_offset: int) -> str:
    return f"{INTENT_PREFIX}{producer}/e{epoch:06d}/{first_offset:012d}.json"


def parse_intent_key(key: str) -> tuple[str, int, int] | None:
    """(producer, epoch, first offset) of an intent key; None for anything else (the
    intent layout of ``keys.LAYOUT``, in full)."""
    match = LAYOUT["intent"].fullmatch(key)
    if match is None:
        return None
    return match["producer"], int(match["epoch"]), int(match["offset"])


_encoder = msgspec.json.Encoder()
_INTENT_DECODER = msgspec.json.Decoder(Intent)  # built once at import: see log._VERSION_DECODER


def encode_intent(intent: Intent) -> bytes:
    return _encoder.encode(intent)


def decode_intent(data: bytes | memoryview, key: str) -> Intent:
    """Parse an intent and check it against its key: one producer, one epoch, dense offsets."""
    with decoding(key, "damaged intent"):
        intent = _INTENT_DECODER.decode(data)
    if intent.format != INTENT_FORMAT:
        raise CorruptDataError(key, f"unsupported intent format {intent.format!r} (this reader knows {INTENT_FORMAT})")
    if not intent.tgbs:
        raise CorruptDataError(key, "intent carries no TGB")
    if parse_intent_key(key) != (intent.producer, intent.epoch, intent.first_offset):
        raise CorruptDataError(key, f"intent of {intent.producer}@{intent.first_offset} e{intent.epoch} under this key")
    for expected, tgb in enumerate(intent.tgbs, start=intent.first_offset):
        if (tgb.producer, tgb.epoch, tgb.source_offset) != (intent.producer, intent.epoch, expected):
            raise CorruptDataError(key, f"TGB {tgb.producer}@{tgb.source_offset} e{tgb.epoch} breaks the intent")
    log.check_descriptors(intent.tgbs, key)
    return intent
