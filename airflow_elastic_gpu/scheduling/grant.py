"""Step 3 of the adaptive policy's hand-out: free GPUs to the jobs by weighted marginal speed-up.

The hot path of a decision (thousands of grants on a large pool), kept apart from the policy's
rules (:mod:`~airflow_elastic_gpu.scheduling.adaptive`). Source of the rule: heSRPT (Berg et al.,
"Optimal Resource Allocation for Elastic and Parallelizable Jobs", 2020), in the discrete form the
adaptive policy's module docstring gives.
"""

from __future__ import annotations

import bisect
import heapq

from airflow_elastic_gpu.scheduling.state import JobState


def _wait(waiting: dict[float, tuple | list[tuple]], neg_score: float, entry: tuple) -> None:
    """File ``entry`` under ``neg_score`` in :func:`grant`'s ``waiting``."""
    held = waiting.get(neg_score)
    if held is None:
        waiting[neg_score] = entry
    elif type(held) is list:
        bisect.insort(held, entry)
    else:
        waiting[neg_score] = sorted((held, entry))


def _untie(waiting: dict[float, tuple | list[tuple]], neg_score: float, tied: list[tuple]) -> tuple:
    """The best of ``tied`` (popped from ``waiting[neg_score]``); the others are filed back."""
    best = tied.pop(0)
    waiting[neg_score] = tied if len(tied) > 1 else tied[0]
    return best


def grant(
    order: list[JobState],
    frozen: list[bool],
    counts: list[int],
    free: int,
    node: int,
    by_gain: list[bool] | None = None,
) -> int:
    """Step 3: hand ``free`` GPUs (> 0) out by weighted marginal speed-up, updating ``counts``.

    ``node`` is the largest node's GPU count (> 0). A job's score at ``n``
    GPUs is ``weight * (throughput(n + k) - throughput(n)) / throughput(1) / k``
    for its next growth of ``k`` GPUs (one while it fits a node, then up to
    the next whole node); ``weight`` is the number of jobs ranked at or after it. A job not yet
    measured on a whole node's GPUs (no sample at ``node`` GPUs or more, its own or, as its
    prior, its family's: ``with_pool_prior``) grows no further than
    the whole nodes its request (``JobState.request``) needs: its prior cannot tell whether more
    nodes help (the Pollux T4 profiles measure 8 GPUs on two nodes slower than 4 on one for most
    models). Once measured on a whole node, its growth follows the model fitted from that
    measurement (and the policy's exploration of idle GPUs may try the next node).
    A waiting job marked in ``by_gain`` (at 0 GPUs) competes with its start:
    ``k = min_gpus`` and zero throughput at 0 GPUs.

    The best job has the highest score, then the better rank (its place in ``order``: the
    policy's service order, so a tie goes as the rank does). Hot path (thousands of grants per
    decision on a large pool), so the heap holds bare ``-score`` floats, which
    compare several times faster than tuples, and ``waiting`` maps each to its
    job's entry ``(rank, k, throughput(n + k), job)``, or
    to a sorted list of the entries that tie on it (the heap then holds the
    score once per entry; ranks are unique, so entries sort on them alone). ``k`` and
    ``throughput(n + k)`` save the grant and the job's next score from working them out again;
    ``job`` is ``(throughput.steps_per_s, throughput(1), max_gpus)``.

    :returns: the GPUs still free.
    """
    num_jobs = len(order)
    heap: list[float] = []
    waiting: dict[float, tuple | list[tuple]] = {}
    for r, j in enumerate(order):
        if frozen[r]:  # keeps its count (it holds GPUs: not a waiting job's start either)
            continue
        n = counts[r]
        max_gpus = j.max_gpus
        if max_gpus > node and j.request < max_gpus:
            observed = j.throughput.observed  # sorted by GPU count
            if not observed or observed[-1][0] < node:  # not measured on a whole node yet
                max_gpus = min(max_gpus, -(-j.request // node) * node)  # the whole nodes its request needs
        if 0 < n < max_gpus:
            speed = j.throughput.steps_per_s
            speed_1 = speed(1)
            k = 1 if n < node else min(node - n % node, max_gpus - n)
            speed_next = speed(n + k)
            neg_score = -((num_jobs - r) * (speed_next - speed(n)) / speed_1 / k)
        elif n == 0 and by_gain is not None and by_gain[r]:  # a waiting job's start
            speed = j.throughput.steps_per_s
            speed_1, k = speed(1), j.min_gpus
            speed_next = speed(k)
            neg_score = -((num_jobs - r) * speed_next / speed_1 / k)
        else:
            continue
        _wait(waiting, neg_score, (r, k, speed_next, (speed, speed_1, max_gpus)))
        heap.append(neg_score)
    if not heap:
        return free
    heapq.heapify(heap)
    heappop, heapreplace = heapq.heappop, heapq.heapreplace
    neg_score = heappop(heap)
    best = waiting.pop(neg_score)
    if type(best) is list:
        best = _untie(waiting, neg_score, best)
    while True:
        if neg_score >= 0.0:
            return free  # nobody gains from another GPU
        r, k, speed_next, job = best
        if k <= free:  # else a whole node is not free; smaller growths of others may still fit
            speed, speed_1, max_gpus = job
            n = counts[r] = counts[r] + k
            free -= k
            if free <= 0:
                return free
            if n < max_gpus:  # its next growth, and the best again?
                k = 1 if n < node else min(node - n % node, max_gpus - n)
                speed_n, speed_next = speed_next, speed(n + k)
                next_neg = -((num_jobs - r) * (speed_next - speed_n) / speed_1 / k)
                best = (r, k, speed_next, job)
                if not heap or next_neg < heap[0]:
                    neg_score = next_neg  # still the best: no heap traffic
                    continue
                if next_neg > heap[0] and next_neg not in waiting:  # the common case: no tie
                    neg_score = heapreplace(heap, next_neg)
                    waiting[next_neg] = best
                else:  # ties on its score: let the sorted entries decide
                    _wait(waiting, next_neg, best)
                    heapq.heappush(heap, next_neg)
                    neg_score = heappop(heap)
                best = waiting.pop(neg_score)
                if type(best) is list:
                    best = _untie(waiting, neg_score, best)
                continue
        if not heap:
            return free
        neg_score = heappop(heap)
        best = waiting.pop(neg_score)
        if type(best) is list:
            best = _untie(waiting, neg_score, best)
