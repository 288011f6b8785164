"""The termination-based baseline: the adaptive policy's decisions, carried out by re-creating the job.

Source: Wang et al., SC20, section V (the "termination-based" scheduler their
sidecar is compared with): the same progress-driven decisions, but every
resize kills the job's pods and creates new ones, so it pays the cold-start
cost (pod scheduling, container start, framework and data initialisation)
instead of an in-place restart. The policy measures that larger overhead
and its hysteresis makes it resize less often.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy


@dataclass(frozen=True)
class TerminationPolicy(AdaptivePolicy):
    """:class:`AdaptivePolicy` whose resizes re-create the job (``resize_mechanism = "recreate"``)."""

    name: str = "termination"
    resize_mechanism: ClassVar[str] = "recreate"
