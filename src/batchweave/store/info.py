"""What a listing says about one object (``ObjectInfo``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ObjectInfo"]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object: key relative to the namespace, size in bytes, last write (Unix s)."""

    key: str
    size: int
    modified_s: float = 0.0
