"""Where a job's processes run: ``local`` (this host) now; ``kubernetes`` plugs in behind the same calls."""

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
            "backend='kubernetes' is not available in this release yet; use backend='local'"
        )
    raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
