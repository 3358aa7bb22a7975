"""A store with the latency, bandwidth and faults of a cloud object store, for benchmarks
and chaos tests. Wraps any store URL (usually ``memory://``) and delays every request.

The model, per request (all times in seconds):

    put     put_s        + nbytes / bandwidth_bytes_s   (the write applies half-way through)
    get     first_byte_s + nbytes / bandwidth_bytes_s   (a miss costs first_byte_s)
    head    head_s       list  list_s       delete  delete_s

each multiplied by a log-normal factor with median 1 and shape ``jitter_sigma`` (the
long right tail of real object stores). Faults: ``error_rate`` fails a request before it
is applied (a 503 SlowDown), ``ambiguous_rate`` fails a write *after* it was applied (a
timeout whose write landed); both go through the normal retry path of ``Store``.

``GrowingManifest`` adds the paper's commit cost on top, for ablations: there every
commit reads the whole manifest (every TGB so far) and writes it anew, so a commit's
fragile window grows with history. Our log writes a delta instead, and its window is flat.

Default figures, for S3 Standard in-region from one client connection:
- first-byte latency of small GETs about 20-30 ms median with a long tail, and about
  80-90 MB/s per connection: Durner, Leis, Neumann, "Exploiting Cloud Object Storage
  for High-Performance Analytics", PVLDB 16(11), 2023, sections 2.2-2.4;
- small PUTs slower than GETs (tens of ms) and "100-200 ms" first-byte latency as the
  conservative planning figure: AWS, "Best practices design patterns: optimizing Amazon
  S3 performance" (performance guidelines, latency-sensitive applications).
We take GET 25 ms, PUT 40 ms, HEAD 15 ms, LIST 40 ms, DELETE 20 ms, 90 MB/s, sigma 0.3.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from batchweave import keys, log
from batchweave.errors import ConfigError
from batchweave.store import Store
from batchweave.store.localfs import Data

__all__ = ["CLOUD_DEFAULTS", "GrowingManifest", "LatencyModel", "LatencyStore"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Per-request latency (seconds), bandwidth (bytes/s) and fault rates (0..1)."""

    put_s: float = 0.040
    first_byte_s: float = 0.025
    head_s: float = 0.015
    list_s: float = 0.040
    delete_s: float = 0.020
    bandwidth_bytes_s: float = 90e6
    jitter_sigma: float = 0.3
    error_rate: float = 0.0
    ambiguous_rate: float = 0.0

    def __post_init__(self) -> None:
        times = (self.put_s, self.first_byte_s, self.head_s, self.list_s, self.delete_s, self.jitter_sigma)
        if min(times) < 0 or self.bandwidth_bytes_s <= 0:
            raise ConfigError(f"latency model needs non-negative times and positive bandwidth: {self}")
        if not (0 <= self.error_rate < 1 and 0 <= self.ambiguous_rate < 1):
            raise ConfigError(f"fault rates must be in [0, 1): {self}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def base_s(self, request: str, nbytes: int) -> float:
        """The median duration of one request moving ``nbytes``."""
        fixed = {
            "put": self.put_s,
            "get": self.first_byte_s,
            "head": self.head_s,
            "list": self.list_s,
            "delete": self.delete_s,
        }[request]
        return fixed + nbytes / self.bandwidth_bytes_s


CLOUD_DEFAULTS = LatencyModel()


@dataclass(frozen=True, slots=True)
class GrowingManifest:
    """The paper's commit cost (section 4.2): a manifest version holds every TGB so far.

    Committing reads the newest manifest and writes a new one, both the size of the
    whole TGB list, inside the fragile window. ``LatencyStore`` charges that transfer on
    each log version's put, before the put applies, so conflicts and every policy's
    measured window see it. ``entry_bytes`` is one TGB's entry; ``history_tgbs`` TGBs
    are taken as committed before the run (a long job's manifest, from the first commit).
    """

    entry_bytes: int
    history_tgbs: int = 0

    def __post_init__(self) -> None:
        if self.entry_bytes < 1 or self.history_tgbs < 0:
            raise ConfigError(f"a growing manifest needs entry_bytes >= 1 and history_tgbs >= 0: {self}")

    def commit_bytes(self, tgbs_before: int, tgbs_added: int) -> int:
        """Bytes a commit moves: read the manifest before it, write the one after it."""
        before = self.history_tgbs + tgbs_before
        return (2 * before + tgbs_added) * self.entry_bytes

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class LatencyStore(Store):
    """``Store`` over ``url`` whose every request takes the time ``model`` says.

    Picklable like any Store; ``seed`` makes the jitter and the faults repeatable.
    """

    def __init__(
        self,
        url: str,
        model: LatencyModel = CLOUD_DEFAULTS,
        *,
        seed: int | None = None,
        discard_prefix: str | None = None,
        manifest: GrowingManifest | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        self.model = model
        self.seed = seed
        self.manifest = manifest
        # Ingestion benchmarks time every data write but need not keep gigabytes in memory.
        self.discard_prefix = discard_prefix
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._paused = False
        self.requests: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {
            **super().__getstate__(),
            "model": self.model,
            "seed": self.seed,
            "discard_prefix": self.discard_prefix,
            "manifest": self.manifest,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        model, seed, discard = state.pop("model"), state.pop("seed"), state.pop("discard_prefix")
        self.__init__(
            state["url"],
            model,
            seed=seed,
            discard_prefix=discard,
            manifest=state.pop("manifest"),
            create=state["create"],
            max_attempts=state["max_attempts"],
            storage_options=state["storage_options"],
        )

    def __repr__(self) -> str:
        return f"LatencyStore({self.url!r}, {self.model})"

    @property
    def remote(self) -> bool:
        return True  # it models a cloud object store, whatever it keeps the bytes in

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Requests in this block (in this process) take no modelled time: benchmark set-up."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if self.discard_prefix is not None and key.startswith(self.discard_prefix):
            self._call(key, lambda: None, "put", len(data), conditional=True)
            return
        if self.manifest is not None and not self._paused and _is_version_key(key):
            self._charge_manifest(key, data)
        super().put_if_absent(key, data)

    def stage_if_absent(self, key: str, data: Data, size: int | None = None) -> None:
        """A TGB's objects as a real store takes them: the pieces in one request, not
        joined first (joining an 800 KB TGB took 0.8 ms, 1.6% of its modelled put, that no
        real store pays). Staged keys are data objects, never log versions. A subclass that
        intercepts ``put_if_absent`` still sees every put there (``Store.stage_if_absent``)."""
        if type(self).put_if_absent is not LatencyStore.put_if_absent:
            super().stage_if_absent(key, data, size)
            return
        if self.discard_prefix is not None and key.startswith(self.discard_prefix):
            pieces = data if isinstance(data, list) else [data]
            nbytes = size if size is not None else sum(memoryview(piece).nbytes for piece in pieces)
            self._call(key, lambda: None, "put", nbytes, conditional=True)
            return
        self._stage(key, data, size)

    def _charge_manifest(self, key: str, data: bytes | memoryview) -> None:
        version = log.decode_version_head(data, key, int(key[len(keys.LOG_PREFIX) : -len(".json")]))
        assert self.manifest is not None
        nbytes = self.manifest.commit_bytes(version.first_step, version.tgb_count())
        factor, _, _ = self._draw()
        time.sleep(nbytes / self.model.bandwidth_bytes_s * factor)

    def _draw(self) -> tuple[float, float, float]:
        with self._lock:  # random.Random is not safe to share between threads unguarded
            return self._rng.lognormvariate(0.0, self.model.jitter_sigma), self._rng.random(), self._rng.random()

    def _perform(self, request: str, nbytes: int, op: Callable[[], T]) -> T:
        if self._paused:
            return op()
        with self._lock:
            self.requests[request] = self.requests.get(request, 0) + 1
        factor, fault, ambiguous = self._draw()
        if request == "put":
            duration = self.model.base_s("put", nbytes) * factor
            time.sleep(duration / 2)
            if fault < self.model.error_rate:
                raise ConnectionError("503 SlowDown (injected by LatencyStore)")
            result = op()
            time.sleep(duration / 2)
            if ambiguous < self.model.ambiguous_rate:
                raise TimeoutError("request timed out (injected by LatencyStore) after the write was applied")
            return result
        if fault < self.model.error_rate:
            time.sleep(self.model.base_s(request, 0) * factor)
            raise ConnectionError("503 SlowDown (injected by LatencyStore)")
        try:
            result = op()
        except Exception:
            time.sleep(self.model.base_s(request, 0) * factor)  # a miss still costs a round trip
            raise
        size = len(result) if isinstance(result, memoryview) else 0
        time.sleep(self.model.base_s(request, size) * factor)
        return result


def _is_version_key(key: str) -> bool:
    name = key[len(keys.LOG_PREFIX) :]
    return key.startswith(keys.LOG_PREFIX) and "/" not in name and name.endswith(".json") and name[:-5].isdigit()
