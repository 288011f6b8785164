"""GpuBrokerHook: the Airflow connection to the GPU broker's own database.

Airflow 3 tasks may not use Airflow's metadata DB, so the broker has its own.
Its SQLAlchemy URL is read, in order, from:

1. the Airflow connection ``broker_conn_id`` (default ``elastic_gpu_default``,
   type ``elastic_gpu``): its ``extra`` ``{"url": "postgresql+psycopg://..."}``,
   or its host field holding the URL;
2. ``$AIRFLOW_ELASTIC_GPU_BROKER_URL``;
3. a SQLite file ``$AIRFLOW_HOME/elastic_gpu_broker.db``.

The schema is created or migrated (Alembic) on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from airflow.sdk.bases.hook import BaseHook

from airflow_elastic_gpu.broker.db import default_broker_url
from airflow_elastic_gpu.broker.service import GpuBroker

ENV_WORK_DIR = "AIRFLOW_ELASTIC_GPU_WORK_DIR"


class GpuBrokerHook(BaseHook):
    """Gives operators and triggers a :class:`GpuBroker` for a connection id.

    :param broker_conn_id: Airflow connection id; a missing connection falls back
        to the environment variable, then to the SQLite default.
    """

    conn_name_attr = "broker_conn_id"
    default_conn_name = "elastic_gpu_default"
    conn_type = "elastic_gpu"
    hook_name = "Elastic GPU broker"

    def __init__(self, broker_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.broker_conn_id = broker_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema", "login", "password", "port"],
            "relabeling": {"host": "Broker database URL"},
            "placeholders": {"host": "postgresql+psycopg://user:password@db:5432/broker",
                             "extra": '{"url": "sqlite:////path/broker.db"}'},
        }

    def get_url(self) -> str:
        """The broker DB URL (see the module docstring for the order of sources)."""
        try:
            conn = self.get_connection(self.broker_conn_id)
        except Exception:  # noqa: BLE001 - AirflowNotFoundException and friends: fall back
            conn = None
        if conn is not None:
            url = (conn.extra_dejson or {}).get("url") or conn.host
            if url:
                return url
        return default_broker_url()

    def get_conn(self) -> GpuBroker:
        return GpuBroker(self.get_url())

    get_broker = get_conn

    @staticmethod
    def work_dir() -> Path:
        """Where the local backend keeps job directories (``$AIRFLOW_ELASTIC_GPU_WORK_DIR``)."""
        default = Path(os.environ.get("AIRFLOW_HOME", Path.home() / "airflow")) / "elastic_gpu_jobs"
        return Path(os.environ.get(ENV_WORK_DIR, default))
