"""`bench producers` full mode on the latency model, group commit and the paced point only.

The full sweep in `producers-latency/` ran before the last group-commit change (the next
committer reads intents ahead of its turn; interval 0.4 s; stagger three commit
durations). This re-runs the rows that change uses, with the same code path as the
benchmark: `python docs/benchmarks/session-4/group_final.py OUT_DIR`.
"""

import sys

from batchweave.bench import producers
from batchweave.bench.report import BenchOptions
from batchweave.cli import main

if __name__ == "__main__":
    full = producers.plan

    def group_only(options: BenchOptions) -> dict:
        return {**full(options), "policies": ["group"], "nats": False}

    producers.plan = group_only
    sys.exit(main(["bench", "producers", "--out", sys.argv[1]]))
