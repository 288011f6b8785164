"""Placement: turn per-job GPU counts into concrete GPUs, node-local, moving as few GPUs as it can.

Rules, in order:

1. A job keeps as many of its current GPUs as its target allows (those on the
   node where it has most), so a resize moves few GPUs and a running job never
   drops below the count it keeps (``>= min_gpus`` when it was running on one node).
2. A job that fits on one node stays on one node: it grows on its node when
   that node has room, else moves whole to the tightest node that fits
   (best fit), else grows only as far as its node allows. Splitting a job over
   nodes is slow for communication-heavy models (the Pollux T4 profiles measure
   8 GPUs on two nodes slower than 4 on one), so only a job larger than any node
   spans nodes, over as few nodes as it can.
3. A job that cannot get ``min_gpus`` waits (empty allocation).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

from airflow_elastic_gpu.scheduling.state import GpuId, NodeState


class PlacementRequest(NamedTuple):
    """One job's ask: ``target`` GPUs (0 = none), at least ``min_gpus`` if any, from ``current``.

    A named tuple (immutable, like a frozen dataclass, and cheaper to build)
    because a policy builds one per job per decision: 2,000 on a large pool.
    """

    job_id: str
    target: int
    min_gpus: int
    current: tuple[GpuId, ...] = ()


# GpuId -> device index and NodeState -> device indices, in C: map() over them runs no Python frame
_index_of = attrgetter("index")
_gpu_indices_of = attrgetter("gpu_indices")


def _kept_spread(ordered: list[GpuId], target: int, free: dict[str, set[int]]) -> list[GpuId]:
    """The ``target`` GPUs to keep of a job's current GPUs on several nodes, ``ordered`` (sorted).

    Those still in ``free`` (node name -> free device indices), on the job's fullest nodes first.
    """
    per_node: dict[str, list[GpuId]] = {}
    for gpu in ordered:
        if gpu.index in free.get(gpu.node, ()):
            per_node.setdefault(gpu.node, []).append(gpu)
    by_size = sorted(per_node.values(), key=lambda gs: (-len(gs), gs[0].node))
    return [g for gs in by_size for g in gs][:target]


def place(
    nodes: Sequence[NodeState], requests: Sequence[PlacementRequest]
) -> dict[str, tuple[GpuId, ...]]:
    """Place ``requests`` (served in the given order; one per job id) on ``nodes``.

    :returns: job id -> sorted GPUs; a job gets its target, or fewer (never fewer
        than its ``min_gpus``, else nothing) when free GPUs are fragmented.
        No GPU is given to two jobs, and only GPUs listed in ``nodes`` are given.
    """
    return place_with_leftover(nodes, requests)[0]


def place_with_leftover(
    nodes: Sequence[NodeState], requests: Sequence[PlacementRequest]
) -> tuple[dict[str, tuple[GpuId, ...]], dict[str, list[int]]]:
    """:func:`place`, and the GPUs it left free (so a caller need not work them out again).

    :returns: ``(allocations, leftover)``: ``allocations`` as :func:`place` returns
        them; ``leftover`` maps the name of each node with GPUs nobody got to
        those device indices, in the node's ``gpu_indices`` order.
    """
    free: dict[str, set[int]] = {n.name: set(n.gpu_indices) for n in nodes}
    max_node = max(map(len, map(_gpu_indices_of, nodes)), default=0)
    new_tuple = tuple.__new__  # new_tuple(GpuId, (node, index)) is GpuId(node, index) in C

    # 1. keep current GPUs (only those still schedulable, i.e. in ``free``); result[i]: the
    # GPUs of requests[i], homes[i]: a node they are all on (None: none, or not known)
    result: list[list[GpuId]] = []
    homes: list[str | None] = []
    touched: list[bool] = []  # whether a request's GPUs may be out of order (spread, or grown)
    for _, target, _, current in requests:
        kept: list[GpuId] = []
        home = None
        if target > 0 and current:
            ordered = sorted(current)
            node = ordered[0].node
            if ordered[-1].node == node:  # the common case, a job on one node: keep its lowest indices
                indices = free.get(node)
                if indices is not None:
                    if indices.issuperset(map(_index_of, ordered)):  # all still free
                        kept = ordered[:target]
                    else:
                        kept = [g for g in ordered if g.index in indices][:target]
                    if kept:
                        home = node
                        indices.difference_update(map(_index_of, kept))
            else:
                kept = _kept_spread(ordered, target, free)
                for g in kept:
                    free[g.node].discard(g.index)
                if len({g.node for g in kept}) == 1:
                    home = kept[0].node
        result.append(kept)
        homes.append(home)
        touched.append(home is None)

    # nodes by free-GPU count, each list sorted by name: best fit without scanning every node
    by_free: list[list[str]] = [[] for _ in range(max_node + 1)]
    for name in sorted(free):
        by_free[len(free[name])].append(name)
    num_free = sum(map(len, free.values()))  # GPUs free on all nodes
    bisect_left, insort = bisect.bisect_left, bisect.insort

    def take(node: str, count: int) -> list[GpuId]:
        """The ``count`` lowest free GPUs of ``node``, taken."""
        nonlocal num_free
        indices = free[node]
        size = len(indices)
        bucket = by_free[size]
        del bucket[bisect_left(bucket, node)]
        picked = sorted(indices)
        if count < size:
            del picked[count:]
            indices.difference_update(picked)
        else:
            indices.clear()
        insort(by_free[len(indices)], node)
        num_free -= len(picked)
        return list(map(new_tuple, repeat(GpuId), zip(repeat(node), picked)))

    def release(gpus: list[GpuId], home: str | None) -> None:
        """Give ``gpus`` back; ``home``: the one node they are on, or None (on several, or none)."""
        nonlocal num_free
        if home is not None:
            by_node = {home: gpus}
        else:
            by_node = {}
            for g in gpus:
                by_node.setdefault(g.node, []).append(g)
        for node, gs in by_node.items():
            indices = free[node]
            bucket = by_free[len(indices)]
            del bucket[bisect_left(bucket, node)]
            indices.update(map(_index_of, gs))
            insort(by_free[len(indices)], node)
        num_free += len(gpus)

    def best_fit(target: int) -> str | None:
        """The node with the fewest free GPUs that still has ``target`` (ties: the first by name)."""
        for count in range(target, max_node + 1):
            bucket = by_free[count]
            if bucket:
                return bucket[0]
        return None

    # 2. grow, in the caller's order
    for i, (_, target, min_gpus, _) in enumerate(requests):
        kept = result[i]
        need = target - len(kept)
        if need <= 0:
            continue
        touched[i] = True
        home = homes[i]
        if target <= max_node:
            if home is not None and len(free[home]) >= need:
                kept.extend(take(home, need))
                continue
            # move whole to the tightest node that fits (counting GPUs we would give back)
            if kept and home is None:  # on several nodes
                fits = [n for n in free if len(free[n]) + sum(g.node == n for g in kept) >= target]
                best = min(fits, key=lambda n: (len(free[n]), n)) if fits else None
            else:
                best = best_fit(target)
            if best is not None:
                release(kept, home)
                result[i], homes[i] = take(best, target), best
                continue
            if home is not None:  # partial growth on its own node
                kept.extend(take(home, len(free[home])))
                continue
            if not kept:  # waiting job: start smaller on the roomiest node, if >= min
                roomiest = next((b[-1] for b in reversed(by_free) if b), None)
                if roomiest is not None and len(free[roomiest]) >= min_gpus:
                    result[i] = take(roomiest, min(target, len(free[roomiest])))
                    homes[i] = roomiest
            continue
        # larger than any node: fill its nodes first, then the emptiest others
        if len(kept) + num_free < min_gpus:
            continue
        homes[i] = None
        kept_nodes = {g.node for g in kept}
        order = sorted(kept_nodes, key=lambda n: (-len(free[n]), n))
        covered = sum(len(free[n]) for n in order)
        for count in range(max_node, 0, -1):
            if covered >= need:
                break
            for n in by_free[count]:
                if covered >= need:
                    break
                if n not in kept_nodes:
                    order.append(n)
                    covered += count
        for n in order:
            if need <= 0:
                break
            if not free[n]:
                continue
            got = take(n, min(need, len(free[n])))
            kept.extend(got)
            need -= len(got)

    allocations: dict[str, tuple[GpuId, ...]] = {}
    for req, gpus, home, grown in zip(requests, result, homes, touched):
        if len(gpus) >= req.min_gpus:  # on one node, sorting by index is sorting (ints compare fast)
            if not grown:  # kept GPUs on one node only: a prefix of the sorted current ones
                allocations[req.job_id] = tuple(gpus)
            else:
                allocations[req.job_id] = tuple(sorted(gpus, key=_index_of) if home else sorted(gpus))
        else:  # too few to run: the job waits and its GPUs stay free
            allocations[req.job_id] = ()
            for g in gpus:
                free[g.node].add(g.index)
    leftover = {
        n.name: [i for i in n.gpu_indices if i in free[n.name]] for n in nodes if free[n.name]
    }
    return allocations, leftover
