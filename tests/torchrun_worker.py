"""One training rank under torchrun for tests/test_multinode_torchrun.py: reads its slice of
every step with a ``batchweave.Consumer`` built from the torchrun environment, and keeps a
record of what it read.

    torchrun --nnodes=2 --node_rank=K --nproc_per_node=2 ... tests/torchrun_worker.py \\
        --data URL --out DIR --dp 2 --tp 2 [--hold-after STEP]

No torch import and no process group: the ranks never talk to each other (reading needs no
coordination), so each starts in a fraction of a second.

``<out>/rank-<R>.json`` is this rank's checkpoint: the consumer's cursor and the steps read
up to it (step, checksum of the slice, log version), with the identity of each incarnation
(PID, torchrun agent PID, GROUP_RANK, LOCAL_RANK, where it resumed). It is replaced
atomically after every step, so a SIGKILL at any point leaves a cursor and a list of steps
that agree, as a real checkpoint of model and data cursor would. A rank that finds its
checkpoint resumes from its cursor.

``--hold-after STEP``: after delivering STEP (in its first incarnation only) the rank marks
itself ``held`` and waits for ``<out>/go`` to exist, with the consumer's prefetched steps
in hand but not delivered; the test kills or releases it there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import batchweave as bw

HOLD_LIMIT_S = 120.0


def slice_checksum(data: dict[str, np.ndarray] | bytes) -> str:
    """The checksum the test recomputes from what the producer wrote (names sorted)."""
    digest = hashlib.sha256()
    if isinstance(data, bytes):
        digest.update(data)
    else:
        for name in sorted(data):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(data[name]).tobytes())
    return digest.hexdigest()[:16]


def torchrun_identity() -> dict[str, Any]:
    """Who and where this rank is, from the variables torchrun sets (and the agent's PID:
    torchrun's agent is the parent of its workers, so it names the "node")."""
    env = os.environ
    return {
        "pid": os.getpid(),
        "agent_pid": os.getppid(),
        "rank": int(env["RANK"]),
        "world_size": int(env["WORLD_SIZE"]),
        "local_rank": int(env["LOCAL_RANK"]),
        "local_world_size": int(env["LOCAL_WORLD_SIZE"]),
        "group_rank": int(env["GROUP_RANK"]),
        "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "store_endpoint": env.get("AWS_ENDPOINT_URL", ""),  # the node's proxy: its request counter
    }


def save(path: Path, record: dict[str, Any]) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)  # whole or not at all


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--hold-after", type=int, default=None)
    args = parser.parse_args(argv)

    me = torchrun_identity()
    out = Path(args.out)
    path = out / f"rank-{me['rank']}.json"
    record = json.loads(path.read_text()) if path.exists() else {"incarnations": [], "steps": [], "cursor": None}
    # rank and WORLD_SIZE come from the environment (RANK, WORLD_SIZE), as under any launcher.
    consumer = bw.Consumer(args.data, dp=args.dp, tp=args.tp, timeout_s=60)
    if record["cursor"] is not None:
        consumer.load_state_dict(record["cursor"])
    record["incarnations"].append({**me, "resumed_at": consumer.state_dict()["step"]})
    record.update(held=False, done=False)
    save(path, record)
    first_incarnation = len(record["incarnations"]) == 1
    node_barrier(out, "start", me)  # as a job's ranks meet in init_process_group
    with consumer:
        for batch in consumer:
            record["steps"].append([batch.step, slice_checksum(batch.data), batch.version])
            record["cursor"] = consumer.state_dict()
            hold = first_incarnation and batch.step == args.hold_after
            record["held"] = hold
            save(path, record)
            if hold:
                wait_for_go(out / "go")
        record.update(done=True, held=False, metrics=consumer.metrics().to_dict())
        save(path, record)
        node_barrier(out, "end", me)  # and end together: a node's hub serves until its ranks are done


def node_barrier(out: Path, name: str, me: dict[str, Any]) -> None:
    """Wait until every rank of this node (this incarnation of it: the same agent) got
    here. A real job's ranks meet in collectives; these have no process group."""
    first = me["rank"] - me["local_rank"]
    mark = out / f"barrier-{name}-{me['agent_pid']}"
    mark.mkdir(exist_ok=True)
    (mark / str(me["rank"])).touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not all((mark / str(rank)).exists() for rank in range(first, first + me["local_world_size"])):
        if time.monotonic() > deadline:
            sys.exit(f"the node's ranks did not all reach {name} within {HOLD_LIMIT_S} s")
        time.sleep(0.02)


def wait_for_go(go: Path) -> None:
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not go.exists():
        if time.monotonic() > deadline:
            sys.exit(f"held for {HOLD_LIMIT_S} s and never released")
        time.sleep(0.02)


if __name__ == "__main__":
    main()
