"""The adaptive policy: progress-driven GPU counts for every job, resized only when it pays.

Source: Wang et al., "An Efficient and Non-Intrusive GPU Scheduling Framework
for Deep Learning Training Systems", SC20, section III (adaptive scheduler:
use each job's measured progress to decide how many GPUs it gets now). The
hand-out rule weights each job's marginal speed-up by its rank in
shortest-remaining-work order, the discrete form of heSRPT (Berg et al.,
"Optimal Resource Allocation for Elastic and Parallelizable Jobs", 2020):
linear-scaling jobs are served shortest-first, poorly scaling ones share.

Steps of one decision:

1. Jobs resized less than ``min_resize_interval_s`` ago, or less than their restart overhead ago
   (up to ``max_restart_hold_s``), keep their count, unless some of their GPUs are gone (a drain,
   a GPU out of service): without the second bound two jobs whose restarts outlast the interval
   could take GPUs from each other in turn for ever, neither training (:func:`.state.held`).
2. Other running jobs start from ``min_gpus``; waiting jobs are admitted at ``min_gpus`` in
   rank order (priority, then least remaining work) while GPUs last, but with the pool setting
   ``admission_by_gain`` (on by default) only these: a job whose rank rests on a guess (not
   measured, and no measured job of its training: the pool's guess), one that has waited
   ``admission_patience`` times its predicted run time on ``min_gpus``, one that ran before and
   was not suspended (a running job moved, e.g. to another GPU type), one of a higher priority
   than a running job that could grow (and take the GPUs its start needs), and one on the makespan's
   critical path (its remaining steps at its fastest predicted count, up to ``max_gpus`` or the
   pool's GPUs, take at least the pool's backlog: every unfinished job's remaining work on one
   GPU, over the pool's GPUs; holding it back would delay the last completion one for one).
   Any other waiting job is admitted in step 3, when its start gains more than growing a running
   job (with ``admission_min_waiting`` = k > 1, only while at least k jobs wait). With
   ``admission_by_gain=False`` every waiting job is admitted here.
   With suspension on (``suspend=True``, a pool setting), a waiting job that does
   not fit may suspend preemptible running jobs ranked after it, when the SRPT
   exchange pays its restart overheads (:mod:`~airflow_elastic_gpu.scheduling.suspension`);
   a suspended job waits in rank order like any other and resumes when admitted. With
   suspension on, a preemptible running job that may be suspended (past its minimum runtime,
   under its hourly cap) is not given its minimum here either: its minimum competes in step 3
   like a start, so its GPUs may go to the growth of better-ranked jobs (heSRPT's allocation, as a
   re-created pod that goes back to the queue would give them up); it is suspended only if that
   exchange pays against the better-ranked job that gained and no later-ranked job gained GPUs.
3. Remaining GPUs go to the job with the highest
   ``weight * (throughput(n+k) - throughput(n)) / throughput(1) / k`` for its next step of ``k``
   GPUs (with ``admission_by_gain``, a waiting job's start: ``k = min_gpus`` from zero
   throughput), where ``weight`` is the number of unfinished jobs ranked at or after it. With
   ``admission_by_gain`` this is heSRPT's rule for the first GPUs too: a job's start competes
   with the growth of the jobs ranked before it, so a burst of arrivals is served a few at a time
   on more GPUs each (shortest first), not all at once on one GPU each, which shares the GPUs
   like a processor-sharing queue and finishes every job late. The price is throughput: growth
   is less efficient than a start, and long jobs start later, so the last job may finish later;
   the critical-path rule of step 2 gives part of that back (``docs/benchmarks.md``: -8% average
   JCT against admitting every job first; makespan +6% on the generated workloads, +7% without the
   rule; +1% on the held-out ones, +8% without it).
   A job not yet measured on a whole node's GPUs grows no further than the whole nodes its
   request needs (``requested_gpus``, the user's own estimate; default ``max_gpus``): its prior
   cannot tell whether more nodes help (the Pollux T4 profiles measure 8 GPUs on two nodes slower
   than 4 on one for most models, and a job spread over nodes was never measured on fewer GPUs,
   so it stayed there); once measured on a whole node it grows as its fitted model says, and
   step 4a may try the next node on idle GPUs. A job of a family measured on a whole node counts
   as measured there (its prior carries those samples:
   :func:`~airflow_elastic_gpu.scheduling.throughput.with_pool_prior`).
4. GPUs nobody gained go back to the running jobs that gave them up, so no job
   is shrunk for nothing (unless it was measured slower on them). Before that (step 4a, with
   ``explore``), a running job measured (itself) on its current count or more may try on idle GPUs the
   next whole-node count above every count it or its family was measured on.
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

On a pool of several GPU types (``type_aware``, the default), each job is first given one type,
and steps 1-7 run per type: :mod:`airflow_elastic_gpu.scheduling.heterogeneous`.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from airflow_elastic_gpu.scheduling.grant import grant
from airflow_elastic_gpu.scheduling.placement import PlacementRequest, place_with_leftover
from airflow_elastic_gpu.scheduling.reasons import Reasons
from airflow_elastic_gpu.scheduling.state import (
    RANK_DECIMALS,
    ClusterState,
    Decision,
    GpuId,
    JobState,
    held,
)
from airflow_elastic_gpu.scheduling.suspension import SuspensionRule


@dataclass(frozen=True)
class AdaptivePolicy:
    """The default policy.

    :param hysteresis: a growth, or a suspension, must save more than this many restart
        overheads (>= 0).
    :param min_resize_interval_s: seconds a job keeps an allocation before it may be resized (>= 0);
        a job whose restart overhead is longer keeps it that long, up to ``max_restart_hold_s``.
    :param max_restart_hold_s: the longest a job's restart overhead holds its allocation after a
        resize, seconds (>= 0; 0: ``min_resize_interval_s`` alone). A measured overhead includes
        whatever delayed the first step (a pod pending, an image pull): the cap keeps such a job
        from holding GPUs that better-ranked jobs wait for (the default, 600 s, is the suspension
        rule's ``min_runtime_s`` and Optimus' interval); restarts longer than it are not protected.
    :param suspend: the pool allows suspension: preemptible jobs (``JobState.preemptible``) may
        be taken to zero GPUs to start waiting jobs ranked before them (off by default).
    :param min_runtime_s: with ``suspend``, seconds a job runs after each start or resume before
        it may be suspended (>= 0).
    :param max_suspensions_per_hour: with ``suspend``, most suspensions of one job in any hour (>= 1).
    :param type_aware: on a pool of several GPU types, choose each job's type first
        (:func:`~airflow_elastic_gpu.scheduling.heterogeneous.decide_by_type`); False: treat all
        GPUs alike (a job may then span types and run at its slowest GPU's pace).
    :param admission_by_gain: a waiting job ranked on its own training's measurements starts only
        when its start gains more than the growth of a running job (step 3), unless it is on the
        makespan's critical path (step 2): lower average JCT, a slightly later makespan (the
        default). False: every waiting job is admitted at ``min_gpus`` before any job grows.
    :param admission_patience: a waiting job that has waited this many times its predicted run
        time on ``min_gpus`` is admitted before any growth (> 0): the bound on how long
        shortest-first admission may hold a job back (the default 1: its own run time, so waiting
        at most doubles its JCT against a start on ``min_gpus`` at once). The makespan's critical
        path is the other bound (step 2).
    :param admission_min_waiting: with ``admission_by_gain``, jobs are held back only while at
        least this many jobs wait (an integer >= 1; 1: always). With 2 a lone waiting job starts at
        once (there is no order to choose): less average-JCT gain, little makespan loss
        (``docs/benchmarks.md``).
    :raises ValueError: a parameter out of range.
    """

    hysteresis: float = 2.0
    min_resize_interval_s: float = 60.0
    max_restart_hold_s: float = 600.0
    explore: bool = True
    suspend: bool = False
    min_runtime_s: float = 600.0
    max_suspensions_per_hour: int = 4
    name: str = "adaptive"
    elastic: bool = True
    _suspension: SuspensionRule | None = field(init=False, repr=False, compare=False, default=None)
    type_aware: bool = True
    admission_by_gain: bool = True
    admission_patience: float = 1.0
    admission_min_waiting: int = 1
    preemptive: ClassVar[bool] = False
    resize_mechanism: ClassVar[str] = "inplace"

    def __post_init__(self) -> None:
        for flag in ("explore", "suspend", "elastic", "type_aware", "admission_by_gain"):
            if not isinstance(getattr(self, flag), bool):  # not 2, not "false": a typo stored as is
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")  # noqa: TRY004
        for key, kind in (("hysteresis", "a number >= 0"), ("min_resize_interval_s", "a number of seconds >= 0"),
                          ("max_restart_hold_s", "a number of seconds >= 0"),
                          ("min_runtime_s", "a number of seconds >= 0"), ("admission_patience", "a number > 0")):
            value = getattr(self, key)  # a bool is an int to Python, never a number here
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not (value > 0 if kind.endswith("> 0") else value >= 0)):  # NaN fails both
                raise ValueError(f"{key} must be {kind}, got {value!r}")
        for key in ("max_suspensions_per_hour", "admission_min_waiting"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        rule = SuspensionRule(self.min_runtime_s, self.max_suspensions_per_hour, self.hysteresis)
        object.__setattr__(self, "_suspension", rule if self.suspend else None)

    def rank(self, cluster: ClusterState) -> list[JobState]:
        """Jobs in service order: priority (high first), then least remaining work, then submit time."""
        return self._ranked(cluster)[0]

    @staticmethod
    def _ranked(cluster: ClusterState) -> tuple[list[JobState], list[float]]:
        """:meth:`rank`'s order, and each ranked job's ``remaining_time_s(1)`` (seconds), computed once."""
        jobs = cluster.jobs
        # remaining_time_s(1), inlined (a decision ranks every job): steps left / steps/s on one GPU
        left = [max(0.0, j.total_steps - j.steps_done) / j.throughput.steps_per_s(1) for j in jobs]
        keys = [(-j.priority, round(t, RANK_DECIMALS), j.submit_time_s, j.job_id) for j, t in zip(jobs, left)]
        ranked = sorted(range(len(jobs)), key=keys.__getitem__)  # stable, as sorting the jobs by key
        return [jobs[i] for i in ranked], [left[i] for i in ranked]

    def counts(self, cluster: ClusterState) -> tuple[dict[str, int], list[JobState]]:
        """Target GPU count per job (steps 1-5), and the rank order used."""
        order, _, counts, _ = self._counts(cluster)
        return {j.job_id: c for j, c in zip(order, counts)}, order

    def _counts(
        self, cluster: ClusterState
    ) -> tuple[list[JobState], list[float], list[int], list[bool]]:
        """Steps 1-5 over the ranked jobs.

        :returns: ``(order, remaining_1_s, counts, resized)``, lists indexed by rank:
            the jobs, their ``remaining_time_s(1)``, their target GPU counts, and
            whether each was resized too recently to be resized now (step 1).
        """
        order, remaining_1_s = self._ranked(cluster)
        now_s, interval_s = cluster.now_s, self.min_resize_interval_s
        hold_s = self.max_restart_hold_s
        resized = [held(j, now_s, interval_s, hold_s) for j in order]
        if any(resized):  # a held job whose GPUs are gone (a drain, a GPU out of service) is not held
            gpus_by_node = {n.name: n.gpu_indices for n in cluster.nodes}
            resized = [r and held(j, now_s, interval_s, hold_s, gpus_by_node) for r, j in zip(resized, order)]
        frozen = list(resized)
        capacity = cluster.capacity
        # running jobs that keep their minimum although their suspension could be weighed (suspend)
        kept = [False] * len(order)
        while True:
            counts = self._hand_out(cluster, order, remaining_1_s, frozen, kept)
            rule = self._suspension
            if rule is not None:
                # a running job left at zero by the hand-out keeps its minimum unless its suspension
                # pays (SRPT exchange, against the better-ranked job that gained GPUs and finishes
                # first), leaves no more GPUs idle than keeping it (a minimum larger than what the
                # others could take would leave the rest unused) and no later-ranked job gained GPUs
                # (they may be its GPUs: suspension serves only better-ranked jobs, never a lower
                # priority)
                num_jobs = len(order)
                gained = [counts[r] > (min(j.min_gpus, len(j.allocation)) if j.allocation else 0)
                          for r, j in enumerate(order)]
                later_gained = [False] * num_jobs
                for r in range(num_jobs - 2, -1, -1):
                    later_gained[r] = later_gained[r + 1] or gained[r + 1]
                idle = capacity - sum(counts)  # GPUs nobody took
                bad, best, best_s = [], None, float("inf")
                for r, j in enumerate(order):
                    if j.allocation and counts[r] == 0 and not frozen[r] and not kept[r] and (
                            later_gained[r] or best is None
                            or not rule.pays(j, len(j.allocation), order[best], counts[best])
                            or (idle > 0 and self._idles_more(cluster, order, remaining_1_s, frozen, kept, r, idle))):
                        bad.append(r)
                    if gained[r] and counts[r] > 0:
                        left_s = round(j.remaining_time_s(counts[r]), RANK_DECIMALS)  # ties: by rank
                        if left_s < best_s:
                            best, best_s = r, left_s
                if bad:
                    for r in bad:
                        kept[r] = True
                    continue
            spare = capacity - sum(counts)
            unpaid = [
                r for r, j in enumerate(order)
                if not frozen[r] and j.allocation and counts[r] != len(j.allocation)
                and self._unpaid(j, counts[r], spare)
            ]
            if not unpaid:
                return order, remaining_1_s, counts, resized
            for r in unpaid:
                frozen[r] = True

    def _idles_more(self, cluster: ClusterState, order: list[JobState], remaining_1_s: list[float],
                    frozen: list[bool], kept: list[bool], r: int, idle: int) -> bool:
        """Whether suspending the job at rank ``r`` leaves more GPUs idle (``idle`` now) than keeping
        it at its minimum: a minimum larger than what the others could take leaves the rest unused."""
        with_r = list(kept)
        with_r[r] = True
        return cluster.capacity - sum(self._hand_out(cluster, order, remaining_1_s, frozen, with_r)) < idle

    @staticmethod
    def _on_critical_path(job: JobState, remaining_1_s: float, backlog_s: float, capacity: int) -> bool:
        """Whether waiting ``job``'s ideal remaining run time is at least ``backlog_s`` (the pool's
        remaining work, the job's own included, on one GPU each, over the pool's ``capacity``
        GPUs): even at its best the job would not finish before the pool could finish everything,
        so holding it back delays the last completion (makespan) one for one.

        The ideal time is its remaining steps at its fastest predicted count from ``min_gpus`` to
        ``max_gpus`` or the pool's GPUs, whichever is fewer
        (:meth:`~airflow_elastic_gpu.scheduling.throughput.ThroughputModel.best_steps_per_s`; the
        node rule of step 3, which holds an unmeasured job to its request's nodes for now, does not
        count: it is a caution, not the job's speed). ``remaining_1_s`` is its remaining time on one
        GPU (seconds), an upper bound of the ideal time."""
        if remaining_1_s < backlog_s:
            return False
        most = min(job.max_gpus, capacity)
        if most < job.min_gpus:
            return True
        return job.remaining_steps / job.throughput.best_steps_per_s(job.min_gpus, most) >= backlog_s

    def _unpaid(self, job: JobState, count: int, spare: float = float("inf")) -> bool:
        """True if resizing running ``job`` to ``count`` is for its own sake but saves too little.

        A growth, or a shrink that speeds the job up (it was measured slower on
        more GPUs) while the GPUs it gives up would stay idle, must save more than
        ``hysteresis`` restart overheads. A shrink that other jobs need the GPUs of
        (more than ``spare``, the GPUs the decision leaves idle), or that slows the
        job down, serves other jobs and is not judged here.
        """
        num_gpus = len(job.allocation)
        if not num_gpus or count == num_gpus:
            return False
        speed = job.throughput.steps_per_s
        if count < num_gpus and (count <= 0 or speed(count) <= speed(num_gpus) or num_gpus - count > spare):
            return False  # a shrink that serves others (or slows the job down), or a suspension: judged elsewhere
        steps = max(0.0, job.total_steps - job.steps_done)
        gain = steps / speed(num_gpus) - steps / speed(count)
        return (count > num_gpus or gain > 0) and gain <= self.hysteresis * job.restart_overhead_s

    def _hand_out(
        self,
        cluster: ClusterState,
        order: list[JobState],
        remaining_1_s: list[float],
        frozen: list[bool],
        kept: list[bool] | None = None,
    ) -> list[int]:
        """Steps 2-4: GPU count per ranked job (a list indexed by rank), frozen jobs kept at theirs.

        Hot path (thousands of grants per decision on a large pool): a heap entry
        is ``(-score, remaining_time_s(1), job_id, rank, step)``, ordered as the
        first three fields; ``step`` is the GPUs the job's next growth takes, so
        the grant reuses what scoring worked out.
        """
        num_jobs = len(order)
        counts = [0] * num_jobs
        suspended = [False] * num_jobs
        free = capacity = cluster.capacity
        rule = self._suspension
        # waiting jobs whose start competes with growth in step 3 (None: all admitted here)
        by_gain: list[bool] | None = [False] * num_jobs if (self.admission_by_gain or rule is not None) else None
        now_s, patience = cluster.now_s, self.admission_patience
        for r, j in enumerate(order):  # frozen jobs keep their count, running jobs their minimum
            if frozen[r]:
                counts[r] = len(j.allocation)
            elif j.allocation:
                if rule is not None and r > 0 and not (kept and kept[r]) and rule.eligible(j, now_s):
                    by_gain[r] = True  # its minimum competes with the growth of better-ranked jobs
                    continue
                counts[r] = min(j.min_gpus, len(j.allocation))
            else:
                continue
            free -= counts[r]
        reserved = 0  # GPUs the starts of such jobs would take: not for jobs ranked after them here
        by_gain_admission = self.admission_by_gain and (
            self.admission_min_waiting <= 1
            or sum(1 for j in order if not j.allocation) >= self.admission_min_waiting)
        # the pool's backlog (s): every unfinished job's remaining work on one GPU, over the pool's GPUs
        backlog_s = sum(remaining_1_s) / capacity if by_gain_admission and capacity else 0.0
        # the lowest priority of a job whose growth could take GPUs (running, below its max, not held)
        lowest_priority = min((j.priority for r, j in enumerate(order)
                               if counts[r] and counts[r] < j.max_gpus and not frozen[r]), default=None)
        for r, j in enumerate(order):  # admit waiting jobs at their minimum
            if not j.allocation:
                if free - reserved < j.min_gpus and rule is not None:  # suspend later-ranked jobs, if that pays
                    # (not the GPUs set aside for better-ranked jobs admitted by gain)
                    victims = rule.victims(order, counts, frozen, r, j.min_gpus - (free - reserved), now_s)
                    for v in victims:
                        free += counts[v]
                        counts[v] = 0
                        suspended[v] = True
                    if victims:  # GPUs freed for this job: it starts now
                        counts[r] = j.min_gpus
                        free -= counts[r]
                        continue
                if free - reserved < j.min_gpus:
                    continue
                if (by_gain_admission and j.throughput.from_own_training
                        and (lowest_priority is None or j.priority <= lowest_priority)  # else a lower
                        # priority's growth could win the GPUs its start needs
                        and (j.first_start_s is None or j.suspensions_s)  # not a running job moved
                        and now_s - j.submit_time_s < patience * j.remaining_time_s(j.min_gpus)
                        and not self._on_critical_path(j, remaining_1_s[r], backlog_s, capacity)):
                    by_gain[r] = True  # admitted in step 3 instead, if its start gains most
                    reserved += j.min_gpus
                    continue
                counts[r] = j.min_gpus
                free -= counts[r]

        node = cluster.max_node_gpus
        if free > 0:  # step 3 (free > 0 implies node > 0)
            free = grant(order, frozen, counts, free, node, by_gain)
        if free > 0 and self.explore:  # step 4a: idle GPUs try a count no job has been measured on
            by_need = sorted(
                range(num_jobs),
                key=lambda r: -round(order[r].remaining_time_s(max(1, order[r].num_gpus)), RANK_DECIMALS),
            )
            for r in by_need:
                if free <= 0:
                    break
                j, n = order[r], counts[r]
                if frozen[r] or not j.allocation or n != len(j.allocation) or node == 0:
                    continue
                observed, own = j.throughput.observed, j.throughput.own_observed
                seen = observed[-1][0] if observed else 0  # by the job or (its prior) its family
                m = (max(n, seen) // node + 1) * node
                if m <= j.max_gpus and m - n <= free and own and own[-1][0] >= n:  # measured where it runs
                    counts[r] = m
                    free -= m - n
        for r, j in enumerate(order):  # step 4: nobody wanted them, give them back (unless that slows the job)
            if free <= 0:
                break
            back = min(free, len(j.allocation) - counts[r]) if j.allocation and not suspended[r] else 0
            if back > 0 and counts[r] + back >= j.min_gpus:
                speed = j.throughput.steps_per_s
                if speed(counts[r] + back) >= speed(counts[r]):
                    counts[r] += back
                    free -= back
        return counts

    def _fill(
        self,
        order: list[JobState],
        resized: list[bool],
        allocations: dict[str, tuple[GpuId, ...]],
        leftover: dict[str, list[int]],
    ) -> dict[str, tuple[GpuId, ...]]:
        """Step 7: GPUs that placement could not use (free GPUs split over nodes) go to jobs on their node.

        A single-node job on a node with free GPUs grows there, one GPU at a
        time, to the job with the best marginal speed-up, while that is
        positive and pays its restart overhead.

        :param resized: per ranked job, whether it was resized too recently to grow now.
        :param leftover: node name -> free device indices (nodes with none left out),
            as :func:`~airflow_elastic_gpu.scheduling.placement.place_with_leftover` returns them.
        """
        if not leftover:
            return allocations
        on_node: dict[str, list[JobState]] = {}
        for r, j in enumerate(order):
            gpus = allocations[j.job_id]
            if not gpus or resized[r]:
                continue
            node = gpus[0].node
            if node in leftover and all(g.node == node for g in gpus):
                on_node.setdefault(node, []).append(j)

        def gain(j: JobState, n: int) -> float:
            t = j.throughput
            return (t.steps_per_s(n + 1) - t.steps_per_s(n)) / t.steps_per_s(1)

        out = dict(allocations)
        for node, jobs in on_node.items():  # nodes are independent: each node's GPUs go to its jobs
            free = list(leftover[node])
            grown = {j.job_id: list(allocations[j.job_id]) for j in jobs}
            heap = [(-gain(j, len(grown[j.job_id])), i, j) for i, j in enumerate(jobs)]
            heapq.heapify(heap)
            while free and heap:
                neg, i, j = heapq.heappop(heap)
                n = len(grown[j.job_id])
                if -neg <= 0 or n >= j.max_gpus or (j.allocation and self._unpaid(j, n + 1)):
                    continue
                grown[j.job_id].append(GpuId(node, free.pop(0)))
                heapq.heappush(heap, (-gain(j, n + 1), i, j))
            for job_id, gpus in grown.items():
                if len(gpus) > len(allocations[job_id]):
                    out[job_id] = tuple(sorted(gpus))
        return out

    def decide(self, cluster: ClusterState) -> Decision:
        """The allocation of every job of ``cluster`` (steps 1-7 of the module; per GPU type first on a
        pool of several, with ``type_aware``).

        Python's cyclic garbage collector is paused while it decides (unless the caller paused it):
        a decision at 2,000 jobs allocates tens of thousands of short-lived objects, none in cycles
        (reference counting frees them), and a full collection that fell inside it, scanning every
        object of the pool's state, added 15-25 ms to one decision in three (``docs/benchmarks.md``,
        section 6). The collection runs after the decision instead; the broker holds the pool's
        lock for less.
        """
        if not gc.isenabled():  # the caller's choice, or a per-type decision inside this one
            return self._decide(cluster)
        gc.disable()
        try:
            return self._decide(cluster)
        finally:
            gc.enable()

    def _decide(self, cluster: ClusterState) -> Decision:
        if self.type_aware and len(cluster.gpu_types) > 1:
            from airflow_elastic_gpu.scheduling.heterogeneous import decide_by_type

            return decide_by_type(self, cluster)
        order, _, counts, resized = self._counts(cluster)
        new_request = tuple.__new__  # new_request(PlacementRequest, fields): a named tuple built in C
        allocations, leftover = place_with_leftover(
            cluster.nodes,
            [new_request(PlacementRequest, (j.job_id, c, j.min_gpus, j.allocation)) for j, c in zip(order, counts)],
        )
        allocations = self._fill(order, resized, allocations, leftover)
        return Decision(allocations, self._reasons(order, allocations))

    def _reasons(
        self, order: list[JobState], allocations: dict[str, tuple[GpuId, ...]]
    ) -> Mapping[str, str]:
        """One line per ranked job whose GPUs change, saying why (a mapping that writes each line
        when it is read: a broker publishes only some of the changes at once, the others wait for
        GPUs to be given back).

        A job's GPUs are a set: no job lists a GPU twice, so equal sets have equal sizes.
        """
        changed: dict[str, int] = {}
        for r, j in enumerate(order):
            current, new = j.allocation, allocations[j.job_id]
            if len(new) != len(current) or (new != current and set(new) != set(current)):
                changed[j.job_id] = r
        return Reasons(changed, order, allocations, f"{self.hysteresis:g}")
