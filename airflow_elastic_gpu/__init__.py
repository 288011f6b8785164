"""airflow-elastic-gpu: share GPUs between concurrent DL trainings and resize them while they run."""

__version__ = "0.1.0"


def get_provider_info() -> dict:
    """Provider metadata read by Airflow's ProvidersManager (``apache_airflow_provider`` entry point)."""
    return {
        "package-name": "airflow-elastic-gpu",
        "name": "Elastic GPU",
        "description": "Deferrable training operators that share a GPU pool through a broker which "
        "resizes running jobs (stop-and-restart sidecar).",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Elastic GPU",
                "external-doc-url": "https://doi.org/10.1109/SC41405.2020.00094",
                "tags": ["software"],
            }
        ],
        "operators": [
            {"integration-name": "Elastic GPU",
             "python-modules": ["airflow_elastic_gpu.operators.training"]}
        ],
        "hooks": [
            {"integration-name": "Elastic GPU", "python-modules": ["airflow_elastic_gpu.hooks.broker"]}
        ],
        "triggers": [
            {"integration-name": "Elastic GPU",
             "python-modules": ["airflow_elastic_gpu.triggers.training"]}
        ],
        "extra-links": ["airflow_elastic_gpu.links.job.ElasticJobLink"],
        "connection-types": [
            {
                "hook-class-name": "airflow_elastic_gpu.hooks.broker.GpuBrokerHook",
                "connection-type": "elastic_gpu",
            }
        ],
    }
