"""What one simulation produced: per-job records, the pool's timelines, and the summary metrics.

Metrics (field terms; ``docs/simulator.md`` defines each):

* **JCT** = finish - submit (queueing included); avg, p50, p95, p99 (nearest rank);
* **makespan** = last finish - first submit;
* **slowdown** = JCT / the job's ideal run time: its work at its best consolidated speed with the
  whole cluster to itself (at most its largest GPU count; on a cluster of several GPU types, each
  type with the GPUs it has, several types together at the slowest one's pace), no queueing, no
  restart;
* **finish-time fairness** (Themis, Mahajan et al., NSDI'20, section 3.1):
  ``rho = T_shared / T_id``, ``T_shared`` the job's JCT in the shared cluster, ``T_id`` its run
  time alone on a ``1/N`` share of the cluster, ``N`` the contention (the time-average number
  of jobs in the system, itself included, over the job's life). ``rho > 1``: the job did worse
  than on its fair share.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from airflow_elastic_gpu.simulator.model import ClusterShape


@dataclass
class JobRecord:
    """One job's outcome (seconds; ``work`` in samples of its model).

    :param best_speeds: samples/s of the job's fastest consolidated placement with at most
        ``n`` GPUs, at index ``n - 1`` (non-decreasing; its last entry gives ``lower_bound_jct_s``).
    :param recreate_wait_s: seconds the job waited, without GPUs, for its re-created pod to be
        scheduled again (``recreate`` mechanism only; a preempted job's pod is re-created too, so
        its time suspended counts here).
    """

    job_id: str
    model: str
    submit_s: float
    requested_gpus: int
    duration_s: float
    work: float
    start_s: float | None = None
    end_s: float | None = None
    gpu_s: float = 0.0
    resizes: int = 0
    preemptions: int = 0
    restart_lost_s: float = 0.0
    restart_lost_gpu_s: float = 0.0
    lower_bound_jct_s: float = 0.0
    recreate_wait_s: float = 0.0
    best_speeds: tuple[float, ...] = field(default=(), repr=False)

    @property
    def jct_s(self) -> float:
        return (self.end_s if self.end_s is not None else math.inf) - self.submit_s

    @property
    def queueing_s(self) -> float:
        return (self.start_s if self.start_s is not None else math.inf) - self.submit_s

    @property
    def slowdown(self) -> float:
        """JCT over the ideal run time (``lower_bound_jct_s``); >= 1."""
        return self.jct_s / self.lower_bound_jct_s if self.lower_bound_jct_s > 0 else math.nan

    def isolated_jct_s(self, share_gpus: float) -> float:
        """Run time alone on ``share_gpus`` GPUs (> 0, may be fractional), no queueing or restart.

        The speed on a fractional share is linear between the best speeds at the integer counts
        around it (time-sharing below one GPU); above the job's largest count it stays flat.

        :raises ValueError: no ``best_speeds`` recorded, or ``share_gpus <= 0``.
        """
        if not self.best_speeds or not share_gpus > 0:
            raise ValueError(f"need best_speeds and share_gpus > 0, got {len(self.best_speeds)} speeds, {share_gpus!r}")
        top = len(self.best_speeds)
        lo = min(top, math.floor(share_gpus))
        low_speed = self.best_speeds[lo - 1] if lo >= 1 else 0.0
        high_speed = self.best_speeds[min(top, lo + 1) - 1]
        speed = low_speed + (high_speed - low_speed) * (min(share_gpus, top) - lo)
        return self.work / speed


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of ``values`` by the nearest-rank rule: the smallest value
    with at least ``q`` of them at or below it (with fewer than 100 values, p99 is the largest).

    :raises ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("no values to take a quantile of")
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, math.ceil(q * len(ranked)) - 1))]


def contention(jobs: list[JobRecord]) -> list[float]:
    """Per job (same order): the time-average number of jobs in the system (submitted, not finished,
    itself included) over its life ``[submit_s, end_s]``; Themis's ``N``. ``nan`` for an unfinished job."""
    ends = [j.end_s if j.end_s is not None else math.inf for j in jobs]
    times = np.array(sorted({t for j, e in zip(jobs, ends) for t in (j.submit_s, e) if math.isfinite(t)}))
    delta = np.zeros(len(times))
    np.add.at(delta, np.searchsorted(times, [j.submit_s for j in jobs]), 1)
    finished = [e for e in ends if math.isfinite(e)]
    np.add.at(delta, np.searchsorted(times, finished), -1)
    in_system = np.cumsum(delta)  # on [times[k], times[k + 1])
    area = np.concatenate(([0.0], np.cumsum(in_system[:-1] * np.diff(times))))  # integral up to times[k]
    out = []
    for j, e in zip(jobs, ends):
        if not math.isfinite(e) or e <= j.submit_s:
            out.append(math.nan if not math.isfinite(e) else 1.0)
            continue
        a, b = np.searchsorted(times, (j.submit_s, e))
        out.append(float(area[b] - area[a]) / (e - j.submit_s))
    return out


@dataclass
class SimulationResult:
    """Everything one simulation produced.

    :param allocations: ``(time_s, job_id, num_gpus)`` at every change of a job's GPU count.
    :param busy: ``(time_s, gpus_held)`` at every change of the pool's held GPUs.
    """

    policy: str
    mechanism: str
    cluster: ClusterShape
    jobs: list[JobRecord]
    allocations: list[tuple[float, str, int]]
    busy: list[tuple[float, int]]
    decisions: int
    decision_s: float
    wall_s: float
    makespan_lower_bound_s: float
    work_done: float

    def fairness(self) -> list[tuple[float, float]]:
        """Per job (order of ``jobs``): ``(contention N, finish-time fairness rho)`` (see the module doc)."""
        out = []
        for j, n in zip(self.jobs, contention(self.jobs)):
            if not math.isfinite(n):  # unfinished
                rho = math.inf
            else:  # a job of no work (a simulation's own input; traces refuse one): 1 if it took no time
                isolated = j.isolated_jct_s(self.cluster.capacity / n)
                rho = j.jct_s / isolated if isolated > 0 else 1.0 if j.jct_s <= 0 else math.inf
            out.append((n, rho))
        return out

    def summary(self) -> dict[str, Any]:
        """Averages and tails over all jobs (seconds); see ``docs/simulator.md`` for each field."""
        jct = sorted(j.jct_s for j in self.jobs)
        first = min(j.submit_s for j in self.jobs)
        last = max(j.end_s if j.end_s is not None else math.inf for j in self.jobs)  # an end at 0.0 is one
        makespan = last - first
        gpu_s = sum(j.gpu_s for j in self.jobs)

        def pct(q: float) -> float:
            return nearest_rank(jct, q)

        avg_lb = sum(j.lower_bound_jct_s for j in self.jobs) / len(self.jobs)
        slowdowns = [j.slowdown for j in self.jobs]
        rhos = [rho for _, rho in self.fairness()]
        return {
            "policy": self.policy,
            "mechanism": self.mechanism,
            "cluster": str(self.cluster),
            "jobs": len(self.jobs),
            "avg_jct_s": sum(jct) / len(jct),
            "p50_jct_s": pct(0.50),
            "p95_jct_s": pct(0.95),
            "p99_jct_s": pct(0.99),
            "makespan_s": makespan,
            "avg_queueing_s": sum(j.queueing_s for j in self.jobs) / len(self.jobs),
            "gpu_utilisation": gpu_s / (self.cluster.capacity * makespan) if makespan > 0 else 0.0,
            "resizes": sum(j.resizes for j in self.jobs),
            "preemptions": sum(j.preemptions for j in self.jobs),
            "restart_lost_gpu_s": sum(j.restart_lost_gpu_s for j in self.jobs),
            "recreate_wait_s": sum(j.recreate_wait_s for j in self.jobs),
            "avg_slowdown": sum(slowdowns) / len(slowdowns),
            "max_slowdown": max(slowdowns),
            "avg_ftf_rho": sum(rhos) / len(rhos),
            "max_ftf_rho": max(rhos),
            "share_ftf_rho_above_1": sum(r > 1 + 1e-9 for r in rhos) / len(rhos),
            "avg_jct_lower_bound_s": avg_lb,
            "makespan_lower_bound_s": self.makespan_lower_bound_s,
            "avg_jct_over_bound": (sum(jct) / len(jct)) / avg_lb if avg_lb > 0 else math.nan,
            "makespan_over_bound": makespan / self.makespan_lower_bound_s
            if self.makespan_lower_bound_s > 0 else math.nan,
            "decisions": self.decisions,
            "avg_decision_ms": 1000 * self.decision_s / self.decisions if self.decisions else 0.0,
            "wall_s": self.wall_s,
        }


def gpus_in_use_at(result: SimulationResult, t: float) -> int:
    """GPUs held at time ``t`` (step function of ``result.busy``)."""
    times = [b[0] for b in result.busy]
    i = bisect.bisect_right(times, t) - 1
    return result.busy[i][1] if i >= 0 else 0
