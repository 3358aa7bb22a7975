"""The latency proxy moved to ``batchweave.testing.proxy`` (it also injects S3 errors there)."""

from __future__ import annotations

from batchweave.testing.proxy import LatencyProxy, ProxyCounters

__all__ = ["LatencyProxy", "ProxyCounters"]
