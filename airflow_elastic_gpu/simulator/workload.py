"""Cut a paper-scale workload from a raw production trace.

Source: the workload generator of the Pollux artifact (``petuum/adaptdl``,
branch ``osdi21-artifact``, ``simulator/workload.py``): take the jobs that
arrived in an H-hour window of the day, keep those that fit the cluster and
are not too large, sample them until their GPU-time reaches the wanted load,
and give each a model by its GPU-time.

The raw traces are multi-day and heavy-tailed (median tens of thousands of
seconds, up to 12 days) with demand far above 16 GPUs; a generated workload
has ``load x gpus x hours`` GPU-hours of work arriving over ``hours`` hours.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from airflow_elastic_gpu.simulator.profiles import ProfileSet, load_profiles
from airflow_elastic_gpu.simulator.trace import TraceJob

DAY_S = 86400.0
MAX_LOAD = 100.0
"""The highest offered load (a hundred times the cluster's GPU-time over the window)."""


class WorkloadError(ValueError):
    """Bad generator parameters, or a trace with no usable job; the message says which."""


def generate_workload(
    trace: Sequence[TraceJob],
    *,
    gpus: int = 16,
    hours: float = 8.0,
    load: float = 1.0,
    seed: int = 0,
    start_hour: float = 0.0,
    max_gpu_hours: float | None = None,
    profiles: ProfileSet | None = None,
) -> list[TraceJob]:
    """A workload of ``load * gpus * hours`` GPU-hours arriving over ``hours`` hours.

    :param trace: the raw trace (``submit_time_s`` from its start; the hour of day is
        ``submit_time_s mod 86400``).
    :param gpus: cluster size; jobs asking for more are dropped.
    :param hours: arrival window length, in (0, 24].
    :param load: offered GPU-time as a multiple of ``gpus * hours`` (> 0, at most :data:`MAX_LOAD`).
    :param seed: seeds the sampling and the model draw.
    :param start_hour: window start, hour of the trace's day, in [0, 24).
    :param max_gpu_hours: largest job kept, GPU-hours (default ``gpus * hours / 8``, 16 for 16 GPUs x 8 h).
    :param profiles: gives the model names (default: the bundled Pollux T4 set).
    :returns: jobs sorted by submit time, ids ``0..N-1``, each with a ``model``.
    :raises WorkloadError: a parameter out of range, or no trace job passes the filters.
    """
    if not (isinstance(gpus, int) and gpus >= 1):
        raise WorkloadError(f"gpus must be an integer >= 1, got {gpus!r}")
    if not 0 < hours <= 24:
        raise WorkloadError(f"hours must be in (0, 24], got {hours!r}")
    if not 0 < load <= MAX_LOAD:  # inf: the sampling never reached its budget
        raise WorkloadError(f"load must be > 0 and at most {MAX_LOAD:g}, got {load!r}")
    if not 0 <= start_hour < 24:
        raise WorkloadError(f"start_hour must be in [0, 24), got {start_hour!r}")
    cap_h = max_gpu_hours if max_gpu_hours is not None else gpus * hours / 8
    if not 0 < cap_h < float("inf"):
        raise WorkloadError(f"max_gpu_hours must be a finite number > 0, got {max_gpu_hours!r}")
    profiles = profiles or load_profiles()
    lo, hi = start_hour * 3600.0, start_hour * 3600.0 + hours * 3600.0

    def offset(j: TraceJob) -> float | None:
        t = j.submit_time_s % DAY_S
        if lo <= t < hi:
            return t - lo
        if hi > DAY_S and t < hi - DAY_S:  # a window that wraps past midnight
            return t + DAY_S - lo
        return None

    candidates = [
        (off, j)
        for j in trace
        if (off := offset(j)) is not None and j.num_gpus <= gpus and j.gpu_time_s <= cap_h * 3600.0
    ]
    if not candidates:
        raise WorkloadError(
            f"no job of the trace arrives in hours [{start_hour:g}, {start_hour + hours:g}) of the day, "
            f"fits {gpus} GPUs and is at most {cap_h:g} GPU-hours"
        )
    rng = random.Random(seed)
    budget = load * gpus * hours * 3600.0
    chosen: list[tuple[float, TraceJob]] = []
    total = 0.0
    pool: list[tuple[float, TraceJob]] = []
    while total < budget:
        if not pool:  # without replacement, refilled when exhausted
            pool = list(candidates)
            rng.shuffle(pool)
        off, j = pool.pop()
        chosen.append((off, j))
        total += j.gpu_time_s
    chosen.sort(key=lambda item: (item[0], item[1].job_id))
    out = []
    for i, (off, j) in enumerate(chosen):
        model = j.model or profiles.assign(None, j.gpu_time_s, rng).model
        out.append(replace(j, job_id=str(i), submit_time_s=round(off, 3), model=model))
    return out
