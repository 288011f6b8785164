"""Which of a policy's new targets can be published now, under the two-phase resize protocol.

A policy decides where every job should be; the broker (and the simulator, which copies the
broker's loop) publishes a job's new target only when every GPU in it is neither in use by another
job (that job has not acked its shrink yet) nor in another job's target. Shrinks go first, since
their GPUs leave the target sets at once. A job whose latest generation is not acked yet may
already run on every GPU of it (its agent starts the trainer, then acks): its target is not
replaced by one without some of those GPUs until it acks, since they would be free for another
job while its trainer still uses them. What is blocked now is published by a later rebalance,
after the holders ack. Pure: GPUs are any hashable key (the broker's row ids, the simulator's
:class:`~airflow_elastic_gpu.scheduling.state.GpuId`).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def publishable(
    order: Sequence[str],
    targets: Mapping[str, Collection[K]],
    wanted: Mapping[str, Collection[K]],
    in_use_holder: Mapping[K, str],
    target_holder: Mapping[K, str],
    started: Collection[str],
    *,
    preemptive: bool = False,
    suspendable: Collection[str] = (),
    unacked: Collection[str] = (),
    fixed: Collection[str] = (),
) -> list[tuple[str, frozenset[K]]]:
    """The ``(job id, new target)`` pairs to publish now, in publishing order.

    :param order: job ids, in the order ties are served (the broker's: submit time, id).
    :param targets: job id -> its current target GPUs.
    :param wanted: job id -> the policy's target GPUs (missing: none).
    :param in_use_holder: GPU -> the job whose acked generation uses it.
    :param target_holder: GPU -> the job whose current target holds it.
    :param started: jobs that have had a target before (generation >= 1).
    :param preemptive: allow taking every GPU of a started job; otherwise such a change is skipped.
    :param suspendable: started jobs that may be taken to zero GPUs (suspended) even when not
        ``preemptive``: preemptible jobs, when the pool allows suspension.
    :param unacked: jobs whose current target's generation is not acked yet: only a target that
        keeps all of its GPUs (a growth) is published for them until they ack.
    :param fixed: jobs whose target is not changed at all (finishing: some of their trainers have
        exited, the others are about to; unreachable: their agent has been silent for half the
        lease).
    """
    holders = dict(target_holder)
    changed = [
        (job_id, frozenset(wanted.get(job_id, ())))
        for job_id in order
        if frozenset(wanted.get(job_id, ())) != frozenset(targets[job_id])
    ]
    changed.sort(key=lambda item: not item[1] <= frozenset(targets[item[0]]))  # shrinks first
    out = []
    for job_id, new in changed:
        if any(in_use_holder.get(g, job_id) != job_id or holders.get(g, job_id) != job_id for g in new):
            continue  # published by a later rebalance, once the holders ack
        if job_id in fixed:
            continue  # finishing (its GPUs are freed when it ends) or unreachable
        if job_id in unacked and not new >= frozenset(targets[job_id]):
            continue  # its trainer may run on its unacked target already: changed once it acks
        if not new and job_id in started and not preemptive and job_id not in suspendable:
            continue  # a running job is never taken to zero GPUs, unless it may be suspended
        for g in targets[job_id]:
            holders.pop(g, None)
        for g in new:
            holders[g] = job_id
        out.append((job_id, new))
    return out
