"""ElasticTrainingOperator: run one DL training as an elastic job on the shared GPU pool.

Like ``KubernetesPodOperator(deferrable=True)``, the operator only orchestrates: it submits the job
to the broker (idempotent on the task instance's ids and deployment, so a retry or a worker crash
never creates a second job for the same try), starts its processes through the backend, and defers
to :class:`ElasticTrainingTrigger`, freeing the worker slot while the broker resizes the job.
``execute_complete`` logs the job's resizes, attaches the job's figures to the events of the task's
outlet assets, and returns its metrics to XCom, or raises with the broker's reason. With
``deferrable=False`` it waits in the worker, polling the same
:class:`~airflow_elastic_gpu.triggers.watcher.JobWatcher` as the trigger. With
``start_from_trigger=True`` the task does not take a worker slot to start: the triggerer submits and
starts the job (:func:`~airflow_elastic_gpu.triggers.submit.submit_and_start`), and a worker only
runs ``execute_complete``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from airflow_elastic_gpu.backends import Backend, BackendError, backend_settings, make_backend
from airflow_elastic_gpu.backends.base import check_env
from airflow_elastic_gpu.backends.kubernetes_config import with_pod_template_read
from airflow_elastic_gpu.broker.types import (
    DEFAULT_POOL,
    MAX_NAME_CHARS,
    BrokerError,
    JobSpec,
    JobView,
    NotFound,
    check_int,
    check_pool_name,
    check_text,
    task_family,
)
from airflow_elastic_gpu.compat import (
    AirflowException,
    AirflowFailException,
    Asset,
    BaseOperator,
    StartTriggerArgs,
    TaskDeferred,
    resolved_later,
)
from airflow_elastic_gpu.config import (
    airflow_conf,
    default_deferrable,
    default_poll_interval_s,
    default_work_dir,
)
from airflow_elastic_gpu.hooks.broker import GpuBrokerHook
from airflow_elastic_gpu.links.job import ElasticJobLink
from airflow_elastic_gpu.operators import results
from airflow_elastic_gpu.operators.checks import check_modes, rendered_later
from airflow_elastic_gpu.states import PUBLISH_KINDS, JobStatus
from airflow_elastic_gpu.triggers.orphans import check_orphans
from airflow_elastic_gpu.triggers.submit import submit_and_start
from airflow_elastic_gpu.triggers.task_instance import (
    attempt_of,
    clear_number_of,
    job_name_of,
    max_tries_of,
    task_key,
    will_retry,
)
from airflow_elastic_gpu.triggers.training import (
    KILLED_REASON,
    TIMEOUT_CANCEL,
    TIMEOUT_REASON,
    TRIGGER_CLASSPATH,
    ElasticTrainingTrigger,
)
from airflow_elastic_gpu.triggers.watcher import CleanupFailed, JobWatcher


class ElasticTrainingOperator(BaseOperator):
    """Run ``command`` as an elastic training job whose GPU count the broker changes while it runs.

    :param command: training command (templated); ``{num_gpus}`` is replaced at each (re)start,
        e.g. ``torchrun --nproc_per_node={num_gpus} train.py``. It must resume from
        ``$ELASTIC_CHECKPOINT_DIR``.
    :param total_steps: steps of the whole training (>= 1), to predict remaining time.
    :param min_gpus: fewest GPUs it runs on (>= 1).
    :param max_gpus: most GPUs it can use (default ``min_gpus``: not elastic).
    :param requested_gpus: the fixed request used by non-elastic policies (default ``max_gpus``);
        the adaptive policy spreads a job not yet measured on a whole node over no more nodes
        than this needs (a smaller request keeps it on one node until measured there).
    :param progress_pattern: regex with group ``step`` for progress lines; default JSON lines with ``"step"``.
    :param checkpoint_dir: where the trainer checkpoints (checked at submit); default a per-job dir.
    :param gpu_pool: broker GPU pool name; default the broker connection's *Default GPU pool*, else
        ``[elastic_gpu] default_pool`` (``"default"``).
    :param priority: larger is served first by the broker.
    :param preemptible: the job may be suspended (resized to zero GPUs: checkpoint, stop, keep its
        place) to start shorter jobs, when its GPU pool allows suspension (the pool's policy
        parameter ``suspend``); it resumes from its checkpoint. Off by default.
    :param backend: ``"local"`` (processes on this host) or ``"kubernetes"`` (a pod per job with the
        sidecar; needs ``image`` and the ``kubernetes`` settings, see :class:`KubernetesJobConfig`).
    :param image: the training image (``backend="kubernetes"``).
    :param kubernetes: pod settings for ``backend="kubernetes"`` (any field of
        :class:`~airflow_elastic_gpu.backends.kubernetes.KubernetesJobConfig`: ``namespace``,
        ``resize_mechanism`` ("inplace" or "recreate"), ``on_finish_action``, ``pod_template_file``,
        ``full_pod_spec``, ``image_pull_secrets``, ``container_resources``, ``tolerations``, ``volumes``,
        ``volume_mounts``, ``broker_api_url``, ``agent_image``, ``kubernetes_conn_id``...). Without
        ``broker_api_url`` the connection's *Broker API URL* is used, else ``[elastic_gpu]
        broker_api_url``.
    :param env: extra environment variables for the trainer (templated): a dict of strings. The
        trainer does not inherit the worker's Airflow configuration, connections, variables or
        broker URL; pass what it needs here.
    :param broker_conn_id: Airflow connection of the broker.
    :param poll_interval: seconds between polls of the job (the trigger's, or the worker's); default
        ``[elastic_gpu] poll_interval`` (5).
    :param deferrable: defer to the triggerer; False waits in the worker, with the same job watcher
        as the trigger. Default ``[elastic_gpu] default_deferrable`` (true: Airflow's own
        ``[operators] default_deferrable`` is false out of the box, and a training would hold a
        worker slot for its whole length). Airflow does not enforce ``execution_timeout`` while a
        task is deferred; the trigger does: past it (counted from the start of this try), the job
        is cancelled and the task fails (and is retried as on Airflow's own timeout).
    :param start_from_trigger: submit and start the job from the triggerer, so the task takes a
        worker slot only for ``execute_complete`` (needs ``deferrable``; a mapped task starts from a
        worker all the same, as its mapped arguments are only known there).
    :param virtual_gpus: for the local backend on a host without GPUs, the pool size to register
        when the pool does not exist yet (>= 1); default ``[elastic_gpu] virtual_gpus`` (4); per node
        with ``virtual_nodes``.
    :param virtual_nodes: for the local backend on a host without GPUs, split the new pool into this
        many virtual nodes of ``virtual_gpus`` each (>= 1, default 1); a training larger than a node
        then runs as a gang, one launcher per node (its command uses ``{nnodes}``, ``{node_rank}``,
        ``{master_addr}`` and ``{master_port}``).
    :param relative_speed: optional, for pools of several GPU types: GPU type -> the job's relative
        single-GPU speed there (a prior for types it has not run on; only ratios count).
    :param job_name: the job's name in the broker, the UI and the CLI (templated); default the task
        id, with ``[map_index]`` for a mapped task. Whatever the name, the jobs of one task form one
        family, ``dag_id.task_id``: until a job is measured, the broker assumes it runs as fast as
        the task's running or latest finished job (the prior that ranks it among waiting jobs).
    :param outlets: as for any operator; each outlet :class:`~airflow.sdk.Asset` (e.g. the trained
        model or its checkpoint directory) gets an asset event whose ``extra`` holds the job's
        figures (:meth:`asset_metadata`), so a DAG scheduled on the asset can pick the best model.
    :raises AirflowFailException: a bad argument (no retry: at DAG parse time, or as a mapped task unmaps).
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
        gpu_pool: str | None = None,
        priority: int = 0,
        preemptible: bool = False,
        backend: str = "local",
        env: dict[str, str] | None = None,
        broker_conn_id: str = GpuBrokerHook.default_conn_name,
        poll_interval: float | None = None,
        deferrable: bool | None = None,
        start_from_trigger: bool = False,
        virtual_gpus: int | None = None,
        virtual_nodes: int = 1,
        relative_speed: dict[str, float] | None = None,
        job_name: str | None = None,
        image: str | None = None,
        kubernetes: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        try:
            conf = airflow_conf()
            if poll_interval is None:
                poll_interval = default_poll_interval_s(conf=conf)
            if deferrable is None:
                deferrable = default_deferrable(conf=conf)
        except ValueError as exc:
            raise AirflowFailException(f"{self.task_id}: {exc}") from None
        check_modes(self.task_id, poll_interval=poll_interval, deferrable=deferrable, start_from_trigger=start_from_trigger,
                    trigger_fields={"command": command, "env": env, "checkpoint_dir": checkpoint_dir, "job_name": job_name})
        try:
            if gpu_pool is not None:  # named as the argument the user wrote (JobSpec's field is pool)
                check_pool_name("gpu_pool", gpu_pool)
            if job_name is not None and not resolved_later(job_name):  # named as the argument (JobSpec's is name)
                check_text("job_name", job_name, MAX_NAME_CHARS)
            # template fields given an upstream task's output (XComArg) are known only when the task
            # runs: checked then (execute, or the trigger's submit), here a stand-in of the right type
            spec = JobSpec(  # the one validation of a job's fields, also run by the broker at submit
                name=self.task_id if job_name is None or resolved_later(job_name) else job_name,
                command="resolved when the task runs" if rendered_later(command) else command,
                min_gpus=min_gpus, max_gpus=max_gpus,
                total_steps=total_steps, requested_gpus=requested_gpus,
                pool=DEFAULT_POOL if gpu_pool is None else gpu_pool, priority=priority,
                progress_pattern=progress_pattern, checkpoint_dir=None if rendered_later(checkpoint_dir) else checkpoint_dir,
                backend=backend, preemptible=preemptible, relative_speed=relative_speed,
            )
            self.kubernetes = backend_settings(backend, image=image, kubernetes=kubernetes)
            if virtual_gpus is not None:
                check_int("virtual_gpus", virtual_gpus, 1)
            check_int("virtual_nodes", virtual_nodes, 1)
            if not resolved_later(env):  # a value from an upstream task's output: checked when the task runs
                checked = check_env({k: v for k, v in env.items() if not resolved_later(v)}
                                    if isinstance(env, Mapping) else env)
                env = {**checked, **{k: v for k, v in env.items() if resolved_later(v)}} if env else checked
        except (BrokerError, BackendError) as exc:
            raise AirflowFailException(f"{self.task_id}: {exc}") from None
        max_gpus = spec.max_gpus
        self.command = command
        self.total_steps = total_steps
        self.min_gpus = min_gpus
        self.max_gpus = max_gpus
        self.requested_gpus = requested_gpus
        self.progress_pattern = progress_pattern
        self.checkpoint_dir = checkpoint_dir
        self.gpu_pool = gpu_pool
        self.priority = priority
        self.preemptible = preemptible
        self.backend = backend
        self.env = env or {}
        self.broker_conn_id = broker_conn_id
        self.poll_interval = poll_interval
        self.deferrable = deferrable
        self.virtual_gpus = virtual_gpus
        self.virtual_nodes = virtual_nodes
        self.relative_speed = spec.relative_speed
        self.job_name = job_name
        self.broker_api_url_given = bool(kubernetes and "broker_api_url" in kubernetes)
        self.start_from_trigger = start_from_trigger
        if start_from_trigger:
            self.start_trigger_args = StartTriggerArgs(
                trigger_cls=TRIGGER_CLASSPATH, next_method="execute_complete",
                trigger_kwargs=self._trigger_kwargs(job_id=None, labels=None))
        self._job_id: str | None = None
        self._attempt: str | None = None  # this task try's id (JobSpec.attempt), once it runs

    # -- helpers
    @cached_property
    def hook(self) -> GpuBrokerHook:
        """The hook, and through it the one broker client, of this run of the task."""
        return GpuBrokerHook(self.broker_conn_id)

    def _make_backend(self) -> Backend:
        return make_backend(self.backend, broker=self.hook.broker, work_dir=default_work_dir(conf=airflow_conf()),
                            kubernetes=self._kubernetes_settings(), virtual_gpus=self.virtual_gpus,
                            virtual_nodes=self.virtual_nodes)

    def _kubernetes_settings(self) -> dict[str, Any] | None:
        """The pod settings, with the connection's (or the config's) broker API URL unless the
        operator gave one, and the pod template file read here (the triggerer may not have it)."""
        if self.kubernetes is None:
            return None
        url = None if self.broker_api_url_given else self.hook.broker_api_url()
        return {**with_pod_template_read(self.kubernetes), **({"broker_api_url": url} if url else {})}

    def _trigger_kwargs(self, *, job_id: str | None, labels: dict[str, str] | None,
                        deadline_s: float | None = None) -> dict[str, Any]:
        """The trigger's arguments. Without ``job_id`` (``start_from_trigger``) they describe the job
        to submit; ``command``, ``env``, ``checkpoint_dir`` and ``job_name`` are rendered in the
        triggerer (the operator's template fields that are trigger arguments)."""
        kwargs: dict[str, Any] = {
            "job_id": job_id, "broker_conn_id": self.broker_conn_id, "poll_interval": self.poll_interval,
            "backend": self.backend, "work_dir": None, "kubernetes": self.kubernetes,
            "env": self.env or None, "context": labels,
        }
        if job_id is not None:
            kwargs["deadline_s"] = deadline_s  # Airflow does not enforce execution_timeout while deferred
            kwargs["work_dir"] = str(default_work_dir(conf=airflow_conf()))
            kwargs["kubernetes"] = self._kubernetes_settings()
            return kwargs
        return {**kwargs, "command": self.command, "checkpoint_dir": self.checkpoint_dir,
                "job_name": self.job_name, "job": {
                    "total_steps": self.total_steps, "min_gpus": self.min_gpus, "max_gpus": self.max_gpus,
                    "requested_gpus": self.requested_gpus, "progress_pattern": self.progress_pattern,
                    "gpu_pool": self.gpu_pool, "priority": self.priority, "preemptible": self.preemptible,
                    "virtual_gpus": self.virtual_gpus, "virtual_nodes": self.virtual_nodes,
                    "relative_speed": self.relative_speed,
                    "broker_api_url_given": self.broker_api_url_given}}

    @staticmethod
    def task_labels(context: Any) -> dict[str, str]:
        """The task instance's ``dag_id``, ``task_id``, ``run_id`` and ``map_index``, for the backend."""
        ti = context["ti"]
        return {"dag_id": ti.dag_id, "task_id": ti.task_id, "run_id": ti.run_id,
                "map_index": str(ti.map_index)}

    # -- Airflow entry points
    def execute(self, context: Any) -> dict[str, Any] | None:
        ti = context["ti"]
        started_s = time.time()  # this try's execution_timeout counts from here, while deferred too
        self._attempt = attempt_of(ti)  # the job is this try's (a cleared task's old trigger leaves it)
        try:
            return self._execute(context, started_s)
        except TaskDeferred:
            raise
        except Exception as exc:
            # Airflow calls no on_kill when execute raises: on the task's last try, nobody would
            # follow the job (a retry reattaches to it), which would hold its GPUs until it ends
            if self._job_id is not None and not will_retry(ti, self, exc, AirflowFailException, context):
                self._stop_after_last_try(exc)
            raise

    def _stop_after_last_try(self, exc: Exception) -> None:
        try:
            if not self.hook.broker.job(self._job_id).status.terminal:
                self.log.error("job %s: cancelled, the task's last try fails (%s)", self._job_id, exc)
                self._stop_job(f"the task's last try failed: {str(exc)[:500]}")
        except Exception as stop_exc:  # noqa: BLE001 - noted on the error raised
            exc.add_note(f"job {self._job_id} could not be cancelled after the task's last try: {stop_exc}")

    def _execute(self, context: Any, started_s: float) -> dict[str, Any] | None:
        ti = context["ti"]
        labels = self.task_labels(context)
        try:  # the connection's pool (or the configuration's): mended there, a retry takes it
            if not (pool := self.gpu_pool):
                check_pool_name("the connection's pool", pool := self.hook.default_pool())
        except BrokerError as exc:
            raise AirflowException(f"{self.task_id}: {exc}") from None
        try:  # the rendered template fields: a retry renders the same values, so it is not retried
            spec = JobSpec(
                name=job_name_of(ti, self.job_name),
                command=self.command, min_gpus=self.min_gpus, max_gpus=self.max_gpus,
                requested_gpus=self.requested_gpus, total_steps=self.total_steps, key=task_key(ti),
                pool=pool, priority=self.priority,
                progress_pattern=self.progress_pattern, checkpoint_dir=self.checkpoint_dir, backend=self.backend,
                preemptible=self.preemptible, relative_speed=self.relative_speed,
                family=task_family(ti.dag_id, ti.task_id), attempt=self._attempt, max_tries=max_tries_of(ti),
                clear_number=clear_number_of(context),
            )
            env = check_env(self.env)
        except (BrokerError, BackendError) as exc:
            raise AirflowFailException(f"{self.task_id}: {exc}") from None
        try:
            broker, backend = self.hook.broker, self._make_backend()
            job = submit_and_start(broker, backend, spec, env=env, labels=labels, log=self.log,
                                   on_submitted=lambda submitted: setattr(self, "_job_id", submitted.id)).job
        except (BrokerError, BackendError) as exc:  # a refusal too: a pool's size changes (a drain ends)
            raise AirflowException(f"{self.task_id}: {exc}") from None
        ElasticJobLink.persist(ti, pool=job.pool, job_id=job.id)
        if self.deferrable:
            deadline_s = started_s + self.execution_timeout.total_seconds() if self.execution_timeout else None
            self.defer(trigger=ElasticTrainingTrigger(**self._trigger_kwargs(job_id=job.id, labels=labels,
                                                                             deadline_s=deadline_s)),
                       method_name="execute_complete")
        return self._wait_in_worker(JobWatcher(broker, backend, job.id, env=self.env, context=labels,
                                               log=self.log), context)

    def _wait_in_worker(self, watcher: JobWatcher, context: Any, deadline_s: float | None = None) -> dict[str, Any]:
        """Poll ``watcher`` every ``poll_interval`` seconds until the job ends: ``deferrable=False``
        (``execution_timeout`` bounds the wait), or a job the triggerer could not follow (Airflow
        restarts the timeout on resume: the job is cancelled at ``deadline_s``, epoch seconds, as the
        trigger would). A poll also checks the pool for jobs no task follows (:func:`.orphans.check_orphans`:
        a worker's wait may be the pool's only one); one that fails (the broker briefly away) is retried.

        :raises AirflowException: the job did not succeed, or the broker no longer has it.
        """
        while True:
            try:
                job, _events = watcher.poll()
            except CleanupFailed as exc:  # the job has ended: its result counts after a few tries
                if not watcher.cleanup_failed(exc):
                    time.sleep(self.poll_interval)
                    continue
                job = exc.job
            except NotFound as exc:  # no retry brings it back
                raise AirflowException(f"{self.task_id}: following job {watcher.job_id} failed: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - the broker DB or the cluster API is briefly unreachable
                self.log.warning("polling job %s failed (%s); retrying in %ss with a new backend client",
                                 watcher.job_id, exc, self.poll_interval)
                time.sleep(self.poll_interval)
                # a new backend client; the broker client replaces a dropped connection itself
                watcher = watcher.renewed(watcher.broker, self._make_backend())
                continue
            if job.status.terminal:
                return self._result(job, context)
            if deadline_s is not None and time.time() >= deadline_s:
                try:  # the next poll reads the job cancelled: retried, as a time-out
                    self._stop_job(TIMEOUT_CANCEL)
                    deadline_s = None  # once (a later try that reattached follows the job on)
                except Exception as exc:  # noqa: BLE001 - the broker briefly away: again at the next poll
                    self.log.warning("could not cancel job %s at the try's deadline (%s)", watcher.job_id, exc)
                    time.sleep(self.poll_interval)
                continue
            check_orphans(watcher.broker, watcher.backend, job.pool)  # as a trigger's poll does
            time.sleep(self.poll_interval)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the trigger fired: log the job's resizes, return its metrics.

        The triggerer cannot follow the job (its broker is not the worker's, or it cannot make its
        broker or backend client): the worker follows it as with ``deferrable=False``, where its
        broker has the job.

        :raises AirflowFailException: the triggerer cannot follow the job and the worker's broker
            cannot be read either (the job is cancelled where it can be and its processes stopped,
            so it holds no GPU that nobody watches), or :meth:`_result`'s.
        :raises AirflowException: the trigger could not start the job (``start_from_trigger``), the
            triggerer could not cancel the job past the task's deadline (the job is cancelled here,
            unless it has ended, a success returned; retried, as a time-out), or the job did not succeed.
        """
        if event.get("job_id") is None:  # a configuration error (retry false) is not retried
            raise (AirflowException if event.get("retry", True) else AirflowFailException)(
                f"{self.task_id}: the triggerer could not start the training: {event.get('reason')}")
        if event.get("status") == "error":
            message = (f"{self.task_id}: the triggerer could not follow training job {event['job_id']}: "
                       f"{event.get('reason')}")
            self._job_id, self._attempt = event["job_id"], attempt_of(context["ti"])
            timed_out = bool(event.get("timed_out"))
            job = self._job_in_worker(event["job_id"])
            if job is not None and (not timed_out or job.status.terminal):  # timed out: one that ended counts
                # the worker's broker has the job: the worker follows it, not throw a healthy training away
                if self.start_from_trigger:  # the triggerer pushes no XCom: the link's job id comes now
                    ElasticJobLink.persist(context["ti"], pool=job.pool, job_id=job.id)
                self.log.warning("%s; %s. Give the triggerer the worker's broker (connection and [elastic_gpu] "
                                 "settings)", message, f"the job has {job.status.value}" if job.status.terminal
                                 else "the worker follows the job until it ends instead")
                return self._wait_in_worker(JobWatcher(self.hook.broker, self._make_backend(), job.id, env=self.env,
                                                       context=self.task_labels(context), log=self.log), context,
                                            deadline_s=event.get("deadline_s"))
            try:  # the worker's broker has the job: no one would watch it, or end it
                self._stop_job(TIMEOUT_CANCEL if timed_out
                               else f"the triggerer could not follow the job: {event.get('reason')}")
            except Exception as exc:  # noqa: BLE001 - the message says what is left
                self.log.warning("could not cancel job %s in the worker's broker (%s)", self._job_id, exc)
            if timed_out:  # retried, as on Airflow's own time-out
                raise AirflowException(message)
            raise AirflowFailException(message)
        broker = self.hook.broker
        job = broker.job(event["job_id"])
        if self.start_from_trigger:  # the triggerer cannot push XCom: the link's job id comes now
            ElasticJobLink.persist(context["ti"], pool=job.pool, job_id=job.id)
        for e in broker.events(job_id=job.id):
            if e.kind in PUBLISH_KINDS:
                self.log.info("[%s] %s", e.kind, e.message)
        return self._result(job, context)

    def _job_in_worker(self, job_id: str) -> JobView | None:
        """``job_id`` as the worker's broker has it, or None when it cannot be read there."""
        try:
            return self.hook.broker.job(job_id)
        except Exception as exc:  # noqa: BLE001 - not the worker's either: the job is ended as before
            self.log.warning("job %s cannot be read in the worker's broker either (%s)", job_id, exc)
            return None

    def _result(self, job: JobView, context: Any) -> dict[str, Any]:
        """:raises AirflowFailException: ``job`` was cancelled, but not by the task's time-out nor
            by this task's ``on_kill`` (a user stopped it: ``airflow-elastic-gpu cancel``): not
            retried.
        :raises AirflowException: ``job`` did not succeed otherwise (the message has the broker's
            reason; the task's ``retries`` apply). A job cancelled by ``on_kill`` is one of them:
            Airflow kills a task when a user marks it failed (its state is then set already), but
            also when its worker shuts down or loses its heartbeats, and then a retry is due.
        """
        if job.status is not JobStatus.SUCCEEDED:
            message = f"{self.task_id}: training job {job.id} {job.status.value}: {job.reason}"
            retried = (TIMEOUT_REASON, KILLED_REASON)
            if job.status is JobStatus.CANCELLED and not (job.reason or "").startswith(retried):
                raise AirflowFailException(message)
            raise AirflowException(message)
        result = self.metrics(job)
        self.log.info("job %s succeeded: %s", job.id, result)
        if warning := job.progress_warning():
            self.log.warning("%s", warning)
        results.annotate_outlets([o for o in (self.outlets or []) if isinstance(o, Asset)], job, context, self.log,
                                 self.asset_metadata)
        return result

    metrics = staticmethod(results.metrics)
    asset_metadata = staticmethod(results.asset_metadata)

    def on_kill(self) -> None:
        """Cancel the job and stop its processes (the job is known from its submission on, while its
        processes start too)."""
        self._stop_job(KILLED_REASON)

    def _stop_job(self, reason: str) -> None:
        """Cancel this try's job with ``reason`` and stop its processes; the stop is tried even when
        the cancel fails (whose error is then raised). A job a later try of the task reattached to
        is left to it."""
        if self._job_id is None:
            return
        try:
            job = self.hook.broker.cancel(self._job_id, reason, attempt=self._attempt)
        except Exception as exc:
            self.log.warning("could not cancel job %s (%s); stopping its processes all the same", self._job_id, exc)
            self._make_backend().stop(self._job_id, timeout_s=30)
            raise
        if not job.status.terminal:
            self.log.info("job %s goes on: a later try of this task follows it now", self._job_id)
            return
        self._make_backend().stop(self._job_id, timeout_s=30)
