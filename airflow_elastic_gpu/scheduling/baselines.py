"""Kept for imports written against earlier releases: the static policy now lives in :mod:`.static`."""

from airflow_elastic_gpu.scheduling.static import StaticPolicy

__all__ = ["StaticPolicy"]
