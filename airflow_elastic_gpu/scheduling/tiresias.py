"""Tiresias: two-dimensional least-attained-service with discretized priority queues.

Source: Gu et al., "Tiresias: A GPU Cluster Manager for Distributed Deep
Learning", NSDI'19, section 4 (2D-LAS: a job's attained service is its
GPU count x time; K queues with thresholds, FIFO by first start inside a
queue; a job is demoted when its attained service crosses its queue's
threshold). The defaults (2 queues, 1 GPU-hour threshold) are those of the
paper's discretized 2D-LAS as Voda's implementation uses them.

Tiresias does not resize: a job runs on its request or not at all, and a job
of a lower queue is preempted (checkpointed, GPUs taken) when a higher one
needs its GPUs. The starvation-avoidance promotion ("PromoteKnob") is not
modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from airflow_elastic_gpu.scheduling.placement import PlacementRequest, place
from airflow_elastic_gpu.scheduling.state import ClusterState, Decision, JobState


@dataclass(frozen=True)
class TiresiasPolicy:
    """Discretized 2D-LAS, non-elastic and preemptive.

    :param queue_thresholds_gpu_s: attained GPU-seconds at which a job drops
        to the next queue, increasing; ``len + 1`` queues.
    """

    queue_thresholds_gpu_s: tuple[float, ...] = (3600.0,)
    name: str = "tiresias"
    elastic: bool = False
    preemptive: ClassVar[bool] = True
    resize_mechanism: ClassVar[str] = "recreate"

    def __post_init__(self) -> None:
        t = tuple(self.queue_thresholds_gpu_s)
        if any(x <= 0 for x in t) or list(t) != sorted(t):
            raise ValueError(f"queue_thresholds_gpu_s must be positive and increasing, got {t}")

    def queue(self, job: JobState) -> int:
        """0 for the highest-priority queue; one more per threshold the job's attained service crossed."""
        return sum(job.attained_gpu_s >= t for t in self.queue_thresholds_gpu_s)

    def decide(self, cluster: ClusterState) -> Decision:
        inf = float("inf")
        order = sorted(
            cluster.jobs,
            key=lambda j: (
                self.queue(j),
                j.first_start_s if j.first_start_s is not None else inf,
                j.submit_time_s,
                j.job_id,
            ),
        )
        # In queue order, each job on its request while the GPUs last. A job counted in that cannot
        # be placed (the free GPUs are scattered over nodes) is left out and the count made again:
        # counted, it held GPUs that stayed idle, kept later jobs that fit from starting, and had
        # lower-queue jobs preempted for nothing.
        unplaceable: set[str] = set()
        while True:
            free = cluster.capacity
            counts: dict[str, int] = {}
            for j in order:
                counts[j.job_id] = j.request if free >= j.request and j.job_id not in unplaceable else 0
                free -= counts[j.job_id]
            allocations = place(
                cluster.nodes,
                [PlacementRequest(j.job_id, counts[j.job_id], j.request, j.allocation) for j in order],
            )
            failed = {j.job_id for j in order if counts[j.job_id] and not allocations[j.job_id]}
            if not failed:
                break
            unplaceable |= failed
        reasons: dict[str, str] = {}
        for j in order:
            new = allocations[j.job_id]
            if new and not j.allocation:
                reasons[j.job_id] = f"start on its request of {len(new)} GPU(s) (queue {self.queue(j)})"
            elif j.allocation and not new:
                reasons[j.job_id] = (
                    f"preempted: queue {self.queue(j)} after {j.attained_gpu_s:.0f} GPU-s of service"
                )
        return Decision(allocations, reasons)
