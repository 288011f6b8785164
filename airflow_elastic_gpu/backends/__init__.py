"""Where a job's processes run: ``local`` (this host) or ``kubernetes`` (a pod per job). The
operator and the trigger see them only through :class:`~airflow_elastic_gpu.backends.base.Backend`,
built by :func:`~airflow_elastic_gpu.backends.base.make_backend`."""

from airflow_elastic_gpu.backends.base import (
    BACKENDS,
    Backend,
    BackendError,
    Problem,
    backend_settings,
    make_backend,
)

__all__ = ["BACKENDS", "Backend", "BackendError", "Problem", "backend_settings", "make_backend"]
