"""TensorFlow integration: a ``tf.data.Dataset`` over this rank's slices, and its cursor in
``tf.train.Checkpoint``.

Import it explicitly (``from batchweave.tf import TGBReader``); the core package never
imports tensorflow. ``TGBReader`` is a ``tf.train.experimental.PythonState``: put it in a
``tf.train.Checkpoint`` beside the model and the reading position is saved and restored
with it, as the ``batchweave.cursor/2`` JSON text.

tf.data pulls elements ahead of the training loop (``prefetch``, parallel ``map``, Keras),
so the position of the generator feeding it is not what the loop consumed. Each element
therefore travels with its own cursor, and the reader records that cursor only when the
element is handed to the loop (``for batch in reader``, or ``reader.iterate(dataset)``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Generator, Iterator, Mapping
from typing import Any, Unpack

import numpy as np
import tensorflow as tf

from batchweave.consumer import CURSOR_FORMAT, Batch, Consumer, RankReading
from batchweave.errors import BatchWeaveError, ConfigError, LayoutError
from batchweave.mesh import Mesh
from batchweave.reading.options import ReadKeywords, ReadOptions
from batchweave.store import Store

__all__ = ["TGBReader"]

_CURSOR_SPEC = tf.TensorSpec(shape=(), dtype=tf.string)
_BYTES_SPEC = tf.TensorSpec(shape=(), dtype=tf.string)


class TGBReader(tf.train.experimental.PythonState):
    """This rank's slice of every committed step, through tf.data, with a checkpointable cursor.

    ``for batch in reader`` yields each step as ``dict[str, tf.Tensor]`` (a scalar
    ``tf.string`` tensor for raw-bytes namespaces) and advances the cursor as each batch
    is handed out. ``tf.train.Checkpoint(data=reader, model=...)`` saves that cursor and
    ``restore`` puts it back: the next loop continues right after the last step consumed
    before the save, whatever tf.data had pulled ahead.

    Args:
        url: namespace URL (or a batchweave ``Store``).
        dp, cp, tp, pp: mesh sizes, in BatchWeave's sense: ranks that read one slice each.
        rank: this rank in BatchWeave's order (``pp, dp, cp, tp``, outermost first);
            default ``RANK`` from the environment (or 0 when the mesh has one rank). Under
            ``tf.distribute`` pass the worker's index, e.g.
            ``strategy.cluster_resolver.task_id``.
        element_spec: ``dict`` of ``tf.TensorSpec`` per array name (or one ``TensorSpec``
            of ``tf.string`` for raw-bytes namespaces). None (default): inferred from the
            first step when the dataset is first built (one read), with every dimension
            left unknown (``None``), since shapes may differ from step to step.
        options: every reading option as one ``batchweave.ReadOptions``, or give them as
            keywords (``prefetch``, ``timeout_s``, ``max_poll_interval_s``,
            ``sequence_axis``, ``log_metrics_s``, ``storage_options``, ``local_rank``,
            ``local_world_size``, ``node_sharing``), as for ``batchweave.Consumer``.

    The URL and ``storage_options`` are checked here (ConfigError), but no request is
    made before the dataset is first built or iterated. Errors of reading (a cursor of
    another namespace, a timeout, collected data) are raised by the loop as the same
    typed ``BatchWeaveError`` the consumer raises, not as a TensorFlow error.
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
        element_spec: Mapping[str, tf.TensorSpec] | tf.TensorSpec | None = None,
        options: ReadOptions | None = None,
        **keywords: Unpack[ReadKeywords],
    ) -> None:
        mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp)
        self._reading = RankReading.checked(url, mesh, rank, ReadOptions.build(options, **keywords))
        self.mesh, self.rank, self.url = mesh, self._reading.rank, url
        self.options = self._reading.options  # every reading option, as the consumer gets them
        self._spec = _checked_spec(element_spec)
        start = {"format": CURSOR_FORMAT, "version": 0, "position_numerator": 0, "position_denominator": 1}
        self._consumed = Consumer.state_on_mesh({**start, "step": 0, "dp": dp, "cp": cp}, self.mesh)
        self._restores = 0  # counts load_state_dict calls: a loop started before one is stale
        self._error: BaseException | None = None  # what the generator raised, re-raised typed
        self._lock = threading.Lock()  # the generator runs on a tf.data thread
        self._dataset: tf.data.Dataset | None = None
        self.last_step: int | None = None

    # -- the dataset -----------------------------------------------------------------

    @property
    def element_spec(self) -> dict[str, tf.TensorSpec] | tf.TensorSpec:
        """The spec of one batch: as given, or inferred from the step at the cursor (one
        read; ConfigError when the stream has ended with no step left to infer it from)."""
        if self._spec is None:
            spec = self._infer_spec()
            if spec is None:
                raise ConfigError(
                    f"{self}: the stream has ended with no step left to read, so the element_spec cannot be "
                    "inferred; pass element_spec="
                )
            self._spec = spec
        return self._spec

    @property
    def dataset(self) -> tf.data.Dataset:
        """The ``tf.data.Dataset`` of ``(batch, cursor)`` pairs behind ``iter(reader)``.

        ``cursor`` is a scalar ``tf.string``: the JSON cursor right after this batch.
        Transform it one element in, one element out, keeping the cursor beside the batch
        (``dataset.map(lambda batch, cursor: (f(batch), cursor))``, ``prefetch``), then
        iterate with ``reader.iterate(dataset)`` so that the reader records what the loop
        consumed. Each iteration starts at the reader's cursor at that moment. When the
        stream has ended with nothing left to read and no ``element_spec`` was given, the
        dataset is empty (its batch spec ``{}``).
        """
        if self._dataset is None:
            spec = self._spec if self._spec is not None else self._infer_spec()
            if spec is None:  # nothing left to read: not cached, a restore may go back
                return tf.data.Dataset.from_generator(lambda: iter(()), output_signature=({}, _CURSOR_SPEC))
            self._spec = spec
            self._dataset = tf.data.Dataset.from_generator(self._generate, output_signature=(spec, _CURSOR_SPEC))
        return self._dataset

    def __iter__(self) -> Iterator[Any]:
        return self.iterate(self.dataset)

    def iterate(self, dataset: tf.data.Dataset) -> Generator[Any, None, None]:
        """The batches of ``dataset`` (built from ``self.dataset``), recording each one's
        cursor as it is handed out."""
        _check_pairs(dataset)
        restores = self._restores
        iterator = iter(dataset)
        while True:
            try:
                batch, cursor = next(iterator)
            except StopIteration:
                return
            except tf.errors.OpError as exc:
                error = self._take_error()
                if error is None:
                    raise
                raise error from exc
            if self._restores != restores:
                raise ConfigError(
                    f"{self}: the reader's state was restored while this loop was running; start a new "
                    "loop (for batch in reader) to read from the restored position"
                )
            self._consumed = json.loads(cursor.numpy())
            self.last_step = self._consumed["step"] - 1
            yield batch

    def _take_error(self) -> BaseException | None:
        with self._lock:
            error, self._error = self._error, None
        return error

    def _generate(self) -> Generator[tuple[Any, str], None, None]:
        # Runs on a tf.data thread, once per iteration of the dataset, from the cursor of
        # what the loop has consumed so far. TensorFlow turns exceptions raised here into
        # its own errors; the original is kept for ``iterate`` to raise.
        try:
            with self._new_consumer(self._consumed) as consumer:
                for batch in consumer:
                    yield self._checked(batch), json.dumps(consumer.state_dict())
        except BatchWeaveError as exc:
            with self._lock:
                self._error = exc
            raise

    def _new_consumer(self, cursor: Mapping[str, Any]) -> Consumer:
        consumer = self._reading.consumer()
        if cursor["position_numerator"] or cursor["version"]:
            consumer.load_state_dict(dict(cursor))  # checked against the namespace here
        return consumer

    def _infer_spec(self) -> dict[str, tf.TensorSpec] | tf.TensorSpec | None:
        """The spec of the step at the cursor, or None when the stream has ended before it."""
        with self._new_consumer(self._consumed) as consumer:
            batch = next(consumer, None)
        return None if batch is None else _spec_of(batch)

    def _checked(self, batch: Batch) -> Any:
        """The batch, when it fits the element spec: a LayoutError names what does not."""
        spec = self.element_spec
        data = batch.data
        if isinstance(spec, tf.TensorSpec) or isinstance(data, bytes):
            if not (isinstance(spec, tf.TensorSpec) and isinstance(data, bytes)):
                raise LayoutError(f"{self}: step {batch.step} is {_kind(data)}, the element_spec expects {spec}")
            return data
        if set(data) != set(spec):
            raise LayoutError(
                f"{self}: step {batch.step} has arrays {sorted(data)}, the element_spec has {sorted(spec)}"
            )
        for name, array in data.items():
            want = spec[name]
            if tf.as_dtype(array.dtype) != want.dtype or not want.shape.is_compatible_with(array.shape):
                raise LayoutError(
                    f"{self}: step {batch.step} array {name!r} is {array.dtype} of shape {array.shape}, "
                    f"the element_spec expects {want}"
                )
        return data

    # -- checkpointing (tf.train.Checkpoint, and the shared cursor) -------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor after the last batch handed out: ``batchweave.cursor/2``, as
        ``Consumer.state_dict()`` (what ``serialize`` writes as JSON)."""
        return dict(self._consumed)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a saved cursor (of any BatchWeave reader: the format is shared).

        Raises ConfigError now for anything that is not a cursor; the checks against the
        namespace run when the next loop starts and raise from it. A loop already running
        is stale: its next batch raises ConfigError.
        """
        self._consumed = Consumer.state_on_mesh(state, self.mesh)
        self._restores += 1
        self.last_step = None

    def serialize(self) -> str:
        """``tf.train.experimental.PythonState``: the cursor as JSON text."""
        return json.dumps(self.state_dict(), sort_keys=True)

    def deserialize(self, string_value: bytes | str) -> None:
        """``tf.train.experimental.PythonState``: the cursor back from ``serialize``."""
        try:
            state = json.loads(string_value)
        except ValueError as exc:
            raise ConfigError(f"{self}: the checkpoint's reader state is not JSON: {string_value[:200]!r}") from exc
        self.load_state_dict(state)

    def mark_checkpoint(self, checkpoint_id: str) -> None:
        """``Consumer.mark_checkpoint`` for the cursor of what the loop consumed: call it once
        the checkpoint holding this reader is durable."""
        with self._new_consumer(self._consumed) as consumer:
            consumer.mark_checkpoint(checkpoint_id)

    def __repr__(self) -> str:
        return f"TGBReader({getattr(self.url, 'url', self.url)!r}, rank={self.rank}, mesh={self.mesh})"


def _check_pairs(dataset: tf.data.Dataset) -> None:
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2 and spec[1] == _CURSOR_SPEC):
        raise ConfigError(
            f"reader.iterate() takes a dataset of (batch, cursor) pairs built from reader.dataset, "
            f"got elements {spec}; keep the cursor: dataset.map(lambda batch, cursor: (f(batch), cursor))"
        )


def _spec_of(batch: Batch) -> dict[str, tf.TensorSpec] | tf.TensorSpec:
    if isinstance(batch.data, bytes):
        return _BYTES_SPEC
    spec = {}
    for name, array in batch.data.items():
        spec[name] = tf.TensorSpec(shape=[None] * array.ndim, dtype=_tf_dtype(name, array.dtype))
    return spec


def _tf_dtype(name: str, dtype: np.dtype) -> tf.DType:
    try:
        return tf.as_dtype(dtype)
    except TypeError as exc:
        raise LayoutError(f"array {name!r} of dtype {dtype} has no TensorFlow dtype: {exc}") from exc


def _checked_spec(spec: Any) -> dict[str, tf.TensorSpec] | tf.TensorSpec | None:
    if spec is None:
        return None
    if isinstance(spec, tf.TensorSpec):
        if spec.dtype != tf.string or spec.shape.rank != 0:
            raise ConfigError(
                f"a single element_spec is for raw-bytes namespaces: TensorSpec((), tf.string), got {spec}"
            )
        return spec
    if not isinstance(spec, Mapping) or not spec or not all(isinstance(s, tf.TensorSpec) for s in spec.values()):
        raise ConfigError(f"element_spec must be a dict of tf.TensorSpec per array name, got {spec!r}")
    return dict(spec)


def _kind(data: Any) -> str:
    return "raw bytes" if isinstance(data, bytes) else f"arrays {sorted(data)}"
