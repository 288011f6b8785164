"""What the operator and the trigger ask of a backend (the :class:`Backend` protocol), the one
factory that builds a backend by name, and the error every backend raises.

A backend is where a job's processes run: ``local`` (this host, see
:mod:`airflow_elastic_gpu.backends.local`) or ``kubernetes`` (a pod per job, see
:mod:`airflow_elastic_gpu.backends.kubernetes`). The broker decides which GPUs a job gets; the
backend only starts, watches and stops the processes that use them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from airflow_elastic_gpu.broker.types import JobView

if TYPE_CHECKING:
    from airflow_elastic_gpu.broker.service import GpuBroker

BACKENDS = ("local", "kubernetes")

log = logging.getLogger(__name__)


class BackendError(RuntimeError):
    """The backend could not check, start, find or stop a job's processes; the message says why."""


@dataclass(frozen=True)
class Problem:
    """Why a job cannot go on, as its backend sees it.

    :param reason: a sentence for the job's failure reason (the trainer's last log lines are added).
    :param gone: the job's processes were not found. A process may be between two states (a pod
        being re-created, a trainer that has just exited and whose exit the broker has not recorded
        yet), so the job watcher fails the job only after several polls in a row say so; any
        other problem fails it at once.
    :param node: a gang of pods: the node whose pod is broken (its trainer no longer runs); the
        broker then frees that node's GPUs only, and the other nodes' once their trainers have
        stopped (their agents report it, or the lease passes). None: the job's only pod or process.
    :param running: the trainer may still run (the problem is its agent's: a sidecar whose image
        cannot be pulled): the job is failed with its GPUs held, as after a cancel, until its
        trainer has stopped (the lease passes: the launcher fences it without its agent).
    :param finished: with ``gone``: the trainer had exited cleanly, but its agent is gone without
        reporting it (killed, or it gave up on a broker away for long): the job succeeds, with
        these final metrics (read from its log; ``{}`` when it printed none).
    """

    reason: str
    gone: bool = False
    node: str | None = None
    running: bool = False
    finished: dict[str, Any] | None = None


@runtime_checkable
class Backend(Protocol):
    """The calls the operator, the trigger and ``airflow-elastic-gpu run-local`` make on a backend.

    Every call is synchronous (the trigger runs them in a thread) and may raise
    :class:`BackendError`.
    """

    name: str

    def ensure_pool(self, pool: str) -> str | None:
        """Make sure the broker has GPU pool ``pool`` for this backend's jobs (local: register this
        host's GPUs when the pool does not exist yet). Returns a sentence saying what it
        registered, or ``None`` when there was nothing to do."""
        ...

    def check(self, command: str, checkpoint_dir: str | None) -> None:
        """Fail fast, before a job is submitted, on a command or checkpoint directory that cannot
        work here.

        :raises BackendError: the message names the bad argument.
        """
        ...

    def start(self, job: JobView, *, env: Mapping[str, str] | None = None,
              context: Mapping[str, str] | None = None) -> str:
        """Start ``job``'s processes, or reattach to them when they still run (idempotent).

        :param env: extra environment variables for the trainer.
        :param context: the task's ``dag_id``, ``task_id``, ``run_id`` and ``map_index`` (labels
            of the backend's resources; the local backend has none).
        :returns: the backend reference to store with ``GpuBroker.start``.
        """
        ...

    def is_running(self, job_id: str) -> bool:
        """True while the job's processes (or the pod that will run them) exist."""
        ...

    def sync(self, job: JobView, *, env: Mapping[str, str] | None = None,
             context: Mapping[str, str] | None = None) -> str | None:
        """Make the job's processes match the broker's current target (Kubernetes: create or
        re-create its pod; local: nothing, the agent applies targets itself). ``env`` and
        ``context`` as given to :meth:`start`. Returns what it did, for logs."""
        ...

    def problem(self, job: JobView) -> Problem | None:
        """Why ``job`` (not ended in the broker) cannot go on, or ``None``."""
        ...

    def stop(self, job_id: str, *, succeeded: bool = False, timeout_s: float | None = None) -> None:
        """Stop the job's processes and clean up (idempotent).

        :param succeeded: the job succeeded (Kubernetes: ``on_finish_action`` may keep failed pods).
        :param timeout_s: seconds to wait for a graceful stop before killing; ``None``: the
            backend's default.
        """
        ...

    def log_tail(self, job_id: str, lines: int = 20) -> list[str]:
        """The last ``lines`` lines of the trainer's log (empty when there is none)."""
        ...


def check_env(env: object, what: str = "env") -> dict[str, str]:
    """``env`` as the trainer's extra environment variables, checked before any job is submitted.

    :param env: ``None`` or a mapping of names to values, both strings.
    :param what: the argument's name, for the message.
    :returns: a copy of ``env`` (empty for ``None``).
    :raises BackendError: ``env`` is not a mapping, or a name is empty or holds ``=`` or a NUL
        character, or a value is not a string or holds a NUL character (the message names it).
    """
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise BackendError(f"{what} must be a dict of environment variable names to string values, "
                           f"got {type(env).__name__} {env!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise BackendError(f"{what}: {key!r} is not a valid environment variable name "
                               "(a non-empty string without '=' or NUL)")
        if not isinstance(value, str) or "\0" in value:
            raise BackendError(f"{what}[{key!r}] must be a string without NUL characters, "
                               f"got {type(value).__name__} {value!r}")
    return dict(env)


def start_job(broker: GpuBroker, backend: Backend, job: JobView, *, env: Mapping[str, str] | None = None,
              context: Mapping[str, str] | None = None) -> JobView:
    """Start ``job``'s processes through ``backend`` and record them in ``broker``, so that a job is
    either started or failed, never left holding GPUs with nothing running.

    A job never started before (no backend reference yet) whose start fails is failed at once in the
    broker, with the error as its reason, whatever the backend had started of it is stopped, and its
    GPUs are released once nothing of it runs (:func:`abandon`); the error is then raised. A job that was started before (a retried
    task reattaching) is left as it is: its processes may well be running.

    :param env: extra environment variables for the trainer (see :func:`check_env`).
    :param context: as for :meth:`Backend.start`.
    :returns: the job as the broker records it after the start.
    :raises BackendError: the backend could not start the job (any other error is raised as it is,
        after the job was failed all the same).
    """
    fresh = job.backend_ref is None
    try:
        ref = backend.start(job, env=check_env(env), context=context)
        return broker.start(job.id, ref)  # unrecorded, what was started would run on with nobody to stop it
    except BaseException as exc:  # Ctrl-C, a task's termination too: nothing left holding GPUs unwatched
        if fresh:
            abandon(broker, backend, job.id, exc)
        raise


def abandon(broker: GpuBroker, backend: Backend, job_id: str, error: BaseException) -> None:
    """Fail a job that could not be started (``error`` says why) and stop what was started of it; a
    failure of either step is logged and noted on ``error`` (which the caller raises), never hidden.

    Its GPUs stay held until nothing of it runs any more (the backend's stop reports it, or the
    check after the stop, or else the pool's lease passes): a start may fail after it spawned a
    trainer, which another job's must not meet on the GPUs."""
    reason = f"the {backend.name} backend could not start the job: {str(error) or type(error).__name__}"

    def release() -> None:
        # a backend whose stop frees them itself once nothing of the job runs (the local one: it
        # sees its trainers, which may outlive SIGKILL) is left to do so
        if not getattr(backend, "stop_releases", False) and not backend.is_running(job_id):
            broker.fail(job_id, "nothing of it runs")  # an ended job's held GPUs freed

    for step, call in (("fail the job in the broker", lambda: broker.fail(job_id, reason, hold=True)),
                       ("stop what was started", lambda: backend.stop(job_id, timeout_s=10)),
                       ("free its GPUs", release)):
        try:
            call()
        except Exception as cleanup_exc:  # reported on the error being raised, never hidden
            log.exception("job %s: could not %s after a failed start", job_id, step)
            error.add_note(f"then could not {step}: {cleanup_exc}")


def backend_settings(name: str, *, image: str | None = None,
                     kubernetes: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Check a backend's settings at DAG parse time, before any job exists.

    :param name: one of :data:`BACKENDS`.
    :param image: the training image (``kubernetes`` only).
    :param kubernetes: pod settings (``kubernetes`` only): any field of
        :class:`~airflow_elastic_gpu.backends.kubernetes.KubernetesJobConfig`.
    :returns: the JSON-serializable settings :func:`make_backend` takes as ``kubernetes`` (the
        operator hands them to the trigger), or ``None`` for ``local``.
    :raises BackendError: an unknown backend, settings given to a backend they do not apply to, or
        a bad setting (the message names it).
    """
    if name not in BACKENDS:
        raise BackendError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "local":
        if image or kubernetes:
            raise BackendError("image and kubernetes apply to backend='kubernetes' only")
        return None
    from airflow_elastic_gpu.backends.kubernetes_config import KubernetesJobConfig

    try:
        return KubernetesJobConfig(image=image or "", **(kubernetes or {})).to_dict()
    except TypeError as exc:  # an unknown field
        raise BackendError(f"bad kubernetes settings: {exc}") from None


def make_backend(name: str, *, broker: GpuBroker, work_dir: str | Path | None = None,
                 kubernetes: Mapping[str, Any] | None = None, virtual_gpus: int | None = None,
                 virtual_nodes: int = 1) -> Backend:
    """The backend called ``name``, for jobs of ``broker``.

    :param work_dir: ``local``: parent of the job directories (default
        :func:`~airflow_elastic_gpu.config.default_work_dir`).
    :param kubernetes: ``kubernetes``: the settings :func:`backend_settings` returned.
    :param virtual_gpus: ``local``: GPUs to register on a host without any (default
        ``$AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS`` or 4), per node.
    :param virtual_nodes: ``local``: virtual nodes of ``virtual_gpus`` each (>= 1; jobs larger than
        one run as a gang, see :mod:`airflow_elastic_gpu.sidecar.gang`).
    :raises BackendError: an unknown backend, or missing or bad Kubernetes settings.
    """
    if name == "local":
        from airflow_elastic_gpu.backends.local import LocalBackend
        from airflow_elastic_gpu.config import default_work_dir

        return LocalBackend(work_dir or default_work_dir(), broker, virtual_gpus=virtual_gpus,
                            virtual_nodes=virtual_nodes)
    if name == "kubernetes":
        from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend, KubernetesJobConfig

        if not kubernetes:
            raise BackendError("backend='kubernetes' needs pod settings: ElasticTrainingOperator("
                               "backend='kubernetes', image=..., kubernetes={...})")
        return KubernetesBackend(KubernetesJobConfig.from_dict(dict(kubernetes)), broker)
    raise BackendError(f"backend must be one of {BACKENDS}, got {name!r}")
