"""Trace-driven simulation of a GPU pool under any scheduling policy.

The simulator runs the same policy objects as the broker (``scheduling/``)
against job traces and measured GPU scaling profiles; see
:func:`~airflow_elastic_gpu.simulator.engine.simulate`.
"""

from airflow_elastic_gpu.simulator.engine import ClusterShape, SimulationResult, simulate
from airflow_elastic_gpu.simulator.model import RecreateModel, RestartOverheads
from airflow_elastic_gpu.simulator.profiles import ProfileSet, load_profiles
from airflow_elastic_gpu.simulator.trace import TraceJob, load_trace, write_trace

__all__ = [
    "ClusterShape", "ProfileSet", "RecreateModel", "RestartOverheads", "SimulationResult", "TraceJob",
    "load_profiles", "load_trace", "simulate", "write_trace",
]
