"""The provider's metadata for Airflow's ProvidersManager: modules, connection form, config section.

Written like the ``get_provider_info`` of the ``apache-airflow-providers-*`` packages (their
``provider.yaml`` as a dict). It imports only the standard library and
:mod:`airflow_elastic_gpu.config`: Airflow reads it in every process that lists providers.
"""

from __future__ import annotations

from typing import Any

from airflow_elastic_gpu.config import provider_config

CONN_TYPE = "elastic_gpu"
INTEGRATION = "Elastic GPU"

#: The connection form's own fields (keys of the connection's extra): label, JSON schema,
#: description. Airflow >= 3.2 reads them from ``conn-fields`` below; 3.1 from
#: ``GpuBrokerHook.get_connection_form_widgets``.
CONN_FIELDS: dict[str, dict[str, Any]] = {
    "url": {"label": "Broker database URL",
            "schema": {"type": ["string", "null"], "format": "password"},
            "description": "SQLAlchemy URL of the broker's database, e.g. "
                           "postgresql+psycopg://user:password@db:5432/broker. Empty: "
                           "[elastic_gpu] broker_url, else SQLite in $AIRFLOW_HOME."},
    "pool": {"label": "Default GPU pool",
             "schema": {"type": ["string", "null"]},
             "description": "GPU pool of trainings that name none (default: [elastic_gpu] default_pool)."},
    "api_url": {"label": "Broker API URL",
                "schema": {"type": ["string", "null"]},
                "description": "The broker's HTTP API as seen from training pods (backend='kubernetes'), "
                               "e.g. http://elastic-gpu-broker:8793."},
}
#: The standard fields the form hides: everything lives in the fields above.
HIDDEN_FIELDS = ["host", "schema", "login", "password", "port", "extra"]


def get_provider_info() -> dict[str, Any]:
    """Provider metadata read by Airflow's ProvidersManager (``apache_airflow_provider`` entry point)."""
    from airflow_elastic_gpu import __version__

    return {
        "package-name": "airflow-elastic-gpu",
        "name": INTEGRATION,
        "description": "Deferrable training operators that share a GPU pool through a broker which "
        "resizes running jobs (stop-and-restart sidecar).\n",
        "versions": [__version__],
        "integrations": [{
            "integration-name": INTEGRATION,
            "external-doc-url": "https://doi.org/10.1109/SC41405.2020.00094",
            "tags": ["software"],
        }],
        "operators": [{"integration-name": INTEGRATION,
                       "python-modules": ["airflow_elastic_gpu.operators.training"]}],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": ["airflow_elastic_gpu.hooks.broker"]}],
        "triggers": [{"integration-name": INTEGRATION,
                      "python-modules": ["airflow_elastic_gpu.triggers.training"]}],
        "extra-links": ["airflow_elastic_gpu.links.job.ElasticJobLink"],
        "connection-types": [{
            "hook-class-name": "airflow_elastic_gpu.hooks.broker.GpuBrokerHook",
            "hook-name": "Elastic GPU broker",
            "connection-type": CONN_TYPE,
            "conn-fields": CONN_FIELDS,
            "ui-field-behaviour": {"hidden-fields": list(HIDDEN_FIELDS)},
        }],
        "config": provider_config(),
    }
