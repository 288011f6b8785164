"""The broker's inventory: GPU pools, their nodes and GPUs, and each pool's scheduling settings."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session

from airflow_elastic_gpu.broker.lifecycle import Lifecycle
from airflow_elastic_gpu.broker.models import Gpu, GpuInUse, GpuPool, GpuTarget, Job, Node
from airflow_elastic_gpu.broker.rows import request_rebalance
from airflow_elastic_gpu.broker.types import (
    DEFAULT_POOL,
    InvalidRequest,
    NodeView,
    NotFound,
    check_int,
    check_pool_name,
    check_text,
)
from airflow_elastic_gpu.scheduling.policy import get_policy, policy_classes
from airflow_elastic_gpu.states import EventKind

MAX_NODE_CHARS = 253  # a DNS name, as Kubernetes node names are
MAX_GPUS_PER_NODE = 1024
MAX_PERIOD_S = 10 * 365 * 24 * 3600.0  # ten years: "never", as the simulator uses it
# PostgreSQL: a transaction-scoped advisory lock that serialises the first registrations of node names
_NEW_NODE_LOCK = text("SELECT pg_advisory_xact_lock(724102)")


def _known_node(s: Session, pool: str, name: str) -> Node:
    """The node ``name`` of ``pool``.

    :raises NotFound: no such node in the pool.
    """
    node = s.scalar(select(Node).where(Node.pool == pool, Node.name == name))
    if node is None:
        raise NotFound(f"unknown node {name!r} in pool {pool!r}")
    return node


class Inventory(Lifecycle):
    """Node and pool calls of :class:`~airflow_elastic_gpu.broker.service.GpuBroker`."""

    def register_node(
        self,
        name: str,
        num_gpus: int | None = None,
        *,
        pool: str = DEFAULT_POOL,
        gpu_type: str | None = None,
        gpu_indices: Sequence[int] | None = None,
        cordoned: bool = False,
        out_of_service: Sequence[int] = (),
    ) -> NodeView:
        """Add a node with its GPUs to ``pool`` (created if new); idempotent.

        Registering again adds missing GPUs and, with ``gpu_type``, updates their type (None keeps
        the node's, ``"virtual"`` for a new node); it never removes a GPU (mark a node unschedulable
        to drain it). New GPUs are offered to waiting jobs at once.

        :param num_gpus: GPUs on the node (1-1024), indices ``0..num_gpus-1``; or give ``gpu_indices``.
        :param cordoned: a new node starts drained (no job is placed on it before it is).
        :param out_of_service: indices of GPUs added now that start out of service (never offered).
        :raises InvalidRequest: empty or too long name, pool or type; a name with ``/``, or ``.`` or
            ``..``; no GPUs; negative, duplicate or
            too large indices; a node of that name in another pool (first registrations of a name
            take one lock on PostgreSQL, so two at the same moment in two pools cannot both pass).
        """
        check_text("node name", name, MAX_NODE_CHARS)
        if "/" in name or name in (".", ".."):  # a gang's launchers run in a directory named after it
            raise InvalidRequest(f"node name {name!r} may not contain '/' or be '.' or '..'")
        check_pool_name("GPU pool name", pool)
        if gpu_type is not None:
            check_text("gpu_type", gpu_type, 128)
        if gpu_indices is None:
            if num_gpus is None or isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
                raise InvalidRequest(f"node {name!r}: num_gpus must be an integer >= 1, got {num_gpus!r}")
            if num_gpus > MAX_GPUS_PER_NODE:
                raise InvalidRequest(f"node {name!r}: num_gpus must be at most {MAX_GPUS_PER_NODE}, got {num_gpus}")
            gpu_indices = range(num_gpus)
        indices = _indices(name, gpu_indices)
        if not indices or len(set(indices)) != len(indices):
            raise InvalidRequest(f"node {name!r}: bad GPU indices {indices[:20]}")
        out_of_service = _indices(name, out_of_service, "out-of-service GPU")
        if unknown := sorted(set(out_of_service) - set(indices)):
            raise InvalidRequest(f"node {name!r} has no GPU {unknown[0]} to put out of service (its GPUs: "
                                 f"{sorted(indices)[:20]})")

        def run() -> NodeView:
            with self._tx(pool, create_pool=True) as s:
                node = s.scalar(select(Node).where(Node.pool == pool, Node.name == name))
                if node is None and s.get_bind().dialect.name == "postgresql":
                    # first registrations of a name, in any pool, one at a time: the check below
                    # then sees a concurrent one in another pool (SQLite: one writer already)
                    s.execute(_NEW_NODE_LOCK)
                    node = s.scalar(select(Node).where(Node.pool == pool, Node.name == name))
                if node is None:
                    other = s.scalar(select(Node.pool).where(Node.name == name, Node.pool != pool).limit(1))
                    if other is not None:
                        raise InvalidRequest(
                            f"node {name!r} is already in GPU pool {other!r}: a node's GPUs belong to one pool "
                            f"(in two, a job of each could get the same GPU); register it in {other!r}, or "
                            "give this node its own name if it is another machine")
                    node = Node(pool=pool, name=name, schedulable=not cordoned)
                    s.add(node)
                    s.flush()
                    self._event(s, pool, EventKind.NODE, f"registered node {name} with {len(indices)} GPU(s)")
                have = {g.index: g for g in node.gpus}
                kind = gpu_type or next((g.gpu_type for g in have.values()), "virtual")
                added = False
                for i in indices:
                    if i in have:
                        if gpu_type is not None:
                            have[i].gpu_type = gpu_type
                    else:
                        s.add(Gpu(node_id=node.id, index=i, gpu_type=kind, healthy=i not in out_of_service))
                        added = True
                s.flush()
                s.refresh(node)
                if added:
                    request_rebalance(s, pool, self.clock())
                return self._node_views(s, [node])[0]

        view = self._retrying(run)
        self._serve_rebalance(pool)
        return view

    def set_node_schedulable(self, name: str, schedulable: bool, *, pool: str = DEFAULT_POOL) -> None:
        """Mark a node (un)schedulable; an unschedulable node's GPUs are drained by the rebalance.

        :raises NotFound: unknown node or pool.
        """

        def run() -> None:
            with self._tx(pool) as s:
                node = _known_node(s, pool, name)
                if node.schedulable != schedulable:  # a repeated call (or a redo after its commit) records nothing
                    node.schedulable = schedulable
                    self._event(s, pool, EventKind.NODE, f"node {name} {'schedulable' if schedulable else 'drained'}")
                request_rebalance(s, pool, self.clock())

        self._retrying(run)
        self._serve_rebalance(pool)

    def set_gpus_healthy(self, name: str, indices: Sequence[int], healthy: bool, *,
                         pool: str = DEFAULT_POOL) -> None:
        """Take GPUs of a node out of service (``healthy=False``: a failing GPU, e.g. Xid or ECC
        errors) or put them back. An unhealthy GPU goes to no job; the rebalance moves the jobs that
        hold one off it as a drain does (a job with no room elsewhere keeps it until room appears,
        rather than being stopped), and the GPU stays held until their agents ack the move.

        :param indices: the GPUs' device indices on the node.
        :raises NotFound: unknown pool, node, or GPU index of the node.
        """
        wanted = sorted(set(_indices(name, indices)))
        if not wanted:
            raise InvalidRequest("name at least one GPU index")

        def run() -> None:
            with self._tx(pool) as s:
                node = _known_node(s, pool, name)
                gpus = {g.index: g for g in node.gpus}
                if unknown := [i for i in wanted if i not in gpus]:
                    raise NotFound(f"node {name!r} has no GPU {unknown[0]!r} (its GPUs: {sorted(gpus)})")
                changed = [i for i in wanted if gpus[i].healthy != healthy]
                for i in changed:
                    gpus[i].healthy = healthy
                if changed:
                    what = "back in service" if healthy else "out of service (unhealthy)"
                    self._event(s, pool, EventKind.NODE,
                                f"GPU(s) {', '.join(f'{name}:{i}' for i in changed)} {what}")
                    request_rebalance(s, pool, self.clock())

        self._retrying(run)
        self._serve_rebalance(pool)

    def remove_node(self, name: str, *, pool: str = DEFAULT_POOL) -> None:
        """Remove a node and its GPUs from ``pool`` (a machine retired, or moving to another pool:
        register it there afterwards). Only a node none of whose GPUs a job holds or is published
        can be removed: drain it first (:meth:`set_node_schedulable`), and the rebalance moves its
        jobs off it once their agents have acked.

        :raises NotFound: unknown node or pool.
        :raises InvalidRequest: a job still holds or is published GPUs of the node (named).
        """

        tried: list[bool] = []

        def run() -> None:
            with self._tx(pool) as s:
                try:
                    node = _known_node(s, pool, name)
                except NotFound:
                    if tried:  # redone after the first try's commit went through (the connection lost at COMMIT)
                        return
                    raise
                gpu_ids = [g.id for g in node.gpus]
                holders = sorted({job_id for held in (GpuInUse, GpuTarget)
                                  for job_id in s.scalars(select(held.job_id).where(held.gpu_id.in_(gpu_ids)))})
                if holders:
                    raise InvalidRequest(
                        f"node {name!r} of pool {pool!r} has GPUs of job(s) {', '.join(holders[:5])}"
                        f"{' and more' if len(holders) > 5 else ''}: drain it first (`nodes drain {name}`) and "
                        "remove it once its GPUs are free")
                s.execute(delete(Gpu).where(Gpu.node_id == node.id))
                s.execute(delete(Node).where(Node.id == node.id))
                self._event(s, pool, EventKind.NODE, f"removed node {name} with {len(gpu_ids)} GPU(s)")
                request_rebalance(s, pool, self.clock())
                tried.append(True)

        self._retrying(run)

    def configure_pool(
        self,
        pool: str = DEFAULT_POOL,
        *,
        policy: str | None = None,
        policy_params: dict[str, Any] | None = None,
        lease_s: float | None = None,
        rebalance_interval_s: float | None = None,
    ) -> None:
        """Set a pool's scheduling policy (by name, with parameters), heartbeat lease and rebalance
        period (seconds, finite, > 0).

        ``policy_params`` replaces the parameters set before (the CLI's ``pool --param`` adds to
        them); given without ``policy``, they are checked against the pool's own policy.

        :raises InvalidRequest: unknown or preemptive policy, bad parameters, a bad period, or a
            shorter lease while jobs of the pool hold GPUs.
        :raises NotFound: unknown pool.
        """
        if policy_params is not None and not isinstance(policy_params, dict):
            raise InvalidRequest(f"policy_params must be a dict, got {type(policy_params).__name__}")
        if policy is not None:
            _check_policy(policy, policy_params)
        for name, value in (("lease_s", lease_s), ("rebalance_interval_s", rebalance_interval_s)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and 0 < value <= MAX_PERIOD_S
            ):
                raise InvalidRequest(f"{name} must be a number of seconds in (0, {MAX_PERIOD_S:.0f}], got {value!r}")

        def run() -> None:
            with self._tx(pool) as s:
                row = s.get(GpuPool, pool)
                before = (row.policy, row.policy_params, row.lease_s, row.rebalance_interval_s)
                if policy is not None:
                    row.policy = policy
                    row.policy_params = policy_params
                elif policy_params is not None:
                    _check_policy(row.policy, policy_params)
                    row.policy_params = policy_params
                if lease_s is not None:
                    if float(lease_s) < row.lease_s and _holders(s, pool):
                        raise InvalidRequest(
                            f"lease_s can be lowered (from {row.lease_s:g}s to {float(lease_s):g}s) only while no job "
                            f"of GPU pool {pool!r} holds GPUs: their agents fence their trainers within the lease "
                            "they were told, and a shorter one would free GPUs a trainer may still use. Lower it "
                            "once they have ended, or raise it at any time")
                    row.lease_s = float(lease_s)
                if rebalance_interval_s is not None:
                    row.rebalance_interval_s = float(rebalance_interval_s)
                if (row.policy, row.policy_params, row.lease_s, row.rebalance_interval_s) != before:
                    # (a repeated call, or a redo after its commit went through, records nothing)
                    self._event(s, pool, EventKind.CONFIG, f"policy {row.policy} {row.policy_params or {}}, "
                                f"lease {row.lease_s:g}s, rebalance every {row.rebalance_interval_s:g}s")
                request_rebalance(s, pool, self.clock())

        self._retrying(run)
        self._serve_rebalance(pool)


def _check_policy(name: str, params: dict[str, Any] | None) -> None:
    """:raises InvalidRequest: ``name`` is not a policy the broker runs, or ``params`` are not its
    parameters."""
    for key, value in (params or {}).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequest(f"policy parameter {key} must be a finite number, got {value!r}")
    if name not in (classes := policy_classes()):  # not the simulator's list: its preemptive peers are refused below
        runs = sorted(n for n, cls in classes.items() if not getattr(cls, "preemptive", False))
        raise InvalidRequest(f"unknown scheduling policy {name!r}; the broker runs {', '.join(runs)}")
    try:
        chosen = get_policy(name, **(params or {}))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if getattr(chosen, "preemptive", False):
        raise InvalidRequest(
            f"policy {chosen.name!r} preempts running jobs (takes all their GPUs), which the "
            "broker never does; it is available in the simulator only"
        )


def _holders(s: Any, pool: str) -> bool:
    """Whether a job of ``pool`` holds GPUs (in use, or in a published target)."""
    return any(s.execute(select(held.job_id).join(Job, Job.id == held.job_id).where(Job.pool == pool).limit(1)).first()
               for held in (GpuInUse, GpuTarget))


def _indices(node: str, values: Any, kind: str = "GPU") -> list[int]:
    """``values`` as a list of GPU indices (integers, not bools, 0 to ``MAX_GPUS_PER_NODE - 1``).

    :raises InvalidRequest: not a sequence of such integers (the message names ``node`` and the
        ``kind`` of GPU meant)."""
    if isinstance(values, (str, bytes, int)) or not isinstance(values, Iterable):
        raise InvalidRequest(f"node {node!r}: {kind} indices must be a list of integers, got {values!r}")
    out = list(values)
    for i in out:
        check_int(f"node {node!r}: {kind} index", i, 0, MAX_GPUS_PER_NODE - 1)
    return out
