"""ElasticTrainingOperator: run one DL training as an elastic job on the shared GPU pool.

Like ``KubernetesPodOperator(deferrable=True)``, the operator only
orchestrates: it submits the job to the broker (idempotent on dag_id, task_id,
run_id and map_index, so a retry or a worker crash never creates a second job
for the same try), starts its processes through the backend, and defers to
:class:`ElasticTrainingTrigger`, freeing the worker slot while the broker
resizes the job. ``execute_complete`` logs the job's resizes and returns its
metrics to XCom, or raises with the trainer's last log lines.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from airflow.exceptions import AirflowException
from airflow.sdk import BaseOperator

from airflow_elastic_gpu.backends import BACKENDS, BackendError, get_backend
from airflow_elastic_gpu.backends.local import detect_gpus
from airflow_elastic_gpu.broker.models import JobStatus
from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import (
    DEFAULT_POOL,
    BrokerError,
    JobSpec,
    JobView,
    compile_progress_pattern,
)
from airflow_elastic_gpu.config import default_work_dir
from airflow_elastic_gpu.links.job import ElasticJobLink
from airflow_elastic_gpu.hooks.broker import GpuBrokerHook
from airflow_elastic_gpu.triggers.training import ElasticTrainingTrigger

LOCAL_NODE = "localhost"


class ElasticTrainingOperator(BaseOperator):
    """Run ``command`` as an elastic training job whose GPU count the broker changes while it runs.

    :param command: training command (templated); ``{num_gpus}`` is replaced at each (re)start,
        e.g. ``torchrun --nproc_per_node={num_gpus} train.py``. It must resume from
        ``$ELASTIC_CHECKPOINT_DIR``.
    :param total_steps: steps of the whole training (>= 1), to predict remaining time.
    :param min_gpus: fewest GPUs it runs on (>= 1).
    :param max_gpus: most GPUs it can use (default ``min_gpus``: not elastic).
    :param requested_gpus: the fixed request used by non-elastic policies (default ``max_gpus``).
    :param progress_pattern: regex with group ``step`` for progress lines; default JSON lines with ``"step"``.
    :param checkpoint_dir: where the trainer checkpoints (checked at submit); default a per-job dir.
    :param gpu_pool: broker GPU pool name.
    :param priority: larger is served first by the broker.
    :param backend: ``"local"`` (processes on this host) or ``"kubernetes"`` (a pod per job with the
        sidecar; needs ``image`` and the ``kubernetes`` settings, see :class:`KubernetesJobConfig`).
    :param image: the training image (``backend="kubernetes"``).
    :param kubernetes: pod settings for ``backend="kubernetes"`` (any field of
        :class:`~airflow_elastic_gpu.backends.kubernetes.KubernetesJobConfig`: ``namespace``,
        ``resize_mechanism`` ("inplace" or "recreate"), ``on_finish_action``, ``pod_template_file``,
        ``full_pod_spec``, ``image_pull_secrets``, ``container_resources``, ``tolerations``, ``volumes``,
        ``volume_mounts``, ``broker_api_url``, ``agent_image``, ``kubernetes_conn_id``...).
    :param env: extra environment variables for the trainer (templated).
    :param broker_conn_id: Airflow connection of the broker.
    :param poll_interval: seconds between the trigger's polls.
    :param deferrable: defer to the triggerer (default); False polls in the worker.
    :param virtual_gpus: for the local backend on a host without GPUs, the pool size to register
        when the pool does not exist yet.
    :raises AirflowException: a bad argument (at DAG parse time), or a failed job.
    """

    template_fields: Sequence[str] = ("command", "env", "checkpoint_dir", "job_name")
    ui_color = "#b5e3c6"
    operator_extra_links = (ElasticJobLink(),)

    def __init__(
        self,
        *,
        command: str,
        total_steps: int,
        min_gpus: int = 1,
        max_gpus: int | None = None,
        requested_gpus: int | None = None,
        progress_pattern: str | None = None,
        checkpoint_dir: str | None = None,
        gpu_pool: str = DEFAULT_POOL,
        priority: int = 0,
        backend: str = "local",
        env: dict[str, str] | None = None,
        broker_conn_id: str = GpuBrokerHook.default_conn_name,
        poll_interval: float = 5.0,
        deferrable: bool = True,
        virtual_gpus: int | None = None,
        job_name: str | None = None,
        image: str | None = None,
        kubernetes: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        max_gpus = min_gpus if max_gpus is None else max_gpus
        for name, value in (("min_gpus", min_gpus), ("max_gpus", max_gpus), ("total_steps", total_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AirflowException(f"{self.task_id}: {name} must be an integer >= 1, got {value!r}")
        if min_gpus > max_gpus:
            raise AirflowException(f"{self.task_id}: min_gpus ({min_gpus}) must not be larger than "
                                   f"max_gpus ({max_gpus})")
        if backend not in BACKENDS:
            raise AirflowException(f"{self.task_id}: backend must be one of {BACKENDS}, got {backend!r}")
        if poll_interval <= 0:
            raise AirflowException(f"{self.task_id}: poll_interval must be > 0 seconds, got {poll_interval}")
        try:
            compile_progress_pattern(progress_pattern)
        except BrokerError as exc:
            raise AirflowException(f"{self.task_id}: {exc}") from None
        self.kubernetes: dict[str, Any] | None = None
        if backend == "kubernetes":
            from airflow_elastic_gpu.backends.kubernetes import KubernetesJobConfig

            try:
                self.kubernetes = KubernetesJobConfig(image=image or "", **(kubernetes or {})).to_dict()
            except (BackendError, TypeError) as exc:
                raise AirflowException(f"{self.task_id}: {exc}") from None
        elif image or kubernetes:
            raise AirflowException(f"{self.task_id}: image and kubernetes apply to backend='kubernetes' only")
        self.command = command
        self.total_steps = total_steps
        self.min_gpus = min_gpus
        self.max_gpus = max_gpus
        self.requested_gpus = requested_gpus
        self.progress_pattern = progress_pattern
        self.checkpoint_dir = checkpoint_dir
        self.gpu_pool = gpu_pool
        self.priority = priority
        self.backend = backend
        self.env = env or {}
        self.broker_conn_id = broker_conn_id
        self.poll_interval = poll_interval
        self.deferrable = deferrable
        self.virtual_gpus = virtual_gpus
        self.job_name = job_name
        self._job_id: str | None = None

    # -- helpers
    def _hook(self) -> GpuBrokerHook:
        return GpuBrokerHook(self.broker_conn_id)

    def _backend(self, url: str):
        if self.backend == "kubernetes":
            from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend, KubernetesJobConfig

            return KubernetesBackend(KubernetesJobConfig.from_dict(self.kubernetes or {}), GpuBroker(url, migrate=False))
        return get_backend(self.backend, broker_url=url, work_dir=default_work_dir())

    def _ensure_local_pool(self, broker: GpuBroker) -> None:
        if self.backend == "local" and self.gpu_pool not in broker.pools():
            found = detect_gpus(self.virtual_gpus)
            broker.register_node(LOCAL_NODE, pool=self.gpu_pool, gpu_type=found.gpu_type,
                                 gpu_indices=found.indices)
            self.log.info("registered %d %sGPU(s) of this host in pool %r", len(found.indices),
                          "virtual " if found.virtual else "", self.gpu_pool)

    @staticmethod
    def job_key(context: Any) -> str:
        ti = context["ti"]
        return f"{ti.dag_id}/{ti.task_id}/{ti.run_id}/{ti.map_index}"

    # -- Airflow entry points
    def execute(self, context: Any) -> dict[str, Any] | None:
        hook = self._hook()
        url = hook.get_url()
        broker = GpuBroker(url)
        self._ensure_local_pool(broker)
        backend = self._backend(url)
        try:
            if self.backend == "kubernetes":
                largest = max((len(n.gpus) for n in broker.nodes(self.gpu_pool) if n.schedulable), default=0)
                if self.max_gpus > largest:
                    raise BackendError(
                        f"max_gpus={self.max_gpus} is larger than any node of pool {self.gpu_pool!r} "
                        f"({largest} GPUs): one pod per node is not supported yet")
            backend.check_command(self.command)
            backend.check_checkpoint_dir(self.checkpoint_dir)
            ti = context["ti"]
            job = broker.submit(JobSpec(
                name=self.job_name or (self.task_id if ti.map_index < 0 else f"{self.task_id}[{ti.map_index}]"),
                command=self.command, min_gpus=self.min_gpus, max_gpus=self.max_gpus,
                requested_gpus=self.requested_gpus, total_steps=self.total_steps, key=self.job_key(context),
                pool=self.gpu_pool, priority=self.priority, progress_pattern=self.progress_pattern,
                checkpoint_dir=self.checkpoint_dir, backend=self.backend,
            ))
            self._job_id = job.id
            if self.backend == "kubernetes":
                ref = backend.start(job.id, self.command, progress_pattern=self.progress_pattern,
                                    checkpoint_dir=self.checkpoint_dir, env=self.env,
                                    context={"dag_id": ti.dag_id, "task_id": ti.task_id, "run_id": ti.run_id,
                                             "map_index": str(ti.map_index)})
                broker.start(job.id, ref)
                self.log.info("job %s: token Secret and (once placed) pod in namespace %s", job.id,
                              backend.config.namespace)
            elif backend.is_running(job.id):
                self.log.info("reattached to running job %s", job.id)
            else:
                handle = backend.start(job.id, self.command, progress_pattern=self.progress_pattern,
                                       checkpoint_dir=self.checkpoint_dir, env=self.env)
                broker.start(job.id, handle.to_ref())
                self.log.info("started job %s (%d-%d GPUs, %d steps); files in %s", job.id, self.min_gpus,
                              self.max_gpus, self.total_steps, handle.job_dir)
        except (BrokerError, BackendError) as exc:
            raise AirflowException(f"{self.task_id}: {exc}") from None
        ti.xcom_push(key="job_id", value=job.id)
        trigger = ElasticTrainingTrigger(job.id, self.broker_conn_id, self.poll_interval, self.backend,
                                         str(default_work_dir()), kubernetes=self.kubernetes,
                                         env=self.env or None)
        if self.deferrable:
            self.defer(trigger=trigger, method_name="execute_complete")
        while not broker.job(job.id).status.terminal:  # non-deferrable: poll here
            trigger._poll(0)
            time.sleep(self.poll_interval)
        view = broker.job(job.id)
        return self.execute_complete(context, {"job_id": view.id, "status": view.status.value})

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        url = self._hook().get_url()
        broker = GpuBroker(url, migrate=False)
        job = broker.job(event["job_id"])
        for e in broker.events(job_id=job.id):
            if e.kind in ("start", "resize"):
                self.log.info("[%s] %s", e.kind, e.message)
        if job.status is not JobStatus.SUCCEEDED:
            raise AirflowException(f"training job {job.id} {job.status.value}: {job.reason}")
        result = self.metrics(job)
        self.log.info("job %s succeeded: %s", job.id, result)
        return result

    @staticmethod
    def metrics(job: JobView) -> dict[str, Any]:
        """The XCom result: JCT, queueing delay and GPU-seconds (s), resizes, final step, exit code, trainer metrics."""
        extra = {k: v for k, v in (job.metrics or {}).items() if k not in ("final", "step")}
        return {"job_id": job.id, "jct_s": job.jct_s, "queueing_delay_s": job.queueing_delay_s,
                "gpu_seconds": job.gpu_seconds, "num_resizes": job.num_resizes, "final_step": job.steps_done,
                "exit_code": job.exit_code, **extra}

    def on_kill(self) -> None:
        if self._job_id is None:
            return
        url = self._hook().get_url()
        GpuBroker(url, migrate=False).cancel(self._job_id, "task killed")
        self._backend(url).stop(self._job_id, timeout_s=30)
