"""A namespace's schema: each array's name, dtype and shape, fixed by its first TGB. Pure, no I/O.

Within one TGB every slice already has the same array names and dtypes
(``layout.encode_tgb``); the schema carries that across TGBs, so that a namespace never
mixes ``tokens`` of int32 with ``tokens`` of int64, or ``x`` with ``y``. Every rank
trains on whatever the namespace holds, so the mix would otherwise only show as a
crash (or worse, none) somewhere in training.

- The version that commits a namespace's first TGB of arrays carries the whole schema
  (``log.LogVersion.schema``), once; every TGB descriptor carries only its ``digest``
  (16 hex characters), and the log's rules (``logrules``) refuse a version whose TGBs'
  digests differ from the namespace's. So two producers that race to commit different
  schemas cannot both win, and readers' proofs refuse such a version too.
- A producer checks each TGB against the schema before uploading it (``mismatch``), so
  the usual mistake is refused at ``append`` with a ``SchemaError`` that names the array.
- A shape's first dimension may be declared variable (``None``; shown as ``*``): packed
  sequences, variable-length audio. Without a declaration, the first TGB's exact shapes
  are the schema.
- Payloads of raw bytes have no schema.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from batchweave.errors import SchemaError
from batchweave.layout import ArraysLayout, dtype_problem

__all__ = ["ArraySchema", "Schema", "derive", "difference", "held_to", "mismatch", "problem", "schema_digest"]

_MAX_DIMS = 32  # as layout's: a slice header with more is refused there


class ArraySchema(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One array of a schema: its ``name``, its ``dtype`` as numpy spells it exactly
    (``"<i4"`` for little-endian int32: ``ndarray.dtype.str``) and its ``shape`` within a
    slice, with ``None`` for a first dimension that varies from slice to slice."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    def describe(self) -> str:
        """``"int32 (*, 2048)"``: the dtype's name and the shape, ``*`` for a variable dimension."""
        return f"{_dtype_text(self.dtype)} {_shape_text(self.shape)}"


class Schema(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The arrays every slice of a namespace holds, sorted by name.

    Build one with ``Schema.of`` (from names, dtypes and shapes) or ``Schema.from_arrays``
    (from an example slice), and give it to ``Producer(..., schema=...)`` to declare a
    variable first dimension; ``batchweave.read_schema(url)`` returns a namespace's.
    """

    arrays: tuple[ArraySchema, ...]

    @classmethod
    def of(cls, arrays: Mapping[str, tuple[Any, Sequence[int | None]]]) -> Schema:
        """A schema from ``{name: (dtype, shape)}``; ``dtype`` is anything numpy takes
        (``"int32"``, ``np.float16``), ``shape`` a slice's shape with ``None`` first for a
        dimension that varies. E.g. ``Schema.of({"tokens": ("int32", (None, 2048))})``.
        Raises ``SchemaError`` for a name, dtype or shape that no slice can have."""
        specs = []
        for name, spec in sorted(arrays.items(), key=lambda item: str(item[0])):
            if not isinstance(name, str) or not name:
                raise SchemaError(f"schema array names must be non-empty strings, got {name!r}")
            if not isinstance(spec, (tuple, list)) or len(spec) != 2:
                raise SchemaError(f"schema array {name!r}: give (dtype, shape), got {spec!r}")
            specs.append(ArraySchema(name, _dtype_spelling(name, spec[0]), _shape_of(name, spec[1])))
        schema = cls(tuple(specs))
        why = problem(schema)
        if why:
            raise SchemaError(f"schema {schema.describe() or '(no arrays)'}: {why}")
        return schema

    @classmethod
    def declared(cls, schema: Schema | Mapping[str, tuple[Any, Sequence[int | None]]] | None) -> Schema | None:
        """What ``Producer`` and ``run_pool`` take as ``schema=``: a ``Schema``, the mapping
        ``Schema.of`` takes, or None (nothing declared)."""
        return schema if schema is None or isinstance(schema, Schema) else cls.of(schema)

    @classmethod
    def from_arrays(cls, example: Mapping[str, Any], *, variable_first_dim: Iterable[str] = ()) -> Schema:
        """The schema of one example slice (a dict of numpy arrays or torch tensors), with
        the first dimension of the arrays named in ``variable_first_dim`` left variable."""
        variable = set(variable_first_dim)
        unknown = variable - set(example)
        if unknown:
            raise SchemaError(f"variable_first_dim names {sorted(unknown)}; the example's arrays are {sorted(example)}")
        arrays: dict[str, tuple[Any, Sequence[int | None]]] = {}
        for name, value in example.items():
            shape: list[int | None] = list(value.shape)
            if name in variable:
                if not shape:
                    raise SchemaError(f"array {name!r} has no dimensions: its first dimension cannot vary")
                shape[0] = None
            arrays[name] = (_example_dtype(name, value), shape)
        return cls.of(arrays)

    @property
    def digest(self) -> str:
        """A short fingerprint (16 hex characters) that every TGB descriptor carries."""
        return schema_digest(self)

    def describe(self) -> str:
        """``"mask: bool (*,), tokens: int32 (*, 2048)"``."""
        return ", ".join(f"{a.name}: {a.describe()}" for a in self.arrays)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{name: {"dtype": "<i4", "shape": [None, 2048]}}``, ready for JSON."""
        return {a.name: {"dtype": a.dtype, "shape": list(a.shape)} for a in self.arrays}


@functools.lru_cache(maxsize=64)  # one schema per namespace; every TGB's check asks again
def schema_digest(schema: Schema) -> str:
    """``schema.digest``: blake2b of its JSON, 8 bytes (a schema is written by the producers
    of one job: the digest tells schemas apart, it does not defend against forgery)."""
    return hashlib.blake2b(msgspec.json.encode(schema), digest_size=8).hexdigest()


def problem(schema: Schema) -> str:
    """Why ``schema`` cannot be a namespace's ("" when it can): it comes from the log, so
    it is checked like any input."""
    if not schema.arrays:
        return "it lists no arrays"
    names = [a.name for a in schema.arrays]
    if names != sorted(set(names)):
        return f"array names are not distinct and sorted: {[n[:80] for n in names[:_MAX_DIMS]]}"
    for array in schema.arrays:
        where = f"array {array.name[:80]!r}"
        if not array.name:
            return "an array has an empty name"
        why = dtype_problem(array.dtype)
        if why:
            return f"{where}: {why}"
        if len(array.shape) > _MAX_DIMS:
            return f"{where}: {len(array.shape)} dimensions (at most {_MAX_DIMS})"
        if any(n is None for n in array.shape[1:]) or any(n is not None and n < 0 for n in array.shape):
            return f"{where}: shape {_shape_text(array.shape)} (only the first dimension may vary; none is negative)"
    return ""


def derive(arrays: ArraysLayout) -> Schema:
    """The exact schema of a slice of ``arrays`` (what an undeclared first TGB fixes)."""
    return Schema(tuple(ArraySchema(name, dtype, tuple(shape)) for name, dtype, shape in arrays))


def held_to(
    namespace: Schema | None, own: Schema | None, declared: Schema | None, first: ArraysLayout
) -> tuple[Schema, str]:
    """The schema a producer holds a TGB of arrays to, and whose it is (for messages): the
    namespace's (as last read), else the producer's own (declared, or fixed by its first
    TGB), else the exact one of the TGB's ``first`` slice. A declaration is named whenever
    it is the one held to, so the words do not depend on whether the producer has read its
    own first commit back yet."""
    if declared is not None and (namespace or own) == declared:
        return declared, "this producer's declared schema"
    if namespace is not None:
        return namespace, "the namespace's schema"
    if own is not None:
        return own, "the schema of this producer's first TGB"
    return derive(first), "the schema of this TGB's first slice"


def mismatch(schema: Schema, arrays: ArraysLayout, whose: str = "the namespace's schema") -> str:
    """How a slice of ``arrays`` differs from ``schema`` ("" when it fits), naming the
    first array that differs and what ``whose`` (the schema's owner, for the message) says."""
    expected = {a.name: a for a in schema.arrays}
    got = {name: (dtype, shape) for name, dtype, shape in arrays}
    for name in sorted(expected.keys() | got.keys()):
        if name not in got:
            return f"array {name!r} is missing, {whose} has it as {expected[name].describe()}"
        dtype, shape = got[name]
        if name not in expected:
            return f"array {name!r} ({_dtype_text(dtype)} {_shape_text(shape)}) is not in {whose} ({schema.describe()})"
        spec = expected[name]
        if dtype != spec.dtype or not _fits(shape, spec.shape):
            hint = ""
            if dtype == spec.dtype and _only_first_differs(shape, spec.shape):
                # Where the namespace has no schema yet, Producer(schema=...) declares one.
                hint = " (only a first dimension declared variable may vary)"
            return f"array {name!r} is {_dtype_text(dtype)} {_shape_text(shape)}, {whose} says {spec.describe()}{hint}"
    return ""


def difference(expected: Schema, got: Schema, whose: str = "the namespace's schema") -> str:
    """How schema ``got`` differs from ``expected`` ("" when they are equal), as ``mismatch``
    words it: the first array that differs."""
    expected_by_name = {a.name: a for a in expected.arrays}
    got_by_name = {a.name: a for a in got.arrays}
    for name in sorted(expected_by_name.keys() | got_by_name.keys()):
        if name not in got_by_name:
            return f"array {name!r} is missing, {whose} has it as {expected_by_name[name].describe()}"
        if name not in expected_by_name:
            return f"array {name!r} ({got_by_name[name].describe()}) is not in {whose} ({expected.describe()})"
        if got_by_name[name] != expected_by_name[name]:
            return f"array {name!r} is {got_by_name[name].describe()}, {whose} says {expected_by_name[name].describe()}"
    return ""


def _fits(shape: tuple[int, ...], declared: tuple[int | None, ...]) -> bool:
    return len(shape) == len(declared) and all(d is None or d == n for n, d in zip(shape, declared, strict=True))


def _only_first_differs(shape: tuple[int, ...], declared: tuple[int | None, ...]) -> bool:
    return len(shape) == len(declared) > 0 and shape[1:] == declared[1:]


def _dtype_spelling(name: str, dtype: Any) -> str:
    try:
        spelling = np.dtype(dtype).str
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"schema array {name!r}: {dtype!r} is not a numpy dtype ({exc})") from exc
    why = dtype_problem(spelling)
    if why:
        raise SchemaError(f"schema array {name!r}: {why} (numeric, bytes or text dtypes only)")
    return spelling


def _example_dtype(name: str, value: Any) -> Any:
    """An example array's dtype; a torch tensor's through numpy, as ``append`` converts it."""
    if type(value).__module__.startswith("torch"):
        try:
            return value.detach().cpu().numpy().dtype
        except TypeError as exc:
            raise SchemaError(f"array {name!r}: torch dtype {value.dtype} has no numpy equivalent") from exc
    return value.dtype


def _shape_of(name: str, shape: Any) -> tuple[int | None, ...]:
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise SchemaError(f"schema array {name!r}: shape must be a sequence of sizes, got {shape!r}")
    dims = tuple(shape)
    if not all(d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool)) for d in dims):
        raise SchemaError(f"schema array {name!r}: shape {dims!r} holds something other than sizes and None")
    return tuple(None if d is None else int(d) for d in dims)


def _dtype_text(spelling: str) -> str:
    """``"<i8"`` as ``"int64"``; a spelling whose name would hide its byte order stays as it is."""
    try:
        name = np.dtype(spelling).name
        return name if np.dtype(name).str == spelling else spelling
    except (TypeError, ValueError):
        return spelling


def _shape_text(shape: Sequence[int | None]) -> str:
    dims = ["*" if n is None else str(n) for n in shape]
    return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
