"""JAX integration: a Grain ``IterDataset`` over this rank's slices, checkpointable by Grain.

Import it explicitly (``from batchweave.grain import TGBIterDataset``); the core package
never imports jax or grain. The iterator's ``get_state()`` is the ``Consumer``'s cursor
(``batchweave.cursor/2``: ints and strings under constant keys), which Grain's checkpoint
handler, and Orbax through it, stores as JSON; ``set_state()`` resumes right after the last
step the iterator handed out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Unpack

import grain
import numpy as np

from batchweave.consumer import CURSOR_FORMAT, Consumer, RankReading
from batchweave.errors import ConfigError, LayoutError
from batchweave.mesh import Mesh
from batchweave.reading.options import ReadKeywords, ReadOptions
from batchweave.store import Store

__all__ = ["TGBDatasetIterator", "TGBIterDataset", "to_jax"]


class TGBIterDataset(grain.IterDataset):
    """This rank's slice of every committed step, as a Grain ``IterDataset``.

    Each element is one step: ``dict[str, numpy.ndarray]`` (read-only arrays that share
    memory with the bytes read), or ``bytes`` for raw-bytes namespaces. Chain Grain
    transformations on it as on any ``IterDataset`` (``.map(to_jax)``, ...); iterators
    over the chain save and restore the cursor through Grain's own state.

    Args:
        url: namespace URL (or a batchweave ``Store``).
        dp, cp, tp, pp: mesh sizes, in BatchWeave's sense: ranks that read one slice each.
        rank: this rank in BatchWeave's order (``pp, dp, cp, tp``, outermost first).
            Default: ``jax.process_index()``, and then ``dp*cp*tp*pp`` must equal
            ``jax.process_count()``: one BatchWeave rank per JAX process, which is also
            how Grain's checkpoint handler names each process's state file. Call
            ``jax.distributed.initialize()`` before creating the dataset (JAX requires it
            before any other JAX call, and this one asks JAX for the process index).
        options: every reading option as one ``batchweave.ReadOptions``, or give them as
            keywords (``prefetch``, ``timeout_s``, ``max_poll_interval_s``,
            ``sequence_axis``, ``log_metrics_s``, ``storage_options``, ``local_rank``,
            ``local_world_size``, ``node_sharing``), as for ``batchweave.Consumer`` (the consumer
            prefetches on its own threads; Grain's ``mp_prefetch`` would add nothing and
            cannot split one rank's stream, so it is refused).

    The URL and ``storage_options`` are checked here (ConfigError), but no request is
    made before the first element is asked for.
    """

    def __init__(
        self,
        url: str | Store,
        *,
        dp: int,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        rank: int | None = None,
        options: ReadOptions | None = None,
        **keywords: Unpack[ReadKeywords],
    ) -> None:
        super().__init__()
        mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp)
        rank = _jax_process_rank(mesh) if rank is None else rank
        # The consumer's settings stay in _reading: an attribute `prefetch` would hide IterDataset.prefetch().
        self._reading = RankReading.checked(url, mesh, rank, ReadOptions.build(options, **keywords))
        self.mesh, self.rank, self.url = mesh, self._reading.rank, url
        self.options = self._reading.options  # every reading option, as the consumer gets them

    def __iter__(self) -> TGBDatasetIterator:
        return TGBDatasetIterator(self)

    def new_consumer(self) -> Consumer:
        """A ``Consumer`` for this rank, from step 0 (used by each iterator)."""
        return self._reading.consumer()

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain's hook for ``mp_prefetch`` workers: refused, a rank's steps cannot be split."""
        del sequential_slice
        if (sl.start or 0) == 0 and sl.stop is None and (sl.step or 1) == 1:
            return  # one worker reading everything: nothing to split
        raise ConfigError(
            f"TGBIterDataset cannot be split across Grain worker processes (slice {sl}): each rank reads "
            "exactly one slice per step, in order, and the consumer already prefetches on threads; "
            "do not use mp_prefetch (or use num_workers=0)"
        )

    def __str__(self) -> str:
        return f"TGBIterDataset({getattr(self.url, 'url', self.url)!r}, rank={self.rank}, mesh={self.mesh})"


class TGBDatasetIterator(grain.DatasetIterator):
    """An iterator of ``TGBIterDataset``: one step per ``next()``, and the cursor as state.

    ``get_state()`` is the cursor after the last element handed out, never what the
    consumer prefetched; ``set_state()`` takes it back (or any ``Consumer.state_dict()``
    / ``TGBDataset.state_dict()``: the format is shared). ``last_step`` is the step of the
    element last handed out (None before the first).
    """

    def __init__(self, dataset: TGBIterDataset) -> None:
        super().__init__()
        self._dataset = dataset
        self._consumer: Consumer | None = None
        self._state: dict[str, Any] | None = None  # a cursor to apply when the consumer is built
        self.last_step: int | None = None

    def __next__(self) -> dict[str, np.ndarray] | bytes:
        self._assert_not_closed()
        batch = next(self._get_consumer())
        self.last_step = batch.step
        return batch.data

    def _get_consumer(self) -> Consumer:
        if self._consumer is None:
            consumer = self._dataset.new_consumer()
            if self._state is not None:
                consumer.load_state_dict(self._state)
            self._consumer, self._state = consumer, None
        return self._consumer

    def get_state(self) -> dict[str, Any]:
        """The cursor, ``batchweave.cursor/2``: exactly ``Consumer.state_dict()``.

        JSON-serializable (ints and strings under constant keys: ``format``, ``version``,
        ``position_numerator``, ``position_denominator``, ``step``, ``dp``, ``cp``,
        ``namespace``), as Grain's checkpoint handler needs.
        """
        if self._consumer is not None:
            return self._consumer.state_dict()
        if self._state is not None:
            return dict(self._state)
        mesh = self._dataset.mesh
        start = {"format": CURSOR_FORMAT, "version": 0, "position_numerator": 0, "position_denominator": 1}
        return Consumer.state_on_mesh({**start, "step": 0, "dp": mesh.dp, "cp": mesh.cp}, mesh)

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Resume right after the step ``state`` was saved at.

        Raises ConfigError for anything that is not a cursor (checked now, without I/O);
        the checks against the namespace (a cursor of another namespace is a ConfigError,
        one whose data was collected a DataReclaimedError) run now when the iterator has
        started, else at ``start_prefetch()`` (Grain's checkpoint handler calls it right
        after) or the next ``next()``.
        """
        cursor = Consumer.state_on_mesh(state, self._dataset.mesh)
        if self._consumer is not None:
            self._consumer.load_state_dict(cursor)
        else:
            self._state = cursor
        self.last_step = None

    def start_prefetch(self) -> None:
        """Grain's hint that elements will be wanted soon (its checkpoint handler calls it
        after ``set_state``): opens the consumer now, so a restored cursor is checked
        against the namespace here, and its errors raise here."""
        self._get_consumer()

    def mark_checkpoint(self, checkpoint_id: str) -> None:
        """``Consumer.mark_checkpoint``: call once the checkpoint holding ``get_state()`` is durable."""
        self._get_consumer().mark_checkpoint(checkpoint_id)

    def close(self) -> None:
        """Stop the consumer's background threads; ``next()`` then raises ValueError (Grain's rule)."""
        if self._consumer is not None:
            self._consumer.close()
        super().close()

    def __str__(self) -> str:
        return f"TGBDatasetIterator({self._dataset}, last_step={self.last_step})"


def to_jax(batch: Mapping[str, np.ndarray], device: Any = None) -> dict[str, Any]:
    """A step's arrays as JAX arrays on ``device`` (default: JAX's default device).

    Uses ``jax.device_put``, which on the CPU backend wraps a C-contiguous numpy array in
    place, without a copy, when its data starts at a 64-byte boundary and JAX keeps its
    dtype; otherwise it copies once. Slices place every array at a 64-byte offset, so
    whether an array is wrapped depends on where the buffer read from the store starts.
    64-bit arrays are copied to 32 bits unless ``jax_enable_x64`` is set. On a GPU or TPU
    the arrays are copied to the device (one transfer). ``jax.numpy.asarray`` always
    copies, and ``jax.dlpack.from_dlpack`` refuses the read-only arrays the consumer
    yields. The JAX array keeps the numpy buffer alive; both are immutable.
    """
    if not isinstance(batch, Mapping):
        raise LayoutError(
            f"to_jax takes a step's dict of arrays, got {type(batch).__name__}: a raw-bytes namespace's "
            "steps are bytes; decode them first (e.g. numpy.frombuffer)"
        )
    import jax  # deferred: jax is heavy to import and only needed here

    out = {}
    for name, array in batch.items():
        try:
            out[name] = jax.device_put(array, device)
        except (TypeError, ValueError) as exc:
            raise LayoutError(
                f"array {name!r} of dtype {array.dtype} and shape {array.shape} cannot become a JAX array: {exc}"
            ) from exc
    return out


def _jax_process_rank(mesh: Mesh) -> int:
    """``jax.process_index()``, checked against the mesh: one BatchWeave rank per JAX process."""
    import jax  # deferred: only when the rank is not given

    index, count = jax.process_index(), jax.process_count()
    if mesh.world_size != count:
        raise ConfigError(
            f"no rank given, so the rank is jax.process_index() = {index} of jax.process_count() = {count} "
            f"processes, but dp*cp*tp*pp = {mesh.dp}*{mesh.cp}*{mesh.tp}*{mesh.pp} = {mesh.world_size}; "
            "pass rank= or size the mesh to the JAX processes"
        )
    return index
