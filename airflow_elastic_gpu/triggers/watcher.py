"""JobWatcher: one poll of a running job, shared by the trigger (in a thread) and the operator's
``deferrable=False`` path, so both keep the pool rebalanced, keep the backend in step with the
broker, fail a job whose processes are gone, log its events and clean up once it has ended.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from airflow_elastic_gpu.backends.base import Backend, BackendError
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import EventView, JobView
from airflow_elastic_gpu.sidecar.logparse import log_excerpt
from airflow_elastic_gpu.states import ENDED_KINDS, PUBLISH_KINDS, EventKind, JobStatus

GONE_POLLS = 3
"""Polls in a row that must find a job's processes gone before the job is failed."""
CLEANUP_TRIES = 3
"""Polls whose clean-up of an ended job may fail before its end is reported all the same."""
LOGGED_KINDS = PUBLISH_KINDS | {EventKind.ACK} | ENDED_KINDS
"""Event kinds written into the task log: generations published and acked, and the job's end."""


class CleanupFailed(BackendError):
    """The job has ended, but the backend could not stop (clean up) its processes.

    :param job: the ended job, as the broker records it.
    """

    def __init__(self, job: JobView, error: Exception) -> None:
        super().__init__(f"job {job.id} {job.status.value}, but its clean-up failed: {error}")
        self.job = job


class TaskLog(Protocol):
    """What the watcher needs of a logger: a stdlib ``logging.Logger`` or Airflow's structlog one."""

    def info(self, msg: str, *args: Any) -> Any: ...


class JobWatcher:
    """Follows job ``job_id``: call :meth:`poll` every few seconds until the job has ended.

    Synchronous and blocking (database and backend calls): the trigger runs :meth:`poll` in a
    thread. Its only state is the last event logged and a count of polls that found the job's
    processes gone; a new watcher (after a triggerer restart) picks up where the broker is.

    :param broker: the broker client.
    :param backend: the job's backend.
    :param job_id: the broker's job id.
    :param after_event_id: events up to this id were logged already.
    :param env: the trainer's extra environment, as given to ``Backend.start`` (for re-creations).
    :param context: the task's labels, as given to ``Backend.start`` (for re-creations).
    :param log: where events go (the task log: the operator's or the trigger's logger).
    """

    def __init__(self, broker: GpuBroker, backend: Backend, job_id: str, *, after_event_id: int = 0,
                 env: Mapping[str, str] | None = None, context: Mapping[str, str] | None = None,
                 log: TaskLog | None = None) -> None:
        self.broker = broker
        self.backend = backend
        self.job_id = job_id
        self.after_event_id = after_event_id
        self.env = env
        self.context = context
        self.log: TaskLog = log or logging.getLogger(__name__)
        self.gone_polls = 0  # polls in a row that found the job's processes gone
        self.cleanup_failures = 0  # clean-ups of the ended job that failed (see cleanup_failed)

    def renewed(self, broker: GpuBroker, backend: Backend) -> JobWatcher:
        """This watcher with new clients (after a failed poll: expired credentials, a dropped
        connection), where it left off: its event cursor, its gone polls and its failed clean-ups."""
        fresh = JobWatcher(broker, backend, self.job_id, after_event_id=self.after_event_id, env=self.env,
                           context=self.context, log=self.log)
        fresh.gone_polls, fresh.cleanup_failures = self.gone_polls, self.cleanup_failures
        return fresh

    def poll(self) -> tuple[JobView, list[EventView]]:
        """One round: the leased periodic rebalance of the job's pool, ``backend.sync``, a check of
        ``backend.problem`` (:meth:`end_if_broken`), the new events logged, and ``backend.stop`` once
        the broker records the job's end.

        :returns: the job as the broker now records it, and the events new since the last poll.
        :raises BrokerError: the job is unknown, or a broker call failed.
        :raises CleanupFailed: the job has ended and the backend could not stop its processes
            (the caller retries, then reports the end all the same: :meth:`cleanup_failed`).
        :raises BackendError: the backend could not sync the job's processes.
        """
        job = self.broker.job(self.job_id)
        self.broker.maybe_rebalance(job.pool)
        if not job.status.terminal:
            try:
                self.backend.sync(job, env=self.env, context=self.context)
            finally:  # a broken pod is reported while its pods cannot be synced too
                self.end_if_broken(job)
        job = self.broker.job(self.job_id)
        if job.status is JobStatus.LOST:
            job = self._finished_unreported(job)
        events = self.broker.events(job_id=self.job_id, after_id=self.after_event_id)
        for event in events:
            if event.kind in LOGGED_KINDS:
                self.log.info("[%s] %s", event.kind, event.message)
            self.after_event_id = event.id
        if job.status.terminal:
            try:
                self.backend.stop(self.job_id, succeeded=job.status is JobStatus.SUCCEEDED)
            except Exception as exc:  # any: a cluster API or a disk that fails, the job has ended
                raise CleanupFailed(job, exc) from exc
        return job, events

    def cleanup_failed(self, exc: CleanupFailed) -> bool:
        """Count the clean-up failure ``exc`` (raised by :meth:`poll`): True (the end is to be
        reported) once there were :data:`CLEANUP_TRIES`, with an error in the task log that says
        what is left behind. The broker's record is the truth: the job has ended, and an ended job's GPUs go to
        others once its trainer has stopped (a cancelled one's agent stops it); what a failed
        clean-up leaves (on Kubernetes: pods, the token Secret, a gang's Service) is to be removed
        by hand, as the error says."""
        self.cleanup_failures += 1
        failures = self.cleanup_failures
        if failures < CLEANUP_TRIES:
            self.log.warning("%s; retrying (%d of %d)", exc, failures, CLEANUP_TRIES)
            return False
        self.log.error("%s (%d tries): its end is reported all the same; what the clean-up "
                       "left behind is to be removed by hand", exc, failures)
        return True

    def _finished_unreported(self, job: JobView) -> JobView:
        """A LOST job whose trainer had exited cleanly (its backend reads it: a local launcher's
        ``status.json``, a pod's log) succeeds with the metrics found: its agent could not reach the
        broker within the lease (the broker's API away as the job ended), and the try was retried,
        the whole training redone from its last checkpoint. The broker takes the late report."""
        try:
            problem = self.backend.problem(job)
        except Exception as exc:  # noqa: BLE001 - the job's end stands as LOST
            self.log.warning("job %s: could not tell whether its trainer had finished (%s)", job.id, exc)
            return job
        if problem is None or problem.finished is None:
            return job
        self.log.warning("job %s was declared lost, but %s: it succeeded", job.id, problem.reason)
        return self.broker.finish(job.id, 0, problem.finished or None)

    def end_if_broken(self, job: JobView) -> None:
        """End ``job`` when its backend finds a problem (:meth:`.Backend.problem`): failed with the
        reason and the trainer's last log lines, at once, or after :data:`GONE_POLLS` calls in a row
        for processes that are gone; a clean exit its agent did not report succeeds."""
        problem = self.backend.problem(job)
        self.gone_polls = self.gone_polls + 1 if problem is not None and problem.gone else 0
        if problem is None or (problem.gone and self.gone_polls < GONE_POLLS):
            return
        if problem.finished is not None:  # a clean exit that its agent did not live to report
            self.log.warning("job %s: %s", job.id, problem.reason)
            self.broker.finish(job.id, 0, problem.finished or None)
            return
        tail = log_excerpt(self.backend.log_tail(job.id))
        # a gang: the broken pod's node only, the other nodes' GPUs stay held until their trainers stop
        reason = f"{problem.reason}. Last log lines:\n{tail}" if tail else problem.reason
        self.broker.fail(job.id, reason, node=problem.node, hold=problem.running)
