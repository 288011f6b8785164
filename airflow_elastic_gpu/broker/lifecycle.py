"""A job's life in the broker: submit, start, heartbeats, progress, acks, and its end.

Resize protocol (two-phase; DESIGN.md "Resize protocol"): a rebalance publishes a job's new target
with a new generation (:mod:`.rebalance`); the agent restarts the trainer on it and :meth:`ack`\\ s
the generation; only then do the job's in-use GPUs become the target, freeing the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import uuid
from typing import Any

from sqlalchemy import delete, insert, literal, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from airflow_elastic_gpu.broker.models import (
    GpuInUse,
    GpuPool,
    GpuTarget,
    Job,
    Node,
    ProgressSample,
)
from airflow_elastic_gpu.broker.queries import Queries
from airflow_elastic_gpu.broker.rebalance import store_book
from airflow_elastic_gpu.broker.types import InvalidRequest, JobSpec, JobView, Target
from airflow_elastic_gpu.scheduling.core import apply_ack, record_progress
from airflow_elastic_gpu.states import TERMINAL, EventKind, JobStatus


def token_hash(token: str) -> str:
    """sha256 of an API token, as stored (the token itself never is)."""
    return hashlib.sha256(token.encode()).hexdigest()


class Lifecycle(Queries):
    """Job calls of :class:`~airflow_elastic_gpu.broker.service.GpuBroker`."""

    def submit(self, spec: JobSpec) -> JobView:
        """Submit a job (idempotent on ``spec.key``) and rebalance its pool (coalesced).

        A key whose job is unfinished returns that job unchanged; a key whose job has ended (a task
        retry) starts a new job and keeps the old one's record under ``KEY@OLD_ID``. The reply of a
        new job carries its API token (only there).

        :raises InvalidRequest: not a :class:`JobSpec`, or a job the pool cannot place (the message
            names the field).
        :raises NotFound: unknown pool.
        """
        if not isinstance(spec, JobSpec):
            raise InvalidRequest(f"submit takes a JobSpec, got {type(spec).__name__}")
        key = spec.key or str(uuid.uuid4())
        token = secrets.token_urlsafe(32)

        def run() -> tuple[str, bool]:
            with self._sessions.begin() as s:
                if s.get(GpuPool, spec.pool) is None:
                    self._lock(s, spec.pool)  # raises NotFound, naming the known pools
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
                        return existing.id, False
                    existing.key = f"{key}@{existing.id}"
                    s.flush()
                now = self.clock()
                job = Job(
                    id=str(uuid.uuid4()), key=key, pool=spec.pool, name=spec.name, command=spec.command,
                    min_gpus=spec.min_gpus, max_gpus=spec.max_gpus,
                    requested_gpus=spec.requested_gpus or spec.max_gpus, total_steps=spec.total_steps,
                    priority=spec.priority, progress_pattern=spec.progress_pattern,
                    checkpoint_dir=spec.checkpoint_dir, backend=spec.backend, status=JobStatus.QUEUED,
                    submit_s=now, last_heartbeat_s=now, steps_done=0.0, target_generation=0,
                    acked_generation=0, num_resizes=0, gpu_seconds=0.0, token_hash=token_hash(token),
                )
                s.add(job)
                s.flush()
                self._event(
                    s, spec.pool, EventKind.SUBMIT,
                    f"submitted {spec.name!r}: {spec.min_gpus}-{spec.max_gpus} GPUs, {spec.total_steps} steps",
                    job.id,
                )
                self._request_rebalance(s, spec.pool)
                return job.id, True

        try:
            job_id, created = self._retrying(run)
        except IntegrityError:  # the same key submitted concurrently: that job is the answer
            job_id, created = self._retrying(run)
        if created:
            self._serve_rebalance(spec.pool)
        view = self.job(job_id)
        return dataclasses.replace(view, token=token) if created else view

    def _pool_size(self, s: Session, pool: str) -> tuple[int, int]:
        """(schedulable GPUs in all, GPUs of the largest schedulable node) of ``pool``."""
        sizes = [
            sum(g.healthy for g in n.gpus)
            for n in s.scalars(select(Node).where(Node.pool == pool, Node.schedulable))
        ]
        return sum(sizes), max(sizes, default=0)

    def issue_token(self, job_id: str) -> str:
        """A new API bearer token for ``job_id`` (the old one stops working); only its hash is stored.

        :raises NotFound: unknown job.
        """
        token = secrets.token_urlsafe(32)

        def run() -> None:
            with self._job_row_tx(job_id) as (_s, job):
                job.token_hash = token_hash(token)

        self._retrying(run)
        return token

    def verify_token(self, job_id: str, token: str) -> bool:
        """True if ``token`` is ``job_id``'s current API token (constant-time compare); False for unknown jobs."""
        stored = self._read(lambda s: s.scalar(select(Job.token_hash).where(Job.id == job_id)))
        return stored is not None and hmac.compare_digest(stored, token_hash(token))

    def start(self, job_id: str, backend_ref: str) -> JobView:
        """Record that the backend launched the job's agent (``backend_ref``: the backend's handle)."""

        def run() -> None:
            with self._job_row_tx(job_id) as (_s, job):
                job.backend_ref = backend_ref
                job.last_heartbeat_s = self.clock()

        self._retrying(run)
        return self.job(job_id)

    def heartbeat(self, job_id: str) -> Target:
        """Agent liveness; returns the job's current target (its status tells a cancelled agent to stop).

        Also runs the pool's rebalance when one is due and nobody else is running one.

        :raises NotFound: unknown job.
        """

        def run() -> tuple[Target, str, bool]:
            with self._job_row_tx(job_id) as (s, job):
                if JobStatus(job.status) not in TERMINAL:
                    job.last_heartbeat_s = self.clock()
                row = s.get(GpuPool, job.pool)
                due = JobStatus(job.status) not in TERMINAL and self._due(s, row)
                return self._target(s, job), job.pool, due

        target, pool, due = self._retrying(run)
        if due and self.maybe_rebalance(pool):
            return self.target(job_id)
        return target

    def target(self, job_id: str) -> Target:
        """The job's latest published generation and its GPUs (read-only)."""
        return self._read(lambda s: self._target(s, self._job(s, job_id)))

    def _target(self, s: Session, job: Job) -> Target:
        gpus, _ = self._job_gpus(s, job.id)
        return Target(job.id, JobStatus(job.status), job.target_generation, gpus)

    def progress(self, job_id: str, step: float, *, generation: int | None = None,
                 time_s: float | None = None) -> None:
        """Record that the trainer reached ``step`` at ``time_s`` (default: now) in ``generation``
        (default: the acked one); see :func:`~airflow_elastic_gpu.scheduling.core.record_progress`.
        Samples for a finished job, or an older generation, are ignored.

        :raises InvalidRequest: negative or non-finite step.
        :raises NotFound: unknown job.
        """
        if not (isinstance(step, (int, float)) and step >= 0 and step != float("inf")):
            raise InvalidRequest(f"step must be a finite number >= 0, got {step!r}")

        def run() -> None:
            with self._job_row_tx(job_id) as (s, job):
                if JobStatus(job.status) in TERMINAL:
                    return
                gen = job.acked_generation if generation is None else generation
                now = self.clock() if time_s is None else time_s
                prev = s.execute(
                    select(ProgressSample.time_s, ProgressSample.step)
                    .where(ProgressSample.job_id == job.id, ProgressSample.generation == gen)
                    .order_by(ProgressSample.id.desc()).limit(1)
                ).first()
                book = self._book(s, job)
                if not record_progress(book, generation=gen, step=step, now_s=now,
                                       previous=None if prev is None else (prev[0], prev[1])):
                    return
                store_book(job, book)
                s.add(ProgressSample(job_id=job.id, time_s=now, step=step, num_gpus=book.num_gpus_of(gen),
                                     generation=gen))
                job.last_heartbeat_s = self.clock()

        self._retrying(run)

    def ack(self, job_id: str, generation: int) -> bool:
        """The agent runs the trainer on ``generation``'s GPUs: move the job's in-use set there.

        Frees the GPUs the job gave up and asks for a rebalance (a waiting growth may now be
        published). Acking an older generation, or one already acked, changes nothing and returns
        False.

        :raises NotFound: unknown job.
        """

        def run() -> tuple[bool, str]:
            with self._job_row_tx(job_id) as (s, job):
                if JobStatus(job.status) in TERMINAL:
                    return False, job.pool
                book = self._book(s, job)
                now = self.clock()
                if not apply_ack(book, generation, now):
                    return False, job.pool
                store_book(job, book)
                s.execute(delete(GpuInUse).where(GpuInUse.job_id == job.id))
                s.execute(insert(GpuInUse).from_select(
                    ["gpu_id", "job_id", "generation"],
                    select(GpuTarget.gpu_id, GpuTarget.job_id, literal(generation)).where(GpuTarget.job_id == job.id),
                ))
                job.last_heartbeat_s = now
                self._event(
                    s, job.pool, EventKind.ACK,
                    f"generation {generation} running on {len(book.in_use)} GPU(s): "
                    f"{', '.join(map(str, book.in_use))}",
                    job.id, generation=generation, num_gpus=len(book.in_use),
                )
                self._request_rebalance(s, job.pool)
                return True, job.pool

        accepted, pool = self._retrying(run)
        if accepted:
            self._serve_rebalance(pool)
        return accepted

    def _end(self, job_id: str, status: JobStatus, reason: str | None, exit_code: int | None,
             metrics: dict[str, Any] | None) -> JobView:
        def run() -> tuple[str, bool]:
            with self._job_row_tx(job_id) as (s, job):
                if JobStatus(job.status) in TERMINAL:
                    return job.pool, False
                self._release(s, job, status, reason, exit_code)
                if metrics:
                    job.metrics = dict(metrics)
                self._request_rebalance(s, job.pool)
                return job.pool, True

        pool, ended = self._retrying(run)
        if ended:
            self._serve_rebalance(pool)
        return self.job(job_id)

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

