"""A job's life in the broker: submit, start, heartbeats, progress and acks (its end: :mod:`.endings`).

Resize protocol (two-phase; docs/architecture.md, "A resize"): a rebalance publishes a job's new target
with a new generation (:mod:`.rebalance`); the agent restarts the trainer on it and :meth:`ack`\\ s
the generation; only then do the job's in-use GPUs become the target, freeing the rest.

Each call is one short transaction on a connection with plain SQL statements (:mod:`.rows`) that
locks the job's row (a heartbeat is one autocommit statement); a call that may move allocations
asks for a rebalance and serves it in the same transaction if one is due and the pool's lock is
free (coalesced, see :mod:`.rebalance`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import uuid
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from airflow_elastic_gpu.broker.endings import Endings
from airflow_elastic_gpu.broker.models import (
    Gpu,
    GpuInUse,
    GpuPool,
    GpuTarget,
    Job,
    Node,
    NodeAck,
    ProgressSample,
)
from airflow_elastic_gpu.broker.rows import (
    JOB_COLUMNS,
    NODES_ACKED,
    PENDING_OF_POOL,
    UNFINISHED,
    book_changes,
    book_of,
    job_gpus,
    update_job,
)
from airflow_elastic_gpu.broker.types import (
    MAX_KEY_CHARS,
    InvalidRequest,
    JobSpec,
    JobView,
    NotFound,
    Target,
)
from airflow_elastic_gpu.scheduling.core import apply_ack, record_progress
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.sidecar.protocol import GANG_PLACEHOLDERS
from airflow_elastic_gpu.states import TERMINAL, EventKind, JobStatus


def token_hash(token: str) -> str:
    """sha256 of an API token, as stored (the token itself never is)."""
    return hashlib.sha256(token.encode()).hexdigest()


# statements of the hot calls, built once (parameters bound per call)
# locked: a reattach hands the job to its try (attempt) only if no cancel ended it meanwhile
_BY_KEY = (select(Job.id, Job.status, Job.token_hash, Job.attempt, Job.max_tries,
                   Job.clear_number).where(Job.key == bindparam("key"))
           .with_for_update(key_share=True))
_ADD_JOB = insert(Job)
# schedulable healthy GPUs per node of the pool (``size``), with the pool's rebalance settings and
# pending requests (what ``_due`` reads) on every row: no row for an unknown pool, one row of size
# 0 for a pool without nodes
_NODE_SIZES = (
    select(func.count(Gpu.id).label("size"), GpuPool.last_rebalance_s, GpuPool.rebalance_interval_s,
           PENDING_OF_POOL.label("pending"))
    .select_from(GpuPool)
    .outerjoin(Node, and_(Node.pool == GpuPool.name, Node.schedulable))
    .outerjoin(Gpu, and_(Gpu.node_id == Node.id, Gpu.healthy))
    .where(GpuPool.name == bindparam("pool")).group_by(GpuPool.name, Node.id)
)
# a job's target: one row per target GPU (or one with a NULL GPU), in one consistent statement
_TARGET = (
    select(Job.status, Job.target_generation, GpuPool.lease_s, Node.name.label("node"), Gpu.index)
    .join(GpuPool, GpuPool.name == Job.pool)
    .outerjoin(GpuTarget, GpuTarget.job_id == Job.id).outerjoin(Gpu, Gpu.id == GpuTarget.gpu_id)
    .outerjoin(Node, Node.id == Gpu.node_id).where(Job.id == bindparam("job_id"))
)

def _of_pool(column: Any) -> Any:
    return select(column).where(GpuPool.name == Job.pool).scalar_subquery()


# a heartbeat of an unfinished job: one statement that updates its row and returns what ``_due``
# reads of its pool
_BEAT = (
    update(Job).where(Job.id == bindparam("job_id"), UNFINISHED)
    .values(last_heartbeat_s=bindparam("now"))
    .returning(Job.pool, _of_pool(GpuPool.last_rebalance_s).label("last_rebalance_s"),
               _of_pool(GpuPool.rebalance_interval_s).label("rebalance_interval_s"),
               _of_pool(PENDING_OF_POOL).label("pending"))
)

def _latest_sample(column: Any) -> Any:
    """``column`` of the job's latest progress sample of the reported generation (the acked one if
    the report names none), as a scalar subquery of the job's row."""
    generation = func.coalesce(bindparam("generation", type_=Integer), Job.acked_generation)
    return (select(column).where(ProgressSample.job_id == Job.id, ProgressSample.generation == generation)
            .order_by(ProgressSample.id.desc()).limit(1).scalar_subquery())


def _count_of(table: Any) -> Any:
    return select(func.count()).where(table.job_id == Job.id).scalar_subquery()


def _type_of(table: Any) -> Any:
    """The one GPU type of the job's GPUs in ``table`` (NULL for none, or several types): the type
    a progress sample was measured on, as :func:`~airflow_elastic_gpu.scheduling.core.gpu_type_of`
    finds it from node types."""
    return (select(case((func.min(Gpu.gpu_type) == func.max(Gpu.gpu_type), func.min(Gpu.gpu_type))))
            .join(table, table.gpu_id == Gpu.id).where(table.job_id == Job.id).scalar_subquery())


# a progress report reads, in one statement, the job's row (locked), its latest sample of the
# generation and how many GPUs the target and the in-use set have
_PROGRESS_JOB = (
    select(*JOB_COLUMNS, _latest_sample(ProgressSample.time_s).label("prev_time_s"),
           _latest_sample(ProgressSample.step).label("prev_step"),
           _count_of(GpuTarget).label("num_target"), _count_of(GpuInUse).label("num_in_use"),
           _type_of(GpuTarget).label("target_type"), _type_of(GpuInUse).label("in_use_type"))
    .where(Job.id == bindparam("job_id")).with_for_update(key_share=True, of=Job)
)
_ADD_SAMPLE = insert(ProgressSample)
_FREE_IN_USE = delete(GpuInUse).where(GpuInUse.job_id == bindparam("job_id"))
_FORGET_NODE_ACK = delete(NodeAck).where(NodeAck.job_id == bindparam("job_id"), NodeAck.node == bindparam("node"))
_ADD_NODE_ACK = insert(NodeAck)
_FORGET_NODE_ACKS = delete(NodeAck).where(NodeAck.job_id == bindparam("job_id"))
_TARGET_TO_IN_USE = insert(GpuInUse).from_select(
    ["gpu_id", "job_id", "generation"],
    select(GpuTarget.gpu_id, GpuTarget.job_id, bindparam("generation", type_=Integer))
    .where(GpuTarget.job_id == bindparam("job_id")),
)


class Lifecycle(Endings):
    """Job calls of :class:`~airflow_elastic_gpu.broker.service.GpuBroker`."""

    # ------------------------------------------------------------------ submit

    def submit(self, spec: JobSpec) -> JobView:
        """Submit a job (idempotent on ``spec.key``) and rebalance its pool (coalesced).

        A key whose job is unfinished returns that job (``spec.attempt``, if given, becomes the try it
        belongs to: see :meth:`cancel`); a key whose job has ended returns it too when ``spec.attempt``
        submitted it (the same task try again, e.g. a trigger made
        again after a triggerer restart), or when it succeeded and ``spec.max_tries`` is the one it
        was submitted with, and ``spec.clear_number`` too where both are known (a retry, not a
        clear, of the task: see :class:`JobSpec`), else (a task
        retry) starts a new job and keeps the old one's record under ``KEY@OLD_ID``. The reply of a new job carries its API token (only there).

        :raises InvalidRequest: not a :class:`JobSpec`, or a job the pool cannot place (the message
            names the field).
        :raises NotFound: unknown pool.
        """
        if not isinstance(spec, JobSpec):
            raise InvalidRequest(f"submit takes a JobSpec, got {type(spec).__name__}")
        key = spec.key or str(uuid.uuid4())
        token = secrets.token_urlsafe(32)

        def run() -> tuple[str, bool | None]:
            with self.engine.begin() as conn:
                capacity, largest, pool_row = self._pool_size(conn, spec.pool)
                # the key's job first: a reattach (a retry, a cleared task's new try) is never
                # refused by the pool's size now (a drain, a GPU out of service), which would
                # leave the job running with nobody to follow it
                existing = conn.execute(_BY_KEY, {"key": key}).first()
                if existing is not None:
                    if JobStatus(existing.status) not in TERMINAL:
                        # reattached (a retry, a cleared task's new try): the job is that try's now,
                        # and what tells its later retries from clears is that try's
                        if spec.attempt is not None and existing.attempt != spec.attempt:
                            update_job(conn, existing.id, attempt=spec.attempt,
                                       **{k: v for k, v in (("max_tries", spec.max_tries),
                                                            ("clear_number", spec.clear_number)) if v is not None})
                        # our own job when this transaction is redone after its commit went
                        # through but the connection was lost before the reply: reply with its token
                        return existing.id, (True if existing.token_hash == token_hash(token) else None)
                    if spec.attempt is not None and existing.attempt == spec.attempt:
                        return existing.id, None  # this attempt's job, ended: not trained again
                    if (JobStatus(existing.status) is JobStatus.SUCCEEDED and spec.max_tries is not None
                            and existing.max_tries == spec.max_tries
                            and (None in (spec.clear_number, existing.clear_number)
                                 or existing.clear_number == spec.clear_number)):
                        # a retry (not a clear) of a task whose training succeeded: that success
                        update_job(conn, existing.id, attempt=spec.attempt)
                        return existing.id, None
                if spec.min_gpus > capacity:
                    raise InvalidRequest(
                        f"min_gpus={spec.min_gpus} is more than GPU pool {spec.pool!r} has ({capacity})"
                    )
                if spec.backend != "simulated" and spec.max_gpus > largest:
                    self._check_multi_node(spec, largest)
                if existing is not None:  # the ended job keeps a key of its own (unique by its id, and fits the column)
                    update_job(conn, existing.id, key=f"{key[:MAX_KEY_CHARS - len(existing.id) - 1]}@{existing.id}")
                now = self.clock()
                job_id = str(uuid.uuid4())
                conn.execute(_ADD_JOB, {
                    "id": job_id, "key": key, "pool": spec.pool, "name": spec.name, "family": spec.family,
                    "attempt": spec.attempt, "max_tries": spec.max_tries,
                    "clear_number": spec.clear_number,
                    "command": spec.command,
                    "min_gpus": spec.min_gpus, "max_gpus": spec.max_gpus,
                    "requested_gpus": spec.requested_gpus or spec.max_gpus, "total_steps": spec.total_steps,
                    "priority": spec.priority, "progress_pattern": spec.progress_pattern,
                    "checkpoint_dir": spec.checkpoint_dir, "backend": spec.backend, "status": JobStatus.QUEUED.value,
                    "preemptible": spec.preemptible,
                    "submit_s": now, "last_heartbeat_s": now, "steps_done": 0.0, "target_generation": 0,
                    "acked_generation": 0, "num_resizes": 0, "gpu_seconds": 0.0, "token_hash": token_hash(token),
                    "throughput": {"relative_speed": dict(spec.relative_speed)} if spec.relative_speed else None,
                })
                self._event(
                    conn, spec.pool, EventKind.SUBMIT,
                    f"submitted {spec.name!r}: {spec.min_gpus}-{spec.max_gpus} GPUs, {spec.total_steps} steps",
                    job_id,
                )
                self._ask_rebalance(conn, spec.pool, self._due(pool_row, added=1))
                return job_id, True

        try:
            job_id, new = self._retrying(run)
        except IntegrityError:  # the same key submitted concurrently: that job is the answer
            job_id, new = self._retrying(run)
        if new is None:
            return self.job(job_id)
        return self._with_token(self.job(job_id), token)

    @staticmethod
    def _check_multi_node(spec: JobSpec, largest: int) -> None:
        """A job larger than any node of its pool runs as a gang, one launcher per node (the local
        backend: one agent for all of them; Kubernetes: one pod, with its own agent, per node): its
        command must take the gang's shape from the placeholders.

        :raises InvalidRequest: the backend runs no gang, or the command lacks the placeholders.
        """
        where = (f"max_gpus={spec.max_gpus} is larger than any node of pool {spec.pool!r} "
                 f"(the largest has {largest} GPUs)")
        if spec.backend not in ("local", "kubernetes"):
            raise InvalidRequest(f"{where}: jobs on several nodes run on the local and kubernetes backends only")
        missing = [p for p in GANG_PLACEHOLDERS if p not in spec.command]
        if missing:
            raise InvalidRequest(
                f"{where}: such a job runs on several nodes, so its command must use the gang's "
                f"placeholders; missing {', '.join(missing)} (e.g. torchrun --nnodes={{nnodes}} "
                "--node_rank={node_rank} --nproc_per_node={num_gpus} --rdzv_backend=c10d "
                "--rdzv_endpoint={master_addr}:{master_port} ...)")

    @staticmethod
    def _with_token(view: JobView, token: str) -> JobView:
        return dataclasses.replace(view, token=token)

    def _pool_size(self, conn: Connection, pool: str) -> tuple[int, int, Any]:
        """(schedulable healthy GPUs in all, those of the largest node, a row with the pool's
        ``last_rebalance_s``, ``rebalance_interval_s`` and ``pending`` requests) of ``pool``.

        :raises NotFound: unknown pool (the message names the known ones).
        """
        rows = conn.execute(_NODE_SIZES, {"pool": pool}).all()
        sizes = [r.size for r in rows]
        if not sizes:
            known = conn.execute(select(GpuPool.name).order_by(GpuPool.name)).scalars().all()
            raise NotFound(
                f"unknown GPU pool {pool!r}; known pools: {', '.join(known) or 'none'} "
                "(register a node in it first: airflow-elastic-gpu nodes add)"
            )
        return sum(sizes), max(sizes), rows[0]

    # ------------------------------------------------------------------ tokens and start

    def issue_token(self, job_id: str) -> str:
        """A new API bearer token for ``job_id`` (the old one stops working); only its hash is stored.

        :raises NotFound: unknown job.
        """
        token = secrets.token_urlsafe(32)

        def run() -> None:
            with self.engine.begin() as conn:
                self._locked_job(conn, job_id)
                update_job(conn, job_id, token_hash=token_hash(token))

        self._retrying(run)
        return token

    def verify_token(self, job_id: str, token: str) -> bool:
        """True if ``token`` is ``job_id``'s current API token (constant-time compare); False for unknown jobs."""
        stored = self._read(lambda s: s.scalar(select(Job.token_hash).where(Job.id == job_id)))
        return stored is not None and hmac.compare_digest(stored, token_hash(token))

    def start(self, job_id: str, backend_ref: str) -> JobView:
        """Record that the backend launched the job's agent (``backend_ref``: the backend's handle).
        An ended job's last heartbeat stays as it was: the GPUs it may still hold are released a
        lease after it (a retried task's start put that off by a lease).

        :raises NotFound: unknown job.
        """

        def run() -> None:
            with self.engine.begin() as conn:
                job = self._locked_job(conn, job_id)
                beat = {} if JobStatus(job.status) in TERMINAL else {"last_heartbeat_s": self.clock()}
                update_job(conn, job_id, backend_ref=backend_ref, **beat)

        self._retrying(run)
        return self.job(job_id)

    # ------------------------------------------------------------------ the agent's calls

    def heartbeat(self, job_id: str) -> Target:
        """Agent liveness; returns the job's current target (its status tells a cancelled agent to stop).

        Also runs the pool's rebalance when one is due and nobody else is running one.

        :raises NotFound: unknown job.
        """

        def beat() -> Any:  # one atomic statement: no transaction needed around it
            with self._autocommit.begin() as conn:
                return conn.execute(_BEAT, {"job_id": job_id, "now": self.clock()}).first()

        job = self._retrying(beat)  # None: unknown, or ended (then the heartbeat changes nothing)
        if job is not None and self._due(job):
            with self._rebalance_failure_logged(job.pool):  # a failing policy must not stop the trainers
                self._serve_rebalance(job.pool, True)
        return self.target(job_id)  # one statement: status, generation and GPUs read together

    def target(self, job_id: str) -> Target:
        """The job's latest published generation and its GPUs (read-only).

        :raises NotFound: unknown job.
        """
        def read(conn: Connection) -> Target:
            rows = conn.execute(_TARGET, {"job_id": job_id}).all()
            if not rows:
                raise NotFound(f"unknown job {job_id!r}")
            job = rows[0]
            gpus = tuple(sorted(GpuId(r.node, r.index) for r in rows if r.node is not None))
            return Target(job_id, JobStatus(job.status), job.target_generation, gpus, job.lease_s)

        return self._read_conn(read, one_statement=True)

    def progress(self, job_id: str, step: float, *, generation: int | None = None,
                 time_s: float | None = None) -> None:
        """Record that the trainer reached ``step`` at ``time_s`` (default: now) in ``generation``
        (default: the acked one); see :func:`~airflow_elastic_gpu.scheduling.core.record_progress`.
        Samples for a finished job, or an older generation, are ignored.

        :raises InvalidRequest: negative or non-finite step, or a generation not published yet.
        :raises NotFound: unknown job.
        """
        if isinstance(step, bool) or not (isinstance(step, (int, float)) and step >= 0 and step != float("inf")):
            raise InvalidRequest(f"step must be a finite number >= 0, got {step!r}")

        reported: list[float] = []  # when the report came: a redo stamps its sample with the first try's time

        def run() -> None:
            with self.engine.begin() as conn:
                job = conn.execute(_PROGRESS_JOB, {"job_id": job_id, "generation": generation}).first()
                if job is None:
                    raise NotFound(f"unknown job {job_id!r}")
                if JobStatus(job.status) in TERMINAL:
                    return
                gen = job.acked_generation if generation is None else generation
                if gen > job.target_generation:  # its sample would pair with the real generation's first
                    raise InvalidRequest(f"generation {gen} of job {job_id} has not been published "
                                         f"(its latest is {job.target_generation})")
                if not reported:
                    reported.append(self.clock() if time_s is None else time_s)
                now = reported[0]
                if (job.prev_time_s, job.prev_step) == (now, step):
                    return  # redone after its commit went through (the connection lost at COMMIT)
                latest = gen == job.target_generation
                # a generation replaced before its ack ran on neither set: no GPU count, no sample
                num_gpus = job.num_target if latest else job.num_in_use if gen == job.acked_generation else 0
                book = book_of(job)
                if not record_progress(book, generation=gen, step=step, now_s=now, num_gpus=num_gpus,
                                       gpu_type=None if not num_gpus else job.target_type if latest else job.in_use_type,
                                       previous=None if job.prev_time_s is None else (job.prev_time_s, job.prev_step)):
                    return
                update_job(conn, job_id, **book_changes(job, book), last_heartbeat_s=self.clock())
                conn.execute(_ADD_SAMPLE, {"job_id": job_id, "time_s": now, "step": step, "num_gpus": num_gpus,
                                           "generation": gen})

        self._retrying(run)

    def ack(self, job_id: str, generation: int, *, node: str | None = None) -> bool:
        """The agent runs the trainer on ``generation``'s GPUs: move the job's in-use set there.

        Frees the GPUs the job gave up and asks for a rebalance (a waiting growth may now be
        published). Acking an older generation, or one already acked, changes nothing and returns
        False.

        :param node: a job with one agent per node (a gang of pods on Kubernetes): the node whose
            agent acks. It runs its part of ``generation``, or, for a node the generation no
            longer uses, nothing (its trainer stopped). The ack is recorded for the node, and the
            in-use set moves only once **every** node of the target and of the in-use set has
            acked the target's generation, so that no GPU is freed while a trainer of the job
            still runs on it. A repeated ack is recorded again (idempotent); an ack of an older
            generation (a late one) is ignored. Returns True when the node's ack was recorded
            (whether or not the generation is now complete). ``None``: one agent acks for the
            whole job.
        :raises NotFound: unknown job.
        :raises InvalidRequest: ``node`` holds none of the job's target or in-use GPUs.
        """

        def run() -> bool:
            with self.engine.begin() as conn:
                job = self._locked_book(conn, job_id)
                if JobStatus(job.status) in TERMINAL:
                    return False
                target, in_use = job_gpus(conn, job_id)
                book = book_of(job, target, in_use)
                if node is not None:
                    if generation != job.target_generation or generation <= job.acked_generation:
                        return False  # a late ack of an older generation, or a retried one
                    needed = {g.node for g in target} | {g.node for g in in_use}
                    if node not in needed:
                        raise InvalidRequest(
                            f"node {node!r} has none of job {job_id}'s GPUs, neither in generation "
                            f"{generation} nor in the one it runs ({', '.join(sorted(needed)) or 'none'})")
                    conn.execute(_FORGET_NODE_ACK, {"job_id": job_id, "node": node})
                    conn.execute(_ADD_NODE_ACK, {"job_id": job_id, "node": node, "generation": generation})
                    acked = set(conn.execute(NODES_ACKED, {"job_id": job_id, "generation": generation}).scalars())
                    if not needed <= acked:
                        return True  # the other nodes' acks will complete the generation
                    conn.execute(_FORGET_NODE_ACKS, {"job_id": job_id})
                now = self.clock()
                if not apply_ack(book, generation, now):
                    return False
                conn.execute(_FREE_IN_USE, {"job_id": job_id})
                conn.execute(_TARGET_TO_IN_USE, {"job_id": job_id, "generation": generation})
                update_job(conn, job_id, **book_changes(job, book), last_heartbeat_s=now)
                self._event(
                    conn, job.pool, EventKind.ACK,
                    f"generation {generation} running on {len(book.in_use)} GPU(s): "
                    f"{', '.join(map(str, book.in_use))}",
                    job_id, generation=generation, num_gpus=len(book.in_use),
                )
                self._ask_rebalance(conn, job.pool, self._due(job, added=1))
                return True

        return self._retrying(run)
