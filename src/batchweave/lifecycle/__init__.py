"""Reclaiming storage: checkpoint watermarks and garbage collection.

``Collector`` (garbage collection as a service, ``batchweave gc URL --every S``) and
``CollectionRun`` are importable from here; the modules load on first use, so importing
``batchweave.lifecycle.watermarks`` does not load the collector.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY: dict[str, str] = dict.fromkeys(("CollectionRun", "Collector"), "batchweave.lifecycle.collector")
if TYPE_CHECKING:
    from batchweave.lifecycle.collector import CollectionRun, Collector

__all__ = ["CollectionRun", "Collector"]


def __getattr__(name: str) -> Any:
    """A name of ``__all__``, imported from its module on first use (then kept here)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchweave.lifecycle' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
