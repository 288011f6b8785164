"""How the broker ends a job's hold on its GPUs: a job's end (its GPU time accounted, its GPUs
freed, or held while its trainer may still run), the release of an ended job's held GPUs (its
agent reports the trainer stopped, or the lease passes), and the reaping of jobs whose agent went
silent for a lease (declared LOST), with a whole lease again for every job after an outage of the
broker's database, when no agent could be heard."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Row, bindparam, literal_column, select

from airflow_elastic_gpu.broker.models import Event, Job
from airflow_elastic_gpu.broker.rows import (
    JOB_COLUMNS,
    Executor,
    book_changes,
    book_of,
    free_gpus,
    job_gpus,
    update_job,
)
from airflow_elastic_gpu.broker.transactions import BrokerBase
from airflow_elastic_gpu.scheduling.core import account_gpu_time
from airflow_elastic_gpu.states import ACTIVE, EventKind, JobStatus

_ENDED_HOLDING = (select(Job.id, Job.pool, Job.last_heartbeat_s).where(Job.id.in_(bindparam("job_ids", expanding=True)))
                  .with_for_update(key_share=True, skip_locked=True))
# the backend's latest problem with a job since it was last heard (few rows: ``ix_event_job_id``)
_PROBLEM = (select(Event.message).where(Event.job_id == bindparam("job_id"), Event.time_s >= bindparam("since"),
                                        Event.kind == literal_column(f"'{EventKind.BACKEND.value}'"))
            .order_by(Event.id.desc()).limit(1))
# the outages since the earliest a silent job was last heard (few rows: a range of ``ix_event_time_s``)
_OUTAGES = (select(Event.time_s).where(Event.time_s >= bindparam("since"), Event.pool == bindparam("pool"),
                                       Event.kind == literal_column(f"'{EventKind.OUTAGE.value}'"))
            .order_by(Event.time_s))


def _heard_s(job: Any) -> float:
    """When the job's agent was last heard, or had a whole lease from (its last publication)."""
    return max(job.last_heartbeat_s, job.published_s or 0.0)


def _silent_for(job: Any, now: float, outages: Sequence[float] = ()) -> float:
    """Seconds the job counts as silent against the pool's lease: since its agent's last heartbeat or
    its last publication, whichever is later (a new generation's agent, e.g. a new pod, has a whole
    lease to start and report). A job never placed (no generation published) is never silent: it
    holds no GPU, and a backend may start its agent only once it is placed (Kubernetes creates the
    pod then); its task watches it meanwhile. Nor is a suspended job that has acked its
    suspension: it holds no GPU either, and its agent may be gone (a pod deleted while it waits);
    its resume is a publication, from which an agent has a whole lease again. Only delays
    reaping, never hastens it: a silent agent's launcher has fenced its trainer within the lease
    of its last contact. ``outages``: when the pool's rebalances resumed after an outage
    (:data:`~airflow_elastic_gpu.states.EventKind.OUTAGE`, ascending): no agent could reach the
    broker before, so a job has a whole lease from the first outage after it was last heard
    (from the first only: a pool whose only callers are gone sees a gap at every call)."""
    if not job.target_generation or (
            job.status == JobStatus.SUSPENDED.value and job.acked_generation >= job.target_generation):
        return 0.0
    heard = _heard_s(job)
    return now - next((t for t in outages if t >= heard), heard)


class Releases(BrokerBase):
    """A job's end and the freeing of its GPUs (the rebalance's first step)."""

    def _release(self, s: Executor, job: Job | Row[Any], status: JobStatus, reason: str | None,
                 exit_code: int | None, metrics: dict[str, Any] | None = None, *, hold: bool = False) -> None:
        """End ``job`` with ``status``: account its GPU time, free its in-use and target GPUs (the
        caller holds the job's row lock).

        :param hold: keep the GPUs (a cancelled job whose trainer may still run): they stay out of
            every allocation until :meth:`_release_held` frees them, when the job's agent reports
            its trainer stopped, or a rebalance finds no heartbeat for ``lease_s`` (by then the
            launcher has fenced the trainer, as for a lost job).
        """
        now = self.clock()
        target, in_use = job_gpus(s, job.id)
        book = book_of(job, target, in_use)
        account_gpu_time(book, now)
        held = hold and bool(target or in_use)
        if not held:
            free_gpus(s, job.id)
        extra = {"metrics": dict(metrics)} if metrics else {}
        update_job(s, job.id, **book_changes(job, book), status=status.value, reason=reason, exit_code=exit_code,
                   end_s=now, **extra)
        message = reason or status.value
        if held:
            message += ("; its GPUs stay held until its trainer has stopped (its agent reports it, or "
                        "no heartbeat for the lease)")
        self._event(s, job.pool, EventKind.ended(status), message, job.id, exit_code=exit_code)

    def _release_held(self, s: Executor, job: Job | Row[Any], why: str, node: str | None = None) -> bool:
        """Free the GPUs an ended job still holds (see :meth:`_release`'s ``hold``), or only those on
        ``node`` (a gang of pods: that node's trainer has stopped); False if none."""
        target, in_use = job_gpus(s, job.id)
        gpus = sorted(g for g in set(target) | set(in_use) if node is None or g.node == node)
        if not gpus:
            return False
        free_gpus(s, job.id, None if node is None else (job.pool, node))
        self._event(s, job.pool, EventKind.RELEASE, f"{len(gpus)} GPU(s) released: {why}", job.id,
                    gpus=[str(g) for g in gpus])
        return True

    def _draining(self, s: Executor, held: dict[str, dict[str, list[int]]], active: set[str], now: float,
                  lease_s: float) -> set[int]:
        """GPU ids (``gpu.id``) of ``held`` (kind -> job id -> GPU ids) that jobs not in ``active``
        (ended ones: a cancelled job's trainer may still be stopping) still hold, after freeing
        those of jobs with no heartbeat for ``lease_s`` seconds (their launchers have fenced their
        trainers by then, as for a lost job)."""
        ended = {j for by_job in held.values() for j in by_job} - active
        if not ended:
            return set()
        out: set[int] = set()
        # locked, skipping a row whose stop is being reported (the report frees the GPUs, once)
        locked = {j.id: j for j in s.execute(_ENDED_HOLDING, {"job_ids": sorted(ended)})}
        for job_id in sorted(ended):
            job = locked.get(job_id)
            if job is not None and (silent_s := now - job.last_heartbeat_s) > lease_s:
                self._release_held(s, job, f"no heartbeat from its agent for {silent_s:.0f}s (lease {lease_s:.0f}s) "
                                           "since the job ended: its trainer is fenced")
            else:
                out.update(i for by_job in held.values() for i in by_job.get(job_id, ()))
        return out

    def _reap_silent(self, s: Executor, row: Row[Any], jobs: Sequence[Row[Any]], previous_s: float,
                     now: float) -> set[str]:
        """End as LOST the jobs of ``jobs`` (the pool ``row``'s unfinished ones) whose agent has been
        silent for longer than the pool's lease (:func:`_silent_for`; their launchers have fenced
        their trainers by then) and free their GPUs; their ids.

        :param previous_s: the pool's last rebalance before this one (:meth:`_outages`)."""
        silent = [j for j in jobs if _silent_for(j, now) > row.lease_s]
        outages = self._outages(s, row, previous_s, now, min(_heard_s(j) for j in silent)) if silent else []
        reaped = set()
        for job in self._locked_active(s, [j.id for j in silent]).values():
            if (silent_s := _silent_for(job, now, outages)) > row.lease_s:
                # why the agent may never have started: the backend's problem (a pod not created)
                problem = s.execute(_PROBLEM, {"job_id": job.id, "since": _heard_s(job)}).scalar()
                self._release(
                    s, job, JobStatus.LOST,
                    f"no heartbeat from the job's agent for {silent_s:.0f}s since its last heartbeat or "
                    f"placement (or an outage of the broker) (lease {row.lease_s:.0f}s); its GPUs were reclaimed"
                    + (f"; the backend's last problem with it: {problem}" if problem else ""),
                    None,
                )
                reaped.add(job.id)
        return reaped

    def _outages(self, s: Executor, row: Row[Any], previous_s: float, now: float, since: float) -> list[float]:
        """When the pool's rebalances resumed after a gap longer than its lease, since ``since``
        (ascending; this rebalance's ``now`` among them if it ends one).

        Every heartbeat and trigger poll of a pool with running jobs asks for a rebalance at least
        every ``rebalance_interval_s``; a gap longer than the lease, and than that interval by half
        a lease (agents report several times a lease), means that no call reached the database (it
        was restarted, failed over, or unreachable), so no agent could be heard either. (An outage
        of the broker's HTTP API alone, which agents on Kubernetes call while the triggerer still
        reaches the database, is not seen: its jobs are declared lost as before.) This rebalance records it (an ``outage`` event), and a silent job gets a whole
        lease from the first outage after it was last heard (its launcher fenced the trainer on
        its own clock; its agent resumes it once heard again). Only delays reaping, never hastens
        it: a pool whose only callers are gone (every agent dead, no task polling) reclaims their
        GPUs one lease later than it would have.

        :param previous_s: the pool's last rebalance before this one (0: none)."""
        outages = [float(t) for t in s.execute(_OUTAGES, {"pool": row.name, "since": since}).scalars()]
        if 0.0 < previous_s and now - previous_s > max(row.lease_s, row.rebalance_interval_s + row.lease_s / 2):
            self._event(s, row.name, EventKind.OUTAGE,
                        f"no rebalance for {now - previous_s:.0f}s (lease {row.lease_s:.0f}s, rebalance interval "
                        f"{row.rebalance_interval_s:.0f}s): no call reached the broker's database; silent jobs "
                        "have a whole lease from now to be heard again")
            outages.append(now)
        return outages

    def _locked_active(self, s: Executor, job_ids: Iterable[str]) -> dict[str, Row[Any]]:
        """Lock the rows of ``job_ids`` (re-read, every column) and return those still unfinished."""
        ids = sorted(set(job_ids))
        if not ids:
            return {}
        rows = s.execute(select(*JOB_COLUMNS).where(Job.id.in_(ids)).order_by(Job.id).with_for_update(key_share=True))
        return {j.id: j for j in rows if j.status in ACTIVE}
