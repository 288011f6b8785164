"""What the operator and the trigger ask of a backend (the :class:`Backend` protocol), the one
factory that builds a backend by name, and the error every backend raises.

A backend is where a job's processes run: ``local`` (this host, see
:mod:`airflow_elastic_gpu.backends.local`) or ``kubernetes`` (a pod per job, see
:mod:`airflow_elastic_gpu.backends.kubernetes`). The broker decides which GPUs a job gets; the
backend only starts, watches and stops the processes that use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from airflow_elastic_gpu.broker.types import JobView

if TYPE_CHECKING:
    from airflow_elastic_gpu.broker.service import GpuBroker

BACKENDS = ("local", "kubernetes")


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
    """

    reason: str
    gone: bool = False


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
    from airflow_elastic_gpu.backends.kubernetes import KubernetesJobConfig

    try:
        return KubernetesJobConfig(image=image or "", **(kubernetes or {})).to_dict()
    except TypeError as exc:  # an unknown field
        raise BackendError(f"bad kubernetes settings: {exc}") from None


def make_backend(name: str, *, broker: GpuBroker, work_dir: str | Path | None = None,
                 kubernetes: Mapping[str, Any] | None = None, virtual_gpus: int | None = None) -> Backend:
    """The backend called ``name``, for jobs of ``broker``.

    :param work_dir: ``local``: parent of the job directories (default
        :func:`~airflow_elastic_gpu.config.default_work_dir`).
    :param kubernetes: ``kubernetes``: the settings :func:`backend_settings` returned.
    :param virtual_gpus: ``local``: GPUs to register on a host without any (default
        ``$AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS`` or 4).
    :raises BackendError: an unknown backend, or missing or bad Kubernetes settings.
    """
    if name == "local":
        from airflow_elastic_gpu.backends.local import LocalBackend
        from airflow_elastic_gpu.config import default_work_dir

        return LocalBackend(work_dir or default_work_dir(), broker, virtual_gpus=virtual_gpus)
    if name == "kubernetes":
        from airflow_elastic_gpu.backends.kubernetes import KubernetesBackend, KubernetesJobConfig

        if not kubernetes:
            raise BackendError("backend='kubernetes' needs pod settings: ElasticTrainingOperator("
                               "backend='kubernetes', image=..., kubernetes={...})")
        return KubernetesBackend(KubernetesJobConfig.from_dict(dict(kubernetes)), broker)
    raise BackendError(f"backend must be one of {BACKENDS}, got {name!r}")
