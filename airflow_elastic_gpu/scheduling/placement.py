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
from dataclasses import dataclass

from airflow_elastic_gpu.scheduling.state import GpuId, NodeState


@dataclass(frozen=True)
class PlacementRequest:
    """One job's ask: ``target`` GPUs (0 = none), at least ``min_gpus`` if any, from ``current``."""

    job_id: str
    target: int
    min_gpus: int
    current: tuple[GpuId, ...] = ()


def _kept(current: tuple[GpuId, ...], target: int) -> list[GpuId]:
    """The ``target`` GPUs of ``current`` to keep: those on the job's fullest nodes first."""
    per_node: dict[str, list[GpuId]] = {}
    for gpu in sorted(current):
        per_node.setdefault(gpu.node, []).append(gpu)
    ordered = sorted(per_node.values(), key=lambda gs: (-len(gs), gs[0].node))
    return [g for gs in ordered for g in gs][:target]


def place(
    nodes: Sequence[NodeState], requests: Sequence[PlacementRequest]
) -> dict[str, tuple[GpuId, ...]]:
    """Place ``requests`` (served in the given order) on ``nodes``.

    :returns: job id -> sorted GPUs; a job gets its target, or fewer (never fewer
        than its ``min_gpus``, else nothing) when free GPUs are fragmented.
        No GPU is given to two jobs, and only GPUs listed in ``nodes`` are given.
    """
    free: dict[str, set[int]] = {n.name: set(n.gpu_indices) for n in nodes}
    node_size = {n.name: n.num_gpus for n in nodes}
    max_node = max(node_size.values(), default=0)
    result: dict[str, list[GpuId]] = {}
    # nodes by free-GPU count, each list sorted by name: best fit without scanning every node
    by_free: list[list[str]] = [[] for _ in range(max_node + 1)]

    def _unindex(node: str) -> None:
        bucket = by_free[len(free[node])]
        del bucket[bisect.bisect_left(bucket, node)]

    def _index(node: str) -> None:
        bisect.insort(by_free[len(free[node])], node)

    # 1. keep current GPUs (only those still schedulable)
    for req in requests:
        usable = tuple(g for g in req.current if g.index in free.get(g.node, ()))
        kept = _kept(usable, req.target) if req.target > 0 else []
        for g in kept:
            free[g.node].discard(g.index)
        result[req.job_id] = kept
    for name in sorted(free):
        _index(name)

    def take(node: str, count: int) -> list[GpuId]:
        _unindex(node)
        picked = sorted(free[node])[:count]
        free[node].difference_update(picked)
        _index(node)
        return [GpuId(node, i) for i in picked]

    def release(gpus: list[GpuId]) -> None:
        for node in {g.node for g in gpus}:
            _unindex(node)
            free[node].update(g.index for g in gpus if g.node == node)
            _index(node)

    def best_fit(target: int, home: str | None) -> str | None:
        """The node with the fewest free GPUs that still has ``target`` (ties: ``home``, then name)."""
        for count in range(target, max_node + 1):
            bucket = by_free[count]
            if bucket:
                return home if home in bucket else bucket[0]
        return None

    # 2. grow, in the caller's order
    for req in requests:
        kept = result[req.job_id]
        need = req.target - len(kept)
        if need <= 0:
            continue
        kept_nodes = {g.node for g in kept}
        if req.target <= max_node:
            home = next(iter(kept_nodes)) if len(kept_nodes) == 1 else None
            if home is not None and len(free[home]) >= need:
                kept.extend(take(home, need))
                continue
            # move whole to the tightest node that fits (counting GPUs we would give back)
            if len(kept_nodes) > 1:
                fits = [
                    n for n in free if len(free[n]) + sum(g.node == n for g in kept) >= req.target
                ]
                best = min(fits, key=lambda n: (len(free[n]), n)) if fits else None
            else:
                best = best_fit(req.target, None)
            if best is not None:
                release(kept)
                result[req.job_id] = take(best, req.target)
                continue
            if home is not None:  # partial growth on its own node
                kept.extend(take(home, len(free[home])))
                continue
            if not kept:  # waiting job: start smaller on the roomiest node, if >= min
                roomiest = next((b[-1] for b in reversed(by_free) if b), None)
                if roomiest is not None and len(free[roomiest]) >= req.min_gpus:
                    result[req.job_id] = take(roomiest, min(req.target, len(free[roomiest])))
            continue
        # larger than any node: fill its nodes first, then the emptiest others
        available = sum(count * len(bucket) for count, bucket in enumerate(by_free))
        if len(kept) + available < req.min_gpus:
            continue
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

    by_job = {req.job_id: req for req in requests}
    return {
        job_id: tuple(sorted(gpus)) if len(gpus) >= by_job[job_id].min_gpus else ()
        for job_id, gpus in result.items()
    }
