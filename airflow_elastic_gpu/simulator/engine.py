"""The discrete-event simulator: a GPU pool, a job trace, measured speeds, and one policy.

Source of the method: the trace-driven simulators of Tiresias (NSDI'19),
Gavel (OSDI'20) and Pollux (OSDI'21): jobs arrive as in the trace, each job's
work is its recorded duration times its measured speed on its requested GPUs,
and a job advances at the measured speed of the GPUs it holds (node spread
included). The scheduler side is the real one:

* **policy mode** (default): :class:`~.schedulers.PolicyScheduler` runs the broker's scheduling core
  (:mod:`airflow_elastic_gpu.scheduling.core`: two-phase publish/ack with generations,
  throughput learnt online from progress samples, the pool's guess for a training never
  measured, restart overhead measured from the first progress after a resize) in memory,
  rebalancing on submit/ack/finish and on a period;
* **broker mode**: :class:`~.schedulers.BrokerScheduler` drives a real
  :class:`~airflow_elastic_gpu.broker.service.GpuBroker` (SQLite in memory)
  whose clock is the simulated one.

Both report progress exactly as the sidecar agent does: one sample when a
generation's trainer makes its first step (after the restart overhead) and
one per rebalance period.

A resize in place (the sidecar) keeps the job's pod and costs it ``inplace_s`` of training; the
trainer keeps its old GPUs while it stops (the agent's reaction, SIGTERM, the checkpoint, the exit:
``inplace_stop_s``), and its agent acks the new generation then: only from then on do GPUs it gives
up go to others, and GPUs it gains count as its own. A termination-based resize (``recreate``)
deletes the job's pod: the old pod keeps its GPUs, not training, for the model's stop part (the
grace period); then the job holds nothing and goes back through scheduling like a queued job
(keeping its progress and submit time), so it waits when others took the GPUs meanwhile; once
placed again it trains after the start part (binding, image pull, container start,
initialisation). See :mod:`airflow_elastic_gpu.simulator.model`.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from airflow_elastic_gpu.scheduling.policy import Policy, get_policy
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel
from airflow_elastic_gpu.simulator.mixed import MixedCluster, TypedProfile, default_profiles
from airflow_elastic_gpu.simulator.model import (
    MECHANISMS,
    ClusterShape,
    RecreateModel,
    RestartOverheads,
    SimulationError,
)
from airflow_elastic_gpu.simulator.profiles import Profile, ProfileSet
from airflow_elastic_gpu.simulator.results import JobRecord, SimulationResult, gpus_in_use_at
from airflow_elastic_gpu.simulator.schedulers import (
    BROKER_KEEPS_GPUS,
    BrokerScheduler,
    PolicyScheduler,
    Scheduler,
)
from airflow_elastic_gpu.simulator.trace import TraceJob

__all__ = [  # the model, result and scheduler classes live in their own modules; here for callers
    "BrokerScheduler", "ClusterShape", "JobRecord", "PolicyScheduler", "RecreateModel", "RestartOverheads",
    "Scheduler", "SimulationError", "SimulationResult", "gpus_in_use_at", "simulate",
]

# --------------------------------------------------------------------------- the engine


@dataclass(eq=False)
class _SimJob:
    record: JobRecord
    profile: Profile
    min_gpus: int
    max_gpus: int
    sid: str = ""
    done: float = 0.0
    alloc: tuple[GpuId, ...] = ()
    speed: float = 0.0
    restart_until: float = 0.0
    generation: int = 0
    awaiting_first_sample: bool = False
    terminating_until: float | None = None  # its pod is being deleted (re-creation) until then
    acking_until: float | None = None  # its trainer stops for an in-place restart until then, then it acks
    requeued_s: float | None = None  # its pod is gone and it waits for GPUs since then
    pod_nodes: frozenset[str] = frozenset()  # the nodes its pods are on (kept while it is suspended)

    @property
    def work(self) -> float:
        return self.record.work


def _speeds_by_count(prof: Profile, cluster: ClusterShape | MixedCluster, max_gpus: int) -> list[float]:
    """The job's best samples/s at each count ``1..max_gpus``, on as few nodes as possible (on a
    cluster of several types: :meth:`~airflow_elastic_gpu.simulator.mixed.TypedProfile.speeds_by_count`);
    the ideal run times (slowdown, finish-time fairness) and the lower bounds all come from it."""
    if isinstance(cluster, MixedCluster) and isinstance(prof, TypedProfile):
        return prof.speeds_by_count(max_gpus, cluster.type_sizes())
    gpn = cluster.gpus_per_node
    return [prof.samples_per_s(n, -(-n // gpn)) for n in range(1, max_gpus + 1)]


def simulate(
    trace: Sequence[TraceJob],
    cluster: ClusterShape,
    policy: str | Policy = "adaptive",
    *,
    profiles: ProfileSet | None = None,
    overheads: RestartOverheads | None = None,
    mechanism: str | None = None,
    rebalance_interval_s: float = 60.0,
    seed: int = 0,
    broker: bool = False,
    broker_url: str = "sqlite://",
    progress: Callable[[float], None] | None = None,
    preemptible: bool = False,
    known_throughput: bool = False,
) -> SimulationResult:
    """Run ``trace`` on ``cluster`` under ``policy``; deterministic for a given ``seed``.

    :param trace: jobs; each must fit the cluster (``num_gpus <= capacity``).
    :param policy: a policy name (:func:`~airflow_elastic_gpu.scheduling.policy.get_policy`) or object.
    :param profiles: scaling profiles (default: the bundled Pollux T4 ones; for a cluster of several
        types, a :class:`~airflow_elastic_gpu.simulator.mixed.MixedCluster`, each type's). A job
        without a ``model`` gets one drawn with ``seed`` by its GPU-time.
    :param overheads: seconds lost per resize for each mechanism (re-creation: a model, see the
        module doc).
    :param mechanism: ``"inplace"`` or ``"recreate"``; default the policy's own
        (``adaptive``: in place; ``termination``, ``tiresias``, ``optimus``, ``afs_l``: re-create).
    :param rebalance_interval_s: period (s, > 0) of the periodic rebalance and of progress reports.
    :param broker: drive a real ``GpuBroker`` instead of the in-memory scheduler (slower; small
        traces; not with re-creation, whose re-queued pods the broker does not model).
    :param progress: called with the fraction of jobs finished, for progress bars.
    :param preemptible: every job of the trace opts in to suspension (``preemptible=True``); a
        policy that suspends (``adaptive`` with ``suspend=True``) may then take a running job to
        zero GPUs. A suspended job holds no GPU and makes no progress; a suspension and its
        resume together pay the mechanism's restart overhead once, like any restart (in place:
        the stop at the suspension, the rest at the resume; counted in ``preemptions``).
    :param known_throughput: an oracle for ablations: the policy knows each job's true throughput
        at every GPU count (packed on as few nodes as possible) from its submission, instead of
        starting from a prior (``benchmarks/policy_ablation.py``); its progress samples are still
        folded in, as the broker's are (they differ from the model only where placement spreads
        the job). Not with ``broker``, nor on a cluster of several GPU types.
    :raises SimulationError: an empty trace, a job larger than the cluster, bad parameters, or
        broker mode with re-creation or ``known_throughput``.
    """
    if not trace:
        raise SimulationError("the trace has no jobs")
    if not rebalance_interval_s > 0:
        raise SimulationError(f"rebalance_interval_s must be > 0, got {rebalance_interval_s!r}")
    pol = get_policy(policy) if isinstance(policy, str) else policy
    mech = mechanism or getattr(pol, "resize_mechanism", "inplace")
    if mech not in MECHANISMS:
        raise SimulationError(f"mechanism must be one of {', '.join(MECHANISMS)}, got {mech!r}")
    if broker and mech == "recreate":
        raise SimulationError(BROKER_KEEPS_GPUS)
    if known_throughput and (broker or not isinstance(cluster, ClusterShape)):
        raise SimulationError("known_throughput is for the in-memory scheduler on a cluster of one GPU type")
    overheads = overheads or RestartOverheads()
    profiles = profiles or default_profiles(cluster)
    capacity = cluster.capacity
    too_big = [j for j in trace if j.num_gpus > capacity]
    if too_big:
        raise SimulationError(
            f"{len(too_big)} job(s) ask for more GPUs than the {cluster} cluster has ({capacity}), "
            f"e.g. job {too_big[0].job_id!r} asks for {too_big[0].num_gpus}; "
            "cut the trace with `airflow-elastic-gpu workload` or use a larger --cluster"
        )
    rng = random.Random(seed)
    jobs: list[_SimJob] = []
    per_gpu_best: dict[int, float] = {}  # id(job) -> its best samples/s per GPU (the makespan bound)
    for tj in sorted(trace, key=lambda j: (j.submit_time_s, j.job_id)):
        prof = profiles.assign(tj.model, tj.gpu_time_s, rng)
        nodes_req = -(-tj.num_gpus // cluster.gpus_per_node)
        work = tj.duration_s * prof.samples_per_s(tj.num_gpus, nodes_req)
        max_gpus = min(capacity, max(prof.max_gpus, tj.num_gpus))
        speeds = _speeds_by_count(prof, cluster, max_gpus)
        best_speeds = tuple(itertools.accumulate(speeds, max))
        rec = JobRecord(tj.job_id, prof.model, tj.submit_time_s, tj.num_gpus, tj.duration_s, work,
                        lower_bound_jct_s=work / best_speeds[-1], best_speeds=best_speeds)
        jobs.append(_SimJob(rec, prof, 1, max_gpus))
        per_gpu_best[id(jobs[-1])] = max(speed / n for n, speed in enumerate(speeds, 1))
    first_submit = jobs[0].record.submit_s
    makespan_lb = max(
        max(j.record.submit_s + j.record.lower_bound_jct_s for j in jobs) - first_submit,
        sum(j.work / per_gpu_best[id(j)] for j in jobs) / capacity,
    )

    nodes = cluster.node_states()
    default_overhead = overheads.of(mech)
    sched: Scheduler = (
        BrokerScheduler(pol, nodes, default_overhead, broker_url)
        if broker
        else PolicyScheduler(pol, nodes, default_overhead)
    )
    overhead = overheads.of(mech)
    recreate = mech == "recreate"
    stop_s, start_s = overheads.recreate.stop_s, overheads.recreate.start_s
    ack_s = overheads.ack_delay_s(mech)
    allocations: list[tuple[float, str, int]] = []
    busy: list[tuple[float, int]] = [(first_submit, 0)]
    held = 0
    active: dict[str, _SimJob] = {}  # sid -> job, in submit order
    pending = list(jobs)
    pending.reverse()  # pop() from the end = earliest
    finished = 0
    now = first_submit
    next_tick = first_submit
    t_wall = time.perf_counter()

    def sample(j: _SimJob) -> None:
        sched.progress(j.sid, j.done, j.generation, now)

    largest_node = max(len(n.gpu_indices) for n in nodes)

    def moved(j: _SimJob, gpus: Sequence[GpuId]) -> str | None:
        """How an in-place resize of ``j`` to ``gpus`` reaches a node it has no pod on: ``"pod"``
        (a job on one node: its pod is deleted and made on the new node, as the Kubernetes backend
        does in either mode), ``"gang"`` (a job larger than every node, one pod per node: a pod is
        made on the new node while the others restart in place), or None (no new node)."""
        if mech != "inplace" or not j.pod_nodes or {g.node for g in gpus} <= j.pod_nodes:
            return None
        return "gang" if j.max_gpus > largest_node else "pod"

    def inplace_cost(j: _SimJob, gpus: Sequence[GpuId]) -> float:
        """Seconds an in-place resize of ``j`` to ``gpus`` costs, its stop included: the in-place
        restart; a pod made on another node: the re-creation's whole cost (its old pod is deleted
        first); a gang's new node: the longer of the in-place restart and the new pod's start."""
        how = moved(j, gpus)
        if how == "gang":
            return max(overhead, overheads.recreate.start_s)
        return overheads.recreate.cost_s if how == "pod" else overhead

    def ack_delay(j: _SimJob, gpus: Sequence[GpuId]) -> float:
        """Seconds from the publication to the job's ack: its trainer's stop on the old GPUs (none
        for a suspended job), and for a pod made on a new node, until that pod's agent runs
        (scheduling, image pull, container start: the new pod's start less the trainer's
        initialisation); a single pod's new one is made once the old one is gone. Until the ack the
        job holds its old GPUs and may only grow (``scheduling/publish.py``), as in the broker."""
        stop = ack_s if j.alloc else 0.0
        agent = max(overheads.recreate.start_s - overheads.recreate.init_s, 0.0)
        how = moved(j, gpus)
        if how == "pod":
            return (overheads.recreate.stop_s if j.alloc else 0.0) + agent
        return max(stop, agent) if how == "gang" else stop

    def apply_targets() -> None:
        changed = True
        while changed:
            changed = False
            for j in list(active.values()):
                if j.terminating_until is not None or j.acking_until is not None:
                    continue  # its pod is going away (re-queued once gone), or its trainer is stopping
                gen, gpus = sched.current(j.sid)
                if gen <= j.generation:
                    continue
                if recreate and j.alloc:  # delete the pod: its GPUs stay taken until it is gone
                    j.generation = gen
                    j.terminating_until = now + stop_s
                    j.restart_until = max(j.restart_until, j.terminating_until)
                    j.awaiting_first_sample = False
                    if gpus:
                        j.record.resizes += 1
                    else:
                        j.record.preemptions += 1
                    continue
                # a resume from zero GPUs pays the restart less the stop, paid at the suspension
                restart_until = now + max(inplace_cost(j, gpus) - (0.0 if j.alloc else ack_s), 0.0)
                delay = ack_delay(j, gpus)
                if delay > 0:  # in place: its trainer stops on its GPUs (a new pod starts), then it acks
                    j.generation = gen
                    j.acking_until = now + delay
                    j.restart_until = max(j.restart_until, restart_until)
                    j.awaiting_first_sample = False
                    continue
                changed = True
                j.generation = gen
                take(j, gen, gpus, restart_until)

    def take(j: _SimJob, gen: int, gpus: Sequence[GpuId], restart_until: float) -> None:
        """Job ``j``'s trainer runs on generation ``gen``'s ``gpus`` from now: the ack."""
        nonlocal held
        old = j.alloc
        j.alloc = tuple(gpus)
        if j.alloc:
            j.pod_nodes = frozenset(g.node for g in j.alloc)
        j.speed = j.profile.speed_on(j.alloc) if j.alloc else 0.0
        held += len(j.alloc) - len(old)
        if len(j.alloc) != len(old):
            allocations.append((now, j.record.job_id, len(j.alloc)))
            busy.append((now, held))
        if j.alloc and j.record.start_s is None:
            j.record.start_s = now
            j.restart_until = now
        elif j.alloc and j.requeued_s is not None:  # the re-created pod is placed
            j.record.recreate_wait_s += now - j.requeued_s
            j.requeued_s = None
            j.restart_until = now + start_s
        elif j.alloc:
            j.restart_until = restart_until
            if old:
                j.record.resizes += 1
        elif old:
            j.record.preemptions += 1
        sched.ack(j.sid, gen, now)
        j.awaiting_first_sample = bool(j.alloc)
        if j.alloc and j.restart_until <= now:
            j.awaiting_first_sample = False
            sample(j)

    def acked(j: _SimJob) -> None:
        """The in-place restart's old trainer has stopped: the job acks the latest generation (a
        growth published meanwhile included) and holds its GPUs from now."""
        gen, gpus = sched.current(j.sid)
        j.generation, j.acking_until = gen, None
        take(j, gen, gpus, j.restart_until)

    def release(j: _SimJob) -> None:
        """The deleted pod is gone: its GPUs are free and the job waits to be placed again."""
        nonlocal held
        held -= len(j.alloc)
        allocations.append((now, j.record.job_id, 0))
        busy.append((now, held))
        j.alloc, j.speed, j.terminating_until, j.requeued_s = (), 0.0, None, now
        j.generation = sched.requeue(j.sid, now)

    def advance(t: float) -> None:
        for j in active.values():
            if not j.alloc:
                continue
            dt = t - now
            n = len(j.alloc)
            productive = max(0.0, t - max(now, j.restart_until))
            j.record.gpu_s += n * dt
            j.record.restart_lost_s += dt - productive
            j.record.restart_lost_gpu_s += n * (dt - productive)
            j.done = min(j.work, j.done + j.speed * productive)

    while pending or active:
        candidates = []
        if pending:
            candidates.append(pending[-1].record.submit_s)
        if active:
            candidates.append(next_tick)
        for j in active.values():
            if not j.alloc:
                if j.acking_until is not None:  # resumed onto a node it has no pod on: the new pod starts
                    candidates.append(j.acking_until)
                continue
            if j.terminating_until is not None:
                candidates.append(j.terminating_until)
            elif j.acking_until is not None:
                candidates.append(j.acking_until)
            elif j.restart_until > now:
                candidates.append(j.restart_until)
            elif j.speed > 0:
                candidates.append(now + (j.work - j.done) / j.speed)
        t = max(now, min(candidates))
        advance(t)
        now = t
        # 1. jobs that finished
        for sid, j in list(active.items()):
            if (j.alloc and j.terminating_until is None and j.restart_until <= now
                    and j.work - j.done <= 1e-9 * max(1.0, j.work)):
                j.done = j.work
                j.record.end_s = now
                held -= len(j.alloc)
                allocations.append((now, j.record.job_id, 0))
                busy.append((now, held))
                j.alloc = ()
                del active[sid]
                sched.finish(sid, now)
                finished += 1
                if progress is not None:
                    progress(finished / len(jobs))
        # 2. deleted pods that are gone (re-creation) give their GPUs back
        for j in list(active.values()):
            if j.terminating_until is not None and j.terminating_until <= now:
                release(j)
        # 2b. in-place restarts whose old trainer stopped ack their generation
        for j in list(active.values()):
            if j.acking_until is not None and j.acking_until <= now:
                acked(j)
        # 3. trainers that came back after a restart report their first step
        for j in active.values():
            if j.awaiting_first_sample and j.restart_until <= now:
                j.awaiting_first_sample = False
                sample(j)
        # 4. arrivals
        while pending and pending[-1].record.submit_s <= now:
            j = pending.pop()
            known = {}
            if known_throughput:  # the oracle: steps are samples, as the work is (see _SimJob)
                gpn = cluster.gpus_per_node
                known["throughput"] = ThroughputModel(tuple(
                    (n, j.profile.samples_per_s(n, -(-n // gpn))) for n in range(1, j.max_gpus + 1)))
            j.sid = sched.submit(j.record.job_id, j.min_gpus, j.max_gpus, j.record.requested_gpus,
                                 max(1, math.ceil(j.work)), now, preemptible,
                                 getattr(j.profile, "relative_speed", None), j.record.model, **known)
            active[j.sid] = j
        # 5. the periodic report and rebalance
        if active and now >= next_tick:
            for j in active.values():
                if (j.alloc and j.restart_until <= now and not j.awaiting_first_sample
                        and j.terminating_until is None):
                    sample(j)
            sched.rebalance(now)
            next_tick = now + rebalance_interval_s
        elif not active and pending:
            next_tick = pending[-1].record.submit_s
        apply_targets()

    return SimulationResult(
        policy=getattr(pol, "name", str(policy)),
        mechanism=mech,
        cluster=cluster,
        jobs=[j.record for j in jobs],
        allocations=allocations,
        busy=busy,
        decisions=sched.decisions,
        decision_s=sched.decision_s,
        wall_s=time.perf_counter() - t_wall,
        makespan_lower_bound_s=makespan_lb,
        work_done=sum(j.done for j in jobs),
    )

