"""Optimus: greedy marginal-gain allocation with a fitted speed function.

Source: Peng et al., "Optimus: An Efficient Dynamic Resource Scheduler for
Deep Learning Clusters", EuroSys'18, section 5.1: every job first gets its
minimum, then each further unit goes to the job whose predicted completion
time drops the most with it (``remaining(n) - remaining(n + 1)``), using a
speed function fitted online from the job's measured throughput (the same
:class:`~airflow_elastic_gpu.scheduling.throughput.ThroughputModel` family).
Optimus re-plans on a fixed interval (10 minutes in the paper) and applies
changes by checkpoint and re-creation; there is no restart-overhead test.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from airflow_elastic_gpu.scheduling.placement import PlacementRequest, place
from airflow_elastic_gpu.scheduling.state import ClusterState, Decision, JobState


@dataclass(frozen=True)
class OptimusPolicy:
    """Marginal-gain allocation, FIFO admission.

    :param min_resize_interval_s: a job keeps an allocation this long before it is re-planned (>= 0).
    """

    min_resize_interval_s: float = 600.0
    name: str = "optimus"
    elastic: bool = True
    preemptive: ClassVar[bool] = False
    resize_mechanism: ClassVar[str] = "recreate"

    def __post_init__(self) -> None:
        value = self.min_resize_interval_s  # a bool is an int to Python, never a number here
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:  # NaN fails
            raise ValueError(f"min_resize_interval_s must be a number of seconds >= 0, got {value!r}")

    def decide(self, cluster: ClusterState) -> Decision:
        order = sorted(cluster.jobs, key=lambda j: (-j.priority, j.submit_time_s, j.job_id))
        # a job keeps an allocation the interval long, its first one too (re-planned at once, a job
        # just started was re-created a minute later)
        frozen = {j.job_id for j in order if j.resized_within(cluster.now_s, self.min_resize_interval_s) or (
            j.allocation and j.last_resize_s is None and j.last_start_s is not None
            and cluster.now_s - j.last_start_s < self.min_resize_interval_s)}
        counts: dict[str, int] = {}
        free = cluster.capacity
        for j in order:
            if j.job_id in frozen:
                counts[j.job_id] = j.num_gpus
            elif j.allocation:
                counts[j.job_id] = j.min_gpus
            else:
                continue
            free -= counts[j.job_id]
        for j in order:
            if not j.allocation:
                counts[j.job_id] = j.min_gpus if free >= j.min_gpus else 0
                free -= counts[j.job_id]

        def gain(j: JobState, n: int) -> float:
            return j.remaining_time_s(n) - j.remaining_time_s(n + 1)

        heap = [
            (-gain(j, counts[j.job_id]), j.submit_time_s, j.job_id, j)
            for j in order
            if j.job_id not in frozen and 0 < counts[j.job_id] < j.max_gpus
        ]
        heapq.heapify(heap)
        while free > 0 and heap:
            neg, sub, job_id, j = heapq.heappop(heap)
            if -neg <= 0:
                break
            counts[job_id] += 1
            free -= 1
            if counts[job_id] < j.max_gpus:
                heapq.heappush(heap, (-gain(j, counts[job_id]), sub, job_id, j))
        allocations = place(
            cluster.nodes,
            [PlacementRequest(j.job_id, counts[j.job_id], j.min_gpus, j.allocation) for j in order],
        )
        reasons = {
            j.job_id: f"{j.num_gpus}->{len(allocations[j.job_id])} GPUs (marginal gain)"
            for j in order
            if len(allocations[j.job_id]) != j.num_gpus
        }
        return Decision(allocations, reasons)
