"""BatchWeave: an object-store-native data plane for large-model training.

Producers publish Transactional Global Batches (TGBs) with create-only puts of the next
log version; training ranks read exactly their own slice of each step. The object store
is the only shared component.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchweave.errors import (
    BatchWeaveError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptDataError,
    DataReclaimedError,
    FlushTimeoutError,
    LayoutError,
    NamespaceOverlapError,
    NotDurableError,
    ObjectExistsError,
    ObjectNotFoundError,
    PoolFailedError,
    ProducerClosedError,
    ProducerFencedError,
    SchemaError,
    SourceOffsetError,
    StepTimeoutError,
    StoreError,
    StorePermissionError,
    StreamEndedError,
    TransientStoreError,
)

__version__ = "0.1.0"

# The rest of the API is imported on first use (PEP 562): `import batchweave.errors`, and
# `batchweave --version` or `--help`, need neither numpy nor the store. Each name, by the
# module that defines it; the imports below are the same for type checkers.
_LAZY = {
    **dict.fromkeys(("AIMD", "DAC", "INCR", "CommitPolicy", "Fixed", "Manual", "Naive"), "batchweave.commit.policies"),
    **dict.fromkeys(("Batch", "Consumer"), "batchweave.consumer"),
    "evaluation_pass": "batchweave.evaluation",
    **dict.fromkeys(("NamespaceInfo", "inspect_namespace", "read_schema"), "batchweave.inspect"),
    "Collector": "batchweave.lifecycle.collector",
    **dict.fromkeys(("GCReport", "collect_garbage"), "batchweave.lifecycle.gc"),
    "release_checkpoint": "batchweave.lifecycle.watermarks",
    "Mesh": "batchweave.mesh",
    **dict.fromkeys(("MixPlan", "Mixture", "SampleRef", "Step"), "batchweave.mixing"),
    **dict.fromkeys(("PoolReport", "run_pool"), "batchweave.pool"),
    **dict.fromkeys(("Producer", "end_stream"), "batchweave.producer"),
    **dict.fromkeys(("NodeSharing", "ReadOptions"), "batchweave.reading.options"),
    "ProducerOptions": "batchweave.writing.options",
    **dict.fromkeys(("ArraySchema", "Schema"), "batchweave.schema"),
    **dict.fromkeys(("IndexedSource", "ShardedSource"), "batchweave.shuffle"),
}
if TYPE_CHECKING:
    from batchweave.commit.policies import AIMD, DAC, INCR, CommitPolicy, Fixed, Manual, Naive
    from batchweave.consumer import Batch, Consumer
    from batchweave.evaluation import evaluation_pass
    from batchweave.inspect import NamespaceInfo, inspect_namespace, read_schema
    from batchweave.lifecycle.collector import Collector
    from batchweave.lifecycle.gc import GCReport, collect_garbage
    from batchweave.lifecycle.watermarks import release_checkpoint
    from batchweave.mesh import Mesh
    from batchweave.mixing import MixPlan, Mixture, SampleRef, Step
    from batchweave.pool import PoolReport, run_pool
    from batchweave.producer import Producer, end_stream
    from batchweave.reading.options import NodeSharing, ReadOptions
    from batchweave.schema import ArraySchema, Schema
    from batchweave.shuffle import IndexedSource, ShardedSource
    from batchweave.writing.options import ProducerOptions


def __getattr__(name: str) -> Any:
    """A name of the API, imported from its module on first use (then kept here)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchweave' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AIMD",
    "DAC",
    "INCR",
    "ArraySchema",
    "Batch",
    "BatchWeaveError",
    "CheckpointNotFoundError",
    "Collector",
    "CommitPolicy",
    "ConfigError",
    "Consumer",
    "CorruptDataError",
    "DataReclaimedError",
    "Fixed",
    "FlushTimeoutError",
    "GCReport",
    "IndexedSource",
    "LayoutError",
    "Manual",
    "Mesh",
    "MixPlan",
    "Mixture",
    "Naive",
    "NamespaceInfo",
    "NamespaceOverlapError",
    "NodeSharing",
    "NotDurableError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "PoolFailedError",
    "PoolReport",
    "Producer",
    "ProducerClosedError",
    "ProducerFencedError",
    "ProducerOptions",
    "ReadOptions",
    "SampleRef",
    "Schema",
    "SchemaError",
    "ShardedSource",
    "SourceOffsetError",
    "Step",
    "StepTimeoutError",
    "StoreError",
    "StorePermissionError",
    "StreamEndedError",
    "TransientStoreError",
    "__version__",
    "collect_garbage",
    "end_stream",
    "evaluation_pass",
    "inspect_namespace",
    "read_schema",
    "release_checkpoint",
    "run_pool",
]
