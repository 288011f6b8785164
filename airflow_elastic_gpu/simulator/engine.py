"""The discrete-event simulator: a GPU pool, a job trace, measured speeds, and one policy.

Source of the method: the trace-driven simulators of Tiresias (NSDI'19),
Gavel (OSDI'20) and Pollux (OSDI'21): jobs arrive as in the trace, each job's
work is its recorded duration times its measured speed on its requested GPUs,
and a job advances at the measured speed of the GPUs it holds (node spread
included). The scheduler side is the real one:

* **policy mode** (default): :class:`PolicyScheduler` runs the broker's scheduling core
  (:mod:`airflow_elastic_gpu.scheduling.core`: two-phase publish/ack with generations,
  throughput learnt online from progress samples, pool-median prior, restart overhead measured
  from the first progress after a resize) in memory, rebalancing on submit/ack/finish and on a
  period;
* **broker mode**: :class:`BrokerScheduler` drives a real
  :class:`~airflow_elastic_gpu.broker.service.GpuBroker` (SQLite in memory)
  whose clock is the simulated one.

Both report progress exactly as the sidecar agent does: one sample when a
generation's trainer makes its first step (after the restart overhead) and
one per rebalance period.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from airflow_elastic_gpu.scheduling.core import JobBook, SchedulingCore, apply_ack, record_progress
from airflow_elastic_gpu.scheduling.policy import Policy, get_policy
from airflow_elastic_gpu.scheduling.state import ClusterState, GpuId, NodeState
from airflow_elastic_gpu.simulator.profiles import Profile, ProfileSet, load_profiles
from airflow_elastic_gpu.simulator.trace import TraceJob

# Restart overheads (seconds of training lost per resize). In-place: the median
# measured by benchmarks/resize_overhead.py (docs/benchmarks.md). Re-creation:
# the measured cold start plus a pod's delete/schedule/start cycle, which
# cannot be measured here (no cluster) and is an assumption: 30 s.
DEFAULT_INPLACE_RESTART_S = 6.5
DEFAULT_COLD_START_S = 5.0
ASSUMED_POD_RECREATE_S = 30.0
DEFAULT_RECREATE_RESTART_S = DEFAULT_COLD_START_S + ASSUMED_POD_RECREATE_S
MECHANISMS = ("inplace", "recreate", "none")


class SimulationError(ValueError):
    """Bad simulator input (cluster shape, overheads, a job the cluster can never run)."""


@dataclass(frozen=True)
class ClusterShape:
    """``nodes`` nodes of ``gpus_per_node`` GPUs each."""

    nodes: int
    gpus_per_node: int
    gpu_type: str = "T4"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise SimulationError(
                f"a cluster needs >= 1 node of >= 1 GPU, got {self.nodes}x{self.gpus_per_node}"
            )

    @classmethod
    def parse(cls, text: str, gpu_type: str = "T4") -> ClusterShape:
        """``"4x4"`` -> 4 nodes of 4 GPUs.

        :raises SimulationError: anything but ``NODESxGPUS`` with positive integers.
        """
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text or "")
        if not m:
            raise SimulationError(
                f"cluster shape must look like NODESxGPUS_PER_NODE, e.g. 4x4, got {text!r}"
            )
        return cls(int(m.group(1)), int(m.group(2)), gpu_type)

    @property
    def capacity(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_states(self) -> tuple[NodeState, ...]:
        width = len(str(self.nodes - 1))
        return tuple(
            NodeState(f"node-{i:0{width}d}", tuple(range(self.gpus_per_node)), self.gpu_type)
            for i in range(self.nodes)
        )

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"


@dataclass(frozen=True)
class RestartOverheads:
    """Seconds of training lost per resize, by mechanism (see the module constants)."""

    inplace_s: float = DEFAULT_INPLACE_RESTART_S
    recreate_s: float = DEFAULT_RECREATE_RESTART_S

    def __post_init__(self) -> None:
        for name in ("inplace_s", "recreate_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise SimulationError(f"restart overhead {name} must be a finite number >= 0, got {value!r}")

    def of(self, mechanism: str) -> float:
        return self.recreate_s if mechanism == "recreate" else self.inplace_s

    @classmethod
    def from_benchmark(cls, path: str | Path, pod_recreate_s: float = ASSUMED_POD_RECREATE_S) -> RestartOverheads:
        """Overheads from a ``benchmarks/results/resize_overhead.json`` file.

        :raises SimulationError: missing file or fields.
        """
        try:
            data = json.loads(Path(path).read_text())
            return cls(float(data["resize_overhead_s"]), float(data["cold_start_s"]) + pod_recreate_s)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SimulationError(f"cannot read restart overheads from {str(path)!r}: {exc}") from None


# --------------------------------------------------------------------------- scheduler side


class Scheduler(Protocol):
    """What the simulator needs from a scheduler: the broker's calls, with the time passed in."""

    decisions: int
    decision_s: float

    def submit(self, job_id: str, min_gpus: int, max_gpus: int, requested_gpus: int,
               total_steps: int, now: float) -> str: ...
    def current(self, sid: str) -> tuple[int, tuple[GpuId, ...]]: ...
    def progress(self, sid: str, step: float, generation: int, now: float) -> None: ...
    def ack(self, sid: str, generation: int, now: float) -> None: ...
    def finish(self, sid: str, now: float) -> None: ...
    def rebalance(self, now: float) -> None: ...


class _TimedPolicy:
    """Wraps a policy to count its decisions and their wall time."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.elastic = policy.elastic
        self.preemptive = getattr(policy, "preemptive", False)
        self.resize_mechanism = getattr(policy, "resize_mechanism", "inplace")
        self.decisions = 0
        self.decision_s = 0.0

    def decide(self, cluster: ClusterState) -> Any:
        t0 = time.perf_counter()
        try:
            return self.policy.decide(cluster)
        finally:
            self.decisions += 1
            self.decision_s += time.perf_counter() - t0


class PolicyScheduler:
    """The scheduling core in memory, with the broker's calls (submit, progress, ack, finish, rebalance).

    The same :class:`~airflow_elastic_gpu.scheduling.core.SchedulingCore` as the broker's, over
    :class:`~airflow_elastic_gpu.scheduling.core.JobBook` values kept in a dict instead of rows.

    :param policy: any policy; a preemptive one may take all GPUs of a running job.
    :param nodes: the pool's nodes.
    :param default_restart_overhead_s: what the policy assumes before a job's first measured resize.
    """

    def __init__(self, policy: Policy, nodes: Sequence[NodeState], default_restart_overhead_s: float) -> None:
        self.policy = _TimedPolicy(policy)
        self.core = SchedulingCore(self.policy, default_restart_overhead_s)
        self.nodes = tuple(nodes)
        self.jobs: dict[str, JobBook] = {}
        self._last_sample: dict[str, tuple[int, float, float]] = {}  # job -> (generation, time_s, step)

    @property
    def decisions(self) -> int:
        return self.policy.decisions

    @property
    def decision_s(self) -> float:
        return self.policy.decision_s

    def submit(self, job_id: str, min_gpus: int, max_gpus: int, requested_gpus: int,
               total_steps: int, now: float) -> str:
        self.jobs[job_id] = JobBook(job_id, min_gpus, max_gpus, total_steps, now, requested_gpus=requested_gpus)
        self.rebalance(now)
        return job_id

    def current(self, sid: str) -> tuple[int, tuple[GpuId, ...]]:
        book = self.jobs[sid]
        return book.target_generation, book.target

    def progress(self, sid: str, step: float, generation: int, now: float) -> None:
        book = self.jobs.get(sid)
        if book is None:
            return
        last = self._last_sample.get(sid)
        previous = (last[1], last[2]) if last is not None and last[0] == generation else None
        if record_progress(book, generation=generation, step=step, now_s=now, previous=previous):
            self._last_sample[sid] = (generation, now, step)

    def ack(self, sid: str, generation: int, now: float) -> None:
        book = self.jobs.get(sid)
        if book is not None and apply_ack(book, generation, now):
            self.rebalance(now)

    def finish(self, sid: str, now: float) -> None:
        if self.jobs.pop(sid, None) is not None:
            self._last_sample.pop(sid, None)
            self.rebalance(now)

    def rebalance(self, now: float) -> None:
        books = sorted(self.jobs.values(), key=lambda b: (b.submit_s, b.job_id))
        self.core.rebalance(self.nodes, books, now)


class BrokerScheduler:
    """The real :class:`GpuBroker` on an in-memory SQLite database, on the simulated clock."""

    def __init__(self, policy: Policy, nodes: Sequence[NodeState], default_restart_overhead_s: float,
                 url: str = "sqlite://") -> None:
        from airflow_elastic_gpu.broker.service import GpuBroker

        self.now = 0.0
        self._policy = _TimedPolicy(policy)
        self.broker = GpuBroker(url, policy=self._policy, clock=lambda: self.now,
                                default_restart_overhead_s=default_restart_overhead_s)
        for n in nodes:
            self.broker.register_node(n.name, gpu_type=n.gpu_type, gpu_indices=n.gpu_indices)
        from airflow_elastic_gpu.broker.inventory import MAX_PERIOD_S

        # the simulator calls rebalance itself, and agents never go silent
        self.broker.configure_pool(lease_s=MAX_PERIOD_S, rebalance_interval_s=MAX_PERIOD_S)

    @property
    def decisions(self) -> int:
        return self._policy.decisions

    @property
    def decision_s(self) -> float:
        return self._policy.decision_s

    def submit(self, job_id: str, min_gpus: int, max_gpus: int, requested_gpus: int,
               total_steps: int, now: float) -> str:
        from airflow_elastic_gpu.broker.types import JobSpec

        self.now = now
        view = self.broker.submit(JobSpec(
            name=job_id, command="simulated", min_gpus=min_gpus, max_gpus=max_gpus,
            requested_gpus=requested_gpus, total_steps=total_steps, key=job_id, backend="simulated",
        ))
        return view.id

    def current(self, sid: str) -> tuple[int, tuple[GpuId, ...]]:
        t = self.broker.target(sid)
        return t.generation, t.gpus

    def progress(self, sid: str, step: float, generation: int, now: float) -> None:
        self.now = now
        self.broker.progress(sid, step, generation=generation, time_s=now)

    def ack(self, sid: str, generation: int, now: float) -> None:
        self.now = now
        self.broker.ack(sid, generation)

    def finish(self, sid: str, now: float) -> None:
        self.now = now
        self.broker.finish(sid)

    def rebalance(self, now: float) -> None:
        self.now = now
        self.broker.rebalance()


# --------------------------------------------------------------------------- results


@dataclass
class JobRecord:
    """One job's outcome (seconds; ``work`` in samples of its model)."""

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

    @property
    def jct_s(self) -> float:
        return (self.end_s if self.end_s is not None else math.inf) - self.submit_s

    @property
    def queueing_s(self) -> float:
        return (self.start_s if self.start_s is not None else math.inf) - self.submit_s


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

    def summary(self) -> dict[str, Any]:
        """Averages and tails over all jobs (seconds); see ``docs/simulator.md`` for each field."""
        jct = sorted(j.jct_s for j in self.jobs)
        first = min(j.submit_s for j in self.jobs)
        last = max(j.end_s or math.inf for j in self.jobs)
        makespan = last - first
        gpu_s = sum(j.gpu_s for j in self.jobs)

        def pct(q: float) -> float:
            return jct[min(len(jct) - 1, max(0, math.ceil(q * len(jct)) - 1))]

        avg_lb = sum(j.lower_bound_jct_s for j in self.jobs) / len(self.jobs)
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
            "avg_jct_lower_bound_s": avg_lb,
            "makespan_lower_bound_s": self.makespan_lower_bound_s,
            "avg_jct_over_bound": (sum(jct) / len(jct)) / avg_lb if avg_lb > 0 else math.nan,
            "makespan_over_bound": makespan / self.makespan_lower_bound_s
            if self.makespan_lower_bound_s > 0 else math.nan,
            "decisions": self.decisions,
            "avg_decision_ms": 1000 * self.decision_s / self.decisions if self.decisions else 0.0,
            "wall_s": self.wall_s,
        }


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

    @property
    def work(self) -> float:
        return self.record.work


def _job_speed(profile: Profile, gpus: tuple[GpuId, ...]) -> float:
    if not gpus:
        return 0.0
    return profile.samples_per_s(len(gpus), len({g.node for g in gpus}))


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
) -> SimulationResult:
    """Run ``trace`` on ``cluster`` under ``policy``; deterministic for a given ``seed``.

    :param trace: jobs; each must fit the cluster (``num_gpus <= capacity``).
    :param policy: a policy name (:func:`~airflow_elastic_gpu.scheduling.policy.get_policy`) or object.
    :param profiles: scaling profiles (default: the bundled Pollux T4 ones). A job
        without a ``model`` gets one drawn with ``seed`` by its GPU-time.
    :param overheads: seconds lost per resize for each mechanism.
    :param mechanism: ``"inplace"`` or ``"recreate"``; default the policy's own
        (``adaptive``: in place; ``termination``, ``tiresias``, ``optimus``, ``afs_l``: re-create).
    :param rebalance_interval_s: period (s, > 0) of the periodic rebalance and of progress reports.
    :param broker: drive a real ``GpuBroker`` instead of the in-memory scheduler (slower; small traces).
    :param progress: called with the fraction of jobs finished, for progress bars.
    :raises SimulationError: an empty trace, a job larger than the cluster, or bad parameters.
    """
    if not trace:
        raise SimulationError("the trace has no jobs")
    if not rebalance_interval_s > 0:
        raise SimulationError(f"rebalance_interval_s must be > 0, got {rebalance_interval_s!r}")
    pol = get_policy(policy) if isinstance(policy, str) else policy
    mech = mechanism or getattr(pol, "resize_mechanism", "inplace")
    if mech not in MECHANISMS:
        raise SimulationError(f"mechanism must be one of {', '.join(MECHANISMS)}, got {mech!r}")
    overheads = overheads or RestartOverheads()
    profiles = profiles or load_profiles()
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
    for tj in sorted(trace, key=lambda j: (j.submit_time_s, j.job_id)):
        prof = profiles.assign(tj.model, tj.gpu_time_s, rng)
        nodes_req = -(-tj.num_gpus // cluster.gpus_per_node)
        work = tj.duration_s * prof.samples_per_s(tj.num_gpus, nodes_req)
        max_gpus = min(capacity, max(prof.max_gpus, tj.num_gpus))
        best_n, best_speed = prof.best(max_gpus, cluster.gpus_per_node)
        rec = JobRecord(tj.job_id, prof.model, tj.submit_time_s, tj.num_gpus, tj.duration_s, work,
                        lower_bound_jct_s=work / best_speed)
        jobs.append(_SimJob(rec, prof, 1, max_gpus))
    per_gpu_best = {
        id(j): max(j.profile.samples_per_s(n, -(-n // cluster.gpus_per_node)) / n
                   for n in range(1, j.max_gpus + 1))
        for j in jobs
    }
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

    def apply_targets() -> None:
        nonlocal held
        changed = True
        while changed:
            changed = False
            for j in list(active.values()):
                gen, gpus = sched.current(j.sid)
                if gen <= j.generation:
                    continue
                changed = True
                old = j.alloc
                j.generation = gen
                j.alloc = tuple(gpus)
                j.speed = _job_speed(j.profile, j.alloc)
                held += len(j.alloc) - len(old)
                if len(j.alloc) != len(old):
                    allocations.append((now, j.record.job_id, len(j.alloc)))
                    busy.append((now, held))
                if j.alloc and j.record.start_s is None:
                    j.record.start_s = now
                    j.restart_until = now
                elif j.alloc:
                    j.restart_until = now + overhead
                    if old:
                        j.record.resizes += 1
                elif old:
                    j.record.preemptions += 1
                sched.ack(j.sid, gen, now)
                j.awaiting_first_sample = bool(j.alloc)
                if j.alloc and j.restart_until <= now:
                    j.awaiting_first_sample = False
                    sample(j)

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
                continue
            if j.restart_until > now:
                candidates.append(j.restart_until)
            elif j.speed > 0:
                candidates.append(now + (j.work - j.done) / j.speed)
        t = max(now, min(candidates))
        advance(t)
        now = t
        # 1. jobs that finished
        for sid, j in list(active.items()):
            if j.alloc and j.restart_until <= now and j.work - j.done <= 1e-9 * max(1.0, j.work):
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
        # 2. trainers that came back after a restart report their first step
        for j in active.values():
            if j.awaiting_first_sample and j.restart_until <= now:
                j.awaiting_first_sample = False
                sample(j)
        # 3. arrivals
        while pending and pending[-1].record.submit_s <= now:
            j = pending.pop()
            j.sid = sched.submit(j.record.job_id, j.min_gpus, j.max_gpus, j.record.requested_gpus,
                                 max(1, math.ceil(j.work)), now)
            active[j.sid] = j
        # 4. the periodic report and rebalance
        if active and now >= next_tick:
            for j in active.values():
                if j.alloc and j.restart_until <= now and not j.awaiting_first_sample:
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


def gpus_in_use_at(result: SimulationResult, t: float) -> int:
    """GPUs held at time ``t`` (step function of ``result.busy``)."""
    times = [b[0] for b in result.busy]
    i = bisect.bisect_right(times, t) - 1
    return result.busy[i][1] if i >= 0 else 0
