"""How a producer writes: every producer option in one frozen value, ``ProducerOptions``.

``Producer`` takes these options as keywords (``max_lag=20_000``) or as one
``options=ProducerOptions(...)``, and holds a ``ProducerOptions`` either way; a producer
pool (``batchweave.run_pool``, processes or Ray actors) carries the one value whole to
every worker. Where a producer writes (the URL, its ``producer_id``, ``dp`` and ``cp``)
is not an option; how it writes is. A new option is one field of ``ProducerOptions``
(with its check), its keyword in ``ProducerKeywords``, its place in the wire form
(``to_json``) and its use in the producer: the pools then carry it unchanged.

Options cross process boundaries as JSON (``to_json``/``from_json``), never pickled: a
commit policy crosses by its name, a schema as its fields, storage options as plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict

import msgspec

from batchweave.commit.policies import CommitPolicy
from batchweave.errors import ConfigError
from batchweave.journal import DEFAULT_SNAPSHOT_EVERY
from batchweave.layout import DEFAULT_MAX_OBJECT_BYTES
from batchweave.packing import DEFAULT_PACK_DELAY_S, check_pack_options
from batchweave.reading.options import check_storage_options_shape, given_options
from batchweave.schema import Schema

__all__ = ["ProducerKeywords", "ProducerOptions", "SchemaSpec"]

# What ``schema=`` takes: a Schema, or ``{name: (dtype, shape)}`` (``Schema.of``).
SchemaSpec = Schema | Mapping[str, tuple[Any, Sequence[int | None]]]
_WIRE_FORMAT = "batchweave.producer-options/1"


@dataclass(frozen=True, slots=True)
class ProducerOptions:
    """Every option of how a producer writes; see ``batchweave.Producer`` for each one.

    ``commit_policy``: a policy object or its name (None: group commit, or DAC with
    ``background_commit=False``: ``commit.policies.resolve_policy``; a name is looked up when a
    producer builds its policy, before it touches the store; a policy object learns from
    the commits of the one producer that takes it, so give each producer its own, or a
    name, which builds a fresh one per producer); ``max_object_bytes``: the
    size cap of one TGB object; ``snapshot_every``: log versions between two snapshots;
    ``background_commit``: commit on a thread of its own; ``publish_metrics``: record the
    counters in the log; ``max_lag``: backpressure, in TGBs above ``W_global`` (None:
    never block); ``storage_options``: obstore options for the store (a mapping of option
    names to values, checked against the store's kind when it is opened); ``schema``: the
    arrays every slice holds (given as a mapping, it is held as the ``Schema`` it
    declares); ``pack_steps`` and ``pack_delay_s``: how TGBs are packed
    (``batchweave.packing``).
    """

    commit_policy: CommitPolicy | str | None = None
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY
    background_commit: bool = True
    publish_metrics: bool = False
    max_lag: int | None = None
    storage_options: Mapping[str, Any] | None = None
    schema: SchemaSpec | None = None
    pack_steps: int | None = None
    pack_delay_s: float = DEFAULT_PACK_DELAY_S

    def __post_init__(self) -> None:
        _check_policy(self.commit_policy)
        _check_count("max_object_bytes", self.max_object_bytes, "bytes")
        _check_count("snapshot_every", self.snapshot_every, "log versions")
        _check_flag("background_commit", self.background_commit)
        _check_flag("publish_metrics", self.publish_metrics)
        if self.max_lag is not None:
            _check_count("max_lag", self.max_lag, "steps or None")
        check_storage_options_shape(self.storage_options)
        check_pack_options(self.pack_steps, self.pack_delay_s)
        # Held as the Schema it declares: one spelling, so options compare and cross as values.
        object.__setattr__(self, "schema", Schema.declared(self.schema))

    @property
    def declared_schema(self) -> Schema | None:
        """``schema`` as the ``Schema`` it declares (``__post_init__`` made it one)."""
        assert self.schema is None or isinstance(self.schema, Schema)
        return self.schema

    @classmethod
    def build(cls, options: ProducerOptions | None = None, /, **keywords: Any) -> ProducerOptions:
        """``options``, or the options the keywords give (``ProducerKeywords``); not both.

        A keyword no producer knows is a TypeError at the call, as for any function (a
        misspelt ``max_lag`` must not be ignored), naming it and the options there are;
        a call that gives both ``options`` and keywords is a ConfigError.
        """
        if (given := given_options(cls, options, keywords, ProducerKeywords.__annotations__, "producer")) is not None:
            return given
        return cls(**keywords)

    def keywords(self) -> ProducerKeywords:
        """These options as the keywords that give them (``build(**options.keywords())``)."""
        return ProducerKeywords(**{f.name: getattr(self, f.name) for f in fields(self)})  # type: ignore[typeddict-item]

    def to_json(self) -> bytes:
        """The options as JSON, to cross to another process (``from_json`` reads them back).

        The commit policy crosses by its name: a policy object is refused with a
        ConfigError (its settings and what it learnt would not cross), and so are storage
        options that are not plain data (a ``credential_provider``): build those in the
        worker, or use the store's environment variables.
        """
        policy = self.commit_policy
        if policy is not None and not isinstance(policy, str):
            name = getattr(policy, "name", None)
            hint = f"its name, commit_policy={name!r}" if isinstance(name, str) else "a policy name, such as 'dac'"
            raise ConfigError(
                f"commit_policy {policy!r} is a policy object, which cannot cross to another process (its "
                f"settings and state would not cross with it): give {hint} (batchweave.commit.policies.resolve_policy "
                "builds a policy from its name)"
            )
        wire = _Wire(
            format=_WIRE_FORMAT,
            commit_policy=policy,
            max_object_bytes=self.max_object_bytes,
            snapshot_every=self.snapshot_every,
            background_commit=self.background_commit,
            publish_metrics=self.publish_metrics,
            max_lag=self.max_lag,
            storage_options=None if self.storage_options is None else dict(self.storage_options),
            schema=self.declared_schema,
            pack_steps=self.pack_steps,
            pack_delay_s=self.pack_delay_s,
        )
        try:
            return msgspec.json.encode(wire)
        except (TypeError, OverflowError) as exc:  # the message names no value: options sit next to secrets
            raise ConfigError(
                "storage_options cannot cross to another process: every value must be plain data (strings, "
                f"numbers, booleans, lists, mappings), got {type(exc).__name__}; build a credential_provider "
                "in the worker, or use the store's environment variables"
            ) from None

    @classmethod
    def from_json(cls, data: bytes | str) -> ProducerOptions:
        """The options ``to_json`` wrote; ConfigError for anything else."""
        try:
            wire = msgspec.json.decode(data, type=_Wire)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"not producer options ({_WIRE_FORMAT}): {exc}") from None
        if wire.format != _WIRE_FORMAT:
            raise ConfigError(f"producer options of format {wire.format!r}; this version reads {_WIRE_FORMAT!r}")
        return cls(**{f.name: getattr(wire, f.name) for f in fields(cls)})


class ProducerKeywords(TypedDict, total=False):
    """The producer options as keywords: ``ProducerOptions``' fields."""

    commit_policy: CommitPolicy | str | None
    max_object_bytes: int
    snapshot_every: int
    background_commit: bool
    publish_metrics: bool
    max_lag: int | None
    storage_options: Mapping[str, Any] | None
    schema: SchemaSpec | None
    pack_steps: int | None
    pack_delay_s: float


def _check_count(name: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive number of {unit}, got {value!r}")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def _check_policy(policy: Any) -> None:
    """A name, None or a policy object. A name is looked up when the producer builds its
    policy (``commit.policies.resolve_policy``, before it touches the store): building one
    here to check it would draw from the policy's random source a second time."""
    if policy is None or isinstance(policy, str):
        return
    if isinstance(policy, type) or not isinstance(policy, CommitPolicy):
        raise ConfigError(
            f"commit_policy {policy!r} is not a policy name or a policy instance with wait_s()/observe(); "
            "see batchweave.commit.policies.CommitPolicy"
        )


class _Wire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``ProducerOptions`` as JSON: the policy by its name."""

    format: str
    commit_policy: str | None
    max_object_bytes: int
    snapshot_every: int
    background_commit: bool
    publish_metrics: bool
    max_lag: int | None
    storage_options: dict[str, Any] | None
    schema: Schema | None
    pack_steps: int | None
    pack_delay_s: float
