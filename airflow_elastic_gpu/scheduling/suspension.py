"""Suspension: when a policy may take a preemptible running job to zero GPUs to start a waiting one.

With stop-and-restart, suspending is a resize to zero (checkpoint, stop, keep the job's place)
and resuming is a resize from zero that pays one restart overhead. The rule here is the exchange
argument behind shortest-remaining-processing-time (SRPT; Schrage, "A proof of the optimality of
the shortest remaining processing time discipline", Oper. Res. 1968) with a switching cost:

    a waiting job W and a running job V that hold the same GPUs one after the other add
    ``R_V + (R_V + o_W + R_W)`` to the sum of JCTs if V goes on and
    ``(o_W + R_W) + (o_W + R_W + o_V + R_V)`` if V is suspended for W, so suspending V lowers
    the sum by ``R_V - R_W - (o_V + o_W)``,

where ``R`` is a job's predicted remaining time on the GPUs in question and ``o`` its restart
overhead. A suspension is made only when that gain exceeds ``hysteresis`` times the two restart
overheads (the adaptive policy's margin for predicted gains), so the predicted average JCT falls
by more than the restart overheads paid.

Two limits keep a job from thrashing. The KAI scheduler's minimum runtime before preemption
(``NVIDIA/KAI-Scheduler``, ``docs/developer/designs/min-runtime``: ``preempt-min-runtime``, a
guaranteed runtime before a workload may be preempted, against "workloads repeatedly preempted
before making meaningful progress"): a job runs at least ``min_runtime_s`` after each start or
resume before it may be suspended. And a cap: at most ``max_per_hour`` suspensions of one job in
any hour, which bounds the restart overhead a job can be made to pay to
``max_per_hour * restart_overhead_s`` per hour. Priorities are respected: a job is only suspended
for a waiting job ranked before it (higher priority first, then less remaining work), and never
for one of lower priority.

Pure code: no I/O, no clock (the time is the cluster's ``now_s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from airflow_elastic_gpu.scheduling.state import JobState

HOUR_S = 3600.0


@dataclass(frozen=True)
class SuspensionRule:
    """When a preemptible job may be suspended, and whether a suspension pays.

    :param min_runtime_s: seconds a job runs after each start or resume before it may be
        suspended (>= 0).
    :param max_per_hour: most suspensions of one job in any 3,600 s (>= 1).
    :param hysteresis: a suspension must lower the predicted sum of JCTs by more than this many
        times the restart overheads it costs (>= 0).
    :raises ValueError: a limit out of range.
    """

    min_runtime_s: float = 600.0
    max_per_hour: int = 4
    hysteresis: float = 2.0

    def __post_init__(self) -> None:
        if not self.min_runtime_s >= 0:
            raise ValueError(f"min_runtime_s must be >= 0, got {self.min_runtime_s!r}")
        if isinstance(self.max_per_hour, bool) or not isinstance(self.max_per_hour, int) or self.max_per_hour < 1:
            raise ValueError(f"max_suspensions_per_hour must be an integer >= 1, got {self.max_per_hour!r}")
        if not self.hysteresis >= 0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis!r}")

    def eligible(self, job: JobState, now_s: float) -> bool:
        """True if running ``job`` may be suspended at ``now_s`` (seconds): it is preemptible,
        holds GPUs, has run ``min_runtime_s`` since its last start or resume, and has been
        suspended fewer than ``max_per_hour`` times in the last hour."""
        if not (job.preemptible and job.allocation):
            return False
        if job.last_start_s is not None and now_s - job.last_start_s < self.min_runtime_s:
            return False
        recent = sum(1 for t in job.suspensions_s if now_s - t < HOUR_S)
        return recent < self.max_per_hour

    def gain_s(self, victim: JobState, victim_gpus: int, waiting: JobState, waiting_gpus: int) -> float:
        """Predicted fall of the sum of JCTs (seconds) if ``victim`` (running on ``victim_gpus``)
        is suspended so that ``waiting`` starts on ``waiting_gpus``, net of both restart
        overheads: ``R_victim - R_waiting - (o_victim + o_waiting)`` (see the module docstring)."""
        overheads_s = victim.restart_overhead_s + waiting.restart_overhead_s
        return victim.remaining_time_s(victim_gpus) - waiting.remaining_time_s(waiting_gpus) - overheads_s

    def pays(self, victim: JobState, victim_gpus: int, waiting: JobState, waiting_gpus: int) -> bool:
        """True if suspending ``victim`` for ``waiting`` saves more than ``hysteresis`` times the
        restart overheads it costs, on top of paying them."""
        overheads_s = victim.restart_overhead_s + waiting.restart_overhead_s
        return self.gain_s(victim, victim_gpus, waiting, waiting_gpus) > self.hysteresis * overheads_s

    def victims(
        self,
        order: Sequence[JobState],
        counts: Sequence[int],
        frozen: Sequence[bool],
        rank: int,
        need: int,
        now_s: float,
    ) -> list[int]:
        """Ranks of running jobs to suspend so that the waiting job at ``rank`` gets ``need`` GPUs.

        Candidates are ranked after it (lower priority, or the same priority and more remaining
        work), hold GPUs in ``counts`` and are not ``frozen``; the latest-ranked go first (SRPT:
        the most remaining work). Each must be :meth:`eligible` and :meth:`pays` on its own.

        :param order: jobs in rank order; ``counts[r]`` is job ``r``'s GPU count so far (the
            caller's running jobs at their minimum).
        :param need: GPUs the waiting job needs beyond the free ones (> 0).
        :returns: the victims' ranks, or ``[]`` when they cannot free ``need`` GPUs.
        """
        waiting = order[rank]
        chosen: list[int] = []
        freed = 0
        for r in range(len(order) - 1, rank, -1):
            if freed >= need:
                break
            victim, n = order[r], counts[r]
            if (n <= 0 or frozen[r] or victim.priority > waiting.priority
                    or not self.eligible(victim, now_s) or not self.pays(victim, n, waiting, waiting.min_gpus)):
                continue
            chosen.append(r)
            freed += n
        return chosen if freed >= need else []
