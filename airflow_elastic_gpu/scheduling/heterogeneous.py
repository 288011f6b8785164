"""GPU-type-aware allocation: each job on one GPU type, where it gains most, then the adaptive hand-out per type.

Sources: Gavel (Narayanan et al., "Heterogeneity-Aware Cluster Scheduling Policies for Deep
Learning Workloads", OSDI'20, sections 3-4: a job's throughput on every accelerator type, jobs
placed by their speed-up on one type relative to the others) and Sia (Jayaram Subramanya et al.,
"Sia: Heterogeneity-aware, goodput-optimized ML-cluster scheduling", SOSP'23, section 4: a job's
per-type throughput starts from a cheap prior and is refined from the job's own progress once it
has run on a type; a job is never split across types).

Steps of one decision on a pool with more than one GPU type (a pool of one type never comes here):

1. **Per-type throughput** (:func:`type_models`): on a type the job has run on, the model fitted
   from its samples there; on another, that model scaled by the job's relative speed of the two
   types: the submitter's hint (``JobState.relative_speed``, e.g. from measured profiles), else the
   median ratio of the pool's jobs measured on both types, else 1.
2. **Type choice** (:func:`choose_types`), jobs in service order (priority, then least remaining
   work on their best type, as the adaptive policy ranks): each type keeps the work already given
   to it, in single-GPU seconds of that type; a job goes to the type where it would finish first,
   ``(work given to T + its work on T) / GPUs of T``, a list-scheduling rule for the sum of
   completion times on unrelated machines, in which a job's relative speed on each type and the
   load already there both count. A type is chosen only if it can still admit the job at
   ``min_gpus`` after the jobs before it. A running job keeps its type unless it may be resized now
   (not held since a resize: :func:`~airflow_elastic_gpu.scheduling.state.held`) and the move
   saves more than ``hysteresis`` restart overheads, its current count where it is against the
   count it can count on there (``min_gpus``, or more where GPUs are idle now and not reserved by
   the jobs before it or by running jobs; ``max_gpus`` at most).
   A waiting job whose best type has no room left because running jobs ranked after it hold their
   minimum there displaces them, the worst-ranked first, to other types with room for their
   minimum (a resize to another type, not a suspension; jobs held since a resize stay),
   when its predicted finish there beats the type it would get otherwise by more than
   ``hysteresis`` times their restart overheads: otherwise the long jobs that started first keep
   the fast GPUs for as long as they run and the short ones that arrive later get the slow ones,
   the opposite of shortest-first.
3. **Hand-out per type**: the adaptive policy (:class:`~airflow_elastic_gpu.scheduling.adaptive.
   AdaptivePolicy`) on that type's nodes and jobs, each job with its model on that type; a job
   moved to a type starts there as a waiting job. A moved job that placement could not start on its
   new type stays on its old one (the decision for that type is redone with it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from airflow_elastic_gpu.scheduling.state import (
    RANK_DECIMALS,
    ClusterState,
    Decision,
    GpuId,
    JobState,
    NodeState,
    held,
    largest_node_by_type,
)
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel

if TYPE_CHECKING:
    from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy

_new_job = JobState.__new__


def _on_type(job: JobState, throughput: ThroughputModel, allocation: tuple[GpuId, ...], now_s: float) -> JobState:
    """``job`` with another ``throughput`` and ``allocation`` (a copy without re-validation: hot path).

    A job that holds GPUs of another type (it moves) is shown started (``first_start_s``, if not
    known: ``now_s``) and not suspended (no suspension history in this view: it holds no GPU to
    be suspended from here): without GPUs of this type it is a running job to admit at once, not
    a waiting or suspended one whose start competes with growth
    (:class:`~airflow_elastic_gpu.scheduling.adaptive.AdaptivePolicy`, step 2)."""
    copy = _new_job(JobState)
    copy.__dict__.update(job.__dict__)
    copy.__dict__["throughput"] = throughput
    copy.__dict__["allocation"] = allocation
    if job.allocation and not allocation:
        copy.__dict__["suspensions_s"] = ()
    if job.allocation and job.first_start_s is None:
        copy.__dict__["first_start_s"] = now_s
    return copy


def pool_speed_ratios(jobs: Sequence[JobState]) -> dict[tuple[str, str], float]:
    """``(a, b)`` -> median over the jobs measured on both GPU types ``a`` and ``b`` of their
    single-GPU throughput on ``b`` over that on ``a`` (pairs nobody was measured on are absent)."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for j in jobs:
        if len(j.throughput_by_type) < 2:
            continue
        # its own samples only: a family's samples (a prior) would count one family once per queued run
        measured = [(t, m.steps_per_s(1)) for t, m in j.throughput_by_type.items() if m.own_observed]
        for a, speed_a in measured:
            for b, speed_b in measured:
                if a != b:
                    ratios.setdefault((a, b), []).append(speed_b / speed_a)
    return {pair: statistics.median(values) for pair, values in ratios.items()}


def _ratio(job: JobState, a: str, b: str, pool_ratios: Mapping[tuple[str, str], float]) -> float:
    """The job's speed on type ``b`` over its speed on ``a``: its hint, else the pool's, else 1."""
    hint = job.relative_speed
    if a in hint and b in hint and hint[a] > 0 and hint[b] > 0:
        return hint[b] / hint[a]
    return pool_ratios.get((a, b), 1.0)


def _speeds(job: JobState, types: Sequence[str], pool_ratios: Mapping[tuple[str, str], float],
            node_gpus: Mapping[str, int] | None = None) -> dict[str, tuple[ThroughputModel, float]]:
    """Type -> ``(model, factor)``: the job's steps/s on that type at ``n`` GPUs are
    ``model.steps_per_s(n) * factor`` (step 1; a pair, so the hot path builds no model).

    :param node_gpus: type -> GPUs of its largest node: a model taken from another type (or from
        samples on several) that knows its node size
        (:attr:`~airflow_elastic_gpu.scheduling.throughput.ThroughputModel.node_gpus`, set by the
        scheduling core) predicts one node's counts on this type's node size.
    """
    def on(t: str, m: ThroughputModel) -> ThroughputModel:
        if node_gpus is None or not m.node_gpus or not m.observed:
            return m
        return m.on_nodes_of(node_gpus.get(t, m.node_gpus))

    measured = {t: m for t, m in job.throughput_by_type.items() if m.observed}
    if measured:  # the type it has most counts of its own on (then with its family's; ties: by name) is the base
        base_type = (next(iter(measured)) if len(measured) == 1
                     else min(measured, key=lambda t: (-len(measured[t].own_observed), -len(measured[t].observed), t)))
        base = measured[base_type]
        return {t: (measured[t], 1.0) if t in measured else (on(t, base), _ratio(job, base_type, t, pool_ratios))
                for t in types}
    # never measured on one type: its prior is taken as its speed on a type of average speed
    rel = [_ratio(job, types[0], t, pool_ratios) for t in types]
    mean = math.prod(rel) ** (1.0 / len(rel))
    return {t: (on(t, job.throughput), r / mean) for t, r in zip(types, rel)}


def type_models(job: JobState, types: Sequence[str], pool_ratios: Mapping[tuple[str, str], float],
                node_gpus: Mapping[str, int] | None = None) -> dict[str, ThroughputModel]:
    """The job's throughput model (steps/s vs GPU count) on each of ``types`` (step 1).

    :param pool_ratios: as :func:`pool_speed_ratios` returns them.
    :param node_gpus: type -> GPUs of its largest node (default: the models' own node size).
    :returns: type -> model; a type the job has run on has its own fitted model.
    """
    return {t: model.scaled(factor) for t, (model, factor) in _speeds(job, types, pool_ratios, node_gpus).items()}


def _type_of(job: JobState, node_type: Mapping[str, str]) -> str | None:
    """The type holding most of the job's GPUs on ``node_type``'s nodes (ties: the first by name),
    None when it has none there."""
    counts: dict[str, int] = {}
    for g in job.allocation:
        t = node_type.get(g.node)
        if t is not None:
            counts[t] = counts.get(t, 0) + 1
    return min(counts, key=lambda t: (-counts[t], t)) if counts else None


Speeds = Mapping[str, Mapping[str, tuple[ThroughputModel, float]]]
"""Job id -> type -> ``(model, factor)``, as :func:`_speeds` gives them."""


def choose_types(policy: AdaptivePolicy, cluster: ClusterState,
                 speeds: Speeds) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """Step 2: the GPU type of every job.

    :param speeds: job id -> type -> ``(model, factor)`` (the job's steps/s on the type at ``n``
        GPUs: ``model.steps_per_s(n) * factor``).
    :returns: ``(chosen, moved, displaced)``: job id -> type for every job, job id -> the type it
        leaves for each running job that moves, and the ids of the moved jobs that were displaced to
        make room for a waiting job ranked before them.
    """
    types = cluster.gpu_types
    capacity = cluster.capacity_by_type()
    live = [t for t in types if capacity[t]]
    # nodes of a type with GPUs to hand out; a job's GPUs elsewhere (a drained node, a type with
    # no healthy GPU left) do not tie it to a type: it is placed like a waiting job
    node_type = {n.name: n.gpu_type for n in cluster.nodes if capacity.get(n.gpu_type)}
    now_s, interval_s, hold_s = cluster.now_s, policy.min_resize_interval_s, policy.max_restart_hold_s
    gpus_by_node = {n.name: n.gpu_indices for n in cluster.nodes}
    # hot path (every job, every decision on a mixed pool): types as indices into parallel lists
    index = {t: i for i, t in enumerate(live)}
    caps = [capacity[t] for t in live]
    num_live = range(len(live))
    room = list(caps)  # GPUs not yet reserved, per live type
    idle = list(caps)  # GPUs no job holds now, per live type (less those moving jobs are counted on)
    jobs = cluster.jobs
    # per job: its (model, factor) per live type, its single-GPU work on each (single-GPU seconds of
    # that type), its remaining steps, and, if it runs, (its type's index, GPUs it keeps there for
    # sure, held since a resize: too recent to move)
    models: list[list[tuple[ThroughputModel, float]]] = []
    work: list[list[float]] = []
    rests: list[float] = []
    current: list[tuple[int, int, bool] | None] = []
    keys = []
    for j in jobs:
        sp = speeds[j.job_id]
        pairs = [sp[t] for t in live]
        rest = j.remaining_steps
        w = [rest / (m.steps_per_s(1) * f) for m, f in pairs]
        models.append(pairs)
        work.append(w)
        rests.append(rest)
        keys.append((-j.priority, round(min(w), RANK_DECIMALS), j.submit_time_s, j.job_id))  # as AdaptivePolicy.rank
        alloc, cur = j.allocation, None
        if alloc:
            t = node_type.get(alloc[0].node)
            if t is not None and alloc[0].node == alloc[-1].node:  # sorted: one node, one type
                on_t = len(alloc)
            else:
                t = _type_of(j, node_type)
                on_t = sum(node_type.get(g.node) == t for g in alloc) if t is not None else 0
            if t is not None:
                frozen = held(j, now_s, interval_s, hold_s, gpus_by_node)  # as AdaptivePolicy's step 1
                keep = on_t if frozen else min(j.min_gpus, on_t)
                cur = (index[t], keep, frozen)
                room[cur[0]] -= keep
                idle[cur[0]] -= on_t
        current.append(cur)
    ranked = sorted(range(len(keys)), key=keys.__getitem__)
    load = [0.0] * len(live)
    chosen: dict[str, str] = {}
    moved: dict[str, str] = {}
    hysteresis = policy.hysteresis
    # per live type, the running jobs there that may be moved now (not held since a resize),
    # in service order: a waiting job may displace those ranked after it, the worst-ranked first
    movable: list[list[int]] = [[] for _ in live]
    position = [0] * len(jobs)  # job -> its place in service order
    for p, r in enumerate(ranked):
        position[r] = p
    for r in ranked:
        cur = current[r]
        if cur is not None and not cur[2]:
            movable[cur[0]].append(r)
    displaced: dict[int, int] = {}  # job -> the live type it was moved to, to make room for a better-ranked job

    def displace(c: int, short: int, r: int, gain_s: float) -> bool:
        """Make ``short`` GPUs of room on live type ``c`` for waiting job ``r`` by moving running jobs
        ranked after it (the worst-ranked first, among ``movable[c]``) to other types with room for
        their ``min_gpus`` (each where it would finish first); all or nothing, and only if the
        waiting job's predicted finish there is earlier than on the type it would get otherwise by
        ``gain_s`` (seconds; inf: none has room), more than ``hysteresis`` times the displaced jobs'
        restart overheads.

        Without this, running jobs keep their minimum on the fast type for as long as they run, and
        the short jobs that arrive later wait for it or go to a slow type: the fast GPUs serve the
        longest jobs. The adaptive hand-out takes GPUs from later-ranked running jobs down to their
        minimum on one type; this lets a better-ranked job take the minimum too, when the job it
        displaces can keep running elsewhere (a resize to another type: not a suspension).

        :returns: True when the room was made (``chosen``, ``moved``, ``room`` and ``displaced``
            updated for the displaced jobs).
        """
        candidates = movable[c]
        if not any(room[x] > 0 for x in range(len(caps)) if x != c):
            return False  # no other type has room for anyone
        plan: list[tuple[int, int]] = []
        taken = [0] * len(caps)
        for q in reversed(candidates):
            if short <= 0:
                break
            if position[q] < position[r]:  # this one and the rest are ranked before the waiting job
                break
            if q in displaced:
                continue
            need, w = jobs[q].min_gpus, work[q]
            best = None
            for x in range(len(caps)):
                if x != c and room[x] - taken[x] >= need:
                    key = ((load[x] + w[x]) / caps[x], x)
                    if best is None or key < best:
                        best = key
            if best is not None:
                plan.append((q, best[1]))
                taken[best[1]] += need
                short -= current[q][1]
        if short > 0 or not gain_s > hysteresis * sum(jobs[q].restart_overhead_s for q, _ in plan):
            return False
        for q, x in plan:
            job = jobs[q]
            displaced[q] = x
            room[c] += current[q][1]
            room[x] -= job.min_gpus
            chosen[job.job_id] = live[x]
            moved[job.job_id] = live[c]
        while candidates and candidates[-1] in displaced:
            candidates.pop()
        return True

    for r in ranked:
        x = displaced.get(r)
        if x is not None:  # its type is chosen; its work counts on that type for the jobs after it
            load[x] += work[r][x]
            continue
        j = jobs[r]
        w = work[r]
        running = current[r]
        if running is not None:
            c, keep, frozen = running
            room[c] += keep
        else:
            c, keep, frozen = None, 0, False  # not running on a live type
        # the live type where it would finish first (ties: less work there, then the name) among
        # those that can still admit it at min_gpus; if none can, the one it would finish first on
        need = j.min_gpus
        first = pick = None
        for i in num_live:
            key = ((load[i] + w[i]) / caps[i], w[i], live[i], i)
            if first is None or key < first:
                first = key
            if room[i] >= need and (pick is None or key < pick):
                pick = key
        if running is None and pick is not first and displace(
                first[3], need - room[first[3]], r, pick[0] - first[0] if pick is not None else math.inf):
            pick = first
        i = pick[3] if pick is not None else None
        if c is not None and i != c:
            # a running job moves only to a type with room for it, and only when it pays: not held
            # since a resize (the policy's interval, or its restart overhead), and the move saves
            # more than hysteresis restart overheads, its current count where it is against the
            # count it can count on there: min_gpus, or more where GPUs are idle now and not
            # reserved (max_gpus at most): four P100s are not left for one V100 that is a little
            # faster per GPU, and one GPU of a crowded type is left for four idle ones of another
            # when that is faster
            if i is None or frozen:
                i = c
            else:
                n, rest = len(j.allocation), rests[r]
                (m_cur, f_cur), (m_new, f_new) = models[r][c], models[r][i]
                there = max(need, min(j.max_gpus, room[i], idle[i]))
                gain = rest / (m_cur.steps_per_s(n) * f_cur) - rest / (m_new.steps_per_s(there) * f_new)
                if gain > hysteresis * j.restart_overhead_s:
                    idle[i] -= there  # counted on by this job: not by the next one to move there
                else:
                    i = c
        if i is None:
            i = first[3]  # no type has room: it waits on the one it would finish first
        if c is not None and i != c:
            moved[j.job_id] = live[c]
        chosen[j.job_id] = live[i]
        room[i] -= keep if i == c else need
        load[i] += w[i]
    return chosen, moved, {jobs[q].job_id for q in displaced}


def decide_by_type(policy: AdaptivePolicy, cluster: ClusterState) -> Decision:
    """The adaptive policy's decision on a pool of several GPU types (steps 1-3 of the module)."""
    types = cluster.gpu_types
    nodes_of: dict[str, list[NodeState]] = {t: [] for t in types}
    for n in cluster.nodes:
        if n.gpu_indices:
            nodes_of[n.gpu_type].append(n)
    node_gpus = largest_node_by_type(cluster.nodes)
    pool_ratios = pool_speed_ratios(cluster.jobs)
    speeds = {j.job_id: _speeds(j, types, pool_ratios, node_gpus) for j in cluster.jobs}
    chosen, moved, displaced = choose_types(policy, cluster, speeds)
    node_type = {n.name: n.gpu_type for n in cluster.nodes}
    jobs_of: dict[str, list[JobState]] = {t: [] for t in types}
    for j in cluster.jobs:
        jobs_of[chosen[j.job_id]].append(j)

    def decide(t: str) -> Decision:
        jobs = []
        for j in jobs_of[t]:
            model, factor = speeds[j.job_id][t]
            alloc = j.allocation
            if alloc and (alloc[0].node != alloc[-1].node or node_type.get(alloc[0].node) != t):
                alloc = tuple(g for g in alloc if node_type.get(g.node) == t)
            jobs.append(_on_type(j, model.scaled(factor), alloc, cluster.now_s))
        return policy.decide(ClusterState(tuple(nodes_of[t]), tuple(jobs), cluster.now_s))

    decisions = {t: decide(t) for t in types if jobs_of[t]}
    # A job displaced for a waiting job that then gets no GPUs (with admission by gain, the growth
    # of better-ranked jobs may gain more than its start) stays displaced: its GPUs serve jobs ranked
    # before it all the same (sending it back measured worse on the mixed-type benchmark).
    while True:  # each round sends at least one moved job back, so it ends
        stuck = [j for j in cluster.jobs
                 if j.job_id in moved and not decisions[chosen[j.job_id]].allocations[j.job_id]]
        if not stuck:
            break
        redo = set()  # placement could not start them on their new type: they stay where they are
        for j in stuck:
            old = moved.pop(j.job_id)
            jobs_of[chosen[j.job_id]].remove(j)
            jobs_of[old].append(j)
            redo.update((chosen[j.job_id], old))
            chosen[j.job_id] = old
        for t in redo:
            decisions[t] = decide(t)
    allocations: dict[str, tuple[GpuId, ...]] = {}
    for d in decisions.values():
        allocations.update(d.allocations)
    moves: dict[str, str] = {}
    by_id = {j.job_id: j for j in cluster.jobs}
    for job_id, old in moved.items():
        t, job = chosen[job_id], by_id[job_id]
        n, m = len(job.allocation), len(allocations[job_id])
        (m_old, f_old), (m_new, f_new) = speeds[job_id][old], speeds[job_id][t]
        before_s = job.remaining_steps / (m_old.steps_per_s(n) * f_old)
        after_s = job.remaining_steps / (m_new.steps_per_s(m) * f_new)
        why = f" (its {old} GPUs go to jobs ranked before it)" if job_id in displaced else ""
        moves[job_id] = (f"move {old}->{t}, {n}->{m} GPU(s): predicted remaining time "
                         f"{before_s:.0f}s->{after_s:.0f}s{why}")
    return Decision(allocations, _TypedReasons({t: d.reasons for t, d in decisions.items()}, moves))


class _TypedReasons(Mapping[str, str]):
    """The per-type decisions' reason lines, each suffixed with its type (``[V100]``), and the
    moves' own lines; written when read, as the per-type ones are."""

    def __init__(self, by_type: dict[str, Mapping[str, str]], moves: dict[str, str]) -> None:
        self._by_type, self._moves = by_type, moves
        self._type_of = {job_id: t for t, reasons in by_type.items() for job_id in reasons}

    def __len__(self) -> int:
        return len(self._type_of.keys() | self._moves.keys())

    def __iter__(self) -> Iterator[str]:
        yield from self._type_of
        yield from (job_id for job_id in self._moves if job_id not in self._type_of)

    def __getitem__(self, job_id: str) -> str:
        line = self._moves.get(job_id)
        if line is not None:
            return line
        t = self._type_of[job_id]  # KeyError: unchanged
        return f"{self._by_type[t][job_id]} [{t}]"
