"""The Ray backend of producer pools: ``run_pool(..., backend="ray")``, for pools across machines.

Needs the ``batchweave[ray]`` extra; ``batchweave.pool`` imports this module only when the Ray
backend is asked for. The pool attaches to the Ray the calling process has initialised
(``ray.is_initialized()``); otherwise it calls ``ray.init()`` with no address, which joins the
cluster ``RAY_ADDRESS`` or a running local head names, or starts a new local one (left running
until the process exits, as Ray does).

Each producer is one Ray actor, named ``batchweave-pool:<producer id>`` in the job's namespace,
whose ``run`` method is ``batchweave.pool.produce_shards``: the same shard assignment
(``PoolPlan``), the same checks before any actor starts (producer count and shard list, in
``run_pool``) and the same resume from the log as the local backend. Recovery is Ray's: an
actor that dies (``ray.kill``, a SIGKILL, an OOM kill, its node lost) is restarted by Ray up to
``max_restarts`` times, and its ``run`` task is retried on the new incarnation
(``max_task_retries=-1``); the new ``Producer`` resumes where the log says, so nothing is
repeated or skipped and the old incarnation, if it still runs somewhere, is fenced. A
preprocessing error is not a death: the driver calls ``run`` again on the same actor, and both
kinds of retry count against the same ``max_restarts`` per producer.

Placement: producer actors are spread over the cluster's nodes (Ray's ``"SPREAD"``
strategy) unless ``ray_remote_args`` says otherwise: Ray actor options for every producer, or
a function of the producer index returning them (custom ``resources`` or ``num_cpus`` to
choose the nodes; ``NodeAffinitySchedulingStrategy(node_id, soft=False)`` pins a producer to
a node for good, ``soft=True`` only prefers it: Ray 2.60 may place it elsewhere while that
node is slow to start a worker, and restarts it elsewhere when the node is lost). The options the
pool sets itself (the actor's name and namespace, its restarts and lifetime) are refused.
A producer's actor is ended as soon as its run is done, so that what it reserved goes to
producers still waiting for room (a pool may have more producers than the cluster holds).
The small actor that gathers progress runs on the driver's node with no CPU reserved, so
losing any other node loses no pool state (a head node started with ``num_cpus=0``, as Ray
advises for large clusters, can host it).

The job, with the producers' options (``ProducerOptions``, carried as JSON: a commit policy
by its name, never pickled), and the ``source`` are put in Ray's object store once and
shared by every actor; ``preprocess`` is
pickled by reference when it is a module-level function, so its module must be importable on
every worker (install it, or give Ray a ``runtime_env``). The namespace URL must be reachable
from every node: an object store, or a directory they share (never ``memory://``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from batchweave.errors import ConfigError, PoolFailedError
from batchweave.pooljob import PoolJob, PoolPlan, PoolReport, Progress

__all__ = ["actor_name", "producer_options", "run_ray_pool"]

RemoteArgs = Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None
# Actor options the pool owns: the name is how ``ray.get_actor(actor_name(pid))`` finds a
# producer, restarts are ``run_pool``'s ``max_restarts``, and the pool kills its actors when
# it returns (a detached lifetime would not change that).
_POOL_OPTIONS = ("name", "namespace", "get_if_exists", "max_restarts", "max_task_retries", "lifetime")


def actor_name(producer_id: str) -> str:
    """The Ray actor name of a pool producer (``ray.get_actor(actor_name(pid))``)."""
    return f"batchweave-pool:{producer_id}"


# Every method called through a handle is decorated with ``ray.method``: a no-op at run
# time, it is how Ray's annotations give ``handle.method.remote`` a type.
@ray.remote
class _Tracker:
    """Progress and incarnations per producer, told by the producers (fire and forget)."""

    def __init__(self) -> None:
        self._starts: dict[int, list[int]] = {}  # index -> where each run began (incarnations, retries)
        self._runs: dict[int, int] = {}  # index -> runs begun, appended or not (a run killed before its
        # first append told no start: restarts counted from starts missed it)
        self._appended: dict[int, int] = {}

    @ray.method
    def began(self, index: int) -> None:
        self._runs[index] = self._runs.get(index, 0) + 1

    @ray.method
    def appended(self, index: int, offset: int) -> None:
        self._appended[index] = offset

    @ray.method
    def started(self, index: int, resumed_at: int) -> None:
        self._starts.setdefault(index, []).append(resumed_at)

    @ray.method
    def snapshot(self) -> tuple[dict[int, list[int]], dict[int, int]]:
        return self._starts, self._appended

    @ray.method
    def runs(self) -> dict[int, int]:
        return self._runs


@ray.remote
class _ProducerActor:
    def __init__(self, tracker: Any, job: PoolJob, index: int) -> None:
        self._tracker = tracker
        self._job = job
        self._index = index

    @ray.method
    def run(self) -> tuple[int, dict[str, float]]:
        ray.get(self._tracker.began.remote(self._index))  # told before any work: a kill cannot lose it
        first = [True]

        def on_append(index: int, offset: int) -> None:
            if first[0]:
                first[0] = False
                self._tracker.started.remote(index, offset + 1)
            else:
                self._tracker.appended.remote(index, offset)

        return self._job.produce(self._index, on_append=on_append)


def producer_options(plan: PoolPlan, index: int, remote_args: RemoteArgs) -> dict[str, Any]:
    """The Ray actor options the user gives producer ``index`` (``ray_remote_args`` of
    ``run_pool``), with ``scheduling_strategy="SPREAD"`` unless they chose one. Pure."""
    given = remote_args(index) if callable(remote_args) else remote_args
    pid = plan.producer_id(index)
    if given is None:
        given = {}
    if not isinstance(given, Mapping) or not all(isinstance(key, str) for key in given):
        raise ConfigError(
            f"pool {plan.name!r}: ray_remote_args for {pid} must be a dict of Ray actor options, got {given!r}"
        )
    owned = sorted(set(given) & set(_POOL_OPTIONS))
    if owned:
        raise ConfigError(
            f"pool {plan.name!r}: ray_remote_args for {pid} sets {owned}, which the pool sets itself "
            "(the actor name, its restarts: use run_pool's max_restarts)"
        )
    return {"scheduling_strategy": "SPREAD", **given}


def run_ray_pool(
    job: PoolJob, report: PoolReport, progress: bool, options: Sequence[Mapping[str, Any]] | None = None
) -> None:
    """Run every producer of ``job`` as a Ray actor until all are done; fill ``report``.
    ``options``: per producer index, its actor options (``producer_options``; default: spread)."""
    plan, max_restarts = job.plan, job.max_restarts
    if options is None:
        options = [producer_options(plan, index, None) for index in range(plan.producers)]
    if not ray.is_initialized():
        ray.init()
    # On the driver's node, which lives as long as the pool: a tracker lost with another node
    # would fail the pool at its end. No CPU reserved, so a head with num_cpus=0 can host it.
    here = ray.get_runtime_context().get_node_id()
    tracker = _Tracker.options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
    ).remote()
    # The job (with the source) goes to Ray's object store once; every actor reads it there.
    job_ref = ray.put(dataclasses.replace(job, source=list(job.source)))
    actors = {
        index: _ProducerActor.options(
            name=actor_name(plan.producer_id(index)), max_restarts=max_restarts, max_task_retries=-1, **options[index]
        ).remote(tracker, job_ref, index)
        for index in range(plan.producers)
    }
    pending = {actors[index].run.remote(): index for index in actors}
    retries = dict.fromkeys(actors, 0)  # preprocessing errors retried by the driver
    report.restarts = {plan.producer_id(i): 0 for i in actors}
    shown_upto: dict[int, int] = {}
    try:
        with Progress(plan, progress) as shown:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
                if progress:
                    for index, offset in ray.get(tracker.snapshot.remote())[1].items():
                        if shown_upto.get(index) != offset:
                            shown_upto[index] = offset
                            shown.appended(index, offset)
                for ref in ready:
                    index = pending.pop(ref)
                    pid = plan.producer_id(index)
                    try:
                        resumed_at, metrics = ray.get(ref)
                    except RayTaskError as exc:  # preprocess (or the store) raised
                        retries[index] += 1
                        if retries[index] > max_restarts:
                            raise _failed(plan, pid, max_restarts, exc) from exc
                        pending[actors[index].run.remote()] = index
                        continue
                    except RayActorError as exc:  # Ray's restarts ran out
                        raise _failed(plan, pid, max_restarts, exc) from exc
                    report.resumed_at.setdefault(pid, resumed_at)
                    report.metrics[pid] = metrics
                    # Done: its CPUs and resources go to producers still waiting for room
                    # (more producers than the cluster holds, or one restarting after a node loss).
                    _end(actors[index])
        starts, _ = ray.get(tracker.snapshot.remote())
        runs = ray.get(tracker.runs.remote())
        for index in actors:
            pid = plan.producer_id(index)
            began = starts.get(index, [])
            if began:
                report.resumed_at[pid] = began[0]  # where this pool run began, not the last incarnation
            report.restarts[pid] = max(runs.get(index, 1) - 1, len(began) - 1, retries[index])
    finally:
        for actor in (*actors.values(), tracker):
            _end(actor)


def _end(actor: Any) -> None:
    # Ray types ``ActorClass.remote()`` as ``ActorHandle[T] | type[T]`` (so that methods
    # resolve), which its own ``ray.kill(actor: ActorHandle)`` does not accept.
    ray.kill(actor, no_restart=True)


def _failed(plan: PoolPlan, pid: str, max_restarts: int, exc: BaseException) -> PoolFailedError:
    cause = getattr(exc, "cause", None) or exc
    return PoolFailedError(plan.name, pid, max_restarts + 1, type(cause).__name__, str(cause), detail=" (Ray backend)")
