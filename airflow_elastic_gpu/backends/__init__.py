"""Where a job's processes run: ``local`` (this host) or ``kubernetes`` (a pod per job, see
:mod:`airflow_elastic_gpu.backends.kubernetes`, built by the operator from its pod settings)."""

from __future__ import annotations

from pathlib import Path

from airflow_elastic_gpu.backends.local import BackendError, LocalBackend

BACKENDS = ("local", "kubernetes")


def get_backend(name: str, *, broker_url: str, work_dir: str | Path) -> LocalBackend:
    """The backend called ``name``.

    :raises BackendError: an unknown name, or a backend not available in this release.
    """
    if name == "local":
        return LocalBackend(work_dir, broker_url)
    if name == "kubernetes":
        raise BackendError(
            "backend='kubernetes' needs pod settings: use ElasticTrainingOperator(backend='kubernetes', "
            "image=..., kubernetes={...}) or KubernetesBackend(KubernetesJobConfig(...), broker)"
        )
    raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
