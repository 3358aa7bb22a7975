"""The values a producer makes and reads by the thousand a second are not tracked by the
cyclic garbage collector (``gc=False``): each collection would scan them all, and a 100 KB
producer spent about 8% of its CPU in collections, most of it inside its packing."""

from __future__ import annotations

import gc

from batchweave import intent, layout, log


def test_log_values_read_back_are_untracked():
    tgb = log.TGBDescriptor("p", 1, 0, 1, 1, "bytes", ["data/p/x.bwb"], [(0, 0, 10, 7)], 10)
    version = log.LogVersion(
        log.LOG_FORMAT, 1, 0, [tgb], {"p": log.ProducerState(1, 1, "i")}, layout=log.Layout(1, 1, "bytes")
    )
    decoded = log.decode_version(log.encode(version), "_log/00000000000000000001.json", 1)
    head = log.decode_version_head(log.encode(version), "_log/00000000000000000001.json", 1)
    values = [decoded, decoded.tgbs[0], decoded.producers["p"], decoded.layout, head, head.tgbs[0], log.LogState()]
    assert [gc.is_tracked(value) for value in values] == [False] * len(values)


def test_footers_and_intents_are_untracked():
    pack = layout.encode_pack([layout.frame_tgb([b"ab", b"cd"], 2, 1)])
    footer = layout.read_footer(b"".join(bytes(p) for p in pack.parts[0]), "data/x.bwb")
    tgb = log.TGBDescriptor("p", 1, 0, 1, 1, "bytes", ["data/p/x.bwb"], [(0, 0, 10, 7)], 10)
    data = intent.encode_intent(intent.Intent(intent.INTENT_FORMAT, "p", 1, [tgb]))
    written = intent.decode_intent(data, intent.intent_key("p", 1, 0))
    assert not gc.is_tracked(footer) and not any(gc.is_tracked(entry) for entry in footer.slices)
    assert not gc.is_tracked(written)
