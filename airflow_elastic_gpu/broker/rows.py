"""Job rows <-> the scheduling core's books, read and written with plain SQL statements.

The broker's hot calls (heartbeat, progress, ack, a job's end, reads) use SQLAlchemy Core
statements on rows rather than ORM objects: the same SQL, several times less Python per call.
Everything here takes a ``Session`` or a ``Connection`` (both execute Core statements).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Integer,
    Row,
    bindparam,
    case,
    delete,
    insert,
    literal,
    literal_column,
    select,
    union_all,
    update,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.functions import FunctionElement

from airflow_elastic_gpu.broker.models import (
    Event,
    Gpu,
    GpuInUse,
    GpuPool,
    GpuTarget,
    Job,
    Node,
    NodeAck,
    RebalanceRequest,
)
from airflow_elastic_gpu.broker.types import NotFound, family_of
from airflow_elastic_gpu.scheduling.core import JobBook
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel, plausible_speed
from airflow_elastic_gpu.states import ACTIVE, EventKind

Executor = Session | Connection

BOOK_FIELDS = (
    "steps_done", "target_generation", "acked_generation", "num_resizes", "last_resize_s", "published_s",
    "restart_overhead_s", "gpu_seconds", "in_use_since_s", "start_s", "last_start_s",
)
"""Job columns the scheduling core may change (written back by :func:`book_changes`)."""

JOB_COLUMNS = tuple(Job.__table__.columns)
"""Every column of the job table, for ``select(*JOB_COLUMNS)`` (rows with the ORM's attribute names)."""

BOOK_COLUMNS = (
    Job.id, Job.pool, Job.name, Job.family, Job.status, Job.min_gpus, Job.max_gpus, Job.total_steps, Job.submit_s, Job.requested_gpus,
    Job.priority, Job.throughput, Job.last_heartbeat_s, Job.preemptible, Job.suspensions, Job.finished_nodes, Job.attempt,
    *(getattr(Job, name) for name in BOOK_FIELDS),
)
"""The job columns :func:`book_of` and :func:`book_changes` read, with the job's pool and status
(a narrower row than :data:`JOB_COLUMNS`: hot calls read only these)."""


UNFINISHED = Job.status.in_([literal_column(f"'{status.value}'") for status in ACTIVE])
"""``job.status IN ('queued', 'running')`` with the values in the SQL text, so that a hot statement
is compiled once (a bound list is expanded on every execution)."""


_UNMEASURED = ThroughputModel()  # immutable: shared by every job not measured yet (most queued jobs)


class _Position(FunctionElement[int]):
    """``position(needle, haystack)``: the 1-based place of ``needle`` in ``haystack``, 0 when absent."""

    type = Integer()
    inherit_cache = True


@compiles(_Position)
def _instr(element: _Position, compiler: Any, **kw: Any) -> str:  # SQLite: instr(haystack, needle)
    needle, haystack = element.clauses
    return f"instr({compiler.process(haystack, **kw)}, {compiler.process(needle, **kw)})"


@compiles(_Position, "postgresql")
def _strpos(element: _Position, compiler: Any, **kw: Any) -> str:
    needle, haystack = element.clauses
    return f"strpos({compiler.process(haystack, **kw)}, {compiler.process(needle, **kw)})"


def holds(column: Any, text: str) -> ColumnElement[bool]:
    """``column`` holds ``text``, case-sensitively on every database: SQLite's ``LIKE`` (thus
    SQLAlchemy's ``contains``) ignores ASCII case, so ``{NNODES}`` matched ``{nnodes}``."""
    return _Position(literal(text), column) > 0


def _model(observed: Iterable[Any]) -> ThroughputModel:
    # an absurd speed an earlier version stored is left out (it made every rebalance fail)
    kept = tuple((int(n), float(t)) for n, t in observed or () if plausible_speed(float(t)))
    return ThroughputModel(kept) if kept else _UNMEASURED


def throughput_of(job: Job | Row[Any]) -> ThroughputModel:
    """The throughput model stored in a job row's ``throughput`` JSON: ``{"observed": [[num_gpus,
    steps_per_s], ...], "by_type": {gpu_type: [[num_gpus, steps_per_s], ...]}, "relative_speed":
    {gpu_type: speed}}`` (each key optional; ``by_type`` and ``relative_speed``: see :func:`book_of`)."""
    stored = job.throughput
    return _model(stored.get("observed")) if stored else _UNMEASURED


def by_type_of(job: Job | Row[Any]) -> dict[str, ThroughputModel]:
    """The per-GPU-type models stored in a job row's ``throughput`` JSON (``by_type``; may be empty)."""
    stored = job.throughput
    if not stored or "by_type" not in stored:
        return {}
    return {t: _model(obs) for t, obs in stored["by_type"].items()}


_BOOK_READS = (
    "id", "min_gpus", "max_gpus", "total_steps", "submit_s", "requested_gpus", "priority", "throughput",
    "preemptible", "suspensions", "name", "family", "finished_nodes", *BOOK_FIELDS,
)


def book_of(job: Job | Row[Any], target: Iterable[GpuId] = (), in_use: Iterable[GpuId] = ()) -> JobBook:
    """A job (ORM object or row) and its GPUs as the core's :class:`JobBook`."""
    # a row's columns by key (a mapping look-up is several times cheaper than a row's attribute:
    # a rebalance builds a book for every unfinished job of the pool)
    v = job._mapping if isinstance(job, Row) else {name: getattr(job, name) for name in _BOOK_READS}
    stored = v["throughput"]
    suspensions = v["suspensions"]
    return JobBook(
        job_id=v["id"], min_gpus=v["min_gpus"], max_gpus=v["max_gpus"], total_steps=v["total_steps"],
        submit_s=v["submit_s"], requested_gpus=v["requested_gpus"], priority=v["priority"],
        steps_done=v["steps_done"], target=tuple(sorted(target)), target_generation=v["target_generation"],
        in_use=tuple(sorted(in_use)), acked_generation=v["acked_generation"], num_resizes=v["num_resizes"],
        last_resize_s=v["last_resize_s"], published_s=v["published_s"],
        restart_overhead_s=v["restart_overhead_s"],
        throughput=_model(stored.get("observed")) if stored else _UNMEASURED,
        gpu_seconds=v["gpu_seconds"], in_use_since_s=v["in_use_since_s"], start_s=v["start_s"],
        preemptible=bool(v["preemptible"]), last_start_s=v["last_start_s"],
        suspensions_s=tuple([float(t) for t in suspensions]) if suspensions else (),
        throughput_by_type=({t: _model(obs) for t, obs in stored["by_type"].items()}
                            if stored and "by_type" in stored else {}),
        relative_speed=stored.get("relative_speed", {}) if stored else {},
        family=v["family"] or family_of(v["name"]),  # always set at submit and by migration 0010
        finishing=bool(v["finished_nodes"]),
    )


def book_changes(job: Job | Row[Any], book: JobBook) -> dict[str, Any]:
    """The job columns whose value in ``book`` differs from the row's, ``{column: new value}``."""
    changes = {name: getattr(book, name) for name in BOOK_FIELDS if getattr(job, name) != getattr(book, name)}
    by_type = {t: m.observed for t, m in book.throughput_by_type.items()}
    if (throughput_of(job).observed != book.throughput.observed
            or {t: m.observed for t, m in by_type_of(job).items()} != by_type):
        stored: dict[str, Any] = {"observed": [list(p) for p in book.throughput.observed]}
        if by_type:
            stored["by_type"] = {t: [list(p) for p in observed] for t, observed in by_type.items()}
        if book.relative_speed:
            stored["relative_speed"] = dict(book.relative_speed)
        changes["throughput"] = stored
    if tuple(job.suspensions or ()) != book.suspensions_s:
        changes["suspensions"] = list(book.suspensions_s)
    return changes


# The hot calls' statements, built once (immutable SQL constructs; parameters are bound per call).
_JOB = select(*JOB_COLUMNS).where(Job.id == bindparam("job_id"))
_JOB_LOCKED = _JOB.with_for_update(key_share=True)
_UPDATE_JOB = update(Job).where(Job.id == bindparam("_job_id"))
_JOB_GPUS = union_all(*(
    select(literal(kind).label("kind"), Node.name, Gpu.index).join(Gpu, Gpu.node_id == Node.id)
    .join(table, table.gpu_id == Gpu.id).where(table.job_id == bindparam("job_id"))
    for kind, table in (("target", GpuTarget), ("in_use", GpuInUse))
))
_ADD_EVENT = insert(Event)
_ADD_REQUEST = insert(RebalanceRequest)
LOOKBACK_REQUESTS = 256
"""Pending requests are looked for from this far below the watermark: ids are taken before commit,
so a request committed after a rebalance set the watermark may have a lower id; it is within this
many of it while fewer requests than this are in flight at once."""

# unserved rebalance requests of the pool of the enclosing query's ``gpu_pool`` row, counted up to 2
# (0, 1, or 2 for several): those above the last rebalance's watermark (less LOOKBACK_REQUESTS),
# found by a range scan of the (pool, id) index that starts there, so it steps over at most that
# many requests the last rebalance deleted (correlated EXISTS)
_REQUEST_OF_POOL = select(RebalanceRequest.id).where(RebalanceRequest.pool == GpuPool.name,
                                                     RebalanceRequest.id > GpuPool.served_request_id - LOOKBACK_REQUESTS)
PENDING_OF_POOL = case((~_REQUEST_OF_POOL.exists(), 0),
                       (_REQUEST_OF_POOL.order_by(RebalanceRequest.id).offset(1).limit(1).exists(), 2), else_=1)
_POOL = select(*GpuPool.__table__.columns, PENDING_OF_POOL.label("pending")).where(GpuPool.name == bindparam("pool"))
# a job call's row lock: the job's book columns, with its pool's rebalance settings and pending
# requests (what :meth:`Rebalancing._due` reads), in one statement; only the job row is locked
_LOCK_BOOK = (
    select(*BOOK_COLUMNS, GpuPool.last_rebalance_s, GpuPool.rebalance_interval_s, GpuPool.lease_s,
           PENDING_OF_POOL.label("pending"))
    .join(GpuPool, GpuPool.name == Job.pool).where(Job.id == bindparam("job_id"))
    .with_for_update(key_share=True, of=Job)
)
_POOL_TRY_LOCK = _POOL.with_for_update(skip_locked=True, key_share=True)
_FREE_IN_USE = delete(GpuInUse).where(GpuInUse.job_id == bindparam("job_id"))
_FREE_TARGET = delete(GpuTarget).where(GpuTarget.job_id == bindparam("job_id"))
_GPUS_OF_NODE = select(Gpu.id).join(Node, Node.id == Gpu.node_id).where(
    Node.name == bindparam("node"), Node.pool == bindparam("pool")).scalar_subquery()
_FREE_IN_USE_ON = delete(GpuInUse).where(GpuInUse.job_id == bindparam("job_id"), GpuInUse.gpu_id.in_(_GPUS_OF_NODE))
_FREE_TARGET_ON = delete(GpuTarget).where(GpuTarget.job_id == bindparam("job_id"), GpuTarget.gpu_id.in_(_GPUS_OF_NODE))


def read_pool(s: Executor, pool: str) -> Row[Any] | None:
    """The pool's row (every column, and ``pending``: its rebalance requests not served yet, counted
    up to 2), no lock; None for an unknown pool. One statement."""
    return s.execute(_POOL, {"pool": pool}).first()


def try_lock_pool(s: Executor, pool: str) -> Row[Any] | None:
    """Lock the pool's row if no other transaction holds it (PostgreSQL ``FOR NO KEY UPDATE SKIP
    LOCKED``; SQLite's writers hold the database lock already) and return it as :func:`read_pool`
    does; None when another transaction holds it (or the pool is unknown)."""
    return s.execute(_POOL_TRY_LOCK, {"pool": pool}).first()


def free_gpus(s: Executor, job_id: str, node: tuple[str, str] | None = None) -> None:
    """Delete the job's in-use and target GPUs (it ended); with ``node`` (``(pool, node name)``),
    only those on that node (its trainer there has stopped)."""
    if node is None:
        s.execute(_FREE_IN_USE, {"job_id": job_id})
        s.execute(_FREE_TARGET, {"job_id": job_id})
        return
    params = {"job_id": job_id, "pool": node[0], "node": node[1]}
    s.execute(_FREE_IN_USE_ON, params)
    s.execute(_FREE_TARGET_ON, params)


def read_job(s: Executor, job_id: str, *, lock: bool = False) -> Row[Any] | None:
    """The job's row (every column), locked against other writers of the row when ``lock``."""
    return s.execute(_JOB_LOCKED if lock else _JOB, {"job_id": job_id}).first()


NODES_ACKED = select(NodeAck.node).where(NodeAck.job_id == bindparam("job_id"),
                                         NodeAck.generation == bindparam("generation"))
"""The nodes of a job with one agent per node whose agent acked ``generation`` (a generation not
acked by every node yet: the recorded acks are dropped once it is)."""


def lock_book(s: Executor, job_id: str) -> Row[Any] | None:
    """Lock the job's row and read its :data:`BOOK_COLUMNS` with its pool's ``last_rebalance_s``,
    ``rebalance_interval_s``, ``lease_s`` and ``pending`` requests (as :func:`read_pool` counts
    them), one statement; None for an unknown job."""
    return s.execute(_LOCK_BOOK, {"job_id": job_id}).first()


def update_job(s: Executor, job_id: str, **values: Any) -> None:
    """Set columns of one job row (``values``: column name -> value)."""
    if values:
        s.execute(_UPDATE_JOB, {"_job_id": job_id, **values})


def job_gpus(s: Executor, job_id: str) -> tuple[tuple[GpuId, ...], tuple[GpuId, ...]]:
    """``(target, in_use)`` GPUs of one job, sorted (one query)."""
    found: dict[str, list[GpuId]] = {"target": [], "in_use": []}
    for kind, node, index in s.execute(_JOB_GPUS, {"job_id": job_id}):
        found[kind].append(GpuId(node, index))
    return tuple(sorted(found["target"])), tuple(sorted(found["in_use"]))


def add_event(s: Executor, time_s: float, pool: str, kind: EventKind, message: str, job_id: str | None = None,
              **data: Any) -> None:
    s.execute(_ADD_EVENT, {"time_s": time_s, "pool": pool, "job_id": job_id, "kind": kind.value,
                           "message": message, "data": data or None})


def request_rebalance(s: Executor, pool: str, time_s: float) -> None:
    """Ask for a rebalance of ``pool`` (see :mod:`airflow_elastic_gpu.broker.rebalance`)."""
    s.execute(_ADD_REQUEST, {"pool": pool, "time_s": time_s})


def unknown_pool(s: Session, pool: str) -> NotFound:
    """The error for ``pool`` not being a pool of the broker, naming the ones it has."""
    known = s.scalars(select(GpuPool.name).order_by(GpuPool.name)).all()
    return NotFound(f"unknown GPU pool {pool!r}; known pools: {', '.join(known) or 'none'} "
                    "(register a node in it first: airflow-elastic-gpu nodes add)")
