"""A real producer or consumer process for the crash and race tests.

    python tests/worker.py produce URL PRODUCER_ID COUNT [--dp N] [--cp N] [--policy dac|eager]
    python tests/worker.py consume URL RANK OUT.json [--dp N] [--cp N] [--state STATE.json] [--stop-after N]

Payloads are a pure function of (producer_id, source offset, slice index), so a test
can check every byte a consumer received against what must have been produced.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
import zlib

import numpy as np

import batchweave as bw


class Eager:
    """Commit whenever anything is pending: the most commit races per TGB."""

    name = "eager"

    def wait_s(self, pending_tgbs: int, since_last_attempt_s: float) -> float:
        return 0.0 if pending_tgbs else math.inf

    def observe(self, fragile_window_s: float, producers: int, success: bool) -> None:
        pass


def payload(producer_id: str, offset: int, index: int) -> dict[str, np.ndarray]:
    seed = zlib.crc32(f"{producer_id}/{offset}/{index}".encode())
    rng = np.random.default_rng(seed)
    # One shape for every slice: a namespace's first TGB fixes its schema (batchweave.schema).
    return {
        "tokens": rng.integers(0, 50_000, size=(4, 16), dtype=np.int32),
        "origin": np.frombuffer(f"{producer_id}:{offset}".encode().ljust(32), dtype=np.uint8).copy(),
        "slice": np.array([index, offset], dtype=np.int64),
    }


def tgb(producer_id: str, offset: int, slices: int) -> list[dict[str, np.ndarray]]:
    return [payload(producer_id, offset, i) for i in range(slices)]


def origin_of(data: dict[str, np.ndarray]) -> tuple[str, int]:
    producer_id, offset = bytes(data["origin"]).decode().strip().rsplit(":", 1)
    return producer_id, int(offset)


def digest(data: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(data):
        h.update(name.encode())
        h.update(np.ascontiguousarray(data[name]).tobytes())
    return h.hexdigest()


def produce(args: argparse.Namespace) -> int:
    policy = Eager() if args.policy == "eager" else args.policy
    try:
        producer_options = {"commit_policy": policy, "pack_steps": args.pack_steps}
        with bw.Producer(args.url, args.producer_id, dp=args.dp, cp=args.cp, **producer_options) as producer:
            print(f"started epoch={producer.epoch} resume={producer.resume_offset}", flush=True)
            for offset in range(producer.resume_offset, args.count):
                producer.append(tgb(args.producer_id, offset, args.dp * args.cp), source_offset=offset)
                time.sleep(args.pace)  # preprocessing time, so commits happen in between
                if args.flush_every and (offset + 1) % args.flush_every == 0:
                    producer.flush()
                    print(f"committed {offset + 1}", flush=True)
            if args.hold:
                # Stay alive as a zombie would; when told, try to publish one more TGB.
                producer.flush()
                print("holding", flush=True)
                sys.stdin.readline()
                producer.append(tgb(args.producer_id, args.count, args.dp * args.cp), source_offset=args.count)
                producer.flush()
    except bw.ProducerFencedError as exc:
        print(f"fenced: {exc}", flush=True)
        return 3
    print("done", flush=True)
    return 0


def consume(args: argparse.Namespace) -> int:
    consumer = bw.Consumer(args.url, dp=args.dp, cp=args.cp, rank=args.rank, timeout_s=args.timeout_s)
    if args.state:
        with open(args.state) as f:
            consumer.load_state_dict(json.load(f))
    seen = []
    for batch in consumer:
        seen.append({"step": batch.step, "origin": list(origin_of(batch.data)), "digest": digest(batch.data)})
        if args.stop_after is not None and len(seen) >= args.stop_after:
            break
    consumer.close()
    with open(args.out, "w") as f:
        json.dump({"seen": seen, "state": consumer.state_dict()}, f)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("produce")
    p.add_argument("url")
    p.add_argument("producer_id")
    p.add_argument("count", type=int)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--policy", default="dac")
    p.add_argument("--flush-every", type=int, default=0)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--pace", type=float, default=0.0, help="seconds between appends")
    p.add_argument("--pack-steps", type=int, default=None, help="Producer(pack_steps=); default: by size")
    p.set_defaults(run=produce)
    c = sub.add_parser("consume")
    c.add_argument("url")
    c.add_argument("rank", type=int)
    c.add_argument("out")
    c.add_argument("--dp", type=int, default=2)
    c.add_argument("--cp", type=int, default=1)
    c.add_argument("--state")
    c.add_argument("--stop-after", type=int)
    c.add_argument("--timeout-s", type=float, default=60.0)
    c.set_defaults(run=consume)
    args = parser.parse_args()
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
