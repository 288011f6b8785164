"""The scheduling loop shared by the broker and the simulator: one copy of snapshot, decide, publish.

Kueue's split (``pkg/cache`` -> ``pkg/scheduler``) and AdaptDL's (a scheduler core that knows
nothing of Kubernetes) applied here: everything that turns a pool's jobs into new target
allocations lives in this module, as pure code over :class:`JobBook` values. Two adapters use it:

* the broker (:mod:`airflow_elastic_gpu.broker`) loads job rows into books inside its transaction,
  calls the core, and writes back the fields that changed;
* the simulator (:mod:`airflow_elastic_gpu.simulator.engine`) keeps the books in memory.

What the core owns:

* a job's book -> the :class:`~airflow_elastic_gpu.scheduling.state.JobState` a policy reads
  (:meth:`JobBook.job_state`), with a prior for jobs not yet measured (their family's, else a
  guess from the pool's measured jobs);
* progress samples -> the job's throughput model (overall, and per GPU type the sample was
  measured on: :func:`gpu_type_of`) and measured restart overhead (:func:`record_progress`);
* GPU-time accounting (:func:`account_gpu_time`) and the ack that moves a job's in-use set
  (:func:`apply_ack`);
* the policy call and the two-phase publish rule (:meth:`SchedulingCore.rebalance`, which uses
  :func:`~airflow_elastic_gpu.scheduling.publish.publishable`).

No I/O, no clock: the time is passed in (seconds on the caller's clock).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from airflow_elastic_gpu.scheduling.policy import Policy
from airflow_elastic_gpu.scheduling.publish import publishable
from airflow_elastic_gpu.scheduling.state import (
    ClusterState,
    GpuId,
    JobState,
    NodeState,
    largest_node_by_type,
)
from airflow_elastic_gpu.scheduling.suspension import SuspensionRule
from airflow_elastic_gpu.scheduling.throughput import (
    ThroughputModel,
    plausible_speed,
    update_restart_overhead,
    with_family_by_type,
    with_pool_prior,
)


def attained_gpu_s(gpu_seconds: float, num_in_use: int, in_use_since_s: float | None, now_s: float) -> float:
    """GPU-seconds held up to ``now_s``: ``gpu_seconds`` (counted up to the last change of the GPUs in
    use, at ``in_use_since_s``) plus ``num_in_use`` GPUs held since then."""
    if not num_in_use or in_use_since_s is None:
        return gpu_seconds
    return gpu_seconds + num_in_use * max(0.0, now_s - in_use_since_s)


@dataclass(eq=False)
class JobBook:
    """What the scheduling loop keeps of one unfinished job (mutable: the loop updates it in place).

    Field names follow the broker's job table, so the broker copies a row in and the changed
    fields back out. Times are seconds on the caller's clock.

    :param target: GPUs of the latest published generation, sorted.
    :param in_use: GPUs of the latest acked generation (the trainer runs on them), sorted.
    :param throughput: steps/s per GPU count, learnt from progress samples.
    :param throughput_by_type: GPU type -> steps/s per GPU count learnt from the samples measured on
        GPUs of that one type (a sample on GPUs of several types is in ``throughput`` only).
    :param relative_speed: GPU type -> relative single-GPU speed, the submitter's hint (only ratios
        count), or empty.
    :param restart_overhead_s: measured seconds from a resize's publish to its first progress
        (a moving average), ``None`` until the job's first resize.
    :param gpu_seconds: GPU-seconds held up to ``in_use_since_s``.
    :param preemptible: the job opted in to suspension (a resize to zero GPUs).
    :param last_start_s: when the job was last published GPUs after having none (its start or
        latest resume), or ``None``.
    :param suspensions_s: publish times of the job's suspensions (resizes to zero), ascending.
    :param finishing: a trainer of the job (one node of a gang of pods) has exited cleanly and the
        job waits for the others: its allocation is not changed again.
    :param unreachable: the broker has heard nothing from the job's agent for half its lease since
        its last heartbeat, start or resume (with the default fence period its launcher has fenced
        the trainer by then): its allocation is not changed until it reports again or is declared
        lost (a new generation would give it a whole lease again).
    :param single_node: the job cannot run on several nodes (its command has no gang placeholders): a
        decision that spreads it is not published (it keeps its GPUs, or waits, until one node has room).
    """

    job_id: str
    min_gpus: int
    max_gpus: int
    total_steps: int
    submit_s: float
    requested_gpus: int | None = None
    priority: int = 0
    steps_done: float = 0.0
    target: tuple[GpuId, ...] = ()
    target_generation: int = 0
    in_use: tuple[GpuId, ...] = ()
    acked_generation: int = 0
    num_resizes: int = 0
    last_resize_s: float | None = None
    published_s: float | None = None
    restart_overhead_s: float | None = None
    throughput: ThroughputModel = field(default_factory=ThroughputModel)
    gpu_seconds: float = 0.0
    in_use_since_s: float | None = None
    start_s: float | None = None
    preemptible: bool = False
    last_start_s: float | None = None
    suspensions_s: tuple[float, ...] = ()

    @property
    def suspended(self) -> bool:
        """True if the job's latest target is zero GPUs after it had some: it is suspended."""
        return self.target_generation > 0 and not self.target and bool(self.suspensions_s)
    throughput_by_type: dict[str, ThroughputModel] = field(default_factory=dict)
    relative_speed: Mapping[str, float] = field(default_factory=dict)
    family: str | None = None
    finishing: bool = False
    unreachable: bool = False
    single_node: bool = False

    @property
    def at_last_step(self) -> bool:
        """True once the trainer has reported its last step (``total_steps``, or ``total_steps - 1``
        for a trainer that counts from 0) on GPUs: it evaluates or saves now, and a resize would stop
        it there to restart for nothing (a gang's node that ends first would never rejoin). Not past
        ``total_steps``: a trainer that trains on past it was given too few, and is resized as any;
        nor a job of one step (it would be fixed from its start). The core still moves such a job
        off GPUs that may no longer be handed out (a drain)."""
        return (bool(self.target) and self.total_steps > 1 and self.steps_done > 0
                and self.total_steps - 1 <= self.steps_done <= self.total_steps)

    def attained_gpu_s(self, now_s: float) -> float:
        """GPU-seconds the job has held up to ``now_s`` (Tiresias' attained service)."""
        return attained_gpu_s(self.gpu_seconds, len(self.in_use), self.in_use_since_s, now_s)

    def num_gpus_of(self, generation: int) -> int:
        """GPUs the trainer of ``generation`` runs on: the target's if it is the latest, the acked
        in-use set's if it is the acked one (a sample arriving late), else 0: a generation
        published and run, then replaced before its ack, ran on neither set (its count is not kept)."""
        return len(self.gpus_of(generation))

    def gpus_of(self, generation: int) -> tuple[GpuId, ...]:
        """The GPUs of :meth:`num_gpus_of` (empty when not known)."""
        if generation == self.target_generation:
            return self.target
        return self.in_use if generation == self.acked_generation else ()

    def job_state(self, now_s: float, default_restart_overhead_s: float,
                  throughput: ThroughputModel | None = None,
                  throughput_by_type: Mapping[str, ThroughputModel] | None = None) -> JobState:
        """What a policy sees of this job at ``now_s``.

        :param default_restart_overhead_s: assumed until the job's first resize is measured.
        :param throughput: the model to show (default the job's own; the core passes one with the
            pool prior applied).
        :param throughput_by_type: the per-type models to show (default the job's own; the core
            passes them with its family's samples added).
        """
        return JobState(
            job_id=self.job_id,
            min_gpus=self.min_gpus,
            max_gpus=self.max_gpus,
            requested_gpus=self.requested_gpus,
            total_steps=self.total_steps,
            steps_done=self.steps_done,
            submit_time_s=self.submit_s,
            allocation=self.target,
            last_resize_s=self.last_resize_s,
            restart_overhead_s=(
                self.restart_overhead_s if self.restart_overhead_s is not None
                else default_restart_overhead_s
            ),
            throughput=throughput if throughput is not None else self.throughput,
            priority=self.priority,
            attained_gpu_s=self.attained_gpu_s(now_s),
            first_start_s=self.start_s,
            preemptible=self.preemptible,
            last_start_s=self.last_start_s,
            suspensions_s=self.suspensions_s,
            throughput_by_type=self.throughput_by_type if throughput_by_type is None else throughput_by_type,
            relative_speed=self.relative_speed,
        )


def at_most(gpus: Sequence[GpuId], n: int) -> tuple[GpuId, ...]:
    """``gpus`` if there are at most ``n``, else ``n`` of them on as few nodes as may be (the nodes
    holding most of them first). A policy keeps a running job's count, and the broker may lower a
    job's ``max_gpus`` below it (a command that runs on one node, a node's GPUs out of service)."""
    if len(gpus) <= n:
        return tuple(gpus)
    on = Counter(g.node for g in gpus)
    return tuple(sorted(sorted(gpus, key=lambda g: (-on[g.node], g.node, g.index))[:n]))


def gpu_type_of(gpus: Iterable[GpuId], node_types: Mapping[str, str]) -> str | None:
    """The one GPU type of ``gpus`` (``node_types``: node name -> its GPUs' type), or None when they
    are of several types, none, or on a node ``node_types`` does not know."""
    types = {node_types.get(g.node) for g in gpus}
    if len(types) != 1:
        return None
    return types.pop()


def record_progress(book: JobBook, *, generation: int, step: float, now_s: float,
                    previous: tuple[float, float] | None, num_gpus: int | None = None,
                    gpu_type: str | None = None) -> bool:
    """Learn from one progress report: the trainer of ``generation`` reached ``step`` at ``now_s``.

    Two samples of one generation give a throughput sample (steps/s on that generation's GPU
    count, folded into the job's model); the first sample of a resized generation gives a measured
    restart overhead (seconds from publish to first progress). Reports of an older generation than
    the acked one, or of generation 0, are ignored. A speed out of :data:`~.throughput.SPEED_RANGE`
    (an absurd step) folds into no model; its step counts.

    :param previous: ``(time_s, step)`` of the latest earlier sample of the same generation, or None.
    :param num_gpus: GPUs the trainer of ``generation`` runs on, where the caller counted them
        (default :meth:`JobBook.num_gpus_of`, from the book's GPU sets).
    :param gpu_type: the one GPU type of those GPUs (:func:`gpu_type_of`), or None (several types,
        or not known): a throughput sample is also folded into ``book.throughput_by_type[gpu_type]``.

    :returns: True if the sample counts (the caller stores it as the generation's latest). A step
        the generation's latest sample has already reported does not (an HTTP report sent again
        after its reply was lost, a progress pattern that matches two lines of one step): stored at
        its later time, it shortened the next sample's interval and inflated its throughput.
    """
    if generation < book.acked_generation or generation < 1:
        return False
    if previous is not None and step == previous[1]:
        return False
    if num_gpus is None:
        num_gpus = book.num_gpus_of(generation)
    if (previous is None and book.published_s is not None and generation == book.target_generation
            and generation > 1):
        book.restart_overhead_s = update_restart_overhead(book.restart_overhead_s, now_s - book.published_s)
    if previous is not None and now_s > previous[0] and step > previous[1] and num_gpus > 0:
        speed = (step - previous[1]) / (now_s - previous[0])
        if plausible_speed(speed):
            book.throughput = book.throughput.with_sample(num_gpus, speed)
            if gpu_type is not None:
                by_type = book.throughput_by_type
                by_type[gpu_type] = by_type.get(gpu_type, ThroughputModel()).with_sample(num_gpus, speed)
    book.steps_done = step
    return True


def account_gpu_time(book: JobBook, now_s: float) -> None:
    """Add the GPU-seconds the job's in-use set held since the last accounting, up to ``now_s``."""
    book.gpu_seconds = book.attained_gpu_s(now_s)
    book.in_use_since_s = now_s


def apply_ack(book: JobBook, generation: int, now_s: float) -> bool:
    """The trainer runs on ``generation``'s GPUs: its in-use set becomes the target.

    :returns: False (nothing changed) for an older generation, or one already acked.
    """
    if generation != book.target_generation or generation <= book.acked_generation:
        return False
    account_gpu_time(book, now_s)
    if book.acked_generation >= 1:
        book.num_resizes += 1
    book.in_use = book.target
    book.acked_generation = generation
    if book.start_s is None and book.in_use:
        book.start_s = now_s
    return True


@dataclass(frozen=True)
class Publication:
    """A new generation published to one job by :meth:`SchedulingCore.rebalance`.

    :param gpus: the new target, sorted (empty: the job was suspended: a preemptive policy, or a
        preemptible job under a policy that suspends).
    :param previous_gpus: how many GPUs its previous target had (0: the job's first start).
    :param reason: the policy's one-line reason.
    """

    job_id: str
    generation: int
    gpus: tuple[GpuId, ...]
    previous_gpus: int
    reason: str


class SchedulingCore:
    """One pool's policy call and publish rule, over the books of its unfinished jobs.

    :param policy: any :class:`~airflow_elastic_gpu.scheduling.policy.Policy`.
    :param default_restart_overhead_s: what the policy assumes before a job's first measured resize
        (seconds, >= 0).
    """

    def __init__(self, policy: Policy, default_restart_overhead_s: float) -> None:
        if not default_restart_overhead_s >= 0:
            raise ValueError(f"default_restart_overhead_s must be >= 0, got {default_restart_overhead_s!r}")
        self.policy = policy
        self.default_restart_overhead_s = default_restart_overhead_s

    def cluster_state(self, nodes: Sequence[NodeState], books: Sequence[JobBook], now_s: float,
                      history: Mapping[str, ThroughputModel] | None = None,
                      history_by_type: Mapping[str, Mapping[str, ThroughputModel]] | None = None) -> ClusterState:
        """The policy's input: every job's state, unmeasured jobs with their family's prior or the
        pool's guess (:func:`~airflow_elastic_gpu.scheduling.throughput.with_pool_prior`, given
        every job's remaining steps: a guess is also made in time, not only in steps;
        ``history``: family -> the throughput model of its last finished measured job), and on a
        pool of several GPU types its family's samples per type
        (:func:`~airflow_elastic_gpu.scheduling.throughput.with_family_by_type`;
        ``history_by_type``: family -> GPU type -> that job's model on the type).

        Every book's models are given the pool's node size (``ThroughputModel.node_gpus``: per GPU
        type, the healthy GPUs of its largest node) and kept on the book, so that a model kept from
        one decision to the next keeps its predictions."""
        families = {b.job_id: b.family for b in books}
        node_gpus = largest_node_by_type(nodes)
        largest = max(node_gpus.values(), default=0)
        for b in books:
            b.throughput = b.throughput.on_nodes_of(largest)
            if any(m.node_gpus != node_gpus.get(t, largest) for t, m in b.throughput_by_type.items()):
                b.throughput_by_type = {t: m.on_nodes_of(node_gpus.get(t, largest))
                                        for t, m in b.throughput_by_type.items()}
        models = with_pool_prior({b.job_id: b.throughput for b in books}, families, history,
                                 {b.job_id: max(0.0, b.total_steps - b.steps_done) for b in books})
        by_type: Mapping[str, Mapping[str, ThroughputModel] | None] = dict.fromkeys(models)
        if len(node_gpus) > 1:  # only a pool of several types reads them
            # the books' models know their type's node size already (above); a model made for a type
            # a job has none of is given it there (a type no longer in the pool: the largest node's)
            by_type = with_family_by_type({b.job_id: b.throughput_by_type for b in books}, families,
                                          history_by_type, node_gpus, largest)
        return ClusterState(
            tuple(nodes),
            tuple(b.job_state(now_s, self.default_restart_overhead_s, models[b.job_id], by_type[b.job_id])
                  for b in books),
            now_s,
        )

    def rebalance(self, nodes: Sequence[NodeState], books: Sequence[JobBook], now_s: float,
                  history: Mapping[str, ThroughputModel] | None = None,
                  history_by_type: Mapping[str, Mapping[str, ThroughputModel]] | None = None) -> list[Publication]:
        """Decide new targets and publish what the two-phase protocol allows now.

        A published job's book gets its new target and generation (``published_s`` and, for a
        resize, ``last_resize_s`` set to ``now_s``). A growth that needs GPUs another job has not
        given back yet waits for a later rebalance, and so does any change but a growth of a job
        that has not acked its latest generation (its trainer may run on those GPUs already: they
        go to nobody else before it acks); a single-node job without GPUs that no node can hold
        waits, not counted in the decision; a finishing or unreachable job's, or one at its last step
        (:attr:`JobBook.at_last_step`), is not changed at all; a running job is taken to zero GPUs (suspended)
        only by a preemptive policy, or, when the policy suspends (``suspend=True``), if it is
        preemptible and past the policy's minimum runtime and under its hourly cap (or its GPUs are
        gone). A suspension appends ``now_s`` to ``suspensions_s``; a start or resume sets
        ``last_start_s``.

        :param nodes: the pool's schedulable nodes (healthy GPUs only).
        :param books: the pool's unfinished jobs, in the order ties are served (submit time, id).
        :param history: family -> the throughput model of its last finished measured job (the
            prior of its jobs not yet measured, or measured on one GPU count).
        :param history_by_type: family -> GPU type -> that job's model on the type.
        :returns: the publications, in publishing order (shrinks first).
        """
        if not books:
            return []
        # a single-node job without GPUs that no node can hold now (nodes lost GPUs since its submit)
        # waits outside the decision: the GPUs a policy counted for it, whose spread is refused below,
        # went to no job, decision after decision
        largest = max((len(n.gpu_indices) for n in nodes), default=0)
        placeable = [b for b in books if not (b.single_node and not b.target and b.min_gpus > largest)]
        decision = self.policy.decide(self.cluster_state(nodes, placeable, now_s, history, history_by_type))
        by_id = {b.job_id: b for b in books}
        usable = {GpuId(n.name, i) for n in nodes for i in n.gpu_indices}
        out = []
        wanted = {b.job_id: at_most(decision.allocations.get(b.job_id, ()), b.max_gpus) for b in books}
        spread = {b.job_id for b in books if b.single_node and len({g.node for g in wanted[b.job_id]}) > 1}
        suspendable: set[str] = set()
        if getattr(self.policy, "suspend", False):
            # the policy's limits hold whatever its decision (a job spanning GPU types, seen by a
            # type-aware decision with its GPUs of one type only, was suspended inside its minimum
            # runtime), unless the job's GPUs are gone (a drain, a GPU out of service)
            rule = SuspensionRule(getattr(self.policy, "min_runtime_s", SuspensionRule.min_runtime_s),
                                  getattr(self.policy, "max_suspensions_per_hour", SuspensionRule.max_per_hour))
            suspendable = {b.job_id for b in books if b.preemptible and b.target and not wanted[b.job_id] and (
                not usable.issuperset(b.target)
                or rule.eligible(b.job_state(now_s, self.default_restart_overhead_s), now_s))}
        for job_id, new in publishable(
            [b.job_id for b in books],
            {b.job_id: b.target for b in books},
            wanted,
            {g: b.job_id for b in books for g in b.in_use},
            {g: b.job_id for b in books for g in b.target},
            {b.job_id for b in books if b.target_generation > 0},
            preemptive=getattr(self.policy, "preemptive", False),
            suspendable=suspendable,
            unacked={b.job_id for b in books if b.target_generation > b.acked_generation},
            fixed={b.job_id for b in books if b.finishing or b.unreachable
                   or (b.at_last_step and usable.issuperset(b.target))} | spread,
        ):
            book = by_id[job_id]
            previous = len(book.target)
            if previous:
                book.last_resize_s = now_s
                if not new:
                    book.suspensions_s = (*book.suspensions_s, now_s)
            elif new:
                book.last_start_s = now_s
            book.target = tuple(sorted(new))
            book.target_generation += 1
            book.published_s = now_s
            out.append(Publication(job_id, book.target_generation, book.target, previous,
                                   decision.reasons.get(job_id, "policy decision")))
        return out
