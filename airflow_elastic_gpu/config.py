"""Where things live by default: the one place that computes the broker URL and the job directory.

Every entry point (CLI, operator, trigger, hook, API server, demo) asks these functions, so a job
started by one is found by the others.

========================  ==============================================  ===========================
setting                   environment variable                            default
========================  ==============================================  ===========================
Airflow home              ``AIRFLOW_HOME``                                ``~/airflow``
broker database URL       ``AIRFLOW_ELASTIC_GPU_BROKER_URL``              ``sqlite:///<home>/elastic_gpu_broker.db``
local job directories     ``AIRFLOW_ELASTIC_GPU_WORK_DIR``                ``<home>/elastic_gpu_jobs``
========================  ==============================================  ===========================
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

ENV_BROKER_URL = "AIRFLOW_ELASTIC_GPU_BROKER_URL"
ENV_WORK_DIR = "AIRFLOW_ELASTIC_GPU_WORK_DIR"


def airflow_home(environ: Mapping[str, str] = os.environ) -> Path:
    """``$AIRFLOW_HOME``, else ``~/airflow`` (Airflow's own default).

    :param environ: the environment to read (default this process's; the demo passes the one it
        gives Airflow).
    """
    return Path(environ.get("AIRFLOW_HOME") or Path.home() / "airflow").expanduser()


def default_broker_url(environ: Mapping[str, str] = os.environ) -> str:
    """``$AIRFLOW_ELASTIC_GPU_BROKER_URL``, else a SQLite file ``elastic_gpu_broker.db`` in :func:`airflow_home`."""
    return environ.get(ENV_BROKER_URL) or f"sqlite:///{airflow_home(environ) / 'elastic_gpu_broker.db'}"


def default_work_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Parent of the local backend's job directories: ``$AIRFLOW_ELASTIC_GPU_WORK_DIR``, else
    ``elastic_gpu_jobs`` in :func:`airflow_home`."""
    return Path(environ.get(ENV_WORK_DIR) or airflow_home(environ) / "elastic_gpu_jobs").expanduser()


def mask_url(url: str) -> str:
    """``url`` fit to print or log: its password replaced by ``***`` (SQLAlchemy's
    ``render_as_string(hide_password=True)``; a URL SQLAlchemy cannot parse loses everything between
    ``://`` and the last ``@``)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError, TypeError):
        return re.sub(r"(?<=://).*@", "***@", str(url), flags=re.DOTALL)
