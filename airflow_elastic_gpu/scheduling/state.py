"""Values the scheduling policies read and return: GPUs, nodes, jobs, the cluster and a decision.

Everything here is a frozen dataclass: a policy is a pure function of a
:class:`ClusterState` and returns a :class:`Decision`, so the broker and the
simulator can share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from airflow_elastic_gpu.scheduling.throughput import ThroughputModel


class GpuId(NamedTuple):
    """One concrete GPU: ``index`` is the device index on ``node`` (as in ``CUDA_VISIBLE_DEVICES``).

    A named tuple (immutable, ordered by node then index) because policies sort
    and hash tens of thousands of them per decision on large pools.
    """

    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}:{self.index}"


RANK_DECIMALS = 6
"""Remaining times (seconds) are compared rounded to this many decimals (a microsecond) wherever
jobs are ordered by them: times worked out through different speeds that agree but for the last
bits of a float (two never-measured trainings guessed at one time) tie, and the tie goes by rank
(submit time)."""


@dataclass(frozen=True)
class NodeState:
    """A node of a GPU pool.

    :param name: node name, unique in its pool.
    :param gpu_indices: device indices of the node's GPUs that may be handed out
        (healthy ones; a node marked unschedulable has none here).
    :param gpu_type: product name, e.g. ``"NVIDIA H100"`` or ``"virtual"``.
    """

    name: str
    gpu_indices: tuple[int, ...]
    gpu_type: str = "virtual"

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_indices)

    def gpus(self) -> tuple[GpuId, ...]:
        return tuple(GpuId(self.name, i) for i in self.gpu_indices)


def largest_node_by_type(nodes: Iterable[NodeState]) -> dict[str, int]:
    """GPU type -> the GPUs that may be handed out on its largest node (types of nodes with none
    are absent): the node size a throughput model splits its counts at
    (:attr:`~airflow_elastic_gpu.scheduling.throughput.ThroughputModel.node_gpus`)."""
    largest: dict[str, int] = {}
    for n in nodes:
        if n.gpu_indices:
            largest[n.gpu_type] = max(largest.get(n.gpu_type, 0), n.num_gpus)
    return largest


@dataclass(frozen=True)
class JobState:
    """What a policy knows about one unfinished job.

    :param job_id: the broker's id.
    :param min_gpus: fewest GPUs the job can run on (>= 1).
    :param max_gpus: most GPUs the job can use (>= ``min_gpus``).
    :param requested_gpus: the fixed request a static scheduler would grant,
        ``min_gpus <= requested_gpus <= max_gpus``.
    :param total_steps: steps (optimizer updates) the job must do in all.
    :param steps_done: steps done so far.
    :param submit_time_s: submit time, seconds on the policy's clock.
    :param allocation: GPUs the job holds now (its latest target), empty when waiting.
    :param last_resize_s: time of the job's latest allocation change, or ``None``.
    :param restart_overhead_s: measured seconds of training lost by one resize.
    :param throughput: the job's fitted throughput model (steps/s vs GPU count).
    :param priority: larger is served first; ties fall to the policy's order.
    :param attained_gpu_s: GPU-seconds the job has received so far (Tiresias).
    :param first_start_s: when the job first ran, or ``None`` (Tiresias orders its queues by it).
    :param preemptible: the job opted in to suspension: a policy that suspends may take it to zero
        GPUs (checkpoint, stop, keep its place) and resume it later from its checkpoint.
    :param last_start_s: when the job last went from zero GPUs to some (its start or its latest
        resume), or ``None``; the minimum runtime between suspensions counts from it.
    :param suspensions_s: times of the job's suspensions so far (seconds, ascending); the cap on
        suspensions per hour counts them.
    :param throughput_by_type: GPU type -> the job's model fitted from the samples measured on GPUs
        of that type only (types it has run on; on a pool of one type policies read ``throughput``).
    :param relative_speed: GPU type -> the job's relative single-GPU speed on that type (any positive
        unit; only ratios count), a prior for the types it has not run on; empty when unknown.
    """

    job_id: str
    min_gpus: int
    max_gpus: int
    total_steps: int
    requested_gpus: int | None = None
    steps_done: float = 0.0
    submit_time_s: float = 0.0
    allocation: tuple[GpuId, ...] = ()
    last_resize_s: float | None = None
    restart_overhead_s: float = 10.0
    throughput: ThroughputModel = field(default_factory=ThroughputModel)
    priority: int = 0
    attained_gpu_s: float = 0.0
    first_start_s: float | None = None
    preemptible: bool = False
    last_start_s: float | None = None
    suspensions_s: tuple[float, ...] = ()
    throughput_by_type: Mapping[str, ThroughputModel] = field(default_factory=dict)
    relative_speed: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.min_gpus < 1:
            raise ValueError(f"job {self.job_id}: min_gpus must be >= 1, got {self.min_gpus}")
        if self.max_gpus < self.min_gpus:
            raise ValueError(
                f"job {self.job_id}: max_gpus ({self.max_gpus}) is below min_gpus ({self.min_gpus})"
            )
        if self.requested_gpus is not None and not (
            self.min_gpus <= self.requested_gpus <= self.max_gpus
        ):
            raise ValueError(
                f"job {self.job_id}: requested_gpus ({self.requested_gpus}) must lie in "
                f"[min_gpus, max_gpus] = [{self.min_gpus}, {self.max_gpus}]"
            )

    @property
    def num_gpus(self) -> int:
        return len(self.allocation)

    @property
    def request(self) -> int:
        """The static request: ``requested_gpus``, or ``max_gpus`` when none was given."""
        return self.requested_gpus if self.requested_gpus is not None else self.max_gpus

    @property
    def remaining_steps(self) -> float:
        return max(0.0, self.total_steps - self.steps_done)

    def resized_within(self, now_s: float, interval_s: float) -> bool:
        """True if the job holds GPUs and its allocation changed less than ``interval_s`` seconds
        before ``now_s`` (policies keep such a job's count: their minimum interval between resizes;
        the adaptive policy's hold is :func:`held`)."""
        return bool(self.allocation and self.last_resize_s is not None
                    and now_s - self.last_resize_s < interval_s)

    @property
    def suspended(self) -> bool:
        """True if the job has been suspended and has not been resumed since (it holds no GPU)."""
        return not self.allocation and bool(self.suspensions_s)

    def remaining_time_s(self, num_gpus: int) -> float:
        """Predicted seconds to finish on ``num_gpus`` GPUs (``inf`` for 0 GPUs)."""
        if num_gpus <= 0:
            return float("inf")
        return self.remaining_steps / self.throughput.steps_per_s(num_gpus)


@dataclass(frozen=True)
class ClusterState:
    """One GPU pool at one moment: its nodes, its unfinished jobs and the time."""

    nodes: tuple[NodeState, ...]
    jobs: tuple[JobState, ...]
    now_s: float

    @property
    def capacity(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    @property
    def max_node_gpus(self) -> int:
        return max((n.num_gpus for n in self.nodes), default=0)

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """The pool's GPU types (of nodes with GPUs), sorted."""
        return tuple(sorted({n.gpu_type for n in self.nodes if n.gpu_indices}))

    def capacity_by_type(self) -> dict[str, int]:
        """GPUs that may be handed out, per GPU type (every type of :attr:`gpu_types`)."""
        capacity = dict.fromkeys(self.gpu_types, 0)
        for n in self.nodes:
            if n.gpu_indices:
                capacity[n.gpu_type] += n.num_gpus
        return capacity


@dataclass(frozen=True)
class Decision:
    """A policy's answer: the target allocation of every unfinished job.

    :param allocations: job id -> GPUs it should hold (empty tuple: wait).
        Every unfinished job of the input appears once; no GPU appears twice.
    :param reasons: job id -> one line saying why its allocation changed.
    """

    allocations: Mapping[str, tuple[GpuId, ...]]
    reasons: Mapping[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        return {job_id: len(gpus) for job_id, gpus in self.allocations.items()}


def held(job: JobState, now_s: float, interval_s: float, max_restart_hold_s: float,
         gpus_by_node: Mapping[str, tuple[int, ...]] | None = None) -> bool:
    """True if ``job`` keeps its allocation now: it was resized less than ``interval_s`` seconds ago,
    or less than its restart overhead ago (at most ``max_restart_hold_s``), so that a resize is not
    undone before the job could train about as long as the resize cost it (two jobs whose restarts
    outlast the interval could otherwise take GPUs from each other in turn for ever, neither
    training). A job any of whose GPUs is no longer to be had (``gpus_by_node``: node -> its GPUs
    that may be handed out) is never held: it restarts elsewhere anyway.

    :param now_s: the decision's time (seconds).
    :param interval_s: the policy's minimum interval between resizes (seconds).
    :param max_restart_hold_s: the longest the restart overhead holds a job (seconds; 0: the
        interval alone).
    """
    last_s = job.last_resize_s
    if not job.allocation or last_s is None:
        return False
    if now_s - last_s >= max(interval_s, min(job.restart_overhead_s, max_restart_hold_s)):
        return False
    return gpus_by_node is None or all(g.index in gpus_by_node.get(g.node, ()) for g in job.allocation)
