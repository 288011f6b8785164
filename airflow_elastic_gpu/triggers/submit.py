"""Submit a training job to the broker and start its processes: the one copy that the operator (in
the worker) and the trigger (``start_from_trigger=True``, in the triggerer) both run."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_elastic_gpu.backends.base import Backend, abandon, check_env, start_job
from airflow_elastic_gpu.backends.local_processes import started_elsewhere
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec, JobView, task_family
from airflow_elastic_gpu.states import JobStatus
from airflow_elastic_gpu.triggers.task_instance import attempt_of, job_name_of, task_key


@dataclass(frozen=True)
class Started:
    """A submitted job with its processes started.

    :param job: the job as the broker records it after the start.
    :param reattached: its processes were running already (a retried task, a restarted triggerer),
        or it had ended (the same try's job, ``JobSpec.attempt``): nothing new was started.
    """

    job: JobView
    reattached: bool


def trigger_spec(ti: Any, job: Mapping[str, Any], *, command: str, checkpoint_dir: str | None,
                 job_name: str | None, backend: str, pool: str) -> JobSpec:
    """The job a ``start_from_trigger`` trigger submits for task instance ``ti``: the operator's
    fields in ``job`` (the trigger's serialized ``job`` argument) and the rendered ``command``,
    ``checkpoint_dir`` and ``job_name``. No ``max_tries``: the triggerer's task instance does not
    have the real one.

    :raises BrokerError: a bad field (a relative ``checkpoint_dir``, once rendered).
    """
    return JobSpec(
        name=job_name_of(ti, job_name), command=command,
        min_gpus=job["min_gpus"], max_gpus=job.get("max_gpus"), requested_gpus=job.get("requested_gpus"),
        total_steps=job["total_steps"], key=task_key(ti), pool=pool, priority=job.get("priority", 0),
        progress_pattern=job.get("progress_pattern"), checkpoint_dir=checkpoint_dir, backend=backend,
        preemptible=bool(job.get("preemptible", False)), relative_speed=job.get("relative_speed"),
        family=task_family(ti.dag_id, ti.task_id), attempt=attempt_of(ti))


def submit_and_start(broker: GpuBroker, backend: Backend, spec: JobSpec, *, env: Mapping[str, str] | None,
                     labels: Mapping[str, str], log: logging.Logger,
                     on_submitted: Callable[[JobView], None] | None = None) -> Started:
    """Register ``spec.pool`` if the backend can (local: this host's GPUs), check the command,
    submit ``spec`` (idempotent on ``spec.key``; for ``spec.attempt`` also once its job has ended,
    and for a retry (``spec.max_tries``) once its job has succeeded)
    and start the job's processes, unless they run already or the job has ended.

    Blocking (DB and backend calls): a trigger runs it in a thread.

    :param env: the trainer's extra environment, as rendered (checked again here: a template may
        have made a value a non-string).
    :param labels: the task's ``dag_id``, ``task_id``, ``run_id``, ``map_index`` (backend labels).
    :param on_submitted: called with the job once the broker has it, before its processes start
        (a start can take a while: a task killed meanwhile must know which job to stop).
    :raises BrokerError: the broker refused the job.
    :raises BackendError: a bad command, checkpoint directory or environment, or a failed start.
    """
    registered = backend.ensure_pool(spec.pool)
    if registered:
        log.info("%s", registered)
    env = check_env(env)
    backend.check(spec.command, spec.checkpoint_dir)
    job = broker.submit(spec)
    if on_submitted is not None:
        on_submitted(job)
    if job.status.terminal:  # this attempt's job ended, or a retry's succeeded one: nothing to start
        log.info("job %s of this task already %s (this try's, while the triggerer was away, or a retried "
                 "try's success): not trained again", job.id, job.status.value)
        return Started(job, True)
    if backend.name == "local" and (host := started_elsewhere(job.backend_ref)) is not None:
        # a retry or trigger on another machine of a distributed Airflow: its processes run there
        log.info("job %s runs on host %s, not this one: followed from here (its agent there reports to the "
                 "broker, whose lease ends it if that host is lost), not started again", job.id, host)
        return Started(job, True)
    try:
        running = backend.is_running(job.id)
    except Exception as exc:  # the cluster API refused or is away
        if job.backend_ref is None:  # never started: failed now, as a failed start is (start_job)
            abandon(broker, backend, job.id, exc)
        raise
    job = start_job(broker, backend, job, env=env, context=labels)
    if job.status.terminal and not running:  # ended while it started (its task was killed meanwhile)
        log.info("job %s %s while it started: what the start made is stopped", job.id, job.status.value)
        backend.stop(job.id, succeeded=job.status is JobStatus.SUCCEEDED)
        return Started(job, False)
    log.info("%s job %s (%d-%d GPUs, %d steps) on the %s backend: %s",
             "reattached to running" if running else "started", job.id, spec.min_gpus, spec.max_gpus,
             spec.total_steps, backend.name, job.backend_ref)
    return Started(job, running)
