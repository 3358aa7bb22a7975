"""PyTorch integration: an ``IterableDataset`` over this rank's slices, checkpointable by DCP.

Import it explicitly (``from batchweave.torch import TGBDataset``); the core package never
imports torch. The dataset satisfies ``torch.distributed.checkpoint.stateful.Stateful`` by
shape: ``state_dict()`` is a small cursor under constant keys, all plain ints plus one
format string, so ``torch.distributed.checkpoint`` can save and load it in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data

from batchweave.consumer import CURSOR_FORMAT, Consumer, check_prefetch
from batchweave.errors import ConfigError, LayoutError
from batchweave.mesh import Coords, Mesh, resolve_rank
from batchweave.store import Store

__all__ = ["TGBDataset", "mesh_from_device_mesh"]

_DIMS = ("dp", "cp", "tp", "pp")
_STATE_KEYS = ("format", "version", "position_numerator", "position_denominator", "step", "dp", "cp")
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
        prefetch, timeout_s, sequence_axis, store_options: as for ``batchweave.Consumer``.
        copy: False (default) wraps the consumer's read-only numpy arrays without copying
            (``torch.from_numpy``; torch's not-writable warning is suppressed): do not
            modify the tensors in place, move them (``.to(device)``) or copy them first.
            True gives each tensor its own writable memory.

    Use ``DataLoader(dataset, batch_size=None, num_workers=0)``: each rank must read one
    slice per step, in order, and the consumer already prefetches on background threads,
    so worker processes would add nothing; ``num_workers > 0`` raises ConfigError.

    The store is opened on the first ``iter()``, not here, so the dataset pickles and
    forks safely before any I/O. ``last_step`` is the step of the batch last yielded
    (None before the first); the yielded dicts hold only the payload.
    """

    def __init__(
        self,
        url: str | Store,
        mesh: Any = None,
        dp: int | None = None,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        rank: int | None = None,
        prefetch: int | None = None,
        timeout_s: float | None = None,
        sequence_axis: int = -1,
        *,
        dim_names: Mapping[str, str] | None = None,
        copy: bool = False,
        **store_options: Any,
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
        self.rank = resolve_rank(rank, self.mesh)
        self.url = url
        self.prefetch = check_prefetch(prefetch)
        self.timeout_s = timeout_s
        self.sequence_axis = sequence_axis
        self.copy = copy
        self.store_options = store_options
        self.last_step: int | None = None
        self._consumer: Consumer | None = None
        self._state: dict[str, Any] | None = None  # a cursor to apply when the consumer is built

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | bytes]:
        self._refuse_workers()
        consumer = self._get_consumer()
        for batch in consumer:
            out = batch.data if isinstance(batch.data, bytes) else self._tensors(batch.data)
            self.last_step = batch.step
            yield out

    def _refuse_workers(self) -> None:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise ConfigError(
                f"TGBDataset runs in DataLoader worker {info.id} of {info.num_workers}: use num_workers=0. "
                "Each rank reads exactly one slice per step, in order, and the consumer already prefetches "
                "on background threads; worker processes cannot split that stream and would only add copies"
            )

    def _get_consumer(self) -> Consumer:
        if self._consumer is None:
            consumer = Consumer(
                self.url,
                dp=self.mesh.dp,
                cp=self.mesh.cp,
                tp=self.mesh.tp,
                pp=self.mesh.pp,
                rank=self.rank,
                prefetch=self.prefetch,
                timeout_s=self.timeout_s,
                sequence_axis=self.sequence_axis,
                **self.store_options,
            )
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
        """The cursor after the last batch yielded, under constant keys, as plain ints.

        ``position_numerator / position_denominator`` counts the TGBs consumed (what a
        resume uses); ``step`` is the next step counted on this mesh of ``dp`` x ``cp``.
        """
        if self._consumer is not None:
            state = self._consumer.state_dict()
        elif self._state is not None:
            state = self._state
        else:
            state = {"format": CURSOR_FORMAT, "version": 0, "position": [0, 1], "step": 0}
            state = Consumer.state_on_mesh(state, self.mesh)
        return {
            "format": state["format"],
            "version": state["version"],
            "position_numerator": state["position"][0],
            "position_denominator": state["position"][1],
            "step": state["step"],
            "dp": state["dp"],
            "cp": state["cp"],
            "namespace": state.get("namespace", ""),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` (or a ``Consumer.state_dict()``), before or during iteration.

        Raises ConfigError for anything that is not such a cursor. A resume on different
        DP/CP sizes follows ``Consumer.load_state_dict``.
        """
        cursor = Consumer.state_on_mesh(_consumer_state(state), self.mesh)  # checked now, without I/O
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


def _consumer_state(state: Any) -> dict[str, Any]:
    """Convert the flat DCP-friendly cursor to the consumer's form; pass a consumer's through."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"not a BatchWeave dataset state: {state!r:.200}")
    if "position" in state:
        return dict(state)
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ConfigError(f"BatchWeave dataset state lacks {missing}: {dict(state)!r:.200}")
    out = {key: state[key] for key in ("format", "version", "step", "dp", "cp")}
    out["position"] = [state["position_numerator"], state["position_denominator"]]
    out["namespace"] = state.get("namespace", "")  # absent from cursors saved before namespace ids
    return out


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
