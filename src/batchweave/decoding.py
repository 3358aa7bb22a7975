"""Decoding stored bytes: every way a decode can fail, as one ``CorruptDataError`` that
names the object. Pure.

msgspec raises ``DecodeError`` (``ValidationError`` is one) for malformed or mistyped
input, but also ``UnicodeDecodeError`` for invalid UTF-8 in an object key or a string
value it turns into ``str`` (not a ``DecodeError`` in msgspec 0.22), and, defensively,
``RecursionError`` (it nests on the C stack). Each
decoder of a stored format runs inside ``decoding`` so that none of them can let one of
those escape untyped (a garbage-collection summary once caught only the first).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import msgspec

from batchweave.errors import CorruptDataError

__all__ = ["DECODE_ERRORS", "decoding"]

DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


@contextmanager
def decoding(key: str, what: str, also: tuple[type[Exception], ...] = ()) -> Generator[None]:
    """Raise ``CorruptDataError(key, "<what>: <cause>")`` for any decode failure in the
    block (and for the exception types in ``also``, e.g. ``zlib.error`` for compressed
    formats)."""
    try:
        yield
    except (*DECODE_ERRORS, *also) as exc:
        raise CorruptDataError(key, f"{what}: {exc}") from exc
