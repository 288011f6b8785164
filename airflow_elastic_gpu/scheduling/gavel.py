"""Gavel: heterogeneity-aware max-sum-throughput allocation, carried out in rounds (a peer policy).

Source: Narayanan et al., "Heterogeneity-Aware Cluster Scheduling Policies for Deep Learning
Workloads", OSDI'20: section 3.1 (an allocation ``X[j][T]``, the fraction of time job ``j`` spends
on GPU type ``T``; ``sum_T X[j][T] <= 1``; ``sum_j scale_j X[j][T] <= GPUs of T``), section 4.2
(maximise the sum of throughputs, ``scheduler/policies/max_sum_throughput.py`` in the Gavel
repository) and section 5 (round-based scheduling: each round runs the jobs with the highest
priority ``X[j][T] / (share of time received so far)``, whole jobs at their request).

Here each job's throughput on a type is normalised by its throughput on its best type (a job's
steps/s are in its own units), so the objective is the sum of normalised throughputs, and the
linear program is solved exactly as a transportation problem (min-cost flow, successive shortest
paths). Throughput per type is what the type-aware adaptive policy estimates
(:func:`~airflow_elastic_gpu.scheduling.heterogeneous.type_models`: the job's own measurements, else
the submitter's relative-speed hint). Gavel does not resize: a job runs on its request (capped at
the largest type's GPU count: no job is split across types) or waits; a running job keeps its GPUs
for ``round_s`` and is preempted at a round's end when others have priority.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from airflow_elastic_gpu.scheduling.heterogeneous import pool_speed_ratios, type_models
from airflow_elastic_gpu.scheduling.placement import PlacementRequest, place
from airflow_elastic_gpu.scheduling.state import ClusterState, Decision, GpuId, JobState


def max_sum_allocation(
    value: Sequence[Mapping[str, float]], scale: Sequence[int], capacity: Mapping[str, int],
) -> list[dict[str, float]]:
    """Gavel's max-sum-throughput linear program, solved exactly.

    Maximise ``sum_j sum_T value[j][T] * X[j][T]`` subject to ``sum_T X[j][T] <= 1`` and
    ``sum_j scale[j] * X[j][T] <= capacity[T]``, ``X >= 0``. With ``G[j][T] = scale[j] * X[j][T]``
    (GPUs of ``T``) it is a transportation problem: job ``j`` supplies ``scale[j]`` GPUs' worth of
    demand, type ``T`` takes at most ``capacity[T]``, each unit earns ``value[j][T] / scale[j]``;
    solved by successive shortest paths (Bellman-Ford on the residual graph).

    :param value: per job, type -> normalised throughput (>= 0).
    :param scale: per job, GPUs it runs on (>= 1).
    :param capacity: type -> GPUs (>= 0).
    :returns: per job, type -> time fraction ``X[j][T]`` (types with 0 left out).
    """
    types = list(capacity)
    jobs = len(value)
    src, sink = jobs + len(types), jobs + len(types) + 1
    graph: list[list[int]] = [[] for _ in range(sink + 1)]
    to: list[int] = []
    cap: list[float] = []
    cost: list[float] = []

    def edge(u: int, v: int, c: float, w: float) -> None:
        for a, b, cc, ww in ((u, v, c, w), (v, u, 0.0, -w)):
            graph[a].append(len(to))
            to.append(b)
            cap.append(cc)
            cost.append(ww)

    for j in range(jobs):
        edge(src, j, float(scale[j]), 0.0)
        for k, t in enumerate(types):
            if value[j].get(t, 0.0) > 0:
                edge(j, jobs + k, float(scale[j]), -value[j][t] / scale[j])
    for k, t in enumerate(types):
        edge(jobs + k, sink, float(capacity[t]), 0.0)
    eps = 1e-12
    while True:
        dist = [float("inf")] * (sink + 1)
        via = [-1] * (sink + 1)
        dist[src] = 0.0
        for _ in range(sink):
            changed = False
            for u in range(sink + 1):
                if dist[u] == float("inf"):
                    continue
                for e in graph[u]:
                    if cap[e] > eps and dist[u] + cost[e] < dist[to[e]] - eps:
                        dist[to[e]], via[to[e]] = dist[u] + cost[e], e
                        changed = True
            if not changed:
                break
        if dist[sink] >= -eps:  # no path that earns more: optimal
            break
        push, v = float("inf"), sink
        while v != src:
            push, v = min(push, cap[via[v]]), to[via[v] ^ 1]
        v = sink
        while v != src:
            cap[via[v]] -= push
            cap[via[v] ^ 1] += push
            v = to[via[v] ^ 1]
    out: list[dict[str, float]] = [{} for _ in range(jobs)]
    for j in range(jobs):
        for e in graph[j]:
            if jobs <= to[e] < src and e % 2 == 0:  # a forward job -> type edge: its flow is its reverse's capacity
                flow = cap[e ^ 1]
                if flow > eps:
                    out[j][types[to[e] - jobs]] = flow / scale[j]
    return out


@dataclass(frozen=True)
class GavelPolicy:
    """Heterogeneity-aware max-sum-throughput in rounds; non-elastic and preemptive.

    :param round_s: seconds a started job keeps its GPUs before the next round may preempt it (> 0).
    """

    round_s: float = 360.0
    name: str = "gavel"
    elastic: bool = False
    preemptive: ClassVar[bool] = True
    resize_mechanism: ClassVar[str] = "recreate"

    def __post_init__(self) -> None:
        if not self.round_s > 0:
            raise ValueError(f"round_s must be > 0, got {self.round_s}")

    def decide(self, cluster: ClusterState) -> Decision:
        types = cluster.gpu_types
        node_type = {n.name: n.gpu_type for n in cluster.nodes}
        capacity = cluster.capacity_by_type()
        largest = max(capacity.values(), default=0)
        jobs = list(cluster.jobs)
        if largest == 0:  # every GPU drained or out of service: every job waits
            return Decision({j.job_id: () for j in jobs})
        usable = {GpuId(n.name, i) for n in cluster.nodes for i in n.gpu_indices}
        scale = [max(j.min_gpus, min(j.request, largest)) for j in jobs]  # above the largest: waits
        ratios = pool_speed_ratios(jobs)
        value = []
        for j, s in zip(jobs, scale):
            speeds = {t: m.steps_per_s(s) for t, m in type_models(j, types, ratios).items()}
            best = max(speeds.values())
            value.append({t: v / best for t, v in speeds.items() if s <= capacity[t]})
        x = max_sum_allocation(value, scale, capacity)

        def received(j: JobState, s: int) -> float:
            """Share of its time in the pool the job has run at its request (0 for a new job)."""
            age_s = cluster.now_s - j.submit_time_s
            return j.attained_gpu_s / (s * age_s) if age_s > 0 else 0.0

        def in_round(j: JobState) -> bool:
            """True if the job runs and (re)started less than ``round_s`` ago."""
            since = j.last_resize_s if j.last_resize_s is not None else j.first_start_s
            return (bool(j.allocation) and since is not None and cluster.now_s - since < self.round_s
                    and usable.issuperset(j.allocation))  # not on GPUs taken out of service

        free = dict(capacity)
        chosen: dict[str, str] = {}
        for j in jobs:  # a job inside its round keeps its GPUs and its type
            if in_round(j):
                t = node_type[j.allocation[0].node]
                chosen[j.job_id] = t
                free[t] -= len(j.allocation)
        ranked = sorted(
            ((-x_jt / max(received(j, s), 1e-3), j.submit_time_s, j.job_id, t, s)
             for j, s, xj in zip(jobs, scale, x) for t, x_jt in xj.items() if x_jt > 1e-9),
        )
        for _, _, job_id, t, s in ranked:
            if job_id not in chosen and free[t] >= s:
                chosen[job_id] = t
                free[t] -= s
        allocations: dict[str, tuple[GpuId, ...]] = {}
        for t in types:
            requests = []
            for j, s in zip(jobs, scale):
                if chosen.get(j.job_id) == t:
                    keep = tuple(g for g in j.allocation if node_type.get(g.node) == t)
                    n = len(j.allocation) if in_round(j) else s
                    requests.append(PlacementRequest(j.job_id, n, n, keep))
            requests.sort(key=lambda r: not r.current)  # jobs that keep their GPUs first
            allocations.update(place([n for n in cluster.nodes if n.gpu_type == t], requests))
        reasons: dict[str, str] = {}
        for i, j in enumerate(jobs):
            new = allocations.setdefault(j.job_id, ())
            if new and set(new) != set(j.allocation):
                t = chosen[j.job_id]
                reasons[j.job_id] = (f"run on {len(new)} {t} GPU(s) this round "
                                     f"(time share {x[i].get(t, 0):.2f} on {t})")
            elif j.allocation and not new:
                reasons[j.job_id] = f"preempted at the round's end (received {received(j, scale[i]):.2f})"
        return Decision(allocations, reasons)
