"""Read queries of the broker: jobs, nodes, events, samples and whole-pool snapshots.

Each reads in one session with a fixed number of queries, whatever the number of jobs or nodes:
the GPUs of every job and node shown are loaded in one query per table, not one per row.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Row, Select, func, select, tuple_
from sqlalchemy.orm import Session, selectinload

from airflow_elastic_gpu.broker.models import (
    Event,
    Gpu,
    GpuInUse,
    GpuPool,
    GpuTarget,
    Job,
    Node,
    ProgressSample,
)
from airflow_elastic_gpu.broker.rebalance import Rebalancing
from airflow_elastic_gpu.broker.rows import (
    JOB_COLUMNS,
    Executor,
    job_gpus,
    read_job,
    throughput_of,
    unknown_pool,
)
from airflow_elastic_gpu.broker.types import (
    DEFAULT_POOL,
    EventView,
    GpuView,
    JobView,
    NodeView,
    NotFound,
    PoolConfig,
    PoolSnapshot,
)
from airflow_elastic_gpu.scheduling.core import attained_gpu_s
from airflow_elastic_gpu.scheduling.policy import Policy, stored_policy
from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.states import ACTIVE, JobStatus

_MAY_HOLD = (JobStatus.CANCELLED.value, JobStatus.FAILED.value, JobStatus.SUCCEEDED.value)  # may hold GPUs


def event_view(e: Event) -> EventView:
    return EventView(e.id, e.time_s, e.pool, e.job_id, e.kind, e.message, e.data)


def _job_filter(q: Select[Any], pool: str | None, active_only: bool) -> Select[Any]:
    if pool is not None:
        q = q.where(Job.pool == pool)
    return q.where(Job.status.in_(ACTIVE)) if active_only else q


class Queries(Rebalancing):
    """Read-only calls of :class:`~airflow_elastic_gpu.broker.service.GpuBroker`."""

    # ------------------------------------------------------------------ jobs

    def job(self, job_id: str) -> JobView:
        """:raises NotFound: unknown job."""
        def read(conn: Connection) -> JobView:
            job = read_job(conn, job_id)
            if job is None:
                raise NotFound(f"unknown job {job_id!r}")
            return self._views(conn, [job])[0]

        return self._read_conn(read)

    def job_by_key(self, key: str) -> JobView | None:
        def read(conn: Connection) -> JobView | None:
            job = conn.execute(select(*JOB_COLUMNS).where(Job.key == key)).first()
            return None if job is None else self._views(conn, [job])[0]

        return self._read_conn(read)

    def jobs(self, pool: str | None = None, *, active_only: bool = False, limit: int | None = None,
             offset: int = 0, newest_first: bool = False, after: str | None = None,
             id_prefix: str | None = None) -> list[JobView]:
        """Jobs (of ``pool``, or all), in submit order (``newest_first``: the reverse): the ``limit``
        (all if ``None``) after the first ``offset`` of them, and after job ``after`` in that order
        (a page that follows the last job of the one before: jobs ending or removed meanwhile shift
        no later one out of it, as they would shift an offset); with ``id_prefix``, only the jobs
        whose id starts with it.

        :raises NotFound: ``after`` is no job the broker has (the broker keeps every job's row).
        """
        def read(conn: Connection) -> list[JobView]:
            order = (Job.submit_s.desc(), Job.id.desc()) if newest_first else (Job.submit_s, Job.id)
            q = _job_filter(select(*JOB_COLUMNS), pool, active_only).order_by(*order)
            if id_prefix is not None:
                q = q.where(Job.id.startswith(id_prefix, autoescape=True))
            if after is not None:
                anchor = conn.execute(select(Job.submit_s, Job.id).where(Job.id == after)).first()
                if anchor is None:
                    raise NotFound(f"unknown job {after!r} to list jobs after")
                key = tuple_(Job.submit_s, Job.id)
                q = q.where(key < tuple_(*anchor) if newest_first else key > tuple_(*anchor))
            return self._views(conn, conn.execute(q.limit(limit).offset(offset or None)).all())

        return self._read_conn(read)

    def count_jobs(self, pool: str | None = None, *, active_only: bool = False) -> int:
        """How many jobs :meth:`jobs` lists with the same filters and no ``limit``."""
        return self._read_conn(lambda conn: conn.execute(
            _job_filter(select(func.count()).select_from(Job), pool, active_only)).scalar_one())

    def job_names(self, job_ids: Sequence[str]) -> dict[str, str]:
        """Job id -> name of those of ``job_ids`` the broker has (one light query, for labels)."""
        return {i: r.name for i, r in self._rows_by_id(job_ids, Job.name).items()}

    def job_keys(self, job_ids: Sequence[str]) -> dict[str, tuple[str, str | None]]:
        """Job id -> (key, family) of those of ``job_ids`` the broker has (for what a viewer of the
        read-only views may read of them: :mod:`.api_access`)."""
        return {i: (r.key, r.family) for i, r in self._rows_by_id(job_ids, Job.key, Job.family).items()}

    def _rows_by_id(self, job_ids: Sequence[str], *columns: Any) -> dict[str, Row[Any]]:
        """Job id -> the row of ``columns`` (and the id) of those of ``job_ids`` the broker has."""
        ids = sorted(set(job_ids))

        def read(conn: Connection) -> dict[str, Row[Any]]:
            found: dict[str, Row[Any]] = {}
            for i in range(0, len(ids), 500):  # a bounded IN list per query
                found.update((r.id, r) for r in conn.execute(select(Job.id, *columns).where(Job.id.in_(ids[i:i + 500]))))
            return found

        return self._read_conn(read)

    def _gpus_by_job(self, s: Executor, table: type[GpuTarget | GpuInUse],
                     job_ids: Sequence[str]) -> dict[str, tuple[GpuId, ...]]:
        found: dict[str, list[GpuId]] = defaultdict(list)
        if job_ids:
            for job_id, node, index in s.execute(
                select(table.job_id, Node.name, Gpu.index).join(Gpu, Gpu.id == table.gpu_id)
                .join(Node, Node.id == Gpu.node_id).where(table.job_id.in_(job_ids))
            ):
                found[job_id].append(GpuId(node, index))
        return {k: tuple(sorted(v)) for k, v in found.items()}

    def _views(self, s: Executor, jobs: Sequence[Job | Row[Any]]) -> list[JobView]:
        # ended jobs hold no GPU, but a cancelled one until its trainer has stopped, and a gang of
        # pods whose end one node reported until every node's trainer has; nor does one that was
        # never published a generation (a new job)
        ids = [j.id for j in jobs if (JobStatus(j.status) in ACTIVE or j.status in _MAY_HOLD)
               and j.target_generation > 0]
        if not ids:
            targets, in_use = {}, {}
        elif len(ids) == 1:
            targets, in_use = ({ids[0]: gpus} for gpus in job_gpus(s, ids[0]))
        else:
            targets = self._gpus_by_job(s, GpuTarget, ids)
            in_use = self._gpus_by_job(s, GpuInUse, ids)
        now = self.clock() if in_use else 0.0
        return [
            JobView(
                id=job.id, key=job.key, name=job.name, pool=job.pool, command=job.command,
                status=JobStatus(job.status), min_gpus=job.min_gpus, max_gpus=job.max_gpus,
                requested_gpus=job.requested_gpus, total_steps=job.total_steps, priority=job.priority,
                steps_done=job.steps_done, target_generation=job.target_generation,
                acked_generation=job.acked_generation, target_gpus=targets.get(job.id, ()),
                in_use_gpus=in_use.get(job.id, ()), num_resizes=job.num_resizes,
                # an ended job's GPU time stops at its end (the count of its release), though it may
                # hold its GPUs until its trainer has stopped
                gpu_seconds=attained_gpu_s(job.gpu_seconds, len(in_use.get(job.id, ())), job.in_use_since_s,
                                           now if job.end_s is None else min(now, job.end_s)),
                restart_overhead_s=job.restart_overhead_s,
                throughput=throughput_of(job).observed, submit_s=job.submit_s, start_s=job.start_s,
                end_s=job.end_s, last_heartbeat_s=job.last_heartbeat_s, exit_code=job.exit_code,
                reason=job.reason, metrics=job.metrics, progress_pattern=job.progress_pattern,
                checkpoint_dir=job.checkpoint_dir, backend=job.backend, backend_ref=job.backend_ref,
                preemptible=bool(job.preemptible), family=job.family, attempt=job.attempt,
                published_s=job.published_s,
            )
            for job in jobs
        ]

    def samples(self, job_id: str) -> list[tuple[float, float, int, int]]:
        """``(time_s, step, num_gpus, generation)`` of every progress sample of a job, in order."""
        return self._read(lambda s: [
            tuple(r) for r in s.execute(
                select(ProgressSample.time_s, ProgressSample.step, ProgressSample.num_gpus, ProgressSample.generation)
                .where(ProgressSample.job_id == job_id).order_by(ProgressSample.id)
            )
        ])

    def events(self, pool: str | None = None, *, job_id: str | None = None, after_id: int = 0,
               limit: int = 1000, latest: bool = False) -> list[EventView]:
        """Events after ``after_id``, oldest first, at most ``limit``: the oldest of them, or with
        ``latest`` the newest."""
        def read(s: Session) -> list[EventView]:
            q = select(Event).where(Event.id > after_id).order_by(Event.id.desc() if latest else Event.id).limit(limit)
            if pool is not None:
                q = q.where(Event.pool == pool)
            if job_id is not None:
                q = q.where(Event.job_id == job_id)
            found = [event_view(e) for e in s.scalars(q)]
            return found[::-1] if latest else found

        return self._read(read)

    # ------------------------------------------------------------------ pools and nodes

    def pool_policy(self, pool: str = DEFAULT_POOL) -> Policy:
        """The policy that rebalances ``pool``.

        :raises NotFound: unknown pool.
        """
        if self.policy_override is not None:
            return self.policy_override
        name, params = self.pool_settings(pool)
        return stored_policy(name, params)

    def pool_config(self, pool: str = DEFAULT_POOL) -> PoolConfig:
        """``pool``'s settings, read in one go.

        :raises NotFound: unknown pool.
        """
        def read(s: Session) -> PoolConfig:
            row = s.get(GpuPool, pool)
            if row is None:
                raise unknown_pool(s, pool)
            return PoolConfig(row.policy, dict(row.policy_params or {}), row.lease_s, row.rebalance_interval_s)

        return self._read(read)

    def pool_settings(self, pool: str = DEFAULT_POOL) -> tuple[str, dict[str, Any]]:
        """``(policy name, policy parameters)`` as set for ``pool`` (parameters not set are absent:
        the policy's defaults apply).

        :raises NotFound: unknown pool.
        """
        config = self.pool_config(pool)
        return config.policy, config.policy_params

    def pools(self) -> list[str]:
        return self._read(lambda s: list(s.scalars(select(GpuPool.name).order_by(GpuPool.name))))

    def nodes(self, pool: str | None = None) -> list[NodeView]:
        def read(s: Session) -> list[NodeView]:
            q = select(Node).options(selectinload(Node.gpus)).order_by(Node.pool, Node.name)
            if pool is not None:
                q = q.where(Node.pool == pool)
            return self._node_views(s, list(s.scalars(q)))

        return self._read(read)

    def _node_views(self, s: Session, nodes: Sequence[Node]) -> list[NodeView]:
        gpu_ids = [g.id for n in nodes for g in n.gpus]
        in_use = dict(s.execute(select(GpuInUse.gpu_id, GpuInUse.job_id).where(GpuInUse.gpu_id.in_(gpu_ids))).all())
        target = dict(s.execute(select(GpuTarget.gpu_id, GpuTarget.job_id).where(GpuTarget.gpu_id.in_(gpu_ids))).all())
        return [
            NodeView(
                pool=node.pool, name=node.name, schedulable=node.schedulable,
                gpus=tuple(GpuView(GpuId(node.name, g.index), g.gpu_type, g.healthy, in_use.get(g.id),
                                   target.get(g.id)) for g in node.gpus),
            )
            for node in nodes
        ]

    def snapshot(self, pool: str = DEFAULT_POOL, *, events: int = 50, ended: int = 100) -> PoolSnapshot:
        """Nodes, GPUs and their holders, the jobs, and the latest ``events`` of one pool, read in
        one session. The jobs are every queued, running or suspended one, the ``ended`` that
        ended last (a pool's history grows with every run; :meth:`jobs` lists it all) and any
        older ended one that still holds a GPU, in submit order; ``ended_hidden`` counts the ended
        ones left out."""
        def read(s: Session) -> PoolSnapshot:
            nodes = self._node_views(s, list(s.scalars(
                select(Node).options(selectinload(Node.gpus)).where(Node.pool == pool).order_by(Node.name))))
            of_pool = select(*JOB_COLUMNS).where(Job.pool == pool)
            # the statements see one moment (``_read``), so a job ending meanwhile is in exactly one
            # of the two lists and the count below agrees with them
            rows = {r.id: r for r in s.execute(of_pool.where(Job.status.in_(ACTIVE))).all()}
            # latest first along ix_job_pool_end_id (every ended job has its end_s): no sort of them all
            last_ended = s.execute(of_pool.where(Job.status.not_in(ACTIVE), Job.end_s.is_not(None))
                                   .order_by(Job.end_s.desc(), Job.id.desc()).limit(ended)).all()
            rows.update((r.id, r) for r in last_ended)
            ended_total = s.scalar(select(func.count()).select_from(Job).where(
                Job.pool == pool, Job.status.not_in(ACTIVE))) or 0
            # an older ended job that still holds GPUs (a cancelled trainer stopping): its GPUs are
            # drawn with its name
            holders = {h for n in nodes for g in n.gpus for h in (g.in_use_by, g.target_of) if h} - rows.keys()
            if holders:
                rows.update((r.id, r) for r in s.execute(of_pool.where(Job.id.in_(sorted(holders)))).all())
            jobs = sorted(self._views(s, list(rows.values())), key=lambda j: (j.submit_s, j.id))
            shown_ended = sum(1 for r in rows.values() if JobStatus(r.status) not in ACTIVE)
            evs = s.scalars(select(Event).where(Event.pool == pool).order_by(Event.id.desc()).limit(events)).all()
            return PoolSnapshot(pool, self.clock(), tuple(nodes), tuple(jobs),
                                tuple(event_view(e) for e in reversed(evs)),
                                ended_hidden=max(0, ended_total - shown_ended))

        return self._read(read)
