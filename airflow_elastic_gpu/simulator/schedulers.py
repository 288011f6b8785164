"""The scheduler side of a simulation: the broker's calls (submit, progress, ack, finish, rebalance)
with the simulated time passed in, in two adapters over the same scheduling core.

* :class:`PolicyScheduler`: the core (:mod:`airflow_elastic_gpu.scheduling.core`) over
  :class:`~airflow_elastic_gpu.scheduling.core.JobBook` values kept in memory;
* :class:`BrokerScheduler`: a real :class:`~airflow_elastic_gpu.broker.service.GpuBroker` on
  in-memory SQLite whose clock is the simulated one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from airflow_elastic_gpu.scheduling.core import (
    JobBook,
    SchedulingCore,
    account_gpu_time,
    apply_ack,
    gpu_type_of,
    record_progress,
)
from airflow_elastic_gpu.scheduling.policy import Policy
from airflow_elastic_gpu.scheduling.state import ClusterState, GpuId, NodeState
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel
from airflow_elastic_gpu.simulator.model import SimulationError


class Scheduler(Protocol):
    """What the simulator needs from a scheduler: the broker's calls, with the time passed in."""

    decisions: int
    decision_s: float

    def submit(self, job_id: str, min_gpus: int, max_gpus: int, requested_gpus: int,
               total_steps: int, now: float, preemptible: bool = False,
               relative_speed: Mapping[str, float] | None = None, family: str | None = None,
               throughput: ThroughputModel | None = None) -> str: ...
    def current(self, sid: str) -> tuple[int, tuple[GpuId, ...]]: ...
    def progress(self, sid: str, step: float, generation: int, now: float) -> None: ...
    def ack(self, sid: str, generation: int, now: float) -> None: ...
    def finish(self, sid: str, now: float) -> None: ...
    def requeue(self, sid: str, now: float) -> int: ...
    def rebalance(self, now: float) -> None: ...


class _TimedPolicy:
    """Wraps a policy to count its decisions and their wall time."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.elastic = policy.elastic
        self.preemptive = getattr(policy, "preemptive", False)
        self.suspend = getattr(policy, "suspend", False)
        self.resize_mechanism = getattr(policy, "resize_mechanism", "inplace")
        self.decisions = 0
        self.decision_s = 0.0

    def __getattr__(self, name: str) -> Any:  # the policy's settings (its suspension limits) as its own
        if name == "policy":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.policy, name)

    def decide(self, cluster: ClusterState) -> Any:
        t0 = time.perf_counter()
        try:
            return self.policy.decide(cluster)
        finally:
            self.decisions += 1
            self.decision_s += time.perf_counter() - t0


class PolicyScheduler:
    """The scheduling core in memory, with the broker's calls (submit, progress, ack, finish, rebalance).

    The same :class:`~airflow_elastic_gpu.scheduling.core.SchedulingCore` as the broker's, over
    :class:`~airflow_elastic_gpu.scheduling.core.JobBook` values kept in a dict instead of rows.

    :param policy: any policy; a preemptive one may take all GPUs of a running job.
    :param nodes: the pool's nodes.
    :param default_restart_overhead_s: what the policy assumes before a job's first measured resize.
    """

    def __init__(self, policy: Policy, nodes: Sequence[NodeState], default_restart_overhead_s: float) -> None:
        self.policy = _TimedPolicy(policy)
        self.core = SchedulingCore(self.policy, default_restart_overhead_s)
        self.nodes = tuple(nodes)
        self._node_types = {n.name: n.gpu_type for n in self.nodes}
        self.jobs: dict[str, JobBook] = {}
        self.history: dict[str, ThroughputModel] = {}  # family -> model of its last finished measured job
        self.history_by_type: dict[str, dict[str, ThroughputModel]] = {}  # family -> its models per GPU type
        self._last_sample: dict[str, tuple[int, float, float]] = {}  # job -> (generation, time_s, step)
        # re-created jobs waiting for GPUs: (published_s, when re-queued, min, max, requested GPUs)
        self._requeued: dict[str, tuple[float | None, float, int, int, int | None]] = {}

    @property
    def decisions(self) -> int:
        return self.policy.decisions

    @property
    def decision_s(self) -> float:
        return self.policy.decision_s

    def submit(self, job_id: str, min_gpus: int, max_gpus: int, requested_gpus: int,
               total_steps: int, now: float, preemptible: bool = False,
               relative_speed: Mapping[str, float] | None = None, family: str | None = None,
               throughput: ThroughputModel | None = None) -> str:
        """Add a job and rebalance. ``throughput``: the job's model known from the start (an oracle
        for ablations; progress samples are folded into it as into any model); default a prior,
        then learnt from its progress, as the broker does."""
        book = JobBook(job_id, min_gpus, max_gpus, total_steps, now, requested_gpus=requested_gpus,
                       preemptible=preemptible, relative_speed=dict(relative_speed or {}), family=family)
        if throughput is not None:
            book.throughput = throughput
        self.jobs[job_id] = book
        self.rebalance(now)
        return job_id

    def current(self, sid: str) -> tuple[int, tuple[GpuId, ...]]:
        book = self.jobs[sid]
        return book.target_generation, book.target

    def progress(self, sid: str, step: float, generation: int, now: float) -> None:
        book = self.jobs.get(sid)
        if book is None:
            return
        last = self._last_sample.get(sid)
        previous = (last[1], last[2]) if last is not None and last[0] == generation else None
        gpu_type = gpu_type_of(book.gpus_of(generation), self._node_types)
        if record_progress(book, generation=generation, step=step, now_s=now, previous=previous, gpu_type=gpu_type):
            self._last_sample[sid] = (generation, now, step)

    def ack(self, sid: str, generation: int, now: float) -> None:
        book = self.jobs.get(sid)
        if book is not None and apply_ack(book, generation, now):
            self.rebalance(now)

    def finish(self, sid: str, now: float) -> None:
        book = self.jobs.pop(sid, None)
        if book is not None:
            if book.family is not None and book.throughput.observed:
                self.history[book.family] = book.throughput
                self.history_by_type[book.family] = dict(book.throughput_by_type)
            self._last_sample.pop(sid, None)
            self._requeued.pop(sid, None)
            self.rebalance(now)

    def requeue(self, sid: str, now: float) -> int:
        """The job's pod is gone (a termination-based resize): it holds no GPUs and waits to be
        placed again like a queued job, keeping its progress, throughput model and submit time.

        The new pod asks for the GPU count of the job's latest target, as a re-created pod's fixed
        request: until it is placed, the policy sees the job with that count as its minimum,
        maximum and request, so it waits while fewer GPUs can be had (a preempted job, whose target is empty,
        waits with its own bounds). Its latest generation counts as acked with no GPUs. Its
        placement counts as a resize (``last_resize_s``), and its restart overhead is measured
        as the re-creation's: the old pod's termination (from the resize's publication until now)
        and the new pod's start, not its wait for GPUs in between (a queueing delay, which the
        policy would otherwise take for a restart cost: a re-created job that waited hours then
        needed a gain of twice that to be resized again, and stayed on one GPU).

        :returns: that generation (the next placement is a later one).
        """
        book = self.jobs[sid]
        self._requeued[sid] = (book.published_s, now, book.min_gpus, book.max_gpus, book.requested_gpus)
        if book.target:
            book.min_gpus = book.max_gpus = book.requested_gpus = len(book.target)
        account_gpu_time(book, now)
        book.target = book.in_use = ()
        book.acked_generation = book.target_generation
        self._last_sample.pop(sid, None)
        generation = book.target_generation
        self.rebalance(now)
        return generation

    def rebalance(self, now: float) -> None:
        books = sorted(self.jobs.values(), key=lambda b: (b.submit_s, b.job_id))
        for pub in self.core.rebalance(self.nodes, books, now, self.history, self.history_by_type):
            if pub.job_id in self._requeued and pub.gpus:
                book = self.jobs[pub.job_id]
                published_s, requeued_s, book.min_gpus, book.max_gpus, book.requested_gpus = self._requeued.pop(
                    pub.job_id)
                # the restart overhead, from then: termination + start, not the wait for GPUs
                book.published_s = None if published_s is None else published_s + (now - requeued_s)
                book.last_resize_s = now


BROKER_KEEPS_GPUS = (
    "broker mode cannot simulate termination-based resizing: the broker keeps a re-created job's "
    "GPUs, while the simulator re-queues it; use mechanism='inplace' or the in-memory scheduler"
)


class BrokerScheduler:
    """The real :class:`GpuBroker` on an in-memory SQLite database, on the simulated clock."""

    def __init__(self, policy: Policy, nodes: Sequence[NodeState], default_restart_overhead_s: float,
                 url: str = "sqlite://") -> None:
        from airflow_elastic_gpu.broker.service import GpuBroker

        self.now = 0.0
        self._last_submit_s = -1.0
        self._policy = _TimedPolicy(policy)
        self.broker = GpuBroker(url, policy=self._policy, clock=lambda: self.now,
                                default_restart_overhead_s=default_restart_overhead_s)
        for n in nodes:
            self.broker.register_node(n.name, gpu_type=n.gpu_type, gpu_indices=n.gpu_indices)
        from airflow_elastic_gpu.broker.inventory import MAX_PERIOD_S

        # the simulator calls rebalance itself, and agents never go silent
        self.broker.configure_pool(lease_s=MAX_PERIOD_S, rebalance_interval_s=MAX_PERIOD_S)

    @property
    def decisions(self) -> int:
        return self._policy.decisions

    @property
    def decision_s(self) -> float:
        return self._policy.decision_s

    def submit(self, job_id: str, min_gpus: int, max_gpus: int, requested_gpus: int,
               total_steps: int, now: float, preemptible: bool = False,
               relative_speed: Mapping[str, float] | None = None, family: str | None = None,
               throughput: ThroughputModel | None = None) -> str:
        if throughput is not None:
            raise SimulationError("a real broker learns each job's throughput: no known throughput in broker mode")
        from airflow_elastic_gpu.broker.types import JobSpec

        # jobs submitted at one instant are served in the order submitted (the trace's), as in policy
        # mode: the broker breaks a tie of submit times by job id, a random UUID (a schedule differed
        # from run to run); the next float apart, they tie no more (at any time a trace may hold)
        self.now = self._last_submit_s = max(now, math.nextafter(self._last_submit_s, math.inf))
        view = self.broker.submit(JobSpec(
            name=family or job_id, command="simulated", min_gpus=min_gpus, max_gpus=max_gpus,
            requested_gpus=requested_gpus, total_steps=total_steps, key=job_id, backend="simulated",
            preemptible=preemptible, relative_speed=relative_speed, family=family,
        ))
        return view.id

    def current(self, sid: str) -> tuple[int, tuple[GpuId, ...]]:
        t = self.broker.target(sid)
        return t.generation, t.gpus

    def progress(self, sid: str, step: float, generation: int, now: float) -> None:
        self.now = now
        self.broker.progress(sid, step, generation=generation, time_s=now)

    def ack(self, sid: str, generation: int, now: float) -> None:
        self.now = now
        self.broker.ack(sid, generation)

    def finish(self, sid: str, now: float) -> None:
        self.now = now
        self.broker.finish(sid)

    def requeue(self, sid: str, now: float) -> int:
        """:raises SimulationError: always: the broker keeps a job's GPUs across a re-creation."""
        raise SimulationError(BROKER_KEEPS_GPUS)

    def rebalance(self, now: float) -> None:
        self.now = now
        self.broker.rebalance()
