"""Decoding from many threads at once, in a fresh interpreter (regression).

msgspec 0.22 prepares a Struct type's decoding information on the type's first decode;
threads that first-decode the same type together could see it half-built and crash
the interpreter (``json_decode_struct_map_inner``, a NULL read): it happened to bench
workers whose producer threads all claimed at once. The decoders are now built at import.
The crash is a race, so the test gives it many chances: fresh interpreters, each with
64 threads released together into their first decodes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

FIRST_DECODES = textwrap.dedent(
    """
    import threading
    from batchweave import layout, log
    from batchweave import intent as intents
    tgbs = [
        log.TGBDescriptor("p", 1, i, 8, 1, "bytes", [f"data/p/e000001/{i:012d}-t.0.bwb"],
                          [(0, k * 10, 10, 0) for k in range(8)], 80)
        for i in range(200)
    ]
    version = log.encode(log.LogVersion(log.LOG_FORMAT, 1, 0, tgbs, {}))
    state = log.encode(log.LogState(producers={"p": log.ProducerState(3, 1, "x")}))
    intent = intents.encode_intent(intents.Intent(intents.INTENT_FORMAT, "p", 1, tgbs))
    tgb = layout.encode_tgb([b"x" * 10] * 4, 4, 1).objects[0]
    start = threading.Barrier(64)

    def decode():
        start.wait()
        for _ in range(3):
            log.decode_version_head(version, "v", 1)
            log.decode_version(version, "v", 1)
            log.decode_snapshot(state, "s")
            intents.decode_intent(intent, intents.intent_key("p", 1, 0))
            layout.read_footer(tgb, "t")

    threads = [threading.Thread(target=decode) for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("decoded")
    """
)


def test_first_decodes_from_many_threads_at_once_do_not_crash():
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", FIRST_DECODES], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "decoded" in run.stdout, (run.returncode, run.stderr[-2000:])
