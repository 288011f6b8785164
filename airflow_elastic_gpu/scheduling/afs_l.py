"""AFS-L: Hwang et al.'s elastic sharing heuristic, as Voda schedules with it.

Source: Hwang et al., "Elastic Resource Sharing for Distributed Deep
Learning", NSDI'21, section 3 (AFS-L), and its implementation in the Voda
scheduler (``heyfey/vodascheduler``, ``pkg/algorithm/afsl.go``). Every
decision starts all jobs at zero GPUs and hands out GPUs one at a time to the
"top priority" job: between two jobs, the one with less remaining time is
preferred unless the longer job's relative throughput gain from one more GPU,
``(S(n+1) - S(n)) / S(n+1)``, beats the shorter one's ``(S(n+1) - S(n)) / S(n)``.
A job with no GPU ranks by remaining time only. Jobs can drop to zero
(preemption); changes are applied by checkpoint and re-creation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from airflow_elastic_gpu.scheduling.placement import PlacementRequest, place
from airflow_elastic_gpu.scheduling.state import ClusterState, Decision, JobState


@dataclass(frozen=True)
class AfsLPolicy:
    """AFS-L with a minimum interval between a job's resizes.

    :param min_resize_interval_s: a job keeps an allocation this long before it is re-planned (>= 0).
    """

    min_resize_interval_s: float = 60.0
    name: str = "afs_l"
    elastic: bool = True
    preemptive: ClassVar[bool] = True
    resize_mechanism: ClassVar[str] = "recreate"

    def __post_init__(self) -> None:
        if self.min_resize_interval_s < 0:
            raise ValueError(f"min_resize_interval_s must be >= 0, got {self.min_resize_interval_s}")

    @staticmethod
    def _speed(j: JobState, n: int) -> float:
        return j.throughput.steps_per_s(n) if n > 0 else 0.0

    def _length(self, j: JobState, n: int) -> float:
        return j.remaining_time_s(n) if n > 0 else float("inf")

    def _prefer_longer(self, short: JobState, long: JobState, counts: dict[str, int]) -> bool:
        ns, nl = counts[short.job_id], counts[long.job_id]
        s0, s1 = self._speed(short, ns), self._speed(short, ns + 1)
        l0, l1 = self._speed(long, nl), self._speed(long, nl + 1)
        left = (l1 - l0) / l1
        right = (s1 - s0) / s0 if s0 > 0 else float("inf")
        return left > right

    def _top(self, jobs: list[JobState], counts: dict[str, int]) -> JobState:
        best = jobs[0]
        for other in jobs[1:]:
            if counts[best.job_id] == 0 and counts[other.job_id] == 0:
                if other.remaining_time_s(1) < best.remaining_time_s(1):
                    best = other
                continue
            a, b = best, other
            if self._length(a, counts[a.job_id]) > self._length(b, counts[b.job_id]):
                a, b = b, a  # a: the shorter job
            best = b if self._prefer_longer(a, b, counts) else a
        return best

    def decide(self, cluster: ClusterState) -> Decision:
        jobs = sorted(cluster.jobs, key=lambda j: (j.submit_time_s, j.job_id))
        counts = {j.job_id: 0 for j in jobs}
        free = cluster.capacity
        open_jobs = []
        for j in jobs:
            if j.resized_within(cluster.now_s, self.min_resize_interval_s):
                counts[j.job_id] = j.num_gpus
                free -= j.num_gpus
            else:
                open_jobs.append(j)
        while free > 0 and open_jobs:
            top = self._top(open_jobs, counts)
            need = top.min_gpus if counts[top.job_id] == 0 else 1
            if need > free:
                open_jobs.remove(top)
                continue
            counts[top.job_id] += need
            free -= need
            if counts[top.job_id] >= top.max_gpus:
                open_jobs.remove(top)
        order = sorted(jobs, key=lambda j: (j.remaining_time_s(1), j.job_id))
        allocations = place(
            cluster.nodes,
            [PlacementRequest(j.job_id, counts[j.job_id], j.min_gpus, j.allocation) for j in order],
        )
        reasons = {
            j.job_id: f"{j.num_gpus}->{len(allocations[j.job_id])} GPUs (AFS-L)"
            for j in jobs
            if len(allocations[j.job_id]) != j.num_gpus
        }
        return Decision(allocations, reasons)
