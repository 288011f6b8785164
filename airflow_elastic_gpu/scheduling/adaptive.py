"""The adaptive policy: progress-driven GPU counts for every job, resized only when it pays.

Source: Wang et al., "An Efficient and Non-Intrusive GPU Scheduling Framework
for Deep Learning Training Systems", SC20, section III (adaptive scheduler:
use each job's measured progress to decide how many GPUs it gets now). The
hand-out rule weights each job's marginal speed-up by its rank in
shortest-remaining-work order, the discrete form of heSRPT (Berg et al.,
"Optimal Resource Allocation for Elastic and Parallelizable Jobs", 2020):
linear-scaling jobs are served shortest-first, poorly scaling ones share.

Steps of one decision:

1. Jobs resized less than ``min_resize_interval_s`` ago are frozen at their count.
2. Other running jobs start from ``min_gpus``; waiting jobs are admitted at
   ``min_gpus`` in rank order (priority, then least remaining work) while GPUs last.
3. Remaining GPUs go one at a time to the job with the highest
   ``weight * (throughput(n+1) - throughput(n)) / throughput(1)``, where
   ``weight`` is the number of unfinished jobs ranked at or after it.
4. GPUs nobody gained go back to the running jobs that gave them up, so no job
   is shrunk for nothing (unless it was measured slower on them).
5. Hysteresis: a running job is resized for its own sake (a growth, or a
   shrink to a count measured faster) only if the predicted time saved
   ``remaining(n_now) - remaining(n_new)`` exceeds ``hysteresis * restart_overhead_s``;
   otherwise it is frozen and steps 2-4 run again.
6. Placement turns counts into GPUs (``placement.place``). Counts are
   node-aware: a job grows one GPU at a time up to a node's size, then by
   whole nodes, because a job split over partly used nodes pays cross-node
   synchronisation (the Pollux T4 profiles measure 8 GPUs on two nodes slower
   than 4 on one for most models).
7. GPUs placement could not use (free GPUs scattered over nodes) go to jobs
   already on those nodes, by marginal speed-up.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from airflow_elastic_gpu.scheduling.placement import PlacementRequest, place
from airflow_elastic_gpu.scheduling.state import ClusterState, Decision, GpuId, JobState


@dataclass(frozen=True)
class AdaptivePolicy:
    """The default policy.

    :param hysteresis: a growth must save more than this many restart overheads (>= 0).
    :param min_resize_interval_s: seconds a job keeps an allocation before it may be resized (>= 0).
    """

    hysteresis: float = 2.0
    min_resize_interval_s: float = 60.0
    explore: bool = True
    name: str = "adaptive"
    elastic: bool = True
    preemptive: ClassVar[bool] = False
    resize_mechanism: ClassVar[str] = "inplace"

    def __post_init__(self) -> None:
        if self.hysteresis < 0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")
        if self.min_resize_interval_s < 0:
            raise ValueError(
                f"min_resize_interval_s must be >= 0, got {self.min_resize_interval_s}"
            )

    def rank(self, cluster: ClusterState) -> list[JobState]:
        """Jobs in service order: priority (high first), then least remaining work, then submit time."""
        return sorted(
            cluster.jobs,
            key=lambda j: (-j.priority, j.remaining_time_s(1), j.submit_time_s, j.job_id),
        )

    def _frozen(self, job: JobState, now_s: float) -> bool:
        return job.resized_within(now_s, self.min_resize_interval_s)

    def counts(self, cluster: ClusterState) -> tuple[dict[str, int], list[JobState]]:
        """Target GPU count per job (steps 1-5), and the rank order used."""
        order = self.rank(cluster)
        weight = {j.job_id: len(order) - r for r, j in enumerate(order)}
        frozen = {j.job_id for j in order if self._frozen(j, cluster.now_s)}
        while True:
            counts = self._hand_out(cluster, order, weight, frozen)
            unpaid = [j for j in order if j.job_id not in frozen and self._unpaid(j, counts[j.job_id])]
            if not unpaid:
                return counts, order
            frozen.update(j.job_id for j in unpaid)

    def _unpaid(self, job: JobState, count: int) -> bool:
        """True if resizing running ``job`` to ``count`` is for its own sake but saves too little.

        A growth, or a shrink that speeds the job up (it was measured slower on
        more GPUs), must save more than ``hysteresis`` restart overheads. A
        shrink that slows the job down serves other jobs and is not judged here.
        """
        if not job.allocation or count == job.num_gpus:
            return False
        gain = job.remaining_time_s(job.num_gpus) - job.remaining_time_s(count)
        return (count > job.num_gpus or gain > 0) and gain <= self.hysteresis * job.restart_overhead_s

    def _hand_out(
        self,
        cluster: ClusterState,
        order: list[JobState],
        weight: dict[str, int],
        frozen: set[str],
    ) -> dict[str, int]:
        counts: dict[str, int] = {}
        free = cluster.capacity
        for j in order:  # frozen jobs keep their count, running jobs their minimum
            if j.job_id in frozen:
                counts[j.job_id] = j.num_gpus
            elif j.allocation:
                counts[j.job_id] = min(j.min_gpus, j.num_gpus) if j.num_gpus else j.min_gpus
            else:
                continue
            free -= counts[j.job_id]
        for j in order:  # admit waiting jobs at their minimum
            if not j.allocation:
                counts[j.job_id] = j.min_gpus if free >= j.min_gpus else 0
                free -= counts[j.job_id]

        node = cluster.max_node_gpus

        def step(j: JobState, n: int) -> int:
            """GPUs the job's next growth takes: one while it fits a node, then a whole node."""
            if n < node or node == 0:
                return min(1, j.max_gpus - n)
            return min(node - n % node, j.max_gpus - n)

        def score(j: JobState, n: int) -> float:
            t, k = j.throughput, step(j, n)
            return weight[j.job_id] * (t.steps_per_s(n + k) - t.steps_per_s(n)) / t.steps_per_s(1) / k

        heap = [
            (-score(j, counts[j.job_id]), j.remaining_time_s(1), j.job_id, j)
            for j in order
            if j.job_id not in frozen and 0 < counts[j.job_id] < j.max_gpus
        ]
        heapq.heapify(heap)
        exhausted = False
        while free > 0 and heap and not exhausted:
            entry = heapq.heappop(heap)
            while True:  # keep granting to this job while it stays the best (saves heap traffic)
                neg, rem, job_id, j = entry
                if -neg <= 0:
                    exhausted = True  # nobody gains from another GPU
                    break
                k = step(j, counts[job_id])
                if k > free:
                    break  # a whole node is not free; smaller growths of others may still fit
                counts[job_id] += k
                free -= k
                if counts[job_id] >= j.max_gpus or free <= 0:
                    break
                entry = (-score(j, counts[job_id]), rem, job_id, j)
                if heap and heap[0] < entry:
                    heapq.heappush(heap, entry)
                    break
        if free > 0 and self.explore:  # step 4a: idle GPUs try a count no job has been measured on
            for j in sorted(order, key=lambda j: -j.remaining_time_s(max(1, j.num_gpus))):
                if free <= 0:
                    break
                n = counts.get(j.job_id, 0)
                if j.job_id in frozen or not j.allocation or n != j.num_gpus or node == 0:
                    continue
                seen = max((c for c, _ in j.throughput.observed), default=0)
                m = (max(n, seen) // node + 1) * node
                if m <= j.max_gpus and m - n <= free and seen >= n:
                    counts[j.job_id] = m
                    free -= m - n
        for j in order:  # step 4: nobody wanted them, give them back (unless that slows the job)
            if free <= 0:
                break
            back = min(free, j.num_gpus - counts[j.job_id]) if j.allocation else 0
            t = j.throughput
            if back > 0 and t.steps_per_s(counts[j.job_id] + back) >= t.steps_per_s(counts[j.job_id]):
                counts[j.job_id] += back
                free -= back
        return counts

    def _fill(
        self, cluster: ClusterState, order: list[JobState], allocations: dict[str, tuple[GpuId, ...]]
    ) -> dict[str, tuple[GpuId, ...]]:
        """Step 7: GPUs that placement could not use (free GPUs split over nodes) go to jobs on their node.

        A single-node job on a node with free GPUs grows there, one GPU at a
        time, to the job with the best marginal speed-up, while that is
        positive and pays its restart overhead.
        """
        free: dict[str, list[int]] = {n.name: list(n.gpu_indices) for n in cluster.nodes}
        for gpus in allocations.values():
            for g in gpus:
                free[g.node].remove(g.index)
        if not any(free.values()):
            return allocations
        out = {k: list(v) for k, v in allocations.items()}
        on_node: dict[str, list[JobState]] = {}
        for j in order:
            nodes = {g.node for g in out[j.job_id]}
            if len(nodes) == 1 and not self._frozen(j, cluster.now_s):
                node = next(iter(nodes))
                if free[node]:
                    on_node.setdefault(node, []).append(j)

        def gain(j: JobState, n: int) -> float:
            t = j.throughput
            return (t.steps_per_s(n + 1) - t.steps_per_s(n)) / t.steps_per_s(1)

        for node, jobs in on_node.items():  # nodes are independent: each node's GPUs go to its jobs
            heap = [(-gain(j, len(out[j.job_id])), i, j) for i, j in enumerate(jobs)]
            heapq.heapify(heap)
            while free[node] and heap:
                neg, i, j = heapq.heappop(heap)
                n = len(out[j.job_id])
                if -neg <= 0 or n >= j.max_gpus or (j.allocation and self._unpaid(j, n + 1)):
                    continue
                out[j.job_id].append(GpuId(node, free[node].pop(0)))
                heapq.heappush(heap, (-gain(j, n + 1), i, j))
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def decide(self, cluster: ClusterState) -> Decision:
        counts, order = self.counts(cluster)
        allocations = place(
            cluster.nodes,
            [PlacementRequest(j.job_id, counts[j.job_id], j.min_gpus, j.allocation) for j in order],
        )
        allocations = self._fill(cluster, order, allocations)
        reasons: dict[str, str] = {}
        rank = {j.job_id: r for r, j in enumerate(order)}
        for j in order:
            new = allocations[j.job_id]
            if set(new) == set(j.allocation):
                continue
            if not j.allocation:
                reasons[j.job_id] = f"start on {len(new)} GPU(s)"
            elif len(new) > j.num_gpus:
                saved = j.remaining_time_s(j.num_gpus) - j.remaining_time_s(len(new))
                reasons[j.job_id] = (
                    f"grow {j.num_gpus}->{len(new)} GPUs: predicted remaining time "
                    f"{j.remaining_time_s(j.num_gpus):.0f}s->{j.remaining_time_s(len(new)):.0f}s, "
                    f"gain {saved:.0f}s > {self.hysteresis:g} x restart overhead "
                    f"{j.restart_overhead_s:.0f}s"
                )
            elif len(new) < j.num_gpus and j.remaining_time_s(len(new)) < j.remaining_time_s(j.num_gpus):
                reasons[j.job_id] = (
                    f"shrink {j.num_gpus}->{len(new)} GPUs: measured faster on fewer GPUs, predicted "
                    f"remaining time {j.remaining_time_s(j.num_gpus):.0f}s->"
                    f"{j.remaining_time_s(len(new)):.0f}s"
                )
            elif len(new) < j.num_gpus:
                reasons[j.job_id] = (
                    f"shrink {j.num_gpus}->{len(new)} GPUs: the GPUs gain more elsewhere "
                    f"(rank {rank[j.job_id] + 1} of {len(order)} by remaining work)"
                )
            else:
                reasons[j.job_id] = f"move to {', '.join(map(str, new))} (placement)"
        return Decision(allocations, reasons)
