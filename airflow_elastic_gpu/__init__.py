"""airflow-elastic-gpu: share GPUs between concurrent DL trainings and resize them while they run."""

__version__ = "0.1.0"
