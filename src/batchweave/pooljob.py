"""What a producer pool's workers share, whichever backend runs them: the plan (which
producer owns which shard), the job (everything a worker needs, the same value in every
process), one producer's run over its shards, the report and the progress bar.

``batchweave.pool`` (the local backend, and ``run_pool``) and ``batchweave.ray_pool``
both import this module, and neither imports the other at import time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchweave.errors import ConfigError
from batchweave.keys import check_name
from batchweave.producer import Producer
from batchweave.reading.polling import HEAD_BUDGET_PER_S
from batchweave.schema import Schema
from batchweave.writing.options import ProducerOptions, SchemaSpec

__all__ = ["PoolJob", "PoolPlan", "PoolReport", "Progress", "job_options", "produce_shards", "start_delay_s"]


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """Which producer owns which shard: pure, the same in every process and every restart."""

    name: str
    producers: int
    shards: int

    def __post_init__(self) -> None:
        check_name(self.name, "pool name")
        if not isinstance(self.producers, int) or self.producers < 1:
            raise ConfigError(f"a pool needs at least one producer, got {self.producers!r}")
        if self.shards < 0:
            raise ConfigError(f"shard count must be non-negative, got {self.shards}")

    def producer_id(self, index: int) -> str:
        return f"{self.name}.{index:04d}-of-{self.producers:04d}"

    def shard(self, index: int, offset: int) -> int:
        """The shard producer ``index`` turns into its TGB at source offset ``offset``."""
        return index + offset * self.producers

    def shard_count(self, index: int) -> int:
        """How many shards producer ``index`` owns (its final offset)."""
        return len(range(index, self.shards, self.producers))

    def check_committed(self, offsets: Mapping[str, int]) -> None:
        """Refuse a list too short for what this pool's producers committed (``offsets``:
        producer id -> next offset, as the log has them; other producers are ignored).

        The shard-list record refuses a shorter list already; this covers a pool that has
        no record (started before records existed, or its record was deleted).
        """
        for index in range(self.producers):
            committed = offsets.get(self.producer_id(index), 0)
            if committed > self.shard_count(index):
                raise ConfigError(
                    f"pool {self.name!r}: producer {self.producer_id(index)} committed {committed} shards, but "
                    f"{self.shards} shards give it only {self.shard_count(index)}: the list lost shards it "
                    "produced. Restart the pool with its full list (shards can only be appended)"
                )

    def check_log(self, producer_ids: Sequence[str]) -> None:
        """Refuse a pool of the same name that the log knows with another producer count."""
        pattern = re.compile(rf"^{re.escape(self.name)}\.\d{{4,}}-of-(\d{{4,}})$")
        sizes = {int(m[1]) for pid in producer_ids if (m := pattern.match(pid))}
        other = sorted(sizes - {self.producers})
        if other:
            raise ConfigError(
                f"pool {self.name!r} was started with {other[0]} producers, now with {self.producers}: "
                f"its shards are assigned by producer count, so restart it with {other[0]} producers "
                "(or give the new pool another name and namespace)"
            )


@dataclass(slots=True)
class PoolReport:
    """What a pool run did: per producer, the shards it owns and where it started."""

    name: str
    producers: int
    shards: int
    resumed_at: dict[str, int] = field(default_factory=dict)  # producer id -> first offset of this run
    restarts: dict[str, int] = field(default_factory=dict)  # producer id -> worker restarts
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # producer id -> Producer.metrics()
    seconds: float = 0.0

    @property
    def produced(self) -> int:
        """Shards turned into TGBs by this run (not by earlier runs of the same pool)."""
        return sum(int(m.get("tgbs_committed", 0)) for m in self.metrics.values())


@dataclass(frozen=True)
class PoolJob:
    """Everything a worker of either backend needs: the same value crosses to every process.

    ``options_json`` is the producers' ``ProducerOptions`` as JSON (``ProducerOptions.to_json``):
    our options cross processes encoded, never pickled (a policy by its name); ``options``
    decodes them. Build a job with ``PoolJob.of``."""

    url: str
    plan: PoolPlan
    source: Sequence[Any]
    preprocess: Callable[[Any], Sequence[Any]]
    dp: int
    cp: int
    max_restarts: int
    options_json: bytes = field(repr=False)  # storage options may hold credentials: never in a repr or a log

    @classmethod
    def of(
        cls,
        url: str,
        plan: PoolPlan,
        source: Sequence[Any],
        preprocess: Callable[[Any], Sequence[Any]],
        dp: int,
        cp: int,
        max_restarts: int,
        options: ProducerOptions,
    ) -> PoolJob:
        """The job, its options encoded (ConfigError for options that cannot cross:
        ``ProducerOptions.to_json``)."""
        return cls(url, plan, source, preprocess, dp, cp, max_restarts, options.to_json())

    @property
    def options(self) -> ProducerOptions:
        """The options every producer of the job is built with, decoded."""
        return ProducerOptions.from_json(self.options_json)

    def produce(self, index: int, on_append: Callable[[int, int], None] | None = None) -> tuple[int, dict[str, float]]:
        """Run producer ``index`` of this job (``produce_shards``)."""
        return produce_shards(
            self.url,
            self.plan,
            index,
            self.source,
            self.preprocess,
            self.dp,
            self.cp,
            options=self.options,
            on_append=on_append,
        )


# Producers a pool starts a second. A start reads the same few log keys as every other's
# (the snapshot listing, the versions it proves its view by, about three requests to the
# busiest of them: measured in ``bench scale``), so a third of the head budget keeps
# that key within it.
START_RATE_PER_S = HEAD_BUDGET_PER_S / 3


def start_delay_s(index: int) -> float:
    """How long worker ``index`` waits before its producer starts: a pool whose workers
    all start at once sent each of those keys one request per worker within a second.
    1,000 workers: the last starts after 43 s; 8 after 0.3 s."""
    return index / START_RATE_PER_S


def produce_shards(
    url: str,
    plan: PoolPlan,
    index: int,
    source: Sequence[Any],
    preprocess: Callable[[Any], Sequence[Any]],
    dp: int,
    cp: int = 1,
    commit_policy: str | None = None,
    on_append: Callable[[int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    schema: Schema | None = None,
    *,
    options: ProducerOptions | None = None,
) -> tuple[int, dict[str, float]]:
    """One producer of the pool, from where the log says it is to its last shard.

    The body of every backend's worker. ``options`` are the producer's
    (``ProducerOptions``); ``commit_policy``, ``storage_options`` and ``schema`` are the
    older way to give three of them (giving both is a ConfigError). ``on_append(index,
    offset)`` is called once with the offset it resumes at minus one, then after each TGB
    is appended (for progress). Returns (the offset it resumed at, its metrics).
    """
    options = job_options(options, commit_policy=commit_policy, storage_options=storage_options, schema=schema)
    time.sleep(start_delay_s(index))
    producer_id = plan.producer_id(index)
    with Producer(url, producer_id, dp, cp, options=options) as producer:
        resumed_at = producer.resume_offset
        if on_append is not None:
            on_append(index, resumed_at - 1)
        for offset in range(resumed_at, plan.shard_count(index)):
            try:
                slices = preprocess(source[plan.shard(index, offset)])
            except Exception:
                producer.flush()  # keep what came before the bad shard: a restart resumes there
                raise
            producer.append(slices, source_offset=offset)
            if on_append is not None:
                on_append(index, offset)
        producer.flush()
        return resumed_at, producer.metrics()


def job_options(
    options: ProducerOptions | None,
    *,
    commit_policy: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    schema: SchemaSpec | None = None,
) -> ProducerOptions:
    """A pool's producer options: ``options``, or the three a pool took one by one before
    (``commit_policy``, ``storage_options``, ``schema``); ConfigError when given both."""
    given = {
        name: value
        for name, value in (("commit_policy", commit_policy), ("storage_options", storage_options), ("schema", schema))
        if value is not None
    }
    if options is not None and given:
        raise ConfigError(
            f"give options=ProducerOptions(...) or {', '.join(given)}, not both: put "
            f"{' and '.join(given)} in the ProducerOptions"
        )
    return ProducerOptions.build(options, **given)


class Progress:
    """A rich progress bar per pool (shards appended), or nothing when not wanted."""

    def __init__(self, plan: PoolPlan, enabled: bool) -> None:
        self._plan = plan
        self._enabled = enabled
        self._done: dict[int, int] = {}

    def __enter__(self) -> Progress:
        if self._enabled:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()
            self._task = self._bar.add_task(f"pool {self._plan.name}", total=self._plan.shards)
        return self

    def appended(self, index: int, offset: int) -> None:
        self._done[index] = max(self._done.get(index, 0), offset + 1)
        if self._enabled:
            self._bar.update(self._task, completed=sum(self._done.values()))

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            self._bar.stop()
