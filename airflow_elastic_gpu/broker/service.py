"""GpuBroker: the shared state of all training jobs and every change to it, one transaction each.

Each state change (register, submit, start, progress, heartbeat, ack, finish,
fail, cancel, rebalance) runs as one short transaction under its GPU pool's
lock: ``SELECT ... FOR UPDATE`` on the pool row in PostgreSQL, ``BEGIN
IMMEDIATE`` in SQLite. Serialization failures and deadlocks are retried.

Resize protocol (two-phase; DESIGN.md "Resize protocol"):

1. ``rebalance`` asks the policy for target allocations.
2. A changed job is *published* its target with a new generation, but only if
   every GPU of it is free now (in no other job's in-use or target set); a
   shrink is always publishable. A growth that must wait for a GPU to be given
   back is published by a later rebalance (each ack triggers one).
3. The agent restarts the trainer on the target and ``ack``\\ s the generation;
   only then do the job's in-use GPUs become the target, freeing the rest.

No GPU is ever in use by two jobs: the protocol ensures it, and the primary
key of ``gpu_in_use`` (and of ``gpu_target``) enforces it in the database.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import random
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, delete, select
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from airflow_elastic_gpu.broker import db
from airflow_elastic_gpu.broker.models import (
    TERMINAL,
    Event,
    Gpu,
    GpuInUse,
    GpuPool,
    GpuTarget,
    Job,
    JobStatus,
    Node,
    ProgressSample,
)
from airflow_elastic_gpu.broker.types import (
    DEFAULT_POOL,
    BrokerError,
    EventView,
    GpuView,
    InvalidRequest,
    JobSpec,
    JobView,
    NodeView,
    NotFound,
    PoolSnapshot,
    Target,
    compile_progress_pattern,
)
from airflow_elastic_gpu.scheduling.policy import Policy, get_policy
from airflow_elastic_gpu.scheduling.publish import publishable
from airflow_elastic_gpu.scheduling.state import ClusterState, GpuId, JobState, NodeState
from airflow_elastic_gpu.scheduling.throughput import (
    ThroughputModel,
    update_restart_overhead,
    with_pool_prior,
)

log = logging.getLogger(__name__)

__all__ = [
    "BrokerError", "EventView", "GpuBroker", "GpuView", "InvalidRequest", "JobSpec", "JobView",
    "NodeView", "NotFound", "PoolSnapshot", "Target", "compile_progress_pattern",
]

def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


_RETRYABLE_PG_CODES = {"40001", "40P01"}  # serialization_failure, deadlock_detected
# the server went away (restart, failover): the transaction was rolled back, so it is safe to redo
_RECONNECT_PG_CODES = {"57P01", "57P02", "57P03", "08000", "08001", "08003", "08006"}


class GpuBroker:
    """The broker. Thread-safe: each call opens its own session and transaction.

    :param url_or_engine: broker database URL or an engine (see :func:`db.create_broker_engine`).
    :param policy: a policy object that overrides every pool's configured one
        (the simulator and tests use this); default: each pool's own setting
        (:meth:`configure_pool`), which every process sharing the DB sees.
    :param clock: returns the time in seconds (epoch); injected for tests and the simulator.
    :param default_restart_overhead_s: assumed until a job's first resize is measured.
    :param migrate: create/upgrade the schema on construction.
    """

    def __init__(
        self,
        url_or_engine: str | Engine | None = None,
        *,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.time,
        default_restart_overhead_s: float = 10.0,
        migrate: bool = True,
    ) -> None:
        if default_restart_overhead_s < 0:
            raise InvalidRequest(
                f"default_restart_overhead_s must be >= 0, got {default_restart_overhead_s}"
            )
        if isinstance(url_or_engine, Engine):
            self.engine = url_or_engine
        else:
            self.engine = db.create_broker_engine(url_or_engine or db.default_broker_url())
        if migrate:
            db.migrate(self.engine)
        self.policy_override = policy
        self.clock = clock
        self.default_restart_overhead_s = default_restart_overhead_s
        self.retries = 0  # transactions redone after a serialization failure, deadlock or lost connection
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def _tx(self, pool: str | None = None, *, create_pool: bool = False) -> Iterator[Session]:
        """One transaction holding ``pool``'s lock (taken later by :meth:`_lock` when None)."""
        with self._sessions.begin() as session:
            if pool is not None:
                self._lock(session, pool, create=create_pool)
            yield session

    def _lock(self, session: Session, pool: str, *, create: bool = False) -> GpuPool:
        row = session.execute(
            select(GpuPool).where(GpuPool.name == pool).with_for_update()
        ).scalar_one_or_none()
        if row is None:
            if not create:
                known = session.scalars(select(GpuPool.name).order_by(GpuPool.name)).all()
                raise NotFound(
                    f"unknown GPU pool {pool!r}; known pools: {', '.join(known) or 'none'} "
                    "(register a node in it first: airflow-elastic-gpu nodes add)"
                )
            row = GpuPool(
                name=pool, created_s=self.clock(), last_rebalance_s=0.0, policy="adaptive",
                lease_s=60.0, rebalance_interval_s=10.0,
            )
            session.add(row)
            session.flush()
        return row

    def _retrying(self, fn: Callable[[], Any], attempts: int = 8) -> Any:
        """Run ``fn`` (one whole transaction), retrying serialization failures and deadlocks."""
        for attempt in range(attempts):
            try:
                return fn()
            except (OperationalError, DBAPIError) as exc:
                code = getattr(getattr(exc, "orig", None), "sqlstate", None) or getattr(
                    getattr(exc, "orig", None), "pgcode", None
                )
                locked = "database is locked" in str(exc)
                lost = bool(getattr(exc, "connection_invalidated", False)) or code in _RECONNECT_PG_CODES
                if isinstance(exc, IntegrityError) or not (
                    code in _RETRYABLE_PG_CODES or locked or lost
                ):
                    raise
                if attempt == attempts - 1:
                    raise
                self.retries += 1
                log.info("retrying broker transaction after %s",
                         code or ("a lost connection" if lost else "locked database"))
                time.sleep(min(1.0, 0.01 * 2**attempt) * (1 + random.random()))
        raise AssertionError("unreachable")

    def _job(self, session: Session, job_id: str) -> Job:
        job = session.get(Job, job_id, populate_existing=True)
        if job is None:
            raise NotFound(f"unknown job {job_id!r}")
        return job

    @contextmanager
    def _job_tx(self, job_id: str) -> Iterator[tuple[Session, Job]]:
        """A transaction holding the lock of ``job_id``'s pool, with the job re-read under it."""
        with self._sessions.begin() as session:
            pool = session.scalar(select(Job.pool).where(Job.id == job_id))
            if pool is None:
                raise NotFound(f"unknown job {job_id!r}")
            self._lock(session, pool)
            yield session, self._job(session, job_id)

    @contextmanager
    def _job_row_tx(self, job_id: str) -> Iterator[tuple[Session, Job]]:
        """A transaction holding only ``job_id``'s row lock (not its pool's).

        For calls that change nothing but their own job row (progress, a heartbeat when no
        rebalance is due): they never wait behind the pool's rebalances. They never take the
        pool lock after this one, so they cannot deadlock with a rebalance (pool, then job rows).
        """
        with self._sessions.begin() as session:
            job = session.scalar(
                select(Job).where(Job.id == job_id).with_for_update().execution_options(populate_existing=True)
            )
            if job is None:
                raise NotFound(f"unknown job {job_id!r}")
            yield session, job

    def _rebalance_due(self, job_id: str) -> bool:
        with self._sessions() as s:
            row = s.execute(
                select(GpuPool.last_rebalance_s, GpuPool.rebalance_interval_s)
                .join(Job, Job.pool == GpuPool.name).where(Job.id == job_id)
            ).first()
        if row is None:
            raise NotFound(f"unknown job {job_id!r}")
        return self.clock() - row[0] >= row[1]

    def _event(
        self,
        session: Session,
        pool: str,
        kind: str,
        message: str,
        job_id: str | None = None,
        **data: Any,
    ) -> None:
        session.add(
            Event(
                time_s=self.clock(),
                pool=pool,
                job_id=job_id,
                kind=kind,
                message=message,
                data=data or None,
            )
        )
        log.info("[%s] %s%s", kind, f"job {job_id}: " if job_id else "", message)

    # ------------------------------------------------------------------ inventory

    def register_node(
        self,
        name: str,
        num_gpus: int | None = None,
        *,
        pool: str = DEFAULT_POOL,
        gpu_type: str = "virtual",
        gpu_indices: Sequence[int] | None = None,
    ) -> NodeView:
        """Add a node with its GPUs to ``pool`` (created if new); idempotent.

        Registering again adds missing GPUs and updates their type; it never
        removes a GPU (mark a node unschedulable to drain it).

        :param num_gpus: GPUs on the node, indices ``0..num_gpus-1``; or give ``gpu_indices``.
        :raises InvalidRequest: empty name, no GPUs, negative or duplicate indices.
        """
        if not name or not name.strip():
            raise InvalidRequest("node name must not be empty")
        if not pool or not pool.strip():
            raise InvalidRequest("GPU pool name must not be empty")
        if gpu_indices is None:
            if num_gpus is None or num_gpus < 1:
                raise InvalidRequest(f"node {name!r}: num_gpus must be >= 1, got {num_gpus}")
            gpu_indices = range(num_gpus)
        indices = list(gpu_indices)
        if not indices or any(i < 0 for i in indices) or len(set(indices)) != len(indices):
            raise InvalidRequest(f"node {name!r}: bad GPU indices {indices}")

        def run() -> NodeView:
            with self._tx(pool, create_pool=True) as s:
                node = s.scalar(select(Node).where(Node.pool == pool, Node.name == name))
                if node is None:
                    node = Node(pool=pool, name=name, schedulable=True)
                    s.add(node)
                    s.flush()
                    self._event(s, pool, "node", f"registered node {name} with {len(indices)} GPU(s)")
                have = {g.index: g for g in node.gpus}
                for i in indices:
                    if i in have:
                        have[i].gpu_type = gpu_type
                    else:
                        s.add(Gpu(node_id=node.id, index=i, gpu_type=gpu_type, healthy=True))
                s.flush()
                s.refresh(node)
                return self._node_view(s, node)

        return self._retrying(run)

    def set_node_schedulable(self, name: str, schedulable: bool, *, pool: str = DEFAULT_POOL) -> None:
        """Mark a node (un)schedulable; an unschedulable node's GPUs are drained by the next rebalance."""

        def run() -> None:
            with self._tx(pool) as s:
                node = s.scalar(select(Node).where(Node.pool == pool, Node.name == name))
                if node is None:
                    raise NotFound(f"unknown node {name!r} in pool {pool!r}")
                node.schedulable = schedulable
                self._event(s, pool, "node", f"node {name} {'schedulable' if schedulable else 'drained'}")
                self._rebalance(s, pool)

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
        """Set a pool's scheduling policy (by name, with parameters), heartbeat lease and rebalance period.

        :raises InvalidRequest: unknown or preemptive policy, bad parameters, or a non-positive period.
        :raises NotFound: unknown pool.
        """
        if policy is not None or policy_params is not None:
            try:
                chosen = get_policy(policy or "adaptive", **(policy_params or {}))
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
            if getattr(chosen, "preemptive", False):
                raise InvalidRequest(
                    f"policy {chosen.name!r} preempts running jobs (takes all their GPUs), which the "
                    "broker never does; it is available in the simulator only"
                )
        for name, value in (("lease_s", lease_s), ("rebalance_interval_s", rebalance_interval_s)):
            if value is not None and not value > 0:
                raise InvalidRequest(f"{name} must be > 0 seconds, got {value!r}")

        def run() -> None:
            with self._tx(pool) as s:
                row = s.get(GpuPool, pool)
                if policy is not None:
                    row.policy = policy
                    row.policy_params = policy_params
                elif policy_params is not None:
                    row.policy_params = policy_params
                if lease_s is not None:
                    row.lease_s = lease_s
                if rebalance_interval_s is not None:
                    row.rebalance_interval_s = rebalance_interval_s
                self._event(s, pool, "config", f"policy {row.policy} {row.policy_params or {}}, "
                            f"lease {row.lease_s:g}s, rebalance every {row.rebalance_interval_s:g}s")

        self._retrying(run)

    def pool_policy(self, pool: str = DEFAULT_POOL) -> Policy:
        """The policy that rebalances ``pool``."""
        if self.policy_override is not None:
            return self.policy_override
        def read() -> Any:
            with self._sessions() as s:
                row = s.get(GpuPool, pool)
                if row is None:
                    raise NotFound(f"unknown GPU pool {pool!r}")
                return get_policy(row.policy, **(row.policy_params or {}))

        return self._retrying(read)

    def pools(self) -> list[str]:
        def read() -> Any:
            with self._sessions() as s:
                return list(s.scalars(select(GpuPool.name).order_by(GpuPool.name)))

        return self._retrying(read)

    def nodes(self, pool: str | None = None) -> list[NodeView]:
        def read() -> Any:
            with self._sessions() as s:
                q = select(Node).order_by(Node.pool, Node.name)
                if pool is not None:
                    q = q.where(Node.pool == pool)
                return [self._node_view(s, n) for n in s.scalars(q)]

        return self._retrying(read)

    def _node_view(self, s: Session, node: Node) -> NodeView:
        gpu_ids = [g.id for g in node.gpus]
        in_use = dict(s.execute(select(GpuInUse.gpu_id, GpuInUse.job_id).where(GpuInUse.gpu_id.in_(gpu_ids))).all())
        target = dict(s.execute(select(GpuTarget.gpu_id, GpuTarget.job_id).where(GpuTarget.gpu_id.in_(gpu_ids))).all())
        return NodeView(
            pool=node.pool,
            name=node.name,
            schedulable=node.schedulable,
            gpus=tuple(
                GpuView(GpuId(node.name, g.index), g.gpu_type, g.healthy, in_use.get(g.id), target.get(g.id))
                for g in node.gpus
            ),
        )

    # ------------------------------------------------------------------ job life

    def submit(self, spec: JobSpec) -> JobView:
        """Submit a job (idempotent on ``spec.key``) and rebalance its pool.

        A key whose job is unfinished returns that job unchanged; a key whose
        job has ended (a task retry) starts a new job and keeps the old one's
        record under ``KEY@OLD_ID``.

        :raises InvalidRequest: a bad field (the message names it).
        :raises NotFound: unknown pool.
        """
        if not isinstance(spec, JobSpec):
            raise InvalidRequest(f"submit takes a JobSpec, got {type(spec).__name__}")
        key = spec.key or str(uuid.uuid4())

        def run() -> JobView:
            with self._tx(spec.pool) as s:
                capacity, largest = self._pool_size(s, spec.pool)
                if spec.min_gpus > capacity:
                    raise InvalidRequest(
                        f"min_gpus={spec.min_gpus} is more than GPU pool {spec.pool!r} has ({capacity})"
                    )
                if spec.backend != "simulated" and spec.max_gpus > largest:
                    raise InvalidRequest(
                        f"max_gpus={spec.max_gpus} is larger than any node of pool {spec.pool!r} "
                        f"(the largest has {largest} GPUs): a job runs on one node"
                    )
                existing = s.scalar(select(Job).where(Job.key == key))
                if existing is not None:
                    if JobStatus(existing.status) not in TERMINAL:
                        return self._view(s, existing)
                    existing.key = f"{key}@{existing.id}"
                    s.flush()
                now = self.clock()
                job = Job(
                    id=str(uuid.uuid4()),
                    key=key,
                    pool=spec.pool,
                    name=spec.name,
                    command=spec.command,
                    min_gpus=spec.min_gpus,
                    max_gpus=spec.max_gpus,
                    requested_gpus=spec.requested_gpus or spec.max_gpus,
                    total_steps=spec.total_steps,
                    priority=spec.priority,
                    progress_pattern=spec.progress_pattern,
                    checkpoint_dir=spec.checkpoint_dir,
                    backend=spec.backend,
                    status=JobStatus.QUEUED,
                    submit_s=now,
                    last_heartbeat_s=now,
                    steps_done=0.0,
                    target_generation=0,
                    acked_generation=0,
                    num_resizes=0,
                    gpu_seconds=0.0,
                )
                token = secrets.token_urlsafe(32)
                job.token_hash = _token_hash(token)
                s.add(job)
                s.flush()
                self._event(
                    s, spec.pool, "submit",
                    f"submitted {spec.name!r}: {spec.min_gpus}-{spec.max_gpus} GPUs, {spec.total_steps} steps",
                    job.id,
                )
                self._rebalance(s, spec.pool)
                return dataclasses.replace(self._view(s, job), token=token)

        return self._retrying(run)

    def issue_token(self, job_id: str) -> str:
        """A new API bearer token for ``job_id`` (the old one stops working); only its hash is stored.

        Used when a job's agent is (re)started and needs the HTTP transport.

        :raises NotFound: unknown job.
        """
        token = secrets.token_urlsafe(32)

        def run() -> None:
            with self._job_row_tx(job_id) as (_s, job):
                job.token_hash = _token_hash(token)

        self._retrying(run)
        return token

    def verify_token(self, job_id: str, token: str) -> bool:
        """True if ``token`` is ``job_id``'s current API token (constant-time compare); False for unknown jobs."""

        def read() -> bool:
            with self._sessions() as s:
                stored = s.scalar(select(Job.token_hash).where(Job.id == job_id))
                return stored is not None and hmac.compare_digest(stored, _token_hash(token))

        return self._retrying(read)

    def _pool_size(self, s: Session, pool: str) -> tuple[int, int]:
        """(schedulable GPUs in all, GPUs of the largest schedulable node) of ``pool``."""
        sizes = [
            sum(g.healthy for g in n.gpus)
            for n in s.scalars(select(Node).where(Node.pool == pool, Node.schedulable))
        ]
        return sum(sizes), max(sizes, default=0)

    def start(self, job_id: str, backend_ref: str) -> JobView:
        """Record that the backend launched the job's agent (``backend_ref``: the backend's handle)."""

        def run() -> JobView:
            with self._job_row_tx(job_id) as (s, job):
                job.backend_ref = backend_ref
                job.last_heartbeat_s = self.clock()
                return self._view(s, job)

        return self._retrying(run)

    def heartbeat(self, job_id: str) -> Target:
        """Agent liveness; returns the job's current target (its status tells a cancelled agent to stop).

        Also runs the periodic rebalance when it is due.
        """

        def run() -> Target:
            if self._rebalance_due(job_id):  # pool lock first, then the job: the rebalance's order
                with self._job_tx(job_id) as (s, job):
                    if JobStatus(job.status) not in TERMINAL:
                        job.last_heartbeat_s = self.clock()
                    self._maybe_rebalance(s, job.pool)
                    return self._target(s, job)
            with self._job_row_tx(job_id) as (s, job):
                if JobStatus(job.status) not in TERMINAL:
                    job.last_heartbeat_s = self.clock()
                return self._target(s, job)

        return self._retrying(run)

    def target(self, job_id: str) -> Target:
        """The job's latest published generation and its GPUs (read-only)."""

        def read() -> Any:
            with self._sessions() as s:
                return self._target(s, self._job(s, job_id))

        return self._retrying(read)

    def _target(self, s: Session, job: Job) -> Target:
        gpus = self._gpus_of(s, GpuTarget, job.id)
        return Target(job.id, JobStatus(job.status), job.target_generation, gpus)

    def _gpus_of(self, s: Session, table: type[GpuTarget | GpuInUse], job_id: str) -> tuple[GpuId, ...]:
        rows = s.execute(
            select(Node.name, Gpu.index)
            .join(Gpu, Gpu.node_id == Node.id)
            .join(table, table.gpu_id == Gpu.id)
            .where(table.job_id == job_id)
        ).all()
        return tuple(sorted(GpuId(n, i) for n, i in rows))

    def progress(
        self, job_id: str, step: float, *, generation: int | None = None, time_s: float | None = None
    ) -> None:
        """Record that the trainer reached ``step`` at ``time_s`` (default: now) in ``generation``.

        Two samples of one generation give a throughput sample (steps/s on that
        generation's GPU count); the first sample of a new generation gives the
        measured restart overhead (seconds from publish to first progress).
        Samples for a finished job, or an older generation, are ignored.

        :raises InvalidRequest: negative or non-finite step.
        """
        if not (step >= 0 and step != float("inf")):
            raise InvalidRequest(f"step must be a finite number >= 0, got {step!r}")

        def run() -> None:
            with self._job_row_tx(job_id) as (s, job):
                if JobStatus(job.status) in TERMINAL:
                    return
                gen = job.acked_generation if generation is None else generation
                if gen < job.acked_generation or gen < 1:
                    return
                now = self.clock() if time_s is None else time_s
                num_gpus = len(self._gpus_of(s, GpuTarget if gen == job.target_generation else GpuInUse, job.id))
                prev = s.scalar(
                    select(ProgressSample)
                    .where(ProgressSample.job_id == job.id, ProgressSample.generation == gen)
                    .order_by(ProgressSample.id.desc())
                    .limit(1)
                )
                if prev is None and job.published_s is not None and gen == job.target_generation and gen > 1:
                    job.restart_overhead_s = update_restart_overhead(
                        job.restart_overhead_s, now - job.published_s
                    )
                if prev is not None and now > prev.time_s and step > prev.step and num_gpus > 0:
                    model = self._model(job).with_sample(num_gpus, (step - prev.step) / (now - prev.time_s))
                    job.throughput = {"observed": [list(p) for p in model.observed]}
                s.add(ProgressSample(job_id=job.id, time_s=now, step=step, num_gpus=num_gpus, generation=gen))
                job.steps_done = step
                job.last_heartbeat_s = self.clock()

        self._retrying(run)

    @staticmethod
    def _model(job: Job) -> ThroughputModel:
        observed = (job.throughput or {}).get("observed", [])
        return ThroughputModel(tuple((int(n), float(t)) for n, t in observed))

    def ack(self, job_id: str, generation: int) -> bool:
        """The agent runs the trainer on ``generation``'s GPUs: move the job's in-use set there.

        Frees the GPUs the job gave up and rebalances (a waiting growth may now be
        published). Acking an older generation, or one already acked, changes
        nothing and returns False.
        """

        def run() -> bool:
            with self._job_tx(job_id) as (s, job):
                if JobStatus(job.status) in TERMINAL or generation != job.target_generation:
                    return False
                if generation <= job.acked_generation:
                    return False
                now = self.clock()
                self._account_gpu_time(s, job, now)
                was_running = job.acked_generation >= 1
                s.execute(delete(GpuInUse).where(GpuInUse.job_id == job.id))
                s.flush()
                for t in s.scalars(select(GpuTarget).where(GpuTarget.job_id == job.id)):
                    s.add(GpuInUse(gpu_id=t.gpu_id, job_id=job.id, generation=generation))
                s.flush()
                job.acked_generation = generation
                job.last_heartbeat_s = now
                if job.start_s is None:
                    job.start_s = now
                if was_running:
                    job.num_resizes += 1
                gpus = self._gpus_of(s, GpuInUse, job.id)
                self._event(
                    s, job.pool, "ack",
                    f"generation {generation} running on {len(gpus)} GPU(s): {', '.join(map(str, gpus))}",
                    job.id, generation=generation, num_gpus=len(gpus),
                )
                self._rebalance(s, job.pool)
                return True

        return self._retrying(run)

    def _account_gpu_time(self, s: Session, job: Job, now: float) -> None:
        held = s.query(GpuInUse).filter(GpuInUse.job_id == job.id).count()
        if job.in_use_since_s is not None:
            job.gpu_seconds += held * max(0.0, now - job.in_use_since_s)
        job.in_use_since_s = now

    def _end(self, job_id: str, status: JobStatus, reason: str | None, exit_code: int | None,
             metrics: dict[str, Any] | None) -> JobView:
        def run() -> JobView:
            with self._job_tx(job_id) as (s, job):
                if JobStatus(job.status) in TERMINAL:
                    return self._view(s, job)
                self._release(s, job, status, reason, exit_code)
                if metrics:
                    job.metrics = dict(metrics)
                self._rebalance(s, job.pool)
                return self._view(s, job)

        return self._retrying(run)

    def _release(self, s: Session, job: Job, status: JobStatus, reason: str | None, exit_code: int | None) -> None:
        now = self.clock()
        self._account_gpu_time(s, job, now)
        s.execute(delete(GpuInUse).where(GpuInUse.job_id == job.id))
        s.execute(delete(GpuTarget).where(GpuTarget.job_id == job.id))
        job.status = status
        job.reason = reason
        job.exit_code = exit_code
        job.end_s = now
        self._event(s, job.pool, status.value, reason or status.value, job.id, exit_code=exit_code)

    def finish(self, job_id: str, exit_code: int = 0, metrics: dict[str, Any] | None = None) -> JobView:
        """The trainer exited with 0: SUCCEEDED, GPUs released. Idempotent on an ended job."""
        return self._end(job_id, JobStatus.SUCCEEDED, "trainer finished", exit_code, metrics)

    def fail(self, job_id: str, reason: str, exit_code: int | None = None,
             metrics: dict[str, Any] | None = None) -> JobView:
        """The job cannot go on (``reason`` says why): FAILED, GPUs released."""
        return self._end(job_id, JobStatus.FAILED, reason, exit_code, metrics)

    def cancel(self, job_id: str, reason: str = "cancelled by user") -> JobView:
        """Stop the job: CANCELLED, GPUs released; its agent sees the status and stops the trainer."""
        return self._end(job_id, JobStatus.CANCELLED, reason, None, None)

    # ------------------------------------------------------------------ scheduling

    def rebalance(self, pool: str = DEFAULT_POOL) -> dict[str, tuple[GpuId, ...]]:
        """Ask the policy for new targets now and publish them; returns job id -> newly published GPUs."""

        def run() -> dict[str, tuple[GpuId, ...]]:
            with self._tx(pool) as s:
                return self._rebalance(s, pool)

        return self._retrying(run)

    def maybe_rebalance(self, pool: str = DEFAULT_POOL) -> bool:
        """Rebalance if the last one is older than ``rebalance_interval_s`` (a lease in the DB)."""

        def run() -> bool:
            with self._tx(pool) as s:
                return self._maybe_rebalance(s, pool)

        return self._retrying(run)

    def _maybe_rebalance(self, s: Session, pool: str) -> bool:
        row = s.get(GpuPool, pool)
        if row is not None and self.clock() - row.last_rebalance_s >= row.rebalance_interval_s:
            self._rebalance(s, pool)
            return True
        return False

    def _rebalance(self, s: Session, pool: str) -> dict[str, tuple[GpuId, ...]]:
        now = self.clock()
        pool_row = s.get(GpuPool, pool)
        assert pool_row is not None
        pool_row.last_rebalance_s = now
        active = list(
            s.scalars(
                select(Job)
                .where(Job.pool == pool, Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
                .order_by(Job.submit_s, Job.id)
            )
        )
        for job in active:  # reap jobs whose agent went silent
            if now - job.last_heartbeat_s > pool_row.lease_s:
                self._release(
                    s, job, JobStatus.LOST,
                    f"no heartbeat from the job's agent for {now - job.last_heartbeat_s:.0f}s "
                    f"(lease {pool_row.lease_s:.0f}s); its GPUs were reclaimed",
                    None,
                )
        active = [j for j in active if j.status in (JobStatus.QUEUED, JobStatus.RUNNING)]
        if not active:
            return {}

        nodes = list(s.scalars(select(Node).where(Node.pool == pool).order_by(Node.name)))
        gpu_by_id: dict[int, GpuId] = {}
        id_by_gpu: dict[GpuId, int] = {}
        node_states = []
        for n in nodes:
            for g in n.gpus:
                gpu_by_id[g.id] = GpuId(n.name, g.index)
                id_by_gpu[GpuId(n.name, g.index)] = g.id
            if n.schedulable:
                node_states.append(
                    NodeState(n.name, tuple(g.index for g in n.gpus if g.healthy),
                              n.gpus[0].gpu_type if n.gpus else "virtual")
                )
        targets: dict[str, set[int]] = {j.id: set() for j in active}
        target_holder: dict[int, str] = {}
        for t in s.scalars(select(GpuTarget).join(Job, Job.id == GpuTarget.job_id).where(Job.pool == pool)):
            targets.setdefault(t.job_id, set()).add(t.gpu_id)
            target_holder[t.gpu_id] = t.job_id
        in_use_holder: dict[int, str] = {
            u.gpu_id: u.job_id
            for u in s.scalars(select(GpuInUse).join(Job, Job.id == GpuInUse.job_id).where(Job.pool == pool))
        }
        # a job not yet measured is assumed as fast as the pool's median job
        models = with_pool_prior({j.id: self._model(j) for j in active})
        held = Counter(in_use_holder.values())
        states = tuple(
            JobState(
                job_id=j.id,
                min_gpus=j.min_gpus,
                max_gpus=j.max_gpus,
                requested_gpus=j.requested_gpus,
                total_steps=j.total_steps,
                steps_done=j.steps_done,
                submit_time_s=j.submit_s,
                allocation=tuple(sorted(gpu_by_id[g] for g in targets[j.id])),
                last_resize_s=j.last_resize_s,
                restart_overhead_s=(
                    j.restart_overhead_s if j.restart_overhead_s is not None else self.default_restart_overhead_s
                ),
                throughput=models[j.id],
                priority=j.priority,
                attained_gpu_s=j.gpu_seconds
                + held[j.id] * max(0.0, now - (j.in_use_since_s if j.in_use_since_s is not None else now)),
                first_start_s=j.start_s,
            )
            for j in active
        )
        policy = self.policy_override or get_policy(pool_row.policy, **(pool_row.policy_params or {}))
        decision = policy.decide(ClusterState(tuple(node_states), states, now))
        by_id = {j.id: j for j in active}
        published: dict[str, tuple[GpuId, ...]] = {}
        wanted = {j.id: {id_by_gpu[g] for g in decision.allocations.get(j.id, ())} for j in active}
        for job_id, new in publishable(
            [j.id for j in active], targets, wanted, in_use_holder, target_holder,
            {j.id for j in active if j.target_generation > 0},
        ):
            job = by_id[job_id]
            s.execute(delete(GpuTarget).where(GpuTarget.job_id == job.id))
            s.flush()
            job.target_generation += 1
            for g in sorted(new):
                s.add(GpuTarget(gpu_id=g, job_id=job.id, generation=job.target_generation))
            s.flush()
            was = len(targets[job.id])
            if was:
                job.last_resize_s = now
            job.published_s = now
            job.status = JobStatus.RUNNING
            gpus = tuple(sorted(gpu_by_id[g] for g in new))
            published[job.id] = gpus
            reason = decision.reasons.get(job.id, "policy decision")
            self._event(
                s, pool, "resize" if was else "start",
                f"generation {job.target_generation}: {reason}",
                job.id,
                generation=job.target_generation,
                from_gpus=was,
                to_gpus=len(new),
                gpus=[str(g) for g in gpus],
                restart_overhead_s=job.restart_overhead_s or self.default_restart_overhead_s,
            )
        return published

    # ------------------------------------------------------------------ reading

    def job(self, job_id: str) -> JobView:
        def read() -> Any:
            with self._sessions() as s:
                return self._view(s, self._job(s, job_id))

        return self._retrying(read)

    def job_by_key(self, key: str) -> JobView | None:
        def read() -> Any:
            with self._sessions() as s:
                job = s.scalar(select(Job).where(Job.key == key))
                return None if job is None else self._view(s, job)

        return self._retrying(read)

    def jobs(self, pool: str | None = None, *, active_only: bool = False) -> list[JobView]:
        def read() -> Any:
            with self._sessions() as s:
                q = select(Job).order_by(Job.submit_s, Job.id)
                if pool is not None:
                    q = q.where(Job.pool == pool)
                if active_only:
                    q = q.where(Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
                return [self._view(s, j) for j in s.scalars(q)]

        return self._retrying(read)

    def events(self, pool: str | None = None, *, job_id: str | None = None, after_id: int = 0,
               limit: int = 1000) -> list[EventView]:
        def read() -> Any:
            with self._sessions() as s:
                q = select(Event).where(Event.id > after_id).order_by(Event.id).limit(limit)
                if pool is not None:
                    q = q.where(Event.pool == pool)
                if job_id is not None:
                    q = q.where(Event.job_id == job_id)
                return [EventView(e.id, e.time_s, e.pool, e.job_id, e.kind, e.message, e.data) for e in s.scalars(q)]

        return self._retrying(read)

    def samples(self, job_id: str) -> list[tuple[float, float, int, int]]:
        """``(time_s, step, num_gpus, generation)`` of every progress sample of a job, in order."""

        def read() -> Any:
            with self._sessions() as s:
                return [
                    (p.time_s, p.step, p.num_gpus, p.generation)
                    for p in s.scalars(select(ProgressSample).where(ProgressSample.job_id == job_id).order_by(ProgressSample.id))
                ]

        return self._retrying(read)

    def snapshot(self, pool: str = DEFAULT_POOL, *, events: int = 50) -> PoolSnapshot:
        """Nodes, GPUs and their holders, jobs and the latest ``events`` of one pool, read in one transaction."""

        def read() -> Any:
            with self._sessions() as s:
                nodes = tuple(self._node_view(s, n) for n in s.scalars(select(Node).where(Node.pool == pool).order_by(Node.name)))
                jobs = tuple(self._view(s, j) for j in s.scalars(select(Job).where(Job.pool == pool).order_by(Job.submit_s)))
                evs = s.scalars(select(Event).where(Event.pool == pool).order_by(Event.id.desc()).limit(events)).all()
                return PoolSnapshot(
                    pool, self.clock(), nodes, jobs,
                    tuple(EventView(e.id, e.time_s, e.pool, e.job_id, e.kind, e.message, e.data) for e in reversed(evs)),
                )

        return self._retrying(read)

    def _view(self, s: Session, job: Job) -> JobView:
        return JobView(
            id=job.id, key=job.key, name=job.name, pool=job.pool, command=job.command,
            status=JobStatus(job.status), min_gpus=job.min_gpus, max_gpus=job.max_gpus,
            requested_gpus=job.requested_gpus, total_steps=job.total_steps, priority=job.priority,
            steps_done=job.steps_done, target_generation=job.target_generation,
            acked_generation=job.acked_generation,
            target_gpus=self._gpus_of(s, GpuTarget, job.id),
            in_use_gpus=self._gpus_of(s, GpuInUse, job.id),
            num_resizes=job.num_resizes, gpu_seconds=job.gpu_seconds,
            restart_overhead_s=job.restart_overhead_s,
            throughput=self._model(job).observed,
            submit_s=job.submit_s, start_s=job.start_s, end_s=job.end_s,
            last_heartbeat_s=job.last_heartbeat_s, exit_code=job.exit_code, reason=job.reason,
            metrics=job.metrics, progress_pattern=job.progress_pattern,
            checkpoint_dir=job.checkpoint_dir, backend=job.backend, backend_ref=job.backend_ref,
        )
