"""A job's end in the broker: ``finish``, ``fail`` and ``cancel``, and the per-node reports of a gang
of pods (its nodes' GPUs freed as their trainers stop; a node's clean exit without metrics waits
for the others); with the job-row locks every job call takes first."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, bindparam, select

from airflow_elastic_gpu.broker.models import Event, Node
from airflow_elastic_gpu.broker.queries import Queries
from airflow_elastic_gpu.broker.rows import NODES_ACKED, job_gpus, lock_book, read_job, update_job
from airflow_elastic_gpu.broker.types import InvalidRequest, JobView, NotFound
from airflow_elastic_gpu.states import TERMINAL, EventKind, JobStatus

log = logging.getLogger(__name__)

_NODE_OF_POOL = select(Node.id).where(Node.pool == bindparam("pool"), Node.name == bindparam("node"))
_LAST_EVENT = (select(Event.kind, Event.message).where(Event.job_id == bindparam("job_id"))
               .order_by(Event.id.desc()).limit(1))


class Endings(Queries):
    """The end-of-job calls of :class:`~airflow_elastic_gpu.broker.service.GpuBroker`, and the row
    locks of every job call."""

    def _locked_job(self, conn: Connection, job_id: str) -> Any:
        job = read_job(conn, job_id, lock=True)
        if job is None:
            raise NotFound(f"unknown job {job_id!r}")
        return job

    def _locked_book(self, conn: Connection, job_id: str) -> Any:
        job = lock_book(conn, job_id)
        if job is None:
            raise NotFound(f"unknown job {job_id!r}")
        return job

    # ------------------------------------------------------------------ the end

    def _end(self, job_id: str, status: JobStatus, reason: str | None, exit_code: int | None,
             metrics: dict[str, Any] | None, *, hold: bool = False, node: str | None = None,
             attempt: str | None = None) -> JobView:
        def run() -> None:
            with self.engine.begin() as conn:
                job = self._locked_book(conn, job_id)
                if attempt is not None and job.attempt is not None and job.attempt != attempt:
                    log.info("job %s: not ended for task try %s: try %s follows it now", job_id, attempt, job.attempt)
                    return
                if node is not None and conn.execute(_NODE_OF_POOL, {"pool": job.pool, "node": node}).first() is None:
                    raise InvalidRequest(f"node {node!r} is not a node of GPU pool {job.pool!r}")
                where = "its trainer stopped" if node is None else f"its trainer on node {node} stopped"
                if (job.status == JobStatus.LOST.value and status is JobStatus.SUCCEEDED
                        and (node is None or metrics)):
                    # the trainer had finished cleanly, but its agent could not report it within the
                    # lease (the broker's API away): the job succeeded (its GPUs were freed already)
                    update_job(conn, job.id, status=status.value, reason=reason, exit_code=exit_code,
                               **({"metrics": dict(metrics)} if metrics else {}))
                    self._event(conn, job.pool, EventKind.ended(status),
                                f"{reason}: its trainer had exited cleanly, reported after the job was declared "
                                "lost (its agent could not reach the broker within the lease)", job.id,
                                exit_code=exit_code)
                    return
                if JobStatus(job.status) in TERMINAL:
                    # the agent's report of a trainer that stopped after its job ended (cancelled)
                    if not hold and self._release_held(conn, job, f"{where} ({reason})", node):
                        self._ask_rebalance(conn, job.pool, self._due(job, added=1))
                    return
                if node is not None and status is JobStatus.FAILED and not hold:
                    target, in_use = job_gpus(conn, job.id)
                    if (target or in_use) and node not in {g.node for g in (*target, *in_use)}:
                        # a node the job no longer runs on (a gang's dropped node, acked: its trainer
                        # died with its generation, or its pod's deletion stopped it): not the job's end
                        log.info("job %s: %s on node %s, which the job no longer runs on; it runs on", job.id,
                                 reason, node)
                        return
                exited = list(job.finished_nodes or ())
                if node is not None and status is JobStatus.SUCCEEDED and not metrics:
                    # a gang of pods: this node's trainer exited cleanly without the final metrics
                    # line; the trainer that prints it (global rank 0) may still run on another node.
                    # The job's trainers run on its acked generation's GPUs and on those of the nodes
                    # that acked its target already, or, before the first ack (nothing in use), on its
                    # target's. Not on the other nodes of a newer target: a finishing gang applies no
                    # newer generation, so they never report
                    target, in_use = job_gpus(conn, job.id)
                    nodes = {g.node for g in in_use or target}
                    if in_use and target and job.target_generation > job.acked_generation:
                        nodes |= set(conn.execute(NODES_ACKED, {"job_id": job.id,
                                                                "generation": job.target_generation}).scalars())
                    if node not in nodes and nodes:
                        return  # a node the job no longer runs on (dropped): nothing of it to record
                    waiting = sorted(nodes - {*exited, node})
                    if waiting:
                        if node not in exited:
                            update_job(conn, job.id, finished_nodes=sorted({*exited, node}))
                            self._event(conn, job.pool, EventKind.FINISHING,
                                        f"its trainer on node {node} exited cleanly; the job ends once "
                                        f"{', '.join(waiting)} {'has' if len(waiting) == 1 else 'have'} too "
                                        "or the final metrics come (its allocation is kept until then)", job.id)
                        return
                # a gang of pods: one node's agent reports; the other nodes' trainers may still
                # run until their agents see the end, so their GPUs stay held until they report
                self._release(conn, job, status, reason, exit_code, metrics, hold=hold or node is not None)
                if node is not None and not hold:
                    self._release_held(conn, job, f"{where} ({reason})", node)
                for other in exited:  # nodes whose trainers exited cleanly earlier
                    if other != node:
                        self._release_held(conn, job, f"its trainer on node {other} had exited cleanly", other)
                self._ask_rebalance(conn, job.pool, self._due(job, added=1))

        self._retrying(run)
        return self.job(job_id)

    def finish(self, job_id: str, exit_code: int = 0, metrics: dict[str, Any] | None = None, *,
               node: str | None = None) -> JobView:
        """The trainer exited with 0: SUCCEEDED, GPUs released. On an ended job it changes nothing
        but frees the GPUs the job still holds (its trainer has stopped: see :meth:`cancel`), except
        on a LOST one, which succeeds (its agent could not report the clean exit within the lease;
        a gang's node: only with the final metrics).

        :param node: as for :meth:`fail`: a gang of pods' node whose agent reports; the other
            nodes' GPUs stay held until their agents report their trainers stopped. Without
            ``metrics`` (that node's trainer is not the one that prints them), the job succeeds
            only once every node it runs on has reported so; until then the node is recorded
            (``finished_nodes``), the job runs on with its allocation fixed, and the view returned
            is still RUNNING.
        :raises InvalidRequest: ``node`` is not a node of the job's pool, or ``exit_code`` is not 0
            (a trainer that exited otherwise failed: :meth:`fail`).
        """
        if exit_code != 0 or isinstance(exit_code, bool):
            raise InvalidRequest(f"finish is a clean exit (exit_code 0), got exit_code={exit_code!r}: a trainer that "
                                 "exited otherwise is reported with fail")
        return self._end(job_id, JobStatus.SUCCEEDED, "trainer finished", exit_code, metrics, node=node)

    def fail(self, job_id: str, reason: str, exit_code: int | None = None,
             metrics: dict[str, Any] | None = None, *, node: str | None = None, hold: bool = False) -> JobView:
        """The job cannot go on (``reason`` says why): FAILED, GPUs released. On an ended job: as
        :meth:`finish`.

        :param node: a job with one agent per node (a gang of pods): the node whose agent reports,
            whose trainer has stopped. Only that node's GPUs are released; the other nodes' stay
            out of every allocation until their agents report their trainers stopped (the same
            call) or until no heartbeat came for the pool's ``lease_s``, as after :meth:`cancel`.
            None: the whole job's trainers have stopped.
        :param hold: the trainer may still run (the backend sees its agent broken, not its trainer):
            every GPU of the job stays held as after :meth:`cancel`.
        :raises InvalidRequest: ``node`` is not a node of the job's pool.
        """
        return self._end(job_id, JobStatus.FAILED, reason, exit_code, metrics, node=node, hold=hold)

    def note_problem(self, job_id: str, message: str) -> bool:
        """Record that the backend could not do what the job needs now and tries again (``message``:
        e.g. a pod not created, a resource quota exceeded): a ``backend`` event, which the task's log
        and the UI show, and which the reason names if the job is declared LOST meanwhile (its agent
        never started). Recorded once while it is the job's latest event (a backend retries every
        poll). Nothing on an ended job.

        :returns: whether an event was recorded.
        :raises NotFound: unknown job.
        """
        message = str(message)[:2000]

        def run() -> bool:
            with self.engine.begin() as conn:
                job = self._locked_job(conn, job_id)
                if JobStatus(job.status) in TERMINAL:
                    return False
                last = conn.execute(_LAST_EVENT, {"job_id": job_id}).first()
                if last is not None and last.kind == EventKind.BACKEND.value and last.message == message:
                    return False
                self._event(conn, job.pool, EventKind.BACKEND, message, job_id)
                return True

        return self._retrying(run)

    def cancel(self, job_id: str, reason: str = "cancelled by user", *, attempt: str | None = None) -> JobView:
        """Stop the job: CANCELLED at once; its agent sees the status on its next heartbeat and
        stops the trainer (SIGTERM, the grace period). Its GPUs stay out of every allocation until
        the agent reports the trainer stopped (:meth:`fail` or :meth:`finish` on the ended job), or
        until no heartbeat came for the pool's ``lease_s`` (the launcher has fenced the trainer
        by then): no other job starts on a GPU the cancelled trainer may still use.

        :param attempt: the task try that cancels (``JobSpec.attempt``): the job is cancelled only
            if that try submitted it, or the last to reattach to it (:meth:`submit`), or none did;
            else it is left as it is (a cleared task's old trigger must not stop the job its new
            try follows) and the view returned is not ended.
        """
        return self._end(job_id, JobStatus.CANCELLED, reason, None, None, hold=True, attempt=attempt)
