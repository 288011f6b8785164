"""Jobs that no task follows any more: cancelled, so that their GPUs go to other jobs.

A training task's job is stopped by the task itself when it ends: by its trigger when a user marks
the deferred task failed or success or clears it (the triggerer cancels the trigger), by the
operator when its last try fails in the worker. Two ends reach no code of the task:

- a deferred task marked failed (or success) while no triggerer runs: when a triggerer starts
  again, the task is no longer deferred and its trigger is never run;
- a task whose worker died (a SIGKILL, a lost host) that Airflow then fails without a retry.

The job then trains on, for hours, on GPUs that nobody's result will use. Every trigger of a pool,
and every task of it that waits in its worker (``deferrable=False``), therefore looks, every
:data:`ORPHAN_CHECK_S` (once per pool and process), at the pool's
unfinished jobs that the operator submitted (their key is ``dag_id/task_id/run_id/map_index`` and
their family ``dag_id.task_id``: :func:`task_of`) and asks Airflow for their task instances' states
(``RuntimeTaskInstance.get_task_states``, one question per task: the answer's keys of one question
never collide, as ``<task>_1`` of a mapped task and a task named ``<task>_1`` would). A job whose
task instance is in an ended state (:data:`ENDED_STATES`) at two checks in a row is cancelled, if
the task try it belonged to at the check is still the one (a cleared task's new try that reattached
meanwhile keeps it). A task instance Airflow does not
know (a DAG run deleted) is left alone, and so is every state from which the task may still follow
its job (running, deferred, queued, up for retry, cleared). Only this Airflow deployment's jobs are
checked: deployments that share a broker name themselves (``[elastic_gpu] deployment``, the first
segment of their jobs' keys), and a job of another, whose DAG, task and run ids may well be the
same as a task of this one that has ended (a scheduled run's are), is never asked about.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from airflow_elastic_gpu.backends.base import Backend
from airflow_elastic_gpu.broker.types import JobStatus, JobView, task_key_parts
from airflow_elastic_gpu.config import airflow_conf, default_deployment
from airflow_elastic_gpu.triggers.threads import in_daemon_thread

log = logging.getLogger(__name__)

ORPHAN_CHECK_S = 60.0
"""Seconds between two checks of a pool's jobs in one triggerer process; a job is cancelled at the
second check that finds its task instance ended, so 60-120 s after the task ended."""
ENDED_STATES = frozenset({"success", "failed", "skipped", "removed", "upstream_failed"})
"""Task instance states from which the task does not come back to its job without a user's clear
(a cleared task's new try submits again: it reattaches to a job that still runs, else resumes
from the checkpoint)."""
STATES_TIMEOUT_S = 10.0
"""How long one question to Airflow may take (the triggerer's supervisor answers it)."""

TaskStates = Callable[[str, list[str], list[str]], Mapping[str, Mapping[str, Any]]]
"""``(dag_id, task_ids, run_ids) -> {run_id: {task key: state}}``, the shape of Airflow's
``RuntimeTaskInstance.get_task_states`` (a mapped task's key is ``<task_id>_<map_index>``)."""


@dataclass(frozen=True)
class TaskId:
    """The Airflow task instance a job was submitted for."""

    dag_id: str
    task_id: str
    run_id: str
    map_index: int

    @property
    def state_key(self) -> str:
        """The task's key in Airflow's answer of task states."""
        return self.task_id if self.map_index < 0 else f"{self.task_id}_{self.map_index}"

    def __str__(self) -> str:
        mapped = "" if self.map_index < 0 else f", map index {self.map_index}"
        return f"{self.dag_id}.{self.task_id} (run {self.run_id}{mapped})"


def task_of(job: JobView, deployment: str = "") -> TaskId | None:
    """The task instance the operator of Airflow deployment ``deployment`` (``[elastic_gpu]
    deployment``, ``""`` for none) submitted ``job`` for, or ``None`` for a job submitted otherwise
    (the CLI, the API, another deployment) or whose key was cut (ids too long: the key ends in a
    hash) (:func:`~airflow_elastic_gpu.broker.types.task_key_parts`)."""
    parts = task_key_parts(job.key, job.family)
    if parts is None or parts[0] != deployment:
        return None
    _, dag_id, task_id, run_id, map_index = parts
    try:
        index = int(map_index)
    except ValueError:
        return None
    return TaskId(dag_id, task_id, run_id, index) if dag_id and task_id and run_id else None


def airflow_task_states(dag_id: str, task_ids: list[str], run_ids: list[str]) -> Mapping[str, Mapping[str, Any]]:
    """Airflow's :data:`TaskStates`, asked through the supervisor of the process (a triggerer's or a
    task's); at most :data:`STATES_TIMEOUT_S`.

    :raises TimeoutError: no answer in time (a triggerer that shuts down).
    :raises Exception: no supervisor to ask (no Airflow, or outside its processes)."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    return in_daemon_thread(lambda: RuntimeTaskInstance.get_task_states(
        dag_id=dag_id, task_ids=task_ids, run_ids=run_ids), "elastic-gpu-task-states").result(STATES_TIMEOUT_S)


@dataclass
class OrphanCheck:
    """The checks of one pool's jobs (see the module): when the last ran, and the jobs whose task
    instance it found ended (job id -> the task try the job belonged to then)."""

    interval_s: float | None = None  # None: ORPHAN_CHECK_S
    last_s: float | None = None
    suspects: dict[str, str | None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def due(self, now_s: float) -> bool:
        interval_s = ORPHAN_CHECK_S if self.interval_s is None else self.interval_s
        return self.last_s is None or now_s - self.last_s >= interval_s

    def run(self, broker: Any, backend: Backend | None, pool: str, task_states: TaskStates,
            now_s: float, deployment: str = "") -> list[JobView]:
        """One check of ``pool`` (see the module): cancel the jobs of Airflow deployment
        ``deployment`` found orphaned at this check and the one before, and stop their processes
        with ``backend`` where it is theirs (in a thread of its own: a stop may wait a grace period).

        :returns: the jobs cancelled.
        :raises Exception: the broker could not be read (the check is done again at the next poll).
        """
        if not self.lock.acquire(blocking=False):  # another trigger's poll checks the pool now
            return []
        try:
            if not self.due(now_s):
                return []
            self.last_s = now_s
            jobs = [(job, task) for job in broker.jobs(pool, active_only=True) if (task := task_of(job, deployment)) is not None]
            ended = self._ended(jobs, task_states)
            cancelled = []
            for job, task in jobs:
                state = ended.get(job.id)
                if state is None or job.id not in self.suspects or self.suspects[job.id] != job.attempt:
                    continue  # ended at this check only, or a try reattached since the last
                reason = (f"its Airflow task {task} is {state} and no task follows the job (it ended while no "
                          "triggerer ran, or its worker was lost): cancelled to free its GPUs")
                ended_job = broker.cancel(job.id, reason, attempt=job.attempt)
                if ended_job.status is JobStatus.CANCELLED and ended_job.reason == reason:  # not one that ended meanwhile
                    log.warning("job %s: %s", job.id, reason)
                    cancelled.append(ended_job)
                    if backend is not None and job.backend == backend.name:  # a stop elsewhere finds nothing
                        # where the job was started (another namespace of the cluster, for one)
                        stopper = getattr(backend, "for_job", lambda _job: backend)(job)
                        in_daemon_thread(lambda job_id=job.id, b=stopper: _stop(b, job_id), "elastic-gpu-orphan-stop")
            done = {j.id for j in cancelled}
            self.suspects = {job.id: job.attempt for job, _task in jobs if job.id in ended and job.id not in done}
            return cancelled
        finally:
            self.lock.release()

    @staticmethod
    def _ended(jobs: Iterable[tuple[JobView, TaskId]], task_states: TaskStates) -> dict[str, str]:
        """Job id -> its task instance's state, for the jobs whose task instance has ended."""
        by_task: dict[tuple[str, str], list[tuple[JobView, TaskId]]] = {}
        for job, task in jobs:
            by_task.setdefault((task.dag_id, task.task_id), []).append((job, task))
        ended: dict[str, str] = {}
        for (dag_id, task_id), members in by_task.items():
            try:
                states = task_states(dag_id, [task_id], sorted({t.run_id for _, t in members}))
            except Exception as exc:  # noqa: BLE001 - no answer: nobody is cancelled on a guess
                log.info("could not read the task states of %s.%s (%s): its jobs are checked again later",
                         dag_id, task_id, exc)
                continue
            for job, task in members:
                state = (states.get(task.run_id) or {}).get(task.state_key)
                if state is not None and str(getattr(state, "value", state)) in ENDED_STATES:
                    ended[job.id] = str(getattr(state, "value", state))
        return ended


def _stop(backend: Backend, job_id: str) -> None:
    try:
        backend.stop(job_id, timeout_s=30)
    except Exception as exc:  # noqa: BLE001 - the agent stops the trainer of a cancelled job all the same
        log.warning("job %s: could not stop its processes (%s)", job_id, exc)


_CHECKS: dict[tuple[int, str], OrphanCheck] = {}
_CHECKS_LOCK = threading.Lock()


def check_orphans(broker: Any, backend: Backend | None, pool: str, task_states: TaskStates | None = None,
                  deployment: str | None = None) -> Future[list[JobView]] | None:
    """The trigger's call at each poll: :meth:`OrphanCheck.run` for ``pool`` of ``broker``'s
    engine, in a thread of its own when one is due in this process (Airflow's answers may take
    seconds: the trigger's own poll does not wait for them), with Airflow's answer (``task_states``,
    default :func:`airflow_task_states`), for the jobs of Airflow deployment ``deployment`` (default
    ``[elastic_gpu] deployment``). A check that fails (the broker away) is logged and done
    again when the next is due.

    :returns: the check's future (the jobs it cancelled), or ``None`` when none is due.
    """
    key = (id(getattr(broker, "engine", broker)), pool)
    with _CHECKS_LOCK:
        check = _CHECKS.setdefault(key, OrphanCheck())
    if not check.due(time.monotonic()) or check.lock.locked():
        return None

    def run() -> list[JobView]:
        try:
            name = default_deployment(conf=airflow_conf()) if deployment is None else deployment
            return check.run(broker, backend, pool, task_states or airflow_task_states, time.monotonic(), name)
        except Exception as exc:  # noqa: BLE001 - logged; the next check that is due tries again
            log.warning("could not check GPU pool %s for jobs no task follows (%s)", pool, exc)
            return []

    return in_daemon_thread(run, "elastic-gpu-orphans")
