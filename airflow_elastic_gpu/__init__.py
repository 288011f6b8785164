"""airflow-elastic-gpu: share GPUs between concurrent DL trainings and resize them while they run."""

from airflow_elastic_gpu.get_provider_info import get_provider_info

__version__ = "0.1.0"

__all__ = ["__version__", "get_provider_info"]
