"""``python -m benchmarks NAME [--quick] --out DIR [--store ...] [--workload ...]`` or
``python -m benchmarks --replot DIR/NAME.json ...``: ``batchweave bench`` from the root of a
checkout (the same command line, the same checks)."""

from __future__ import annotations

import sys

from batchweave.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
