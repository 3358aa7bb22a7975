"""A training rank for the node-sharing tests: reads its slice of every step through its
node's hub, pauses after step ``--pause-at`` until ``--go`` exists (so the test can kill
the hub's process mid-run), and writes what it read.

    python node_worker.py URL RANK OUT --dp 2 --tp 2 --local-world-size 4 --pause-at 5 --go PATH
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import batchweave as bw
from batchweave.reading import nodehub


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("rank", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--local-world-size", type=int, required=True)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--go", type=Path)
    args = parser.parse_args()
    consumer = bw.Consumer(
        args.url,
        dp=args.dp,
        tp=args.tp,
        rank=args.rank,
        local_rank=args.rank % args.local_world_size,
        local_world_size=args.local_world_size,
        node_sharing=True,
        timeout_s=60,
    )
    seen = []
    for batch in consumer:
        seen.append([batch.step, int(batch.data["x"][0])])
        if batch.step == args.pause_at:
            ready = {"pid": os.getpid(), "hosting": bool(nodehub._hubs)}
            partial = args.out.with_suffix(".partial")
            partial.write_text(json.dumps(ready))
            os.replace(partial, args.out.with_suffix(".ready"))  # whole or not at all: the test reads it at once
            while not args.go.exists():  # the test's signal to go on
                time.sleep(0.01)
    consumer.close()
    args.out.write_text(json.dumps({"seen": seen}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
