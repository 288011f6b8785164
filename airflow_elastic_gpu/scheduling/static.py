"""The static policy, the baseline every other policy is measured against.

Source: what Kubernetes' default scheduler (or an Airflow pool whose slots
are GPUs) does with a fixed ``nvidia.com/gpu`` request: each job gets exactly
its request when it fits, pending jobs are tried in submit order and any that
fits is started (backfill), and nothing is ever resized or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from airflow_elastic_gpu.scheduling.placement import PlacementRequest, place
from airflow_elastic_gpu.scheduling.state import ClusterState, Decision


@dataclass(frozen=True)
class StaticPolicy:
    """Fixed request, first fit in submit order with backfill, no resize."""

    name: str = "static"
    elastic: bool = False
    preemptive: ClassVar[bool] = False
    resize_mechanism: ClassVar[str] = "none"

    def decide(self, cluster: ClusterState) -> Decision:
        order = sorted(cluster.jobs, key=lambda j: (j.submit_time_s, j.job_id))
        requests = [
            PlacementRequest(j.job_id, j.num_gpus, j.num_gpus, j.allocation)
            if j.allocation
            else PlacementRequest(j.job_id, j.request, j.request)
            for j in order
        ]
        allocations = place(cluster.nodes, requests)
        reasons = {
            j.job_id: f"start on its request of {j.request} GPU(s)"
            for j in order
            if not j.allocation and allocations[j.job_id]
        }
        return Decision(allocations, reasons)
