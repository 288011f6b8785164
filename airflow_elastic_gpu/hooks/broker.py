"""GpuBrokerHook: the Airflow connection to the GPU broker's own database.

Airflow 3 tasks may not use Airflow's metadata DB, so the broker has its own.
Its SQLAlchemy URL is read, in order, from:

1. the Airflow connection ``broker_conn_id`` (default ``elastic_gpu_default``,
   type ``elastic_gpu``): its ``extra`` ``{"url": "postgresql+psycopg://..."}``,
   or its host field holding the URL;
2. :func:`airflow_elastic_gpu.config.default_broker_url`: ``$AIRFLOW_ELASTIC_GPU_BROKER_URL``,
   else a SQLite file ``elastic_gpu_broker.db`` in ``$AIRFLOW_HOME``.

The hook owns one broker client (:attr:`GpuBrokerHook.broker`, made on first use, which creates or
migrates the schema), as ``KubernetesHook`` owns its API clients.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from airflow.sdk.bases.hook import BaseHook

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.config import default_broker_url


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

    @cached_property
    def broker(self) -> GpuBroker:
        """This hook's broker client, made on first use (the schema is created or migrated then).

        :raises ValueError: a malformed URL or a missing database driver.
        """
        return GpuBroker(self.get_url())

    def get_conn(self) -> GpuBroker:
        """:attr:`broker` (the same client on every call)."""
        return self.broker
