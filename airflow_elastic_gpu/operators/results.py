"""What a training task returns and tells its outlet assets, from the broker's view of its job."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from airflow_elastic_gpu.broker.types import JobView


def metrics(job: JobView) -> dict[str, Any]:
    """The XCom result: the trainer's metrics, then JCT, queueing delay and GPU-seconds (s), resizes,
    final step and exit code (these replace trainer metrics of the same name)."""
    extra = {k: v for k, v in (job.metrics or {}).items() if k not in ("final", "step")}
    # the broker's figures win: a trainer's metric named like one (e.g. job_id) does not replace it
    return {**extra, "job_id": job.id, "jct_s": job.jct_s, "queueing_delay_s": job.queueing_delay_s,
            "gpu_seconds": job.gpu_seconds, "num_resizes": job.num_resizes, "final_step": job.steps_done,
            "exit_code": job.exit_code}


def asset_metadata(job: JobView) -> dict[str, Any]:
    """The ``extra`` of the outlet assets' events: :func:`metrics` (the trainer's own, e.g.
    ``accuracy``, included) plus ``gpu_hours`` (GPU-seconds / 3600), the job's ``name``, ``pool``
    and ``checkpoint_dir``; JSON values only."""
    out = {k: v for k, v in metrics(job).items() if isinstance(v, (str, int, float, bool)) or v is None}
    return {**out, "gpu_hours": job.gpu_seconds / 3600.0, "name": job.name, "pool": job.pool,
            "checkpoint_dir": job.checkpoint_dir}


def annotate_outlets(assets: Sequence[Any], job: JobView, context: Any, log: logging.Logger,
                     metadata: Callable[[JobView], dict[str, Any]] = asset_metadata) -> None:
    """Put ``metadata(job)`` (the operator's :meth:`asset_metadata`, which a subclass may override)
    into the event of each of ``assets`` (the task's outlet assets; Airflow emits the events when
    the task succeeds); nothing without ``context["outlet_events"]``."""
    events = context.get("outlet_events") if hasattr(context, "get") else None
    for asset in assets if events is not None else ():
        extra = metadata(job)
        events[asset].extra.update(extra)
        log.info("asset %s: %s", asset.uri, extra)
