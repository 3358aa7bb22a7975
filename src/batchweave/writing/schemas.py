"""Which schema a producer's TGB must fit, and whether its declared schema is the
namespace's: the producer's checks before it uploads or claims anything. Pure: schemas and
states in, a schema or a ``SchemaError`` out (``batchweave.schema`` holds the rules of
schemas themselves)."""

from __future__ import annotations

from batchweave import schema as schemas
from batchweave.errors import SchemaError
from batchweave.layout import FramedTGB
from batchweave.log import LogState
from batchweave.schema import Schema

__all__ = ["check_declared", "schema_for"]

_FIX = (
    "A namespace keeps the schema of its first TGB of arrays (batchweave.read_schema shows it): "
    "convert the arrays to it, or write them to a new namespace"
)


def schema_for(
    tgb: FramedTGB, namespace: Schema | None, own: Schema | None, declared: Schema | None, where: str
) -> Schema | None:
    """The schema ``tgb``'s arrays fit, or SchemaError (``where`` names the TGB): the
    namespace's (as of the newest log version the producer read), else the producer's own
    (declared, or fixed by its first TGB), else the first slice's exact one. None for bytes."""
    if tgb.kind == "bytes":
        if own is not None:
            raise SchemaError(
                f"{where}: slices are bytes, but this producer's schema is of arrays ({own.describe()}); "
                "nothing was written. Give dicts of arrays, or write bytes to a namespace of bytes"
            )
        return None
    if namespace is not None and own is not None and namespace != own:
        problem = schemas.difference(namespace, own)
        raise SchemaError(f"{where}: {problem}; nothing was written. {_FIX}")
    expected, whose = schemas.held_to(namespace, own, declared, tgb.array_layouts[0])
    for arrays in tgb.array_layouts:
        problem = schemas.mismatch(expected, arrays, whose)
        if problem:
            raise SchemaError(f"{where}: {problem}; nothing was written. {_FIX}")
    return expected


def check_declared(declared: Schema | None, state: LogState, url: str, producer_id: str) -> None:
    """A declared schema must be the namespace's (when it has one), and not for bytes:
    SchemaError naming the namespace at ``url`` and the producer otherwise."""
    if declared is None:
        return
    layout = state.layout
    if layout is not None and layout.kind == "bytes":
        raise SchemaError(
            f"{url}: producer {producer_id!r} declares a schema of arrays "
            f"({declared.describe()}), but the namespace holds bytes; drop schema=, or use a new namespace"
        )
    if state.schema is not None and state.schema != declared:
        raise SchemaError(
            f"{url}: producer {producer_id!r} declares another schema than the namespace's "
            f"(log version {state.version}): {schemas.difference(state.schema, declared, 'the namespace')}; "
            "declare the namespace's schema (batchweave.read_schema), or use a new namespace"
        )
