"""BatchWeave: an object-store-native data plane for large-model training.

Producers publish Transactional Global Batches (TGBs) with create-only puts of the next
log version; training ranks read exactly their own slice of each step. The object store
is the only shared component.
"""

from batchweave.commit.policies import AIMD, DAC, INCR, CommitPolicy, Fixed, Manual, Naive
from batchweave.consumer import Batch, Consumer
from batchweave.errors import (
    BatchWeaveError,
    ConfigError,
    CorruptDataError,
    DataReclaimedError,
    LayoutError,
    NotDurableError,
    ObjectExistsError,
    ObjectNotFoundError,
    ProducerFencedError,
    SchemaError,
    SourceOffsetError,
    StepTimeoutError,
    StoreError,
    StorePermissionError,
    StreamEndedError,
    TransientStoreError,
)
from batchweave.evaluation import evaluation_pass
from batchweave.inspect import NamespaceInfo, inspect_namespace, read_schema
from batchweave.lifecycle.gc import GCReport, collect_garbage
from batchweave.lifecycle.watermarks import release_checkpoint
from batchweave.mesh import Mesh
from batchweave.mixing import MixPlan, Mixture, SampleRef, Step
from batchweave.pool import PoolReport, run_pool
from batchweave.producer import Producer, end_stream
from batchweave.schema import ArraySchema, Schema
from batchweave.shuffle import IndexedSource, ShardedSource

__version__ = "0.1.0"

__all__ = [
    "AIMD",
    "DAC",
    "INCR",
    "ArraySchema",
    "Batch",
    "BatchWeaveError",
    "CommitPolicy",
    "ConfigError",
    "Consumer",
    "CorruptDataError",
    "DataReclaimedError",
    "Fixed",
    "GCReport",
    "IndexedSource",
    "LayoutError",
    "Manual",
    "Mesh",
    "MixPlan",
    "Mixture",
    "Naive",
    "NamespaceInfo",
    "NotDurableError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "PoolReport",
    "Producer",
    "ProducerFencedError",
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
