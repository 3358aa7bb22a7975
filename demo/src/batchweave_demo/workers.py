"""The demo's child processes: a preprocessing producer and a reading rank. Top-level
functions, because the ``spawn`` context imports them in a fresh interpreter.

Children talk to the parent over a pipe in JSON (never pickled data). A child that must
stop at a precise point (the producer with uploaded, uncommitted TGBs; the rank a few
steps after its checkpoint) sends a message and then blocks reading the pipe: the
parent answers with SIGKILL, never with bytes. If the parent dies, the read fails and
the child exits instead of lingering.
"""

from __future__ import annotations

import json
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from batchweave.consumer import Consumer
from batchweave.errors import BatchWeaveError
from batchweave.producer import Producer
from batchweave_demo.directory import write_json
from batchweave_demo.plan import COMMIT_EVERY, checkpoint_id, producer_id
from batchweave_demo.workload import WRITER_EPOCH, build_tgb, payload_checksum

CONSUMER_TIMEOUT_S = 120.0


def _send(conn: Connection | None, message: dict[str, Any]) -> None:
    if conn is not None:
        conn.send_bytes(json.dumps(message).encode())


def _block_until_killed(conn: Connection) -> None:
    conn.recv_bytes()  # the parent never writes: it SIGKILLs this process
    raise SystemExit(3)  # unreachable unless the parent broke the protocol


def producer_main(spec: dict[str, Any], appended: Any, conn: Connection) -> None:
    """One preprocessing worker. ``spec["gate"]``: after appending the offset just below
    it, report the uploaded group and block before the ``flush()`` that would commit it."""
    index, share, slices = spec["index"], spec["share"], spec["dp"] * spec["cp"]
    pid = producer_id(index)
    out = Path(spec["results"]) / f"producer-{pid}-{spec['incarnation']}.json"
    record: dict[str, Any] = {"producer_id": pid, "incarnation": spec["incarnation"], "os_pid": os.getpid()}
    record["done"] = False
    try:
        # pack_steps=1: each TGB's objects are uploaded in its append, so a worker killed at
        # the gate leaves uploaded, uncommitted objects behind: the orphans the story shows
        # (with packs, small TGBs would still be held in memory, and die with the process).
        with Producer(
            spec["url"],
            pid,
            dp=spec["dp"],
            cp=spec["cp"],
            commit_policy="manual",
            background_commit=False,
            pack_steps=1,
        ) as producer:
            start = producer.resume_offset
            record.update(resume_offset=start, epoch=producer.epoch)
            write_json(out, record)
            _send(conn, {"event": "started", "resume_offset": start, "epoch": producer.epoch})
            for offset in range(start, share):
                tgb = build_tgb(index, offset, slices, spec["images"])
                for s in tgb:  # so a rank can tell which incarnation wrote what it read
                    s[WRITER_EPOCH] = np.array([producer.epoch], dtype=np.int64)
                producer.append(tgb, source_offset=offset)
                appended[index] = offset + 1
                if offset + 1 == spec["gate"]:
                    _send(conn, {"event": "uploaded", "first": offset + 1 - COMMIT_EVERY, "last": offset})
                    _block_until_killed(conn)
                if (offset + 1) % COMMIT_EVERY == 0 or offset + 1 == share:
                    producer.flush()
                    record["metrics"] = producer.metrics()
                    write_json(out, record)
        record.update(metrics=producer.metrics(), done=True)
        write_json(out, record)
    except BatchWeaveError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        write_json(out, record)
        raise SystemExit(1) from None


def _save_checkpoint(consumer: Consumer, directory: Path, step: int, rank: int) -> None:
    """What a trainer does after a checkpoint is durable: cursor to disk, then the mark."""
    folder = directory / checkpoint_id(step)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / f"rank-{rank}.json", consumer.state_dict())
    consumer.mark_checkpoint(checkpoint_id(step))


def consumer_main(spec: dict[str, Any], progress: Any, conn: Connection | None) -> None:
    """One reader of rank ``spec["rank"]``'s slice: a training rank, its resumed
    incarnation (``spec["resume"]``: a cursor file) or the uninterrupted twin."""
    for name in ("RANK", "WORLD_SIZE"):  # the demo passes ranks explicitly
        os.environ.pop(name, None)
    rank, every = spec["rank"], spec["checkpoint_every"]
    out = Path(spec["results"]) / f"{spec['name']}.json"
    record: dict[str, Any] = {"name": spec["name"], "rank": rank, "os_pid": os.getpid(), "error": None}
    record.update(steps=[], sources=[], checksums=[], epochs=[], bytes=0)
    try:
        with Consumer(spec["url"], dp=spec["dp"], cp=spec["cp"], rank=rank, timeout_s=CONSUMER_TIMEOUT_S) as consumer:
            if spec["resume"]:
                consumer.load_state_dict(json.loads(Path(spec["resume"]).read_text()))
            record.update(slice_index=consumer.slice_index, start_step=consumer.state_dict()["step"])
            progress[spec["slot"]] = record["start_step"]  # a resumed rank starts over at its checkpoint
            for batch in consumer:
                assert isinstance(batch.data, dict)
                _record_batch(record, batch.step, batch.data)
                done = batch.step + 1
                progress[spec["slot"]] = done
                if spec["mark"] and done % every == 0 and done < spec["steps"]:  # data must follow a checkpoint
                    _save_checkpoint(consumer, Path(spec["checkpoints"]), done, rank)
                if done == spec["gate"]:
                    write_json(out, record)
                    assert conn is not None
                    _send(conn, {"event": "stopped", "delivered": done, "checkpoint": done // every * every})
                    _block_until_killed(conn)
    except BatchWeaveError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    write_json(out, record)
    if record["error"]:
        raise SystemExit(1)


def _record_batch(record: dict[str, Any], step: int, data: dict[str, np.ndarray]) -> None:
    record["steps"].append(step)
    record["sources"].append(data["source"].tolist())
    record["checksums"].append(payload_checksum(data))
    record["epochs"].append(int(data[WRITER_EPOCH][0]))
    record["bytes"] += sum(a.nbytes for a in data.values())
