"""ElasticTrainingTrigger: waits in the triggerer for a training job to end, and keeps the pool rebalanced.

Each poll (every ``poll_interval`` seconds, the broker calls in a thread so
the triggerer's event loop never blocks) it runs the broker's leased periodic
rebalance, logs the job's new events (resizes with their reasons) into the
task log, and fires once the broker records a terminal state. The trigger
holds no state beyond its serialized arguments: after a triggerer restart it
re-polls and picks up where the broker is. The broker's record of the job's
end is the truth, whatever happened to the processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_elastic_gpu.broker.service import GpuBroker

GONE_POLLS = 3  # polls with neither agent nor launcher alive before the job is failed


class ElasticTrainingTrigger(BaseTrigger):
    """Fires ``{"job_id", "status", "reason"}`` when job ``job_id`` ends.

    :param job_id: the broker's job id.
    :param broker_conn_id: Airflow connection of the broker (see ``GpuBrokerHook``).
    :param poll_interval: seconds between polls.
    :param backend: the job's backend name; ``local`` lets the trigger notice dead processes.
    :param work_dir: the local backend's job directory parent.
    :param after_event_id: events up to this id were already logged.
    """

    def __init__(self, job_id: str, broker_conn_id: str = "elastic_gpu_default", poll_interval: float = 5.0,
                 backend: str = "local", work_dir: str | None = None, after_event_id: int = 0,
                 kubernetes: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> None:
        super().__init__()
        self.kubernetes = kubernetes
        self.env = env
        self.job_id = job_id
        self.broker_conn_id = broker_conn_id
        self.poll_interval = poll_interval
        self.backend = backend
        self.work_dir = work_dir
        self.after_event_id = after_event_id
        self._broker: GpuBroker | None = None
        self._url: str | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "airflow_elastic_gpu.triggers.training.ElasticTrainingTrigger",
            {"job_id": self.job_id, "broker_conn_id": self.broker_conn_id,
             "poll_interval": self.poll_interval, "backend": self.backend, "work_dir": self.work_dir,
             "after_event_id": self.after_event_id, "kubernetes": self.kubernetes, "env": self.env},
        )

    def _get_broker(self) -> GpuBroker:
        if self._broker is None:
            from airflow_elastic_gpu.hooks.broker import GpuBrokerHook

            self._url = GpuBrokerHook(self.broker_conn_id).get_url()
            self._broker = GpuBroker(self._url, migrate=False)
        return self._broker

    def _local_backend(self):
        from airflow_elastic_gpu.backends import get_backend
        from airflow_elastic_gpu.config import default_work_dir

        return get_backend("local", broker_url=self._url or "", work_dir=self.work_dir or default_work_dir())

    def _poll(self, gone: int) -> tuple[Any, list[Any], int]:
        try:
            broker = self._get_broker()
            job = broker.job(self.job_id)
            broker.maybe_rebalance(job.pool)
        except Exception:
            self._broker = None  # re-create the client next time (credentials, dropped connections)
            raise
        if not job.status.terminal and self.backend == "kubernetes":
            self._kubernetes_poll(broker, job)
        if not job.status.terminal and self.backend == "local" and job.backend_ref:
            backend = self._local_backend()
            gone = 0 if backend.is_running(self.job_id) else gone + 1
            if gone >= GONE_POLLS:
                tail = "\n".join(backend.log_tail(self.job_id))
                broker.fail(self.job_id, "the job's agent and launcher processes are gone (host restart or "
                            f"killed by hand). Last log lines:\n{tail}")
        job = broker.job(self.job_id)
        events = broker.events(job_id=self.job_id, after_id=self.after_event_id)
        return job, events, gone

    def _kubernetes_backend(self):
        from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend, KubernetesJobConfig

        if getattr(self, "_k8s", None) is None:
            self._k8s = KubernetesBackend(KubernetesJobConfig.from_dict(self.kubernetes or {}), self._get_broker())
        return self._k8s

    def _kubernetes_poll(self, broker: GpuBroker, job: Any) -> None:
        """Create or re-create the job's pod for the broker's target; fail the job if its pod broke."""
        backend = self._kubernetes_backend()
        backend.sync(job.id, job.command, progress_pattern=job.progress_pattern,
                     checkpoint_dir=job.checkpoint_dir, env=self.env)
        placed = bool(job.target_gpus)
        problem = backend.problem(job.id, expected=placed and job.acked_generation >= 1)
        if problem:
            tail = "\n".join(backend.log_tail(job.id))
            broker.fail(job.id, f"{problem}. Last log lines:\n{tail}" if tail else problem)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        gone = 0
        while True:
            try:
                job, events, gone = await asyncio.to_thread(self._poll, gone)
            except Exception as exc:  # the broker DB is briefly unreachable: keep waiting
                self.log.warning("polling the broker failed (%s); retrying in %ss", exc, self.poll_interval)
                await asyncio.sleep(self.poll_interval)
                continue
            for e in events:
                if e.kind in ("start", "resize", "ack", "lost", "failed", "cancelled", "succeeded"):
                    self.log.info("[%s] %s", e.kind, e.message)
                self.after_event_id = e.id
            if job.status.terminal:
                if self.backend == "kubernetes":
                    await asyncio.to_thread(self._kubernetes_backend().stop, job.id,
                                            succeeded=job.status.value == "succeeded")
                yield TriggerEvent({"job_id": job.id, "status": job.status.value, "reason": job.reason})
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """The user marked the deferred task failed/success or cleared it: stop the job, free its GPUs."""
        def kill() -> None:
            broker = self._get_broker()
            broker.cancel(self.job_id, "task instance killed by a user while deferred")
            if self.backend == "local":
                self._local_backend().stop(self.job_id, timeout_s=30)
            elif self.backend == "kubernetes":
                self._kubernetes_backend().stop(self.job_id)

        await asyncio.to_thread(kill)
