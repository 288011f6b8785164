"""The broker's adapter to the scheduling core: load a pool's rows, call the core, write back what changed.

Rebalances are **coalesced**, and job calls never wait for one:

* A call that may change allocations (submit, ack, a job's end, a node or pool change) inserts a
  :class:`~airflow_elastic_gpu.broker.models.RebalanceRequest` row (an insert, so it never waits on
  a running rebalance) and, if one is due, tries to take the pool's lock without waiting
  (``FOR NO KEY UPDATE SKIP LOCKED``; SQLite serializes writers anyway): a job call in its own
  transaction (:meth:`Rebalancing._ask_rebalance`, under a savepoint), a node or pool change after
  its commit. If it gets the lock, it runs one rebalance that serves every pending request; if
  another rebalance holds the lock, that one, or the next, serves it: a rebalance deletes the
  requests it saw *before* it reads the pool, so a request committed later is left for the next
  one. Callers count pending requests from just below the pool's watermark (the highest id the
  last rebalance saw, less :data:`~.rows.LOOKBACK_REQUESTS`), an index range scan that steps over
  at most that many served, deleted rows; the look-back finds a request whose id was taken before
  the watermark but committed after it.
* A job call locks its job row before anything else and never waits for the pool's lock. A
  rebalance holds the pool lock, reads the pool without row
  locks, decides, then locks just the job rows it writes (publications, reaped jobs) and re-checks
  them: a job that ended meanwhile is left alone, and if a job it publishes to acked meanwhile (its
  in-use set moved to a target the decision may have shared out), nothing is published and the
  rebalance asks for another. A stale read is only ever conservative: a GPU
  is published to a job only if no other job's target names it (targets change only under the
  pool lock or when a job ends) and no acked generation uses it.
* A periodic rebalance (heartbeats, triggers) also serves any request left. Concurrent explicit
  :meth:`Rebalancing.rebalance` calls are served by one run, not one each.

The two-phase resize protocol and the "no GPU in two jobs" invariant are the core's and the
schema's (primary keys of ``gpu_in_use`` and ``gpu_target``); coalescing changes when a decision is
taken, never what may be published.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    Row,
    String,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session

from airflow_elastic_gpu.broker.models import (
    Event,
    Gpu,
    GpuInUse,
    GpuPool,
    GpuTarget,
    Job,
    Node,
    RebalanceRequest,
)
from airflow_elastic_gpu.broker.releases import Releases
from airflow_elastic_gpu.broker.rows import (
    BOOK_COLUMNS,
    UNFINISHED,
    Executor,
    book_of,
    by_type_of,
    holds,
    read_pool,
    request_rebalance,
    throughput_of,
    try_lock_pool,
)
from airflow_elastic_gpu.broker.transactions import transient_kind
from airflow_elastic_gpu.broker.types import DEFAULT_POOL, NotFound
from airflow_elastic_gpu.scheduling.core import JobBook, SchedulingCore
from airflow_elastic_gpu.scheduling.policy import Policy, stored_policy
from airflow_elastic_gpu.scheduling.state import GpuId, NodeState
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel
from airflow_elastic_gpu.sidecar.protocol import GANG_PLACEHOLDERS
from airflow_elastic_gpu.states import EventKind, JobStatus

log = logging.getLogger(__name__)

# a rebalance's statements, built once (parameters bound per call)
_SERVED = delete(RebalanceRequest).where(RebalanceRequest.pool == bindparam("pool"))
# whether a job may run on several nodes: its command uses every gang placeholder (the simulator's
# jobs may, as submit lets them)
_MULTI_NODE = or_(Job.backend == "simulated",
                  and_(*(holds(Job.command, p) for p in GANG_PLACEHOLDERS))).label("multi_node")
_ACTIVE_JOBS = (select(*BOOK_COLUMNS, _MULTI_NODE).where(Job.pool == bindparam("pool"), UNFINISHED)
                .order_by(Job.submit_s, Job.id))
_FINISHED_MEASURED = (Job.pool == bindparam("pool"), Job.status == literal_column(f"'{JobStatus.SUCCEEDED.value}'"),
                      Job.throughput.is_not(None))


def _latest_of_family(family: Any, samples: Any) -> Any:
    """The samples of ``family``'s latest finished job that has samples (``samples``: the JSON
    ``observed`` key is present): at most one row, read backwards along ``ix_job_pool_family_end``."""
    return (select(Job.family, Job.throughput).where(Job.family == family, samples.is_not(None), *_FINISHED_MEASURED)
            .order_by(Job.end_s.desc(), Job.id.desc()).limit(1))


# PostgreSQL: one statement, the families as one array parameter (compiled and parsed once), each
# family's latest run found by a LATERAL index look-up: the cost does not grow with the history
_NAMES = func.unnest(bindparam("names", type_=postgresql.ARRAY(String))).table_valued("family").render_derived(name="names")
_LATEST = _latest_of_family(_NAMES.c.family, Job.throughput.op("->")(literal_column("'observed'"))).lateral("latest")
_FAMILY_HISTORY_PG = select(_LATEST.c.family, _LATEST.c.throughput).select_from(_NAMES).join(_LATEST, true())
# elsewhere (SQLite, in process): one look-up per family
_FAMILY_LATEST = _latest_of_family(bindparam("family"), func.json_extract(Job.throughput, "$.observed"))


def _dialect(s: Executor) -> str:
    return (s.get_bind() if isinstance(s, Session) else s).dialect.name


def family_history(s: Executor, pool: str, books: Sequence[JobBook]
                   ) -> tuple[dict[str, ThroughputModel], dict[str, dict[str, ThroughputModel]]]:
    """Family -> throughput model (its samples) of the latest finished measured job of that family
    in ``pool``, and family -> GPU type -> that job's model on the type, for the families of the
    pool's unfinished jobs (the prior of a scheduled retraining's next run:
    :func:`~airflow_elastic_gpu.scheduling.throughput.with_pool_prior` and
    :func:`~airflow_elastic_gpu.scheduling.throughput.with_family_by_type`).
    An index look-up per family (``ix_job_pool_family_end``; on PostgreSQL all in one statement),
    none when no job has a family."""
    names = sorted({b.family for b in books if b.family is not None})
    if not names:
        return {}, {}
    out: dict[str, ThroughputModel] = {}
    by_type: dict[str, dict[str, ThroughputModel]] = {}
    if _dialect(s) == "postgresql":
        rows = list(s.execute(_FAMILY_HISTORY_PG, {"pool": pool, "names": names}))
    else:
        rows = [row for name in names if (row := s.execute(_FAMILY_LATEST, {"pool": pool, "family": name}).first())]
    for row in rows:
        model = throughput_of(row)
        if model.observed:
            out[row.family] = model
            measured = {t: m for t, m in by_type_of(row).items() if m.observed}
            if measured:
                by_type[row.family] = measured
    return out, by_type


# every GPU of the pool with the jobs whose target and in-use set name it (at most one each: the
# GPU is the primary key of both tables; a job holds only GPUs of its own pool's nodes)
_POOL_GPUS = (
    select(Node.name, Node.schedulable, Gpu.id, Gpu.index, Gpu.gpu_type, Gpu.healthy,
           GpuTarget.job_id.label("target_job"), GpuInUse.job_id.label("in_use_job"))
    .join(Gpu, Gpu.node_id == Node.id)
    .outerjoin(GpuTarget, GpuTarget.gpu_id == Gpu.id).outerjoin(GpuInUse, GpuInUse.gpu_id == Gpu.id)
    .where(Node.pool == bindparam("pool")).order_by(Node.name, Gpu.index)
)
_DROP_TARGETS = delete(GpuTarget).where(GpuTarget.job_id.in_(bindparam("job_ids", expanding=True)))
_PUBLISH = update(Job).where(Job.id == bindparam("_job_id"))
_ADD_EVENT = insert(Event)
_ADD_TARGET = insert(GpuTarget)


_MAX_REQUEST = select(func.max(RebalanceRequest.id)).where(RebalanceRequest.pool == bindparam("pool")).scalar_subquery()
_TOUCH_POOL = update(GpuPool).where(GpuPool.name == bindparam("pool")).values(
    last_rebalance_s=bindparam("now"),
    served_request_id=case(  # never lowered (only leftovers below it may be visible)
        (_MAX_REQUEST > GpuPool.served_request_id, _MAX_REQUEST), else_=GpuPool.served_request_id),
)
# PostgreSQL: both in one statement (one round trip less under the pool lock): the requests are
# deleted and the watermark set to the highest id deleted, from one snapshot
_SERVED_IDS = _SERVED.returning(RebalanceRequest.id).cte("served")
_MAX_SERVED = select(func.max(_SERVED_IDS.c.id)).scalar_subquery()
_TOUCH_AND_SERVE = update(GpuPool).where(GpuPool.name == bindparam("pool")).values(
    last_rebalance_s=bindparam("now"),
    served_request_id=case((_MAX_SERVED > GpuPool.served_request_id, _MAX_SERVED), else_=GpuPool.served_request_id),
).add_cte(_SERVED_IDS)
_POOL_SHARED = select(GpuPool.last_rebalance_s).where(GpuPool.name == bindparam("pool")).with_for_update(read=True)


class Rebalancing(Releases):
    """Rebalances of a pool (coalesced)."""

    # ------------------------------------------------------------------ requests and coalescing

    def _due(self, row: Row[Any] | None, added: int = 0) -> bool:
        """Whether to rebalance now, from the pool's row as :func:`~.rows.read_pool` reads it (or
        :func:`~.rows.lock_book`; ``added``: requests the caller inserted after that read): the
        last rebalance is older than ``rebalance_interval_s``; or requests are pending and either
        the last rebalance is older than :attr:`coalesce_s` or this is the only request (nobody
        else is busy with the pool, so waiting would gather nothing). Several requests within
        ``coalesce_s`` of a rebalance wait for the next call, heartbeat or trigger poll after it:
        one rebalance serves them all."""
        if row is None:
            return False
        since = self.clock() - row.last_rebalance_s
        if since >= row.rebalance_interval_s:
            return True
        pending = min(2, row.pending + added)
        return pending > 0 and (since >= self.coalesce_s or pending == 1)

    def _serve_rebalance(self, pool: str, due: bool | None = None) -> bool:
        """Run the pending rebalance of ``pool`` if one is due and its lock is free now; else the
        lock's holder, or a later call, serves it. Whether one is due (``due``, as the caller's
        transaction saw it, or read here) is known before the lock is taken, so the lock stays free
        for the rebalance that is. True if this call ran one."""
        if due is None:
            due = self._due(self._read_conn(lambda conn: read_pool(conn, pool), one_statement=True))
        if not due:
            return False

        def run() -> bool:
            with self.engine.begin() as conn:
                row = try_lock_pool(conn, pool)
                if row is None or not self._due(row):
                    return False
                self._rebalance(conn, row)
                return True

        return self._retrying(run)

    def _ask_rebalance(self, s: Executor, pool: str, due: bool) -> None:
        """Ask for a rebalance of ``pool`` in the caller's job transaction and, if one is ``due`` (as
        the caller read the pool before asking, see :meth:`_due`) and the pool's lock is free now,
        serve it there: one transaction, instead of a second one after the commit.

        The caller holds only job rows it locked first, so this cannot deadlock: a rebalance then waits only
        for other job rows, whose holders never wait for the pool (they try its lock without
        waiting). The rebalance runs under a savepoint: if it fails for a reason other than a
        transient one (which redoes the whole transaction), the failure is logged, the pool's
        requests stay pending for the next call, and the caller's change is still committed.
        """
        request_rebalance(s, pool, self.clock())
        if not due:
            return
        row = try_lock_pool(s, pool)
        if row is None or not self._due(row):
            return
        with self._rebalance_failure_logged(pool), s.begin_nested():
            self._rebalance(s, row)

    @contextmanager
    def _rebalance_failure_logged(self, pool: str) -> Iterator[None]:
        """Around a rebalance that serves a job call or a heartbeat: a failure that is neither
        transient (those redo the whole transaction) nor the schema's own guard (an
        ``IntegrityError``: one GPU, one job; never hidden) is logged with its traceback and
        counted in :attr:`failed_rebalances`; its requests stay pending, so the next call that finds
        one due tries again, and the caller's own change stands."""
        try:
            yield
        except IntegrityError:
            raise
        except Exception as exc:
            if isinstance(exc, (OperationalError, DBAPIError)) and transient_kind(exc) is not None:
                raise
            self.failed_rebalances += 1
            log.exception("rebalance of pool %r failed; its requests stay pending", pool)

    def rebalance(self, pool: str = DEFAULT_POOL) -> dict[str, tuple[GpuId, ...]]:
        """Ask the policy for new targets now and publish them; returns job id -> newly published GPUs.

        Coalesced: concurrent calls never run one rebalance each, nor queue behind each other. If
        another transaction holds the pool, this call waits with a *shared* lock on the pool row
        (PostgreSQL ``FOR SHARE``: every waiter is let through together when the holder commits);
        if the holder was a rebalance (it was running when this call asked, or started later), it
        served this call and ``{}`` is returned; otherwise this call tries again.

        :raises NotFound: unknown pool.
        """
        seen = self._read_conn(lambda conn: read_pool(conn, pool), one_statement=True)
        if seen is None:
            raise NotFound(f"unknown GPU pool {pool!r}")

        def attempt() -> dict[str, tuple[GpuId, ...]] | None:
            with self.engine.begin() as conn:
                row = try_lock_pool(conn, pool)
                if row is None:
                    return None
                if row.last_rebalance_s != seen.last_rebalance_s:
                    return {}  # one ran since this call looked
                return self._rebalance(conn, row)

        def wait_for_holder() -> float:  # one statement: it waits for the lock, takes and drops it
            with self._autocommit.begin() as conn:
                return conn.execute(_POOL_SHARED, {"pool": pool}).scalar_one()

        while (done := self._retrying(attempt)) is None:
            if self._retrying(wait_for_holder) != seen.last_rebalance_s:
                return {}
        return done

    def maybe_rebalance(self, pool: str = DEFAULT_POOL) -> bool:
        """Rebalance if one is due (asked for, or the last is older than ``rebalance_interval_s``: a
        lease in the DB) and no other transaction holds the pool's lock; True if it ran.

        :raises NotFound: unknown pool.
        """
        if self._read_conn(lambda conn: read_pool(conn, pool), one_statement=True) is None:
            raise NotFound(f"unknown GPU pool {pool!r}")
        return self._serve_rebalance(pool, True)

    def _policy_of(self, row: GpuPool | Row[Any]) -> Policy:
        return self.policy_override or stored_policy(row.policy, row.policy_params)

    # ------------------------------------------------------------------ the rebalance itself

    def _rebalance(self, s: Executor, row: Row[Any]) -> dict[str, tuple[GpuId, ...]]:
        """Serve the pool's requests: reap silent jobs, run the scheduling core over the pool's
        jobs and publish its decisions (the caller holds the lock of the pool, ``row``)."""
        now = self.clock()
        pool, previous_s = row.name, row.last_rebalance_s  # read before the touch (an ORM row is updated by it)
        if _dialect(s) == "postgresql":
            s.execute(_TOUCH_AND_SERVE, {"pool": pool, "now": now})
        else:
            s.execute(_TOUCH_POOL, {"pool": pool, "now": now})  # the watermark first: the delete sees as much
            s.execute(_SERVED, {"pool": pool})
        jobs = s.execute(_ACTIVE_JOBS, {"pool": pool}).all()
        reaped = self._reap_silent(s, row, jobs, previous_s, now)
        jobs = [j for j in jobs if j.id not in reaped]
        self.rebalances += 1  # counted once it has read the pool (a failure after this is logged)
        held_ids: dict[str, dict[str, list[int]]] = {"target": defaultdict(list), "in_use": defaultdict(list)}
        gpus = s.execute(_POOL_GPUS, {"pool": pool}).all()
        for *_, gpu_id, _index, _type, _healthy, target_job, in_use_job in gpus:
            if target_job is not None:
                held_ids["target"][target_job].append(gpu_id)
            if in_use_job is not None:
                held_ids["in_use"][in_use_job].append(gpu_id)
        # GPUs an ended job still holds (cancelled, its trainer maybe still stopping) go to nobody
        draining = self._draining(s, held_ids, {j.id for j in jobs}, now, row.lease_s)
        if not jobs:
            return {}
        gpu_by_id: dict[int, GpuId] = {}
        usable: dict[str, list[int]] = {}
        gpu_types: dict[str, str] = {}
        for node, schedulable, gpu_id, index, gpu_type, healthy, *_ in gpus:
            gpu_by_id[gpu_id] = GpuId(node, index)
            if schedulable:
                gpu_types.setdefault(node, gpu_type)
                indices = usable.setdefault(node, [])
                if healthy and gpu_id not in draining:
                    indices.append(index)
        nodes = [NodeState(name, tuple(indices), gpu_types[name]) for name, indices in usable.items()]
        id_by_gpu = {g: i for i, g in gpu_by_id.items()}
        held = {kind: defaultdict(list, {j: [gpu_by_id[i] for i in ids] for j, ids in by_job.items()})
                for kind, by_job in held_ids.items()}
        books = [book_of(j, held["target"][j.id], held["in_use"][j.id]) for j in jobs]
        # A job whose command cannot run on several nodes is never spread over them, and gets at most
        # the GPUs a node has free of draining: with GPUs out of service (the device plugin's health)
        # no node may have its max_gpus any more, and a larger target spread it over nodes, which
        # its backend cannot run (submit checks the command against the nodes of then)
        largest = max((len(n.gpu_indices) for n in nodes), default=0)
        for job, book in zip(jobs, books):
            book.single_node = not job.multi_node
            if book.single_node and book.max_gpus > largest >= book.min_gpus:
                book.max_gpus = largest
                book.requested_gpus = min(book.requested_gpus or largest, largest)
        for job, book in zip(jobs, books):
            # an agent silent for half the lease since the job's start or resume (a new pod has
            # that long to start its agent): no new generation, which would give the job a whole
            # lease again, again and again while GPUs keep coming free
            heard_s = max(job.last_heartbeat_s, book.last_start_s or 0.0)
            book.unreachable = bool(book.target) and now - heard_s > row.lease_s / 2
        history = family_history(s, pool, books)
        try:
            publications = SchedulingCore(self._policy_of(row), self.default_restart_overhead_s).rebalance(
                nodes, books, now, *history)
        except Exception:  # logged; what was done above stands
            # a policy that fails (a bug, parameters it cannot use) decides nothing, but the silent
            # jobs reaped and the ended jobs' GPUs freed above are kept: rolled back with the
            # decision, no lease ended and no cancelled job's GPUs came back while it failed
            request_rebalance(s, pool, now)  # the requests it served stay asked for
            self.failed_rebalances += 1
            log.exception("rebalance of pool %r failed in its policy; its requests stay pending", pool)
            return {}
        locked = self._locked_active(s, [p.job_id for p in publications])
        # A job that acked while we decided now runs on GPUs the decision may have given away (a
        # GPU only in its old target is free to go in the same round), and a gang one of whose
        # nodes reported its trainer's clean exit runs on with its allocation fixed (its agents
        # apply no new generation): decide again next time.
        then = {j.id: (j.acked_generation, bool(j.finished_nodes)) for j in jobs}
        if any((locked[p.job_id].acked_generation, bool(locked[p.job_id].finished_nodes)) != then[p.job_id]
               for p in publications if p.job_id in locked):
            request_rebalance(s, pool, now)
            self.stale_rebalances += 1
            return {}
        # A job that ended while we decided may still hold its GPUs (a cancelled one, until its
        # trainer stops), some of which the decision gave to others: decide again next time.
        if any(p.job_id not in locked for p in publications):
            request_rebalance(s, pool, now)
            self.stale_rebalances += 1
            return {}
        pubs = publications
        if not pubs:
            return {}
        # one statement per kind of write for all publications (old targets dropped before any new
        # one is added: a GPU one job gives up may be another's in the same rebalance)
        s.execute(_DROP_TARGETS, {"job_ids": [p.job_id for p in pubs]})
        targets = [{"gpu_id": id_by_gpu[g], "job_id": p.job_id, "generation": p.generation} for p in pubs for g in p.gpus]
        if targets:
            s.execute(_ADD_TARGET, targets)
        by_id = {b.job_id: b for b in books}
        s.execute(_PUBLISH, [
            {"_job_id": p.job_id, "target_generation": p.generation, "published_s": now,
             "status": (JobStatus.RUNNING if p.gpus else JobStatus.SUSPENDED).value,
             "last_resize_s": now if p.previous_gpus else locked[p.job_id].last_resize_s,
             "last_start_s": by_id[p.job_id].last_start_s, "suspensions": list(by_id[p.job_id].suspensions_s)}
            for p in pubs
        ])
        events, at = [], self.clock()  # written after any reap above, and stamped so
        for p in pubs:
            kind = (EventKind.SUSPEND if not p.gpus
                    else EventKind.RESIZE if p.previous_gpus
                    else EventKind.RESUME if by_id[p.job_id].suspensions_s
                    else EventKind.START)
            message = f"generation {p.generation}: {p.reason}"
            events.append({
                "time_s": at, "pool": pool, "job_id": p.job_id, "kind": kind.value, "message": message,
                "data": {"generation": p.generation, "from_gpus": p.previous_gpus, "to_gpus": len(p.gpus),
                         "gpus": [str(g) for g in p.gpus],
                         "restart_overhead_s": locked[p.job_id].restart_overhead_s or self.default_restart_overhead_s},
            })
            log.info("[%s] job %s: %s", kind.value, p.job_id, message)
        s.execute(_ADD_EVENT, events)
        return {p.job_id: p.gpus for p in pubs}
