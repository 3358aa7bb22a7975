"""How a rank reads: every reading option in one frozen value, ``ReadOptions``. Pure.

``Consumer`` and the framework readers (``batchweave.torch``, ``.grain``, ``.tf``) take
these options as keywords (``prefetch=4``) or as one ``options=ReadOptions(...)``, and
hold a ``ReadOptions`` either way. Where a rank reads (the mesh and the rank) is not an
option; how it reads is. A new option is one field of ``ReadOptions`` (with its check),
its keyword in ``ReadKeywords``, and its use in the consumer: every reader then takes it
(a test checks that each accepts every field).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypedDict

from batchweave.errors import ConfigError

__all__ = ["NodeSharing", "ReadKeywords", "ReadOptions", "check_storage_options_shape", "given_options"]


@dataclass(frozen=True, slots=True)
class NodeSharing:
    """Whether the ranks of one node share one log follower and one read per slice
    (``batchweave.reading.node``), and this rank's place on its node.

    ``enabled`` None (default): on when the node has more than one rank, the store is an
    object store and the system is Linux. ``local_rank`` and ``local_world_size`` default
    to ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the environment (torchrun), else 0 of 1.
    """

    enabled: bool | None = None
    local_rank: int | None = None
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise ConfigError(f"node_sharing must be True, False or None, got {self.enabled!r}")


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """Every option of how a rank reads; see ``batchweave.Consumer`` for each one.

    ``prefetch``: reads fetched ahead (None: chosen from the data and the store);
    ``timeout_s``: the longest one ``next()`` waits (None: wait); ``max_poll_interval_s``:
    the longest pause between log probes while idle; ``sequence_axis``: the axis slices
    are joined and split along when CP changed; ``log_metrics_s``: log ``metrics()``
    every this many seconds (None: never); ``storage_options``: obstore options for the
    store, a mapping of option names to values (anything else is a ConfigError here; the
    names are checked against the store's kind when the store is opened); ``node``: how
    the ranks of a node share reading.
    """

    prefetch: int | None = None
    timeout_s: float | None = None
    max_poll_interval_s: float = 1.0
    sequence_axis: int = -1
    log_metrics_s: float | None = None
    storage_options: Mapping[str, Any] | None = None
    node: NodeSharing = field(default_factory=NodeSharing)

    def __post_init__(self) -> None:
        _check_positive("prefetch", self.prefetch, int, "steps")
        _check_positive("timeout_s", self.timeout_s, int | float, "seconds")
        _check_positive("max_poll_interval_s", self.max_poll_interval_s, int | float, "seconds", optional=False)
        _check_positive("log_metrics_s", self.log_metrics_s, int | float, "seconds")
        if isinstance(self.sequence_axis, bool) or not isinstance(self.sequence_axis, int):
            raise ConfigError(f"sequence_axis must be an axis number, got {self.sequence_axis!r}")
        check_storage_options_shape(self.storage_options)
        if not isinstance(self.node, NodeSharing):
            raise ConfigError(f"node must be a NodeSharing, got {self.node!r}")

    @classmethod
    def build(cls, options: ReadOptions | None = None, /, **keywords: Any) -> ReadOptions:
        """``options``, or the options the keywords give (``ReadKeywords``); not both.

        A keyword no reader knows is a TypeError at the call, as for any function (a
        misspelt ``prefetch`` must not be ignored), naming it and the options there are;
        a call that gives both ``options`` and keywords is a ConfigError.
        """
        if (given := given_options(cls, options, keywords, ReadKeywords.__annotations__, "reading")) is not None:
            return given
        node = NodeSharing(
            keywords.pop("node_sharing", None), keywords.pop("local_rank", None), keywords.pop("local_world_size", None)
        )
        return cls(**keywords, node=node)

    def keywords(self) -> ReadKeywords:
        """These options as the keywords that give them (``build(**options.keywords())``)."""
        flat: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "node"}
        flat.update(
            node_sharing=self.node.enabled, local_rank=self.node.local_rank, local_world_size=self.node.local_world_size
        )
        return ReadKeywords(**flat)


class ReadKeywords(TypedDict, total=False):
    """The reading options as keywords: ``ReadOptions``' fields, ``node`` as its three."""

    prefetch: int | None
    timeout_s: float | None
    max_poll_interval_s: float
    sequence_axis: int
    log_metrics_s: float | None
    storage_options: Mapping[str, Any] | None
    node_sharing: bool | None
    local_rank: int | None
    local_world_size: int | None


def _check_positive(name: str, value: Any, kind: Any, unit: str, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if value is None or isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        allowed = " or None" if optional else ""
        raise ConfigError(f"{name} must be a positive number of {unit}{allowed}, got {value!r}")


def given_options(
    kind: type[Any], options: Any, keywords: Mapping[str, Any], known: Mapping[str, Any], what: str
) -> Any:
    """The checks of an options value's ``build`` (``ReadOptions``, ``ProducerOptions``):
    ``options`` when it is given (a ``kind``, with no keywords beside it), else None. A
    keyword not in ``known`` is a TypeError naming it and the ``what`` options there are."""
    unknown = sorted(set(keywords) - set(known))
    if unknown:
        raise TypeError(f"unknown {what} option(s) {', '.join(unknown)}: the options are {', '.join(known)}")
    if options is None:
        return None
    if keywords:
        raise ConfigError(f"give options={kind.__name__}(...) or the keywords {', '.join(keywords)}, not both")
    if not isinstance(options, kind):
        raise ConfigError(f"options must be a {kind.__name__}, got {options!r}")
    return options


def check_storage_options_shape(options: Any) -> None:
    """The shape the store checks the keys of (``batchweave.store.check_storage_options``,
    once the URL says which keys a store takes): None or a mapping with string keys. The
    message names the type, never the value: options sit next to secrets."""
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise ConfigError(
            "storage_options must be a mapping of option names to values, such as {'region': 'eu-west-1'} "
            f"or {{'fsync': False}} (or None), got a value of type {type(options).__name__}"
            + (": a string of options is not parsed, give each option as a key" if isinstance(options, str) else "")
        )
    kinds = sorted({type(key).__name__ for key in options if not isinstance(key, str)})
    if kinds:
        raise ConfigError(
            f"storage_options must be a mapping with string keys (option names), got keys of type {kinds}"
        )
