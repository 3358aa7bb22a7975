"""Producer pools: a preprocessing function over a source of shards, with N producers.

    report = bw.run_pool("s3://bucket/run-7", "prep", shards, tokenize_and_pack, producers=16, dp=8)

``source`` is a sequence of shards (paths, URLs, or small items); ``preprocess(shard)``
turns one shard into one TGB: a list of ``dp * cp`` slice payloads, as ``Producer.append``
takes them. Every shard becomes exactly one TGB, exactly once, whatever crashes:

- Producer ``i`` of ``N`` is named ``<name>.<i>-of-<N>`` (stable across restarts) and owns
  shards ``i, i + N, i + 2N, ...``; its ``k``-th shard is its source offset ``k``. The
  log records each producer's next offset (exactly-once, invariant I3), so a restarted
  producer resumes at ``resume_offset`` and maps it back to its next shard: nothing is
  repeated or skipped, and an old incarnation still running is fenced.
- The mapping needs N to stay the same: a pool restarted with another producer count is
  refused with ``ConfigError`` (its shard assignment would differ).
- It also needs the list to keep its order. At its first start a pool records a
  fingerprint of its shard list under ``_pools/<name>/`` (``batchweave.shardlist``); a
  restart over the same list resumes, one with shards appended at the end is allowed
  (and recorded), and any other list (a shard changed, inserted, removed or moved,
  another dataset under the same name) is refused with ``ConfigError`` naming the first
  shard index that differs, before any producer starts. The check costs one LIST and
  one GET (and one create-only put when the list is new or longer), however many shards.
- A worker process that dies (an exception, an OOM kill, a SIGKILL) is started again, up
  to ``max_restarts`` times per producer; a whole pool started again after a crash of
  its driver resumes every producer where the log says it is.

Backends: ``"local"`` runs one spawned process per producer on this machine; ``"ray"``
runs one Ray actor per producer on the Ray cluster this process is attached to, with
Ray's own actor restarts doing recovery (``batchweave.ray_pool``, the ``batchweave[ray]``
extra). Either way each worker imports ``preprocess`` by reference, so it must be a
module-level function of a module the workers can import.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from batchweave import shardlist
from batchweave.commit.policies import resolve_policy
from batchweave.errors import ConfigError, ObjectExistsError, PoolFailedError, StoreError
from batchweave.journal import Journal
from batchweave.pooljob import PoolJob, PoolPlan, PoolReport, Progress, job_options, produce_shards
from batchweave.producer import end_stream
from batchweave.schema import Schema
from batchweave.shardlist import ShardListRecord
from batchweave.store import Store, open_store
from batchweave.writing.options import ProducerOptions

__all__ = ["PoolJob", "PoolPlan", "PoolReport", "check_shard_list", "produce_shards", "run_pool"]

_BACKENDS = ("local", "ray")  # "ray": batchweave.ray_pool, imported only when asked for


def run_pool(
    url: str,
    name: str,
    source: Sequence[Any],
    preprocess: Callable[[Any], Sequence[Any]],
    *,
    producers: int,
    dp: int,
    cp: int = 1,
    backend: str = "local",
    options: ProducerOptions | None = None,
    commit_policy: str | None = None,
    max_restarts: int = 3,
    end_of_stream: bool = False,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    ray_remote_args: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None = None,
    schema: Schema | Mapping[str, tuple[Any, Sequence[int | None]]] | None = None,
) -> PoolReport:
    """Turn every shard of ``source`` into one TGB of the namespace at ``url``; see the module doc.

    ``options``: how every producer writes (``ProducerOptions``: the commit policy,
    ``storage_options``, ``schema``, ``max_lag``, packing, ...), carried whole to every
    worker, encoded (``ProducerOptions.to_json``: a commit policy by its name, and storage
    options of plain data only; anything else is a ConfigError here, before any worker
    starts). ``commit_policy``, ``storage_options`` and ``schema`` are the older way to
    give three of them (giving them with ``options`` is a ConfigError): ``commit_policy``
    is a policy name (None: the producer's default, group commit); ``schema`` is what every producer declares
    (``Producer(schema=...)``: arrays whose first dimension varies). The options are
    checked here, before any worker starts; ``storage_options`` also open the store here.
    ``end_of_stream`` commits the end marker once every shard is committed. Raises the
    first worker error that restarts did not cure, as a ``PoolFailedError`` naming the
    producer, its attempts and the error (type and message).
    ``ray_remote_args`` (Ray backend only): Ray actor options for every producer actor
    (``resources``, ``scheduling_strategy``, ``num_cpus``, ``runtime_env``, ...), or a function
    of the producer index returning them; see ``batchweave.ray_pool``.
    """
    if backend not in _BACKENDS:
        raise ConfigError(f"unknown pool backend {backend!r}; known: {list(_BACKENDS)}")
    if ray_remote_args is not None and backend != "ray":
        raise ConfigError(f"ray_remote_args places Ray actors: it needs backend='ray', not {backend!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
    # A bad option (a schema, a policy object that cannot cross, an unknown policy name) is
    # refused here, not by every worker in turn.
    producer_options = job_options(options, commit_policy=commit_policy, storage_options=storage_options, schema=schema)
    encoded = producer_options.to_json()
    resolve_policy(producer_options.commit_policy)
    plan = PoolPlan(name, producers, len(source))
    # The Ray actors' options are checked before the store is touched.
    ray_options = _ray_actor_options(plan, ray_remote_args) if backend == "ray" else None
    store_options = producer_options.storage_options
    store = open_store(url, storage_options=None if store_options is None else dict(store_options))
    producer_states = Journal(store).load_state().producers
    plan.check_log(list(producer_states))
    # The last check: it records a new or longer list.
    check_shard_list(store, plan, source, {pid: state.offset for pid, state in producer_states.items()})
    started = time.monotonic()
    report = PoolReport(name, producers, len(source))
    job = PoolJob(store.url, plan, source, preprocess, dp, cp, max_restarts, encoded)
    if ray_options is not None:
        from batchweave.ray_pool import run_ray_pool

        run_ray_pool(job, report, progress, ray_options)
    else:
        _LocalPool(job).run(report, progress)
    report.seconds = time.monotonic() - started
    if end_of_stream:
        end_stream(store)
    return report


def _ray_actor_options(plan: PoolPlan, ray_remote_args: Any) -> list[dict[str, Any]]:
    from batchweave.ray_pool import producer_options  # imports ray: only for the Ray backend

    return [producer_options(plan, index, ray_remote_args) for index in range(plan.producers)]


_RECORD_ATTEMPTS = 8  # each retry means another driver recorded a list of this pool meanwhile


def check_shard_list(
    store: Store, plan: PoolPlan, source: Sequence[Any], committed: Mapping[str, int] | None = None
) -> ShardListRecord:
    """Compare ``source`` with the shard list pool ``plan.name`` recorded; record it when new or appended.

    Returns the record that now holds. Raises ConfigError (naming the pool and the first
    shard index that differs, or the count that shrank) for any other list, and for a
    shard without a canonical encoding. Costs one LIST and one GET of the store, plus one
    create-only put when the list is new or longer. Two drivers starting the same pool at
    once race for that put: one wins, the other compares its list with the winner's.

    ``committed`` (producer id -> next offset, from the log) matters only when there is no
    record yet: a pool started before records existed adopts ``source`` as its list, unless
    its producers committed more shards than ``source`` gives them (``PoolPlan.check_committed``).
    """
    for _ in range(_RECORD_ATTEMPTS):
        recorded = _newest_record(store, plan.name)
        record = _record_for(plan, source, recorded, committed or {})
        if record is recorded:
            return record  # the same list: nothing to write
        store.require_create_only()  # racing drivers are told apart by this put alone
        try:
            store.put_if_absent(shardlist.record_key(plan.name, record.version), shardlist.encode_record(record))
        except ObjectExistsError:
            continue  # another driver recorded first (or our own put landed and its answer was lost)
        return record
    raise StoreError(
        f"{shardlist.POOL_PREFIX}{plan.name}/",
        f"the pool's shard-list record kept changing over {_RECORD_ATTEMPTS} reads",
    )


def _record_for(
    plan: PoolPlan, source: Sequence[Any], recorded: ShardListRecord | None, committed: Mapping[str, int]
) -> ShardListRecord:
    """The record that holds ``source``: ``recorded`` itself, or a new one to write; ConfigError if refused."""
    lengths = shardlist.checkpoint_lengths(len(source))
    if recorded is None:  # a first start (a start that crashed before recording ran no producer)
        plan.check_committed(committed)
        return ShardListRecord.of(plan.name, 0, len(source), shardlist.prefix_digests(plan.name, source, lengths))
    digests = shardlist.prefix_digests(plan.name, source, {*lengths, recorded.shards})
    verdict = shardlist.compare(recorded, len(source), digests)
    if verdict.refused:
        raise ConfigError(verdict.message(plan.name, shardlist.record_key(plan.name, recorded.version)))
    if verdict.kind == "same":
        return recorded
    return ShardListRecord.of(plan.name, recorded.version + 1, len(source), digests)


def _newest_record(store: Store, name: str) -> ShardListRecord | None:
    listed = (info.key for info in store.list(f"{shardlist.POOL_PREFIX}{name}/"))
    key = shardlist.newest_record_key(name, listed)
    return None if key is None else shardlist.decode_record(store.get(key), key, name)


class _LocalPool:
    """One spawned process per producer; a dead worker is started again, up to a limit.

    Each worker reports over a pipe of its own: a shared multiprocessing.Queue has one
    lock for all writers, and a worker SIGKILLed while holding it would block the rest.
    """

    def __init__(self, job: PoolJob) -> None:
        # spawn, not fork: obstore's I/O runtime does not survive fork (store.requests).
        self._context = multiprocessing.get_context("spawn")
        self._job = job
        self._plan = job.plan
        self._errors: dict[str, tuple[str, str]] = {}  # producer id -> its worker's last error: type, message

    def run(self, report: PoolReport, progress: bool) -> None:
        workers = {i: self._start(i) for i in range(self._plan.producers)}
        report.restarts = {self._plan.producer_id(i): 0 for i in workers}
        try:
            with Progress(self._plan, progress) as shown:
                while workers:
                    waitables = [w for process, pipe in workers.values() for w in (process.sentinel, pipe)]
                    multiprocessing.connection.wait(waitables)
                    for index, (process, pipe) in list(workers.items()):
                        self._drain(index, pipe, report, shown, until_eof=process.exitcode is not None)
                        if process.exitcode is None:
                            continue
                        if self._plan.producer_id(index) in report.metrics:
                            del workers[index]  # finished and reported
                        else:
                            workers[index] = self._restart(index, process.exitcode, report)
        finally:
            for process, pipe in workers.values():
                process.kill()  # only our own workers, by their handles
                process.join()
                pipe.close()

    def _start(self, index: int) -> tuple[Any, Any]:
        reader, writer = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_local_worker, args=(self._job, index, writer), name=self._plan.producer_id(index)
        )
        process.start()
        writer.close()  # the worker holds the only writing end: its exit is our end of file
        return process, reader

    def _restart(self, index: int, exitcode: int, report: PoolReport) -> tuple[Any, Any]:
        pid = self._plan.producer_id(index)
        if report.restarts[pid] >= self._job.max_restarts:
            cause_type, cause = self._errors.get(pid, ("", ""))
            raise PoolFailedError(
                self._plan.name,
                pid,
                report.restarts[pid] + 1,
                cause_type,
                cause,
                detail=f" (last exit code {exitcode})",
            )
        report.restarts[pid] += 1
        return self._start(index)

    def _drain(self, index: int, pipe: Any, report: PoolReport, shown: Progress, until_eof: bool) -> None:
        """Apply a worker's messages: appended offsets, final metrics, errors. With
        ``until_eof`` (the worker has exited) read everything it left in the pipe."""
        pid = self._plan.producer_id(index)
        while until_eof or pipe.poll():
            try:
                kind, body = pipe.recv()
            except (EOFError, OSError):
                return  # the worker is gone (a message cut short by a kill counts as none)
            if kind == "appended":
                report.resumed_at.setdefault(pid, body + 1)  # the first message says where it resumed
                shown.appended(index, body)
            elif kind == "done":
                resumed_at, metrics = body
                report.resumed_at.setdefault(pid, resumed_at)
                report.metrics[pid] = metrics
            else:  # "error": kept for the message if the restarts run out
                self._errors[pid] = (str(body[0]), str(body[1]))


def _local_worker(job: PoolJob, index: int, pipe: Any) -> None:
    try:
        resumed_at, metrics = job.produce(index, on_append=lambda i, offset: pipe.send(("appended", offset)))
    except BaseException as exc:
        pipe.send(("error", (type(exc).__name__, str(exc))))
        raise
    pipe.send(("done", (resumed_at, metrics)))
    pipe.close()
