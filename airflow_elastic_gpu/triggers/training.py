"""ElasticTrainingTrigger: waits in the triggerer for a training job to end, and keeps the pool rebalanced.

Every ``poll_interval`` seconds it runs one :meth:`JobWatcher.poll
<airflow_elastic_gpu.triggers.watcher.JobWatcher.poll>` in a thread (the broker and backend calls
block; the triggerer's event loop must not): the broker's leased periodic rebalance, the backend
kept in step with the broker, a job whose processes are gone failed, its new events (resizes
with their reasons) logged into the task log. It fires once the broker records a terminal state,
after the backend has cleaned up. The trigger holds no state beyond its serialized arguments:
after a triggerer restart it re-polls and picks up where the broker is. The broker's record of
the job's end is the truth, whatever happened to the processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_elastic_gpu.broker.types import JobView
from airflow_elastic_gpu.triggers.watcher import JobWatcher


class ElasticTrainingTrigger(BaseTrigger):
    """Fires ``{"job_id", "status", "reason"}`` when job ``job_id`` ends.

    :param job_id: the broker's job id.
    :param broker_conn_id: Airflow connection of the broker (see ``GpuBrokerHook``).
    :param poll_interval: seconds between polls.
    :param backend: the job's backend name (see :func:`~airflow_elastic_gpu.backends.make_backend`).
    :param work_dir: the local backend's job directory parent (default: the triggerer's).
    :param after_event_id: events up to this id were already logged.
    :param kubernetes: the Kubernetes backend's settings (``backend_settings``' result).
    :param env: the trainer's extra environment (to re-create its processes).
    :param context: the task's ``dag_id``, ``task_id``, ``run_id``, ``map_index`` (labels of
        re-created resources).
    """

    def __init__(self, job_id: str, broker_conn_id: str = "elastic_gpu_default", poll_interval: float = 5.0,
                 backend: str = "local", work_dir: str | None = None, after_event_id: int = 0,
                 kubernetes: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 context: dict[str, str] | None = None) -> None:
        super().__init__()
        self.job_id = job_id
        self.broker_conn_id = broker_conn_id
        self.poll_interval = poll_interval
        self.backend = backend
        self.work_dir = work_dir
        self.after_event_id = after_event_id
        self.kubernetes = kubernetes
        self.env = env
        self.context = context
        self._watcher: JobWatcher | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "airflow_elastic_gpu.triggers.training.ElasticTrainingTrigger",
            {"job_id": self.job_id, "broker_conn_id": self.broker_conn_id,
             "poll_interval": self.poll_interval, "backend": self.backend, "work_dir": self.work_dir,
             "after_event_id": self.after_event_id, "kubernetes": self.kubernetes, "env": self.env,
             "context": self.context},
        )

    def _get_watcher(self) -> JobWatcher:
        """The watcher, with a new hook (broker client) and backend after :meth:`_drop_watcher`.
        Blocking (reads the Airflow connection): call it in a thread."""
        if self._watcher is None:
            from airflow_elastic_gpu.backends import make_backend
            from airflow_elastic_gpu.hooks.broker import GpuBrokerHook

            broker = GpuBrokerHook(self.broker_conn_id).broker
            backend = make_backend(self.backend, broker=broker, work_dir=self.work_dir,
                                   kubernetes=self.kubernetes)
            self._watcher = JobWatcher(broker, backend, self.job_id, after_event_id=self.after_event_id,
                                       env=self.env, context=self.context, log=self.log)
        return self._watcher

    def _drop_watcher(self) -> None:
        """Forget the clients after an error, so the next poll makes new ones (expired credentials,
        dropped connections)."""
        if self._watcher is not None:
            self.after_event_id = self._watcher.after_event_id
            self._watcher.broker.engine.dispose()
            self._watcher = None

    def _poll(self) -> JobView:
        watcher = self._get_watcher()
        job, _events = watcher.poll()
        self.after_event_id = watcher.after_event_id
        return job

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            try:
                job = await asyncio.to_thread(self._poll)
            except Exception as exc:  # noqa: BLE001 - the broker DB or the cluster API is briefly unreachable
                self.log.warning("polling job %s failed (%s); retrying in %ss with new clients", self.job_id,
                                 exc, self.poll_interval)
                await asyncio.to_thread(self._drop_watcher)
                await asyncio.sleep(self.poll_interval)
                continue
            if job.status.terminal:
                yield TriggerEvent({"job_id": job.id, "status": job.status.value, "reason": job.reason})
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """The user marked the deferred task failed/success or cleared it: stop the job, free its GPUs."""
        def kill() -> None:
            watcher = self._get_watcher()
            watcher.broker.cancel(self.job_id, "task instance killed by a user while deferred")
            watcher.backend.stop(self.job_id, timeout_s=30)

        await asyncio.to_thread(kill)
