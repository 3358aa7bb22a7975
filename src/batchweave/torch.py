"""PyTorch integration: an ``IterableDataset`` over this rank's slices, checkpointable by DCP.

Import it explicitly (``from batchweave.torch import TGBDataset``); the core package never
imports torch. The dataset satisfies ``torch.distributed.checkpoint.stateful.Stateful`` by
shape: ``state_dict()`` is the ``Consumer``'s cursor, ints and strings under constant keys,
so ``torch.distributed.checkpoint`` can save and load it in place.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Unpack

import numpy as np
import torch
import torch.utils.data

from batchweave.consumer import CURSOR_FORMAT, Consumer, RankReading
from batchweave.errors import ConfigError, LayoutError
from batchweave.mesh import Coords, Mesh
from batchweave.reading.options import ReadKeywords, ReadOptions
from batchweave.store import Store

try:  # what a DataLoader iterates an IterableDataset with; private, so only if it is there
    from torch.utils.data._utils.fetch import _IterableDatasetFetcher
except ImportError:  # pragma: no cover - a torch that moved it: the batching check is skipped
    _IterableDatasetFetcher = None

__all__ = ["TGBDataset", "mesh_from_device_mesh"]

_DIMS = ("dp", "cp", "tp", "pp")
_NOT_WRITABLE = "The given NumPy array is not writable"


class TGBDataset(torch.utils.data.IterableDataset):
    """This rank's slice of every committed step, as ``dict[str, torch.Tensor]`` (or bytes).

    Args:
        url: namespace URL (or a batchweave ``Store``).
        mesh: a ``torch.distributed.device_mesh.DeviceMesh`` whose dims are named among
            ``dp``, ``cp``, ``tp``, ``pp``; a missing dim has size 1. Give it instead of
            ``dp``/``cp``/``tp``/``pp``. The rank is then this process's coordinate in the
            mesh (so any dim order works), unless ``rank`` is given.
        dim_names: for meshes named otherwise, which mesh dim plays each role, e.g.
            ``{"dp": "data", "tp": "model"}``. Every mesh dim must have a role.
        dp, cp, tp, pp: mesh sizes, when no ``mesh`` is given.
        rank: this rank in BatchWeave's order (``pp, dp, cp, tp``, outermost first);
            default: from ``mesh``, else ``RANK`` from the environment.
        options: every reading option as one ``batchweave.ReadOptions``, or give them as
            keywords (``prefetch``, ``timeout_s``, ``max_poll_interval_s``,
            ``sequence_axis``, ``log_metrics_s``, ``storage_options``, ``local_rank``,
            ``local_world_size``, ``node_sharing``), as for ``batchweave.Consumer``; the ranks of a node
            share one log follower and one read per slice, by default under torchrun
            with several ranks per node on an object store.
        copy: False (default) wraps the consumer's read-only numpy arrays without copying
            (``torch.from_numpy``; torch's not-writable warning is suppressed): do not
            modify the tensors in place, move them (``.to(device)``) or copy them first.
            True gives each tensor its own writable memory.

    Use ``DataLoader(dataset, batch_size=None, num_workers=0)``: each item is already
    this rank's whole step, so a DataLoader that batches (its default ``batch_size=1``)
    would stack steps under a new leading dimension, and ``iter()`` on it raises
    ConfigError. Each rank must read one slice per step, in order, and the consumer
    already prefetches on background threads, so worker processes would add nothing;
    ``num_workers > 0`` raises ConfigError. torchdata's ``StatefulDataLoader`` is used the
    same way; its ``state_dict()`` holds this dataset's cursor under ``"dataset_state"``.

    The URL and ``storage_options`` are checked here (a mistyped URL, an unknown option or
    a local directory that does not exist is a ConfigError), but no request is made before
    the first ``iter()``, so the dataset pickles and forks safely before any I/O.
    ``last_step`` is the step of the batch last yielded (None before the first); the
    yielded dicts hold only the payload.
    """

    def __init__(
        self,
        url: str | Store,
        *,
        mesh: Any = None,
        dp: int | None = None,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        rank: int | None = None,
        dim_names: Mapping[str, str] | None = None,
        copy: bool = False,
        options: ReadOptions | None = None,
        **keywords: Unpack[ReadKeywords],
    ) -> None:
        super().__init__()
        if mesh is not None:
            if dp is not None or (cp, tp, pp) != (1, 1, 1):
                raise ConfigError("give either a DeviceMesh or dp/cp/tp/pp sizes, not both")
            self.mesh, mesh_rank = mesh_from_device_mesh(mesh, dim_names)
            rank = mesh_rank if rank is None else rank
        else:
            if dim_names is not None:
                raise ConfigError("dim_names applies only with a DeviceMesh (mesh=...)")
            if dp is None:
                raise ConfigError("give a DeviceMesh (mesh=...) or the data-parallel size dp")
            self.mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp)
        self._reading = RankReading.checked(url, self.mesh, rank, ReadOptions.build(options, **keywords))
        self.rank, self.url, self.copy = self._reading.rank, url, copy
        self.options = self._reading.options  # every reading option, as the consumer gets them
        self.last_step: int | None = None
        self._consumer: Consumer | None = None
        self._state: dict[str, Any] | None = None  # a cursor to apply when the consumer is built

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | bytes]:
        # Not a generator function: the checks run at iter(), when the caller's frame is
        # still the DataLoader fetcher that asked (iter() itself adds no Python frame).
        _refuse_data_loader_misuse(sys._getframe(1))
        return self._batches()

    def _batches(self) -> Iterator[dict[str, torch.Tensor] | bytes]:
        consumer = self._get_consumer()
        for batch in consumer:
            out = batch.data if isinstance(batch.data, bytes) else self._tensors(batch.data)
            self.last_step = batch.step
            yield out

    def _get_consumer(self) -> Consumer:
        if self._consumer is None:
            consumer = self._reading.consumer()
            if self._state is not None:
                consumer.load_state_dict(self._state)
            self._consumer, self._state = consumer, None
        return self._consumer

    def _tensors(self, data: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        out = {}
        for name, array in data.items():
            if self.copy:
                array = np.array(array, copy=True)
            try:
                if array.flags.writeable:
                    out[name] = torch.from_numpy(array)
                else:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
                        out[name] = torch.from_numpy(array)
            except (TypeError, ValueError) as exc:
                raise LayoutError(
                    f"array {name!r} of dtype {array.dtype} and shape {array.shape} cannot become a torch tensor: {exc}"
                ) from exc
        return out

    def close(self) -> None:
        """Stop the consumer's background threads; iteration can start again from the cursor."""
        if self._consumer is not None:
            self._consumer.close()

    # -- checkpointing (torch.distributed.checkpoint Stateful) -----------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor after the last batch yielded: exactly ``Consumer.state_dict()``.

        ``batchweave.cursor/2``, ints and strings under constant keys: ``format``,
        ``version``, ``position_numerator`` and ``position_denominator`` (the TGBs consumed,
        what a resume uses), ``step`` (the next step on this mesh of ``dp`` x ``cp``),
        ``dp``, ``cp`` and ``namespace``. Right after ``load_state_dict`` (or ``dcp.load``), it
        is the loaded cursor, whose ``step`` is the step to continue at. A
        ``StatefulDataLoader`` keeps a state loaded into it and hands it to the dataset only
        at ``iter(loader)``, which reads nothing: read the step from there on.
        """
        if self._consumer is not None:
            return self._consumer.state_dict()
        if self._state is not None:
            return dict(self._state)
        start = {"format": CURSOR_FORMAT, "version": 0, "position_numerator": 0, "position_denominator": 1}
        return Consumer.state_on_mesh({**start, "step": 0, "dp": self.mesh.dp, "cp": self.mesh.cp}, self.mesh)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` or a ``Consumer.state_dict()`` (also a
        ``batchweave.cursor/1`` one, of either), before or during iteration.

        Raises ConfigError for anything that is not such a cursor. A resume on different
        DP/CP sizes follows ``Consumer.load_state_dict``.
        """
        cursor = Consumer.state_on_mesh(state, self.mesh)  # checked now, without I/O
        if self._consumer is not None:
            self._consumer.load_state_dict(cursor)
        else:
            self._state = cursor
        self.last_step = None

    def mark_checkpoint(self, checkpoint_id: str) -> None:
        """``Consumer.mark_checkpoint``: call once the checkpoint holding ``state_dict()`` is durable."""
        self._get_consumer().mark_checkpoint(checkpoint_id)

    # -- pickling --------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._consumer is not None:
            state["_state"] = self._consumer.state_dict()
        state["_consumer"] = None
        return state

    def __repr__(self) -> str:
        return f"TGBDataset({getattr(self.url, 'url', self.url)!r}, rank={self.rank}, mesh={self.mesh})"


def _refuse_data_loader_misuse(caller: types.FrameType | None) -> None:
    """ConfigError when a DataLoader batches this dataset or runs it in worker processes.

    ``caller`` is the frame that called ``iter()`` on the dataset: for a DataLoader, its
    ``_IterableDatasetFetcher``, whose ``auto_collation`` is True when the loader batches.
    """
    fetcher = caller.f_locals.get("self") if caller is not None else None
    batching = (
        _IterableDatasetFetcher is not None
        and isinstance(fetcher, _IterableDatasetFetcher)
        and bool(fetcher.auto_collation)
    )
    info = torch.utils.data.get_worker_info()
    if batching:
        workers = ", num_workers=0" if info is not None else ""
        raise ConfigError(
            f"TGBDataset is iterated by a DataLoader that batches (batch_size is not None; its default is 1): "
            f"use DataLoader(dataset, batch_size=None{workers}). Each item is already this rank's whole step, "
            "so batching would stack steps under a new leading dimension"
        )
    if info is not None:
        raise ConfigError(
            f"TGBDataset runs in DataLoader worker {info.id} of {info.num_workers}: use num_workers=0. "
            "Each rank reads exactly one slice per step, in order, and the consumer already prefetches "
            "on background threads; worker processes cannot split that stream and would only add copies"
        )


def mesh_from_device_mesh(device_mesh: Any, dim_names: Mapping[str, str] | None = None) -> tuple[Mesh, int]:
    """BatchWeave mesh sizes and this process's BatchWeave rank from a DeviceMesh.

    Needs ``mesh_dim_names``, ``shape`` (or ``size(i)``) and ``get_coordinate()`` (or,
    failing that, ``get_rank()``, correct only when the dims are in ``pp, dp, cp, tp``
    order over ranks ``0..N-1``).
    """
    names = getattr(device_mesh, "mesh_dim_names", None)
    if not names:
        raise ConfigError("the DeviceMesh has no mesh_dim_names; create it with mesh_dim_names=('dp', ...)")
    roles = dict(dim_names) if dim_names is not None else {name: name for name in names if name in _DIMS}
    unknown_roles = [role for role in roles if role not in _DIMS]
    if unknown_roles:
        raise ConfigError(f"dim_names keys must be among {_DIMS}, got {unknown_roles}")
    role_of = {}
    for role, name in roles.items():
        if name not in names:
            raise ConfigError(f"dim_names maps {role!r} to {name!r}, which is not a mesh dim of {tuple(names)}")
        role_of[name] = role
    unmapped = [name for name in names if name not in role_of]
    if unmapped:
        raise ConfigError(
            f"mesh dims {unmapped} have no role; name dims among {_DIMS} or pass dim_names={{'dp': 'data', ...}}"
        )
    shape = getattr(device_mesh, "shape", None)
    shape = tuple(shape) if shape is not None else tuple(device_mesh.size(i) for i in range(len(names)))
    sizes = {role: 1 for role in _DIMS}
    for name, size in zip(names, shape, strict=True):
        sizes[role_of[name]] = int(size)
    mesh = Mesh(**sizes)
    coordinate = device_mesh.get_coordinate() if hasattr(device_mesh, "get_coordinate") else None
    if coordinate is None:
        return mesh, int(device_mesh.get_rank())
    coords = {role: 0 for role in _DIMS}
    for name, index in zip(names, coordinate, strict=True):
        coords[role_of[name]] = int(index)
    return mesh, mesh.rank(Coords(**coords))
