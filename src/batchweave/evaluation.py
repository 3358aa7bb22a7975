"""An evaluation set beside training: one full pass of an ended namespace per call.

The evaluation set is a namespace of its own, written once and ended with
``bw.end_stream(url)``. Each pass is a fresh ``Consumer`` from step 0 to the end: it marks
no checkpoint, so it never holds back garbage collection of anything, and it shares
nothing with the training consumer, whose cursor (``state_dict``) does not move.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from batchweave.consumer import Batch, Consumer
from batchweave.errors import ConfigError, LayoutError
from batchweave.journal import Journal
from batchweave.log import LogState
from batchweave.mesh import Mesh
from batchweave.reading.reshard import Reshard
from batchweave.store import open_store

__all__ = ["evaluation_pass"]


def evaluation_pass(
    url: str,
    dp: int,
    cp: int = 1,
    tp: int = 1,
    pp: int = 1,
    rank: int | None = None,
    *,
    timeout_s: float | None = 60.0,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[Batch]:
    """An iterator over this rank's slice of every step of the ended namespace at ``url``, once.

    ``dp, cp, tp, pp, rank`` as for ``Consumer`` (``rank`` defaults to ``RANK``).
    ``timeout_s`` bounds each step's wait, as for ``Consumer``. Raises ConfigError at once
    (before iterating) if the namespace has not ended: a pass over a stream that is still
    being written would never finish, and LayoutError at once if the pass would leave TGBs
    out: a ``dp`` that grows the written one k-fold reads k TGBs a step, so a set whose
    count of TGBs is not a multiple of k has a trailing partial step (read it with the
    written ``dp``, or a divisor of it). Costs one read of the log's state (O(1) requests
    plus its tail, like opening a consumer) and then what reading the namespace from its
    start costs; the reader starts its threads at the first ``next()`` and stops them at
    the end of the pass (or when the iterator is closed or collected).
    """
    store = open_store(url, create=False, storage_options=storage_options)
    state = Journal(store, read_only=True).load_state()
    if not state.end_of_stream:
        raise ConfigError(
            f"{store.url} has not ended: an evaluation pass reads a namespace to its end, so write the "
            "evaluation set once and end it with bw.end_stream(url) (or batchweave end-stream URL)"
        )
    reader = Consumer(store, dp=dp, cp=cp, tp=tp, pp=pp, rank=rank, timeout_s=timeout_s)
    _check_reads_everything(store.url, state, reader.mesh)
    return _one_pass(reader)


def _check_reads_everything(url: str, state: LogState, mesh: Mesh) -> None:
    """A pass must read every TGB: a mesh whose steps the set does not fill (DP grown k-fold
    over a count of TGBs that is not a multiple of k) would leave the last ones out, as a
    training consumer does at the end of a stream. Delivering them to some replicas only
    would not be a step of the mesh (the others would have none), so refuse the pass."""
    layout = state.layout
    if layout is None or layout.kind is None:
        return  # nothing was written: the pass is empty on any mesh
    left = Reshard(layout.dp, layout.cp, mesh, layout.kind).describe_leftover(state.steps, ahead=True)
    if left:
        raise LayoutError(f"{url}: an evaluation pass reads every TGB of the set, but {left}")


def _one_pass(reader: Consumer) -> Iterator[Batch]:
    with reader:
        yield from reader
