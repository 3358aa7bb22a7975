"""How hard the property-based tests try: bounded in `make test`, much longer in `make soak`.

``BATCHWEAVE_SOAK=N`` multiplies every budget below by N (``make soak`` sets it); the
default of 1 keeps the whole suite within its time limit on 2 cores.
"""

from __future__ import annotations

import os

FACTOR = max(1, int(os.environ.get("BATCHWEAVE_SOAK", "1") or 1))


def examples(n: int) -> int:
    """``n`` Hypothesis examples in a normal run, ``n * FACTOR`` in a soak."""
    return n * FACTOR
